"""GKD with and without per-block activation checkpointing (`GKDSettings.activation_checkpointing`): memory of
one optimiser step and its time.

Run: `PYTHONPATH=.:benchmarks python benchmarks/bench_gkd_checkpointing.py [--hidden 256] [--seq 1024]`.
Writes benchmarks/results/bench_gkd_checkpointing.json and prints a markdown table. Teacher and student are
`bench_gkd`'s (the `bench_importance` parent, pattern `MEM*EM-E`, and that parent with half the experts and
Mamba heads). Each mode runs in its own process (glibc's mmap threshold fixed, so freed activations go back to
the system and RSS follows the live tensors), after one warm-up step (AdamW's moments exist):

- saved bytes: distinct storages packed for the backward by `torch.autograd.graph.saved_tensors_hooks` during
  the step's forward (with checkpointing, the tensors saved inside a block are not packed: the backward
  recomputes them; the block inputs the checkpoint holds are the previous blocks' outputs, counted where
  the cosine or the next op saves them, or not at all when nothing else does);
- peak step memory: on CUDA, `max_memory_allocated` during the step minus the allocation before it; on
  the CPU, the peak resident set during the step (sampled every millisecond) minus the one before it;
- step time: median over `--repeats` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from bench_gkd import child_spec
from bench_importance import parent_spec

from puzzle import gkd
from puzzle.model import HybridLM

RESULTS = Path(__file__).parent / "results" / "bench_gkd_checkpointing.json"


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRSS:
    """The largest resident set seen while the block runs, sampled every millisecond by a thread."""

    def __enter__(self) -> _PeakRSS:
        self.before = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def measure(args: argparse.Namespace, checkpointing: bool) -> dict:
    """One mode, in this process."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    teacher = HybridLM(parent_spec(args.hidden, args.vocab)).to(device).eval().requires_grad_(False)
    student = HybridLM(child_spec(teacher.spec)).to(device).train()
    settings = gkd.GKDSettings(
        lr=1e-5, batch_size=args.batch, vocab_chunk=args.vocab_chunk, steps=10**6, autocast=False
    )
    distiller = gkd._Distiller(student, checkpointing)
    optimizer = torch.optim.AdamW(list(student.parameters()), lr=1e-5)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = batch.to(device)

    def step() -> None:
        gkd._train_step(distiller, teacher, optimizer, batch, 1e-5, settings, args.batch)

    step()  # warm-up: AdamW's moments, the allocator
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        with _PeakRSS() as rss:
            step()
        peak = rss.peak - rss.before
    times = []
    for _ in range(args.repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {
        "checkpointing": checkpointing,
        "saved_bytes": sum(storages.values()),
        "peak_step_bytes": peak,
        "peak_kind": "cuda max_memory_allocated" if cuda else "RSS",
        "step_s": statistics.median(times),
        "step_s_all": times,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--vocab-chunk", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--mode", choices=["on", "off"], help=argparse.SUPPRESS)  # one mode, for the driver
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.mode is not None:
        print(json.dumps(measure(args, args.mode == "on")))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # large frees go back to the system
    rows = {}
    for mode in ("off", "on"):
        out = subprocess.run(
            [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--mode", mode],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    ratios = {
        "saved_bytes": rows["on"]["saved_bytes"] / rows["off"]["saved_bytes"],
        "peak_step_bytes": rows["on"]["peak_step_bytes"] / rows["off"]["peak_step_bytes"],
        "step_s": rows["on"]["step_s"] / rows["off"]["step_s"],
    }
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "mode"}
    result = {"settings": settings, "off": rows["off"], "on": rows["on"], "on_over_off": ratios}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    mib = 1024**2
    print(
        f"| checkpointing | saved bytes (MiB) | peak step memory (MiB, {rows['off']['peak_kind']}) | step s |"
    )
    print("|---|---:|---:|---:|")
    for mode in ("off", "on"):
        row = rows[mode]
        print(
            f"| {mode} | {row['saved_bytes'] / mib:.1f} | {row['peak_step_bytes'] / mib:.1f} | {row['step_s']:.3f} |"
        )
    print(
        f"| on / off | {ratios['saved_bytes']:.3f} | {ratios['peak_step_bytes']:.3f} | {ratios['step_s']:.3f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
