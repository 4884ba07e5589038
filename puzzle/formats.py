"""The facts of a served weight format, in one place: the format names, NVFP4's block, which tensor roles a
block's weight format covers and which keep their dtype, and the weights served under one NVFP4 scale.

The numerics (`puzzle.quant`), the specs' `weight_format` axis (`puzzle.spec`), the costs
(`puzzle.cost.formats`), the fake-quantized mixers (`puzzle.blocks.formats`) and the export
(`puzzle.quant_blocks`, `puzzle.nemotron_h.quantized`) all read them here. Imports nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

# Storage formats a block's matmul weights can take (the weight_format axis). "bf16" is the parent's: the
# default, written nowhere (ids, JSON).
WEIGHT_FORMATS: tuple[str, ...] = ("bf16", "fp8", "nvfp4")
DEFAULT_WEIGHT_FORMAT = "bf16"
NVFP4_BLOCK = 16  # values sharing one E4M3 scale, along the input dimension

# Every tensor role a mixer's tensor list names (`puzzle.blocks.tensors.TensorInfo.role`), and whether a
# block's weight format (fp8 / nvfp4) covers it: True for its matmul weights; False for what keeps the
# recipe's dtype, as serving recipes keep them (vLLM builds the router and conv1d without a quantization
# config). A new role states which here, or it is no role: ROLES is this table's keys.
ROLE_QUANTIZED: dict[str, bool] = {
    "embedding": False,  # embeddings.weight [V, H]
    "lm_head": False,  # lm_head.weight [V, H]
    "norm": False,  # every RMSNorm weight (block pre-norms, Mamba's gated norm, norm_f)
    "bias": False,  # 1-D biases of linear layers
    "mamba_proj": True,  # Mamba in_proj / out_proj
    "mamba_conv": False,  # Mamba depthwise conv1d weight and bias
    "mamba_ssm": False,  # Mamba dt_bias, A_log, D
    "attention_proj": True,  # q/k/v/o projections
    "router": False,  # MoE gate.weight [E, H]
    "router_bias": False,  # MoE gate.e_score_correction_bias [E], an fp32 buffer
    "routed_expert": True,  # experts.{j}.up_proj / down_proj
    "shared_expert": True,  # shared_experts.up_proj / down_proj
    "latent_proj": True,  # fc1_latent_proj / fc2_latent_proj
    "mlp": True,  # dense MLP up_proj / down_proj
    "linear": True,  # the single matrix of a LinearSpec block
}
ROLES: tuple[str, ...] = tuple(ROLE_QUANTIZED)
QUANTIZED_ROLES: frozenset[str] = frozenset(role for role, covered in ROLE_QUANTIZED.items() if covered)
KEEP_DTYPE_ROLES: tuple[str, ...] = tuple(role for role, covered in ROLE_QUANTIZED.items() if not covered)

# Mixer-relative weights a server runs as one fused matmul that takes one NVFP4 global scale (vLLM's
# qkv_proj): the export writes them with one scale, and the fake-quantized mixer computes them so.
NVFP4_SHARED_SCALE: tuple[tuple[str, ...], ...] = (("q_proj.weight", "k_proj.weight", "v_proj.weight"),)


def shared_scale_groups(names: Iterable[str]) -> list[tuple[str, ...]]:
    """`names` split into the groups that share one NVFP4 global scale: q/k/v together, every other alone."""
    names = list(names)
    groups: list[tuple[str, ...]] = []
    grouped: set[str] = set()
    for group in NVFP4_SHARED_SCALE:
        present = tuple(name for name in group if name in names)
        if present:
            groups.append(present)
            grouped.update(present)
    return groups + [(name,) for name in names if name not in grouped]
