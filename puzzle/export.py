"""Export a child as a checkpoint serving engines read: weights, config.json, the parent's tokenizer and
generation files, `puzzle.json` (the parent, the solution, predicted and measured figures, MTP) and a
model card, README.md (`puzzle.card`; never over a README.md the user placed there).

Formats: "auto" (plain `nemotron_h` when transformers' NemotronHForCausalLM can hold the child, else
`nemotron_h_puzzle`), "nemotron_h" and "nemotron_h_puzzle" (forced; an impossible nemotron_h is an error),
and "engine": as "auto", after checking that vLLM and llama.cpp can load the child
(`puzzle.nemotron_h.engines`), refusing with every reason (engine, block, why) otherwise. An engine export
for TensorRT-LLM (engines=["trtllm"]) writes quantized blocks in ModelOpt's layout, the one it loads
(hf_quant_config.json, `puzzle.nemotron_h.modelopt`); every other export writes compressed-tensors'.
`puzzle.json` records the layout and who reads it (`quant_layout`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from puzzle.card import model_card
from puzzle.files import CARD_FILE, card_owner
from puzzle.kv_cache import kv_scales
from puzzle.model import HybridLM
from puzzle.nemotron_h.checkpoint import EXPORT_RECORD, exported_formats, save_pretrained
from puzzle.nemotron_h.config import CheckpointError, config_from_spec
from puzzle.nemotron_h.engines import SERVING_ENGINES, engine_problems, engine_support
from puzzle.nemotron_h.kv_export import kv_engine_problems, kv_model_type
from puzzle.nemotron_h.weights import DEFAULT_MAX_SHARD_BYTES
from puzzle.search.types import Solution
from puzzle.spec import ModelSpec, with_weight_formats

FORMATS = ("auto", "nemotron_h", "nemotron_h_puzzle", "engine")
RECORD_FORMAT = 1


class ExportError(CheckpointError):
    """A child that cannot be exported in the format asked for (e.g. one an engine could not load)."""


def _model_type(child: HybridLM, format: str, engines: Iterable[str], stored: ModelSpec | None = None) -> str:
    """The model_type `format` asks for, after an engine export's checks of the child as stored (`stored`:
    its spec in the formats written, None: its own)."""
    if format not in FORMATS:
        raise ExportError(f"unknown export format {format!r}; choose one of {list(FORMATS)}")
    if format == "engine":
        engines = tuple(engines)
        spec = child.spec if stored is None else stored
        problems = [str(problem) for problem in engine_problems(spec, engines)]
        problems += [  # an fp8 KV cache an engine would not serve with its scales
            f"{engine}: {reason}"
            for engine, reasons in kv_engine_problems(child).items()
            if engine in engines
            for reason in reasons
        ]
        if problems:
            listed = "\n  ".join(str(problem) for problem in problems)
            raise ExportError(
                f"refusing an engine export: {len(problems)} reason(s) a serving engine could not load this "
                f"child:\n  {listed}\nexport with format='auto' (puzzle.load and trust_remote_code read it)"
            )
        return "auto"
    return format


def export_config(
    child: HybridLM,
    format: str = "auto",
    engines: Iterable[str] = SERVING_ENGINES,
    formats: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """The config.json `export` writes for `child` (no weights read: works for a model on the meta device);
    `formats` {block index: format}: the blocks' stored formats (None: their specs')."""
    stored = child.spec if formats is None else with_weight_formats(child.spec, formats)
    model_type = kv_model_type(child, _model_type(child, format, engines, stored))
    return config_from_spec(
        stored, child.source_config, dtype=child.embeddings.weight.dtype, model_type=model_type
    )


def export_record(
    child: HybridLM,
    config: Mapping[str, Any],
    parent_dir: Path | None,
    solution: Solution | Mapping[str, Any] | None,
    measured: Mapping[str, Any] | None,
    formats: Mapping[int, str] | None = None,
    layout: str = "compressed-tensors",
) -> dict[str, Any]:
    """The content of `puzzle.json`: what the child is, where it came from, how it scores and who can serve it
    (`layout`: the one its quantized blocks are stored in, which only some engines read)."""
    assembly = getattr(child, "assembly", None)
    record: dict[str, Any] = {"format": RECORD_FORMAT, "model_type": config["model_type"]}
    if assembly is not None:
        record.update(assembly.to_dict())
    else:
        record["parent"] = {"path": None, "fingerprint": None}
    if parent_dir is not None:
        record["parent"]["path"] = str(parent_dir)
    if solution is not None:
        # A saved solution (solutions/{name}.json) is recorded as it is: no search table is rebuilt for it.
        record["search"] = solution.to_json() if isinstance(solution, Solution) else dict(solution)
    if measured is not None:
        record["measured"] = dict(measured)
    record["spec"] = child.spec.to_dict()
    scales = kv_scales(child)
    if scales:  # an fp8 KV cache (`puzzle.kv_cache`): its calibrated scales, by block
        record["kv_cache"] = {"dtype": "fp8", "scales": {str(i): list(pair) for i, pair in scales.items()}}
    record["engines"] = engine_support(
        child.spec if formats is None else with_weight_formats(child.spec, formats)
    )
    for engine, reasons in kv_engine_problems(child).items():
        record["engines"][engine] = [*record["engines"][engine], *reasons]
    if formats is not None and _quantizes(formats):
        for engine, reason in _layout_reasons(layout).items():
            record["engines"][engine] = [*record["engines"][engine], reason]
    if "mtp" not in record:
        record["mtp"] = {
            "handling": "not assembled by puzzle: extra tensors carried as loaded",
            "tensors": sum(name.startswith("mtp.") for name in child.extra_tensors),
        }
    record["mtp"]["config"] = "mtp_block_configs" if "mtp_block_configs" in config else "globals"
    return record


def export(
    child: HybridLM,
    path: str | Path,
    *,
    parent_dir: str | Path | None = None,
    solution: Solution | Mapping[str, Any] | None = None,
    measured: Mapping[str, Any] | None = None,
    format: str = "auto",
    engines: Iterable[str] = SERVING_ENGINES,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    run_info: Mapping[str, Any] | None = None,
    weight_formats: Mapping[str, str] | None = None,
) -> Path:
    """Write `child` (e.g. from `puzzle.assemble.assemble`) as a checkpoint directory at `path`; returns it.

    Files: config.json and safetensors weights (`puzzle.nemotron_h.save_pretrained`, atomic), the
    tokenizer and generation_config.json files of `parent_dir` (default: the directory the parent was
    loaded from), and `puzzle.json` (`export_record`: parent path and fingerprint, solution block by
    block, predicted costs and KL, the search's `solution` (a `Solution`, or its saved JSON as `puzzle
    search --json` and a run's solutions/{name}.json hold it, recorded as it is), `measured` (e.g. `puzzle.assemble.measured_kl`, default the child's
    `assembly.measured`), MTP handling, which engines can serve it; with `format="engine"`,
    `checked_engines`: those it was checked for). `format`: see the module docstring; `engines`: those
    `format="engine"` checks. Never writes into `parent_dir` or the parent's
    directory (CheckpointError); `overwrite` as in `save_pretrained`.

    `weight_formats`: {module-name prefix, e.g. "backbone.layers.3.mixer": "bf16" | "fp8" | "nvfp4"}: those
    blocks' matmul weights are written quantized, in the compressed-tensors format vLLM loads
    (`puzzle.nemotron_h.quantized`; recorded in puzzle.json as `weight_formats`), and `puzzle.load` reads
    them back dequantized. None: the formats of the child's block specs (an assembled child's
    `weight_format`s), if any. llama.cpp has its own quantization types: export bf16 (a child without
    formats) for it and quantize with its tools.

    README.md: the model card (`puzzle.card.model_card`); `run_info` is what the Run API knows of the
    run (`puzzle.card.run_card_info`: budgets, GKD, config fingerprint; None: a standalone export). A
    README.md already at `path` without puzzle's marker is the user's: kept, and no card is written.
    """
    parent = None if parent_dir is None else Path(parent_dir).resolve()
    if parent is not None and not parent.is_dir():
        raise ExportError(f"parent directory {parent} does not exist")
    engines = tuple(engines)
    # {block: format}: the user's module prefixes read once (checked before the record copies them), else
    # an assembled child's blocks' own formats
    formats = exported_formats(child.spec, weight_formats)
    config = export_config(child, format, engines, formats)
    layout = quant_layout(format, engines, formats)
    if measured is None and getattr(child, "assembly", None) is not None and child.assembly.measured:
        measured = child.assembly.measured
    record = export_record(child, config, parent or child.source_path, solution, measured, formats, layout)
    if format == "engine":  # what was checked, beside `engines` (every engine's verdict)
        record["checked_engines"] = list(engines)
    if run_info is not None:
        record["run"] = dict(run_info)
    if weight_formats is not None or formats:
        record["weight_formats"] = {f"backbone.layers.{i}.mixer": fmt for i, fmt in sorted(formats.items())}
    if _quantizes(formats):  # which engines read the stored layout (puzzle.nemotron_h.modelopt / quantized)
        record["quant_layout"] = LAYOUT_RECORDS[layout]
    files = {}
    if card_owner(path) == "user":
        record["model_card"] = f"not written: {CARD_FILE} at the export path is the user's"
    else:
        files[CARD_FILE] = _card(child, record, parent or child.source_path, run_info)
    files[EXPORT_RECORD] = json.dumps(record, indent=2, default=str) + "\n"
    return save_pretrained(
        child,
        path,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        model_type=config["model_type"],
        aux_source=parent,
        extra_files=files,
        block_weight_formats=formats,
        quant_layout=layout,
    )


# puzzle.json's `quant_layout`: how the quantized blocks are stored and who reads that layout.
LAYOUT_RECORDS = {
    "compressed-tensors": {
        "layout": "compressed-tensors",
        "config": "config.json quantization_config",
        "read_by": ["vllm", "sglang", "puzzle.load", "transformers (trust_remote_code)"],
    },
    "modelopt": {
        "layout": "modelopt",
        "config": "hf_quant_config.json (MIXED_PRECISION quantized_layers)",
        "read_by": ["trtllm"],
    },
}


def _layout_reasons(layout: str) -> dict[str, str]:
    """{engine: why it does not read quantized blocks stored in `layout`}."""
    if layout == "modelopt":
        why = (
            "quantized blocks stored in ModelOpt's layout for TensorRT-LLM (hf_quant_config.json), which it does "
            "not read; export without engines=['trtllm'] for compressed-tensors"
        )
        return dict.fromkeys(("vllm", "sglang", "transformers"), why)
    return {
        "trtllm": "quantized blocks stored in compressed-tensors' layout, and TensorRT-LLM refuses its weight-only "
        "nvfp4 groups (input_activations null); export with format='engine', engines=['trtllm'] for ModelOpt's"
    }


def _quantizes(formats: Mapping[int, str]) -> bool:
    return any(fmt != "bf16" for fmt in formats.values())


def quant_layout(format: str, engines: Iterable[str], formats: Mapping[int, str]) -> str:
    """The layout quantized blocks are written in: ModelOpt's for an engine export to TensorRT-LLM (it reads
    hf_quant_config.json; its compressed-tensors reader refuses our weight-only nvfp4), else compressed-tensors.
    One checkpoint holds one layout (the two name and shape their scales differently): an engine export of
    a quantized child for TensorRT-LLM and for vLLM or SGLang at once is refused."""
    engines = tuple(engines)
    if format != "engine" or "trtllm" not in engines or not _quantizes(formats):
        return "compressed-tensors"
    others = [engine for engine in engines if engine in ("vllm", "sglang")]
    if others:
        raise ExportError(
            f"refusing an engine export for trtllm and {others} at once: TensorRT-LLM reads quantized blocks "
            "in ModelOpt's layout (hf_quant_config.json), vLLM and SGLang in compressed-tensors', and one "
            "checkpoint holds one; export twice, engines=['trtllm'] and engines=" + repr(others)
        )
    return "modelopt"


def _card(
    child: HybridLM, record: Mapping[str, Any], parent_dir: Path | None, run_info: Mapping[str, Any] | None
) -> str:
    """The model card of `child`, the parent read from `parent_dir`'s config.json (else the child's source)."""
    parent_config = child.source_config
    if parent_dir is not None and (parent_dir / "config.json").is_file():
        with contextlib.suppress(OSError, ValueError):  # unreadable: the card shows the child's blocks alone
            parent_config = json.loads((parent_dir / "config.json").read_text())
    return model_card(
        child.spec,
        json.loads(json.dumps(record, default=str)),
        parent_dir=parent_dir,
        parent_config=parent_config,
        run=run_info,
    )
