"""The `puzzle` command: one sub-command per stage, each registered by its own module.

Exit codes: 0 success; 1 an error while running (including an unexpected one, reported in one line:
rerun with PUZZLE_DEBUG=1 for its traceback); 2 a usage error or bad input (argparse's convention,
also bare `puzzle`, which prints the help); 130 interrupted (Ctrl-C); 141 (128 + SIGPIPE, what a shell
reports for `yes | head`) when whoever reads the output stops early, as in `puzzle costs X | head -1`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from puzzle import __version__

# Each module defines `register(subparsers)`, which adds its sub-command and sets `func(args) -> int`.
COMMAND_MODULES: tuple[str, ...] = (
    "puzzle.commands.search",
    "puzzle.commands.costs",
    "puzzle.commands.config",
    "puzzle.commands.run",
    "puzzle.commands.plan",
    "puzzle.commands.report",
    "puzzle.commands.convert",
    "puzzle.commands.demo",
    "puzzle.commands.eval",
)

DEBUG_ENV = "PUZZLE_DEBUG"
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `puzzle` parser with every sub-command of COMMAND_MODULES registered, or only `command`'s.

    With `command` only the module whose name ends in it is imported (`puzzle search` does not pay for the
    cost model's imports); every module when none does or when it registers no such sub-command.
    """
    modules = [name for name in COMMAND_MODULES if name.rsplit(".", 1)[-1] == command] or COMMAND_MODULES
    parser = argparse.ArgumentParser(
        prog="puzzle",
        description="Compress hybrid Mamba / attention / MoE language models (the Puzzle method).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in modules:
        importlib.import_module(module_name).register(subparsers)
    if command is not None and command not in subparsers.choices and len(modules) < len(COMMAND_MODULES):
        return build_parser()
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `puzzle` command on `argv` (default: sys.argv[1:]); returns the exit code.

    argparse's own exits (--help, --version, usage errors) stay SystemExit, as argparse raises them.
    """
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(argv[0] if argv and not argv[0].startswith("-") else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        if _flush_stdout() == EXIT_BROKEN_PIPE:  # `puzzle --help | head -1`
            raise SystemExit(EXIT_BROKEN_PIPE) from None
        raise
    if not hasattr(args, "func"):  # bare `puzzle`: a usage error, with the whole help
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Call `args.func(args)` and flush its output, turning what escapes it into an exit code and one line.

    A closed pipe on stdout exits quietly (EXIT_BROKEN_PIPE); an OSError (disk full, an unwritable path)
    is the system's one-line message; any other exception is a bug or an unchecked input: one line naming it, and a hint to rerun
    with PUZZLE_DEBUG=1, which lets the exception (and its traceback) through.
    """
    name = f"puzzle {getattr(args, 'command', '')}".strip()
    try:
        code = int(args.func(args) or 0)
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        try:
            sys.stdout.flush()  # what the command printed before failing
        except OSError:  # the failure may be stdout itself (`> /dev/full`): don't fail again at exit
            _silence_stdout()
        if isinstance(error, OSError):  # the system's reason and the file it names: enough to act on
            from puzzle.files import describe_os_error

            print(f"{name}: error: {describe_os_error(error)}", file=sys.stderr)
        else:
            print(f"{name}: unexpected error: {type(error).__name__}: {error}", file=sys.stderr)
            print(f"{name}: rerun with {DEBUG_ENV}=1 to see the traceback", file=sys.stderr)
        return EXIT_ERROR
    return _flush_stdout() or code


def _flush_stdout() -> int | None:
    """Flush stdout now, where a failure can be reported, rather than at interpreter exit; None if it worked."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as error:  # e.g. `> /dev/full`
        _silence_stdout()
        print(f"puzzle: error: cannot write the output: {error}", file=sys.stderr)
        return EXIT_ERROR
    return None


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is still buffered succeeds.

    The recipe of Python's signal documentation ("Note on SIGPIPE"); a stdout without a file descriptor
    (a test's capture) is left alone.
    """
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
