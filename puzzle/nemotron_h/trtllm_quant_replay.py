"""What TensorRT-LLM (PyTorch backend) reads from a quantized NemotronH checkpoint in ModelOpt's layout, replayed
without it: which quant algo each module it builds gets, which tensors it loads for it, and the weight values
those tensors stand for, dequantized with its conventions.

Followed (commits as read; each file's own):

- `tensorrt_llm/_torch/model_config.py` (008e0af8980fc560003631ba4ac37828836a91c8): `load_modelopt_quant_config`
  and `_build_modelopt_quant_config`: `quant_algo` (a QuantAlgo name), and for MIXED_PRECISION one QuantConfig per
  `quantized_layers` entry (`quant_algo`, `group_size`), `kv_cache_quant_algo` global;
- `tensorrt_llm/quantization/modelopt_config.py` (2edf354d4b92161efd50b10b71e8e20fb6c5925a):
  `is_modelopt_quant_config` (producer.name "modelopt" or quant_method "modelopt*"), the legacy nested and the
  flat shapes;
- `tensorrt_llm/_torch/models/modeling_nemotron_h.py` (00620eb025e7c24895986e1042380bd1be4426d9):
  `NemotronHForCausalLM.__init__` renames the table's keys `backbone` -> `model`; `NemotronHMOE` takes the first
  entry under `model.layers.{i}.mixer.experts.` for its fused experts; the latent projections, shared experts,
  MLP and Mamba projections are `Linear`s;
- `tensorrt_llm/_torch/models/modeling_utils.py` (`apply_layerwise_quant_config`): a plain Linear gets the entry
  of its exact name, the fused qkv_proj its `q_proj` entry (k and v follow q), a fused MoE the first entry
  containing its name; a module without an entry stays unquantized (MIXED_PRECISION is QuantMode 0);
- `tensorrt_llm/_torch/modules/linear.py`: `FP8RowwiseLinearMethod` (weight float8_e4m3fn [out, in],
  weight_scale fp32 [out]: value = weight * weight_scale per row), `NVFP4LinearMethod.load_weight_scales` and
  the W4A16 method (weight uint8 [out, in/2] of E2M1 pairs, weight_scale float8_e4m3fn per 16 inputs,
  weight_scale_2 the per-tensor DECODE scale: value = e2m1 * weight_scale * weight_scale_2; a fused qkv asserts
  one weight_scale_2 for q, k and v);
- `tensorrt_llm/_torch/modules/fused_moe/fused_moe_cutlass.py` (`CutlassFusedMoE._QUANT_SUPPORT_TABLE`): the
  fused MoE takes unquantized, FP8 (per tensor), FP8_BLOCK_SCALES, NVFP4, W4A16_NVFP4, ... but no
  FP8_PER_CHANNEL_PER_TOKEN.

`read` returns every hub weight TensorRT-LLM would load, as fp32 values (quantized ones dequantized), or raises
`TrtllmQuantError` with what it would refuse or misread. Only the algos puzzle writes are dequantized
(FP8_PER_CHANNEL_PER_TOKEN, W4A16_NVFP4); another algo in a checkpoint is reported, not guessed at.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from puzzle.nemotron_h import trtllm_replay

HF_QUANT_CONFIG = "hf_quant_config.json"
LINEAR_ALGOS = ("FP8_PER_CHANNEL_PER_TOKEN", "W4A16_NVFP4")  # the Linear algos replayed here
MOE_ALGOS = ("W4A16_NVFP4",)  # of those, the ones CutlassFusedMoE implements
NVFP4_GROUP = 16
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes by code (sign in bit 3)
_EXPERT = re.compile(r"(.*\.mixer\.experts)\.\d+\.(up_proj|down_proj)$")


class TrtllmQuantError(ValueError):
    """TensorRT-LLM would refuse (or misread) the checkpoint here."""


@dataclass(frozen=True)
class TrtllmRead:
    """What TensorRT-LLM reads: `algos` {TensorRT-LLM module name: quant algo or None}, `weights` {hub weight
    name: fp32 value it computes with}."""

    algos: dict[str, str | None]
    weights: dict[str, torch.Tensor]


def _trtllm_name(name: str) -> str:
    # NemotronHForCausalLM.__init__: re.sub(r"(model\.layers\.)?backbone", "model", k) on the table's keys
    return re.sub(r"(model\.layers\.)?backbone", "model", name)


def layer_table(quant_config: Mapping[str, Any]) -> dict[str, str]:
    """{TensorRT-LLM module name: quant algo} of an hf_quant_config.json as `_build_modelopt_quant_config` reads
    it (MIXED_PRECISION: its `quantized_layers`); TrtllmQuantError for a file it does not take as ModelOpt's."""
    is_modelopt = str(quant_config.get("quant_method", "")).lower().startswith("modelopt") or (
        (quant_config.get("producer") or {}).get("name") == "modelopt"
    )
    inner = quant_config.get("quantization", quant_config if is_modelopt else None)
    if not isinstance(inner, Mapping):
        raise TrtllmQuantError(
            f"{HF_QUANT_CONFIG}: not a ModelOpt quant config (no 'quantization' dict, producer "
            f"{(quant_config.get('producer') or {}).get('name')!r})"
        )
    algo = inner.get("quant_algo")
    if algo != "MIXED_PRECISION":
        raise TrtllmQuantError(
            f"{HF_QUANT_CONFIG}: quantization.quant_algo is {algo!r}; the replay covers MIXED_PRECISION, where "
            "each module's algo is its quantized_layers entry (a global algo would quantize every module)"
        )
    table: dict[str, str] = {}
    for name, entry in (inner.get("quantized_layers") or {}).items():
        layer_algo = entry.get("quant_algo") if isinstance(entry, Mapping) else None
        if layer_algo is None:
            raise TrtllmQuantError(
                f"{HF_QUANT_CONFIG}: quantized_layers[{name!r}] has no quant_algo: {entry!r}"
            )
        if layer_algo == "W4A16_NVFP4" and entry.get("group_size") not in (None, NVFP4_GROUP):
            raise TrtllmQuantError(
                f"{HF_QUANT_CONFIG}: quantized_layers[{name!r}] group_size {entry.get('group_size')!r}; "
                f"NVFP4 takes {NVFP4_GROUP}"
            )
        table[_trtllm_name(name)] = layer_algo
    return table


def _modules(config: Mapping[str, Any]) -> dict[str, list[str]]:
    """{TensorRT-LLM module: [hub weight names it loads]} for every quantizable module trtllm_replay builds
    (Linear projections; a MoE layer's experts as one fused module); q/k/v as the fused `qkv_proj`."""
    modules: dict[str, list[str]] = {}
    for layer in trtllm_replay.replay(config):
        for tensor, shape in layer.tensors.items():
            if not tensor.endswith(".weight") or len(shape) != 2 or ".norm." in tensor or ".gate." in tensor:
                continue
            if tensor.endswith("conv1d.weight"):
                continue
            module = _trtllm_name(tensor.removesuffix(".weight"))
            expert = _EXPERT.fullmatch(module)
            if expert is not None:
                module = expert.group(1)
            elif module.endswith((".q_proj", ".k_proj", ".v_proj")):
                module = module[: -len("q_proj")] + "qkv_proj"
            modules.setdefault(module, []).append(tensor)
    return modules


def _algo(module: str, table: Mapping[str, str]) -> str | None:
    """apply_layerwise_quant_config: the entry a module gets (None: none, unquantized)."""
    if module.endswith(".experts"):  # a fused MoE: the first entry containing its name
        return next((algo for name, algo in table.items() if module in name), None)
    if module.endswith(".qkv_proj"):  # the fused qkv: q_proj's entry
        prefix = module.removesuffix(".qkv_proj")
        return next((algo for name, algo in table.items() if f"{prefix}.q_proj" in name), None)
    return table.get(module)


def resolve(config: Mapping[str, Any], table: Mapping[str, str]) -> dict[str, str | None]:
    """{TensorRT-LLM module: algo} for the modules it builds from config.json `config` and the table; raises
    TrtllmQuantError where it would refuse, or quantize a part of a fused module as another part."""
    modules = _modules(config)
    algos = {module: _algo(module, table) for module in modules}
    problems = []
    for module, algo in algos.items():
        # the parts of a fused module that TensorRT-LLM gives the first part's algo: the table must agree
        parts = {_trtllm_name(t.removesuffix(".weight")) for t in modules[module]}
        differing = sorted(p for p in parts if table.get(p) != algo)
        if differing:
            problems.append(
                f"{module}: TensorRT-LLM gives the fused module one algo ({algo}), but quantized_layers has "
                f"{[(p, table.get(p)) for p in differing[:3]]}"
            )
        allowed = MOE_ALGOS if module.endswith(".experts") else LINEAR_ALGOS
        if algo is not None and algo not in allowed:
            kind = (
                "CutlassFusedMoE"
                if module.endswith(".experts")
                else "the replay (a Linear algo puzzle does not write)"
            )
            problems.append(f"{module}: quant_algo {algo} is not implemented by {kind}")
    named = {_trtllm_name(t.removesuffix(".weight")) for ts in modules.values() for t in ts}
    unmatched = sorted(name for name in table if name not in named)
    if unmatched:
        problems.append(f"quantized_layers entries that match no module TensorRT-LLM builds: {unmatched[:3]}")
    if problems:
        raise TrtllmQuantError("; ".join(problems))
    return algos


def _e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[out, in/2] uint8 -> [out, in] fp32 E2M1 values: the even element in the low nibble (ModelOpt's packing)."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    magnitude = torch.tensor(_E2M1, dtype=torch.float32)[codes & 0x7]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def _expect(stored: Mapping[str, tuple[str, list[int]]], name: str, dtype: str, shape: list[int]) -> None:
    have = stored.get(name)
    if have is None:
        raise TrtllmQuantError(f"{name}: missing (TensorRT-LLM loads a {dtype} {shape} tensor here)")
    if have != (dtype, shape):
        raise TrtllmQuantError(f"{name}: stored {have[0]} {have[1]}, TensorRT-LLM allocates {dtype} {shape}")


def _stored_parts(algo: str | None, tensor: str, shape: tuple[int, ...]) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of what TensorRT-LLM loads for hub weight `tensor` [out, in] under `algo` (None: the
    unquantized weight, dtype as stored: "" here)."""
    out, inp = shape
    base = tensor.removesuffix(".weight")
    if algo is None:
        return [(tensor, "", [out, inp])]
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":  # FP8RowwiseLinearMethod.create_weights
        return [(tensor, "F8_E4M3", [out, inp]), (f"{base}.weight_scale", "F32", [out])]
    return [  # W4A16_NVFP4 (the NVFP4 methods' checkpoint tensors, before the scales are swizzled)
        (tensor, "U8", [out, inp // 2]),
        (f"{base}.weight_scale", "F8_E4M3", [out, inp // NVFP4_GROUP]),
        (f"{base}.weight_scale_2", "F32", []),
    ]


def check_layout(
    config: Mapping[str, Any], quant_config: Mapping[str, Any], stored: Mapping[str, tuple[str, list[int]]]
) -> dict[str, str | None]:
    """`resolve` of config.json `config` and hf_quant_config.json `quant_config`, then every tensor TensorRT-LLM
    loads checked against the checkpoint header `stored` {name: (safetensors dtype, shape)} (names, dtypes and
    shapes only: works for a 75B-shaped child without weights); returns the module algos."""
    algos = resolve(config, layer_table(quant_config))
    modules = _modules(config)
    shapes = {t: s for layer in trtllm_replay.replay(config) for t, s in layer.tensors.items()}
    used: set[str] = set()
    for module, algo in algos.items():
        for tensor in modules[module]:
            for name, dtype, shape in _stored_parts(algo, tensor, shapes[tensor]):
                if dtype == "" and stored.get(name, ("", []))[0] in ("F8_E4M3", "U8"):
                    raise TrtllmQuantError(
                        f"{name}: stored {stored[name][0]} but {module} has no quantized_layers entry: "
                        "TensorRT-LLM allocates it unquantized"
                    )
                _expect(stored, name, dtype or stored.get(name, ("BF16",))[0], shape)
                used.add(name)
    scales = (".weight_scale", ".weight_scale_2", ".input_scale")
    left = sorted(k for k in stored if k not in used and k.endswith(scales))
    if left:
        raise TrtllmQuantError(f"scale tensors no module TensorRT-LLM builds loads: {left[:3]}")
    return algos


def read(directory: str | Path) -> TrtllmRead:
    """Every matmul weight TensorRT-LLM loads from the checkpoint at `directory`, as the fp32 values it computes
    with (fp8: weight * weight_scale[:, None]; W4A16_NVFP4: e2m1 * weight_scale * weight_scale_2)."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    path = directory / HF_QUANT_CONFIG
    if not path.is_file():
        raise TrtllmQuantError(
            f"{directory}: no {HF_QUANT_CONFIG}: TensorRT-LLM takes the checkpoint as unquantized"
        )
    handles = {}
    stored: dict[str, tuple[str, list[int]]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        handle = safe_open(file, "pt")
        for key in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
            handles[key] = handle
            stored[key] = (handle.get_slice(key).get_dtype(), list(handle.get_slice(key).get_shape()))
    algos = check_layout(config, json.loads(path.read_text()), stored)

    def tensor(name: str) -> torch.Tensor:
        return handles[name].get_tensor(name)

    modules = _modules(config)
    shapes = {t: s for layer in trtllm_replay.replay(config) for t, s in layer.tensors.items()}
    weights: dict[str, torch.Tensor] = {}
    for module, algo in algos.items():
        global_scales = []
        for name in modules[module]:
            out, inp = shapes[name]
            base = name.removesuffix(".weight")
            if algo is None:
                weights[name] = tensor(name).float()
            elif algo == "FP8_PER_CHANNEL_PER_TOKEN":  # the rowwise GEMM's weight * per-row scale
                weights[name] = tensor(name).float() * tensor(f"{base}.weight_scale").unsqueeze(1)
            else:  # W4A16_NVFP4: e2m1 * E4M3 block scale * the decode global scale weight_scale_2
                block = tensor(f"{base}.weight_scale").float()
                scale_2 = tensor(f"{base}.weight_scale_2").float()
                global_scales.append(float(scale_2))
                values = _e2m1(tensor(name)).reshape(out, inp // NVFP4_GROUP, NVFP4_GROUP)
                weights[name] = (values * block.unsqueeze(-1) * scale_2).reshape(out, inp)
        if module.endswith(".qkv_proj") and len(set(global_scales)) > 1:
            # NVFP4LinearMethod.load_weight_scales: "The weight_scale_2 should be same for all the weights"
            raise TrtllmQuantError(f"{module}: q/k/v weight_scale_2 differ {global_scales}")
    return TrtllmRead(algos, weights)


# ------------------------------------------------------- its compressed-tensors reader (why a second layout)


def compressed_tensors_algo(group: Mapping[str, Any], top_format: str | None = None) -> str:
    """The QuantAlgo TensorRT-LLM resolves one compressed-tensors config group to, as
    `_quant_config_from_config_group` does (`tensorrt_llm/models/quant_config_utils.py`, commit
    21156a7a57acd21e17feb5c2721c30f035e0f2af); TrtllmQuantError where it raises."""
    weights = group["weights"]
    strategy, bits = weights["strategy"], weights["num_bits"]
    fmt = group.get("format", top_format)
    inputs = group.get("input_activations")
    if fmt == "mxfp4-pack-quantized" or (
        bits == 4 and weights.get("type") == "float" and strategy == "group" and inputs is None
    ):
        if weights["group_size"] != 32:
            raise TrtllmQuantError(
                f"Unsupported group_size: {weights['group_size']}. Supported: 32 for MXFP4."
            )
        return "W4A16_MXFP4"
    if inputs is None:  # it indexes group_config["input_activations"]["strategy"]: None is not subscriptable
        raise TrtllmQuantError(
            f"a {bits}-bit {strategy} weight-only group (input_activations null): TensorRT-LLM reads its "
            "input_activations['strategy'] and fails (TypeError) on a weight-only group other than MXFP4"
        )
    if bits == 8 and strategy == "channel":
        if inputs["strategy"] != "token":
            raise TrtllmQuantError(f"Unsupported inputs_quant_strategy: {inputs['strategy']}.")
        return "FP8_PER_CHANNEL_PER_TOKEN"
    if bits == 8 and strategy == "block":
        if inputs["strategy"] != "group" or inputs.get("group_size") != 128:
            raise TrtllmQuantError("FP8 block scales: inputs per group of 128 only")
        return "FP8_BLOCK_SCALES"
    if bits == 4 and weights.get("type") == "float" and strategy == "tensor_group":
        if inputs["strategy"] != "tensor_group":
            raise TrtllmQuantError(f"Unsupported inputs_quant_strategy for NVFP4: {inputs['strategy']}.")
        if weights["group_size"] != NVFP4_GROUP:
            raise TrtllmQuantError(
                f"Unsupported group_size: {weights['group_size']}. Supported: 16 for NVFP4."
            )
        return "NVFP4"
    raise TrtllmQuantError(f"Unsupported quant_bits: {bits}. Supported: 8 (FP8) or 4 (NVFP4).")


__all__ = [
    "TrtllmQuantError",
    "TrtllmRead",
    "check_layout",
    "compressed_tensors_algo",
    "layer_table",
    "read",
    "resolve",
]
