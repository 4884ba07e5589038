"""Task accuracy of a run's parent and children on the same items: lm-eval's stderr beside a paired comparison.

`python benchmarks/paired_eval.py RUN_DIR [--tasks T1,T2] [--limit N] [--out FILE.json]` evaluates the parent
and every exported child of RUN_DIR (`puzzle.eval.run_targets`, as `puzzle eval RUN_DIR` does) with
lm-eval's per-document outputs, and prints for each task's metric:

- each model's value +- lm-eval's stderr (unpaired: sqrt(p (1 - p) / N)) and its KL after GKD (run.json);
- for each pair of models (parent vs each child, child vs child) our paired comparison over the same
  documents: the mean per-item difference with its stderr (the standard deviation of the per-item
  differences / sqrt(N)) and McNemar's exact two-sided p-value on the items one model gets right and the
  other wrong.

The children are compressions of the parent, so most items are right or wrong for all of them alike; the
paired stderr counts only the items where they differ, which is why it is far below the unpaired one.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from itertools import combinations
from pathlib import Path
from typing import Any

from puzzle.eval import evaluate, load_target, run_targets, task_manager


def mcnemar_p(right_only_a: int, right_only_b: int) -> float:
    """McNemar's exact two-sided p-value: the discordant items' split under a fair coin (1.0 when none)."""
    n = right_only_a + right_only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(right_only_a, right_only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """The paired comparison of two models' per-item scores (same documents, same order): mean difference
    a - b, its stderr, the discordant counts and McNemar's p."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"paired scores need the same documents, at least 2: found {len(a)} and {len(b)}")
    differences = [x - y for x, y in zip(a, b)]
    return {
        "difference": statistics.fmean(differences),
        "stderr": statistics.stdev(differences) / math.sqrt(len(differences)),
        "a_only": sum(1 for x, y in zip(a, b) if x > y),
        "b_only": sum(1 for x, y in zip(a, b) if x < y),
        "p_mcnemar": mcnemar_p(sum(1 for x, y in zip(a, b) if x > y), sum(1 for x, y in zip(a, b) if x < y)),
    }


def per_item(results: dict[str, Any], task: str, metric: str) -> list[float]:
    """`metric`'s score of each document of `task`, in doc_id order, from lm-eval's logged samples."""
    samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
    return [float(sample[metric]) for sample in samples]


def kl_after_gkd(run_dir: Path) -> dict[str, float]:
    """{child: its held-out KL after GKD (the weights kept)} from run.json's distill record."""
    stages = json.loads((run_dir / "run.json").read_text())["stages"]
    outputs = stages.get("distill", {}).get("outputs", {})
    return {name: entry.get("kept_eval", entry["last_eval"])["kl"] for name, entry in outputs.items()}


def main(argv: list[str] | None = None) -> int:
    """Evaluate, print the table and pairs, write --out when given."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--tasks", default="puzzle_next_line,puzzle_identifiers")
    parser.add_argument("--metrics", default="puzzle_next_line:acc_norm,puzzle_identifiers:acc")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="JSON of the figures; reused on a rerun")
    parser.add_argument("--only", default=None, help="evaluate only these models (comma-separated)")
    args = parser.parse_args(argv)
    targets = run_targets(args.run_dir)
    if targets is None:
        print(f"{args.run_dir}: not a run directory", file=sys.stderr)
        return 2
    tasks = [t for t in args.tasks.split(",") if t]
    metrics = dict(pair.split(":") for pair in args.metrics.split(","))
    manager = task_manager()
    kl = kl_after_gkd(args.run_dir)
    scores: dict[str, dict[str, list[float]]] = {}
    summary: dict[str, Any] = {"limit": args.limit, "models": {}, "pairs": {}}
    # --out of an earlier call with the same tasks and limit: its models' per-item scores are reused
    earlier = json.loads(args.out.read_text()) if args.out is not None and args.out.is_file() else {}
    if (earlier.get("limit"), earlier.get("tasks")) != (args.limit, tasks):
        earlier = {}
    summary["tasks"] = tasks
    summary["scores"] = scores
    for name, path in targets.items():
        if name in earlier.get("scores", {}):
            scores[name] = earlier["scores"][name]
            summary["models"][name] = row = earlier["models"][name]
            print(f"{name}: reused from {args.out}: {row}", flush=True)
            continue
        if args.only is not None and name not in args.only.split(","):
            continue
        started = time.perf_counter()
        model, tokenizer = load_target(path)
        results = evaluate(
            model,
            tokenizer,
            tasks,
            limit=args.limit,
            batch_size=args.batch_size,
            manager=manager,
            log_samples=True,
        )
        seconds = time.perf_counter() - started
        scores[name] = {task: per_item(results, task, metrics[task]) for task in tasks}
        row = {"kl": kl.get(name, 0.0 if name == "parent" else None), "seconds": seconds}
        for task in tasks:
            metric = metrics[task]
            row[task] = {
                "metric": metric,
                "n": len(scores[name][task]),
                "value": results["results"][task][f"{metric},none"],
                "stderr": results["results"][task][f"{metric}_stderr,none"],
            }
        summary["models"][name] = row
        cells = "; ".join(
            f"{task} {row[task]['metric']} {row[task]['value']:.4f} +- {row[task]['stderr']:.4f}"
            for task in tasks
        )
        kl_text = "-" if row["kl"] is None else f"{row['kl']:.4f}"
        print(f"{name}: KL {kl_text}; {cells} (n={row[tasks[0]]['n']}; {seconds:.0f} s)", flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(summary, indent=2) + "\n")
    targets = {name: path for name, path in targets.items() if name in scores}
    for a, b in combinations(targets, 2):
        for task in tasks:
            comparison = paired(scores[a][task], scores[b][task])
            summary["pairs"][f"{a} - {b}: {task}"] = comparison
            print(
                f"{a} - {b}: {task} {metrics[task]} {comparison['difference']:+.4f} +- "
                f"{comparison['stderr']:.4f} paired (items right for {a} only {comparison['a_only']}, "
                f"{b} only {comparison['b_only']}; McNemar p {comparison['p_mcnemar']:.3g})"
            )
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
