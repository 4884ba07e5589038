"""Compress NVIDIA-Nemotron-3-Nano-30B-A3B with the Python API: the whole pipeline, one call per rank.

On a node of 8 GPUs (every rank runs this file; `Run` shards the work and runs the search and export on
rank 0):

    torchrun --nproc-per-node 8 examples/compress_nemotron3_nano.py \
        --parent /models/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 --data /data/distillation-mix --out runs/nano

Settings come from examples/configs/nemotron3_nano.yaml (or `--config FILE`); `--budget` replaces its
budget list and `--set KEY=VALUE` overrides any key, the VALUE read as YAML: `--set gkd.token_budget=1e9`,
`--set 'bld={lr: 1e-3, token_budget: 640}'` (a mapping replaces the whole section). The result is
validated like `puzzle config check` (a bad key or value: one-line error, exit 2). A killed run resumes
where it stopped when started again with the same arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from puzzle import dist
from puzzle.config import ConfigError, load_config_data
from puzzle.config.loader import read_yaml
from puzzle.run import Run

CONFIG = Path(__file__).resolve().parent / "configs" / "nemotron3_nano.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parent", required=True, help="the parent checkpoint directory (Hugging Face)")
    parser.add_argument("--data", required=True, action="append", help="a data source (repeatable)")
    parser.add_argument("--out", required=True, help="the run directory (outputs, logs, checkpoints)")
    parser.add_argument("--config", default=str(CONFIG), help=f"the run config (default {CONFIG.name})")
    parser.add_argument("--budget", action="append", help="a budget, e.g. active_params<=0.7x (repeatable)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (YAML value)"
    )
    parser.add_argument("--until", help="stop after this stage (importance, library, scores, ...)")
    parser.add_argument("--quiet", action="store_true", help="print only the results")
    return parser.parse_args(argv)


def override(data: dict[str, Any], assignment: str) -> None:
    """Apply `KEY=VALUE` (KEY dotted, VALUE YAML) to the config mapping `data` in place."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE")
    *path, last = key.strip().split(".")
    node = data
    for part in path:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {assignment!r}: {part} is not a section")
    node[last] = yaml.safe_load(text)


def build_config(args: argparse.Namespace):
    """The RunConfig: the config file, then the paths and budgets of the command line, then `--set`."""
    data, _ = read_yaml(args.config)
    data["parent"]["path"] = str(Path(args.parent).absolute())
    data["data"]["sources"] = [str(Path(source).absolute()) for source in args.data]
    data["run_dir"] = str(Path(args.out).absolute())
    if args.budget:
        data["search"]["budgets"] = list(args.budget)
    for assignment in args.set:
        override(data, assignment)
    config = load_config_data(data, Path(args.config).parent, file=args.config)
    config.validate_paths()
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = build_config(args)
    except ConfigError as error:
        print(f"compress_nemotron3_nano: {error}", file=sys.stderr)
        return 2
    dist.init_from_env()  # a no-op without torchrun
    try:
        if dist.is_main() and not args.quiet:
            logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
            logging.getLogger("puzzle").setLevel(logging.INFO)
        run = Run(config.run_dir, config)
        rounds = run.all(args.until)
        if dist.is_main():
            last = rounds[-1]
            stages = last.manifest()["stages"]
            for name, entry in stages.get("solutions", {}).get("outputs", {}).items():
                solution = json.loads((last.layout.root / entry["file"]).read_text())
                print(f"solution {name} (budgets {', '.join(entry['budgets'])}):")
                for block, variant in solution["choices"].items():
                    print(f"  {block}: {variant}")
                print(f"  totals: {solution['totals']}")
            for name, entry in stages.get("export", {}).get("outputs", {}).items():
                print(f"export {name}: {last.layout.root / entry['path']}")
    finally:
        dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
