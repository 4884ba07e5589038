"""Replace-one-block scoring: `puzzle.score.score_variants` (suffix-only recomputation) vs one full forward per variant.

Run: `PYTHONPATH=. python benchmarks/bench_scoring.py [--blocks 12 24] [--hidden 256] [--repeats 2]`. Writes
benchmarks/results/bench_scoring.json and prints a markdown table. For each parent depth both run
interleaved in one process on the same tiny hybrid parent (the 8-block cycle `MEM*EM-E` repeated), the same
variants (4 per block: the parent's own, a smaller one of the same kind, a linear one, a no-op) and tokens.
The naive side is favoured: it keeps the parent's full log-probabilities per batch (computed once) and
computes only the KL and top-1 agreement from whole-vocab logits, where `score_variants` also computes the
loss change, top-5 and hidden-state NMSE, streams the vocabulary in chunks and writes its files. Figures of
merit: the ratios of medians and of minima of the times, and the ratio of peak memory above the loaded
parent and batches (each measured once in a fresh process: peak RSS on the CPU, with glibc returning large
frees to the system so that the baseline is not inflated; `max_memory_allocated` on CUDA). The CPU is shared
with other jobs, so wall times are noisy; on the CPU (one torch thread) the process CPU time of each run
is also recorded, which other jobs disturb much less.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from puzzle.blocks import build_block
from puzzle.model import HybridLM
from puzzle.score import ScoreSettings, score_variants
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, NoOpSpec, Variant

RESULTS = Path(__file__).parent / "results" / "bench_scoring.json"
RUNS = ("naive_full_forward", "score_variants")


def parent_spec(hidden: int, vocab: int, num_blocks: int = 8) -> ModelSpec:
    """The pattern `MEM*EM-E` repeated to `num_blocks` blocks, small widths."""
    mamba = MambaSpec(num_heads=hidden // 32, head_dim=64, state_size=32, n_groups=2, chunk_size=64)
    attention = AttentionSpec(num_heads=hidden // 64, num_kv_heads=2, head_dim=64)
    moe = MoESpec(num_experts=8, top_k=2, expert_width=hidden, shared_width=hidden)
    mlp = MLPSpec(width=4 * hidden)
    cycle = (mamba, moe, mamba, attention, moe, mamba, mlp, moe)
    blocks = tuple(cycle[i % len(cycle)] for i in range(num_blocks))
    return ModelSpec(vocab_size=vocab, hidden_size=hidden, blocks=blocks)


def variants_of(spec: ModelSpec) -> dict[Variant, torch.nn.Module]:
    """Four per block: a smaller one of the same kind, a linear replacement, a no-op, and the parent's own."""
    smaller = {
        MambaSpec: lambda b: MambaSpec(b.num_heads // 2, b.head_dim, b.state_size, b.n_groups, b.chunk_size),
        MoESpec: lambda b: MoESpec(b.num_experts, 1, b.expert_width, b.shared_width),
        AttentionSpec: lambda b: AttentionSpec(b.num_heads, 1, b.head_dim),
        MLPSpec: lambda b: MLPSpec(b.width // 2),
    }
    library: dict[Variant, torch.nn.Module | None] = {}
    for index, block in enumerate(spec.blocks):
        library[Variant(index, block)] = None
        for child in (smaller[type(block)](block), LinearSpec(), NoOpSpec()):
            library[Variant(index, child)] = build_block(child, spec.hidden_size).eval()
    return library


@torch.no_grad()
def naive(parent: HybridLM, library, batches) -> dict[Variant, float]:
    """Mean KL per variant: a full forward of the parent with the block swapped, whole-vocab log-softmax."""
    references = [F.log_softmax(parent(ids).logits[:, :-1], -1) for ids in batches]
    kls = {}
    for variant, mixer in library.items():
        index = variant.block_index
        saved_mixer, saved_norm = parent.layers[index].mixer, parent.layers[index].norm
        if mixer is not None:
            parent.replace_mixer(index, mixer)
        total, tokens = 0.0, 0
        for ids, logp in zip(batches, references):
            logq = F.log_softmax(parent(ids).logits[:, :-1], -1)
            total += float((logp.exp() * (logp - logq)).sum())
            tokens += logp.shape[0] * logp.shape[1]
            _ = (logq.argmax(-1) == logp.argmax(-1)).sum()
        parent.replace_mixer(index, saved_mixer, norm=saved_norm)
        kls[variant] = total / tokens
    return kls


class Setup:
    """One parent depth: the parent, its variants, the held-out batches and the two ways of scoring."""

    def __init__(self, args: argparse.Namespace, num_blocks: int) -> None:
        torch.manual_seed(0)
        self.device = torch.device(args.device)
        self.spec = parent_spec(args.hidden, args.vocab, num_blocks)
        self.parent = HybridLM(self.spec).to(self.device).eval()
        self.library = {v: m if m is None else m.to(self.device) for v, m in variants_of(self.spec).items()}
        generator = torch.Generator().manual_seed(1)
        self.batches = [
            torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(self.device)
            for _ in range(args.batches)
        ]
        self.settings = ScoreSettings(vocab_chunk=args.vocab_chunk)
        self.scratch = Path(tempfile.mkdtemp(prefix="bench_scoring_"))

    def run(self, name: str) -> dict[Variant, float]:
        if name == "naive_full_forward":
            return naive(self.parent, self.library, self.batches)
        shutil.rmtree(self.scratch / "run", ignore_errors=True)  # no reuse: every repeat scores everything
        scores = score_variants(
            self.parent, self.library, self.library, self.batches, self.scratch / "run", self.settings
        )
        return {variant: score.kl for variant, score in scores.variants.items()}

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_bytes(setup: Setup, name: str) -> int:
    """Peak memory of one run above what is held before it (the parent, variants and batches)."""
    gc.collect()
    if setup.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        setup.run(name)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS (VmHWM) to the current RSS
    before = _status_kib("VmRSS")
    setup.run(name)
    return (_status_kib("VmHWM") - before) * 1024


def memory_in_child(args: argparse.Namespace, argv: list[str], num_blocks: int, name: str) -> int:
    """`peak_bytes` of one run in a fresh process (so that neither run sees the other's freed memory)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # frees of 64 KiB and more go back to the system
    command = [sys.executable, __file__, *argv, "--memory-of", name, "--blocks", str(num_blocks)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"])


def bench(args: argparse.Namespace, argv: list[str], num_blocks: int) -> dict:
    setup = Setup(args, num_blocks)
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    cpu_times: dict[str, list[float]] = {name: [] for name in RUNS}
    results: dict[str, dict[Variant, float]] = {}
    for _ in range(args.repeats):
        for name in RUNS:
            start, cpu_start = time.perf_counter(), time.process_time()
            results[name] = setup.run(name)
            if setup.device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - cpu_start)
    worst = max(abs(results["score_variants"][v] - results["naive_full_forward"][v]) for v in setup.library)
    setup.close()
    peaks = {name: memory_in_child(args, argv, num_blocks, name) for name in RUNS}
    base, base_min = statistics.median(times[RUNS[0]]), min(times[RUNS[0]])
    rows = [
        {
            "run": name,
            "times_s": values,
            "median_s": statistics.median(values),
            "min_s": min(values),
            "ratio_to_naive": statistics.median(values) / base,
            "ratio_of_mins": min(values) / base_min,
            "cpu_times_s": cpu_times[name],
            "cpu_ratio_of_medians": statistics.median(cpu_times[name])
            / statistics.median(cpu_times[RUNS[0]]),
            "cpu_ratio_of_mins": min(cpu_times[name]) / min(cpu_times[RUNS[0]]),
            "peak_bytes": peaks[name],
            "peak_ratio_to_naive": peaks[name] / peaks[RUNS[0]],
        }
        for name, values in times.items()
    ]
    return {
        "blocks": num_blocks,
        "pattern": setup.spec.pattern,
        "variants": len(setup.library),
        "max_abs_kl_difference": worst,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--vocab-chunk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--memory-of", choices=RUNS, help=argparse.SUPPRESS)  # the child of memory_in_child
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_of:
        setup = Setup(args, args.blocks[0])
        setup.run(args.memory_of)  # warm-up: lazily built kernels and caches are not the run's memory
        print(json.dumps({"peak_bytes": peak_bytes(setup, args.memory_of)}))
        setup.close()
        return 0
    child = [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in ("hidden", "vocab", "batch", "seq", "batches", "vocab_chunk", "threads", "device")
    ]
    depths = [bench(args, child, n) for n in args.blocks]
    result = {
        "benchmark": "bench_scoring",
        "command": "PYTHONPATH=. python benchmarks/bench_scoring.py " + " ".join(argv),
        "hidden": args.hidden,
        "vocab": args.vocab,
        "vocab_chunk": args.vocab_chunk,
        "tokens": args.batch * args.seq * args.batches,
        "repeats": args.repeats,
        "threads": args.threads,
        "device": args.device,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "depths": depths,
        "note": "shared CPU (other jobs running): wall times are noisy; compare the ratios, CPU-time ones first",
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, args.output)
    print(f"H={args.hidden}, V={args.vocab}, chunk {args.vocab_chunk}, {result['tokens']} tokens\n")
    print(
        "| blocks | variants | run | median s | min s | ratio of medians | ratio of mins | CPU-time ratio "
        "(medians / mins) | peak MB | peak ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for depth in depths:
        for row in depth["rows"]:
            print(
                f"| {depth['blocks']} | {depth['variants']} | {row['run']} | {row['median_s']:.2f} | "
                f"{row['min_s']:.2f} | {row['ratio_to_naive']:.2f}x | {row['ratio_of_mins']:.2f}x | "
                f"{row['cpu_ratio_of_medians']:.2f}x / {row['cpu_ratio_of_mins']:.2f}x | "
                f"{row['peak_bytes'] / 2**20:.1f} | {row['peak_ratio_to_naive']:.2f}x |"
            )
        print(f"(blocks {depth['blocks']}: max |KL difference| {depth['max_abs_kl_difference']:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
