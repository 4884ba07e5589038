"""NemotronH checkpoint directories in and out: `load` builds a HybridLM, `save_pretrained` writes one.

A checkpoint is config.json (`puzzle.nemotron_h.config`) plus safetensors weights
(`puzzle.nemotron_h.weights`) and the tokenizer / generation files that travel with them. Saving
never writes into the directory a model was loaded from, never deletes a file it did not write, and
replaces an earlier checkpoint atomically (`puzzle.files` staging directories).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from collections.abc import Callable, Mapping
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
from torch import nn

from puzzle import dist, files
from puzzle.blocks.moe import allocate_banks, module_hub_state
from puzzle.files import (
    CARD_FILE,
    OWNER_MARKER,
    card_owner,
    default_mode,
    make_staging_dir,
    remove_stale_staging,
    swap_directory_into_place,
)
from puzzle.kv_cache import KVCacheError, set_kv_scales
from puzzle.model import HybridLM
from puzzle.nemotron_h import kv_export, modelopt, quantized
from puzzle.nemotron_h.config import (
    CONFIG_NAME,
    CheckpointError,
    config_from_spec,
    read_config,
    spec_from_config,
)
from puzzle.nemotron_h.remote import REMOTE_CODE_FILES, write_remote_code
from puzzle.nemotron_h.stream import convert_weights, stream_weights
from puzzle.nemotron_h.weights import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    SHARD_FILE,
    SINGLE_FILE,
    disk_name,
    map_checkpoint,
    open_safetensors,
    weight_files,
)
from puzzle.progress import progress
from puzzle.spec import ModelSpec, NoOpSpec, with_weight_formats
from puzzle.spec import weight_formats as spec_weight_formats

# ---------------------------------------------------------------------------------------------------- load


def _assign(model: nn.Module, key: str, tensor: torch.Tensor) -> None:
    """Replace the (meta) parameter or buffer `key` of `model` by `tensor`."""
    module_name, _, leaf = key.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=module._parameters[leaf].requires_grad)
    else:
        module._buffers[leaf] = tensor


def _keeps_fp32(key: str) -> bool:
    # The router decides which experts run; like transformers, keep its weight and bias in fp32.
    return key.endswith(("mixer.gate.e_score_correction_bias", "mixer.gate.weight"))


def _compute_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`load`'s dtype argument checked: None, or a floating-point dtype of at least 16 bits."""
    if dtype is None:
        return None
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(found, torch.dtype) or not found.is_floating_point or found.itemsize < 2:
        raise ValueError(
            f"dtype {dtype!r} is not a dtype a model can be loaded in; use torch.bfloat16, torch.float16, "
            "torch.float32 or torch.float64 (or their names)"
        )
    return found


def _refuse_quantized(config: Mapping[str, Any], path: Path, what: str) -> None:
    """Quantised checkpoints store packed weights and scales that are not the model's tensors: only a plain
    `load` reads puzzle's own compressed-tensors exports back (dequantized); `what` cannot."""
    if config.get("quantization_config"):
        quantized.read_formats(config, str(path / CONFIG_NAME))  # a foreign quantization: its own message
        raise CheckpointError(
            f"{path / CONFIG_NAME} describes a quantized checkpoint; {what} reads unquantized weights only: "
            "load it with puzzle.load (unsharded), which dequantizes it, and save that"
        )


def load(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    *,
    shard: bool | str = False,
) -> HybridLM:
    """Load a NemotronH checkpoint directory (config.json + safetensors) as a HybridLM in eval mode.

    dtype (a floating-point torch dtype of 16 bits or more, or its name) None keeps the checkpoint's
    dtype (that of its embeddings); the router's weight and correction bias stay fp32 either way, as
    in transformers. Tensors are read one at a time from memory-mapped files straight into the model,
    so peak memory is about one copy of the weights. Tensors outside the backbone and lm_head (e.g.
    `mtp.*`) are kept unread in `model.extra_tensors` and written back on save.

    device "meta" builds the model's structure without reading any weight: the checkpoint's tensor
    names, shapes and dtypes are checked as for a real load and the parameters are meta tensors of
    the dtype a real load would give (for inspecting or costing a model, or `to_empty` + init). Such a
    model cannot be saved.

    shard=True (under an initialised torch.distributed process group, e.g. torchrun) returns the model
    sharded with FSDP2 over the ranks as `puzzle.shard.shard_parent` shards it, each rank reading from the
    files only the rows it owns (`puzzle.nemotron_h.sharded`): no rank ever holds the whole model. With
    one rank it is this plain load. RuntimeError without a process group. shard="hsdp" shards inside a
    node and replicates across nodes (`puzzle.shard.mesh`); True and "fsdp" shard over every rank. `device` None is the CPU for a
    plain load and this rank's device (`puzzle.dist.device()`: cuda:LOCAL_RANK, or the CPU) for a sharded one.

    A quantized export of puzzle's (compressed-tensors fp8 / nvfp4 blocks, `save_pretrained(...,
    weight_formats=)`) is read back dequantized: each quantized weight is its served values (the
    fake-quantized weights, `puzzle.quant`), in `dtype`, and its blocks keep their formats
    (`model.spec.blocks[i].weight_format`, `quantized.spec_with_formats`). Other quantized checkpoints
    are refused.

    Raises CheckpointError naming the file and tensor for a missing, unexpected, misshapen or
    non-float (e.g. int8 or fp8 without its scales) weight.
    """
    if shard:
        from puzzle.nemotron_h import sharded  # on use: FSDP and DTensor imports

        sharded.require_process_group()
        device = dist.device() if device is None else device
        if dist.world_size() > 1:
            _refuse_quantized(read_config(Path(path)), Path(path), "a sharded load")
            meta = load(path, dtype=dtype, device="meta")  # names, shapes and dtypes checked as for a load
            return sharded.load_sharded(meta, path, device, "fsdp" if shard is True else shard)
    compute_dtype = _compute_dtype(dtype)
    device = torch.device("cpu" if device is None else device)
    path = Path(path)
    config = read_config(path)
    spec = spec_from_config(config, where=str(path / CONFIG_NAME))
    quantized_formats = quantized.read_formats(config, str(path / CONFIG_NAME))
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(open_safetensors(file)) for file in weight_files(path)}
        sources, extras, prefix = map_checkpoint(handles)
        sources, kv_sources = kv_export.take_scales(sources)  # an fp8 KV cache's scales: no model tensors
        if kv_export.check_kv_cache_scheme(config, str(path / CONFIG_NAME)) and not kv_sources:
            raise CheckpointError(
                f"{path}: config.json has a kv_cache_scheme but the weights hold no k_scale / v_scale"
            )
        if quantized_formats is not None:  # puzzle's compressed-tensors export: weights read back dequantized
            sources, spec = quantized.read_back(sources, spec, str(path))
        with torch.device("meta"):
            model = HybridLM(spec)
        # Hub names: the routed experts of each MoE block one by one, as checkpoints store them.
        expected = {key: tuple(value.shape) for key, value in module_hub_state(model).items()}
        if spec.tie_embeddings:
            expected.pop("lm_head.weight")
            sources.pop("lm_head.weight", None)
        for index, block in enumerate(spec.blocks):  # older files kept a no-op block's (unused) pre-norm
            if isinstance(block, NoOpSpec):
                sources.pop(f"layers.{index}.norm.weight", None)
        missing = [key for key in expected if key not in sources]
        if missing:
            names = ", ".join(repr(disk_name(key, prefix)) for key in missing[:5])
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"{path}: checkpoint is missing tensor(s) {names}{more}")
        unexpected = [key for key in sources if key not in expected]
        if unexpected:
            names = ", ".join(repr(sources[key].key) for key in unexpected[:5])
            more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
            raise CheckpointError(
                f"{path}: unexpected tensor(s) {names}{more} for a model with pattern {spec.pattern}"
            )
        for key, shape in expected.items():
            source = sources[key]
            if source.shape != shape:
                raise CheckpointError(
                    f"{source.file.name}: tensor {source.name!r} has shape {list(source.shape)}, "
                    f"expected {list(shape)} (from {CONFIG_NAME})"
                )
            source.check_is_weight()  # every model tensor is a float weight or buffer
        target_dtype = compute_dtype or SAFETENSORS_DTYPES[sources["embeddings.weight"].dtype]
        expert_views = allocate_banks(
            model, target_dtype, device
        )  # each routed expert is a slice of its bank
        for key in progress(expected, f"loading {path.name}", total=len(expected), unit="tensor"):
            source = sources[key]
            if key in expert_views:
                if device.type != "meta":
                    expert_views[key].copy_(quantized.read_source(handles, source))
                continue
            dtype_of_key = torch.float32 if _keeps_fp32(key) else target_dtype
            if device.type == "meta":
                tensor = torch.empty(source.shape, dtype=dtype_of_key, device=device)
            else:
                tensor = quantized.read_source(handles, source)
                tensor = tensor.to(dtype=dtype_of_key).to(device).contiguous()
                if tensor.data_ptr() % 64:  # file data sits at any offset; CPU matmuls round by alignment
                    tensor = tensor.clone()
            _assign(model, key, tensor)
        kv_scales = kv_export.read_scales(handles, kv_sources, str(path)) if kv_sources else {}
    if kv_scales:
        try:
            set_kv_scales(model, kv_scales)
        except KVCacheError as error:
            raise CheckpointError(f"{path}: {error}") from None
    if spec.tie_embeddings:
        model.lm_head.weight = model.embeddings.weight
    leftover = [name for name, value in [*model.named_parameters(), *model.named_buffers()] if value.is_meta]
    if leftover and device.type != "meta":  # a non-persistent buffer would need recomputing; none today
        raise CheckpointError(f"{path}: no checkpoint tensor for {leftover[:5]}")
    model.extra_tensors = dict(extras)
    model.source_config = dict(config)
    model.source_path = path.resolve()
    return model.eval()


def stored_spec(path: str | Path, config: Mapping[str, Any] | None = None) -> ModelSpec:
    """The spec `load(path)` builds, from config.json (`config`: already read) and, for a quantized export of
    puzzle's, the weight files' headers (no tensor is read): its blocks carry the formats their weights are
    stored in (`quantized.read_back`). CheckpointError for another tool's quantized checkpoint, as `load`."""
    path = Path(path)
    config = read_config(path) if config is None else config
    where = str(path / CONFIG_NAME)
    spec = spec_from_config(config, where=where)
    if quantized.read_formats(config, where) is None:
        return spec
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(open_safetensors(file)) for file in weight_files(path)}
        return quantized.read_back(map_checkpoint(handles)[0], spec, str(path))[1]


# -------------------------------------------------------------------------------------------------- save


# Tokenizer and generation files copied from the loaded checkpoint, so the output is usable as is
# (never code: a `*.py` file matching these is neither copied nor counted as a checkpoint file).
_AUX_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template*",
    "*.jinja",
    "vocab.*",
    "merges.txt",
)


def _is_aux_file(name: str) -> bool:
    return not name.endswith(".py") and any(fnmatch(name, pattern) for pattern in _AUX_FILES)


# Written beside the weights by `puzzle.export` (what the child is and where it came from).
EXPORT_RECORD = "puzzle.json"


def is_checkpoint_file(name: str) -> bool:
    """Whether a file called `name` is one a checkpoint save writes (config, weights, index, aux files)."""
    return (
        name in (CONFIG_NAME, SINGLE_FILE, INDEX_FILE, OWNER_MARKER, EXPORT_RECORD, modelopt.HF_QUANT_CONFIG)
        or name in REMOTE_CODE_FILES
        or SHARD_FILE.fullmatch(name) is not None
        or _is_aux_file(name)
    )


def foreign_entries(directory: Path) -> list[str]:
    """Entries of `directory` a checkpoint save would not write: other files and every subdirectory (what
    makes `save_pretrained` refuse it without `overwrite`); none for a missing directory."""
    ours = {CARD_FILE} if card_owner(directory) == "puzzle" else set()  # the model card of an earlier export
    return files.foreign_entries(
        directory, lambda entry: not entry.is_dir() and (is_checkpoint_file(entry.name) or entry.name in ours)
    )


def refusal_to_overwrite(target: Path, foreign: list[str]) -> str:
    """The first half of the refusal to save into `target`, which holds `foreign` (`foreign_entries`): the
    caller adds what its user can do about it (a keyword argument, a command-line flag)."""
    return files.refusal_to_overwrite(target, foreign, "checkpoint files")


def save_pretrained(
    model: HybridLM,
    path: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    *,
    model_type: str = "auto",
    aux_source: str | Path | None = None,
    extra_files: Mapping[str, str] | None = None,
    weight_formats: Mapping[str, str] | None = None,
    block_weight_formats: Mapping[int, str] | None = None,
    quant_layout: str = "compressed-tensors",
) -> Path:
    """Write `model` as a NemotronH checkpoint directory at `path`; returns the path.

    `quant_layout`: how quantized blocks are stored: "compressed-tensors" (vLLM, SGLang, `puzzle.load`) or
    "modelopt" (TensorRT-LLM: hf_quant_config.json and ModelOpt's tensors, `puzzle.nemotron_h.modelopt`).

    `weight_formats`: {module-name prefix, e.g. "backbone.layers.3.mixer": "bf16" | "fp8" | "nvfp4"}: the
    matmul weights of those blocks' mixers are stored quantized in the compressed-tensors format vLLM
    loads, with `quantization_config` in config.json (`puzzle.nemotron_h.quantized`); {}: none quantized;
    None: the formats of the model's block specs (`weight_format`, e.g. an assembled child's:
    `puzzle.spec.weight_formats`), if any. `block_weight_formats`: the same as {block index: format}, what
    `weight_formats` is read into (`puzzle.quant_blocks.block_formats`, e.g. by `puzzle.export`); give one.

    `model_type`: as `config_from_spec` ("auto", "nemotron_h", "nemotron_h_puzzle"). `aux_source`: the
    directory whose tokenizer / generation files are copied (default: the one the model was loaded
    from), never written into either. `extra_files`: {file name: text} written with the checkpoint
    (e.g. `puzzle.json`), atomically with it.

    Layout: config.json (see `config_from_spec`), model.safetensors, or model-0000i-of-0000n.safetensors
    plus model.safetensors.index.json when the tensors exceed `max_shard_bytes`, and the tokenizer /
    generation files of the checkpoint the model was loaded from; a nemotron_h_puzzle checkpoint also gets
    the `trust_remote_code` modelling files and `auto_map` (`puzzle.nemotron_h.remote`). Every file gets the permissions of
    a plainly created one (`puzzle.files.default_mode`).

    What happens to `path`:
    - missing, empty, or holding only checkpoint files (config.json, model.safetensors,
      model-NNNNN-of-NNNNN.safetensors, model.safetensors.index.json, tokenizer* / vocab.* /
      merges.txt / special_tokens_map.json / generation_config.json / chat templates; no
      subdirectory), i.e. an earlier checkpoint: the checkpoint is built in a hidden staging
      directory beside it and renamed into place, replacing the old one atomically;
    - holding anything else (code, data, a README not written by puzzle.export, a `.git` folder): refused with CheckpointError,
      nothing written, unless `overwrite=True`, which writes the checkpoint files into it beside the
      other files (each file replaced atomically, not the set): files with checkpoint names are
      replaced, and stale weights of an earlier save (model.safetensors, shards, index) are removed
      so the directory reads as the new checkpoint; no other file is touched;
    - the directory the model was loaded from, a folder holding it, or one inside it: refused.

    The weights are streamed (`puzzle.nemotron_h.stream.stream_weights`): one tensor in memory at a time, the
    bytes those of safetensors' `save_file`. A model sharded with FSDP2 over several ranks: call it on every
    rank; the ranks gather one tensor at a time and rank 0 writes (a refusal or failure on rank 0 is a
    RuntimeError naming it on the others).

    A save killed midway leaves a `.NAME.tmp-*` (or `.NAME.old-*`) directory beside `path`; the next
    save to `path` removes it once its owner marker proves the process that wrote it is gone (and
    puts a previous checkpoint moved aside back first). A save that fails leaves nothing behind.
    """
    meta = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if meta:
        raise CheckpointError(f"cannot save a model with tensors on the meta device (e.g. {meta[0]!r})")
    options: dict[str, Any] = {
        "overwrite": overwrite,
        "model_type": kv_export.kv_model_type(model, model_type),
        "aux_source": aux_source,
        "extra_files": extra_files,
    }

    # weights(directory): write the weight files there (None: a sharded save's other ranks, gathering only)
    weights: Callable[[Path | None], list[str]] = functools.partial(
        stream_weights, model, max_shard_bytes=max_shard_bytes
    )
    formats = exported_formats(model.spec, weight_formats, block_weight_formats)
    options["formats"] = formats  # the config describes the blocks as stored (e.g. nvfp4 experts)
    # {} or only bf16 blocks: every block as it is (e.g. bf16 for llama.cpp), no quantization_config
    quant_plan = quantized.plan(model, formats) if formats else None  # refusals before writing
    if quant_layout not in modelopt.LAYOUTS:
        raise CheckpointError(
            f"unknown quant_layout {quant_layout!r}; choose one of {list(modelopt.LAYOUTS)}"
        )
    if quant_plan is not None and quant_plan.weights and quant_layout == "modelopt":
        problems = modelopt.layout_problems(model.spec, quant_plan.blocks)
        if kv_export.scale_tensors(model):
            problems.append(
                (-1, "an fp8 KV cache: its scales are written for vLLM only (compressed-tensors)")
            )
        if problems:
            listed = "; ".join(f"block {index}: {why}" if index >= 0 else why for index, why in problems)
            raise CheckpointError(f"the ModelOpt layout (TensorRT-LLM) cannot hold this child: {listed}")
        table = modelopt.hf_quant_config(quant_plan.weights)
        options["quantization_config"] = modelopt.inline_config(table)
        options["extra_files"] = {
            **(extra_files or {}),
            modelopt.HF_QUANT_CONFIG: json.dumps(table, indent=2) + "\n",
        }
        weights = functools.partial(
            quantized.stream_quantized,
            model,
            max_shard_bytes=max_shard_bytes,
            quant_plan=quant_plan,
            layout="modelopt",
        )
    elif quant_plan is not None and quant_plan.weights:
        options["quantization_config"] = quantized.quantization_config(quant_plan)
        weights = functools.partial(
            quantized.stream_quantized, model, max_shard_bytes=max_shard_bytes, quant_plan=quant_plan
        )
    if kv_export.scale_tensors(model):  # an fp8 KV cache: its scheme, beside the weights' groups if any
        base = options.get("quantization_config") or quantized.quantization_config(
            quantized.QuantPlan({}, {})
        )
        options["quantization_config"] = kv_export.with_kv_cache_scheme(base)
    written_plain = _quantized_blocks_written_plain(model, formats)
    if written_plain:  # the values those blocks multiply by, so a plain load computes as the model does
        weights = functools.partial(_effective_weights, weights, written_plain)

    if _sharded(model):  # every rank gathers, rank 0 writes
        return _save_sharded(model, path, weights, options)
    return _save(model, path, weights, **options)


def exported_formats(
    spec: ModelSpec,
    weight_formats: Mapping[str, str] | None = None,
    block_weight_formats: Mapping[int, str] | None = None,
) -> dict[int, str]:
    """{block index: format} a save writes: `block_weight_formats` as given, else `weight_formats` (module-name
    prefixes, read here once by `block_formats`), else the block specs' own formats (`spec.weight_formats`)."""
    from puzzle.quant_blocks import block_formats

    if weight_formats is not None and block_weight_formats is not None:
        raise CheckpointError("give weight_formats (module-name prefixes) or block_weight_formats, not both")
    if block_weight_formats is not None:
        return dict(block_weight_formats)
    if weight_formats is not None:
        return block_formats(weight_formats, spec.num_blocks)
    return spec_weight_formats(spec)


def _quantized_blocks_written_plain(model: HybridLM, formats: Mapping[int, str]) -> list[nn.Module]:
    """The mixers whose spec quantizes them (an assembled child's fp8 / nvfp4 blocks) but which
    `formats` ({block index: format}) writes unquantized (e.g. {} for llama.cpp)."""
    return [
        model.layers[index].mixer
        for index, fmt in spec_weight_formats(model.spec).items()
        if formats.get(index, "bf16") == "bf16"
    ]


def _effective_weights(
    weights: Callable[[Path | None], list[str]], mixers: list[nn.Module], directory: Path | None
) -> list[str]:
    """`weights(directory)` with `mixers`' covered weights fake-quantized in their spec's format: the values
    their forward multiplies by. For a baked child (it holds fake_quantize(master)) these are its stored
    values bit for bit, fake quantization being idempotent (`puzzle.quant`); a quantized block that still
    holds master weights (not baked) is written as its forward computes, not as its masters."""
    from puzzle.blocks.formats import fake_quantized

    with contextlib.ExitStack() as stack:
        for mixer in mixers:
            stack.enter_context(fake_quantized(mixer))
        return weights(directory)


def _sharded(model: nn.Module) -> bool:
    """Whether `model` holds parameters sharded over more than one rank (FSDP2 DTensors)."""
    return dist.world_size() > 1 and any(hasattr(p, "device_mesh") for p in model.parameters())


def _save_sharded(
    model: HybridLM, path: str | Path, weights: Callable[[Path | None], list[str]], options: dict[str, Any]
) -> Path:
    """`save_pretrained` of an FSDP2-sharded model, called on every rank: rank 0 checks, stages and writes
    the files while every rank gathers the tensors with it one at a time (`stream_weights`). A refusal or
    failure on rank 0 is raised there as it is and on the other ranks as a RuntimeError naming it."""
    if not dist.is_main():
        if dist.broadcast_object(None):  # rank 0 reached the weights: gather with it
            weights(None)
        failure = dist.broadcast_object(None)
        if failure is not None:
            raise RuntimeError(f"rank 0 failed to save {path}: {failure}")
        return Path(path).absolute()
    announced = False

    def write(staging: Path) -> list[str]:
        nonlocal announced
        announced = dist.broadcast_object(True)
        return weights(staging)

    failure = None
    try:
        return _save(model, path, write, **options)
    except BaseException as error:
        failure = f"{type(error).__name__}: {error}"
        raise
    finally:
        if not announced:  # refused before the weights: the other ranks gather nothing
            dist.broadcast_object(False)
        dist.broadcast_object(failure)


def _save(
    model: HybridLM,
    path: str | Path,
    write: Callable[[Path], list[str]],
    overwrite: bool = False,
    *,
    model_type: str = "auto",
    aux_source: str | Path | None = None,
    extra_files: Mapping[str, str] | None = None,
    quantization_config: Mapping[str, Any] | None = None,
    formats: Mapping[int, str] | None = None,
) -> Path:
    """`save_pretrained`'s checks and files, the weights written into the staging directory by `write`
    (`model` gives the config, the source directory and the tokenizer files; its weights may be meta;
    `formats` {block index: format} the blocks' stored formats, None: their specs')."""
    target = Path(path).absolute()
    source = model.source_path
    aux = source if aux_source is None else Path(aux_source).resolve()
    # Neither over the source (or a folder holding it) nor inside it: the parent's directory stays untouched.
    for protected in dict.fromkeys(p for p in (source, aux) if p is not None):
        if protected.is_relative_to(target.resolve()) or target.resolve().is_relative_to(protected):
            raise CheckpointError(
                f"refusing to write into {target}: the model was loaded from {protected}, which must stay "
                "untouched"
            )
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a directory")
    remove_stale_staging(target)
    foreign = foreign_entries(target)
    if foreign and not overwrite:
        raise CheckpointError(
            f"{refusal_to_overwrite(target, foreign)}; save into a new or empty directory, or pass "
            "overwrite=True to write the checkpoint files beside them"
        )
    stored = model.spec if formats is None else with_weight_formats(model.spec, formats)
    config = config_from_spec(
        stored, model.source_config, dtype=model.embeddings.weight.dtype, model_type=model_type
    )
    if quantization_config is not None:
        config["quantization_config"] = dict(quantization_config)
    staging = make_staging_dir(target)
    try:
        write(staging)
        config = write_remote_code(staging, config)  # nemotron_h_puzzle: the trust_remote_code files
        (staging / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        if aux is not None and aux.is_dir():
            for file in sorted(aux.iterdir()):
                if file.is_file() and _is_aux_file(file.name):
                    shutil.copy2(file, staging / file.name)
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
        for file in staging.iterdir():  # safetensors writes 0o600, copy2 copies the source's mode
            file.chmod(default_mode())
        if foreign:
            _write_beside(staging, target)
        else:
            swap_directory_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def convert_checkpoint(
    source: str | Path,
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    *,
    model_type: str = "auto",
) -> Path:
    """`save_pretrained(load(source, dtype), path, ...)`, the same files byte for byte, streamed: the weights
    are read from `source` and written one tensor at a time (`puzzle.nemotron_h.stream.convert_weights`),
    so memory holds one tensor, not the model (`puzzle convert`). Errors as `load` and `save_pretrained`."""
    _refuse_quantized(read_config(Path(source)), Path(source), "puzzle convert")
    model = load(source, dtype, device="meta")  # every name, shape and dtype checked; no weight read
    return _save(
        model,
        path,
        lambda staging: convert_weights(model, Path(source), staging, max_shard_bytes),
        overwrite,
        model_type=model_type,
    )


def _write_beside(staging: Path, target: Path) -> None:
    """Move the checkpoint files of `staging` into the existing `target`, leaving its other files alone.

    Weight files of an earlier save that this one does not rewrite are removed first (a stale index or
    model.safetensors would be read instead of the new weights; a stale hf_quant_config.json would make
    TensorRT-LLM read compressed-tensors weights as ModelOpt's); config.json comes last.
    """
    written = {file.name for file in staging.iterdir() if file.name != OWNER_MARKER}
    for entry in target.iterdir():
        stale_weights = entry.name in (
            SINGLE_FILE,
            INDEX_FILE,
            modelopt.HF_QUANT_CONFIG,
        ) or SHARD_FILE.fullmatch(entry.name)
        if stale_weights and entry.name not in written and entry.is_file():
            entry.unlink()
    for name in sorted(written, key=lambda name: name == CONFIG_NAME):
        os.replace(staging / name, target / name)
    shutil.rmtree(staging)
