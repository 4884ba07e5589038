"""Deprecated alias of `puzzle.nemotron_h`, kept so `from puzzle import hf` / `puzzle.hf.load` still work.

Use `puzzle.load`, `puzzle.nemotron_h` (config <-> spec, `load`, `save_pretrained`) or its modules
`puzzle.nemotron_h.config`, `.weights` and `.checkpoint`. This module will be removed.
"""

import warnings

from puzzle.nemotron_h.checkpoint import is_checkpoint_file, load, save_pretrained
from puzzle.nemotron_h.config import (
    CONFIG_ALIASES,
    CONFIG_NAME,
    DEFAULTS,
    SUPPORTED_MODEL_TYPES,
    CheckpointError,
    block_config_fields,
    block_kinds,
    config_from_spec,
    normalize_config,
    read_config,
    read_config_file,
    spec_from_config,
    transformers_incompatibilities,
)
from puzzle.nemotron_h.weights import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    SINGLE_FILE,
    LazyTensor,
    hub_state,
    weight_files,
)

warnings.warn(
    "puzzle.hf is deprecated: use puzzle.nemotron_h (or puzzle.load / HybridLM.save_pretrained)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "CONFIG_ALIASES",
    "CONFIG_NAME",
    "DEFAULTS",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "SUPPORTED_MODEL_TYPES",
    "CheckpointError",
    "LazyTensor",
    "block_config_fields",
    "block_kinds",
    "config_from_spec",
    "hub_state",
    "is_checkpoint_file",
    "load",
    "normalize_config",
    "read_config",
    "read_config_file",
    "save_pretrained",
    "spec_from_config",
    "transformers_incompatibilities",
    "weight_files",
]
