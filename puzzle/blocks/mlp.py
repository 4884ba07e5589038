"""The small stateless mixers: a dense MLP, a single hidden x hidden Linear, and the no-op of a removed block."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from puzzle.blocks.tensors import TensorInfo, linear_tensors
from puzzle.spec import LinearSpec, MLPSpec, NoOpSpec


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, the activation of Nemotron-H MLPs and experts."""
    return torch.square(F.relu(x))


# Keys are `MLPSpec.ACTIVATIONS`; "gelu" is the exact (erf) GELU, as transformers' ACT2FN["gelu"].
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu2": relu2,
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
}


class _Stateless(nn.Module):
    """Cache protocol of a mixer with no state across tokens: no cache, one-token step = forward."""

    def init_cache(
        self, batch_size: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """None: nothing is kept across tokens."""
        return None

    def step(self, x: torch.Tensor, cache: None = None) -> torch.Tensor:
        """x: [b, 1, H] -> [b, 1, H]."""
        return self.forward(x, cache)


class MLPMixer(_Stateless):
    """Non-gated MLP `down(act(up(x)))`: up_proj [I, H], down_proj [H, I].

    `norm_eps` is unused; every mixer accepts it so that `build_block` treats them alike.
    """

    def __init__(self, spec: MLPSpec, hidden_size: int, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.spec = spec
        self.up_proj = nn.Linear(hidden_size, spec.width, bias=spec.bias)
        self.down_proj = nn.Linear(spec.width, hidden_size, bias=spec.bias)
        self.act_fn = ACTIVATIONS[spec.activation]

    @staticmethod
    def hub_tensors(spec: MLPSpec, hidden_size: int) -> list[TensorInfo]:
        """The tensors this mixer stores (names as in NemotronH checkpoints, relative to the mixer), in order."""
        return linear_tensors("up_proj", spec.width, hidden_size, "mlp", spec.bias) + linear_tensors(
            "down_proj", hidden_size, spec.width, "mlp", spec.bias
        )

    def forward(self, x: torch.Tensor, cache: None = None) -> torch.Tensor:
        """x: [b, t, H] -> [b, t, H]."""
        return self.down_proj(self.act_fn(self.up_proj(x)))


class LinearMixer(_Stateless):
    """One hidden x hidden matrix (`linear.weight` [H, H]) standing in for a block's mixer."""

    def __init__(self, spec: LinearSpec, hidden_size: int, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.spec = spec
        self.linear = nn.Linear(hidden_size, hidden_size, bias=spec.bias)

    @staticmethod
    def hub_tensors(spec: LinearSpec, hidden_size: int) -> list[TensorInfo]:
        """The tensors this mixer stores: `linear.weight` [H, H] (+ `linear.bias` [H])."""
        return linear_tensors("linear", hidden_size, hidden_size, "linear", spec.bias)

    def forward(self, x: torch.Tensor, cache: None = None) -> torch.Tensor:
        """x: [b, t, H] -> [b, t, H]."""
        return self.linear(x)


class NoOpMixer(_Stateless):
    """A removed block: no parameters, adds zero to the residual stream."""

    def __init__(self, spec: NoOpSpec, hidden_size: int, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.spec = spec

    @staticmethod
    def hub_tensors(spec: NoOpSpec, hidden_size: int) -> list[TensorInfo]:
        """None: a removed block stores nothing."""
        return []

    def forward(self, x: torch.Tensor, cache: None = None) -> torch.Tensor:
        """x: [b, t, H] -> zeros [b, t, H] (same dtype and device)."""
        return torch.zeros_like(x)
