"""Streaming safetensors writes: a checkpoint's weight files written tensor by tensor, never whole in memory.

The export used to build each shard in memory and hand it to safetensors' `save_file`. Here the
files are laid out first from the tensors' names, dtypes and shapes alone (`plan_files`): the same shards
(`plan_shards`), and in each file the header `save_file` would write (its tensor order, offsets and padding,
`file_header`). Each tensor's bytes then go straight to their offset as soon as the tensor exists, in
whatever order it arrives, so the output is byte-identical to that while memory holds one tensor.

Two sources of tensors:
- a model (`stream_weights`), possibly sharded with FSDP2 over the ranks: every rank walks the state dict
  in the same order and gathers one tensor at a time (`DTensor.full_tensor()`, a collective); rank 0
  writes it and every rank drops it, so no rank holds more than the largest tensor (an MoE block's expert
  bank, `up` or `down`) at once;
- a checkpoint on disk (`puzzle convert`, `checkpoint.convert_checkpoint`): one tensor read at a time.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch
from torch import nn

from puzzle import gathers
from puzzle.blocks.moe import ExpertBank, expert_banks
from puzzle.nemotron_h.config import CheckpointError
from puzzle.nemotron_h.kv_export import scale_tensors
from puzzle.nemotron_h.weights import (
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    SINGLE_FILE,
    LazyTensor,
    TensorSource,
    disk_name,
    map_checkpoint,
    model_key,
    open_safetensors,
    plan_shards,
    read_tensor,
    weight_files,
)

# safetensors' `save_file` lays the data out by dtype (this order, measured against safetensors 0.8 in
# tests/test_stream_export.py), then by name; its header lists the tensors in that same order.
DATA_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
METADATA = {"format": "pt"}

# Called with the parameter elements this rank holds materialised (gathered or read) after each change:
# tests hook it to bound a streaming write's peak memory.
held_observer: Callable[[int], None] | None = None


@dataclass(frozen=True)
class Entry:
    """One tensor of the output: its hub name, safetensors dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * SAFETENSORS_DTYPES[self.dtype].itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("BF16" for torch.bfloat16)."""
    if dtype not in _DTYPE_NAMES:
        raise CheckpointError(f"cannot write a {dtype} tensor to safetensors")
    return _DTYPE_NAMES[dtype]


def file_header(entries: Iterable[Entry]) -> tuple[bytes, dict[str, int]]:
    """(the bytes before the tensor data: length and JSON header, as `save_file` writes them; each tensor's
    offset from the start of the file)."""
    ordered = sorted(entries, key=lambda entry: (DATA_ORDER.index(entry.dtype), entry.name))
    table: dict[str, object] = {"__metadata__": METADATA}
    offset = 0
    for entry in ordered:
        table[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(table, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header with spaces to 8 bytes
    start = 8 + len(text)
    offsets = {
        name: start + value["data_offsets"][0] for name, value in table.items() if name != "__metadata__"
    }
    return len(text).to_bytes(8, "little") + text, offsets


def plan_files(entries: Iterable[Entry], max_shard_bytes: int) -> dict[str, list[Entry]]:
    """{file name: its tensors}: the shards `save_file` of each whole shard makes of the same tensors, in the same order."""
    by_name = {entry.name: entry for entry in entries}
    shards = plan_shards({name: entry.nbytes for name, entry in by_name.items()}, max_shard_bytes)
    if len(shards) == 1:
        return {SINGLE_FILE: [by_name[name] for name in shards[0]]}
    return {
        f"model-{number:05d}-of-{len(shards):05d}.safetensors": [by_name[name] for name in names]
        for number, names in enumerate(shards, start=1)
    }


class _Held:
    """Parameter elements materialised at once on this rank (reported to `held_observer`)."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def change(self, elements: int) -> None:
        self.now += elements
        self.peak = max(self.peak, self.now)
        if held_observer is not None:
            held_observer(self.now)


class StreamWriter:
    """The weight files of `entries` in `directory`, filled in tensor by tensor (any order) by `write`.

    Every file is created at its final size with its header at the start; `close` checks that every tensor
    was written exactly once and writes the index (the layout of a `save_file` per shard).
    """

    def __init__(self, entries: Iterable[Entry], directory: Path, max_shard_bytes: int) -> None:
        self.entries = {entry.name: entry for entry in entries}
        self.files = plan_files(self.entries.values(), max_shard_bytes)
        self.directory = directory
        self.where: dict[str, tuple[IO[bytes], int]] = {}
        self.written: set[str] = set()
        self.handles: list[IO[bytes]] = []
        for file_name, file_entries in self.files.items():
            header, offsets = file_header(file_entries)
            handle = open(directory / file_name, "wb")  # noqa: SIM115 (closed in `close`)
            self.handles.append(handle)
            handle.write(header)
            handle.truncate(len(header) + sum(entry.nbytes for entry in file_entries))
            self.where.update({name: (handle, offset) for name, offset in offsets.items()})

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Tensor `name`'s bytes at its offset; CheckpointError for a name, dtype or shape not planned."""
        entry = self.entries.get(name)
        if entry is None or name in self.written:
            what = "written twice" if entry is not None else "not one of the planned tensors"
            raise CheckpointError(f"streaming {self.directory}: tensor {name!r} is {what}")
        found = Entry(name, dtype_name(tensor.dtype), tuple(tensor.shape))
        if found != entry:
            raise CheckpointError(
                f"streaming {self.directory}: tensor {name!r} is {found.dtype} {list(found.shape)}, planned "
                f"as {entry.dtype} {list(entry.shape)}"
            )
        handle, offset = self.where[name]
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        handle.seek(offset)
        handle.write(memoryview(data))
        self.written.add(name)

    def close(self) -> list[str]:
        """Close the files and write the index; returns the file names (the shards, then the index if any)."""
        for handle in self.handles:
            handle.close()
        missing = [name for name in self.entries if name not in self.written]
        if missing:
            raise CheckpointError(f"streaming {self.directory}: tensors never written: {missing[:5]}")
        if len(self.files) == 1:
            return [SINGLE_FILE]
        total = sum(entry.nbytes for entry in self.entries.values())
        weight_map = {entry.name: file for file, entries in self.files.items() for entry in entries}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return [*self.files, INDEX_FILE]

    def abort(self) -> None:
        for handle in self.handles:
            handle.close()


# A unit of work: the hub tensors it gives, produced when called (the gathered or read tensors held until the
# next unit; the int is the elements they hold).
Unit = Callable[[], tuple[list[tuple[str, torch.Tensor]], int]]


def write_streamed(
    entries: list[Entry], units: Iterable[Unit], directory: Path | None, max_shard_bytes: int
) -> list[str]:
    """Run every unit in order and write its tensors into `directory` (None: run them, write nothing: the
    ranks other than 0 of a sharded write); returns the file names (the shards, then the index if any)."""
    writer = None if directory is None else StreamWriter(entries, directory, max_shard_bytes)
    held = _Held()
    error: Exception | None = None
    for unit in units:  # every unit runs even after a failed write: the other ranks' collectives wait on them
        pieces, elements = unit()
        held.change(elements)
        if writer is not None and error is None:
            try:
                for name, tensor in pieces:
                    copied = 0 if tensor.is_contiguous() else tensor.numel()  # a transposed expert view
                    held.change(copied)
                    writer.write(name, tensor)
                    held.change(-copied)
            except Exception as caught:  # raised once every unit has run
                error = caught
        del pieces
        held.change(-elements)
    if writer is None:
        return []
    if error is not None:
        writer.abort()
        raise error
    return writer.close()


# ------------------------------------------------------------------------------------------ from a model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor  # on use: DTensor imports

    return gathers.track(tensor.full_tensor()) if isinstance(tensor, DTensor) else tensor


def model_entries(model: nn.Module, extras: Mapping[str, torch.Tensor | LazyTensor]) -> list[Entry]:
    """The hub tensors `hub_state` gives for `model` (names, dtypes, shapes; in its order), from metadata only:
    a sharded parameter's global shape, each bank's experts one by one."""
    banks = {prefix + "up": bank for prefix, bank in expert_banks(model).items()}
    downs = {prefix + "down" for prefix in expert_banks(model)}
    out: list[Entry] = []
    for key, tensor in model.state_dict().items():
        if key in banks:
            bank, prefix = banks[key], key.removesuffix("up")
            dtypes = {"up": dtype_name(bank.up.dtype), "down": dtype_name(bank.down.dtype)}
            for name, half, shape in bank.hub_shapes():
                out.append(Entry(disk_name(prefix + name), dtypes[half], shape))
        elif key not in downs:
            out.append(Entry(disk_name(key), dtype_name(tensor.dtype), tuple(tensor.shape)))
    names = {entry.name for entry in out}
    for key, tensor in extras.items():
        if key in names:
            raise CheckpointError(f"extra tensor {key!r} collides with a model tensor")
        dtype = tensor.dtype if isinstance(tensor, LazyTensor) else dtype_name(tensor.dtype)
        out.append(Entry(key, dtype, tuple(tensor.shape)))
    return out


def _bank_unit(key: str, tensor: torch.Tensor, bank: ExpertBank) -> Unit:
    """The experts of one bank half (`up` or `down`, model key `key`), gathered whole."""

    def run() -> tuple[list[tuple[str, torch.Tensor]], int]:
        full = _full(tensor).detach()
        half = key.rsplit(".", 1)[1]
        prefix = key.removesuffix(half)
        pieces = [(disk_name(prefix + name), piece) for name, piece in bank.hub_pieces(half, full)]
        return pieces, full.numel()

    return run


def _tensor_unit(name: str, tensor: torch.Tensor) -> Unit:
    def run() -> tuple[list[tuple[str, torch.Tensor]], int]:
        full = _full(tensor).detach()
        return [(name, full)], full.numel()

    return run


def _extra_unit(name: str, tensor: torch.Tensor | LazyTensor, main: bool) -> Unit:
    """An extra tensor (e.g. MTP), read from its file when written: rank 0 only (no collective)."""

    def run() -> tuple[list[tuple[str, torch.Tensor]], int]:
        if not main:
            return [], 0
        loaded = tensor.load() if isinstance(tensor, LazyTensor) else tensor
        return [(name, loaded)], loaded.numel()

    return run


def model_units(
    model: nn.Module, extras: Mapping[str, torch.Tensor | LazyTensor], main: bool
) -> Iterator[Unit]:
    """One unit per state-dict tensor of `model` (a bank's `up` and `down` each give their experts), then
    the extra tensors. The same units in the same order on every rank (the gathers are collectives)."""
    banks = {}
    for prefix, bank in expert_banks(model).items():
        banks[prefix + "up"] = banks[prefix + "down"] = bank
    for key, tensor in model.state_dict().items():
        if key in banks:
            yield _bank_unit(key, tensor, banks[key])
        else:  # a tied lm_head is gathered again: the file holds its own copy, as `hub_state` writes it
            yield _tensor_unit(disk_name(key), tensor)
    for key, tensor in extras.items():
        yield _extra_unit(key, tensor, main)


def saved_extras(model: nn.Module) -> dict[str, torch.Tensor | LazyTensor]:
    """The tensors a save writes after the model's own: its extra tensors (e.g. MTP), then its KV cache
    scales when its cache is fp8 (`puzzle.nemotron_h.kv_export`)."""
    return {**getattr(model, "extra_tensors", {}), **scale_tensors(model)}


def stream_weights(model: nn.Module, directory: Path | None, max_shard_bytes: int) -> list[str]:
    """Write `model`'s weights (`hub_state`: hub names, experts one by one, extra tensors) into `directory`
    tensor by tensor, byte-identical to `save_file` of each whole shard of `hub_state(model)`; returns the file names.

    A model sharded with FSDP2: call it on every rank (each tensor is gathered by a collective), with the
    directory on rank 0 and None on the others, which gather and drop. Peak memory per rank is the largest
    tensor (a bank's `up` or `down`), plus one expert's transposed copy on rank 0.
    """
    extras = saved_extras(model)
    entries = model_entries(model, extras)
    return write_streamed(
        entries, model_units(model, extras, directory is not None), directory, max_shard_bytes
    )


# --------------------------------------------------------------------------------------- from a checkpoint


def _read_unit(name: str, read: Callable[[], torch.Tensor], dtype: torch.dtype) -> Unit:
    def run() -> tuple[list[tuple[str, torch.Tensor]], int]:
        tensor = read().to(dtype)  # the cast `load` makes
        return [(name, tensor)], tensor.numel()

    return run


def convert_weights(model: nn.Module, path: Path, directory: Path, max_shard_bytes: int) -> list[str]:
    """Write checkpoint `path`'s weights into `directory` as `load(path, dtype)` then `save_pretrained` would,
    byte for byte, reading one tensor (or one expert of a fused tensor) at a time; `model` is that load on
    the meta device (`load(path, dtype, device="meta")`: the names, shapes and dtypes, all checked)."""
    extras = model.extra_tensors
    entries = model_entries(model, extras)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(open_safetensors(file)) for file in weight_files(path)}
        sources, _, _ = map_checkpoint(handles)
        if model.spec.tie_embeddings:  # the copy `hub_state` writes is of the embeddings
            sources["lm_head.weight"] = sources["embeddings.weight"]

        def reader(source: TensorSource) -> Callable[[], torch.Tensor]:
            return lambda: read_tensor(handles[source.file], source.file, source.key, source.expert)

        units: list[Unit] = []
        for entry in entries:
            if entry.name in extras:
                units.append(_extra_unit(entry.name, extras[entry.name], main=True))
                continue
            key, _ = model_key(entry.name)
            units.append(_read_unit(entry.name, reader(sources[key]), SAFETENSORS_DTYPES[entry.dtype]))
        return write_streamed(entries, units, directory, max_shard_bytes)


# ------------------------------------------------------------------------------------ a plain state dict


def stream_state(tensors: Mapping[str, torch.Tensor], directory: Path | None) -> list[str]:
    """Write `tensors` (name -> tensor, as they are named: e.g. a state dict) into one safetensors file
    (`SINGLE_FILE`) in `directory`, one tensor at a time, in their order; returns the file names.

    DTensors (a model sharded with FSDP2) are gathered one at a time: call it on every rank, with the
    directory on rank 0 and None on the others, which gather and drop. Peak memory per rank is the largest
    tensor, never the whole state (GKD's output: `puzzle.gkd`).
    """
    entries = [Entry(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()]
    units = [_tensor_unit(name, tensor) for name, tensor in tensors.items()]
    one_file = sum(entry.nbytes for entry in entries) + 1
    return write_streamed(entries, units, directory, one_file)
