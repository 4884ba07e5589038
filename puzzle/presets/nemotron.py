"""NVIDIA Nemotron-H / Nemotron-3 architectures as ModelSpecs (numbers from their published config.json files).

Also the Puzzle-75B-A9B-like child of Nemotron-3-Super used to reproduce the seed's published claims.
"""

from __future__ import annotations

import dataclasses

from puzzle.space import SearchSpace
from puzzle.spec import AttentionSpec, BlockSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, SpecError

NEMOTRON_VOCAB = 131072

SUPER_PATTERN = "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NANO_9B_V2_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"
# Every published config.json has time_step_min 0.001, which transformers applies as the lower clamp of
# dt after softplus (time_step_limit = (time_step_min, inf)).
DT_MIN = 0.001


def nemotron_mamba(num_heads: int, head_dim: int) -> MambaSpec:
    """A Mamba-2 mixer as every NVIDIA Nemotron-H / Nemotron-3 config has it: state 128, 8 groups, conv 4."""
    return MambaSpec(
        num_heads=num_heads,
        head_dim=head_dim,
        state_size=128,
        n_groups=8,
        conv_kernel=4,
        chunk_size=128,
        dt_clamp_min=DT_MIN,
    )


def from_pattern(
    pattern: str, hidden_size: int, by_char: dict[str, BlockSpec], vocab_size: int = NEMOTRON_VOCAB
) -> ModelSpec:
    """A ModelSpec from NVIDIA's `hybrid_override_pattern` string and one spec per pattern character."""
    unknown = sorted(set(pattern) - set(by_char))
    if unknown:
        raise SpecError(f"pattern characters {unknown} have no block spec; given: {sorted(by_char)}")
    return ModelSpec(
        vocab_size=vocab_size, hidden_size=hidden_size, blocks=tuple(by_char[c] for c in pattern)
    )


def nemotron3_super() -> ModelSpec:
    """Nemotron-3-Super-120B-A12B backbone (MTP module excluded): 120,668,687,360 params, 12,770,216,960 active."""
    return from_pattern(
        SUPER_PATTERN,
        4096,
        {
            "M": nemotron_mamba(128, 64),
            "*": AttentionSpec(num_heads=32, num_kv_heads=2, head_dim=128),
            "E": MoESpec(
                num_experts=512,
                top_k=22,
                expert_width=2688,
                shared_width=5376,
                latent_size=1024,
                routed_scaling_factor=5.0,
            ),
        },
    )


def nemotron3_nano() -> ModelSpec:
    """Nemotron-3-Nano-30B-A3B: 31,577,937,344 params, 3,580,073,408 active."""
    return from_pattern(
        NANO_PATTERN,
        2688,
        {
            "M": nemotron_mamba(64, 64),
            "*": AttentionSpec(num_heads=32, num_kv_heads=2, head_dim=128),
            "E": MoESpec(
                num_experts=128, top_k=6, expert_width=1856, shared_width=3712, routed_scaling_factor=2.5
            ),
        },
    )


def nemotron_h_8b() -> ModelSpec:
    """Nemotron-H-8B (dense relu^2 MLPs): 8,100,852,736 params."""
    return from_pattern(
        H_8B_PATTERN,
        4096,
        {
            "M": nemotron_mamba(128, 64),
            "*": AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128),
            "-": MLPSpec(width=21504),
        },
    )


def nemotron_nano_9b_v2() -> ModelSpec:
    """NVIDIA-Nemotron-Nano-9B-v2: 8,888,227,328 params."""
    return from_pattern(
        NANO_9B_V2_PATTERN,
        4480,
        {
            "M": nemotron_mamba(128, 80),
            "*": AttentionSpec(num_heads=40, num_kv_heads=8, head_dim=128),
            "-": MLPSpec(width=15680),
        },
    )


# Per-MoE-block (width, top_k) of the Puzzle-75B-A9B-like child, in block order. NVIDIA's per-block
# choice is not in our reference; this one is illustrative, with the published summary statistics:
# 5 distinct widths in [1280, 2688] summing to 64,384 (mean 1,609.6 = 59.9% of 2688), 7 distinct
# top-k values in [4, 18], sum of top_k x width 712,960. The largest variants sit at both ends of the
# stack. Totals depend only on the two sums.
PUZZLE_75B_MOE = (
    *[(2688, 18)] * 2, (2048, 14), *[(1792, 12)] * 4, *[(1536, 10)] * 5, *[(1280, 8)] * 7,
    (1280, 6), (1280, 4),
    *[(1280, 8)] * 7, *[(1536, 10)] * 5, *[(1792, 12)] * 4, *[(2048, 14)] * 2, (2688, 18),
)  # fmt: skip
PUZZLE_75B_STATE_SIZE = 96


def puzzle_75b_a9b_like() -> ModelSpec:
    """Nemotron-3-Super with ssm_state_size 96 in every Mamba block and per-block MoE widths / top-k.

    Everything else (512 experts, latent 1024, shared expert 5376, attention, embeddings) unchanged.
    """
    parent = nemotron3_super()
    moe_choices = iter(PUZZLE_75B_MOE)
    blocks: list[BlockSpec] = []
    for block in parent.blocks:
        if isinstance(block, MambaSpec):
            block = dataclasses.replace(block, state_size=PUZZLE_75B_STATE_SIZE)
        elif isinstance(block, MoESpec):
            width, top_k = next(moe_choices)
            block = dataclasses.replace(block, expert_width=width, top_k=top_k)
        blocks.append(block)
    if next(moe_choices, None) is not None:
        raise SpecError("PUZZLE_75B_MOE has more entries than Nemotron-3-Super has MoE blocks")
    return ModelSpec(
        vocab_size=parent.vocab_size,
        hidden_size=parent.hidden_size,
        blocks=tuple(blocks),
        norm_eps=parent.norm_eps,
    )


# The seed's search on Nemotron-3-Super: one of three SSM state sizes per Mamba block; per MoE block a
# width from 1280 to 2688 in steps of 128 (12 values) and an even top-k from 4 to 22 (10 values), taken
# together; attention untouched. The Puzzle-75B-A9B-like child's choices all lie in it.
SUPER_SEARCH_SPACE = {
    "rounding": 128,
    "kinds": {
        "mamba": {"state_size": [128, 96, 64]},
        "moe": {
            "expert_width": {"min": 1280, "max": 2688, "step": 128},
            "top_k": {"min": 4, "max": 22, "step": 2},
            "mode": "coupled",
        },
    },
}


def nemotron3_super_space() -> SearchSpace:
    """The seed's search space on Nemotron-3-Super: 3 Mamba, 120 MoE, 1 attention variant(s) per block."""
    return SearchSpace.from_dict(SUPER_SEARCH_SPACE)
