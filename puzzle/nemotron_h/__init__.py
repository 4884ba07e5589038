"""NemotronH checkpoints (NVIDIA / transformers `nemotron_h`, Puzzle `nemotron_h_puzzle`) in and out.

- `config`: config.json <-> ModelSpec, one field table per block kind read in both directions (no torch);
- `weights`: safetensors in and out: hub tensor names, fused experts, shards, lazy tensors;
- `checkpoint`: `load` (directory -> HybridLM) and `save_pretrained` (HybridLM -> directory, atomic).
- `sharded`: `load(..., shard=True)`: the model sharded with FSDP2, each rank reading only its rows.

The config names import eagerly (they need no torch, e.g. for `puzzle costs`); `load`,
`save_pretrained` and the weights names load torch and the model on first use.
"""

from puzzle._lazy import lazy_attributes as _lazy_attributes
from puzzle.nemotron_h.config import (
    CONFIG_NAME,
    SUPPORTED_MODEL_TYPES,
    CheckpointError,
    block_config_fields,
    block_kinds,
    config_from_spec,
    mtp_block_specs,
    normalize_config,
    read_config,
    read_config_file,
    spec_from_config,
    transformers_incompatibilities,
)
from puzzle.nemotron_h.engines import ENGINES, EngineProblem, engine_problems, engine_support

_LAZY = {
    "load": "puzzle.nemotron_h.checkpoint",
    "save_pretrained": "puzzle.nemotron_h.checkpoint",
    "is_checkpoint_file": "puzzle.nemotron_h.checkpoint",
    "stored_spec": "puzzle.nemotron_h.checkpoint",
    "LazyTensor": "puzzle.nemotron_h.weights",
    "hub_state": "puzzle.nemotron_h.weights",
    "weight_files": "puzzle.nemotron_h.weights",
    "DEFAULT_MAX_SHARD_BYTES": "puzzle.nemotron_h.weights",
    "INDEX_FILE": "puzzle.nemotron_h.weights",
    "SINGLE_FILE": "puzzle.nemotron_h.weights",
}


__getattr__, __dir__ = _lazy_attributes(__name__, _LAZY)  # and submodules, e.g. `remote`


__all__ = [
    "CONFIG_NAME",
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
    "stored_spec",
    "transformers_incompatibilities",
    "weight_files",
    "ENGINES",
    "EngineProblem",
    "engine_problems",
    "engine_support",
    "mtp_block_specs",
]
