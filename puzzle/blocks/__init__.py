"""Mixer modules, one per block kind, built from their specs through a registry keyed by spec type.

The names below load on first use (PEP 562), so that `puzzle.blocks.tensors` (the tensor lists the
cost model reads) can be imported without importing torch: `puzzle search --library` and the cost
model's imports stay torch-free.
"""

from __future__ import annotations

from puzzle._lazy import lazy_attributes as _lazy_attributes

_LAZY: dict[str, str] = {
    "BLOCK_TYPES": "puzzle.blocks.registry",
    "build_block": "puzzle.blocks.registry",
    "AttentionMixer": "puzzle.blocks.attention",
    "KVCache": "puzzle.blocks.attention",
    "LinearMixer": "puzzle.blocks.mlp",
    "MLPMixer": "puzzle.blocks.mlp",
    "MambaMixer": "puzzle.blocks.mamba",
    "MoEMixer": "puzzle.blocks.moe",
    "NoOpMixer": "puzzle.blocks.mlp",
}


__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY)  # and submodules, e.g. `tensors`


__all__ = sorted(_LAZY)
