"""The tensors a mixer stores, as data: names, shapes and roles, listed by each mixer from its spec.

Each mixer class has a `hub_tensors(spec, hidden_size)` static method beside its `__init__`, the one
list of its tensors that the cost model (`puzzle.cost`) and checkpoint code read instead of keeping a
second table of sizes. Names are relative to the mixer and are the NemotronH hub names without the
`backbone.layers.{i}.mixer.` prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Roles decide a tensor's storage format under a quantisation recipe (puzzle.cost.formats).
ROLES: tuple[str, ...] = (
    "embedding",  # embeddings.weight [V, H]
    "lm_head",  # lm_head.weight [V, H]
    "norm",  # every RMSNorm weight (block pre-norms, Mamba's gated norm, norm_f)
    "bias",  # 1-D biases of linear layers
    "mamba_proj",  # Mamba in_proj / out_proj
    "mamba_conv",  # Mamba depthwise conv1d weight and bias
    "mamba_ssm",  # Mamba dt_bias, A_log, D
    "attention_proj",  # q/k/v/o projections
    "router",  # MoE gate.weight [E, H]
    "router_bias",  # MoE gate.e_score_correction_bias [E], an fp32 buffer
    "routed_expert",  # experts.{j}.up_proj / down_proj
    "shared_expert",  # shared_experts.up_proj / down_proj
    "latent_proj",  # fc1_latent_proj / fc2_latent_proj
    "mlp",  # dense MLP up_proj / down_proj
    "linear",  # the single matrix of a LinearSpec block
)

# The roles a block's `weight_format` (fp8 / nvfp4) covers: its mixer's matmul weights. Norms, biases, the
# router, conv and SSM parameters stay in the recipe's format (bf16 / fp32), as serving recipes keep them.
QUANTIZED_ROLES: frozenset[str] = frozenset(
    ("mamba_proj", "attention_proj", "routed_expert", "shared_expert", "latent_proj", "mlp", "linear")
)


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: `name` relative to its owner (e.g. "in_proj.weight"), shape [out, in, ...].

    `is_parameter` is False for buffers that are saved but not trained (the MoE router's correction
    bias); `expert` is the index of the routed expert the tensor belongs to (None: every token uses it),
    which is what active-parameter counts and the bytes an MoE step reads are computed from.
    """

    name: str
    shape: tuple[int, ...]
    role: str
    is_parameter: bool = True
    expert: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def prefixed(self, prefix: str) -> TensorInfo:
        """The same tensor named `prefix + name` (e.g. "mixer." or "layers.3.")."""
        return TensorInfo(prefix + self.name, self.shape, self.role, self.is_parameter, self.expert)


def linear_tensors(
    name: str,
    out_features: int,
    in_features: int,
    role: str,
    bias: bool = False,
    expert: int | None = None,
) -> list[TensorInfo]:
    """The tensors of an `nn.Linear(in_features, out_features, bias)` called `name`: weight [out, in] (+ bias [out])."""
    tensors = [TensorInfo(f"{name}.weight", (out_features, in_features), role, expert=expert)]
    if bias:
        tensors.append(TensorInfo(f"{name}.bias", (out_features,), "bias", expert=expert))
    return tensors
