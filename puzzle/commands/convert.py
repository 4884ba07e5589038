"""`puzzle convert SRC DST`: rewrite a NemotronH checkpoint in another dtype, format or shard size."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from puzzle.commands import byte_size

EXIT_BAD_INPUT = 2
DTYPES = ("bfloat16", "float16", "float32")
FORMATS = ("auto", "nemotron_h", "nemotron_h_puzzle")


def register(subparsers: Any) -> None:
    """Add `puzzle convert` to the `puzzle` parser."""
    parser = subparsers.add_parser(
        "convert",
        help="rewrite a checkpoint in another dtype, format or shard size",
        description="Load the NemotronH checkpoint SRC (puzzle.load) and save it to DST (a new or empty "
        "directory, or an earlier checkpoint, replaced atomically; with --overwrite, a directory holding other "
        "files too): routed experts stored one by one as the hub does, shards of at most --max-shard-size, "
        "the tokenizer and generation files copied. DST may not lie inside SRC nor hold it.",
    )
    parser.add_argument("src", metavar="SRC", help="the checkpoint directory to read")
    parser.add_argument("dst", metavar="DST", help="the directory to write")
    parser.add_argument("--dtype", choices=DTYPES, help="the weights' dtype (default: SRC's)")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="nemotron_h (transformers' NemotronH), nemotron_h_puzzle (trust_remote_code, any child) or "
        "auto (nemotron_h when it can hold the model); default auto",
    )
    parser.add_argument(
        "--max-shard-size",
        type=byte_size,
        default="5GB",
        metavar="SIZE",
        help="largest weight file, e.g. 5GB, 500MB, 2GiB (default 5GB)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="DST may hold other files: write the checkpoint files beside them (files with checkpoint "
        "names are replaced, stale weights removed, nothing else touched); never allowed into SRC",
    )
    parser.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    """`puzzle convert`: DST's path on stdout, or one error line and exit code 2 for bad input."""
    from puzzle.files import path_problem
    from puzzle.nemotron_h.checkpoint import convert_checkpoint, foreign_entries, refusal_to_overwrite
    from puzzle.nemotron_h.config import CheckpointError

    if not args.src or not args.dst:
        print(
            "puzzle convert: error: SRC and DST must be directory names, found an empty one", file=sys.stderr
        )
        return EXIT_BAD_INPUT
    source, target = Path(args.src).resolve(), Path(args.dst).resolve()
    if target.is_relative_to(source) or source.is_relative_to(target):
        print(
            f"puzzle convert: error: refusing to write {args.dst}: it lies inside {args.src} or holds it; "
            "choose a directory outside the source checkpoint",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    problem = path_problem(target, "DST")  # a file, or a folder nothing can be created in: before loading
    if problem is not None:
        print(f"puzzle convert: error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    foreign = [] if args.overwrite else foreign_entries(target)
    if foreign:  # before loading SRC (minutes for a large parent), in the command line's terms
        print(
            f"puzzle convert: error: {refusal_to_overwrite(target, foreign)}; choose a new or empty DST, or "
            "add --overwrite to write the checkpoint files beside them",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    try:
        path = convert_checkpoint(  # streamed: one tensor in memory at a time
            source,
            target,
            dtype=args.dtype,
            max_shard_bytes=args.max_shard_size,
            overwrite=args.overwrite,
            model_type=args.format,
        )
    except CheckpointError as error:
        print(f"puzzle convert: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(path)
    return 0
