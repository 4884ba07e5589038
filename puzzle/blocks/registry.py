"""The registry of mixer modules keyed by spec type, and `build_block`, which builds a mixer from its spec."""

from __future__ import annotations

from functools import lru_cache

from torch import nn

from puzzle.blocks import formats
from puzzle.blocks.attention import AttentionMixer, KVCache
from puzzle.blocks.mamba import MambaMixer
from puzzle.blocks.mlp import LinearMixer, MLPMixer, NoOpMixer
from puzzle.blocks.moe import MoEMixer
from puzzle.blocks.tensors import TensorInfo
from puzzle.spec import (
    AttentionSpec,
    BlockSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    MoESpec,
    NoOpSpec,
    kind_entry,
)

# Spec type -> mixer class; every mixer is built as `cls(spec, hidden_size, norm_eps)`.
BLOCK_TYPES: dict[type, type[nn.Module]] = {
    MambaSpec: MambaMixer,
    AttentionSpec: AttentionMixer,
    MoESpec: MoEMixer,
    MLPSpec: MLPMixer,
    LinearSpec: LinearMixer,
    NoOpSpec: NoOpMixer,
}


def build_block(spec: BlockSpec, hidden_size: int, norm_eps: float = 1e-5) -> nn.Module:
    """The mixer for `spec` (without the block's pre-norm and residual, which live in the model).

    Builds on whatever device is current, `torch.device("meta")` included. A spec with a weight format
    other than bf16 gets a mixer whose calls fake-quantize its matmul weights (`puzzle.blocks.formats`).
    """
    mixer_cls = kind_entry(BLOCK_TYPES, spec, "no mixer for a")
    # A quantized spec's mixer runs its covered weights fake-quantized (puzzle.blocks.formats).
    return formats.install(mixer_cls(spec, hidden_size, norm_eps))


@lru_cache(maxsize=4096)
def mixer_tensors(spec: BlockSpec, hidden_size: int) -> tuple[TensorInfo, ...]:
    """Every tensor the mixer of `spec` stores (names relative to the mixer), from its class's `hub_tensors`:
    the one list the cost model, the weight formats and the export read. Cached per (spec, hidden size)."""
    return tuple(kind_entry(BLOCK_TYPES, spec, "no mixer for a").hub_tensors(spec, hidden_size))


__all__ = [
    "BLOCK_TYPES",
    "AttentionMixer",
    "KVCache",
    "LinearMixer",
    "MLPMixer",
    "MambaMixer",
    "MoEMixer",
    "NoOpMixer",
    "build_block",
    "mixer_tensors",
]
