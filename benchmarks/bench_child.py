"""Compressed child vs its parent: decode tokens/s measured on this CPU next to the cost model's predicted speed-up.

Run: `PYTHONPATH=. python benchmarks/bench_child.py [--quick] [--repeats 15]`. Writes
benchmarks/results/bench_child.json and prints a markdown table. The parent is the "demo" preset (random
weights: only timing matters), the child the same spec with every MoE at half its top-k and expert width,
every Mamba at half its state size and the last block a no-op (built with `dataclasses.replace`). Both
generate greedily through `HybridLM`'s cache (prefill untimed, then single-token decode steps timed), one
torch thread, interleaved parent / child, medians over repeats. The prediction is `puzzle.cost`'s
`model_performance` on the calibrated "this machine" profile (fp32 weights, activations and state),
calibrated again before each round. Figure of merit: measured speed-up (child tokens/s / parent tokens/s)
against the predicted one. The CPU is shared with other jobs, so absolute tokens/s are noisy; ratios less so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

from puzzle.cost.hardware import calibrate_this_machine
from puzzle.cost.measure import decode_seconds
from puzzle.cost.roofline import Scenario, model_performance
from puzzle.model import HybridLM
from puzzle.presets import get_preset
from puzzle.spec import MambaSpec, ModelSpec, MoESpec, NoOpSpec

RESULTS = Path(__file__).parent / "results" / "bench_child.json"


def compressed(parent: ModelSpec) -> ModelSpec:
    """The parent with MoE top-k and expert width halved, Mamba state halved and the last block a no-op."""
    blocks = []
    for block in parent.blocks:
        if isinstance(block, MoESpec):
            block = dataclasses.replace(
                block, top_k=max(1, block.top_k // 2), expert_width=block.expert_width // 2
            )
        elif isinstance(block, MambaSpec):
            block = dataclasses.replace(block, state_size=block.state_size // 2)
        blocks.append(block)
    blocks[-1] = NoOpSpec()
    return dataclasses.replace(parent, blocks=tuple(blocks))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo", help="parent preset (demo, demo-quick)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed sample")
    parser.add_argument("--repeats", type=int, default=15, help="timed samples per model (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    parser.add_argument("--quick", action="store_true", help="demo-quick parent, fewer steps and repeats")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.steps, args.repeats = "demo-quick", 16, 9
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    specs = {"parent": get_preset(args.preset)}
    specs["child"] = compressed(specs["parent"])
    models = {name: HybridLM(spec).eval() for name, spec in specs.items()}
    prompt = torch.randint(0, specs["parent"].vocab_size, (args.batch, args.prompt))
    scenario = Scenario(
        args.batch,
        args.prompt,
        args.steps,
        recipe="fp32",
        kv_dtype="fp32",
        ssm_dtype="fp32",
        conv_dtype="fp32",
        activation_dtype="fp32",
        compute_dtype="fp32",
    )
    for model in models.values():  # warm-up: first calls allocate
        decode_seconds(model, prompt, 4)
    measured: dict[str, list[float]] = {name: [] for name in models}
    predicted: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        hardware = calibrate_this_machine.__wrapped__()  # fresh: the load of other jobs changes by the second
        for name, model in models.items():
            measured[name].append(decode_seconds(model, prompt, args.steps) / args.steps)
            predicted[name].append(model_performance(specs[name], scenario, hardware).decode_step_s)

    rows = {}
    for name in models:
        step_s, predicted_s = statistics.median(measured[name]), statistics.median(predicted[name])
        rows[name] = {
            "blocks": [block.short_name() for block in specs[name].blocks],
            "measured_step_ms": 1e3 * step_s,
            "measured_tokens_per_s": args.batch / step_s,
            "predicted_step_ms": 1e3 * predicted_s,
            "predicted_tokens_per_s": args.batch / predicted_s,
        }
    minima = {name: min(times) for name, times in measured.items()}
    measured_speedup = rows["child"]["measured_tokens_per_s"] / rows["parent"]["measured_tokens_per_s"]
    predicted_speedup = rows["child"]["predicted_tokens_per_s"] / rows["parent"]["predicted_tokens_per_s"]
    result = {
        "benchmark": "bench_child",
        "note": "shared CPU (other jobs running): absolute tokens/s are noisy; compare the speed-ups",
        "settings": {**vars(args), "output": str(args.output)},
        "torch": torch.__version__,
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "rows": rows,
        "measured_speedup": measured_speedup,
        "predicted_speedup": predicted_speedup,
        "predicted_over_measured": predicted_speedup / measured_speedup,
        "measured_speedup_of_minima": minima["parent"] / minima["child"],
        "seconds": time.perf_counter() - started,
    }
    print("| model | measured tokens/s | predicted tokens/s |")
    print("|---|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['measured_tokens_per_s']:.1f} | {row['predicted_tokens_per_s']:.1f} |")
    print(f"\nspeed-up child / parent: measured {measured_speedup:.2f}x, predicted {predicted_speedup:.2f}x")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
