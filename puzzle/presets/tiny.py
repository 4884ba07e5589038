"""A tiny hybrid parent with every block kind, for tests, demos and CPU benchmarks."""

from __future__ import annotations

from puzzle.spec import AttentionSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, SpecError


def tiny_hybrid(hidden_size: int = 64, vocab_size: int = 256) -> ModelSpec:
    """Pattern `M*EM-E`: Mamba-2 (state 16), GQA attention, latent MoE with a shared expert, dense MLP.

    Widths scale with `hidden_size`, which must be a multiple of 32 (H / 16 Mamba heads in 2 groups).
    """
    if (
        isinstance(hidden_size, bool)
        or not isinstance(hidden_size, int)
        or hidden_size % 32
        or hidden_size <= 0
    ):
        raise SpecError(f"tiny_hybrid: hidden_size must be a positive multiple of 32, found {hidden_size!r}")
    H = hidden_size
    mamba = MambaSpec(num_heads=H // 16, head_dim=32, state_size=16, n_groups=2, conv_kernel=4, chunk_size=32)
    attention = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=H // 4)
    moe = MoESpec(
        num_experts=8,
        top_k=2,
        expert_width=H,
        shared_width=2 * H,
        latent_size=H // 2,
        routed_scaling_factor=2.0,
    )
    mlp = MLPSpec(width=4 * H)
    return ModelSpec(vocab_size=vocab_size, hidden_size=H, blocks=(mamba, attention, moe, mamba, mlp, moe))
