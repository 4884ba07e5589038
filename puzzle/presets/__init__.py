"""Named architectures (NVIDIA's hybrid parents, the seed's Puzzle-75B-A9B-like child, a tiny demo parent) and search spaces."""

from __future__ import annotations

from collections.abc import Callable

from puzzle.presets.demo import demo_parent_spec, demo_quick_parent_spec
from puzzle.presets.nemotron import (
    nemotron3_nano,
    nemotron3_super,
    nemotron3_super_space,
    nemotron_h_8b,
    nemotron_nano_9b_v2,
    puzzle_75b_a9b_like,
)
from puzzle.presets.tiny import tiny_hybrid
from puzzle.space import SearchSpace
from puzzle.spec import ModelSpec, SpecError

PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "nemotron3-super": nemotron3_super,
    "nemotron3-nano": nemotron3_nano,
    "nemotron-h-8b": nemotron_h_8b,
    "nemotron-nano-9b-v2": nemotron_nano_9b_v2,
    "puzzle-75b-a9b-like": puzzle_75b_a9b_like,
    "tiny-hybrid": tiny_hybrid,
    "demo": demo_parent_spec,
    "demo-quick": demo_quick_parent_spec,
}


def get_preset(name: str) -> ModelSpec:
    """The ModelSpec of a named preset (underscores and case are ignored: "nemotron3_super" works)."""
    key = name.strip().lower().replace("_", "-")
    if key not in PRESETS:
        raise SpecError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[key]()


SPACE_PRESETS: dict[str, Callable[[], SearchSpace]] = {
    "nemotron3-super": nemotron3_super_space,
}


def get_space_preset(name: str) -> SearchSpace:
    """The SearchSpace of a named preset, named like its parent ("nemotron3-super"); case and _ ignored."""
    key = name.strip().lower().replace("_", "-")
    if key not in SPACE_PRESETS:
        raise SpecError(f"unknown search space preset {name!r}; choose one of {sorted(SPACE_PRESETS)}")
    return SPACE_PRESETS[key]()


__all__ = [
    "PRESETS",
    "SPACE_PRESETS",
    "get_preset",
    "get_space_preset",
    "nemotron3_nano",
    "nemotron3_super",
    "nemotron3_super_space",
    "nemotron_h_8b",
    "nemotron_nano_9b_v2",
    "puzzle_75b_a9b_like",
    "tiny_hybrid",
    "demo_parent_spec",
    "demo_quick_parent_spec",
]
