"""`puzzle eval TARGET --tasks T1,T2`: task accuracy of a checkpoint, an export or a run directory's models (lm-eval)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from puzzle.commands import positive_int

EXIT_BAD_INPUT = 2


def register(subparsers: Any) -> None:
    """Add `puzzle eval` to the `puzzle` parser."""
    parser = subparsers.add_parser(
        "eval",
        help="task accuracy of a checkpoint or export (lm-evaluation-harness)",
        description="Evaluate the checkpoint or export TARGET (config.json, safetensors and tokenizer files), or "
        "a run directory's parent and each of its exports/NAME/ (one row per model and metric), "
        "on lm-eval tasks: its registry's, the local puzzle_next_line (offline), or the task YAMLs under "
        "--include-path. Needs the eval extra: pip install 'puzzle-nas[eval]'.",
    )
    parser.add_argument(
        "target",
        metavar="TARGET",
        help="a checkpoint or export directory, or a run directory (its parent and every exported child)",
    )
    parser.add_argument(
        "--tasks", required=True, help="comma-separated task names, e.g. puzzle_next_line,hellaswag"
    )
    parser.add_argument(
        "--limit", type=positive_int, help="at most this many documents per task (default: all)"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=1, metavar="B", help="requests per forward (default 1)"
    )
    parser.add_argument(
        "--include-path", metavar="DIR", help="a folder of extra lm-eval task YAMLs (and their local data)"
    )
    parser.add_argument("--device", help="where to run the model, e.g. cuda or cpu (default: cpu)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print lm-eval's results (its 'results' part) as JSON; of a run directory, {model: results}",
    )
    parser.set_defaults(func=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    """`puzzle eval`: a table (or JSON) on stdout; one error line and exit code 2 for bad input."""
    from pathlib import Path

    from puzzle.data import DataError
    from puzzle.eval import (
        EvalError,
        check_tasks,
        evaluate,
        load_target,
        run_targets,
        summary,
        task_manager,
    )
    from puzzle.nemotron_h.config import CheckpointError

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        if not tasks:
            raise EvalError("--tasks names no task")
        if not Path(args.target).is_dir():
            raise EvalError(f"TARGET {args.target} is not a directory")
        # The task names first: indexing the tasks takes seconds, loading a large model minutes.
        manager = task_manager(args.include_path)
        check_tasks(tasks, manager)
        targets = run_targets(args.target)
        if targets is None:
            targets = {None: Path(args.target)}
        results: dict[str | None, dict[str, Any]] = {}
        for name, path in targets.items():  # one model in memory at a time
            model, tokenizer = load_target(path)
            results[name] = evaluate(
                model,
                tokenizer,
                tasks,
                limit=args.limit,
                batch_size=args.batch_size,
                include_path=args.include_path,
                device=args.device,
                manager=manager,
            )
            del model
    except (EvalError, DataError, CheckpointError) as error:
        print(f"puzzle eval: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        shown = {name: r.get("results", {}) for name, r in results.items()}
        print(json.dumps(shown.get(None, shown), indent=2, sort_keys=None in results, default=str))
        return 0
    run = None not in results
    print(
        ("{:<24} ".format("model") if run else "") + f"{'task':<24} {'metric':<10} {'value':>8} {'stderr':>8}"
    )
    for name, result in results.items():
        for row in summary(result):
            stderr = "" if row["stderr"] is None else f"{row['stderr']:.4f}"
            model_cell = f"{name:<24} " if run else ""
            print(f"{model_cell}{row['task']:<24} {row['metric']:<10} {row['value']:>8.4f} {stderr:>8}")
    return 0
