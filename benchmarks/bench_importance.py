"""Cost of importance collection relative to a plain parent forward over the same calibration tokens.

Run: `PYTHONPATH=. python benchmarks/bench_importance.py [--hidden 512] [--repeats 7]`. Writes
benchmarks/results/bench_importance.json and prints a markdown table. Three things run interleaved in
one process on the same tokens: the parent's forward under no_grad, `collect_importance` without the
least-squares sums (the scores of every pruning axis), and with them (adds X^T X and X^T Y per block,
needed only for linear replacements). Figures of merit: the ratios of medians and of minima (target
<= 1.3x for the scores; the minimum is the least disturbed by other jobs). The CPU is shared with other
jobs, so absolute times are noisy; ratios less so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from puzzle.model import HybridLM
from puzzle.prune.importance import collect_importance
from puzzle.spec import AttentionSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec

RESULTS = Path(__file__).parent / "results" / "bench_importance.json"


def parent_spec(hidden: int, vocab: int) -> ModelSpec:
    """A Nemotron-3-like stack scaled down: pattern `MEM*EM-E` with the real models' width ratios."""
    mamba = MambaSpec(num_heads=hidden // 32, head_dim=64, state_size=64, n_groups=4, chunk_size=128)
    attention = AttentionSpec(num_heads=hidden // 64, num_kv_heads=2, head_dim=64)
    moe = MoESpec(
        num_experts=16, top_k=4, expert_width=hidden // 2, shared_width=hidden, latent_size=hidden // 2
    )
    mlp = MLPSpec(width=4 * hidden)
    blocks = (mamba, moe, mamba, attention, moe, mamba, mlp, moe)
    return ModelSpec(vocab_size=vocab, hidden_size=hidden, blocks=blocks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batches", type=int, default=2, help="calibration batches per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fit-every", type=int, default=8, help="linear-fit sums over every k-th token")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    spec = parent_spec(args.hidden, args.vocab)
    model = HybridLM(spec).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator) for _ in range(args.batches)
    ]

    def forward() -> None:
        with torch.no_grad():
            for ids in batches:
                model(ids)

    runs = {
        "forward": forward,
        "importance": lambda: collect_importance(model, batches, linear_fit=False),
        "importance+linear_fit": lambda: collect_importance(
            model, batches, linear_fit=True, linear_fit_every=args.fit_every
        ),
    }
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)

    base, base_min = statistics.median(times["forward"]), min(times["forward"])
    rows = [
        {
            "run": name,
            "median_s": statistics.median(values),
            "min_s": min(values),
            "ratio_to_forward": statistics.median(values) / base,
            "ratio_of_mins": min(values) / base_min,
        }
        for name, values in times.items()
    ]
    tokens = args.batch * args.seq * args.batches
    result = {
        "benchmark": "bench_importance",
        "pattern": spec.pattern,
        "hidden": args.hidden,
        "tokens_per_run": tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "linear_fit_every": args.fit_every,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "target_ratio": 1.3,
        "rows": rows,
        "note": "shared CPU (other jobs running): absolute times are noisy; compare the ratios",
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, args.output)

    print(
        f"importance collection vs forward, pattern {spec.pattern}, H={args.hidden}, {tokens} tokens per run\n"
    )
    print("| run | median s | min s | ratio of medians | ratio of mins |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['run']} | {row['median_s']:.3f} | {row['min_s']:.3f} | "
            f"{row['ratio_to_forward']:.2f}x | {row['ratio_of_mins']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
