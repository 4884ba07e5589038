"""How many parameter elements this process holds whole, gathered from FSDP2 shards, now and at most.

A sharded model keeps 1/N of each unit on a rank, but several steps make a unit (or a tensor) whole on every
rank for a while: BLD and assembly copy a parent block (`puzzle.shard.gathered_mixer`), GKD turns each unit
of a sharded student back into a plain module before sharding it its own way (`puzzle.shard.plain_unit`),
scoring, the measured KL and GKD's teacher all-gather the lm_head, and saves, fingerprints and the streamed
export gather one tensor at a time. Each of those sites hands what it gathered to `track` (or, for a
unit FSDP unshards in place, wraps the time it is whole in `holding`). The counter follows the tensors'
storages, not the call sites: an element stops counting when the last tensor that uses its storage is freed
(a finalizer on the storage), so a gathered unit that is kept (a plain mixer waiting to be sharded again)
counts until it really goes.

`COUNTER.live` is the number of gathered elements alive now; `COUNTER.peak` the most alive at once since the
last `reset_peak()`. `puzzle run` resets it as each stage starts and logs the stage's peak ("NAME: peak
gathered parameter elements ..."); the stage-by-stage memory test (tests/test_shard_memory.py) reads it.
FSDP2's own all-gather of a unit for its forward or backward is not counted: it is one unit at a time
(plus FSDP's prefetch of the next) by construction.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class GatherCounter:
    """The live and peak counts of gathered (whole, unsharded) parameter elements in this process."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._storages: set[tuple[str, int]] = set()  # (device, data_ptr) of each storage counted now

    def _add(self, numel: int) -> None:
        self.live += numel
        self.peak = max(self.peak, self.live)

    def _release(self, key: tuple[str, int] | None, numel: int) -> None:
        if key is not None:
            self._storages.discard(key)
        self.live -= numel

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count `tensor`, whole tensor just gathered, until its storage is freed; returns it. A storage
        already counted (a view or a no-op copy of a tracked tensor) is counted once."""
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return tensor
        key = (str(tensor.device), storage.data_ptr())
        if key in self._storages:
            return tensor
        numel = storage.nbytes() // tensor.element_size()
        self._storages.add(key)
        self._add(numel)
        weakref.finalize(storage, self._release, key, numel)
        return tensor

    @contextmanager
    def holding(self, numel: int) -> Iterator[None]:
        """Count `numel` elements for the body: a unit FSDP holds unsharded in place (`unshard()`)."""
        self._add(numel)
        try:
            yield
        finally:
            self._release(None, numel)

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now (at the start of a stage)."""
        self.peak = self.live


COUNTER = GatherCounter()


def track(tensor: torch.Tensor) -> torch.Tensor:
    """`COUNTER.track`: count a whole tensor just gathered from shards until it is freed."""
    return COUNTER.track(tensor)
