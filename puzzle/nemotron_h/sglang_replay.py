"""What SGLang builds from a NemotronH checkpoint, layer by layer, replayed without SGLang.

Followed: sgl-project/sglang `python/sglang/srt/models/nemotron_h.py` at commit
02c60328e56db1c91b639859469b61c103ca2e7f (`NemotronHModel.__init__.get_layer`, `NemotronHMambaDecoderLayer`,
`NemotronHMLPDecoderLayer`, `NemotronHAttentionDecoderLayer`, `NemotronHMoEDecoderLayer`, `NemotronHMoE`,
`NemotronHAttention`, `NemotronHForCausalLM.load_weights`; `EntryClass` holds `NemotronHPuzzleForCausalLM`)
and `python/sglang/srt/configs/nemotron_h.py` at commit 01144484d28d8adb6a4714a23ad6f4bf68fb188d
(`NemotronHConfig`, `NemotronHPuzzleConfig`: model_type nemotron_h_puzzle, SGLang's own config class, no
trust_remote_code needed; its `get_nemotron_h_config_for_layer(i)` is a copy of the config with every key of
`block_configs[i]` set on it; plain NemotronHConfig returns itself).

For layer i of `hybrid_override_pattern` (ALL_DECODER_LAYER_TYPES: M, -, *, E; anything else a KeyError):

- Mamba (M): the GLOBAL config (`MambaMixer2(cache_params=config.mamba2_cache_params, ...)`), and so is the
  Mamba state cache (`mamba2_cache_params`: one shape for every Mamba layer);
- MLP (-): the GLOBAL config: `intermediate_size`, or its entry for this MLP layer when it is a list
  (index = the count of "-" up to layer i, minus one); `mlp_bias` global;
- attention (*): `get_nemotron_h_config_for_layer(i)`: heads, KV heads, head_dim, sliding_window per layer;
- MoE (E): `get_nemotron_h_config_for_layer(i)`: n_routed_experts, num_experts_per_tok,
  moe_intermediate_size (one int: FusedMoE takes one width), n_shared_experts and
  moe_shared_expert_intermediate_size, moe_latent_size, routing (n_group, topk_group, norm_topk_prob,
  routed_scaling_factor) per layer; the loader's expert mapping spans `max_n_routed_experts` (the largest
  block's count), so fewer experts in a block load.

So the issue's claim holds: per-layer config for MoE and attention, global for MLP and Mamba. SGLang's KV
pool (outside nemotron_h.py) is laid out for one attention shape, as vLLM's: `engines.SGLANG_RULES` keeps
vLLM's conservative one-attention-shape rule. The MTP module is not replayed (its tensors are carried as is).
Quantization: SGLang reads `quantization_config` from config.json (compressed-tensors included) per module,
as vLLM does; the tensors compared here are the ones the export writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from puzzle.nemotron_h.vllm_replay import (
    LayerReplay,
    build_layer,
    compare,
    config_object,
    mlp_width,
    start_layer,
)
from puzzle.spec import ModelSpec

SGLANG_COMMIT = "02c60328e56db1c91b639859469b61c103ca2e7f"  # models/nemotron_h.py as read
SGLANG_CONFIG_COMMIT = "01144484d28d8adb6a4714a23ad6f4bf68fb188d"  # configs/nemotron_h.py as read
PER_LAYER = ("*", "E")  # the layer kinds SGLang builds from get_nemotron_h_config_for_layer(i)


def _layer(config: Any, index: int, char: str, pattern: str) -> LayerReplay:
    layer = start_layer(index, char, "SGLang")
    if layer.unsupported is not None:
        return layer
    get_layer_config = getattr(config, "get_nemotron_h_config_for_layer", None)
    per_layer = char in PER_LAYER and get_layer_config is not None
    built_from = get_layer_config(index) if per_layer else config
    return build_layer(layer, config, built_from, lambda: mlp_width(config, pattern, index), "SGLang")


def replay(config: Mapping[str, Any]) -> list[LayerReplay]:
    """Every main layer SGLang builds for config.json `config`."""
    obj = config_object(config)
    pattern = obj.hybrid_override_pattern
    return [_layer(obj, i, char, pattern) for i, char in enumerate(pattern)]


def mismatches(
    config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], spec: ModelSpec | None = None
) -> list[tuple[int, str]]:
    """(block index, why) for every way SGLang would build the checkpoint (`config`, `shapes`) otherwise."""
    main = {name: shape for name, shape in shapes.items() if not name.startswith("mtp.")}
    return compare(replay(config), main, spec, engine="SGLang")
