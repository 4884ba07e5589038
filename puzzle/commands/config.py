"""`puzzle config`: check a run config (`check CONFIG`) or print the reference of every key (`reference`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_CONFIG_ERROR = 2


def register(subparsers: Any) -> None:
    """Add `puzzle config check` and `puzzle config reference` to the `puzzle` parser."""
    parser = subparsers.add_parser(
        "config",
        help="check a run config, or print the reference of its keys",
        description="Run configs: `check CONFIG` validates one and prints it resolved (every default filled "
        "in, relative paths made absolute); `reference` prints the Markdown reference of every key.",
    )
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="validate a run config and print it resolved",
        description="Validate CONFIG (types, values, budgets, scenarios) and what it names on disk (the "
        "parent's config.json and safetensors headers, the tokenizer, the data, the space file, a writable "
        "run_dir outside the parent and the inputs (a data folder or file, the tokenizer); no weight is read), "
        "that every budget is met by some architecture of the space, priced by the run's cost model, and "
        "that every stage fits the memory per rank as `puzzle plan` estimates it: exactly the checks "
        "`puzzle run` makes before its first stage. Then print the resolved config. Exit code 2 with a "
        "one-line error naming the file, line and key on any config error, or what `puzzle run` would "
        "refuse; nothing is written.",
    )
    check.add_argument("config", metavar="CONFIG", help="the run config, a YAML file")
    check.add_argument(
        "--no-paths",
        action="store_true",
        help="check the file only, not the paths it names (for a config written on another machine)",
    )
    check.add_argument(
        "--no-plan-check",
        action="store_true",
        help="as `puzzle run --no-plan-check`: accept a stage that `puzzle plan` estimates does not fit",
    )
    check.add_argument(
        "--json", action="store_true", help="print the resolved config as JSON instead of YAML"
    )
    check.set_defaults(func=run_check)
    reference = actions.add_parser(
        "reference",
        help="print the Markdown reference of every config key (docs/CONFIG.md)",
        description="Print the reference of every section and key of a run config, as Markdown.",
    )
    reference.set_defaults(func=run_reference)


def run_check(args: argparse.Namespace) -> int:
    """`puzzle config check`: the resolved config on stdout, or one error line and exit code 2."""
    from puzzle.config import ConfigError, dump_config, load_config

    try:
        config = load_config(args.config, check_paths=not args.no_paths)
    except ConfigError as error:
        print(f"puzzle config check: error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if not args.no_paths:
        from puzzle.preflight import preflight  # late: torch and the stages

        problems = preflight(config, plan_check=not args.no_plan_check).problems
        for line in problems:
            print(f"puzzle config check: {line}", file=sys.stderr)
        if problems:
            return EXIT_CONFIG_ERROR
    if args.json:
        print(json.dumps(config.to_dict(), indent=2))
    else:
        print(dump_config(config), end="")
    if args.no_paths:
        what = "the file only, paths not checked"
    else:
        what = "paths and budgets checked" + ("" if args.no_plan_check else ", the plan fits")
    print(f"{args.config}: valid ({what})", file=sys.stderr)
    return 0


def run_reference(args: argparse.Namespace) -> int:
    """`puzzle config reference`: docs/CONFIG.md on stdout."""
    from puzzle.config import reference_markdown

    print(reference_markdown(), end="")
    return 0
