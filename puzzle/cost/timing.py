"""The one latency statistic of the cost model: the median of timed calls after untimed warm-up calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_seconds(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 2,
    device: Any = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds of `repeats` calls of `fn` after `warmup` untimed ones, on `clock` (wall time; or
    `time.process_time`, the process's CPU time, which other jobs on a shared CPU do not stretch).

    On a CUDA `device` every timed call ends with a synchronize, so queued kernels are counted.
    """
    synchronize = _synchronizer(device)
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        synchronize()
        times.append(clock() - start)
    return statistics.median(times)


def _synchronizer(device: Any) -> Callable[[], None]:
    if device is None or getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return lambda: None
    import torch  # only a CUDA timing needs it

    return lambda: torch.cuda.synchronize(device)
