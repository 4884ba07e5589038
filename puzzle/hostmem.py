"""Host memory that a freed tensor gives back to the system, so a rank's resident set is what it holds.

glibc serves a large allocation with its own `mmap` (returned to the system on free) only above a
threshold that starts at 128 KiB and *rises* to the size of each large block freed, up to 32 MiB. After
the first all-gather of an FSDP unit is freed, every later allocation below that size (all-gathered units,
gradients before their reduce-scatter, AdamW's temporaries, logits chunks) comes from the heap, where
freed blocks stay resident, fragmented by the small tensors allocated between them. On a CPU run
(gloo ranks, where host memory is the device memory) the resident set then keeps the high-water mark of
every transient gather: measured on the 399 MiB benchmark parent at 2 ranks (benchmarks/bench_scale.py),
2,781 MiB per rank above the import baseline with the dynamic threshold, 1,843 MiB with a fixed one.

`return_freed_memory` fixes the threshold (`mallopt(M_MMAP_THRESHOLD, ...)`, which also turns the rise
off): blocks of at least `threshold` bytes are mapped and unmapped on their own. The memory is really
returned (the process holds less), nothing is hidden from `ru_maxrss`. A user's own
`MALLOC_MMAP_THRESHOLD_` environment setting wins; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
DEFAULT_THRESHOLD = 1 << 20  # 1 MiB: every weight-sized tensor; small activations stay on the fast heap


def return_freed_memory(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Serve allocations of at least `threshold` bytes by mmap from now on, in this process; returns whether
    the setting was made (False: not glibc, or MALLOC_MMAP_THRESHOLD_ is set in the environment)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
