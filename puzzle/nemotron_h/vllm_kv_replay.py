r"""Which k/v scale each attention layer of a NemotronH checkpoint gets in vLLM's fp8 KV cache, replayed without
vLLM: what `puzzle.nemotron_h.vllm_quant_replay` does for the weights' schemes, for the KV cache scales.

Followed (vLLM sources as read; commits where the index gave one):

- the attention layers: `vllm/model_executor/models/nemotron_h.py` 00b08dc4 (`NemotronHAttention` builds
  `Attention(..., quant_config, prefix=f"{prefix}.attn")` under `model.layers.{i}.mixer`, for each `*` of
  `hybrid_override_pattern`: `puzzle.nemotron_h.vllm_replay.replay`), its `hf_to_vllm_mapper` (prefix
  `backbone` -> `model`, `mtp` -> None; substrings `A_log` -> `A`, `embeddings` -> `embed_tokens`; stacked
  `.q_proj` / `.k_proj` / `.v_proj` -> `.qkv_proj`), and `load_weights` = `AutoWeightsLoader(self)
  .load_weights(weights, mapper=self.hf_to_vllm_mapper)`;
- the names: since vLLM 0.23 (PR #43167, which removed `QuantizationConfig.get_cache_scale`),
  `AutoWeightsLoader` unions the model's mapper with `quant_config.get_cache_scale_mapper()`:
  compressed-tensors' adds the suffixes `.k_proj.output_scale` -> `.attn.k_scale` (and v, q) to the base
  class's regexes (`quantization/base_config.py`: `\.mixer\.[kv]_proj\.([kv])_scale$` -> `.mixer.attn.\1_scale`,
  the default `(?<!\.attn)\.([qkv])_scale$` -> `.attn.\1_scale`, ...). `WeightsMapper._map_name_with_shard`
  (`models/utils.py`) applies its rules in the order regexes, substrings, stacked, prefixes, suffixes, so a
  NemotronH `k_proj.output_scale` becomes `qkv_proj.output_scale` before its suffix rule could match, and
  AutoWeightsLoader finds no such parameter (a ValueError). The base mapper was read from a copy of
  base_config.py whose commit the index did not give; the rule order from an annotated copy of models/utils.py;
- the parameters and their use: `quantization/kv_cache.py` 190900b9 (`BaseKVCacheMethod.create_weights`:
  `q_scale`, `k_scale`, `v_scale`, `prob_scale`, scalars initialised to -1.0; `process_weights_after_loading`:
  with a kv_cache_dtype other than "auto", both k and v loaded (> 0) -> used; neither -> 1.0 (with a warning);
  one -> the larger duplicated; the result becomes `_k_scale` / `_v_scale`);
- the scheme: `compressed_tensors/compressed_tensors.py` be696453 (`CompressedTensorsConfig.get_quant_method`
  gives every `Attention` a `CompressedTensorsKVCacheMethod`, whose `validate_kv_cache_scheme` requires type
  float or 8 bits, strategy "tensor", symmetric). At that commit `from_config` does not pass the
  `kv_cache_scheme` on (later ones do); the replay validates the config's scheme either way.

The cache dtype itself is the server's `--kv-cache-dtype` (`kv_cache_dtype` here): with "auto" the scales
are loaded and ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from puzzle.nemotron_h.vllm_replay import replay

# NemotronHForCausalLM.hf_to_vllm_mapper, and the cache-scale mappers AutoWeightsLoader unions with it.
RENAME_SUBSTR = {"A_log": "A", "embeddings": "embed_tokens"}
RENAME_PREFIX = {"backbone": "model", "mtp": None}
STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj"}
CACHE_SCALE_REGEX = (  # QuantizationConfig.get_cache_scale_mapper (the rules a NemotronH name can meet)
    (re.compile(r"\.kv_scale$"), r".attn.k_scale"),
    (re.compile(r"\.mixer\.[kv]_proj\.([kv])_scale$"), r".mixer.attn.\1_scale"),
    (re.compile(r"(?<!\.attn)\.([qkv])_scale$"), r".attn.\1_scale"),
)
CT_CACHE_SUFFIX = {  # CompressedTensorsConfig.get_cache_scale_mapper
    ".k_proj.output_scale": ".attn.k_scale",
    ".v_proj.output_scale": ".attn.v_scale",
    ".q_proj.output_scale": ".attn.q_scale",
}
SCALE_PARAMS = ("q_scale", "k_scale", "v_scale", "prob_scale")  # BaseKVCacheMethod.create_weights


class VllmKVError(ValueError):
    """vLLM would refuse the checkpoint's KV cache here (the error it raises, replayed)."""


def map_name(name: str) -> str | None:
    """A checkpoint tensor's name as vLLM's NemotronH loader sees it (None: dropped, e.g. MTP)."""
    for pattern, new in CACHE_SCALE_REGEX:
        if pattern.search(name):
            name = pattern.sub(new, name, count=1)
            break
    for substr, new in RENAME_SUBSTR.items():
        if substr in name:
            name = name.replace(substr, new, 1)
    for substr, new in STACKED.items():
        if substr in name:
            name = name.replace(substr, new, 1)
    for prefix, new in RENAME_PREFIX.items():
        if name.startswith(prefix):
            if new is None:
                return None
            name = name.replace(prefix, new, 1)
    for suffix, new in CT_CACHE_SUFFIX.items():
        if name.endswith(suffix):
            name = new.join(name.rsplit(suffix, 1))
    return name


def validate_kv_cache_scheme(scheme: Mapping[str, Any] | None) -> None:
    """CompressedTensorsKVCacheMethod.validate_kv_cache_scheme (VllmKVError where it raises)."""
    if scheme is None:
        return
    if scheme.get("type") != "float" and scheme.get("num_bits") != 8:
        raise VllmKVError(
            "Currently supported kv cache quantization is num_bits=8, type=float, however received "
            f"num_bits={scheme.get('num_bits')}, type={scheme.get('type')}"
        )
    if scheme.get("strategy") != "tensor":
        raise VllmKVError(
            "Only support per-tensor scaling factor for compressed-tensors KV cache. Expected strategy: "
            f"tensor, found strategy: {scheme.get('strategy')}"
        )
    if not scheme.get("symmetric"):
        raise VllmKVError(
            "Only support symmetric scaling factor for compressed-tensors KV cache. However found "
            f"symmetric: {scheme.get('symmetric')}"
        )


@dataclass
class KVReplay:
    """What vLLM ends up with: `scales` {attention layer prefix (`model.layers.3.mixer.attn`): (k, v)}, the
    checkpoint name each loaded parameter came from, and `unexpected` checkpoint scale tensors it has no
    parameter for (AutoWeightsLoader raises on the first one)."""

    scales: dict[str, tuple[float, float]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # vLLM parameter -> checkpoint name
    unexpected: list[str] = field(default_factory=list)


def load_kv_scales(
    config: Mapping[str, Any], tensors: Mapping[str, float], kv_cache_dtype: str = "fp8"
) -> KVReplay:
    """The k/v scales each attention layer of config.json `config` serves with, from the checkpoint's scale
    tensors `tensors` {name: value} (any tensor whose name ends in `_scale` that is not a weight's
    `weight_scale`). VllmKVError for a kv_cache_scheme vLLM refuses."""
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") == "compressed-tensors":
        validate_kv_cache_scheme(quantization.get("kv_cache_scheme"))
    params: dict[str, float] = {}
    layers = []
    for layer in replay(config):
        if layer.char == "*" and not layer.prefix.startswith("mtp.") and layer.unsupported is None:
            prefix = f"model.layers.{layer.index}.mixer.attn"
            layers.append(prefix)
            params.update({f"{prefix}.{name}": -1.0 for name in SCALE_PARAMS})
    out = KVReplay()
    for name, value in tensors.items():
        mapped = map_name(name)
        if mapped is None:
            continue
        if mapped not in params:
            out.unexpected.append(f"{name} -> {mapped}")
            continue
        params[mapped] = float(value)  # default_weight_loader: a one-element tensor fills the scalar
        out.sources[mapped] = name
    for prefix in layers:
        k, v = params[f"{prefix}.k_scale"], params[f"{prefix}.v_scale"]
        if kv_cache_dtype == "auto":
            k = v = 1.0
        elif k > 0 and v > 0:
            pass
        elif k < 0 and v < 0:
            k = v = 1.0
        else:
            k = v = max(k, v)
        out.scales[prefix] = (k, v)
    return out


__all__ = ["KVReplay", "VllmKVError", "load_kv_scales", "map_name", "validate_kv_cache_scheme"]
