"""The `puzzle` command: one sub-command per stage, each registered by its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines `register(subparsers)`, which adds its sub-command and sets `func(args) -> int`.
COMMAND_MODULES: tuple[str, ...] = ("puzzle.commands.search", "puzzle.commands.costs")


def build_parser() -> argparse.ArgumentParser:
    """The `puzzle` parser with every sub-command of COMMAND_MODULES registered."""
    parser = argparse.ArgumentParser(
        prog="puzzle",
        description="Compress hybrid Mamba / attention / MoE language models (the Puzzle method).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `puzzle` command on `argv` (default: sys.argv[1:]); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 1
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
