"""Which quantization scheme vLLM picks for each layer of a NemotronH compressed-tensors checkpoint, replayed
without vLLM (which needs a GPU build): what `puzzle.nemotron_h.vllm_replay` does for shapes, for the
`quantization_config`.

Followed, in vLLM 0.34.0 (the PyPI wheel's sources):

- `vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py`:
  `CompressedTensorsConfig.from_config` and `_quantization_scheme_map_from_config` (config groups ->
  {target: weights / input_activations / format}, validated with compressed-tensors' own `QuantizationArgs`),
  `apply_vllm_mapper` (targets and ignore entries that are layer paths, not `re:` patterns, renamed by the
  model's rename mapper), `get_quant_method` (LinearBase -> `get_scheme`; ParallelLMHead; VocabParallelEmbedding;
  RoutedExperts -> `CompressedTensorsMoEMethod.get_moe_method`), `get_scheme_dict`, `get_scheme` and
  `_get_scheme_from_parts` with its predicates (`_is_nvfp4_format`, `_is_mxfp4`, `_is_mxfp8`,
  `_is_wNa16_group_channel`, `_is_fp8_w8a8`, `_is_fp8_w8a16`);
- `.../compressed_tensors/utils.py`: `is_activation_quantization_format`, `should_ignore_layer`,
  `find_matched_target` (`_find_first_match`, `_is_equal_or_regex_match`, `_match_fused_layer`);
- `.../compressed_tensors/compressed_tensors_moe/compressed_tensors_moe.py`:
  `CompressedTensorsMoEMethod.get_moe_method` (the fused experts resolved through
  `{layer}.0.{gate, up, down}` names, which must all resolve alike);
- `vllm/model_executor/models/nemotron_h.py`: `NemotronHForCausalLM.hf_to_vllm_mapper` (its rename mapper:
  `backbone` -> `model`, `A_log` -> `A`, `embeddings` -> `embed_tokens`; `get_rename_mapper` drops the
  stacked q/k/v -> qkv_proj map and the `mtp` -> None map), `packed_modules_mapping` (qkv_proj = q/k/v),
  and which modules get the quantization config: Mamba in_proj / out_proj, qkv_proj / o_proj, MLP and
  shared-expert up/down, latent projections, the routed experts (`FusedMoEFactory`, ckpt_names
  ("up_proj", "down_proj", None): non-gated, so the up name is None); not the router (`GateLinear`, built
  without one) nor Mamba's conv1d (quant_config=None). MTP layers are vLLM's separate draft model: not replayed.

Branches for integer and MX schemes are named, not replayed in detail (puzzle writes neither). The GPU is
taken to be one with fp8 (capability >= 89, as B200), where vLLM picks W8A8 for fp8 with activations.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from puzzle.nemotron_h.vllm_replay import replay

VLLM_VERSION = "0.34.0"
# NemotronHForCausalLM.hf_to_vllm_mapper.get_rename_mapper(): substrings, then prefixes.
RENAME_SUBSTR = {"A_log": "A", "embeddings": "embed_tokens"}
RENAME_PREFIX = {"backbone": "model"}
PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
# compressed_tensors/utils.py is_activation_quantization_format
ACTIVATION_FORMATS = ("naive-quantized", "int-quantized", "float-quantized", "nvfp4-pack-quantized")
MOE_CKPT_NAMES = ("up_proj", None, "down_proj")  # (gate, up, down) as get_moe_method reads them


class VllmQuantError(ValueError):
    """vLLM would refuse the checkpoint here (the error it raises, replayed)."""


@dataclass(frozen=True)
class QuantLayer:
    """One layer vLLM builds with the quantization config: its vLLM name, module class, and the scheme chosen."""

    name: str
    module_class: str
    scheme: str | None  # None: unquantized (UnquantizedLinearMethod / UnquantizedFusedMoEMethod / no method)


# ------------------------------------------------------------------------------ CompressedTensorsConfig


def _map_name(key: str) -> str:
    for substr, new in RENAME_SUBSTR.items():
        if substr in key:
            key = key.replace(substr, new, 1)
    for prefix, new in RENAME_PREFIX.items():
        if key.startswith(prefix):
            key = key.replace(prefix, new, 1)
    return key


def _map_target(target: str) -> str:
    is_layer_path = "." in target and not target.startswith("re:")
    return _map_name(target) if is_layer_path else target


class ReplayedConfig:
    """CompressedTensorsConfig.from_config then apply_vllm_mapper, as vLLM builds it for NemotronH."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        from compressed_tensors.quantization import QuantizationArgs, QuantizationType

        self.quant_format = config.get("format")
        self.ignore = [_map_target(t) for t in config.get("ignore", [])]
        self.target_scheme_map: dict[str, dict[str, Any]] = {}
        for group in (config.get("config_groups") or {}).values():
            targets = group.get("targets")
            if len(targets) == 1 and targets[0].endswith("Attention"):  # from_config skips attention groups
                continue
            for target in targets:
                entry: dict[str, Any] = {"weights": QuantizationArgs.model_validate(group.get("weights"))}
                entry["input_activations"] = None
                entry["format"] = group.get("format")
                fmt = entry["format"] if entry["format"] is not None else self.quant_format
                act_quant_format = fmt in ACTIVATION_FORMATS
                inputs = group.get("input_activations")
                if act_quant_format or inputs:
                    if not inputs:
                        if entry["weights"].type != QuantizationType.FLOAT:
                            raise VllmQuantError(f"target {target!r}: AssertionError (weights not float)")
                    else:
                        entry["input_activations"] = QuantizationArgs.model_validate(inputs)
                self.target_scheme_map[_map_target(target)] = entry

    def scheme_dict(self, module_class: str, layer_name: str) -> dict[str, Any] | None:
        """get_scheme_dict."""
        if should_ignore_layer(layer_name, self.ignore, PACKED_MODULES):
            return None
        if self.target_scheme_map:
            matched = find_matched_target(layer_name, module_class, self.target_scheme_map, PACKED_MODULES)
            if matched is not None:
                entry = self.target_scheme_map[matched]
                if entry.get("format") is None:
                    entry["format"] = self.quant_format
                return entry
        return None

    def linear_scheme(self, module_class: str, layer_name: str) -> str | None:
        """get_scheme -> _get_scheme_from_parts (the scheme class vLLM instantiates; None: unquantized)."""
        entry = self.scheme_dict(module_class, layer_name)
        weights = entry.get("weights") if entry else None
        if weights is None:
            return None
        inputs, fmt = entry.get("input_activations"), entry.get("format") or self.quant_format
        if _is_nvfp4(weights):
            if inputs is None:
                return "CompressedTensorsW4A4Fp4(use_a16=True)"
            if not _is_nvfp4(inputs):
                raise VllmQuantError(
                    f"{layer_name}: For NVFP4 weights, input quantization must also be NVFP4 format, None for NVFP4A16"
                )
            return "CompressedTensorsW4A4Fp4"
        if _is_mx(weights):
            return "an MX scheme (CompressedTensorsW4A4Mxfp4 / W4A8Mxfp4 / W8A8Mxfp8)"
        if weights.type == "int":
            return "an integer scheme (W4A8 / WNA8O8 / WNA8 / WNA4 / WNA16 / W8A8Int8)"
        if _is_wna16_group_channel(weights, inputs) and fmt == "pack-quantized":
            return "CompressedTensorsWNA16"
        if fmt in ACTIVATION_FORMATS:
            if _is_fp8_w8a8(weights, inputs):
                return "CompressedTensorsW8A8Fp8"
            if _is_fp8_w8a16(weights):
                return "CompressedTensorsW8A16Fp8"
        raise VllmQuantError(
            f"No compressed-tensors compatible scheme was found for layer_name={layer_name!r}, "
            f"weight_quant={weights}, input_quant={inputs}, format={fmt!r}"
        )

    def lm_head_scheme(self, layer_name: str) -> str | None:
        try:
            return self.linear_scheme("ParallelLMHead", layer_name)
        except VllmQuantError:  # get_quant_method catches ValueError for the lm_head
            return None

    def embedding_scheme(self, layer_name: str) -> str | None:
        entry = self.scheme_dict("VocabParallelEmbedding", layer_name)
        weights = entry.get("weights") if entry else None
        if weights is None:
            return None
        if not (_is_wna16_group_channel(weights, None) and weights.type == "int"):
            raise VllmQuantError(
                "compressed-tensors embeddings only support weight-only INT group/channel (WNA16) quantization, "
                f"got: {weights}"
            )
        return "CompressedTensorsEmbeddingWNA16Int"

    def moe_method(self, layer_name: str) -> str | None:
        """CompressedTensorsMoEMethod.get_moe_method (None: UnquantizedFusedMoEMethod)."""
        if "Linear" in self.target_scheme_map and "RoutedExperts" not in self.target_scheme_map:
            self.target_scheme_map["RoutedExperts"] = self.target_scheme_map["Linear"]
        names = [f"{layer_name}.0.{proj}" for proj in MOE_CKPT_NAMES]
        dicts = [self.scheme_dict("RoutedExperts", name) for name in names]
        entry = dicts.pop()
        if not all(d == entry for d in dicts):
            raise VllmQuantError(
                f"{layer_name}: All MoE projections need to have same quantization scheme but found multiple "
                f"(resolving {names})"
            )
        if entry is None:
            return None
        weights, inputs, fmt = entry.get("weights"), entry.get("input_activations"), entry.get("format")
        if _is_mx(weights):
            return "an MX MoE method"
        if _is_wna16_group_channel(weights, inputs):
            if fmt != "pack-quantized":
                raise VllmQuantError(
                    f"{layer_name}: For Fused MoE layers, only format: pack-quantized ... is supported but got "
                    f"format {fmt!r} and bits {weights.num_bits}"
                )
            return "CompressedTensorsWNA16MoEMethod"
        if _is_nvfp4(weights):
            if not (inputs is None or _is_nvfp4(inputs)):
                raise VllmQuantError(
                    f"{layer_name}: For NVFP4 weights, input quantization must also be NVFP4 format or None"
                )
            return "CompressedTensorsW4A4Nvfp4MoEMethod" + ("(use_a16=True)" if inputs is None else "")
        if _is_fp8_w8a8(weights, inputs):
            return "CompressedTensorsW8A8Fp8MoEMethod"
        if weights.type == "int":
            return "an integer MoE method (W8A8Int8 / W4A8)"
        raise VllmQuantError(f"{layer_name}: Unsupported FusedMoe scheme: {weights}, {inputs}")


# ----------------------------------------------------------------------------------------- predicates


def _is_nvfp4(args: Any) -> bool:
    return (
        args is not None
        and args.strategy == "tensor_group"
        and args.symmetric
        and args.group_size == 16
        and args.type == "float"
        and args.num_bits == 4
    )


def _is_mx(args: Any) -> bool:
    """_is_mxfp4 or _is_mxfp8: float group strategy, group 32."""
    return args is not None and args.strategy == "group" and args.group_size == 32 and args.type == "float"


def _is_wna16_group_channel(weights: Any, inputs: Any) -> bool:
    return inputs is None and weights.strategy in ("channel", "group") and not weights.dynamic


def _is_fp8_w8a8(weights: Any, inputs: Any) -> bool:
    if weights is None or inputs is None:
        return False
    floating = weights.type == "float" and inputs.type == "float"
    if not (
        floating
        and weights.symmetric
        and not weights.dynamic
        and weights.strategy in ("tensor", "channel", "block")
    ):
        return False
    if inputs.dynamic:
        return True
    return bool(inputs.symmetric and inputs.strategy == "tensor")


def _is_fp8_w8a16(weights: Any) -> bool:
    return (
        weights is not None
        and weights.type == "float"
        and weights.symmetric
        and not weights.dynamic
        and weights.strategy in ("tensor", "channel", "block")
    )


# ---------------------------------------------------------------------------------- compressed_tensors/utils


def _is_equal_or_regex_match(value: str, target: str, check_contains: bool = False) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    if check_contains:
        return target.lower() in value.lower()
    return target == value


def _find_first_match(value: str, targets: Iterable[str], check_contains: bool = False) -> str | None:
    return next((t for t in targets if _is_equal_or_regex_match(value, t, check_contains)), None)


def _match_fused_layer(layer_name: str, targets: Iterable[str], fused: Mapping[str, list[str]]) -> str | None:
    name = next((key for key in fused if layer_name.endswith(key)), None)
    if name is None:
        return None
    matches = [
        next((t for t in targets if _is_equal_or_regex_match(layer_name.replace(name, part), t)), None)
        for part in fused[name]
    ]
    return matches[0] if all(matches) else None


def find_matched_target(
    layer_name: str, module_class: str, targets: Iterable[str], fused: Mapping[str, list[str]]
) -> str | None:
    targets = list(targets)
    return (
        _find_first_match(layer_name, targets)
        or _find_first_match(module_class, targets, True)
        or _match_fused_layer(layer_name, targets, fused)
    )


def should_ignore_layer(layer_name: str, ignore: Iterable[str], fused: Mapping[str, list[str]]) -> bool:
    ignore = list(ignore)
    proj = layer_name.split(".")[-1]
    if proj in fused and layer_name not in ignore:
        flags = [
            any(_is_equal_or_regex_match(layer_name.replace(proj, p), t) for t in ignore) for p in fused[proj]
        ]
        if any(flags) and not all(flags):
            return True  # vLLM warns and treats the fused layer as ignored
        return flags[0] if flags else False
    return any(_is_equal_or_regex_match(layer_name, t) for t in ignore)


# --------------------------------------------------------------------------------------------- the model


def _layer_modules(char: str, tensors: Iterable[str], prefix: str) -> list[tuple[str, str]]:
    """(vLLM layer name, module class) of the layers of one decoder layer built with the quant config."""
    mixer = _map_name(prefix) + ".mixer"
    present = {name.removeprefix(f"{prefix}.mixer.") for name in tensors}
    if char == "M":
        return [
            (f"{mixer}.in_proj", "MergedColumnParallelLinear"),
            (f"{mixer}.out_proj", "RowParallelLinear"),
        ]
    if char == "*":
        return [(f"{mixer}.qkv_proj", "QKVParallelLinear"), (f"{mixer}.o_proj", "RowParallelLinear")]
    if char == "-":
        return [(f"{mixer}.up_proj", "ColumnParallelLinear"), (f"{mixer}.down_proj", "RowParallelLinear")]
    out = []
    if "shared_experts.up_proj.weight" in present:
        out += [
            (f"{mixer}.shared_experts.up_proj", "ColumnParallelLinear"),
            (f"{mixer}.shared_experts.down_proj", "RowParallelLinear"),
        ]
    if "fc1_latent_proj.weight" in present:
        out += [
            (f"{mixer}.fc1_latent_proj", "ReplicatedLinear"),
            (f"{mixer}.fc2_latent_proj", "ReplicatedLinear"),
        ]
    return [*out, (f"{mixer}.experts", "RoutedExperts")]


def resolve(config: Mapping[str, Any]) -> list[QuantLayer]:
    """Every layer of config.json `config` that vLLM builds with its quantization config, and the scheme it
    picks (VllmQuantError where vLLM would raise). The main layers, then embeddings and lm_head."""
    quant = ReplayedConfig(config["quantization_config"])
    out: list[QuantLayer] = []
    for layer in replay(config):
        if layer.prefix.startswith("mtp.") or layer.unsupported is not None:
            continue
        for name, module_class in _layer_modules(layer.char, layer.tensors, layer.prefix):
            if module_class == "RoutedExperts":
                out.append(QuantLayer(name, module_class, quant.moe_method(name)))
            else:
                out.append(QuantLayer(name, module_class, quant.linear_scheme(module_class, name)))
    out.append(
        QuantLayer(
            "model.embed_tokens", "VocabParallelEmbedding", quant.embedding_scheme("model.embed_tokens")
        )
    )
    out.append(QuantLayer("lm_head", "ParallelLMHead", quant.lm_head_scheme("lm_head")))
    return out
