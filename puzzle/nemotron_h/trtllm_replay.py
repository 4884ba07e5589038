"""What TensorRT-LLM (PyTorch backend) builds from a NemotronH checkpoint, layer by layer, replayed without it.

Followed: NVIDIA/TensorRT-LLM `tensorrt_llm/_torch/models/modeling_nemotron_h.py` at commit
00620eb025e7c24895986e1042380bd1be4426d9 (`NemotronHPuzzleConfig`: a bare PretrainedConfig, model_type
nemotron_h_puzzle; `_get_layer_moe_param`, `MLPLayer`, `TransformerLayer`, `NemotronHMOE`, `NemotronHLayer`,
`NemotronHModel.__init__`, `NemotronHForCausalLM._normalize_puzzle_config`; both NemotronHForCausalLM and
NemotronHPuzzleForCausalLM are registered).

For layer i of `hybrid_override_pattern` (NemotronHLayer: M, -, *, E; anything else a ValueError):

- Mamba (M): the GLOBAL config (Mamba2Mixer: ssm_state_size, conv_kernel, mamba_num_heads, n_groups,
  mamba_head_dim, chunk_size): one Mamba shape;
- MLP (-): the GLOBAL `intermediate_size`; when it is a list of more than one entry, entry i, the LAYER index
  (not the MLP index, as vLLM and SGLang take it);
- attention (*): the GLOBAL config (num_attention_heads, num_key_value_heads): one attention shape, KV heads
  global; it never looks at block_configs;
- MoE (E): `_get_layer_moe_param(config, i, name)`: block_configs[i][name] when not null, else the global, for
  exactly moe_intermediate_size (a list: its first entry), moe_latent_size, n_routed_experts,
  num_experts_per_tok, moe_shared_expert_intermediate_size. Global: n_shared_experts, n_group, topk_group,
  routed_scaling_factor, mlp_bias. `_normalize_puzzle_config` fills those five globals from the first MoE
  entry when config.json lacks them.

So the issue's claim holds: block_configs for those five MoE fields, KV heads (and all attention, Mamba and
MLP shapes) global. A per-expert width is read as its first entry. The MTP module is not replayed.

Quantization: TensorRT-LLM reads ModelOpt's `hf_quant_config.json` (quant_algo, MIXED_PRECISION with a
per-layer `quantized_layers` table: `model_config.quant_config_dict`, looked up per MoE layer and per layer
for NVFP4); an engine export for it writes that layout (`puzzle.nemotron_h.modelopt`), whose reading
`puzzle.nemotron_h.trtllm_quant_replay` replays (module algos, tensors, dequantized values).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from puzzle.nemotron_h.vllm_replay import LayerReplay, build_layer, compare, config_object, start_layer
from puzzle.spec import ModelSpec

TRTLLM_COMMIT = "00620eb025e7c24895986e1042380bd1be4426d9"  # _torch/models/modeling_nemotron_h.py as read
# The MoE fields _get_layer_moe_param reads from block_configs[i] (else the global).
PER_LAYER_MOE = (
    "moe_intermediate_size",
    "moe_latent_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_shared_expert_intermediate_size",
)


def _entry(config: Any, index: int) -> dict[str, Any]:
    entries = getattr(config, "block_configs", None) or []
    return dict(entries[index]) if index < len(entries) else {}


def _moe_config(config: Any, index: int) -> Any:
    """The global config with the five per-layer MoE fields of block_configs[index] (non-null) set on it."""
    layer = copy.copy(config)
    entry = _entry(config, index)
    for name in PER_LAYER_MOE:
        value = entry.get(name)
        if value is not None:
            setattr(layer, name, value)
    width = layer.moe_intermediate_size
    if isinstance(width, (list, tuple)):
        layer.moe_intermediate_size = width[0]  # NemotronHMOE: moe_intermediate[0] if a list
    return layer


def _mlp_width(config: Any, index: int) -> int:
    width = config.intermediate_size
    if isinstance(width, list):
        return width[0] if len(width) == 1 else width[index]  # MLPLayer indexes by the layer
    return width


def _layer(config: Any, index: int, char: str) -> LayerReplay:
    layer = start_layer(index, char, "TensorRT-LLM")
    if layer.unsupported is not None:
        return layer
    built_from = _moe_config(config, index) if char == "E" else config
    return build_layer(layer, config, built_from, lambda: _mlp_width(config, index), "TensorRT-LLM")


def replay(config: Mapping[str, Any]) -> list[LayerReplay]:
    """Every main layer TensorRT-LLM builds for config.json `config`."""
    obj = config_object(config)
    return [_layer(obj, i, char) for i, char in enumerate(obj.hybrid_override_pattern)]


def mismatches(
    config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], spec: ModelSpec | None = None
) -> list[tuple[int, str]]:
    """(block index, why) for every way TensorRT-LLM would build the checkpoint (`config`, `shapes`) otherwise."""
    main = {name: shape for name, shape in shapes.items() if not name.startswith("mtp.")}
    return compare(replay(config), main, spec, engine="TensorRT-LLM")
