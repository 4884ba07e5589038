"""puzzle.hostmem: freed weight-sized tensors go back to the system (the resident set the benchmark reads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A fresh process: a 16 MiB block freed (glibc's dynamic mmap threshold rises to it), then 64 blocks of
# 2 MiB, each followed by a small tensor that pins the heap between them, and the big ones freed. Prints
# the MiB still resident of the 128 MiB freed.
SCRIPT = """
import sys, torch
from puzzle import hostmem
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
if sys.argv[1] == "on":
    assert hostmem.return_freed_memory()
torch.empty(16 << 20, dtype=torch.uint8).fill_(1)
start = rss()
big, small = [], []
for _ in range(64):
    big.append(torch.ones(2 << 20, dtype=torch.uint8))
    small.append(torch.ones(1024, dtype=torch.uint8))
del big
print(rss() - start)
"""


def _kept_mib(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
def test_freed_tensors_leave_the_resident_set() -> None:
    kept_default = _kept_mib("off")
    if kept_default < 64:
        pytest.skip(f"this C library returns fragmented blocks by itself ({kept_default:.0f} MiB kept)")
    assert _kept_mib("on") < 16  # of the 128 MiB freed; glibc's default keeps all of it


def test_a_users_own_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    from puzzle import hostmem

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert hostmem.return_freed_memory() is False
