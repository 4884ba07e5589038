"""puzzle: compress hybrid Mamba / attention / MoE language models by decomposed NAS (the Puzzle method)."""

from puzzle.spec import (
    AttentionSpec,
    BlockSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
    SpecError,
    Variant,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionSpec",
    "BlockSpec",
    "LinearSpec",
    "MLPSpec",
    "MambaSpec",
    "ModelSpec",
    "MoESpec",
    "NoOpSpec",
    "SpecError",
    "Variant",
    "__version__",
]
