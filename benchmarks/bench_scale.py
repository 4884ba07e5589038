"""Peak resident memory per rank of a whole `puzzle run` (every stage, FSDP) at 1, 2 and 4 gloo ranks,
next to what `puzzle plan` predicts.

Run: `PYTHONPATH=. python benchmarks/bench_scale.py [--hidden 1024 --blocks 20 --vocab 32768] [--ranks 1 2 4]`.
Writes benchmarks/results/bench_scale.json and prints a table (stage x ranks: measured, predicted, ratio).

The parent is NemotronH-shaped (Nemotron-3's `MEM*E` rhythm: Mamba-2, MoE, attention; random fp32
weights, only memory matters), built and saved here with `puzzle.nemotron_h.save_pretrained`; the data is
random tokens. One config runs every stage with `shard: fsdp` for BLD, scoring and GKD (and importance,
sharded by default) and tiny step and token counts. Each world size is
`python -m torch.distributed.run --standalone --nproc-per-node N -m puzzle run CONFIG` on the CPU (gloo,
one torch thread per rank) in a fresh run directory.

What is measured: `RunContext.stage` logs, to RUN_DIR/logs/rank{r}.log, `NAME: peak resident memory X MiB` when a
record finishes or is reused, and `baseline: peak resident memory X MiB` before the parent loads (after the
imports and the process group). The figure is `ru_maxrss`, a running maximum over the process's life: a
stage's figure is the peak of that stage *and every one before it*, so the stage that sets a rank's peak is
the first whose figure reaches the final value. Memory-mapped weights that are touched count (on a GPU they
would be device memory). Each process's torch import (~0.4-0.6 GB on a CPU) does not shard, so the peaks
are reported raw and above the baseline; the goals and the plan are compared on the figure above baseline.

The prediction is `puzzle.plan.plan_config(config, N)`: each stage's peak per rank; since the measured
figure is cumulative it is compared with the running maximum of the predicted peaks up to that stage.
Goals: peak per rank at 2 ranks <= 0.6x, at 4 ranks <= 0.35x the peak at 1 rank;
the plan's peak per rank within 25% of the measured one at each world size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "bench_scale.json"
ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
PEAK_LINE = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+: (?P<name>\S+): peak resident memory "
    r"(?P<mib>[0-9.]+) MiB"
)
EVENT_LINE = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+: (?:round \d+: )?(?P<name>\S+): "
    r"(?P<event>running|done|reused)"
)
PLAN_STAGES = ("importance", "library", "scores", "solutions", "assemble", "distill", "export")
STAGE_ORDER = ("importance", "library", "scores", "solutions", "frontier", "assemble", "distill", "export")
GOALS = {2: 0.6, 4: 0.35}
PLAN_TOLERANCE = 0.25


# -- the parent, the data, the config ------------------------------------------------------------------


def parent_spec(hidden: int, blocks: int, vocab: int, experts: int) -> Any:
    """A NemotronH-shaped spec: `blocks` blocks of the `MEM*E` rhythm, hidden `hidden`, vocabulary `vocab`."""
    from puzzle.presets.nemotron import DT_MIN, from_pattern
    from puzzle.spec import AttentionSpec, MambaSpec, MoESpec

    H = hidden
    mamba = MambaSpec(
        num_heads=8,
        head_dim=H // 8,
        state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=32,
        dt_clamp_min=DT_MIN,
    )
    attention = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=H // 8)
    moe = MoESpec(num_experts=experts, top_k=2, expert_width=H, shared_width=H, latent_size=H // 2)
    pattern = ("MEM*E" * blocks)[:blocks]
    return from_pattern(pattern, H, {"M": mamba, "*": attention, "E": moe}, vocab_size=vocab)


def make_parent(spec: Any, path: Path) -> int:
    """Save a random fp32 parent of `spec` at `path` (kept when already there); returns its bytes."""
    import torch

    from puzzle import nemotron_h
    from puzzle.model import HybridLM

    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        model = HybridLM(spec).float()
        nemotron_h.save_pretrained(model, path, overwrite=True)
        del model
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def make_data(path: Path, vocab: int, tokens: int) -> None:
    """Random tokens (memory, not quality, is measured) as one safetensors file."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    save_file(
        {"input_ids": torch.randint(0, vocab, (tokens,), generator=generator)},
        str(path / "tokens.safetensors"),
    )


def config_dict(root: Path, run_dir: Path, seq: int, batch: int, steps: int) -> dict[str, Any]:
    """Every stage, FSDP where a stage has the setting, `steps` optimiser steps of `batch` x `seq` tokens."""
    step_tokens = batch * seq
    return {
        "run_dir": str(run_dir),
        "seed": 0,
        "parent": {"path": str(root / "parent"), "dtype": "float32"},
        "data": {
            "sources": [str(root / "data")],
            "seq_len": seq,
            "held_out_fraction": 0.2,
            "batch_size": batch,
            "eval_batch_size": batch,
            "held_out_tokens": step_tokens,
        },
        "space": {
            "kinds": {
                "attention": {"noop": True},
                "mamba": {"state_size": [8]},
                "moe": {"top_k": [1], "noop": True},
            }
        },
        "importance": {"tokens": step_tokens, "batch_size": batch},
        "bld": {
            "lr": 1e-4,
            "token_budget": steps * step_tokens,
            "checkpoint_every": 0,
            "dtype": "float32",
            "shard": "fsdp",
        },
        "scoring": {"vocab_chunk": 4096, "shard": "fsdp"},
        "search": {"budgets": ["active_params<=0.95x"]},
        "gkd": {
            "lr": 1e-5,
            "token_budget": steps * step_tokens,
            "batch_size": batch,
            "eval_every": 0,
            "checkpoint_every": 0,
            "vocab_chunk": 4096,
            "dtype": "float32",
            "shard": "fsdp",
        },
        "hardware": {
            "profile": "h100",
            "scenarios": {"chat": {"batch_size": 1, "prompt_tokens": seq, "generated_tokens": seq}},
        },
    }


# -- reading the logs ----------------------------------------------------------------------------------


def _seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def parse_log(text: str) -> dict[str, Any]:
    """One rank's log: {"baseline_mib", "records": {NAME: {"peak_mib", "seconds"}}}, records in log order.

    `seconds`: from the record's `running` line to its `done` line (0 for a reused record). A record logged
    twice (a stage and a later round) keeps its last figures."""
    baseline = None
    records: dict[str, dict[str, Any]] = {}
    started: dict[str, float] = {}
    for line in text.splitlines():
        if event := EVENT_LINE.match(line):
            name, when = event["name"], _seconds(event["time"])
            if event["event"] == "running":
                started[name] = when
            else:
                records.setdefault(name, {})["seconds"] = when - started.pop(name, when)
        elif peak := PEAK_LINE.match(line):
            if peak["name"] == "baseline":
                baseline = float(peak["mib"]) if baseline is None else baseline
            else:
                records.setdefault(peak["name"], {})["peak_mib"] = float(peak["mib"])
    records = {name: r for name, r in records.items() if "peak_mib" in r}
    return {"baseline_mib": baseline, "records": records}


def stage_peaks(rank: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per top-level stage (in the order they run): the cumulative peak (MiB, raw and above the baseline) and the
    wall time of one rank; a stage's records STAGE/NAME count towards STAGE."""
    out: dict[str, dict[str, float]] = {}
    base = rank["baseline_mib"] or 0.0
    for name, r in rank["records"].items():
        stage = name.split("/", 1)[0]
        entry = out.setdefault(stage, {"peak_mib": 0.0, "seconds": 0.0})
        entry["peak_mib"] = max(entry["peak_mib"], r["peak_mib"])
        if "/" not in name or stage not in rank["records"]:  # a nested record's time is in its stage's
            entry["seconds"] += r.get("seconds", 0.0)
    for entry in out.values():
        entry["above_baseline_mib"] = entry["peak_mib"] - base
    order = [s for s in STAGE_ORDER if s in out] + [s for s in out if s not in STAGE_ORDER]
    return {s: out[s] for s in order}


def setter(stages: dict[str, dict[str, float]]) -> str | None:
    """The stage that sets the peak: the first whose cumulative figure reaches the final one."""
    final = max((e["peak_mib"] for e in stages.values()), default=None)
    return next((s for s, e in stages.items() if e["peak_mib"] >= final), None)


# -- the comparison ------------------------------------------------------------------------------------


def predicted(config_path: Path, world: int) -> dict[str, float]:
    """`puzzle plan CONFIG --gpus world`: each stage's predicted peak per rank, in MiB, with the host copies
    (`StagePlan.resident`: on these CPU ranks host memory is the device memory)."""
    from puzzle.config import load_config
    from puzzle.plan import plan_config

    plan = plan_config(load_config(config_path), world)
    return {stage.name: stage.resident / MIB for stage in plan.stages}  # CPU ranks: host memory counts


def compare(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per world size: the stages of the highest rank, the plan next to them (its running maximum, as the
    measured figure is cumulative) and the ratios; then the goals."""
    rows, summary = [], {}
    for world, run in sorted(runs.items()):
        worst = max(run["ranks"], key=lambda r: max(e["peak_mib"] for e in r["stages"].values()))
        plan, running = run["predicted_mib"], 0.0
        for stage, entry in worst["stages"].items():
            running = max(running, plan.get(stage, 0.0))
            above = entry["above_baseline_mib"]
            rows.append(
                {
                    "world": world,
                    "stage": stage,
                    "measured_mib": entry["peak_mib"],
                    "above_baseline_mib": above,
                    "predicted_stage_mib": plan.get(stage),
                    "predicted_mib": running,
                    "ratio": running / above if above > 0 else None,
                    "seconds": entry["seconds"],
                }
            )
        peak = max(e["peak_mib"] for e in worst["stages"].values())
        above = peak - (worst["baseline_mib"] or 0.0)
        plan_peak = max(plan.values())
        summary[world] = {
            "peak_mib": peak,
            "baseline_mib": worst["baseline_mib"],
            "above_baseline_mib": above,
            "set_by": setter(worst["stages"]),
            "predicted_mib": plan_peak,
            "predicted_over_measured": plan_peak / above if above > 0 else None,
            "plan_within_25pct": above > 0 and abs(plan_peak / above - 1) <= PLAN_TOLERANCE,
            "seconds": run["seconds"],
        }
    one = summary.get(1)
    for world, s in summary.items():
        if one is not None and world in GOALS:
            s["ratio_to_1"] = s["peak_mib"] / one["peak_mib"]
            s["ratio_to_1_above_baseline"] = s["above_baseline_mib"] / one["above_baseline_mib"]
            s["goal"] = GOALS[world]
            s["goal_met"] = s["ratio_to_1_above_baseline"] <= GOALS[world]
    return {"rows": rows, "summary": summary}


def table(comparison: dict[str, Any]) -> str:
    """Markdown: stage x world size, measured raw and above baseline, predicted, predicted / measured."""
    lines = [
        "| ranks | stage | measured MiB (cumulative) | above baseline | plan: stage peak | plan: running max | plan / measured | s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in comparison["rows"]:
        stage_plan = "-" if r["predicted_stage_mib"] is None else f"{r['predicted_stage_mib']:.0f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"| {r['world']} | {r['stage']} | {r['measured_mib']:.0f} | {r['above_baseline_mib']:.0f} | {stage_plan}"
            f" | {r['predicted_mib']:.0f} | {ratio} | {r['seconds']:.1f} |"
        )
    lines += [
        "",
        "| ranks | peak MiB | baseline | above baseline | set by | plan | plan / measured | vs 1 rank (above baseline) | goal |",
    ]
    lines.append("|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for world, s in comparison["summary"].items():
        versus = f"{s['ratio_to_1']:.2f} ({s['ratio_to_1_above_baseline']:.2f})" if "ratio_to_1" in s else "-"
        goal = f"<= {s['goal']} {'met' if s['goal_met'] else 'NOT met'}" if "goal" in s else "-"
        ratio = "-" if s["predicted_over_measured"] is None else f"{s['predicted_over_measured']:.2f}"
        lines.append(
            f"| {world} | {s['peak_mib']:.0f} | {s['baseline_mib'] or 0:.0f} | {s['above_baseline_mib']:.0f} |"
            f" {s['set_by']} | {s['predicted_mib']:.0f} | {ratio} | {versus} | {goal} |"
        )
    return "\n".join(lines)


# -- running -------------------------------------------------------------------------------------------


def run_world(config: Path, run_dir: Path, world: int, timeout: float) -> dict[str, Any]:
    """`torchrun --nproc-per-node world -m puzzle run CONFIG` (gloo); each rank's parsed log and the wall time."""
    env = {
        **os.environ,
        "PUZZLE_PROGRESS": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, "-m", "puzzle", "run", str(config), "--quiet"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{world} ranks: puzzle run exited {done.returncode}:\n{done.stderr[-3000:]}")
    ranks = []
    for r in range(world):
        parsed = parse_log((run_dir / "logs" / f"rank{r}.log").read_text())
        ranks.append({"rank": r, "baseline_mib": parsed["baseline_mib"], "stages": stage_peaks(parsed)})
    return {"seconds": seconds, "ranks": ranks}


def replan(output: Path, work: Path) -> int:
    """Re-predict the runs recorded in `output` with today's `puzzle plan` (same settings, configs rewritten
    under `work`, where the parent must still be) and rewrite its comparison; the measurements are kept."""
    import yaml

    result = json.loads(output.read_text())
    settings = result["settings"]
    tag = f"h{settings['hidden']}-b{settings['blocks']}-v{settings['vocab']}-e{settings['experts']}"
    root = work / tag
    runs = {int(w): r for w, r in result["runs"].items()}
    for world, run in runs.items():
        config = root / f"config-{world}.yaml"
        data = config_dict(root, root / f"run-{world}", settings["seq"], settings["batch"], settings["steps"])
        config.write_text(yaml.safe_dump(data, sort_keys=False))
        run["predicted_mib"] = predicted(config, world)
    comparison = compare(runs)
    print(table(comparison))
    result.update(comparison, summary={str(w): s for w, s in comparison["summary"].items()})
    result["runs"] = {str(w): r for w, r in runs.items()}
    output.write_text(json.dumps(result, indent=1))
    print(f"rewrote {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument(
        "--batch", type=int, default=4, help="sequences per step (a multiple of every rank count)"
    )
    parser.add_argument("--steps", type=int, default=2, help="BLD and GKD optimiser steps")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/bench_scale"), help="parent, data and run dirs"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per world size")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--replan",
        action="store_true",
        help="measure nothing: compare the runs already in --output with what `puzzle plan` predicts now",
    )
    args = parser.parse_args(argv)
    if args.replan:
        return replan(args.output, args.work)

    import yaml

    spec = parent_spec(args.hidden, args.blocks, args.vocab, args.experts)
    tag = f"h{args.hidden}-b{args.blocks}-v{args.vocab}-e{args.experts}"
    root = args.work / tag
    parent_bytes = make_parent(spec, root / "parent")
    make_data(root / "data", args.vocab, args.seq * args.batch * 64)
    print(f"parent {root / 'parent'}: {parent_bytes / MIB:.0f} MiB fp32", flush=True)
    runs = {}
    for world in args.ranks:
        run_dir = root / f"run-{world}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)  # a fresh run: nothing reused
        config = root / f"config-{world}.yaml"
        config.write_text(
            yaml.safe_dump(config_dict(root, run_dir, args.seq, args.batch, args.steps), sort_keys=False)
        )
        print(f"{world} rank(s): running", flush=True)
        runs[world] = run_world(config, run_dir, world, args.timeout)
        runs[world]["predicted_mib"] = predicted(config, world)
        print(f"{world} rank(s): {runs[world]['seconds']:.0f} s", flush=True)
    comparison = compare(runs)
    print(table(comparison))
    result = {
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("work", "output")},
            "parent_mib": parent_bytes / MIB,
        },
        "command": " ".join(
            ["python", "benchmarks/bench_scale.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": os.cpu_count(),
        "runs": {str(w): r for w, r in runs.items()},
        **comparison,
        "summary": {str(w): s for w, s in comparison["summary"].items()},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
