"""`puzzle plan`'s time per stage against the time `puzzle run` measures, on this CPU (the "this-machine" profile).

Run: `PYTHONPATH=.:benchmarks python benchmarks/plan_vs_measured.py [--parents demo scale] [--repeats 2]`.
Writes benchmarks/results/plan_vs_measured.json and prints, per parent and stage, the planned seconds, the
measured seconds of each repeat and planned / measured (the median's, and the repeats' spread).

Two parents, each run by `python -m puzzle run CONFIG` in a fresh run directory, one process at one torch
thread (steadier on a shared CPU, and the thread count the run's calibration is measured at):
- demo: the quick demo's config (`puzzle.demo.pipeline.demo_config` with `QUICK`, over the cached quick demo
  parent) without its lm-eval section, which `puzzle plan` does not plan;
- scale: a bench_scale parent (`bench_scale.parent_spec`: Nemotron-3's `MEM*E` rhythm, random weights and
  tokens) with bench_scale's config on one rank (`shard: none`) and the "this-machine" profile.

The plan is `puzzle.plan.plan_run` of the run's resolved config on one rank. Against the stage's CPU time
(run.json's `measured.cpu_seconds`, which other jobs on the CPU stretch far less than its wall time): the
median of its plans on this machine calibrated in CPU time (`calibrate_this_machine(time.process_time)`)
once before the run and twice after it. Against the wall time (`measured.seconds`): its plan on the run's
own calibration (RUN_DIR/hardware.json, wall clock), as `puzzle report` prices it. A stage's records
STAGE/NAME are summed where the stage has no record of its own. `--replan` plans recorded runs again with
the current code, on the calibrations recorded with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "plan_vs_measured.json"
STAGES = ("importance", "library", "scores", "solutions", "assemble", "distill", "export")
GOAL = 0.3  # planned within 30% of measured, either way: 1 / 1.3 <= planned / measured <= 1.3


def demo_config(root: Path, run_dir: Path) -> dict[str, Any]:
    """The quick demo's run config over the cached quick demo parent, without lm-eval."""
    from puzzle.demo.parent import demo_parent
    from puzzle.demo.pipeline import QUICK
    from puzzle.demo.pipeline import demo_config as config_of

    parent = demo_parent(quick=True, progress=False)
    data = config_of(parent.path, parent.corpus.path, run_dir, QUICK)
    data.pop("eval")
    return data


def scale_config(root: Path, run_dir: Path, hidden: int, blocks: int, vocab: int) -> dict[str, Any]:
    """bench_scale's parent and config on one rank, priced on this machine."""
    import bench_scale

    spec = bench_scale.parent_spec(hidden, blocks, vocab, experts=8)
    bench_scale.make_parent(spec, root / "parent")
    if not (root / "data").is_dir():
        bench_scale.make_data(root / "data", vocab, 200_000)
    data = bench_scale.config_dict(root, run_dir, seq=128, batch=4, steps=8)
    for stage in ("bld", "scoring", "gkd"):
        data[stage]["shard"] = "none"
    data["importance"]["shard"] = "none"
    data["hardware"]["profile"] = "this-machine"
    return data


def run_once(data: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """`puzzle run` of `data` in `run_dir` (fresh); each stage's measured and planned seconds."""
    import torch

    from puzzle.cost.hardware import calibrate_this_machine

    config_path = run_dir.parent / f"{run_dir.name}.yaml"
    config_path.write_text(yaml.safe_dump(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PUZZLE_PROGRESS": "0", "PYTHONPATH": str(ROOT)}
    # This machine calibrated in CPU time (this process, one thread) just before the run and twice after it:
    # the plan of one thread alone, which other jobs on the CPU do not stretch, against the run's CPU seconds.
    # A calibration spans seconds, the run minutes: the median of the three plans follows the load the run
    # saw rather than that of one moment.
    torch.set_num_threads(1)
    profiles = [calibrate_this_machine.__wrapped__(time.process_time)]
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "puzzle", "run", str(config_path), "--quiet"],
        check=True,
        env=env,
        cwd=ROOT,
    )
    wall = time.perf_counter() - started
    profiles += [calibrate_this_machine.__wrapped__(time.process_time) for _ in range(2)]
    return {"run_dir": str(run_dir), "wall_s": wall, **planned_against(run_dir, profiles)}


def planned_against(run_dir: Path, profiles: list[Any]) -> dict[str, Any]:
    """The finished run in `run_dir`: each stage's measured wall and CPU seconds, and its plan: the median
    over `profiles` (this machine calibrated in CPU time around the run), and on the run's own stored
    calibration."""
    from puzzle.config import load_config
    from puzzle.cost.hardware import profile_to_json, stored_calibration
    from puzzle.layout import RunLayout
    from puzzle.plan import plan_hardware, plan_run

    layout = RunLayout(run_dir)
    records = json.loads(layout.manifest.read_text())["stages"]
    measured: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for name, record in records.items():
        stage = name.split("/", 1)[0]
        if "measured" not in record or ("/" in name and stage in records):
            continue
        measured[stage] = measured.get(stage, 0.0) + record["measured"]["seconds"]
        cpu[stage] = cpu.get(stage, 0.0) + record["measured"]["cpu_seconds"]
    config = load_config(layout.resolved_config, check_paths=False)
    parent = layout.read_parent()
    _, stored = plan_hardware(stored_calibration(layout.calibration))
    on_wall = {s.name: s.seconds for s in plan_run(config, parent, 1, stored).stages}
    plans = [{s.name: s.seconds for s in plan_run(config, parent, 1, profile).stages} for profile in profiles]
    planned = {
        name: None if any(plan[name] is None for plan in plans) else statistics.median(p[name] for p in plans)
        for name in plans[0]
    }
    return {
        "measured_s": measured,
        "cpu_s": cpu,
        "planned_s": planned,
        "planned_on_stored_s": on_wall,
        "calibrations_cpu_time": [profile_to_json(profile) for profile in profiles],
        "calibration_stored": profile_to_json(stored),
    }


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per stage: each run's planned seconds (of its own calibration), measured wall and CPU seconds, the
    ratios planned / wall and planned / CPU, and whether every CPU ratio is within the goal."""
    rows = []
    for stage in STAGES:
        measured = [run for run in runs if run["measured_s"].get(stage)]
        if not measured:
            continue
        planned = [run["planned_s"].get(stage) for run in measured]
        wall = [run["measured_s"][stage] for run in measured]
        cpu = [run["cpu_s"][stage] for run in measured]
        known = all(p is not None for p in planned)
        on_stored = [run["planned_on_stored_s"].get(stage) for run in measured]
        wall_ratios = [p / m for p, m in zip(on_stored, wall)] if known else []
        cpu_ratios = [p / m for p, m in zip(planned, cpu)] if known else []
        rows.append(
            {
                "stage": stage,
                "planned_s": planned,
                "planned_on_stored_s": on_stored,
                "measured_s": wall,
                "cpu_s": cpu,
                "wall_ratios": wall_ratios,
                "cpu_ratios": cpu_ratios,
                "median_cpu_ratio": statistics.median(cpu_ratios) if cpu_ratios else None,
                "within_goal": bool(cpu_ratios) and all(max(r, 1 / r) <= 1 + GOAL for r in cpu_ratios),
            }
        )
    return rows


def table(name: str, rows: list[dict[str, Any]]) -> str:
    """A markdown table of `rows` (each repeat's figures joined by ' / ')."""

    def join(values: list[Any], form: str) -> str:
        return " / ".join(form.format(v) for v in values) if values else "-"

    lines = [
        f"{name}:",
        "",
        "| stage | planned s | CPU s | planned / CPU | within 30% | planned s (run's calibration) | wall s "
        "| planned / wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [
            row["stage"],
            join([p for p in row["planned_s"] if p is not None], "{:.2f}"),
            join(row["cpu_s"], "{:.2f}"),
            join(row["cpu_ratios"], "{:.2f}"),
            ("yes" if row["within_goal"] else "no") if row["cpu_ratios"] else "not planned",
            join([p for p in row["planned_on_stored_s"] if p is not None], "{:.2f}"),
            join(row["measured_s"], "{:.2f}"),
            join(row["wall_ratios"], "{:.2f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replan(output: Path, work: Path) -> int:
    """`--replan`: the recorded runs of `output` planned again by today's code, on the calibrations they
    were planned on; the tables printed and `output` rewritten."""
    from puzzle.cost.hardware import profile_from_json

    results = json.loads(output.read_text())
    for name, parent in results["parents"].items():
        runs = []
        for repeat, run in enumerate(parent["runs"]):
            stored = run.get("calibrations_cpu_time") or [run["calibration_cpu_time"]]  # older files: one
            profiles = [profile_from_json(data, f"{output}: {name}") for data in stored]
            run_dir = Path(run.get("run_dir", work / name / f"run{repeat}"))  # as main() names them
            runs.append({**run, "run_dir": str(run_dir), **planned_against(run_dir, profiles)})
        parent["runs"], parent["stages"] = runs, summarise(runs)
        print(table(name, parent["stages"]), flush=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parents", nargs="+", choices=("demo", "scale"), default=["demo", "scale"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/plan_vs_measured"))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--replan",
        action="store_true",
        help="run nothing: plan the runs recorded in --output again (their run directories and CPU-time "
        "calibrations) with the current code, and rewrite it",
    )
    args = parser.parse_args(argv)
    if args.replan:
        return replan(args.output, args.work)
    results: dict[str, Any] = {"load_average_start": os.getloadavg()[0], "parents": {}}
    for name in args.parents:
        root = args.work / name
        root.mkdir(parents=True, exist_ok=True)
        runs = []
        for repeat in range(args.repeats):
            run_dir = root / f"run{repeat}"
            if run_dir.exists():
                subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            if name == "demo":
                data = demo_config(root, run_dir)
            else:
                data = scale_config(root, run_dir, args.hidden, args.blocks, args.vocab)
            runs.append(run_once(data, run_dir))
        rows = summarise(runs)
        results["parents"][name] = {"runs": runs, "stages": rows}
        print(table(name, rows), flush=True)
    results["load_average_end"] = os.getloadavg()[0]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(
        f"load average {results['load_average_start']:.2f} at the start, {results['load_average_end']:.2f} at the end"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
