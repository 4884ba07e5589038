"""The built-in demo's parent: a small NemotronH-shaped hybrid (Mamba-2, GQA attention, latent MoE) over bytes.

Sizes are a compromise for a 2-core CPU. Big enough that pruning trades something real: 16 routed experts
(top-4) of width 128 beside a shared expert, 4 Mamba heads of 64 channels, 8 query heads sharing 2 KV heads,
so expert counts, widths, top-k, heads and whole blocks can each be cut in several steps: 4,226,096
parameters, 2,653,232 active per token, most of the total in the experts, whose cost per token is only
top-k of them. Small enough that the parent trains in about two minutes (`puzzle.demo.parent`) and the
later stages (a library of ~5-10 variants per block trained for a few hundred steps, scoring, global
distillation) can fit the demo's 10 minutes. The quick size halves the width and drops three blocks
(640,228 parameters) for `puzzle demo --quick`. Mamba's chunk is 64: the plain-torch scan is fastest
there on a CPU at these sizes (of 32, 64, 128 and 256, measured on a shared machine).
"""

from __future__ import annotations

from puzzle.presets.nemotron import DT_MIN, from_pattern
from puzzle.spec import AttentionSpec, MambaSpec, ModelSpec, MoESpec

# The demo corpus's byte-level vocabulary (`puzzle.demo.corpus` tokenises with it): 256 bytes, BOS, EOS.
BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258

DEMO_PATTERN = "MEM*EMEM*E"  # Nemotron-3's rhythm: Mamba and MoE alternate, attention every few blocks
DEMO_QUICK_PATTERN = "MEM*EME"


def demo_spec(pattern: str, hidden_size: int, num_experts: int, top_k: int, num_heads: int) -> ModelSpec:
    """A demo-shaped hybrid of any size (`pattern` over M, E, *): what both presets and the tests use.

    `hidden_size` must be a multiple of 4 and of `num_heads`; Mamba has 4 heads of hidden / 4 channels, the
    experts and the latent space are hidden / 2 wide, the shared expert hidden wide, attention has 2 KV heads.
    """
    H = hidden_size
    mamba = MambaSpec(
        num_heads=4,
        head_dim=H // 4,
        state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=64,
        dt_clamp_min=DT_MIN,
    )
    attention = AttentionSpec(num_heads=num_heads, num_kv_heads=2, head_dim=H // num_heads)
    moe = MoESpec(
        num_experts=num_experts,
        top_k=top_k,
        expert_width=H // 2,
        shared_width=H,
        latent_size=H // 2,
        routed_scaling_factor=2.0,
    )
    return from_pattern(pattern, H, {"M": mamba, "*": attention, "E": moe}, vocab_size=VOCAB_SIZE)


def demo_parent_spec() -> ModelSpec:
    """The demo parent: hidden 256, pattern `MEM*EMEM*E`, 4,226,096 parameters (2,653,232 active)."""
    return demo_spec(DEMO_PATTERN, 256, num_experts=16, top_k=4, num_heads=8)


def demo_quick_parent_spec() -> ModelSpec:
    """The `--quick` demo parent: hidden 128, pattern `MEM*EME`, 8 experts top-2."""
    return demo_spec(DEMO_QUICK_PATTERN, 128, num_experts=8, top_k=2, num_heads=4)
