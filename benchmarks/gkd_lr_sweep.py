"""A small GKD learning-rate sweep on a finished demo run: each child of the run distilled
again at each learning rate, everything else as the demo configures it; the held-out KL at every evaluation,
the best one and the step `keep_best` keeps.

Run: `puzzle demo --quick --out DIR` first, then
`PYTHONPATH=. python benchmarks/gkd_lr_sweep.py DIR [--lr 1e-4 5e-4 2e-3] [--seed 0]`.
Writes DIR/gkd-sweep/sweep-seed{SEED}.json (one GKD output per child and learning rate under DIR/gkd-sweep/) and prints
a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from puzzle.config.run import load_config
from puzzle.gkd import distill
from puzzle.run import Run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a finished `puzzle demo` output (its config.yaml)")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-4, 5e-4, 2e-3])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    run = Run(args.run_dir, load_config(args.run_dir / "config.yaml"))
    names = sorted(run.record("solutions"))
    rows = []
    for name in names:
        for lr in args.lr:
            settings = dataclasses.replace(run.config.gkd, lr=lr, seed=args.seed)
            started = time.perf_counter()
            result = distill(
                run.child(name),
                run.parent(settings.shard),
                run.data.train,
                run.held_out_batches(),
                settings,
                args.run_dir / "gkd-sweep" / f"{name}-lr{lr:g}-seed{args.seed}",
            )
            rows.append(
                {
                    "child": name,
                    "lr": lr,
                    "seed": args.seed,
                    "steps": result.steps,
                    "eval_kl": {e["step"]: e["kl"] for e in result.history["eval"]},
                    "kept_step": result.kept_step,
                    "kept_kl": result.kept_eval["kl"],
                    "before_kl": result.first_eval["kl"],
                    "last_kl": result.last_eval["kl"],
                    "seconds": time.perf_counter() - started,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    out = args.run_dir / "gkd-sweep" / f"sweep-seed{args.seed}.json"
    out.write_text(json.dumps({"lrs": args.lr, "seed": args.seed, "rows": rows}, indent=2) + "\n")
    print("| child | lr | KL before | KL at each evaluation | kept step | kept KL |")
    print("|---|---:|---:|---|---:|---:|")
    for row in rows:
        evals = ", ".join(f"{step}: {kl:.5f}" for step, kl in row["eval_kl"].items())
        print(
            f"| {row['child']} | {row['lr']:g} | {row['before_kl']:.5f} | {evals} | {row['kept_step']} | "
            f"{row['kept_kl']:.5f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
