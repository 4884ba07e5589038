"""`puzzle run CONFIG`: every stage of a Puzzle run, resumable (also under torchrun: see puzzle/run.py)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from puzzle.layout import STAGES

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def register(subparsers: Any) -> None:
    """Add `puzzle run` to the `puzzle` parser."""
    parser = subparsers.add_parser(
        "run",
        help="run every stage of a run config (resumable)",
        description="Run the pipeline of CONFIG: importance, library (BLD), scores, solutions (search), "
        "assemble, distill (GKD), export, and further rounds (rounds.count). A finished stage of the same "
        "inputs is reused; a killed one resumes. Under `torchrun --nproc-per-node N -m puzzle run CONFIG` "
        "the distributed stages shard their work. Logs go to RUN_DIR/logs/rank{r}.log. Exit code 2 for a "
        "config error (nothing is written), a budget no architecture meets or a stage that does not fit the "
        "hardware's memory per rank (as `puzzle plan` reports it), 1 for a failure.",
    )
    parser.add_argument("config", metavar="CONFIG", help="the run config, a YAML file")
    parser.add_argument("--quiet", action="store_true", help="no progress bars, only warnings on stderr")
    parser.add_argument(
        "--until", choices=STAGES, default=None, help="stop after this stage (of the first round)"
    )
    parser.add_argument(
        "--no-plan-check",
        action="store_true",
        help="run even when `puzzle plan` estimates that a stage does not fit the GPU memory per rank",
    )
    parser.set_defaults(func=run)


@contextlib.contextmanager
def logging_to(
    log_dir: Path, rank: int, quiet: bool, command: str = "puzzle run"
) -> Iterator[logging.Handler]:
    """While open: the `puzzle` loggers at INFO to RUN_DIR/logs/rank{r}.log, and rank 0's INFO (WARNING when
    quiet) to stderr; the logger's earlier handlers, level and propagation come back afterwards."""
    log_dir.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("puzzle")
    saved = logger.level, logger.propagate
    handler = logging.FileHandler(log_dir / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    added: list[logging.Handler] = [handler]
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING if quiet else logging.INFO)
        console.setFormatter(logging.Formatter(f"{command}: %(message)s"))
        added.append(console)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the console line above, not the root logger's as well
    for each in added:
        logger.addHandler(each)
    try:
        yield handler
    finally:
        for each in added:
            logger.removeHandler(each)
            each.close()
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def log_traceback(handler: logging.Handler) -> None:
    """The current exception's traceback into the rank's log file only (stderr gets one line)."""
    logger = logging.getLogger("puzzle")
    handler.handle(logger.makeRecord("puzzle", logging.ERROR, __file__, 0, "failed", (), sys.exc_info()))


def run(args: argparse.Namespace) -> int:
    """`puzzle run`: config errors and infeasible budgets exit 2 before anything is written."""
    from puzzle.config import ConfigError, load_config

    try:
        config = load_config(args.config, check_paths=True)
    except ConfigError as error:
        print(f"puzzle run: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.quiet:
        os.environ["PUZZLE_PROGRESS"] = "0"  # puzzle.progress reads it for every bar

    # Late: torch and the stages.
    from puzzle import dist
    from puzzle.preflight import preflight
    from puzzle.run import RunError
    from puzzle.search.types import InfeasibleError

    # Before the logs, as `puzzle config check`: the run directory, the budgets, `puzzle plan`'s memory check.
    checked = preflight(config, plan_check=not args.no_plan_check)
    for line in checked.problems:
        print(f"puzzle run: {line}", file=sys.stderr)
    if checked.problems:
        return EXIT_BAD_INPUT
    pipeline = checked.run
    # The first model built on the meta device imports torch._dynamo (behind torch's reference normal_, which
    # nn.init runs there): about a second of CPU, once per process. Paid here, before any stage's clock, so
    # that a stage's measured time is its own work whichever stage happens to build a model first (the plan,
    # `puzzle.plan_time`, prices work, not imports).
    import torch._dynamo  # noqa: F401

    started = dist.init_from_env()
    try:
        with logging_to(pipeline.layout.logs, dist.rank(), args.quiet) as log_file:
            try:
                pipeline.all(args.until)
                dist.barrier()  # every rank done with its collectives before the group goes
            except ValueError:
                log_traceback(log_file)
                raise
    except InfeasibleError as error:
        print(f"puzzle run: infeasible: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RunError as error:  # a run directory of another parent
        print(f"puzzle run: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as error:  # DataError, ArtifactError, SpecError...: a failure of the run
        print(f"puzzle run: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if started:
            from puzzle import shard

            pipeline.release_parent()  # the sharded parent and the cached meshes hold the process group
            shard.forget_meshes()
            dist.shutdown()
    if dist.rank() == 0 and not args.quiet:
        print(f"puzzle run: finished: {config.run_dir}", file=sys.stderr)
    return 0
