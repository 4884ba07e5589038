"""NemotronH config.json <-> ModelSpec, both directions driven by one field table per block kind.

Reading accepts what NVIDIA and transformers write: `model_type` nemotron_h (one shape per block
kind, `hybrid_override_pattern` or `layers_block_type`, old field aliases) and nemotron_h_puzzle
(per-block `block_configs` whose fields override the global ones; a null field in an entry
inherits the global, as in vLLM; `num_hidden_layers` may be null; MTP fields such as
`mtp_block_configs` are carried, not parsed). Writing gives nemotron_h when transformers'
NemotronHForCausalLM can represent the spec, else nemotron_h_puzzle.

Our extensions of the nemotron_h_puzzle schema (read and written here, unknown to other tools):
- `{"block_type": "linear"}`: the mixer is one [H, H] matrix `backbone.layers.{i}.mixer.linear.weight`
  (`"linear_bias": true` adds `mixer.linear.bias`); pattern character `L`.
- `{"block_type": "noop"}`: a removed block, no tensors (a `norm.weight` of older files is ignored); pattern `N`.
- `moe_intermediate_size` may be a list with one width per routed expert.
- `mamba_dt_clamp_max`: an upper clamp of dt after softplus (absent or null = none).
- `sliding_window` in an attention entry: that block attends to its last `sliding_window` tokens (its own
  included, as transformers and vLLM count it); absent or null = full attention. The key is vLLM's (its
  NemotronHAttention reads it from each layer's config); stated per entry only, never as a global.

No torch here: `puzzle costs` reads configs without loading the model machinery.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from puzzle.checkpoint_files import CheckpointError
from puzzle.spec import (
    BLOCK_SPEC_TYPES,
    AttentionSpec,
    BlockSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
    SpecError,
    kind_entry,
    without_weight_format,
)

if TYPE_CHECKING:
    import torch


SUPPORTED_MODEL_TYPES = ("nemotron_h", "nemotron_h_puzzle")
CONFIG_NAME = "config.json"

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
    "sliding_window": None,
}

# ------------------------------------------------------------------------------------------- field tables

# A block's config fields after merging: DEFAULTS < the global config < its block_configs entry.
Fields = Mapping[str, Any]


@dataclass(frozen=True)
class Field:
    """One config.json key of a block kind: how it gives a spec attribute, and how the spec gives it back.

    `attr` None marks a key the kind fixes (e.g. MoE experts are relu2): `read` checks it and
    returns nothing, `write` gives the fixed value.
    """

    key: str
    attr: str | None
    read: Callable[[Fields], Any]  # merged block fields -> the attribute's value
    write: Callable[[Any], Any]  # block spec -> the key's value


def _same(value: Any) -> Any:
    return value


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _plain(key: str, attr: str, convert: Callable[[Any], Any] = _same) -> Field:
    """A key that carries one spec attribute as it is (after `convert`, e.g. bool or float)."""
    return Field(key, attr, read=lambda fields: convert(fields[key]), write=lambda spec: getattr(spec, attr))


def _fixed(key: str, value: Any, accepts: Callable[[Any], bool], problem: str) -> Field:
    """A key with one supported value: reading anything `accepts` refuses is a SpecError."""

    def read(fields: Fields) -> None:
        if not accepts(fields[key]):
            raise SpecError(f"{problem}, found {key} {fields[key]!r}")

    return Field(key, None, read=read, write=lambda spec: value)


def _kv_heads(fields: Fields) -> int:
    kv_heads = fields["num_key_value_heads"]
    return fields["num_attention_heads"] if kv_heads is None else kv_heads


def _head_dim(fields: Fields) -> int:
    if fields["head_dim"] is not None:
        return fields["head_dim"]
    # Older NVIDIA configs: attention_head_dim, or the hidden size split over the heads.
    return fields.get("attention_head_dim") or fields["hidden_size"] // fields["num_attention_heads"]


def _expert_width(fields: Fields) -> int | tuple[int, ...]:
    width = fields["moe_intermediate_size"]
    return tuple(width) if isinstance(width, list) else width


def _shared_width(fields: Fields) -> int:
    # transformers multiplies the shared expert's width by n_shared_experts; we write 1 or 0 of them.
    return fields["moe_shared_expert_intermediate_size"] * fields["n_shared_experts"]


# MoE fields every nemotron_h_puzzle MoE entry states, as NVIDIA's Puzzle-75B release does: llama.cpp's
# converter reads the width and top-k of each MoE entry with no fallback to the globals, and vLLM drops
# from the globals every field some entry sets ("blockwise members"), so an entry without it would get
# the config class's default instead of the global.
MOE_ENTRY_KEYS = (
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "moe_latent_size",
)


@dataclass(frozen=True)
class KindTable:
    """How one block kind reads from and writes to config.json: its fields, in the order written.

    `not_in_config`: spec attributes no NemotronH config carries (read as their defaults, writable only
    at them). Spec fields in `QUANTIZATION_FIELDS` are not block fields either.
    `names`: what configs also call the kind, beyond its kind name and pattern char.
    `globals_order`: the most common block of the kind sets the global fields, kinds in increasing
    order, so a later kind wins a key two kinds share (MoE's mlp_* over MLP's); None: it sets none.
    `entry_keys`: keys every nemotron_h_puzzle entry of the kind states even when they equal the global.
    """

    spec_type: type[BlockSpec]
    fields: tuple[Field, ...]
    not_in_config: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    globals_order: int | None = None
    entry_keys: tuple[str, ...] = ()


# Spec fields a save states in `quantization_config` (`puzzle.nemotron_h.quantized`), not in the block fields.
QUANTIZATION_FIELDS: tuple[str, ...] = ("weight_format",)

KIND_TABLES: dict[type, KindTable] = {
    table.spec_type: table
    for table in (
        KindTable(
            MambaSpec,
            (
                _plain("mamba_num_heads", "num_heads"),
                _plain("mamba_head_dim", "head_dim"),
                _plain("ssm_state_size", "state_size"),
                _plain("n_groups", "n_groups"),
                _plain("conv_kernel", "conv_kernel"),
                _plain("chunk_size", "chunk_size"),
                _plain("use_conv_bias", "conv_bias", bool),
                # transformers gives in_proj / out_proj a bias from `use_bias` (mamba_proj_bias is unused).
                _plain("use_bias", "proj_bias", bool),
                # transformers clamps dt to (time_step_min, inf) after softplus.
                _plain("time_step_min", "dt_clamp_min", float),
                _plain("mamba_dt_clamp_max", "dt_clamp_max", _optional_float),
                _fixed("mamba_hidden_act", "silu", lambda act: act == "silu", "Mamba blocks must use 'silu'"),
            ),
            names=("linear_attention",),
            globals_order=3,
        ),
        KindTable(
            AttentionSpec,
            (
                _plain("num_attention_heads", "num_heads"),
                Field("num_key_value_heads", "num_kv_heads", _kv_heads, lambda spec: spec.num_kv_heads),
                Field("head_dim", "head_dim", _head_dim, lambda spec: spec.head_dim),
                _plain("attention_bias", "bias", bool),
                _plain("sliding_window", "window"),
            ),
            not_in_config=("rope_theta", "rotary_fraction"),  # NemotronH attention has no position encoding
            names=("full_attention",),
            globals_order=2,
            entry_keys=("sliding_window",),  # a window is per block (PUZZLE_UNSET_GLOBALS)
        ),
        KindTable(
            MoESpec,
            (
                _plain("n_routed_experts", "num_experts"),
                _plain("num_experts_per_tok", "top_k"),
                Field(
                    "moe_intermediate_size",
                    "expert_width",
                    _expert_width,
                    lambda spec: spec.widths[0] if spec.is_uniform else list(spec.widths),
                ),
                Field(
                    "moe_shared_expert_intermediate_size",
                    "shared_width",
                    _shared_width,
                    lambda spec: spec.shared_width,
                ),
                Field(
                    "n_shared_experts", None, lambda fields: None, lambda spec: 1 if spec.shared_width else 0
                ),
                _plain("moe_latent_size", "latent_size"),
                _plain("routed_scaling_factor", "routed_scaling_factor", float),
                _plain("norm_topk_prob", "norm_topk_prob", bool),
                _plain("n_group", "n_group"),
                _plain("topk_group", "topk_group"),
                _fixed("mlp_hidden_act", "relu2", lambda act: act == "relu2", "MoE experts must use 'relu2'"),
                _fixed(
                    "mlp_bias",
                    False,
                    lambda bias: not bias,
                    "MoE blocks with mlp_bias=true are not supported",
                ),
            ),
            globals_order=1,
            entry_keys=MOE_ENTRY_KEYS,
        ),
        KindTable(
            MLPSpec,
            (
                _plain("intermediate_size", "width"),
                _plain("mlp_hidden_act", "activation"),
                _plain("mlp_bias", "bias", bool),
            ),
            globals_order=0,
            entry_keys=("intermediate_size",),
        ),
        KindTable(LinearSpec, (_plain("linear_bias", "bias", bool),)),
        KindTable(NoOpSpec, ()),
    )
}

# Every name a block kind goes by: layers_block_type (old and new), block_configs' block_type, pattern char.
_KIND_NAMES = {
    name: spec_type.kind
    for spec_type, table in KIND_TABLES.items()
    for name in (spec_type.kind, *table.names, spec_type.pattern_char)
}

# transformers' AutoTokenizer reads config.json before the tokenizer's files. Without trust_remote_code it
# cannot build a nemotron_h_puzzle config and falls back to its base config class, which warns that the
# checkpoint's model type is not its own ("") unless an entry of config.json is a dict of that model type: it
# then reads that entry instead, quietly. A nemotron_h_puzzle config carries this one for that reading alone
# (the tokenizer needs no model code: tokenizer_config.json names its class); everything else ignores it.
TOKENIZER_READER_KEY = "tokenizer_reader_config"
TOKENIZER_READER_CONFIG = {
    "model_type": "",
    "note": "read by transformers' AutoTokenizer without trust_remote_code instead of this model's config",
}

# Keys a saved config.json gets from the spec; anything else is carried over from the loaded config.
_OWNED_KEYS = (
    set(CONFIG_ALIASES)
    | {field.key for table in KIND_TABLES.values() for field in table.fields}
    | {
        "model_type",
        "architectures",
        "auto_map",
        "layers_block_type",
        "hybrid_override_pattern",
        "block_configs",
        "mtp_block_configs",
        "num_hidden_layers",
        "vocab_size",
        "hidden_size",
        "layer_norm_epsilon",
        "tie_word_embeddings",
        "attention_head_dim",
        "dtype",
        "torch_dtype",
        "quantization_config",  # describes the stored weights: written by the save that quantizes, never carried
        TOKENIZER_READER_KEY,
    }
)


def block_spec_from_fields(kind: str, fields: Fields) -> BlockSpec:
    """The spec of one block of `kind` from its merged config fields (SpecError if they are unsupported)."""
    table = KIND_TABLES[BLOCK_SPEC_TYPES[kind]]
    values = {}
    for field in table.fields:
        value = field.read(fields)
        if field.attr is not None:
            values[field.attr] = value
    return table.spec_type(**values)


def block_config_fields(spec: BlockSpec) -> dict[str, Any]:
    """The config fields that describe `spec`, from its kind's table (the inverse of the reading)."""
    table = kind_entry(KIND_TABLES, spec, "no config fields for block spec type")
    defaults = {field.name: field.default for field in dataclass_fields(table.spec_type)}
    for attr in table.not_in_config:
        if getattr(spec, attr) != defaults[attr]:
            raise CheckpointError(
                f"{spec.kind} block with {attr}={getattr(spec, attr)!r} cannot be written as a NemotronH "
                "checkpoint: its config has no field for it"
            )
    return {field.key: field.write(spec) for field in table.fields}


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
    blocks = []
    for index, kind in enumerate(kinds):
        fields = _block_fields_in(config, index, kind, where)
        try:
            blocks.append(block_spec_from_fields(kind, fields))
        except (SpecError, TypeError, KeyError) as error:
            raise CheckpointError(f"{where}: block {index} ({kind}): {error}") from error
    try:
        return ModelSpec(
            vocab_size=config.get("vocab_size", DEFAULTS["vocab_size"]),
            hidden_size=config.get("hidden_size", DEFAULTS["hidden_size"]),
            blocks=tuple(blocks),
            norm_eps=float(config.get("layer_norm_epsilon", DEFAULTS["layer_norm_epsilon"])),
            tie_embeddings=bool(config.get("tie_word_embeddings", DEFAULTS["tie_word_embeddings"])),
        )
    except SpecError as error:
        raise CheckpointError(f"{where}: {error}") from error


# ---------------------------------------------------------------------------------------------- config out


def _mamba_problems(block: MambaSpec) -> list[str]:
    return ["an upper dt clamp"] if block.dt_clamp_max is not None else []


def _attention_problems(block: AttentionSpec) -> list[str]:
    # transformers' NemotronHConfig has a `sliding_window` field, but its NemotronH attention never reads it:
    # a windowed block would silently attend to the whole context.
    problems = ["attention biases"] if block.bias else []
    return problems + (["sliding-window attention"] if block.window is not None else [])


def _moe_problems(block: MoESpec) -> list[str]:
    problems = [] if block.is_uniform else ["per-expert widths"]
    if block.weight_format == "nvfp4":
        # transformers 5.x fuses the routed experts at load and dequantizes nvfp4 ones without their
        # weight_global_scale: values ~5e3 off, no missing or unexpected key. The remote code reads them right.
        problems.append("nvfp4 routed experts (transformers misreads them: no weight_global_scale)")
    if block.weight_format == "fp8":
        # Its weights load exactly, but its forward is not the served one: the fused routed experts skip the
        # per-token fp8 activations vLLM applies, and the latent projections' 2-D inputs are quantized per
        # tensor (compressed-tensors' 'token' strategy reduces dims past the first two).
        problems.append("fp8 MoE (transformers' fused experts skip the served per-token fp8 activations)")
    return problems + (["MoE without a shared expert"] if block.shared_width == 0 else [])


# Why transformers' NemotronH cannot hold a block of each kind, whatever the other blocks are.
TRANSFORMERS_PROBLEMS: dict[type, Callable[[Any], list[str]]] = {
    MambaSpec: _mamba_problems,
    AttentionSpec: _attention_problems,
    MoESpec: _moe_problems,
    MLPSpec: lambda block: [],
    LinearSpec: lambda block: ["linear blocks"],
    NoOpSpec: lambda block: ["noop blocks"],
}
# Keys that blocks of different kinds read from one global field of transformers' NemotronH config.
_SHARED_KEYS = ("mlp_hidden_act", "mlp_bias")


def transformers_incompatibilities(spec: ModelSpec) -> list[str]:
    """Why transformers' NemotronH (model_type nemotron_h) cannot represent `spec`; empty if it can."""
    reasons = []
    by_kind: dict[str, set[BlockSpec]] = {}
    for block in spec.blocks:
        # a block's storage format is no shape: transformers reads it from quantization_config, per module
        by_kind.setdefault(block.kind, set()).add(without_weight_format(block))
        reasons += kind_entry(TRANSFORMERS_PROBLEMS, block, "no transformers rules for block spec type")(
            block
        )
    for kind, specs in by_kind.items():
        if len(specs) > 1:
            reasons.append(f"{len(specs)} different {kind} shapes")
    shared: dict[str, Any] = {}
    for block in spec.blocks:
        if not {field.key for field in KIND_TABLES[type(block)].fields} & set(_SHARED_KEYS):
            continue  # not written for this kind (an attention block with rope could not be written at all)
        fields = block_config_fields(block)
        for key in _SHARED_KEYS:
            if key in fields and shared.setdefault(key, fields[key]) != fields[key]:
                reasons.append(f"MoE and MLP blocks disagree on {key}")
    return sorted(set(reasons))


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


MODEL_TYPES = ("auto", "nemotron_h", "nemotron_h_puzzle")


def mtp_block_specs(base: Mapping[str, Any]) -> list[BlockSpec]:
    """The blocks of the checkpoint's MTP module, as specs (empty when it has none).

    nemotron_h_puzzle: `mtp_block_configs` entries over the globals; nemotron_h: the kinds of
    `mtp_layers_block_type` / `mtp_hybrid_override_pattern` (default attention + MoE) with the global
    fields, as transformers and vLLM read them.
    """
    base = normalize_config(base)
    if not base.get("num_nextn_predict_layers"):
        return []
    where = "the MTP module of the base config"
    entries = base.get("mtp_block_configs")
    if entries:
        mtp = {**base, "block_configs": entries, "layers_block_type": None, "hybrid_override_pattern": None}
    else:
        kinds = base.get("mtp_layers_block_type")
        if kinds is None:
            pattern = base.get("mtp_hybrid_override_pattern") or "*E"
            kinds = [_kind(char, where) for char in pattern]
        mtp = {**base, "layers_block_type": kinds, "block_configs": None}
    return list(spec_from_config(mtp, where=where).blocks)


def _globals_order(table: KindTable) -> int:
    return table.globals_order if table.globals_order is not None else -1


def _global_fields(spec: ModelSpec, base: Mapping[str, Any]) -> dict[str, Any]:
    """Global config fields: the base's, then the defaults, then the most common shape of each kind of block.

    Serving engines build Mamba and attention layers (and llama.cpp every MoE field but width and top-k)
    from the globals only, so the globals describe the child's blocks, never the parent's.
    """
    fields = {key: base.get(key, value) for key, value in DEFAULTS.items()}
    setters = sorted((t for t in KIND_TABLES.values() if t.globals_order is not None), key=_globals_order)
    for table in setters:  # MoE wins the mlp_* fields it shares with MLP
        blocks = [block for block in spec.blocks if type(block) is table.spec_type]
        if blocks:
            fields.update(block_config_fields(Counter(blocks).most_common(1)[0][0]))
    return fields


def _entries(blocks: list[BlockSpec], config: dict[str, Any]) -> list[dict[str, Any]]:
    """block_configs entries for `blocks` (main and MTP together) over the globals in `config` (updated).

    Per kind, every entry states the same keys: those where some block of the kind differs from the
    global (plus MOE_ENTRY_KEYS for MoE), so that readers that inherit from the globals (ours, llama.cpp)
    and those that drop blockwise keys from the globals (vLLM) see the same shapes. A null field would
    mean "inherit" (see _block_fields_in): a key some block leaves None gets a None global and is left
    out of that block's entry.
    """
    fields = [block_config_fields(block) for block in blocks]
    for block_fields in fields:
        for key, value in block_fields.items():
            if value is None and config.get(key, DEFAULTS.get(key)) is not None:
                config[key] = None
    stated: dict[str, set[str]] = {}
    for block, block_fields in zip(blocks, fields):
        keys = stated.setdefault(block.kind, set(KIND_TABLES[type(block)].entry_keys))
        keys.update(key for key, value in block_fields.items() if config.get(key, DEFAULTS.get(key)) != value)
    entries = []
    for block, block_fields in zip(blocks, fields):
        entry: dict[str, Any] = {"block_type": block.kind}
        for key, value in block_fields.items():  # the kind table's order
            if key in stated[block.kind] and value is not None:
                entry[key] = value
        entries.append(entry)
    return entries


def config_from_spec(
    spec: ModelSpec,
    base: Mapping[str, Any] | None = None,
    dtype: torch.dtype | str | None = None,
    model_type: str = "auto",
) -> dict[str, Any]:
    """A config.json dict for `spec`: nemotron_h when transformers can load it, else nemotron_h_puzzle.

    `model_type`: "auto" (the above), "nemotron_h" (CheckpointError naming the reasons when
    transformers cannot represent the spec) or "nemotron_h_puzzle". Keys of `base` (the parent's
    config) that the spec does not determine (token ids, MTP settings, ...) are carried over. The
    global fields describe the child (the most common shape of each kind). The MTP module of `base`
    keeps its own shape: in nemotron_h it is read from the globals, so a child whose globals differ
    from its MTP blocks is written as nemotron_h_puzzle, with the MTP blocks in `mtp_block_configs`.
    In nemotron_h_puzzle every block has an entry in `block_configs` (see `_entries`); layers_block_type
    uses the names vLLM validates (mamba, attention, moe, mlp; ours: linear, noop).
    """
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"unknown model_type {model_type!r}; choose one of {list(MODEL_TYPES)}")
    base = normalize_config(base or {})
    mtp = mtp_block_specs(base)
    config = {key: value for key, value in base.items() if key not in _OWNED_KEYS}
    globals_ = _global_fields(spec, base)
    reasons = transformers_incompatibilities(spec)
    mtp_conflicts = sorted(
        {
            f"the MTP module's {block.kind} block differs from the child's"
            for block in mtp
            if any(globals_.get(key) != value for key, value in block_config_fields(block).items())
        }
    )
    if model_type == "nemotron_h" and (reasons or mtp_conflicts):
        raise CheckpointError(
            "this model cannot be written as a plain nemotron_h config (transformers' NemotronHForCausalLM): "
            + ", ".join(reasons + mtp_conflicts)
        )
    needs_puzzle = model_type == "nemotron_h_puzzle" or bool(reasons or mtp_conflicts)
    for key in ("mamba_dt_clamp_max", "linear_bias", "sliding_window"):  # written only when set
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
            "layers_block_type": [block.kind for block in spec.blocks],
        }
    )
    if dtype is not None:
        config["dtype"] = _dtype_name(dtype)
        if "torch_dtype" in base:
            config["torch_dtype"] = _dtype_name(dtype)
    if mtp:  # in the names vLLM validates, whatever the parent's writer used
        config["mtp_layers_block_type"] = [block.kind for block in mtp]
    if not needs_puzzle:  # the MTP shape is the globals': only its kinds remain
        config["model_type"] = "nemotron_h"
        config["architectures"] = ["NemotronHForCausalLM"]
        return dict(sorted(config.items()))
    config["model_type"] = "nemotron_h_puzzle"
    config["architectures"] = ["NemotronHPuzzleForCausalLM"]
    config[TOKENIZER_READER_KEY] = dict(TOKENIZER_READER_CONFIG)
    entries = _entries([*spec.blocks, *mtp], config)
    config["block_configs"] = entries[: spec.num_blocks]
    if mtp:
        config["mtp_block_configs"] = entries[spec.num_blocks :]
    _puzzle_moe_globals(config, [*spec.blocks, *mtp])
    return dict(sorted(config.items()))


# Global MoE fields a nemotron_h_puzzle config leaves out, as NVIDIA's Puzzle schema does: every MoE entry
# states them, and a reader that ignored block_configs would build every block at one width and top-k;
# without the globals it fails loudly instead. Likewise the attention window: each windowed entry states it,
# and a global `sliding_window` would read, to tools that look at the global (transformers' config, vLLM's
# model config), as every layer's.
PUZZLE_UNSET_GLOBALS = ("moe_intermediate_size", "num_experts_per_tok", "sliding_window")


def _puzzle_moe_globals(config: dict[str, Any], blocks: list[BlockSpec]) -> None:
    """Drop PUZZLE_UNSET_GLOBALS; the global n_routed_experts is the largest block's (vLLM maps that many)."""
    for key in PUZZLE_UNSET_GLOBALS:
        config.pop(key, None)
    counts = [block.num_experts for block in blocks if isinstance(block, MoESpec)]
    if counts:
        config["n_routed_experts"] = max(counts)
