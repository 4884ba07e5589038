"""`puzzle demo [--quick] [--out DIR]`: compress the built-in demo parent end to end (see puzzle/demo/pipeline.py)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from puzzle.commands import non_negative_int

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def register(subparsers: Any) -> None:
    """Add `puzzle demo` to the `puzzle` parser."""
    parser = subparsers.add_parser(
        "demo",
        help="compress the built-in demo model end to end on this CPU",
        description="Train (or find in the per-user cache) a small NemotronH-shaped hybrid on the Python "
        "standard library's source, then run the whole pipeline on it for two budgets (85% and 70% of its "
        "active parameters), held to what vLLM and llama.cpp serve: importance, block library (BLD), scores, search, assembly, distillation (GKD) and "
        "export. Writes DIR/demo.md (parent vs children: size, held-out KL and loss, decode tokens/s measured "
        "here and predicted), DIR/report/ and DIR/exports/. On 2 CPU cores about 10 minutes, --quick 0.5 to 2.5 "
        "(more on a busy machine); the last line says how long it took. "
        "A second demo into the same DIR reuses every finished stage.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smaller parent, less data and fewer steps (same stages)"
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="the run directory: new, empty or an earlier demo's (default ./puzzle-demo, ./puzzle-demo-quick)",
    )
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of the parent's training and of every stage"
    )
    parser.add_argument(
        "--cache",
        metavar="DIR",
        default=None,
        help="where the trained parent and the corpus are cached (default $PUZZLE_CACHE or ~/.cache/puzzle)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check the arguments, say what would be done, and stop"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars, only the result")
    parser.set_defaults(func=demo)


def _check_directory(path: Path, option: str, *, run_dir: bool) -> str | None:
    """Why `path` cannot be written as `option`, or None. A run directory must be new, empty or a run."""
    from puzzle.files import path_problem  # the check `puzzle report` makes of its --out too

    problem = path_problem(path, option)
    if problem is None and run_dir:
        # The same rule as `puzzle run` (one place decides what a run may write into); torch-free.
        from puzzle.layout import RunDirError, RunLayout

        try:
            RunLayout(path).check_usable()
        except RunDirError as error:
            return f"{option}: {error}"
        from puzzle.report import report_dir_problem  # DIR/report: the demo's report goes there, at the end

        report = report_dir_problem(
            RunLayout(path).report.absolute(), remedy="move them elsewhere, or choose another --out"
        )
        return None if report is None else f"{option}: {report}"
    return problem


def demo(args: argparse.Namespace) -> int:
    """`puzzle demo`: bad arguments exit 2 before anything is written; a failing stage exits 1. The last line
    printed is the command's wall time, so that a user can compare it with README's figures."""
    started = time.perf_counter()
    from puzzle.demo.pipeline import default_out

    out = Path(args.out).expanduser() if args.out is not None else default_out(args.quick)
    if args.out is not None and not args.out.strip():
        print("puzzle demo: error: --out is empty: expected a directory", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.cache is not None and not args.cache.strip():
        print("puzzle demo: error: --cache is empty: expected a directory", file=sys.stderr)
        return EXIT_BAD_INPUT
    problems = [_check_directory(out, "--out", run_dir=True)]
    if args.cache is not None:
        problems.append(_check_directory(Path(args.cache).expanduser(), "--cache", run_dir=False))
    for problem in problems:
        if problem is not None:
            print(f"puzzle demo: error: {problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if args.dry_run:
        from puzzle.demo.parent import default_cache_dir

        cache = Path(args.cache).expanduser() if args.cache is not None else default_cache_dir()
        size = "--quick " if args.quick else ""
        print(f"puzzle demo {size}would write {out.resolve()} (parent and corpus cached under {cache})")
        return 0

    # Late: torch and the stages.
    from puzzle.commands.run import log_traceback, logging_to
    from puzzle.demo.pipeline import run_demo
    from puzzle.run import RunError

    out.mkdir(parents=True, exist_ok=True)
    with logging_to(out / "logs", 0, args.quiet, "puzzle demo") as log_file:
        try:
            result = run_demo(
                out,
                quick=args.quick,
                seed=args.seed,
                cache_dir=args.cache,
                progress=not args.quiet,
                log=None if args.quiet else lambda line: print(f"puzzle demo: {line}", file=sys.stderr),
            )
        except RunError as error:  # an earlier run of another parent (another --seed or size) in DIR
            print(f"puzzle demo: error: {error}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except ValueError as error:
            log_traceback(log_file)
            print(f"puzzle demo: error: {error}", file=sys.stderr)
            return EXIT_FAILED
    print(result.table.read_text())
    print(f"Written: {result.table}, {result.report}, exports in {result.out / 'exports'}")
    print(wall_time_line(time.perf_counter() - started))
    return 0


def wall_time_line(seconds: float) -> str:
    """The demo's last line: its wall time and the CPU cores it could use (the figure README quotes)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"puzzle demo: done in {seconds:.0f} s wall time on {cores} CPU core(s)"
