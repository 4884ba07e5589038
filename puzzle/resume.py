"""Resumable training checkpoints (BLD waves, GKD): optimizer state as tensors, rank-0 atomic writes, reads.

A checkpoint is one safetensors file (weights, AdamW moments, whatever else the trainer keeps) and a JSON
record that names it (`"tensors"`), written in that order by rank 0 while the other ranks wait, so a kill at
any moment leaves the previous complete checkpoint readable; the tensors file the previous record named is
deleted only after the new record is in place. The record carries the fingerprints of the trainer's inputs:
a record of other inputs is not a checkpoint of this run. Nothing is pickled.

Reading one back is lazy (`read_checkpoint` -> `CheckpointTensors`, over the memory-mapped file): a tensor is
read when asked for, and one whose destination is sharded (an FSDP2 DTensor: a parameter or its AdamW
moments) only in the rows this rank holds (`CheckpointTensors.like`), so no rank holds, or reads, the whole
checkpoint on resume; plain destinations (one process, replicated tensors, the RNG state) get the whole one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from puzzle import dist, shard
from puzzle.artifacts import ArtifactError, json_writer
from puzzle.files import atomic_write
from puzzle.nemotron_h.config import CheckpointError
from puzzle.nemotron_h.sharded import read_like, read_local
from puzzle.nemotron_h.stream import Entry, Unit, dtype_name, write_streamed
from puzzle.nemotron_h.weights import SINGLE_FILE, open_safetensors

# One file per checkpoint, however large (the streamed writer's shard size).
_ONE_FILE = 2**62

_log = logging.getLogger(__name__)


def optimizer_tensors(optimizer: torch.optim.Optimizer, prefix: str) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as `{prefix}{index}/{name}` tensors (indices and names sorted), as
    the optimizer holds them: sharded moments stay sharded DTensors, gathered one at a time by
    `write_checkpoint` (never all at once on every rank)."""
    state = optimizer.state_dict()["state"]
    return {
        f"{prefix}{index}/{name}": torch.as_tensor(state[index][name]).detach()
        for index in sorted(state)
        for name in sorted(state[index])
    }


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """The tensors of a checkpoint file, read on demand from the memory-mapped file: `tensors[key]` reads one
    whole; `like(key, reference)` reads only this rank's rows when `reference` is a sharded DTensor.

    Names and shapes come from the file's header (`shape`) without reading any data. Every read goes
    through `puzzle.nemotron_h.sharded` (its `read_observer` sees it). Holds the file open until `close()`
    (or the end of a `with` block)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stack = contextlib.ExitStack()
        try:
            self._handle = self._stack.enter_context(open_safetensors(path))
        except CheckpointError as error:
            raise ArtifactError(f"cannot read checkpoint tensors {path}: {error}") from error
        self._keys = sorted(self._handle.keys())
        self._names = frozenset(self._keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        """Tensor `key`, whole (for a plain destination: one process, or a replicated tensor)."""
        self._check(key)
        try:
            return read_local(self._handle, self.path, key, self._placeholder(key))
        except CheckpointError as error:
            raise ArtifactError(str(error)) from error

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._names

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of tensor `key` from the file's header (nothing read)."""
        self._check(key)
        return tuple(self._handle.get_slice(key).get_shape())

    def like(self, key: str, reference: torch.Tensor, what: str | None = None) -> torch.Tensor:
        """Tensor `key` laid out as `reference`: a DTensor of this rank's rows only (read from the file, no
        collective) when `reference` is a DTensor, the whole tensor as stored otherwise (what
        `puzzle.shard.like` gives, without the whole tensor on any rank). ArtifactError naming the file and
        the tensor when the shapes differ (`what` names the destination, e.g. "the student")."""
        self._check_shape(key, reference, what)
        try:
            return read_like(self._handle, self.path, key, reference)
        except CheckpointError as error:
            raise ArtifactError(str(error)) from error

    def local(self, key: str, reference: torch.Tensor, what: str | None = None) -> torch.Tensor:
        """This rank's part of tensor `key` for a destination laid out as `reference`, on the CPU as stored:
        its rows of a sharded DTensor, the whole tensor for a plain `reference` (shapes checked as `like`)."""
        self._check_shape(key, reference, what)
        try:
            return read_local(self._handle, self.path, key, reference)
        except CheckpointError as error:
            raise ArtifactError(str(error)) from error

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, key: str) -> None:
        if key not in self:
            raise KeyError(f"{self.path}: no tensor {key!r} in the checkpoint")

    def _check_shape(self, key: str, reference: torch.Tensor, what: str | None) -> None:
        found = self.shape(key)
        if found != tuple(reference.shape):
            raise ArtifactError(
                f"{self.path}: tensor {key!r} has shape {list(found)}, {what or 'its destination'}'s is "
                f"{list(reference.shape)}"
            )

    def _placeholder(self, key: str) -> torch.Tensor:
        """A meta tensor of `key`'s shape: the plain destination `read_local` reads whole into."""
        return torch.empty(self.shape(key), device="meta")


def laid_out(tensors: Mapping[str, torch.Tensor], key: str, reference: torch.Tensor) -> torch.Tensor:
    """Tensor `key` of `tensors` laid out as `reference` (this rank's shard when it is a DTensor): read lazily,
    only this rank's rows, from a `CheckpointTensors`; from a whole tensor (`puzzle.shard.like`, a scatter)
    otherwise."""
    if isinstance(tensors, CheckpointTensors):
        return tensors.like(key, reference)
    return shard.like(tensors[key], reference)


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], prefix: str
) -> None:
    """Restore into `optimizer` what `optimizer_tensors` saved under `prefix`, each moment laid out (sharded)
    as its parameter (`laid_out`: from a `CheckpointTensors`, each rank reads only its rows); the step
    counts are scalars and stay as they are."""
    saved = optimizer.state_dict()
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    for key in sorted(tensors):  # sorted: the same order on every rank (`shard.like` scatters: a collective)
        if key.startswith(prefix):
            index, name = key[len(prefix) :].split("/")
            shape = tensors.shape(key) if isinstance(tensors, CheckpointTensors) else tensors[key].shape
            value = laid_out(tensors, key, parameters[int(index)]) if len(shape) > 0 else tensors[key]
            saved["state"].setdefault(int(index), {})[name] = value
    optimizer.load_state_dict(saved)


def write_checkpoint(
    folder: Path,
    record_name: str,
    tensors_name: str,
    tensors: Mapping[str, torch.Tensor],
    record: Mapping[str, Any],
) -> None:
    """Rank 0 writes `tensors` to `folder/tensors_name`, then `record` (with `"tensors": tensors_name`) to
    `folder/record_name`, then deletes the tensors file the record it replaced named; the other ranks wait.

    Every rank calls it with the same names in the same order. Sharded tensors (DTensors) are gathered
    here one at a time, written by rank 0 and freed before the next (`puzzle.nemotron_h.stream`: the file
    `save_file` would write), so no rank holds the whole checkpoint (a wave's or a student's weights with
    both AdamW moments) at once."""
    entries = [Entry(name, dtype_name(value.dtype), tuple(value.shape)) for name, value in tensors.items()]
    units = [_gathered(name, value) for name, value in tensors.items()]
    if not dist.is_main():
        try:
            write_streamed(entries, units, None, _ONE_FILE)  # this rank's part of each gather
        finally:
            dist.barrier()
        return

    def write(path: str) -> None:
        if not entries:
            save_file({}, path)
            return
        with tempfile.TemporaryDirectory(dir=folder, prefix=".stream-") as directory:
            write_streamed(entries, units, Path(directory), _ONE_FILE)
            os.replace(Path(directory) / SINGLE_FILE, path)

    try:
        atomic_write(folder / tensors_name, write)
        record_path = folder / record_name
        old = json.loads(record_path.read_text())["tensors"] if record_path.is_file() else None
        atomic_write(record_path, json_writer({**record, "tensors": tensors_name}))
        if old and old != tensors_name:
            (folder / old).unlink(missing_ok=True)
    finally:
        dist.barrier()


def _gathered(name: str, value: torch.Tensor) -> Unit:
    """A streamed-write unit: `value` whole on the CPU (gathered when sharded: a collective)."""

    def run() -> tuple[list[tuple[str, torch.Tensor]], int]:
        return [(name, shard.full(value))], value.numel() if isinstance(value, DTensor) else 0

    return run


def read_checkpoint(
    folder: Path, record_name: str, inputs: Mapping[str, str]
) -> tuple[dict[str, Any], CheckpointTensors, Path] | None:
    """(record, tensors, tensors file) of the checkpoint `folder/record_name` when one was written for these
    `inputs`, else None (none there, or another run's). The tensors are read lazily (`CheckpointTensors`:
    nothing is read here; close it, or use it in a `with` block, when done)."""
    record_path = folder / record_name
    if not record_path.is_file():
        return None
    record = json.loads(record_path.read_text())
    if record.get("inputs") != dict(inputs):
        return None
    path = folder / record["tensors"]
    return record, CheckpointTensors(path), path


def announce_resume(what: str, step: int, tokens: int) -> int:
    """Say (INFO, rank 0) that `what` picked up a checkpoint and goes on from `step` after `tokens` trained
    tokens, rather than from the start; returns `step`. The trainers call it once they have restored the
    checkpoint, so the log tells a resumed stage from one computed afresh."""
    if dist.is_main():
        _log.info("%s: resuming from step %d (%d tokens trained before the interruption)", what, step, tokens)
    return step
