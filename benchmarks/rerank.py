"""Measured re-ranking (`search.rerank`) on a small trained demo parent: does the MIP's best survive measuring?

A 10-block demo parent (`MEMEM*MEME`, hidden 32, trained 150 steps on the stdlib email corpus, cached) goes
through the pipeline up to the solutions stage with `search.rerank: K` over a sweep of active-parameter
budgets. For each budget the K candidates' predicted (summed replace-one-block) KL and their KL measured on
the held-out tokens are printed, with the candidate the stage chose. The choice is made on the same held-out
tokens it is judged on, so each candidate is measured again on the held-out split's later batches, which
the choice never saw: a winner that only won on noise loses its margin there. Figures also go to
benchmarks/results/rerank.json.

    python benchmarks/rerank.py                       # budgets 0.4x, 0.55x, 0.7x, K = 5 (about 2 minutes)
    python benchmarks/rerank.py --budgets 0.4x --k 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ablations  # noqa: E402  (a sibling script)

from puzzle.assemble import measured_kl  # noqa: E402
from puzzle.config import load_config_data  # noqa: E402
from puzzle.demo.corpus import stdlib_root  # noqa: E402
from puzzle.demo.parent import TrainSettings, demo_parent  # noqa: E402
from puzzle.demo.pipeline import demo_config  # noqa: E402
from puzzle.files import atomic_write_bytes  # noqa: E402
from puzzle.presets.demo import demo_spec  # noqa: E402
from puzzle.run import Run  # noqa: E402

PARENT_SETTINGS = TrainSettings(
    seq_len=64, batch_size=8, steps=150, lr=5e-3, warmup_steps=10, held_out_sequences=8
)


def fresh_batches(run: Run) -> list[torch.Tensor]:
    """The held-out split's batches after those the stage measured on (`Run.held_out_batches`)."""
    settings = run.config.data
    split = run.data.held_out
    used = len(run.held_out_batches())
    stream = split.batches(settings.eval_batch_size, run.config.seed, rank=0, world=1, epochs=1)
    return [
        batch for index, batch in zip(range(len(split) // settings.eval_batch_size), stream) if index >= used
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--budgets", nargs="+", default=["0.4x", "0.55x", "0.7x"], help="active_params bounds"
    )
    parser.add_argument("--k", type=int, default=5, help="candidates per budget (search.rerank)")
    parser.add_argument("--root", type=Path, default=Path("runs/rerank"), help="run directory and cache")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "rerank.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("PUZZLE_PROGRESS", "0")
    started = time.perf_counter()
    parent = demo_parent(
        args.root / "cache",
        progress=False,
        spec=demo_spec("MEMEM*MEME", 32, num_experts=4, top_k=2, num_heads=4),
        settings=PARENT_SETTINGS,
        corpus_root=stdlib_root() / "email",
    )
    size = dataclasses.replace(ablations.SMOKE, held_out_tokens=4096, importance_tokens=1024, bld_tokens=4096)
    data = demo_config(parent.path, parent.corpus.path, args.root / "run", size)
    data["search"] = {"sweep": "active_params<=" + ",".join(args.budgets), "rerank": args.k}
    run = Run(args.root / "run", load_config_data(data))
    outputs = run.record("solutions")
    fresh = fresh_batches(run)
    chosen_on = sum(batch.numel() for batch in run.held_out_batches())
    print(f"held-out tokens: {chosen_on} chosen on, {sum(batch.numel() for batch in fresh)} fresh")
    results: dict[str, Any] = {}
    for name, entry in outputs.items():
        reranked = entry["rerank"]
        print(f"{name}: chose candidate {reranked['chosen']} of {len(reranked['candidates'])}")
        for candidate in reranked["candidates"]:
            child = run.child_of(candidate)
            again = measured_kl(child, run.parent(), fresh, run.config.scoring.vocab_chunk)["kl"]
            candidate["measured_kl_fresh"] = again
            mark = "*" if candidate["candidate"] == reranked["chosen"] else " "
            print(
                f" {mark} {candidate['candidate']}: predicted {candidate['predicted_kl']:.4f}  measured "
                f"{candidate['measured_kl']:.4f}  fresh tokens {again:.4f}"
            )
        results[name] = reranked
    payload = {
        "budgets": args.budgets,
        "k": args.k,
        "seconds": time.perf_counter() - started,
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.output, (json.dumps(payload, indent=2) + "\n").encode())
    print(f"wrote {args.output} ({payload['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
