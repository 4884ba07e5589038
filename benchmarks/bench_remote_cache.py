"""The trust_remote_code model of a `nemotron_h_puzzle` export: generation tokens/s with the cache against without.

Run: `PYTHONPATH=. python benchmarks/bench_remote_cache.py [--quick] [--new-tokens 256]`. Writes
benchmarks/results/bench_remote_cache.json and prints a markdown table. The model is the "demo-quick" preset
(Mamba, MoE and attention blocks, random weights: only timing matters) exported with
`puzzle.export(format="nemotron_h_puzzle")` and loaded by `AutoModelForCausalLM.from_pretrained(...,
trust_remote_code=True)`. Each sample is one greedy `generate` of exactly `--new-tokens` tokens after a
prompt of each of the `--prompts` lengths (prefill included), `use_cache=True` then `use_cache=False`, one
torch thread, medians over repeats; both must produce the same tokens. Figure of merit: the speed-up (goal
>= 5x at 256 new tokens); it grows with the prompt, as a step without the cache re-runs prompt and all. On
a model this small a cached step is mostly the per-operation overhead of eager PyTorch (and `generate`'s
own), so the speed-up is a floor of what larger children see. The CPU is shared with other jobs, so
absolute tokens/s are noisy; the ratio less so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from puzzle.export import export
from puzzle.model import HybridLM
from puzzle.presets import get_preset

RESULTS = Path(__file__).parent / "results" / "bench_remote_cache.json"


def load_remote(directory: Path, modules: Path):
    """The export's own remote code, imported from a private modules cache (no user cache touched)."""
    from transformers import AutoModelForCausalLM, dynamic_module_utils

    dynamic_module_utils.HF_MODULES_CACHE = str(modules)
    sys.path.insert(0, str(modules))
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()


def timed_generate(
    model, prompt: torch.Tensor, new_tokens: int, use_cache: bool
) -> tuple[float, torch.Tensor]:
    """Seconds of one greedy generate of exactly `new_tokens` tokens, and the tokens."""
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=0,
        )
    return time.perf_counter() - started, out


def measure(model, prompt: torch.Tensor, args: argparse.Namespace) -> dict:
    """Median tokens/s of generate with and without the cache after `prompt`, their ratio, same tokens or not."""
    timed_generate(model, prompt, 4, True)  # warm-up: first calls allocate
    seconds: dict[str, list[float]] = {"with cache": [], "without cache": []}
    outputs = {}
    for _ in range(args.repeats):
        for name, use_cache in (("with cache", True), ("without cache", False)):
            elapsed, outputs[name] = timed_generate(model, prompt, args.new_tokens, use_cache)
            seconds[name].append(elapsed)
    row: dict = {"prompt": prompt.shape[1]}
    for name, times in seconds.items():
        median = statistics.median(times)
        row[name] = {"median_s": median, "tokens_per_s": args.new_tokens / median}
    row["speedup"] = row["with cache"]["tokens_per_s"] / row["without cache"]["tokens_per_s"]
    row["same_tokens"] = torch.equal(outputs["with cache"], outputs["without cache"])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo-quick", help="model preset (demo-quick, demo)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[16, 128], help="prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed samples per setting (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    parser.add_argument("--quick", action="store_true", help="64 new tokens, one repeat")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.new_tokens, args.repeats = 64, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    spec = get_preset(args.preset)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        directory = export(HybridLM(spec).eval(), Path(scratch) / "child", format="nemotron_h_puzzle")
        model = load_remote(directory, Path(scratch) / "modules")
        for length in args.prompts:
            rows.append(measure(model, torch.randint(1, spec.vocab_size, (1, length)), args))
    same = all(row["same_tokens"] for row in rows)
    result = {
        "benchmark": "bench_remote_cache",
        "note": "shared CPU (other jobs running): absolute tokens/s are noisy; compare the speed-up",
        "settings": {**vars(args), "output": str(args.output)},
        "blocks": [block.short_name() for block in spec.blocks],
        "torch": torch.__version__,
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "rows": rows,
        "speedup": {str(row["prompt"]): row["speedup"] for row in rows},
        "same_tokens": same,
        "seconds": time.perf_counter() - started,
    }
    print(f"{args.new_tokens} new tokens, {args.preset} exported as nemotron_h_puzzle, trust_remote_code\n")
    print("| prompt | with cache, tokens/s | without, tokens/s | speed-up | same tokens |")
    print("|---:|---:|---:|---:|---|")
    for row in rows:
        print(
            f"| {row['prompt']} | {row['with cache']['tokens_per_s']:.1f} | "
            f"{row['without cache']['tokens_per_s']:.1f} | {row['speedup']:.1f}x | {row['same_tokens']} |"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.output)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
