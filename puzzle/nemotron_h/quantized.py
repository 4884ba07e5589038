r"""Quantized NemotronH checkpoints in the compressed-tensors format: written per block, read back dequantized.

Why compressed-tensors (not NVIDIA ModelOpt's `hf_quant_config.json`): it is vLLM's native format, one
`quantization_config` in config.json holds any number of config groups, each a scheme with its own
per-module `targets` and storage `format`, so a child with bf16, fp8 and nvfp4 blocks is one config with
two groups; and both of our formats are presets of the library, read by vLLM as exactly the arithmetic of
`puzzle.quant`:

- fp8 -> preset FP8_DYNAMIC, format "float-quantized": weights float 8-bit, strategy "channel", symmetric,
  static (`weight` E4M3 [out, in], `weight_scale` fp32 [out, 1]); activations fp8 per token, dynamic
  (computed by the server, nothing stored). vLLM: `CompressedTensorsW8A8Fp8` (linear layers) and
  `CompressedTensorsW8A8Fp8MoEMethod` (routed experts). Weight-only fp8 (FP8A16) is not used: vLLM's
  fused MoE has no fp8 weight-only path for compressed-tensors (it raises for a float-quantized
  channel scheme without activations).
- nvfp4 -> preset NVFP4A16, format "nvfp4-pack-quantized": weights float 4-bit, strategy "tensor_group",
  group 16, symmetric, E4M3 group scales (`weight_packed` uint8 [out, in/2], `weight_scale` E4M3
  [out, in/16], `weight_global_scale` fp32 [1] = 1 / g, compressed-tensors' encode scale). Weight-only:
  NVFP4 W4A4 also needs calibrated activation global scales (`input_global_scale`), which puzzle does not
  compute. vLLM: `CompressedTensorsW4A4Fp4(use_a16=True)` and `CompressedTensorsW4A4Nvfp4MoEMethod(use_a16=True)`.

The config and its schemes are built with the library (its preset schemes, `QuantizationConfig`, dumped as
its `ModelCompressor.update_config` writes them); the tensors are `puzzle.quant`'s own, because the export
must hold exactly the fake-quantized weights scoring used (the library's compressors recompute the
division in another order; tests read our files back with its decompressors as the oracle of the layout).

The fp8 activations are part of what is scored: an fp8 block's forward quantizes each matmul's input per
token the same way (`puzzle.quant_tokens`), so scores, KL and GKD see the error serving adds.

Targets: one pattern per module matching its hub name and transformers' (`re:^(?:backbone|model)\.layers\.3\.
mixer\.in_proj$`: vLLM maps `backbone.` to `model.`, transformers names its modules `model.`, and an exact
`backbone.` name left transformers' modules unmatched and randomly initialised), and one per MoE block for
its routed experts, which vLLM resolves as a whole (`experts.0.up_proj`,
`experts.0.down_proj` and, for its non-gated experts, `experts.0.None`, which only a pattern matches).
q/k/v share one nvfp4 global scale (vLLM fuses them into qkv_proj with one). Blocks not named, norms,
biases, the router, conv1d, SSM parameters, embeddings, lm_head and MTP tensors stay as they are.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from puzzle.formats import NVFP4_BLOCK, NVFP4_SHARED_SCALE
from puzzle.nemotron_h.config import CheckpointError
from puzzle.nemotron_h.stream import Entry, Unit, model_entries, model_units, saved_extras, write_streamed
from puzzle.nemotron_h.weights import TensorSource, read_tensor
from puzzle.quant import (
    QuantError,
    dequantize_fp8,
    dequantize_nvfp4,
    nvfp4_global_scale,
    quantize_fp8,
    quantize_nvfp4,
)
from puzzle.quant_blocks import quantized_weights
from puzzle.spec import ModelSpec, takes_weight_format

if TYPE_CHECKING:
    from puzzle.model import HybridLM

QUANT_METHOD = "compressed-tensors"
# Our weight formats as compressed-tensors preset schemes and storage formats.
PRESETS = {"fp8": "FP8_DYNAMIC", "nvfp4": "NVFP4A16"}
CT_FORMATS = {"fp8": "float-quantized", "nvfp4": "nvfp4-pack-quantized"}
_BACKBONE = "backbone."


@dataclass
class QuantPlan:
    """Which hub weights get which format: `weights` {hub weight name: "fp8" | "nvfp4"}, `blocks` {index: format}."""

    weights: dict[str, str]
    blocks: dict[int, str]
    # hub weight name -> the names sharing its nvfp4 global scale (q/k/v of a block), itself included
    shared: dict[str, tuple[str, ...]] = field(default_factory=dict)


def plan(model: HybridLM, blocks: Mapping[int, str]) -> QuantPlan:
    """The plan for `model` and {block index: format} (e.g. `puzzle.quant_blocks.block_formats` of the
    module-name prefixes a user gave).

    Refuses (QuantError), before anything is written, an nvfp4 weight whose input dimension is not a
    multiple of 16 and fp8 or nvfp4 for a block with no matmul weight (a no-op block), which would quantize
    nothing ("bf16", keeping it as it is, is accepted).
    """
    spec = model.spec
    blocks = dict(blocks)
    weights: dict[str, str] = {}
    shared: dict[str, tuple[str, ...]] = {}
    for index, fmt in sorted(blocks.items()):
        if fmt == "bf16":
            continue
        prefix = f"{_BACKBONE}layers.{index}.mixer."
        names = quantized_weights(spec.blocks[index], spec.hidden_size)
        if not names:  # silently exporting it unquantized would hide a mistaken block index
            block = spec.blocks[index]
            raise QuantError(
                f"weight format {fmt!r} for block {index} ({_BACKBONE}layers.{index}.mixer, a {block.kind} "
                f"block): it has no matmul weights to store in {fmt}; name a block with weights or give it 'bf16'"
            )
        for name in names:
            weights[prefix + name] = fmt
        for group in NVFP4_SHARED_SCALE:
            present = tuple(prefix + name for name in group if name in names)
            shared.update(dict.fromkeys(present, present))
    entries = {entry.name: entry for entry in model_entries(model, {})}
    for name, fmt in weights.items():
        if fmt == "nvfp4" and entries[name].shape[-1] % NVFP4_BLOCK:
            raise QuantError(
                f"{name}: nvfp4 needs in_features to be a multiple of {NVFP4_BLOCK}, got shape "
                f"{list(entries[name].shape)}; keep this block in fp8 or bf16"
            )
    return QuantPlan(weights, blocks, shared)


# ------------------------------------------------------------------------------------------- the config


def _module(weight_name: str) -> str:
    return weight_name.removesuffix(".weight")


_EXPERT = re.compile(r"backbone\.layers\.(\d+)\.mixer\.experts\.\d+\.(up_proj|down_proj)\.weight")


def _targets(weight_names: Iterable[str]) -> list[str]:
    """compressed-tensors targets for these weights: module names, one expert pattern per MoE block."""
    targets: list[str] = []
    for name in weight_names:
        expert = _EXPERT.fullmatch(name)
        if expert is None:
            # transformers names the modules `model.…`, vLLM maps ours to `model.…` too: a pattern for both
            # (an exact `backbone.…` name matches nothing in transformers, whose modules then stay random)
            module = re.escape(_module(name).removeprefix(_BACKBONE))
            targets.append(rf"re:^(?:backbone|model)\.{module}$")
            continue
        # vLLM resolves the fused experts as `{layer}.experts.0.{up_proj, None, down_proj}` under `model.`
        pattern = rf"re:^(?:backbone|model)\.layers\.{expert.group(1)}\.mixer\.experts\.\d+\.\w+$"
        if pattern not in targets:
            targets.append(pattern)
    return targets


def quantization_config(quant_plan: QuantPlan) -> dict[str, Any]:
    """config.json's `quantization_config`: one config group per format used, built with compressed-tensors."""
    try:
        import compressed_tensors
        from compressed_tensors.quantization import (
            QuantizationConfig,
            QuantizationStatus,
            preset_name_to_scheme,
        )
    except ImportError as error:  # an optional dependency: the [quant] extra
        raise CheckpointError(
            "writing a quantized checkpoint needs compressed-tensors: pip install 'puzzle-nas[quant]'"
        ) from error
    groups = {}
    used = [fmt for fmt in ("fp8", "nvfp4") if fmt in quant_plan.weights.values()]
    for fmt in used:
        names = [name for name, f in quant_plan.weights.items() if f == fmt]
        if not names:
            continue
        scheme = preset_name_to_scheme(PRESETS[fmt], _targets(names))
        scheme.format = CT_FORMATS[fmt]
        groups[f"group_{len(groups)}"] = scheme
    config = QuantizationConfig(
        config_groups=groups,
        format="mixed-precision" if len(used) > 1 else CT_FORMATS[used[0]] if used else "dense",
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=["lm_head"],
    )
    dumped = config.model_dump(mode="json", exclude={"quant_method"})
    # As compressed-tensors' ModelCompressor.update_config writes it (its keys, then the config's fields).
    return {
        "version": compressed_tensors.__version__,
        "quant_method": QUANT_METHOD,
        "sparsity_config": {},
        "transform_config": {},
        **dumped,
    }


# ------------------------------------------------------------------------------------------- the weights


def quantized_names(name: str, fmt: str, shape: tuple[int, ...]) -> list[Entry]:
    """The stored tensors of hub weight `name` [out, in] in format `fmt` (compressed-tensors' names)."""
    module, (out_features, in_features) = _module(name), shape
    if fmt == "fp8":
        return [Entry(name, "F8_E4M3", shape), Entry(f"{module}.weight_scale", "F32", (out_features, 1))]
    return [
        Entry(f"{module}.weight_packed", "U8", (out_features, in_features // 2)),
        Entry(f"{module}.weight_scale", "F8_E4M3", (out_features, in_features // NVFP4_BLOCK)),
        Entry(f"{module}.weight_global_scale", "F32", (1,)),
    ]


def quantized_entries(
    entries: Iterable[Entry], quant_plan: QuantPlan, names: Callable[..., list[Entry]] = quantized_names
) -> list[Entry]:
    """`entries` with each planned weight replaced by its stored tensors (names, dtypes, shapes only);
    `names`: the layout's (`quantized_names`, or `puzzle.nemotron_h.modelopt.modelopt_names`)."""
    out: list[Entry] = []
    for entry in entries:
        fmt = quant_plan.weights.get(entry.name)
        out.extend([entry] if fmt is None else names(entry.name, fmt, entry.shape))
    return out


def quantize_weight(
    name: str, weight: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The stored tensors of one weight, as `quantized_names` lists them."""
    module = _module(name)
    if fmt == "fp8":
        values, scale = quantize_fp8(weight, name)
        return [(name, values), (f"{module}.weight_scale", scale)]
    packed, block_scale, g = quantize_nvfp4(weight, name, global_scale)
    # compressed-tensors stores the encode scale 1 / g; its dequantization (and vLLM's) divides by it.
    return [
        (f"{module}.weight_packed", packed),
        (f"{module}.weight_scale", block_scale),
        (f"{module}.weight_global_scale", (1.0 / g).reshape(1)),
    ]


def quantized_units(
    units: Iterable[Unit],
    quant_plan: QuantPlan,
    quantize: Callable[..., list[tuple[str, torch.Tensor]]] = quantize_weight,
) -> Iterator[Unit]:
    """`units` with every planned weight quantized by `quantize` (the layout's: `quantize_weight`, or
    `modelopt.modelopt_weight`); q/k/v are held until all three arrived (shared scale)."""
    waiting: dict[str, torch.Tensor] = {}

    def wrap(unit: Unit) -> Unit:
        def run() -> tuple[list[tuple[str, torch.Tensor]], int]:
            pieces, elements = unit()
            out: list[tuple[str, torch.Tensor]] = []
            for name, tensor in pieces:
                fmt = quant_plan.weights.get(name)
                if fmt is None:
                    out.append((name, tensor))
                    continue
                group = quant_plan.shared.get(name, (name,)) if fmt == "nvfp4" else (name,)
                waiting[name] = tensor.detach().clone() if len(group) > 1 else tensor.detach()
                if not all(member in waiting for member in group):
                    continue
                held = [waiting.pop(member) for member in group]
                scale = nvfp4_global_scale(*held) if fmt == "nvfp4" else None
                for member, weight in zip(group, held):
                    out.extend(quantize(member, weight, fmt, scale))
            return out, elements

        return run

    for unit in units:
        yield wrap(unit)
    if waiting:  # every member of a shared group is a planned weight of the model: all of them arrive
        raise CheckpointError(f"quantized export: tensors {sorted(waiting)} never completed their group")


def stream_quantized(
    model: nn.Module,
    directory: Path | None,
    max_shard_bytes: int,
    quant_plan: QuantPlan,
    layout: str = QUANT_METHOD,
) -> list[str]:
    """`puzzle.nemotron_h.stream.stream_weights` with the planned weights stored quantized (same files layout,
    same streaming: one tensor gathered at a time, a block's q/k/v at most held together); `layout`
    "compressed-tensors" (vLLM, SGLang) or "modelopt" (TensorRT-LLM, `puzzle.nemotron_h.modelopt`)."""
    from puzzle.nemotron_h import modelopt

    names, quantize = (
        (modelopt.modelopt_names, modelopt.modelopt_weight)
        if layout == "modelopt"
        else (quantized_names, quantize_weight)
    )
    extras = saved_extras(model)
    entries = quantized_entries(model_entries(model, extras), quant_plan, names)
    units = model_units(model, extras, directory is not None)
    if directory is not None:  # other ranks of a sharded save only gather
        units = quantized_units(units, quant_plan, quantize)
    return write_streamed(entries, units, directory, max_shard_bytes)


# ------------------------------------------------------------------------------------------- reading back


@dataclass(frozen=True)
class DequantizedSource(TensorSource):
    """A weight stored quantized: `parts` {stored suffix: source}, read back as fp32 (the served values)."""

    fmt: str = ""
    parts: tuple[tuple[str, TensorSource], ...] = ()

    def read(self, handles: Mapping[Path, Any]) -> torch.Tensor:
        stored = {
            suffix: read_tensor(handles[source.file], source.file, source.key, source.expert)
            for suffix, source in self.parts
        }
        if self.fmt == "fp8":
            return dequantize_fp8(stored["weight"], stored["weight_scale"])
        # compressed-tensors / vLLM: values * block scale / weight_global_scale (the stored encode scale)
        g = 1.0 / stored["weight_global_scale"].float().reshape(())
        return dequantize_nvfp4(stored["weight_packed"], stored["weight_scale"], g)


def _check_scheme(group: str, scheme: Mapping[str, Any], where: str) -> str:
    """Which of our formats a config group is ("fp8", "nvfp4"); CheckpointError for any other scheme."""
    weights = scheme.get("weights") or {}
    fp8 = (8, "float", "channel")
    nvfp4 = (4, "float", "tensor_group")
    found = (weights.get("num_bits"), weights.get("type"), weights.get("strategy"))
    if found == fp8 and weights.get("symmetric", True) and not weights.get("dynamic", False):
        return "fp8"
    if found == nvfp4 and weights.get("group_size") == NVFP4_BLOCK and weights.get("symmetric", True):
        return "nvfp4"
    raise CheckpointError(
        f"{where}: quantization_config group {group!r} stores weights as {weights}; puzzle reads back "
        "compressed-tensors fp8 (float 8-bit, channel strategy, symmetric, static) and nvfp4 (float 4-bit, "
        "tensor_group, group 16) weights only"
    )


def read_formats(config: Mapping[str, Any], where: str) -> set[str] | None:
    """None for an unquantized config.json; the formats of a compressed-tensors one puzzle can read back;
    CheckpointError for any other quantized checkpoint (e.g. NVIDIA's ModelOpt releases)."""
    method = quant_method(config)
    if method is None:
        return None
    if method != QUANT_METHOD:
        raise CheckpointError(
            f"{where} describes a quantized checkpoint (quantization_config, quant_method {method!r}); puzzle "
            "loads unquantized weights (bf16 / fp16 / fp32) and its own compressed-tensors exports: use the "
            "BF16 release. Its architecture alone can still be read with puzzle.nemotron_h.spec_from_config "
            "(e.g. `puzzle costs`)."
        )
    groups = config["quantization_config"].get("config_groups") or {}
    return {_check_scheme(name, scheme, where) for name, scheme in groups.items()}


def quant_method(config: Mapping[str, Any]) -> str | None:
    """The `quant_method` of config.json's `quantization_config` (QUANT_METHOD for puzzle's exports; "unknown"
    when it names none), None for an unquantized checkpoint."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    return quantization.get("quant_method", "unknown") if isinstance(quantization, Mapping) else "unknown"


def dequantizing_sources(sources: Mapping[str, TensorSource], where: str) -> dict[str, TensorSource]:
    """`map_checkpoint`'s sources with each quantized weight's stored tensors folded into one
    `DequantizedSource` under the weight's own key (so `load` sees the model's tensors, names and shapes)."""
    out = dict(sources)
    for key, source in sources.items():
        module = None
        if key.endswith(".weight_packed"):
            module, fmt, suffixes = (
                key.removesuffix(".weight_packed"),
                "nvfp4",
                ("weight_packed", "weight_scale", "weight_global_scale"),
            )
        elif key.endswith(".weight") and source.dtype == "F8_E4M3":
            module, fmt, suffixes = key.removesuffix(".weight"), "fp8", ("weight", "weight_scale")
        if module is None:
            continue
        parts = []
        for suffix in suffixes:
            part = sources.get(f"{module}.{suffix}")
            if part is None:
                raise CheckpointError(f"{where}: quantized weight {source.key!r} has no {suffix!r} beside it")
            parts.append((suffix, part))
            out.pop(f"{module}.{suffix}", None)
        main = dict(parts)["weight_packed" if fmt == "nvfp4" else "weight"]
        rows, cols = main.shape
        shape = (rows, cols * 2) if fmt == "nvfp4" else (rows, cols)
        out[f"{module}.weight"] = DequantizedSource(
            main.file, main.key, shape, "F32", None, fmt, tuple(parts)
        )
    leftover = [key for key in out if key.endswith((".weight_scale", ".weight_global_scale"))]
    if leftover:
        raise CheckpointError(f"{where}: scale tensor(s) {leftover[:3]} belong to no quantized weight")
    return out


def spec_with_formats(spec: ModelSpec, sources: Mapping[str, TensorSource]) -> ModelSpec:
    """`spec` with the `weight_format` of each block whose covered weights (`quantized_weights`) are all
    stored in one format, read from the `dequantizing_sources`: a loaded export keeps its blocks' formats
    (`puzzle costs` of it, a re-export, a further search see them). Its forward is unchanged: the block's
    weights are already on the format's grid, where quantizing again is the identity bit for bit (nvfp4's
    global scale and small blocks are chosen so, `puzzle.quant`), and a re-export writes the same bytes. A block stored partly quantized (another tool's checkpoint) stays as
    the spec says: its weights load exactly, dequantized, and are not quantized again in the forward."""
    stored: dict[int, dict[str, str]] = {}
    for key, source in sources.items():
        if isinstance(source, DequantizedSource) and key.startswith("layers."):
            _, index, _, name = key.split(".", 3)  # layers.{i}.mixer.{name}
            stored.setdefault(int(index), {})[name] = source.fmt
    blocks = list(spec.blocks)
    for index, formats in stored.items():
        block = blocks[index]
        kinds = set(formats.values())
        whole = set(formats) == set(quantized_weights(block, spec.hidden_size))
        if takes_weight_format(block) and len(kinds) == 1 and whole:
            blocks[index] = dataclasses.replace(block, weight_format=kinds.pop())
    return dataclasses.replace(spec, blocks=tuple(blocks))


def read_back(
    sources: Mapping[str, TensorSource], spec: ModelSpec, where: str
) -> tuple[dict[str, TensorSource], ModelSpec]:
    """A compressed-tensors export's `map_checkpoint` sources and config spec as `load` reads them: each
    quantized weight one `DequantizedSource` (`dequantizing_sources`), each block in the format its weights
    are stored in (`spec_with_formats`). Shared by `load` and `puzzle costs` of a checkpoint directory, which
    thereby count a block's weights in the format they are served in."""
    sources = dequantizing_sources(sources, where)
    return sources, spec_with_formats(spec, sources)


def read_source(handles: Mapping[Path, Any], source: TensorSource) -> torch.Tensor:
    """A model tensor from its source: dequantized when stored quantized, else read as is."""
    if isinstance(source, DequantizedSource):
        return source.read(handles)
    return read_tensor(handles[source.file], source.file, source.key, source.expert)


__all__ = [
    "CT_FORMATS",
    "PRESETS",
    "DequantizedSource",
    "QuantPlan",
    "dequantizing_sources",
    "plan",
    "quantization_config",
    "quant_method",
    "quantized_entries",
    "read_back",
    "read_formats",
    "read_source",
    "stream_quantized",
]
