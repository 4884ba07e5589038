"""`puzzle plan CONFIG [--gpus N | --nodes N --gpus-per-node G] [--hardware NAME] [--disk SIZE]`: what each
stage of a run will cost, before it runs (`--hardware NxNAME`: N ranks of NAME; `--nodes`: N x G ranks, a stage
with `shard: hsdp` sharded inside each node of G and replicated across nodes; `--disk`: refuse a run that does
not fit SIZE).

Reads the run config and the parent's config.json only (no weight, no data): see puzzle/plan.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from puzzle.commands import byte_size, fraction, positive_int

EXIT_DOES_NOT_FIT = 2


def register(subparsers: Any) -> None:
    """Add `puzzle plan` to the `puzzle` parser."""
    parser = subparsers.add_parser(
        "plan",
        help="estimate every stage's work, time, peak memory per rank and disk",
        description="For each stage of CONFIG's run (importance, library, scores, solutions, assemble, "
        "distill, export): the units of work and tokens, the estimated time on N GPUs of the named hardware "
        "(cost-model FLOPs at an assumed efficiency), the peak memory per rank under FSDP2 over N ranks, "
        "and the disk it writes. Reads the parent's config.json only. Exit code 2 naming the stage and the "
        "figure when a stage does not fit the hardware's memory x memory_fraction, or the run's disk does "
        "not fit --disk.",
    )
    parser.add_argument("config", metavar="CONFIG", help="the run config, a YAML file")
    parser.add_argument(
        "--gpus",
        type=positive_int,
        default=None,
        help="ranks (GPUs) the run uses (default: N of an NxNAME hardware, else 1)",
    )
    parser.add_argument(
        "--nodes",
        type=positive_int,
        default=None,
        help="nodes the run uses, with --gpus-per-node: N x G ranks, and a stage whose shard is hsdp is "
        "planned sharded over the G ranks of a node, replicated across the N nodes",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=positive_int,
        default=None,
        metavar="G",
        help="ranks (GPUs) per node, with --nodes (torchrun's --nproc-per-node)",
    )
    parser.add_argument(
        "--hardware",
        default=None,
        help="each rank's GPU (h100-80gb, h200-141gb, b200, a100-80gb; default: the config's "
        "hardware.profile); NxNAME (8xb200, as `puzzle costs` writes a server) is N ranks of NAME, as "
        "--gpus N --hardware NAME",
    )
    parser.add_argument(
        "--memory-fraction",
        type=fraction,
        default=None,
        help="usable share of each GPU's memory (default: the config's hardware.memory_fraction)",
    )
    parser.add_argument(
        "--efficiency",
        type=fraction,
        default=None,
        help="assumed share of the dense bf16 peak a step reaches (default 0.35)",
    )
    parser.add_argument(
        "--parent",
        metavar="DIR",
        default=None,
        help="read the parent's config.json from DIR instead of the config's parent.path (a folder holding "
        "only config.json will do: no weight is read)",
    )
    parser.add_argument(
        "--disk",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="the disk the run directory may fill, in bytes or with a unit (6TB, 5.5TiB, 800GiB): exit 2 "
        "naming the stage that writes the most when the run's disk is larger",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`puzzle plan`: the plan on stdout; exit 2 for a config error or a stage that does not fit."""
    from puzzle.config import ConfigError, load_config
    from puzzle.cost.hardware import split_gpus
    from puzzle.plan import DEFAULT_EFFICIENCY, plan_config, plan_hardware
    from puzzle.spec import SpecError

    try:
        config = load_config(args.config)
    except ConfigError as error:
        print(f"puzzle plan: error: {error}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    if args.parent is not None:
        config = dataclasses.replace(
            config, parent=dataclasses.replace(config.parent, path=Path(args.parent).absolute())
        )
    try:
        gpus = _gpus(args)
        gpus, hardware = plan_hardware(args.hardware or config.hardware.profile, gpus)
        if args.hardware is not None and args.gpus is not None:
            count, single = split_gpus(args.hardware)
            if count > 1 and count != gpus:
                raise SpecError(
                    f"--hardware {args.hardware} is {count} GPUs (ranks) of {single}, but --gpus says "
                    f"{gpus}: give --gpus N --hardware {single}"
                )
        plan = plan_config(
            config,
            gpus,
            hardware,
            memory_fraction=args.memory_fraction,
            efficiency=args.efficiency or DEFAULT_EFFICIENCY,
            gpus_per_node=args.gpus_per_node,
        )
    except (SpecError, KeyError) as error:  # an unknown --hardware
        print(f"puzzle plan: error: {error}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    except (ValueError, OSError) as error:  # the parent's config.json: missing or not a NemotronH config
        print(f"puzzle plan: error: parent.path: {error}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.render())
    misfits = plan.misfits()
    if args.disk is not None:
        misfits += plan.disk_misfits(args.disk, "given by --disk")
    if args.nodes is not None and not args.json and not misfits:  # no launch line for a run it refuses
        print(_launch_line(args.nodes, args.gpus_per_node, args.config))
    for line in misfits:
        print(f"puzzle plan: does not fit: {line}", file=sys.stderr)
    return EXIT_DOES_NOT_FIT if misfits else 0


def _launch_line(nodes: int, gpus_per_node: int, config: str) -> str:
    """The plan's last line: the torchrun command that starts the run it planned (`puzzle.launch`)."""
    from puzzle.launch import shell_join, torchrun_args

    where = (
        f"on each of the {nodes} nodes (HEAD_NODE: the first node's host name, JOB_ID: one id for the job)"
        if nodes > 1
        else "on the node"
    )
    return f"launch {where}: {shell_join(torchrun_args(nodes, gpus_per_node, config))}"


def _gpus(args: argparse.Namespace) -> int | None:
    """--gpus, or --nodes x --gpus-per-node (given together; --gpus, if also given, must agree)."""
    from puzzle.spec import SpecError

    if (args.nodes is None) != (args.gpus_per_node is None):
        raise SpecError("--nodes and --gpus-per-node go together: give both (N nodes of G GPUs) or neither")
    if args.nodes is None:
        return args.gpus
    ranks = args.nodes * args.gpus_per_node
    if args.gpus is not None and args.gpus != ranks:
        raise SpecError(
            f"--gpus {args.gpus} but --nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} is {ranks}: "
            "give one or the other"
        )
    return ranks
