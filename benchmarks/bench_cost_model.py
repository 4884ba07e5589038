"""Predicted (roofline, calibrated "this-machine" profile) vs measured latency of the block variants of a tiny hybrid.

Run: `python benchmarks/bench_cost_model.py [--hidden 512] [--rounds 3] [--repeats 15] [--threads 1]`. Writes
benchmarks/results/bench_cost_model.json and prints a markdown table. Both sides run in the same process
on the same (shared, noisy) CPU; the figure of merit is the relative error |predicted - measured| / measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from puzzle.cost.hardware import calibrate_this_machine
from puzzle.cost.measure import measure_block_latency
from puzzle.cost.roofline import Scenario, block_latency
from puzzle.presets import tiny_hybrid
from puzzle.spec import AttentionSpec, BlockSpec, LinearSpec, MambaSpec, MLPSpec, MoESpec

RESULTS = Path(__file__).parent / "results" / "bench_cost_model.json"


def variants(hidden_size: int) -> list[BlockSpec]:
    """The parent's blocks of `tiny_hybrid(hidden_size)` and the pruned variants a search space would offer."""
    parent = tiny_hybrid(hidden_size)
    mamba, attention, moe, _, mlp, _ = parent.blocks
    assert isinstance(mamba, MambaSpec) and isinstance(attention, AttentionSpec)
    assert isinstance(moe, MoESpec) and isinstance(mlp, MLPSpec)
    return [
        mamba,
        dataclasses.replace(mamba, state_size=mamba.state_size // 2),
        dataclasses.replace(mamba, num_heads=mamba.num_heads // 2),
        attention,
        dataclasses.replace(attention, num_kv_heads=1),
        dataclasses.replace(attention, num_heads=2, num_kv_heads=1),
        moe,
        dataclasses.replace(moe, top_k=1),
        dataclasses.replace(moe, expert_width=moe.expert_width // 2),
        dataclasses.replace(moe, num_experts=4, top_k=1),
        mlp,
        dataclasses.replace(mlp, width=mlp.width // 2),
        LinearSpec(),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--generated", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per measurement (median)")
    parser.add_argument("--rounds", type=int, default=3, help="calibrate + measure rounds (medians compared)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    load_before = os.getloadavg()
    scenario = Scenario(
        args.batch, args.prompt, args.generated, activation_dtype="fp32", compute_dtype="fp32", recipe="fp32"
    )
    specs = variants(args.hidden)
    # Other processes share this CPU and their load changes by the second: every measurement follows its
    # own fresh calibration (~0.2 s), and the medians over rounds are compared.
    predictions: dict[tuple[str, str], list[float]] = defaultdict(list)
    measurements: dict[tuple[str, str], list[float]] = defaultdict(list)
    profiles = []
    for _ in range(args.rounds):
        for spec in specs:
            hardware = calibrate_this_machine.__wrapped__()
            profiles.append(hardware)
            predicted = block_latency(spec, args.hidden, scenario, hardware)
            measured = measure_block_latency(spec, args.hidden, scenario, repeats=args.repeats)
            for phase in ("prefill_s", "decode_step_s"):
                predictions[spec.short_name(), phase].append(getattr(predicted, phase))
                measurements[spec.short_name(), phase].append(getattr(measured, phase))
    rows = []
    for (variant, phase), predicted in predictions.items():
        p, m = statistics.median(predicted), statistics.median(measurements[variant, phase])
        rows.append(
            {
                "variant": variant,
                "phase": phase.removesuffix("_s"),
                "predicted_ms": 1e3 * p,
                "measured_ms": 1e3 * m,
                "ratio": p / m,
                "relative_error": abs(p - m) / m,
            }
        )
    errors = [row["relative_error"] for row in rows]
    summary = {
        "median_relative_error": statistics.median(errors),
        "worst_relative_error": max(errors),
        "median_relative_error_prefill": statistics.median(
            r["relative_error"] for r in rows if r["phase"] == "prefill"
        ),
        "median_relative_error_decode": statistics.median(
            r["relative_error"] for r in rows if r["phase"] == "decode_step"
        ),
    }
    report = {
        "benchmark": "bench_cost_model",
        "note": (
            "CPU shared with other processes: timings are noisy (see load_average); each measurement is a "
            "median of repeats, each prediction uses a calibration taken just before it, and the figures "
            "are medians over rounds. Long calls (prefill) are hit harder by time-slicing than the short "
            "calibration kernels, so under load prefill is under-predicted."
        ),
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "settings": {**vars(args), "output": str(args.output), "torch_threads": torch.get_num_threads()},
        "scenario": dataclasses.asdict(scenario),
        "calibration_medians": {
            "matmul_flops_per_s": statistics.median(dict(p.peak_flops)["fp32"] for p in profiles),
            "few_rows_flops_per_s": statistics.median(p.few_rows_flops for p in profiles),
            "memory_bandwidth_bytes_per_s": statistics.median(p.memory_bandwidth for p in profiles),
            "op_overhead_s": statistics.median(p.op_overhead_s for p in profiles),
            "calibrations": len(profiles),
        },
        "summary": summary,
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    print("| variant | phase | predicted ms | measured ms | predicted / measured |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['variant']} | {row['phase']} | {row['predicted_ms']:.3f} | {row['measured_ms']:.3f} "
            f"| {row['ratio']:.2f} |"
        )
    print(
        f"\nmedian relative error {summary['median_relative_error']:.1%} "
        f"(prefill {summary['median_relative_error_prefill']:.1%}, decode {summary['median_relative_error_decode']:.1%}), "
        f"worst {summary['worst_relative_error']:.1%}; {len(rows)} measurements in {report['seconds']:.0f} s; "
        f"1-min load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
