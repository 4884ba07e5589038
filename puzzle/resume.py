"""Resumable training checkpoints (BLD waves, GKD): optimizer state as tensors, rank-0 atomic writes, reads.

A checkpoint is one safetensors file (weights, AdamW moments, whatever else the trainer keeps) and a JSON
record that names it (`"tensors"`), written in that order by rank 0 while the other ranks wait, so a kill at
any moment leaves the previous complete checkpoint readable; the tensors file the previous record named is
deleted only after the new record is in place. The record carries the fingerprints of the trainer's inputs:
a record of other inputs is not a checkpoint of this run. Nothing is pickled.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from puzzle import dist, shard
from puzzle.artifacts import json_writer
from puzzle.files import atomic_write
from puzzle.nemotron_h.stream import Entry, Unit, dtype_name, write_streamed
from puzzle.nemotron_h.weights import SINGLE_FILE

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


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], prefix: str
) -> None:
    """Restore into `optimizer` what `optimizer_tensors` saved under `prefix`, each moment laid out (sharded)
    as its parameter; the step counts are scalars and stay as they are."""
    saved = optimizer.state_dict()
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    for key in sorted(tensors):  # sorted: the same scatter order on every rank
        if key.startswith(prefix):
            index, name = key[len(prefix) :].split("/")
            value = tensors[key]
            if value.ndim > 0:
                value = shard.like(value, parameters[int(index)])
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
) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path] | None:
    """(record, tensors, tensors file) of the checkpoint `folder/record_name` when one was written for these
    `inputs`, else None (none there, or another run's)."""
    record_path = folder / record_name
    if not record_path.is_file():
        return None
    record = json.loads(record_path.read_text())
    if record.get("inputs") != dict(inputs):
        return None
    path = folder / record["tensors"]
    return record, load_file(str(path)), path


def announce_resume(what: str, step: int, tokens: int) -> int:
    """Say (INFO, rank 0) that `what` picked up a checkpoint and goes on from `step` after `tokens` trained
    tokens, rather than from the start; returns `step`. The trainers call it once they have restored the
    checkpoint, so the log tells a resumed stage from one computed afresh."""
    if dist.is_main():
        _log.info("%s: resuming from step %d (%d tokens trained before the interruption)", what, step, tokens)
    return step
