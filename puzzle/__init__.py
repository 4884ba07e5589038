"""puzzle: compress hybrid Mamba / attention / MoE language models by decomposed NAS (the Puzzle method)."""

from puzzle._lazy import lazy_attributes as _lazy_attributes

__version__ = "0.1.0"

# Exports that import torch load on first use, so `import puzzle` (the CLI, spec and cost code) stays light.
_LAZY_EXPORTS = {
    "load": "puzzle.nemotron_h.checkpoint",
    "CheckpointError": "puzzle.nemotron_h.config",
    "HybridLM": "puzzle.model",
    "Budget": "puzzle.search.budget",
    "deployment_problem": "puzzle.search.budget",
    "choices_to_spec": "puzzle.search.budget",
    "Relative": "puzzle.cost.limits",
    "Scenario": "puzzle.cost",
    "get_preset": "puzzle.presets",
    "SearchSpace": "puzzle.space",
    "SpaceError": "puzzle.space",
    "importance_for": "puzzle.prune",
    "init_child": "puzzle.prune",
    "ConfigError": "puzzle.config",
    "RunConfig": "puzzle.config",
    "load_config": "puzzle.config",
    "Run": "puzzle.run",
}
# The spec types load on first use too: `puzzle search --library` needs none (~30 ms of its < 0.5 s).
_LAZY_EXPORTS.update(
    dict.fromkeys(
        (
            "AttentionSpec",
            "BlockSpec",
            "LinearSpec",
            "MambaSpec",
            "MLPSpec",
            "ModelSpec",
            "MoESpec",
            "NoOpSpec",
            "SpecError",
            "Variant",
        ),
        "puzzle.spec",
    )
)


# Subpackages and modules load on first use too: `puzzle.presets.get_space_preset(...)` after `import puzzle`.
__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY_EXPORTS)


__all__ = [
    "AttentionSpec",
    "BlockSpec",
    "Budget",
    "CheckpointError",
    "HybridLM",
    "LinearSpec",
    "MLPSpec",
    "MambaSpec",
    "ModelSpec",
    "MoESpec",
    "NoOpSpec",
    "Relative",
    "Scenario",
    "SearchSpace",
    "SpaceError",
    "SpecError",
    "Variant",
    "__version__",
    "choices_to_spec",
    "get_preset",
    "importance_for",
    "init_child",
    "load",
    "deployment_problem",
    "ConfigError",
    "RunConfig",
    "load_config",
    "Run",
]
