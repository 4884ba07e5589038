"""Quantized NemotronH checkpoints in NVIDIA ModelOpt's layout, the one TensorRT-LLM loads: `hf_quant_config.json`
with a MIXED_PRECISION per-layer table, and ModelOpt's tensor names and scale conventions.

Why a second layout (`puzzle.nemotron_h.quantized` writes compressed-tensors for vLLM and SGLang): TensorRT-LLM
reads compressed-tensors too (`tensorrt_llm/models/quant_config_utils.py`, commit
21156a7a57acd21e17feb5c2721c30f035e0f2af, `_quant_config_from_config_group`), but its nvfp4 branch indexes
`input_activations["strategy"]` and accepts only "tensor_group" (W4A4): our weight-only NVFP4A16 group has
`input_activations: null`, so a mixed fp8 + nvfp4 compressed-tensors export fails there (the reported failure).
Its own format is ModelOpt's (`tensorrt_llm/_torch/model_config.py`, commit
008e0af8980fc560003631ba4ac37828836a91c8, `load_modelopt_quant_config` / `_build_modelopt_quant_config`;
`tensorrt_llm/quantization/modelopt_config.py`, commit 2edf354d4b92161efd50b10b71e8e20fb6c5925a, the legacy
shape `{"producer": {"name": "modelopt"}, "quantization": {...}}`):

- `quantization.quant_algo` "MIXED_PRECISION", and `quantized_layers` {module name: {"quant_algo", "group_size"}}:
  one QuantConfig per named module; a module not named stays unquantized (the global MIXED_PRECISION is
  QuantMode 0), so bf16 blocks stay bf16. `kv_cache_quant_algo` null (no fp8 KV cache in this layout).
- module names are the checkpoint's (`backbone.layers.{i}.mixer.in_proj`); NemotronHForCausalLM renames
  `backbone` to `model` in the table (`modeling_nemotron_h.py`, commit 00620eb025e7c24895986e1042380bd1be4426d9),
  and `DecoderModelForCausalLM.apply_layerwise_quant_config` (`_torch/models/modeling_utils.py`) gives a plain
  Linear the entry of its exact name, the fused qkv_proj the entry of its `q_proj`, and a fused MoE the first
  entry containing its name (`...mixer.experts`, so its per-expert entries `...experts.{e}.up_proj`).
- fp8 -> "FP8_PER_CHANNEL_PER_TOKEN" (`FP8RowwiseLinearMethod`, `_torch/modules/linear.py`): `weight`
  float8_e4m3fn [out, in], `weight_scale` fp32 [out] (1-D: our compressed-tensors [out, 1] does not copy into
  it), activations quantized per token at run time, as our fp8 forward does. Its fused MoE has no such path
  (`CutlassFusedMoE._QUANT_SUPPORT_TABLE`, `_torch/modules/fused_moe/fused_moe_cutlass.py`: per-tensor FP8
  with a static input scale, or 128x128 FP8 block scales): an fp8 MoE block is refused (`layout_problems`).
- nvfp4 -> "W4A16_NVFP4", group_size 16 (`W4A16NVFP4LinearMethod`, and the CUTLASS MoE's W4A16 entry): `weight`
  uint8 [out, in/2] (E2M1 pairs, even column in the low nibble, as `puzzle.quant.pack_e2m1`), `weight_scale`
  float8_e4m3fn [out, in/16], `weight_scale_2` fp32 [] = g, the DECODE global scale (NVFP4LinearMethod:
  "modelopt ckpt stores amax/(448*6)"; the value = e2m1 * weight_scale * weight_scale_2). compressed-tensors
  stores the inverse, `weight_global_scale` = 1 / g: the two conventions are inverted. Weight-only: no
  `input_scale` (the W4A16 method keeps activations in bf16 and no input scale).
- q/k/v of a block share one nvfp4 g (TensorRT-LLM's fused-qkv loader asserts equal `weight_scale_2`s), as the
  compressed-tensors export already does.

config.json carries the same table inline as ModelOpt writes it (`quantization_config`, quant_method
"modelopt"); TensorRT-LLM takes hf_quant_config.json and only warns if the inline one differs. `puzzle.load`
reads compressed-tensors exports back, not this layout (it refuses quant_method "modelopt" with its message).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from puzzle.formats import NVFP4_BLOCK
from puzzle.nemotron_h.stream import Entry
from puzzle.quant import quantize_fp8, quantize_nvfp4
from puzzle.spec import ModelSpec, MoESpec

HF_QUANT_CONFIG = "hf_quant_config.json"
LAYOUTS = ("compressed-tensors", "modelopt")
# Our weight formats as TensorRT-LLM QuantAlgo names (tensorrt_llm/quantization/mode.py).
TRTLLM_ALGOS = {"fp8": "FP8_PER_CHANNEL_PER_TOKEN", "nvfp4": "W4A16_NVFP4"}
MIXED_PRECISION = "MIXED_PRECISION"
PRODUCER = {"name": "modelopt", "version": "0.43.0"}  # the legacy (nested) shape ModelOpt <= 0.43 writes
EXCLUDE = ["lm_head"]


def _module(weight_name: str) -> str:
    return weight_name.removesuffix(".weight")


# Why TensorRT-LLM cannot read an fp8 MoE block (engines.TRTLLM_RULES and the export's refusal say it alike).
FP8_MOE = (
    "fp8 routed experts: TensorRT-LLM's fused MoE (CutlassFusedMoE) has no FP8_PER_CHANNEL_PER_TOKEN path, "
    "only per-tensor FP8 with a static input scale or 128x128 FP8 block scales; keep this MoE block in nvfp4 "
    "or bf16 for TensorRT-LLM"
)


def layout_problems(spec: ModelSpec, formats: Mapping[int, str]) -> list[tuple[int, str]]:
    """(block index, why) for every block of `spec` stored in `formats` {block: format} that TensorRT-LLM cannot
    read in the ModelOpt layout: an fp8 MoE block, whose routed experts its fused MoE has no per-channel fp8 for."""
    return [
        (index, FP8_MOE)
        for index, fmt in sorted(formats.items())
        if fmt == "fp8" and isinstance(spec.blocks[index], MoESpec)
    ]


def hf_quant_config(weights: Mapping[str, str]) -> dict[str, Any]:
    """hf_quant_config.json for the quantized hub weights `weights` {weight name: "fp8" | "nvfp4"}."""
    layers: dict[str, dict[str, Any]] = {}
    for name, fmt in weights.items():
        entry: dict[str, Any] = {"quant_algo": TRTLLM_ALGOS[fmt]}
        if fmt == "nvfp4":
            entry["group_size"] = NVFP4_BLOCK
        layers[_module(name)] = entry
    return {
        "producer": dict(PRODUCER),
        "quantization": {
            "quant_algo": MIXED_PRECISION,
            "kv_cache_quant_algo": None,
            "exclude_modules": list(EXCLUDE),
            "quantized_layers": layers,
        },
    }


def inline_config(quant_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's `quantization_config` for `quant_config` (hf_quant_config.json): its table, inline."""
    return {"quant_method": "modelopt", **quant_config["quantization"], "producer": quant_config["producer"]}


def modelopt_names(name: str, fmt: str, shape: tuple[int, ...]) -> list[Entry]:
    """The stored tensors of hub weight `name` [out, in] in format `fmt` (ModelOpt's names, dtypes, shapes)."""
    module, (out_features, in_features) = _module(name), shape
    if fmt == "fp8":
        return [Entry(name, "F8_E4M3", shape), Entry(f"{module}.weight_scale", "F32", (out_features,))]
    return [
        Entry(name, "U8", (out_features, in_features // 2)),
        Entry(f"{module}.weight_scale", "F8_E4M3", (out_features, in_features // NVFP4_BLOCK)),
        Entry(f"{module}.weight_scale_2", "F32", ()),
    ]


def modelopt_weight(
    name: str, weight: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The stored tensors of one weight, as `modelopt_names` lists them: `puzzle.quant`'s own bytes (the values
    scoring used), under ModelOpt's names and conventions."""
    module = _module(name)
    if fmt == "fp8":
        values, scale = quantize_fp8(weight, name)
        return [(name, values), (f"{module}.weight_scale", scale.reshape(-1))]
    packed, block_scale, g = quantize_nvfp4(weight, name, global_scale)
    # ModelOpt stores the decode scale g itself (compressed-tensors: 1 / g)
    return [
        (name, packed),
        (f"{module}.weight_scale", block_scale),
        (f"{module}.weight_scale_2", g.reshape(())),
    ]


def quantized_modules(weights: Iterable[str]) -> list[str]:
    """The module names of hub weight names (`...mixer.in_proj.weight` -> `...mixer.in_proj`)."""
    return [_module(name) for name in weights]


__all__ = [
    "FP8_MOE",
    "HF_QUANT_CONFIG",
    "LAYOUTS",
    "TRTLLM_ALGOS",
    "hf_quant_config",
    "inline_config",
    "layout_problems",
    "modelopt_names",
    "modelopt_weight",
]
