"""NemotronH checkpoints in and out: config.json <-> ModelSpec, safetensors <-> HybridLM.

Reading accepts what NVIDIA and transformers write: `model_type` nemotron_h (one shape per block
kind, `hybrid_override_pattern` or `layers_block_type`, old field aliases) and nemotron_h_puzzle
(per-block `block_configs` whose fields override the global ones; a null field in an entry
inherits the global, as in vLLM; `num_hidden_layers` may be null; MTP fields such as
`mtp_block_configs` are carried, not parsed); weights under `backbone.` or
`model.`, per-expert or fused 3-D expert tensors, `embeddings` or `embedding`. Tensors are read
lazily from memory-mapped safetensors, one at a time, into a model built on the meta device.

Writing produces the hub layout (`backbone.` prefix, per-expert keys) with model_type nemotron_h
when transformers' NemotronHForCausalLM can represent the model, else nemotron_h_puzzle.

Our extensions of the nemotron_h_puzzle schema (read and written here, unknown to other tools):
- `{"block_type": "linear"}`: the mixer is one [H, H] matrix `backbone.layers.{i}.mixer.linear.weight`
  (`"linear_bias": true` adds `mixer.linear.bias`); pattern character `L`.
- `{"block_type": "noop"}`: a removed block, no tensors besides its (unused) `norm.weight`; pattern `N`.
- `moe_intermediate_size` may be a list with one width per routed expert.
- `mamba_dt_clamp_max`: an upper clamp of dt after softplus (absent or null = none).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from puzzle.files import (
    OWNER_MARKER,
    default_mode,
    make_staging_dir,
    remove_stale_staging,
    swap_directory_into_place,
)
from puzzle.model import HybridLM
from puzzle.progress import progress
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
)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as (or written as) a NemotronH model."""


SUPPORTED_MODEL_TYPES = ("nemotron_h", "nemotron_h_puzzle")
CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

# Old field name -> current name (transformers' NemotronHConfig.__post_init__); the old one wins if present.
CONFIG_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "num_local_experts": "n_routed_experts",
    "layer_types": "layers_block_type",
}

# transformers' NemotronHConfig defaults, so that a missing field means to us what it means to transformers.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072,
    "hidden_size": 4096,
    "tie_word_embeddings": False,
    "layer_norm_epsilon": 1e-5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": False,
    "intermediate_size": 21504,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "ssm_state_size": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
    "time_step_min": 0.001,
    "use_conv_bias": True,
    "chunk_size": 128,
    "use_bias": False,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 7688,
    "moe_shared_expert_intermediate_size": 7688,
    "moe_latent_size": None,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "mamba_dt_clamp_max": None,
    "linear_bias": False,
}

# Every name a block kind goes by: layers_block_type (old and new), block_configs' block_type, pattern char.
_KIND_NAMES = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "M": "mamba",
    "attention": "attention",
    "full_attention": "attention",
    "*": "attention",
    "moe": "moe",
    "E": "moe",
    "mlp": "mlp",
    "-": "mlp",
    "linear": "linear",
    "L": "linear",
    "noop": "noop",
    "N": "noop",
}
# transformers >= 5.2x spells the mixer kinds this way in layers_block_type.
_TRANSFORMERS_NAMES = {"mamba": "linear_attention", "attention": "full_attention", "moe": "moe", "mlp": "mlp"}

# Config fields that describe one block of each kind (what a block_configs entry may override).
_KIND_FIELDS = {
    "mamba": (
        "mamba_num_heads",
        "mamba_head_dim",
        "ssm_state_size",
        "n_groups",
        "conv_kernel",
        "chunk_size",
        "use_conv_bias",
        "use_bias",
        "time_step_min",
        "mamba_dt_clamp_max",
    ),
    "attention": ("num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias"),
    "moe": (
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "n_shared_experts",
        "moe_latent_size",
        "routed_scaling_factor",
        "norm_topk_prob",
        "n_group",
        "topk_group",
        "mlp_hidden_act",
        "mlp_bias",
    ),
    "mlp": ("intermediate_size", "mlp_hidden_act", "mlp_bias"),
    "linear": ("linear_bias",),
    "noop": (),
}

# Keys a saved config.json gets from the spec; anything else is carried over from the loaded config.
_OWNED_KEYS = (
    set(CONFIG_ALIASES)
    | {field for fields in _KIND_FIELDS.values() for field in fields}
    | {
        "model_type",
        "architectures",
        "auto_map",
        "layers_block_type",
        "hybrid_override_pattern",
        "block_configs",
        "num_hidden_layers",
        "vocab_size",
        "hidden_size",
        "layer_norm_epsilon",
        "tie_word_embeddings",
        "attention_head_dim",
        "dtype",
        "torch_dtype",
    }
)


# ----------------------------------------------------------------------------------------------- config in


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of checkpoint directory `path`, checked to be a supported NemotronH model_type."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; a checkpoint is a directory with {CONFIG_NAME}")
    config_path = path / CONFIG_NAME
    if not config_path.is_file():
        raise CheckpointError(f"{path} has no {CONFIG_NAME}; is it a Hugging Face checkpoint directory?")
    return read_config_file(config_path)


def read_config_file(config_path: str | Path) -> dict[str, Any]:
    """A config.json file (inside a checkpoint or alone), checked to be a supported NemotronH model_type."""
    config_path = Path(config_path)
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{config_path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} must hold a JSON object, found {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{config_path}: unsupported model_type {model_type!r}; supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def normalize_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy with old field names replaced by current ones (the old value wins, as in transformers)."""
    out = dict(config)
    for old, new in CONFIG_ALIASES.items():
        if old in out:
            out[new] = out.pop(old)
    return out


def _kind(name: Any, where: str) -> str:
    if name not in _KIND_NAMES:
        raise CheckpointError(
            f"{where}: unknown block type {name!r}; known: {sorted(set(_KIND_NAMES) - {'L', 'N'})}"
        )
    return _KIND_NAMES[name]


def block_kinds(config: Mapping[str, Any], where: str = CONFIG_NAME) -> list[str]:
    """One kind per block ("mamba", "attention", "moe", "mlp", "linear", "noop") from a normalized config.

    Sources in order of precedence: layers_block_type, hybrid_override_pattern, block_configs' block_type.
    """
    types = config.get("layers_block_type")
    block_configs = config.get("block_configs")
    if types is not None:
        if not isinstance(types, list):
            raise CheckpointError(f"{where}: layers_block_type must be a list, found {type(types).__name__}")
        kinds = [_kind(name, f"{where}: layers_block_type[{i}]") for i, name in enumerate(types)]
    elif config.get("hybrid_override_pattern") is not None:
        pattern = config["hybrid_override_pattern"]
        if not isinstance(pattern, str):
            raise CheckpointError(f"{where}: hybrid_override_pattern must be a string, found {pattern!r}")
        kinds = [_kind(char, f"{where}: hybrid_override_pattern[{i}]") for i, char in enumerate(pattern)]
    elif isinstance(block_configs, list):
        kinds = [
            _kind(
                entry.get("block_type") if isinstance(entry, Mapping) else None,
                f"{where}: block_configs[{i}]",
            )
            for i, entry in enumerate(block_configs)
        ]
    else:
        raise CheckpointError(
            f"{where}: no layer layout; expected layers_block_type, hybrid_override_pattern or block_configs"
        )
    if not kinds:
        raise CheckpointError(f"{where}: the model has no blocks")
    return kinds


def _block_fields_in(config: Mapping[str, Any], index: int, kind: str, where: str) -> dict[str, Any]:
    """The fields of block `index`: defaults < global config < its block_configs entry."""
    fields = {**DEFAULTS, **{key: value for key, value in config.items() if key != "block_configs"}}
    block_configs = config.get("block_configs")
    if block_configs is not None:
        entry = block_configs[index]
        if not isinstance(entry, Mapping):
            raise CheckpointError(f"{where}: block_configs[{index}] must be an object, found {entry!r}")
        entry = normalize_config(entry)
        if "block_type" in entry and _kind(entry["block_type"], f"{where}: block_configs[{index}]") != kind:
            raise CheckpointError(
                f"{where}: block {index} is {kind!r} in the layer layout but block_configs[{index}] "
                f"says {entry['block_type']!r}"
            )
        # A null field inherits the global value, as vLLM's NemotronHPuzzleConfig reads it: block
        # configs serialised from per-block dataclasses list unset fields as null.
        fields.update(
            {key: value for key, value in entry.items() if key != "block_type" and value is not None}
        )
    return fields


def _block_spec(kind: str, fields: Mapping[str, Any], hidden_size: int) -> BlockSpec:
    """The spec of one block of `kind` from its merged config fields."""
    if kind == "mamba":
        if fields["mamba_hidden_act"] != "silu":
            raise SpecError(f"mamba_hidden_act {fields['mamba_hidden_act']!r} is not supported (only 'silu')")
        return MambaSpec(
            num_heads=fields["mamba_num_heads"],
            head_dim=fields["mamba_head_dim"],
            state_size=fields["ssm_state_size"],
            n_groups=fields["n_groups"],
            conv_kernel=fields["conv_kernel"],
            chunk_size=fields["chunk_size"],
            conv_bias=bool(fields["use_conv_bias"]),
            # transformers gives in_proj / out_proj a bias from `use_bias` (mamba_proj_bias is unused).
            proj_bias=bool(fields["use_bias"]),
            # transformers clamps dt to (time_step_min, inf) after softplus.
            dt_clamp_min=float(fields["time_step_min"]),
            dt_clamp_max=None
            if fields["mamba_dt_clamp_max"] is None
            else float(fields["mamba_dt_clamp_max"]),
        )
    if kind == "attention":
        num_heads = fields["num_attention_heads"]
        head_dim = fields["head_dim"]
        if head_dim is None:  # older NVIDIA configs
            head_dim = fields.get("attention_head_dim") or hidden_size // num_heads
        num_kv = fields["num_key_value_heads"]
        return AttentionSpec(
            num_heads=num_heads,
            num_kv_heads=num_heads if num_kv is None else num_kv,
            head_dim=head_dim,
            bias=bool(fields["attention_bias"]),
        )
    if kind == "moe":
        if fields["mlp_hidden_act"] != "relu2":
            raise SpecError(
                f"MoE experts must use mlp_hidden_act 'relu2', found {fields['mlp_hidden_act']!r}"
            )
        if fields["mlp_bias"]:
            raise SpecError("MoE blocks with mlp_bias=true are not supported")
        width = fields["moe_intermediate_size"]
        return MoESpec(
            num_experts=fields["n_routed_experts"],
            top_k=fields["num_experts_per_tok"],
            expert_width=tuple(width) if isinstance(width, list) else width,
            shared_width=fields["moe_shared_expert_intermediate_size"] * fields["n_shared_experts"],
            latent_size=fields["moe_latent_size"],
            routed_scaling_factor=float(fields["routed_scaling_factor"]),
            norm_topk_prob=bool(fields["norm_topk_prob"]),
            n_group=fields["n_group"],
            topk_group=fields["topk_group"],
        )
    if kind == "mlp":
        return MLPSpec(
            width=fields["intermediate_size"],
            activation=fields["mlp_hidden_act"],
            bias=bool(fields["mlp_bias"]),
        )
    if kind == "linear":
        return LinearSpec(bias=bool(fields["linear_bias"]))
    return NoOpSpec()


def spec_from_config(config: Mapping[str, Any], where: str = CONFIG_NAME) -> ModelSpec:
    """The ModelSpec described by a NemotronH config.json dict (nemotron_h or nemotron_h_puzzle)."""
    config = normalize_config(config)
    kinds = block_kinds(config, where)
    block_configs = config.get("block_configs")
    if block_configs is not None:
        if not isinstance(block_configs, list):
            raise CheckpointError(
                f"{where}: block_configs must be a list, found {type(block_configs).__name__}"
            )
        if len(block_configs) != len(kinds):
            raise CheckpointError(
                f"{where}: block_configs has {len(block_configs)} entries but the layer layout has {len(kinds)} blocks"
            )
    hidden_size = config.get("hidden_size", DEFAULTS["hidden_size"])
    blocks = []
    for index, kind in enumerate(kinds):
        fields = _block_fields_in(config, index, kind, where)
        try:
            blocks.append(_block_spec(kind, fields, hidden_size))
        except (SpecError, TypeError, KeyError) as error:
            raise CheckpointError(f"{where}: block {index} ({kind}): {error}") from error
    try:
        return ModelSpec(
            vocab_size=config.get("vocab_size", DEFAULTS["vocab_size"]),
            hidden_size=hidden_size,
            blocks=tuple(blocks),
            norm_eps=float(config.get("layer_norm_epsilon", DEFAULTS["layer_norm_epsilon"])),
            tie_embeddings=bool(config.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"])),
        )
    except SpecError as error:
        raise CheckpointError(f"{where}: {error}") from error


# ---------------------------------------------------------------------------------------------- config out


def block_config_fields(spec: BlockSpec) -> dict[str, Any]:
    """The config fields that describe `spec` (inverse of the per-kind parsing above)."""
    if isinstance(spec, MambaSpec):
        return {
            "mamba_num_heads": spec.num_heads,
            "mamba_head_dim": spec.head_dim,
            "ssm_state_size": spec.state_size,
            "n_groups": spec.n_groups,
            "conv_kernel": spec.conv_kernel,
            "chunk_size": spec.chunk_size,
            "use_conv_bias": spec.conv_bias,
            "use_bias": spec.proj_bias,
            "time_step_min": spec.dt_clamp_min,
            "mamba_dt_clamp_max": spec.dt_clamp_max,
        }
    if isinstance(spec, AttentionSpec):
        if spec.rope_theta is not None:
            raise CheckpointError(
                f"attention with RoPE (rope_theta={spec.rope_theta}) cannot be written as a NemotronH checkpoint"
            )
        return {
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "attention_bias": spec.bias,
        }
    if isinstance(spec, MoESpec):
        return {
            "n_routed_experts": spec.num_experts,
            "num_experts_per_tok": spec.top_k,
            "moe_intermediate_size": spec.widths[0] if spec.is_uniform else list(spec.widths),
            "moe_shared_expert_intermediate_size": spec.shared_width,
            "n_shared_experts": 1 if spec.shared_width else 0,
            "moe_latent_size": spec.latent_size,
            "routed_scaling_factor": spec.routed_scaling_factor,
            "norm_topk_prob": spec.norm_topk_prob,
            "n_group": spec.n_group,
            "topk_group": spec.topk_group,
            "mlp_hidden_act": "relu2",
            "mlp_bias": False,
        }
    if isinstance(spec, MLPSpec):
        return {"intermediate_size": spec.width, "mlp_hidden_act": spec.activation, "mlp_bias": spec.bias}
    if isinstance(spec, LinearSpec):
        return {"linear_bias": spec.bias}
    return {}


def transformers_incompatibilities(spec: ModelSpec) -> list[str]:
    """Why transformers' NemotronH (model_type nemotron_h) cannot represent `spec`; empty if it can."""
    reasons = []
    by_kind: dict[str, set[BlockSpec]] = {}
    for block in spec.blocks:
        by_kind.setdefault(block.kind, set()).add(block)
    for kind in ("linear", "noop"):
        if kind in by_kind:
            reasons.append(f"{kind} blocks")
    for kind, specs in by_kind.items():
        if len(specs) > 1:
            reasons.append(f"{len(specs)} different {kind} shapes")
    for block in spec.blocks:
        if isinstance(block, MoESpec) and not block.is_uniform:
            reasons.append("per-expert widths")
        if isinstance(block, MoESpec) and block.shared_width == 0:
            reasons.append("MoE without a shared expert")
        if isinstance(block, AttentionSpec) and block.bias:
            reasons.append("attention biases")
        if isinstance(block, MambaSpec) and block.dt_clamp_max is not None:
            reasons.append("an upper dt clamp")
    shared: dict[str, Any] = {}
    for kind in ("moe", "mlp"):
        for block in by_kind.get(kind, ()):
            for key in ("mlp_hidden_act", "mlp_bias"):
                value = block_config_fields(block)[key]
                if shared.setdefault(key, value) != value:
                    reasons.append(f"MoE and MLP blocks disagree on {key}")
    return sorted(set(reasons))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_from_spec(
    spec: ModelSpec, base: Mapping[str, Any] | None = None, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """A config.json dict for `spec`: nemotron_h when transformers can load it, else nemotron_h_puzzle.

    Keys of `base` (the loaded checkpoint's config) that the spec does not determine (token ids,
    MTP settings, ...) are carried over. In the puzzle format the global fields keep the base's
    values where it has them (the MTP module reads those), and each block_configs entry lists only
    the fields where its block differs from the globals.
    """
    base = normalize_config(base or {})
    needs_puzzle = bool(transformers_incompatibilities(spec))
    config = {key: value for key, value in base.items() if key not in _OWNED_KEYS}
    kinds = [block.kind for block in spec.blocks]
    # Globals: the base's values, else defaults; then the most common shape of each kind, which in the
    # puzzle format only fills fields the base lacks (the base's globals describe its MTP module).
    globals_ = {key: base.get(key, value) for key, value in DEFAULTS.items()}
    from_blocks: dict[str, Any] = {}
    for kind in ("mlp", "moe", "attention", "mamba"):  # MoE wins the mlp_* fields it shares with MLP
        blocks = [block for block in spec.blocks if block.kind == kind]
        if blocks:
            from_blocks.update(block_config_fields(Counter(blocks).most_common(1)[0][0]))
    globals_.update({key: value for key, value in from_blocks.items() if not needs_puzzle or key not in base})
    for key in ("mamba_dt_clamp_max", "linear_bias"):  # our extensions: written only when set
        if not globals_.get(key):
            globals_.pop(key, None)
    config.update(globals_)
    config.update(
        {
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "layer_norm_epsilon": spec.norm_eps,
            "tie_word_embeddings": spec.tie_embeddings,
            "num_hidden_layers": spec.num_blocks,
            "hybrid_override_pattern": spec.pattern,
        }
    )
    if dtype is not None:
        config["dtype"] = _dtype_name(dtype)
        if "torch_dtype" in base:
            config["torch_dtype"] = _dtype_name(dtype)
    if not needs_puzzle:
        config["model_type"] = "nemotron_h"
        config["architectures"] = ["NemotronHForCausalLM"]
        config["layers_block_type"] = [_TRANSFORMERS_NAMES[kind] for kind in kinds]
        return dict(sorted(config.items()))
    config["model_type"] = "nemotron_h_puzzle"
    config["architectures"] = ["NemotronHPuzzleForCausalLM"]
    config["layers_block_type"] = kinds
    # A null in an entry means "inherit" (see _block_fields_in), so a block whose field is None (no
    # latent projection, no dt clamp) makes the global None and the other blocks state their values.
    for block in spec.blocks:
        for key, value in block_config_fields(block).items():
            if value is None and config.get(key, DEFAULTS.get(key)) is not None:
                config[key] = None
    block_configs = []
    for block in spec.blocks:
        entry: dict[str, Any] = {"block_type": block.kind}
        for key, value in block_config_fields(block).items():
            if config.get(key, DEFAULTS.get(key)) != value:
                entry[key] = value
        block_configs.append(entry)
    config["block_configs"] = block_configs
    return dict(sorted(config.items()))


# ---------------------------------------------------------------------------------------------- weights in


@dataclass(frozen=True)
class LazyTensor:
    """A tensor left in a safetensors file until needed (e.g. MTP weights carried through a load/save)."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name, e.g. "BF16"

    def load(self) -> torch.Tensor:
        with _open(self.file) as handle:
            return _read(handle, self.file, self.key)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _SAFETENSORS_DTYPES[self.dtype].itemsize


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class _Source:
    """Where one model tensor lives on disk: file, key, expert index into a fused tensor; its shape and dtype."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name
    expert: int | None = None

    @property
    def name(self) -> str:
        return self.key if self.expert is None else f"{self.key}[{self.expert}]"


@contextlib.contextmanager
def _open(file: Path) -> Iterator[Any]:
    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as error:  # safetensors raises its own error types for truncated or corrupt files
        raise CheckpointError(f"cannot read safetensors file {file}: {error}") from error
    with handle as opened:
        yield opened


def _read(handle: Any, file: Path, key: str, expert: int | None = None) -> torch.Tensor:
    try:
        if expert is None:
            return handle.get_tensor(key)
        return handle.get_slice(key)[expert]
    except Exception as error:
        raise CheckpointError(f"cannot read tensor {key!r} from {file}: {error}") from error


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of checkpoint `path`: from the index if there is one, else all of them."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index} is not a valid safetensors index: {error}") from error
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index} names {file.name}, which does not exist")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no safetensors weights ({SINGLE_FILE} or {INDEX_FILE})")
    return files


_FUSED_EXPERTS = re.compile(r"layers\.(\d+)\.mixer\.experts\.(up_proj|down_proj)$")


def _model_key(disk_key: str) -> tuple[str | None, str]:
    """(HybridLM state-dict key or None for a tensor outside the model, checkpoint prefix)."""
    if disk_key == "lm_head.weight":
        return disk_key, ""
    for prefix in ("backbone.", "model."):
        if disk_key.startswith(prefix):
            rest = disk_key[len(prefix) :]
            return ("embeddings.weight" if rest == "embedding.weight" else rest), prefix
    return None, ""


def _map_checkpoint(handles: Mapping[Path, Any]) -> tuple[dict[str, _Source], dict[str, LazyTensor], str]:
    """Model key -> source, the extra (non-model) tensors by name, and the backbone prefix the checkpoint uses."""
    sources: dict[str, _Source] = {}
    extras: dict[str, LazyTensor] = {}
    prefix_seen = "backbone."

    def add(key: str, source: _Source) -> None:
        if key in sources:
            raise CheckpointError(
                f"{source.file.name}: tensor {source.key!r} gives model tensor {key!r}, already given by "
                f"{sources[key].key!r} in {sources[key].file.name}"
            )
        sources[key] = source

    for file, handle in handles.items():
        for disk_key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            tensor_slice = handle.get_slice(disk_key)
            shape, dtype = tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()
            key, prefix = _model_key(disk_key)
            if key is None:
                extras[disk_key] = LazyTensor(file, disk_key, shape, dtype)
                continue
            prefix_seen = prefix or prefix_seen
            fused = _FUSED_EXPERTS.fullmatch(key)
            if fused is None:
                add(key, _Source(file, disk_key, shape, dtype))
                continue
            if len(shape) != 3:
                raise CheckpointError(
                    f"{file.name}: fused expert tensor {disk_key!r} should be 3-D [experts, out, in], "
                    f"found shape {list(shape)}"
                )
            layer, proj = fused.groups()
            for expert in range(shape[0]):
                add(
                    f"layers.{layer}.mixer.experts.{expert}.{proj}.weight",
                    _Source(file, disk_key, shape[1:], dtype, expert),
                )
    return sources, extras, prefix_seen


def _disk_name(key: str, prefix: str) -> str:
    return key if key == "lm_head.weight" else prefix + key


def _assign(model: nn.Module, key: str, tensor: torch.Tensor) -> None:
    """Replace the (meta) parameter or buffer `key` of `model` by `tensor`."""
    module_name, _, leaf = key.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=module._parameters[leaf].requires_grad)
    else:
        module._buffers[leaf] = tensor


def _keeps_fp32(key: str) -> bool:
    # The router decides which experts run; like transformers, keep its weight and bias in fp32.
    return key.endswith(("mixer.gate.e_score_correction_bias", "mixer.gate.weight"))


# The safetensors dtypes a model weight may be stored in; anything else is not a weight we can read.
_WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64")


def _compute_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`load`'s dtype argument checked: None, or a floating-point dtype of at least 16 bits."""
    if dtype is None:
        return None
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(found, torch.dtype) or not found.is_floating_point or found.itemsize < 2:
        raise ValueError(
            f"dtype {dtype!r} is not a dtype a model can be loaded in; use torch.bfloat16, torch.float16, "
            "torch.float32 or torch.float64 (or their names)"
        )
    return found


def _check_weight_dtype(source: _Source) -> None:
    if source.dtype not in _WEIGHT_DTYPES:
        hint = (
            " (fp8 weights need their scales: use the BF16 release)" if source.dtype.startswith("F8") else ""
        )
        raise CheckpointError(
            f"{source.file.name}: tensor {source.name!r} is stored as {source.dtype} "
            f"({_SAFETENSORS_DTYPES.get(source.dtype, 'unknown')}); expected a floating-point weight, one "
            f"of {', '.join(_WEIGHT_DTYPES)}{hint}"
        )


def _refuse_quantized(config: Mapping[str, Any], path: Path) -> None:
    """Quantised releases (NVFP4 / FP8) store packed weights and scales that are not the model's tensors."""
    quantization = config.get("quantization_config")
    if quantization:
        method = (
            quantization.get("quant_method", "unknown") if isinstance(quantization, Mapping) else "unknown"
        )
        raise CheckpointError(
            f"{path / CONFIG_NAME} describes a quantized checkpoint (quantization_config, quant_method "
            f"{method!r}); puzzle loads unquantized weights (bf16 / fp16 / fp32): use the BF16 release. "
            "Its architecture alone can still be read with puzzle.hf.spec_from_config (e.g. `puzzle costs`)."
        )


def load(
    path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"
) -> HybridLM:
    """Load a NemotronH checkpoint directory (config.json + safetensors) as a HybridLM in eval mode.

    dtype (a floating-point torch dtype of 16 bits or more, or its name) None keeps the checkpoint's
    dtype (that of its embeddings); the router's weight and correction bias stay fp32 either way, as
    in transformers. Tensors are read one at a time from memory-mapped files straight into the model,
    so peak memory is about one copy of the weights. Tensors outside the backbone and lm_head (e.g.
    `mtp.*`) are kept unread in `model.extra_tensors` and written back on save.

    device "meta" builds the model's structure without reading any weight: the checkpoint's tensor
    names, shapes and dtypes are checked as for a real load and the parameters are meta tensors of
    the dtype a real load would give (for inspecting or costing a model, or `to_empty` + init). Such a
    model cannot be saved.

    Raises CheckpointError naming the file and tensor for a missing, unexpected, misshapen or
    non-float (e.g. int8 or fp8) weight.
    """
    compute_dtype = _compute_dtype(dtype)
    device = torch.device(device)
    path = Path(path)
    config = read_config(path)
    spec = spec_from_config(config, where=str(path / CONFIG_NAME))
    _refuse_quantized(config, path)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(_open(file)) for file in weight_files(path)}
        sources, extras, prefix = _map_checkpoint(handles)
        with torch.device("meta"):
            model = HybridLM(spec)
        expected = {key: tuple(value.shape) for key, value in model.state_dict(keep_vars=True).items()}
        if spec.tie_embeddings:
            expected.pop("lm_head.weight")
            sources.pop("lm_head.weight", None)
        missing = [key for key in expected if key not in sources]
        if missing:
            names = ", ".join(repr(_disk_name(key, prefix)) for key in missing[:5])
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"{path}: checkpoint is missing tensor(s) {names}{more}")
        unexpected = [key for key in sources if key not in expected]
        if unexpected:
            names = ", ".join(repr(sources[key].key) for key in unexpected[:5])
            more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
            raise CheckpointError(
                f"{path}: unexpected tensor(s) {names}{more} for a model with pattern {spec.pattern}"
            )
        for key, shape in expected.items():
            source = sources[key]
            if source.shape != shape:
                raise CheckpointError(
                    f"{source.file.name}: tensor {source.name!r} has shape {list(source.shape)}, "
                    f"expected {list(shape)} (from {CONFIG_NAME})"
                )
            _check_weight_dtype(source)  # every model tensor is a float weight or buffer
        target_dtype = compute_dtype or _SAFETENSORS_DTYPES[sources["embeddings.weight"].dtype]
        for key in progress(expected, f"loading {path.name}", total=len(expected), unit="tensor"):
            source = sources[key]
            dtype_of_key = torch.float32 if _keeps_fp32(key) else target_dtype
            if device.type == "meta":
                tensor = torch.empty(source.shape, dtype=dtype_of_key, device=device)
            else:
                tensor = _read(handles[source.file], source.file, source.key, source.expert)
                tensor = tensor.to(dtype=dtype_of_key).to(device).contiguous()
            _assign(model, key, tensor)
    if spec.tie_embeddings:
        model.lm_head.weight = model.embeddings.weight
    leftover = [name for name, value in [*model.named_parameters(), *model.named_buffers()] if value.is_meta]
    if leftover and device.type != "meta":  # a non-persistent buffer would need recomputing; none today
        raise CheckpointError(f"{path}: no checkpoint tensor for {leftover[:5]}")
    model.extra_tensors = dict(extras)
    model.source_config = dict(config)
    model.source_path = path.resolve()
    return model.eval()


# --------------------------------------------------------------------------------------------- weights out


def hub_state(model: HybridLM) -> dict[str, torch.Tensor | LazyTensor]:
    """Tensors to write, by hub name: `backbone.` prefix, per-expert keys, lm_head, then extra tensors."""
    out: dict[str, torch.Tensor | LazyTensor] = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and model.spec.tie_embeddings:
            # NemotronHForCausalLM never ties, so it needs its own copy; safetensors refuses shared storage.
            tensor = tensor.clone()
        out[_disk_name(key, "backbone.")] = tensor
    for key, tensor in model.extra_tensors.items():
        if key in out:
            raise CheckpointError(f"extra tensor {key!r} collides with a model tensor")
        out[key] = tensor
    return out


def _nbytes(tensor: torch.Tensor | LazyTensor) -> int:
    if isinstance(tensor, LazyTensor):
        return tensor.nbytes
    return tensor.numel() * tensor.element_size()


def _plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


# Tokenizer and generation files copied from the loaded checkpoint, so the output is usable as is
# (never code: a `*.py` file matching these is neither copied nor counted as a checkpoint file).
_AUX_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template*",
    "*.jinja",
    "vocab.*",
    "merges.txt",
)
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _is_aux_file(name: str) -> bool:
    return not name.endswith(".py") and any(fnmatch(name, pattern) for pattern in _AUX_FILES)


def is_checkpoint_file(name: str) -> bool:
    """Whether a file called `name` is one a checkpoint save writes (config, weights, index, aux files)."""
    return (
        name in (CONFIG_NAME, SINGLE_FILE, INDEX_FILE, OWNER_MARKER)
        or _SHARD_FILE.fullmatch(name) is not None
        or _is_aux_file(name)
    )


def _foreign_entries(directory: Path) -> list[str]:
    """Entries of `directory` a checkpoint save would not write: other files and every subdirectory."""
    return sorted(
        entry.name for entry in directory.iterdir() if entry.is_dir() or not is_checkpoint_file(entry.name)
    )


def save_pretrained(
    model: HybridLM,
    path: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write `model` as a NemotronH checkpoint directory at `path`; returns the path.

    Layout: config.json (see `config_from_spec`), model.safetensors, or model-0000i-of-0000n.safetensors
    plus model.safetensors.index.json when the tensors exceed `max_shard_bytes`, and the tokenizer /
    generation files of the checkpoint the model was loaded from. Every file gets the permissions of
    a plainly created one (`puzzle.files.default_mode`).

    What happens to `path`:
    - missing, empty, or holding only checkpoint files (config.json, model.safetensors,
      model-NNNNN-of-NNNNN.safetensors, model.safetensors.index.json, tokenizer* / vocab.* /
      merges.txt / special_tokens_map.json / generation_config.json / chat templates; no
      subdirectory), i.e. an earlier checkpoint: the checkpoint is built in a hidden staging
      directory beside it and renamed into place, replacing the old one atomically;
    - holding anything else (code, data, a README, a `.git` folder): refused with CheckpointError,
      nothing written, unless `overwrite=True`, which writes the checkpoint files into it beside the
      other files (each file replaced atomically, not the set): files with checkpoint names are
      replaced, and stale weights of an earlier save (model.safetensors, shards, index) are removed
      so the directory reads as the new checkpoint; no other file is touched;
    - the directory the model was loaded from, a folder holding it, or one inside it: refused.

    A save killed midway leaves a `.NAME.tmp-*` (or `.NAME.old-*`) directory beside `path`; the next
    save to `path` removes it once its owner marker proves the process that wrote it is gone (and
    puts a previous checkpoint moved aside back first). A save that fails leaves nothing behind.
    """
    target = Path(path).absolute()
    source = model.source_path
    # Neither over the source (or a folder holding it) nor inside it: the parent's directory stays untouched.
    if source is not None and (
        source.is_relative_to(target.resolve()) or target.resolve().is_relative_to(source)
    ):
        raise CheckpointError(
            f"refusing to write into {target}: the model was loaded from {source}, which must stay untouched"
        )
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a directory")
    meta = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if meta:
        raise CheckpointError(f"cannot save a model with tensors on the meta device (e.g. {meta[0]!r})")
    remove_stale_staging(target)
    foreign = _foreign_entries(target) if target.is_dir() else []
    if foreign and not overwrite:
        shown = ", ".join(foreign[:5]) + (f" (and {len(foreign) - 5} more)" if len(foreign) > 5 else "")
        raise CheckpointError(
            f"refusing to write into {target}: it holds files that are not checkpoint files ({shown}); "
            "save into a new or empty directory, or pass overwrite=True to write the checkpoint files "
            "beside them"
        )
    config = config_from_spec(model.spec, model.source_config, dtype=model.embeddings.weight.dtype)
    tensors = hub_state(model)
    shards = _plan_shards({name: _nbytes(tensor) for name, tensor in tensors.items()}, max_shard_bytes)
    staging = make_staging_dir(target)
    try:
        weight_map: dict[str, str] = {}
        for number, names in enumerate(shards, start=1):
            file_name = (
                SINGLE_FILE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            )
            shard = {}
            for name in names:
                tensor = tensors[name]
                tensor = tensor.load() if isinstance(tensor, LazyTensor) else tensor
                shard[name] = tensor.detach().to("cpu").contiguous()
                weight_map[name] = file_name
            save_file(shard, str(staging / file_name), metadata={"format": "pt"})
            del shard
        if len(shards) > 1:
            total = sum(_nbytes(tensor) for tensor in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (staging / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        if source is not None and source.is_dir():
            for file in sorted(source.iterdir()):
                if file.is_file() and _is_aux_file(file.name):
                    shutil.copy2(file, staging / file.name)
        for file in staging.iterdir():  # safetensors writes 0o600, copy2 copies the source's mode
            file.chmod(default_mode())
        if foreign:
            _write_beside(staging, target)
        else:
            swap_directory_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _write_beside(staging: Path, target: Path) -> None:
    """Move the checkpoint files of `staging` into the existing `target`, leaving its other files alone.

    Weight files of an earlier save that this one does not rewrite are removed first (a stale index or
    model.safetensors would be read instead of the new weights); config.json comes last.
    """
    written = {file.name for file in staging.iterdir() if file.name != OWNER_MARKER}
    for entry in target.iterdir():
        stale_weights = entry.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.fullmatch(entry.name)
        if stale_weights and entry.name not in written and entry.is_file():
            entry.unlink()
    for name in sorted(written, key=lambda name: name == CONFIG_NAME):
        os.replace(staging / name, target / name)
    shutil.rmtree(staging)
