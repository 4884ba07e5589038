"""The tensors a mixer stores, as data: names, shapes and roles, listed by each mixer from its spec.

Each mixer class has a `hub_tensors(spec, hidden_size)` static method beside its `__init__`, the one
list of its tensors that the cost model (`puzzle.cost`) and checkpoint code read instead of keeping a
second table of sizes. Names are relative to the mixer and are the NemotronH hub names without the
`backbone.layers.{i}.mixer.` prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Roles decide a tensor's storage format under a quantisation recipe (puzzle.cost.formats); the table of
# roles, and which a block's weight format covers, is puzzle.formats (named here for the tensor lists).
from puzzle.formats import QUANTIZED_ROLES, ROLE_QUANTIZED, ROLES  # noqa: F401


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

    def __post_init__(self) -> None:
        # A role outside the table would be priced by no rule (or silently as a matmul weight): refuse it.
        if self.role not in ROLE_QUANTIZED:
            raise ValueError(
                f"tensor {self.name!r} has role {self.role!r}, which puzzle.formats.ROLE_QUANTIZED does not "
                f"list; roles: {', '.join(ROLES)}"
            )

    @property
    def covered(self) -> bool:
        """Whether a block's weight format (fp8 / nvfp4) covers this tensor: a 2-D weight of a matmul role
        (`puzzle.formats.ROLE_QUANTIZED`). Every other tensor keeps its dtype."""
        return ROLE_QUANTIZED[self.role] and len(self.shape) == 2

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
