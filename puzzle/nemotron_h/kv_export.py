r"""A KV-fp8 child's scales in a checkpoint: compressed-tensors' `kv_cache_scheme` and per-layer `k_scale` / `v_scale`.

Written: `quantization_config.kv_cache_scheme` = `KV_CACHE_SCHEME` (compressed-tensors' `QuantizationArgs`
of an fp8 E4M3, per-tensor, static, symmetric cache) and, per attention layer i, the fp32 [1] tensors
`backbone.layers.{i}.mixer.k_scale` and `.v_scale` (`puzzle.kv_cache`: amax / 448 of the layer's keys and
values over the calibration tokens).

Why these names. compressed-tensors 0.20.1 (the version the `[quant]` extra installs) keeps KV cache
scales as parameters of the attention module itself, `k_scale` / `v_scale` (`quantization/quant_metadata.py`
`KVCacheScaleType`, `lifecycle/initialize.py` `initialize_attn_qparams`): the attention module of a
NemotronH layer is its `mixer`. vLLM maps a checkpoint's `*.k_scale` / `*.v_scale` onto the `Attention`
layer's `attn.k_scale` / `attn.v_scale` (`model_executor/model_loader/weight_utils.py`
`maybe_remap_kv_scale_name`, default pattern `\.([kv])_scale$` -> `.attn.\1_scale`; since vLLM 0.23 the
same rule in `QuantizationConfig.get_cache_scale_mapper`, applied by `AutoWeightsLoader`), and NemotronH's
attention is `model.layers.{i}.mixer.attn` (`models/nemotron_h.py` 00b08dc4, `NemotronHAttention`). Older
compressed-tensors wrote `k_proj.output_scale` instead, which vLLM's compressed-tensors config maps to
`attn.k_scale` by a suffix rule (`CompressedTensorsConfig.get_cache_scale`, be696453); for NemotronH such
a name also meets the loader's stacked rename `.k_proj` -> `.qkv_proj` (`hf_to_vllm_mapper`), which a
weights mapper applies before suffixes, so it is not written. `puzzle.nemotron_h.vllm_kv_replay` replays
both paths and checks that every attention layer gets its scales.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from puzzle.kv_cache import kv_scales
from puzzle.nemotron_h.config import CheckpointError
from puzzle.nemotron_h.weights import TensorSource, read_tensor

# compressed-tensors QuantizationArgs of vLLM's fp8 (E4M3) cache with static per-tensor scales, as
# CompressedTensorsKVCacheMethod.validate_kv_cache_scheme accepts it (float, 8 bits, strategy tensor,
# symmetric); `dynamic: false`: the scales are the checkpoint's, not computed by the server.
KV_CACHE_SCHEME: dict[str, Any] = {
    "num_bits": 8,
    "type": "float",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
}
_SCALE_KEY = re.compile(r"layers\.(\d+)\.mixer\.([kv])_scale")


def scale_names(index: int, prefix: str = "backbone.") -> tuple[str, str]:
    """The checkpoint names of block `index`'s k and v scales."""
    return f"{prefix}layers.{index}.mixer.k_scale", f"{prefix}layers.{index}.mixer.v_scale"


def scale_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """{checkpoint name: fp32 [1] tensor} of `model`'s KV scales (`puzzle.kv_cache.kv_scales`); {} for none."""
    out = {}
    for index, pair in kv_scales(model).items():
        for name, value in zip(scale_names(index), pair):
            out[name] = torch.tensor([value], dtype=torch.float32)
    return out


def kv_model_type(model: nn.Module, model_type: str) -> str:
    """The model_type a save writes for `model`: a KV-fp8 model's "auto" is "nemotron_h_puzzle", whose
    remote code applies the scales; plain transformers' NemotronHForCausalLM would load and ignore them (its
    attention is no module compressed-tensors hooks, and it has no k_scale / v_scale), so "nemotron_h" is
    refused (CheckpointError). Any other model keeps `model_type`."""
    if not kv_scales(model):
        return model_type
    if model_type == "nemotron_h":
        raise CheckpointError(
            "a model with an fp8 KV cache cannot be written as a plain nemotron_h config: transformers' "
            "NemotronHForCausalLM would ignore its k_scale / v_scale; write nemotron_h_puzzle (or 'auto')"
        )
    return "nemotron_h_puzzle"


# What each engine of `puzzle.nemotron_h.engines.ENGINES` does with these scales, where it does not serve them.
# vLLM: `puzzle.nemotron_h.vllm_kv_replay`. SGLang (models/nemotron_h.py 02c60328, `load_weights`: `backbone.` ->
# `model.`, `maybe_remap_kv_scale_name` for a `*_scale` it has no parameter for, onto RadixAttention's
# `attn.k_scale`) reads them by the same names; not replayed here.
KV_ENGINE_PROBLEMS = {
    "llama.cpp": "an fp8 KV cache with per-layer scales: llama.cpp's cache types (f16, q8_0, q4_0, ...) take "
    "no scales; export the child without them for llama.cpp",
    "transformers": "an fp8 KV cache: plain NemotronHForCausalLM loads k_scale / v_scale as unexpected keys and "
    "runs an unquantized cache, so the export is nemotron_h_puzzle (trust_remote_code applies them)",
    "trtllm": "an fp8 KV cache: TensorRT-LLM takes KV cache quantization from ModelOpt's hf_quant_config.json "
    "(kv_cache_quant_algo), not compressed-tensors' kv_cache_scheme",
}


def kv_engine_problems(model: nn.Module) -> dict[str, list[str]]:
    """{engine: [why it does not serve `model`'s fp8 KV cache as puzzle computes it]} ({} without one)."""
    if not kv_scales(model):
        return {}
    return {engine: [reason] for engine, reason in KV_ENGINE_PROBLEMS.items()}


def with_kv_cache_scheme(quantization_config: Mapping[str, Any]) -> dict[str, Any]:
    """A compressed-tensors `quantization_config` with the fp8 `kv_cache_scheme` added."""
    return {**quantization_config, "kv_cache_scheme": dict(KV_CACHE_SCHEME)}


def check_kv_cache_scheme(config: Mapping[str, Any], where: str) -> bool:
    """True when config.json's `quantization_config` has a `kv_cache_scheme` (it must be `KV_CACHE_SCHEME`:
    CheckpointError for another one, e.g. a dynamic or per-head cache puzzle does not compute)."""
    scheme = (config.get("quantization_config") or {}).get("kv_cache_scheme")
    if scheme is None:
        return False
    found = {key: scheme.get(key) for key in KV_CACHE_SCHEME}
    if found != KV_CACHE_SCHEME:
        raise CheckpointError(
            f"{where}: quantization_config.kv_cache_scheme is {dict(scheme)}; puzzle reads an fp8 cache with "
            f"static per-tensor scales only ({KV_CACHE_SCHEME})"
        )
    return True


def take_scales(
    sources: Mapping[str, TensorSource],
) -> tuple[dict[str, TensorSource], dict[int, dict[str, TensorSource]]]:
    """`map_checkpoint`'s sources without the KV scales, and those: {block index: {"k": source, "v": source}}."""
    rest: dict[str, TensorSource] = {}
    taken: dict[int, dict[str, TensorSource]] = {}
    for key, source in sources.items():
        match = _SCALE_KEY.fullmatch(key)
        if match is None:
            rest[key] = source
        else:
            taken.setdefault(int(match.group(1)), {})[match.group(2)] = source
    return rest, taken


def read_scales(
    handles: Mapping[Path, Any], taken: Mapping[int, Mapping[str, TensorSource]], where: str
) -> dict[int, tuple[float, float]]:
    """{block index: (k_scale, v_scale)} read from the `take_scales` sources; CheckpointError for a layer with
    only one of the two or a scale that is not one number."""
    out = {}
    for index, pair in sorted(taken.items()):
        if set(pair) != {"k", "v"}:
            raise CheckpointError(f"{where}: layer {index} has a {'/'.join(pair)}_scale but not both k and v")
        values = []
        for half in ("k", "v"):
            source = pair[half]
            tensor = read_tensor(handles[source.file], source.file, source.key, source.expert)
            if tensor.numel() != 1:
                raise CheckpointError(
                    f"{source.file.name}: {source.key!r} has shape {list(tensor.shape)}; a per-tensor KV "
                    "scale is one number"
                )
            values.append(float(tensor.float().reshape(())))
        out[index] = (values[0], values[1])
    return out


__all__ = [
    "KV_CACHE_SCHEME",
    "KV_ENGINE_PROBLEMS",
    "check_kv_cache_scheme",
    "kv_engine_problems",
    "kv_model_type",
    "read_scales",
    "scale_names",
    "scale_tensors",
    "take_scales",
    "with_kv_cache_scheme",
]
