"""What vLLM builds from a NemotronH checkpoint, layer by layer, replayed without vLLM.

Followed: vLLM's `vllm/model_executor/models/nemotron_h.py` at commit 00b08dc44519a82cbdd9061d92d1226985094622
(`NemotronHModel.__init__.get_layer`, the decoder layers `NemotronHMambaDecoderLayer`, `NemotronHMLPDecoderLayer`,
`NemotronHAttentionDecoderLayer`, `NemotronHMoEDecoderLayer`, the mixers `MambaMixer2`, `NemotronHMLP`,
`NemotronHAttention`, `NemotronHMoE`) and `vllm/model_executor/models/nemotron_h_mtp.py` at commit
01ca27739feb561c668e843bf55ca96845056e05 (`NemotronHMultiTokenPredictor.__init__`).

vLLM's config registry has no nemotron_h_puzzle, so for those checkpoints it takes the trust_remote_code class
(our `remote/configuration_nemotron_h_puzzle.py`); plain nemotron_h gets vLLM's own NemotronHConfig, here the
config.json fields over transformers' defaults (the same defaults). Then, for layer i of
`hybrid_override_pattern` (MTP layer j: `mtp_hybrid_override_pattern`, layer index num_hidden_layers + j):

- a character other than M, -, *, E: vLLM raises "Unsupported layer type";
- Mamba (M): built from the GLOBAL config (it never asks for a per-layer one), and so is the Mamba state cache;
- MLP (-), attention (*), MoE (E): built from `config.get_nemotron_h_config_for_layer(i)` when the config class
  has that method, else from the global config.

`replay` lists, per layer, every tensor vLLM allocates (checkpoint name -> shape; expert banks as the
checkpoint's per-expert tensors, which vLLM's loader stacks) and the top-k it routes with. `mismatches`
compares that with a checkpoint's tensors and the child's spec: a tensor vLLM allocates that the checkpoint
lacks or has in another shape, a checkpoint tensor vLLM has no parameter for, an unsupported layer, and a
block whose fields as vLLM reads them (per-layer or global config) describe another block than the child's
(a different top-k, routing setting, Mamba chunk size or dt clamp, ...). Fields vLLM reads but does not turn into tensors (activations, dt clamps) are checked
per kind in `puzzle.nemotron_h.engines.VLLM_RULES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from types import SimpleNamespace
from typing import Any

from puzzle.nemotron_h.config import DEFAULTS, block_kinds, block_spec_from_fields, normalize_config
from puzzle.spec import BlockSpec, ModelSpec, SpecError

VLLM_COMMIT = "00b08dc44519a82cbdd9061d92d1226985094622"  # nemotron_h.py as read
VLLM_LAYER_TYPES = "M-*E"  # ALL_DECODER_LAYER_TYPES in nemotron_h.py
Shapes = dict[str, tuple[int, ...]]
_CHARS = {"mamba": "M", "attention": "*", "moe": "E", "mlp": "-"}
_KINDS = {char: kind for kind, char in _CHARS.items()}


@dataclass
class LayerReplay:
    """What vLLM builds for one layer: its checkpoint prefix, pattern character, tensors, top-k, or why not."""

    index: int  # the block index (main blocks), or num_hidden_layers + j for MTP layer j
    prefix: str  # checkpoint name prefix of the layer's tensors
    char: str
    tensors: Shapes = field(default_factory=dict)
    top_k: int | None = None
    unsupported: str | None = None  # why vLLM cannot build the layer at all
    fields: dict[str, Any] = field(default_factory=dict)  # the config fields the layer was built from
    per_layer: bool = False  # built from get_nemotron_h_config_for_layer(index), not the global config


def config_object(config: Mapping[str, Any]) -> Any:
    """The config object vLLM's model code reads for `config` (a config.json dict)."""
    if config.get("model_type") == "nemotron_h_puzzle":
        from puzzle.nemotron_h.remote.configuration_nemotron_h_puzzle import NemotronHPuzzleConfig

        return NemotronHPuzzleConfig.from_dict(dict(config))
    fields = {**DEFAULTS, **normalize_config(config)}
    pattern = "".join(_CHARS.get(kind, "?") for kind in block_kinds(fields))
    mtp = fields.get("mtp_hybrid_override_pattern") or "".join(
        _CHARS.get(kind, "?") for kind in fields.get("mtp_layers_block_type") or ["attention", "moe"]
    )
    return SimpleNamespace(
        **{**fields, "hybrid_override_pattern": pattern, "mtp_hybrid_override_pattern": mtp}
    )


def _linear(shapes: Shapes, name: str, out: int, inp: int, bias: bool) -> None:
    shapes[f"{name}.weight"] = (out, inp)
    if bias:
        shapes[f"{name}.bias"] = (out,)


def mamba_shapes(config: Any, hidden: int) -> Shapes:
    """MambaMixer2 as NemotronHMambaDecoderLayer builds it, from the global config (ckpt names: A_log, dt_bias)."""
    heads, head_dim = config.mamba_num_heads, config.mamba_head_dim
    inner = heads * head_dim
    groups_state = config.n_groups * config.ssm_state_size
    conv_dim = inner + 2 * groups_state
    shapes: Shapes = {}
    _linear(shapes, "in_proj", 2 * inner + 2 * groups_state + heads, hidden, bool(config.use_bias))
    shapes["conv1d.weight"] = (conv_dim, 1, config.conv_kernel)
    if config.use_conv_bias:
        shapes["conv1d.bias"] = (conv_dim,)
    shapes.update({"A_log": (heads,), "D": (heads,), "dt_bias": (heads,), "norm.weight": (inner,)})
    _linear(shapes, "out_proj", hidden, inner, bool(config.use_bias))
    return shapes


def mlp_width(config: Any, pattern: str, index: int) -> int:
    """NemotronHMLPDecoderLayer: intermediate_size, or its entry for this MLP layer when it is a list."""
    width = config.intermediate_size
    if isinstance(width, list):
        return width[0] if len(width) == 1 else width[pattern[: index + 1].count("-") - 1]
    return width


def mlp_shapes(config: Any, width: int) -> Shapes:
    shapes: Shapes = {}
    _linear(shapes, "up_proj", width, config.hidden_size, bool(config.mlp_bias))
    _linear(shapes, "down_proj", config.hidden_size, width, bool(config.mlp_bias))
    return shapes


def attention_shapes(config: Any) -> Shapes:
    """NemotronHAttention: head_dim from the config, else hidden / heads; q/k/v/o without bias. It also reads
    `getattr(config, "sliding_window", None)` as the layer's window (no tensor: `_layer` records the field)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    shapes: Shapes = {}
    for name, out in (
        ("q_proj", heads * head_dim),
        ("k_proj", kv_heads * head_dim),
        ("v_proj", kv_heads * head_dim),
    ):
        _linear(shapes, name, out, config.hidden_size, False)
    _linear(shapes, "o_proj", config.hidden_size, heads * head_dim, False)
    return shapes


def moe_shapes(config: Any) -> tuple[Shapes, str | None]:
    """NemotronHMoE: router and bias, one fused expert bank of one width, shared experts, latent projections."""
    experts, hidden = config.n_routed_experts, config.hidden_size
    latent = getattr(config, "moe_latent_size", None)
    moe_hidden = hidden if latent is None else latent
    shapes: Shapes = {"gate.weight": (experts, hidden), "gate.e_score_correction_bias": (experts,)}
    width = config.moe_intermediate_size
    problem = None
    if isinstance(width, (list, tuple)):
        problem = (
            f"moe_intermediate_size {list(width)} is a list: vLLM's FusedMoE takes one intermediate_size"
        )
    else:
        for expert in range(experts):  # the checkpoint's per-expert tensors vLLM stacks into w13 / w2
            shapes[f"experts.{expert}.up_proj.weight"] = (width, moe_hidden)
            shapes[f"experts.{expert}.down_proj.weight"] = (moe_hidden, width)
    if config.n_shared_experts:
        shared = config.moe_shared_expert_intermediate_size * config.n_shared_experts
        shapes.update({f"shared_experts.{k}": v for k, v in mlp_shapes(config, shared).items()})
    if latent is not None:
        _linear(shapes, "fc1_latent_proj", latent, hidden, bool(config.mlp_bias))
        _linear(shapes, "fc2_latent_proj", hidden, latent, bool(config.mlp_bias))
    return shapes, problem


def start_layer(index: int, char: str, engine: str, prefix: str | None = None) -> LayerReplay:
    """The replay of layer `index` (pattern character `char`), marked unsupported when `char` is no NemotronH
    layer type of `engine` (vLLM, SGLang and TensorRT-LLM all raise on it). `prefix`: default backbone.layers.i."""
    layer = LayerReplay(index, f"backbone.layers.{index}" if prefix is None else prefix, char)
    if char not in VLLM_LAYER_TYPES:
        layer.unsupported = (
            f"{engine} raises on layer type {char!r} (its NemotronH layers are {VLLM_LAYER_TYPES})"
        )
    return layer


def build_layer(
    layer: LayerReplay, config: Any, built_from: Any, width: Callable[[], int], engine: str
) -> LayerReplay:
    """`layer`'s mixer as an engine builds it: Mamba from the global `config` always, the MLP (`width()` wide),
    attention and MoE from `built_from` (the global config or the engine's per-layer one). A field the
    config lacks is the layer's unsupported reason, naming `engine`."""
    char = layer.char
    try:
        if char == "M":
            mixer = mamba_shapes(config, config.hidden_size)
        elif char == "-":
            mixer = mlp_shapes(built_from, width())
        elif char == "*":
            mixer = attention_shapes(built_from)
        else:
            mixer, problem = moe_shapes(built_from)
            layer.unsupported = problem and problem.replace("vLLM", engine)
            layer.top_k = built_from.num_experts_per_tok
    except (AttributeError, IndexError) as error:  # a field the engine reads that the config does not have
        layer.unsupported = f"{engine} reads a config field the config lacks: {error}"
        return layer
    return built(layer, config, config if char == "M" else built_from, mixer)


def _layer(config: Any, index: int, char: str, prefix: str, pattern: str) -> LayerReplay:
    """One decoder layer as vLLM's get_layer builds it (the MTP layers add their fusion tensors, not compared)."""
    layer = start_layer(index, char, "vLLM", prefix)
    if layer.unsupported is not None:
        return layer
    get_layer_config = getattr(config, "get_nemotron_h_config_for_layer", None)
    layer_config = config if char == "M" or get_layer_config is None else get_layer_config(index)
    return build_layer(layer, config, layer_config, lambda: mlp_width(layer_config, pattern, index), "vLLM")


def built(layer: LayerReplay, config: Any, built_from: Any, mixer: Shapes) -> LayerReplay:
    """`layer` as built from `built_from` (the global `config` or a per-layer copy), its mixer `mixer`."""
    layer.per_layer = built_from is not config
    layer.fields = {
        key: getattr(built_from, key) for key in (*DEFAULTS, "hidden_size") if hasattr(built_from, key)
    }
    layer.tensors = {f"{layer.prefix}.mixer.{name}": shape for name, shape in mixer.items()}
    layer.tensors[f"{layer.prefix}.norm.weight"] = (config.hidden_size,)
    return layer


def replay(config: Mapping[str, Any]) -> list[LayerReplay]:
    """Every layer vLLM builds for config.json `config`: the main layers, then the MTP layers (if any)."""
    obj = config_object(config)
    pattern = obj.hybrid_override_pattern
    layers = [_layer(obj, i, char, f"backbone.layers.{i}", pattern) for i, char in enumerate(pattern)]
    if getattr(obj, "num_nextn_predict_layers", 0):
        mtp_pattern = getattr(obj, "mtp_hybrid_override_pattern", None) or ""
        start = len(pattern)
        layers += [
            _layer(obj, start + j, char, f"mtp.layers.{j}", mtp_pattern) for j, char in enumerate(mtp_pattern)
        ]
    return layers


def _layer_tensors(shapes: Mapping[str, tuple[int, ...]], prefix: str) -> Shapes:
    """The checkpoint's tensors of one layer: its mixer and its pre-norm (MTP fusion tensors excluded)."""
    return {
        name: tuple(shape)
        for name, shape in shapes.items()
        if name.startswith(f"{prefix}.mixer.") or name == f"{prefix}.norm.weight"
    }


def _read_differences(layer: LayerReplay, block: BlockSpec, engine: str = "vLLM") -> str | None:
    """How the block `engine`'s config fields describe differs from the child's `block` (None: it does not)."""
    try:
        read = block_spec_from_fields(block.kind, {**DEFAULTS, **layer.fields})
    except (SpecError, KeyError, TypeError) as error:
        return f"{engine}'s config fields for it do not describe a {block.kind} block: {error}"
    # The weight format is no config field an engine builds the layer from: it reads each module's scheme
    # from the quantization config (quantization_config, or TensorRT-LLM's hf_quant_config.json), replayed apart.
    differs = [
        f"{name} {getattr(read, name)!r} (the child: {getattr(block, name)!r})"
        for name in (f.name for f in dataclass_fields(block))
        if name != "weight_format" and getattr(read, name) != getattr(block, name)
    ]
    if not differs:
        return None
    source = "its per-layer config" if layer.per_layer else "the global fields"
    return f"{engine} builds it from {source}, which give " + ", ".join(differs)


def mismatches(
    config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], spec: ModelSpec | None = None
) -> list[tuple[int, str]]:
    """(block index, why) for every way vLLM would build the checkpoint (`config`, tensor `shapes`) otherwise.

    `spec`: the child (its top-k per MoE block is compared with what vLLM routes). MTP layers (index
    num_hidden_layers + j) are compared on the tensors the checkpoint carries for them, as carried
    unchanged from the parent; the main layers on every tensor.
    """
    return compare(replay(config), shapes, spec)


def compare(
    layers: list[LayerReplay],
    shapes: Mapping[str, tuple[int, ...]],
    spec: ModelSpec | None = None,
    engine: str = "vLLM",
) -> list[tuple[int, str]]:
    """`mismatches` for the layers an engine's replay (this one, sglang_replay, trtllm_replay) builds."""
    found = []
    for layer in layers:
        if layer.unsupported is not None:
            found.append((layer.index, layer.unsupported))
            continue
        have = _layer_tensors(shapes, layer.prefix)
        is_mtp = layer.prefix.startswith("mtp.")
        missing = [name for name in layer.tensors if name not in have and not is_mtp]
        unexpected = [name for name in have if name not in layer.tensors]
        wrong = [
            f"{name} {list(have[name])} ({engine} allocates {list(shape)})"
            for name, shape in layer.tensors.items()
            if name in have and have[name] != shape
        ]
        for label, names in (
            ("missing", missing),
            (f"without a {engine} parameter", unexpected),
            ("shape", wrong),
        ):
            if names:
                names = sorted(names)
                shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                found.append((layer.index, f"checkpoint tensors {label}: {shown}"))
        block = spec.blocks[layer.index] if spec is not None and layer.index < spec.num_blocks else None
        if block is None or _KINDS.get(layer.char) != block.kind:
            continue
        difference = _read_differences(layer, block, engine)
        if difference is not None:
            found.append((layer.index, difference))
    return found
