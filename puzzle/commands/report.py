"""`puzzle report RUN`: write the run's Markdown report and PNG plots (`puzzle.report.write_report`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

EXIT_BAD_INPUT = 2


def register(subparsers: Any) -> None:
    """Add `puzzle report` to the `puzzle` parser."""
    parser = subparsers.add_parser(
        "report",
        help="write a run directory's Markdown report with PNG plots",
        description="Write RUN/report/report.md (or DIR/report.md with --out) and its PNG plots: the Pareto "
        "frontier of predicted KL against each budget, the chosen architecture per block, the costs parent "
        "vs child, the library's BLD losses, GKD curves and measured vs predicted KL. Sections whose inputs "
        "the run lacks are skipped with a note; plots need matplotlib (pip install 'puzzle-nas[plot]').",
    )
    parser.add_argument("run", metavar="RUN", help="the run directory")
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="where to write the report (default RUN/report): a new or empty directory, or an earlier "
        "report's, which is replaced whole",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="DIR may hold other files: write the report's files beside them (files of the same names, "
        "report.md and the PNGs, are replaced; no other file is touched)",
    )
    parser.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    """`puzzle report`: the path of report.md on stdout, or one error line and exit code 2."""
    from puzzle.cost.limits import BudgetError
    from puzzle.layout import RunDirError
    from puzzle.report import write_report
    from puzzle.search.types import SearchError

    if not args.run or args.out == "":
        print(
            "puzzle report: error: RUN and --out must be directory names, found an empty one", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    try:
        path = write_report(args.run, args.out, overwrite=args.overwrite)
    except (RunDirError, SearchError, BudgetError) as error:
        print(f"puzzle report: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(path)
    return 0
