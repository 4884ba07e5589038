"""Benchmark the search MIP: the plain PuLP model against presolve + LP bound + reduced-cost fixing, per solver.

Instances: 88 blocks x 20 / 100 / 500 variants with 3 budgets, uniform and correlated costs (costs driven
by a variant's size, scores falling with size, like a real library), plus a synthetic 80 x 16 library in
the NVlabs block_library.json format read through `puzzle.search.library`. Figures go to
benchmarks/results/bench_mip.json and a markdown table on stdout. The machine is shared with other jobs,
so absolute seconds are noisy: each cell is the median of --repeat runs (3 by default), and the
plain/default ratio in the same run is the figure to read.

    python benchmarks/bench_mip.py            # everything (plain CBC at 500 variants takes minutes)
    python benchmarks/bench_mip.py --quick    # skip the plain model at 500 variants
    python benchmarks/bench_mip.py --library /tmp/block_library.json --only-library

`--library PATH` adds rows on a real NVlabs block library: NVIDIA's published Llama-3.3-70B-Instruct
library (github NVlabs/puzzle, examples/data/Llama-3.3-70B-Instruct/block_library.json, 80 layers x 16
variants). Its licence is non-commercial: it is never committed here; pass a local copy (rows are
skipped when the path is absent).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

try:
    import puzzle  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from puzzle.cost.limits import Bound, Relative
from puzzle.search import SolverOptions, Table, search
from puzzle.search.backend import REDUCED_MIP_HIGHS_OPTIONS
from puzzle.search.library import load_library

RESULTS = Path(__file__).parent / "results" / "bench_mip.json"
KEYS = ("memory", "runtime", "params")


def uniform_table(num_blocks: int, num_variants: int, seed: int) -> Table:
    """Costs and scores drawn independently; the parent (variant 0) is the most expensive, score 0."""
    rng = np.random.default_rng(seed)
    shape = (num_blocks, num_variants)
    score = rng.uniform(0.0, 0.05, shape)
    score[:, 0] = 0.0
    costs = {}
    for key in KEYS:
        values = rng.uniform(0.05, 1.0, shape)
        values[:, 0] = 1.0
        costs[key] = values.ravel()
    return _table(score, costs)


def correlated_table(num_blocks: int, num_variants: int, seed: int) -> Table:
    """Every cost grows with a variant's size (with per-key noise); the score falls with size."""
    rng = np.random.default_rng(seed)
    shape = (num_blocks, num_variants)
    size = rng.uniform(0.05, 1.0, shape)
    size[:, 0] = 1.0
    sensitivity = rng.lognormal(0.0, 1.0, (num_blocks, 1))  # some blocks matter more than others
    score = 0.05 * sensitivity * (1 - size) ** 2 * rng.uniform(0.7, 1.3, shape)
    score[:, 0] = 0.0
    costs = {
        "memory": (size * rng.uniform(0.9, 1.1, shape)).ravel(),
        "runtime": (0.2 + size**0.8 * rng.uniform(0.9, 1.1, shape)).ravel(),
        "params": (size * rng.uniform(0.95, 1.05, shape)).ravel(),
    }
    return _table(score, costs)


def _table(score: np.ndarray, costs: dict[str, np.ndarray]) -> Table:
    num_blocks, num_variants = score.shape
    return Table(
        block_names=tuple(f"block_{b}" for b in range(num_blocks)),
        variant_names=tuple(tuple(f"v{v}" for v in range(num_variants)) for _ in range(num_blocks)),
        score=score.ravel(),
        costs=costs,
    )


def nvlabs_library(path: Path, num_layers: int = 80, num_variants: int = 16, seed: int = 0) -> Table:
    """Write a synthetic NVlabs-format library (attention x FFN variants) and read it back."""
    rng = np.random.default_rng(seed)
    library = {}
    attention_options = (1.0, 0.5, 0.25, 0.0)
    ffn_options = (1.0, 0.75, 0.5, 0.0)
    for layer in range(num_layers):
        variants = {}
        layer_sensitivity = rng.lognormal(0.0, 1.0)
        for attention in attention_options:
            for ffn in ffn_options[: num_variants // len(attention_options)]:
                name = f"attention = {attention:.0%}\t&&\tffn = {ffn:.0%}"
                memory = 765.0 * attention + 672.0 * ffn
                runtime = 354.0 * attention**0.9 + 463.0 * ffn**0.95
                loss = (
                    0.0
                    if attention == ffn == 1.0
                    else layer_sensitivity * ((1 - attention) * 0.8 + (1 - ffn) ** 2) * rng.uniform(0.5, 1.5)
                )
                variants[name] = {
                    "stats": {
                        "memory_mib": memory,
                        "runtime_ms": runtime,
                        "num_params": int(1.5e8 * attention + 7e8 * ffn),
                    },
                    "metrics": {"kl_div": loss, "lm_loss": 1.64 + loss / 100},
                }
        library[f"layer_{layer}"] = variants
    path.write_text(json.dumps(library))
    return load_library(path, "metrics.kl_div", ["stats.memory_mib", "stats.runtime_ms", "stats.num_params"])


# Budgets on the real library: runtime, memory, and both (factors of the parent's totals).
LIBRARY_BUDGETS = (
    {"stats.runtime_ms": 0.5},
    {"stats.runtime_ms": 0.6},
    {"stats.runtime_ms": 0.7},
    {"stats.memory_mib": 0.5},
    {"stats.memory_mib": 0.6},
    {"stats.memory_mib": 0.7},
    {"stats.memory_mib": 0.6, "stats.runtime_ms": 0.6},
    {"stats.memory_mib": 0.7, "stats.runtime_ms": 0.5},
)


def library_cases(path: Path) -> list[tuple[str, Table, list[Bound]]]:
    """One case per LIBRARY_BUDGETS entry on the library file at `path` (none when it is absent)."""
    if not path.is_file():
        print(f"skipping the real-library rows: {path} does not exist", flush=True)
        return []
    table = load_library(path, "metrics.kl_div", ["stats.memory_mib", "stats.runtime_ms"])
    shape = f"{table.num_blocks}x{table.num_variants // table.num_blocks}"
    cases = []
    for budget in LIBRARY_BUDGETS:
        limits = [Bound(key, upper=Relative(factor)) for key, factor in budget.items()]
        label = ", ".join(f"{key.split('.')[-1]}<={factor}x" for key, factor in budget.items())
        cases.append((f"{path.stem} {shape} {label}", table, limits))
    return cases


# Methods compared in one run: the plain PuLP model of every variant, LP + reduced-cost fixing grown
# until it certifies, and the default (fixing against a dived + locally improved incumbent, probing).
METHODS = {
    "plain": {"presolve": False, "fixing": False},
    "fixing": {"presolve": True, "fixing": True, "heuristics": False},
    "default": {"presolve": True, "fixing": True, "heuristics": True},
}


def run_case(
    table: Table, limits: list[Bound], solver: str, method: str, time_limit: float, repeat: int = 1
) -> dict:
    """One method on one instance; with repeat > 1 the median of that many runs (runs over 20 s are not
    repeated), since the machine is shared and single timings are noisy."""
    options = SolverOptions(solver=solver, time_limit_s=time_limit, gap_rel=1e-6, **METHODS[method])
    times = []
    while len(times) < repeat:
        started = time.perf_counter()
        solution = search(table, limits, options=options)
        times.append(time.perf_counter() - started)
        if times[-1] > 20.0:
            break
    return {
        "seconds": float(np.median(times)),
        "runs": [round(t, 4) for t in times],
        "status": solution.status,
        "gap": solution.gap,
        "objective": solution.objective,
        "dropped": solution.presolve_dropped,
        "free_variables": solution.free_variables,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the plain model at 500 variants")
    parser.add_argument("--time-limit", type=float, default=300.0, help="per solve, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell; the median is reported")
    parser.add_argument(
        "--library", type=Path, help="a real NVlabs block_library.json (rows skipped if absent)"
    )
    parser.add_argument("--only-library", action="store_true", help="only the --library rows, HiGHS only")
    parser.add_argument(
        "--output", type=Path, help="results JSON (default: benchmarks/results/bench_mip*.json)"
    )
    args = parser.parse_args()

    cases = []
    for kind, make in (("correlated", correlated_table), ("uniform", uniform_table)):
        for num_variants in (20, 100, 500):
            budgets = [0.55, 0.65, 0.6] if kind == "correlated" else [0.4, 0.4, 0.4]
            limits = [Bound(key, upper=Relative(f)) for key, f in zip(KEYS, budgets)]
            cases.append((f"{kind} 88x{num_variants}", make(88, num_variants, args.seed), limits))
    with tempfile.TemporaryDirectory() as directory:
        table = nvlabs_library(Path(directory) / "block_library.json", seed=args.seed)
    cases.append(
        (
            "NVlabs-format 80x16",
            table,
            [
                Bound("stats.memory_mib", upper=Relative(0.6)),
                Bound("stats.runtime_ms", upper=Relative(0.7)),
                Bound("stats.num_params", upper=Relative(0.65)),
            ],
        )
    )

    solvers = ("highs", "cbc")
    if args.only_library:
        cases, solvers = [], ("highs",)
    if args.library is not None:
        cases.extend(library_cases(args.library))

    rows = []
    for name, table, limits in cases:
        for solver in solvers:
            row = {"instance": name, "solver": solver, "variables": table.num_variants}
            for method in METHODS:
                skip = method == "plain" and args.quick and table.num_variants > 88 * 100
                row[method] = (
                    None if skip else run_case(table, limits, solver, method, args.time_limit, args.repeat)
                )
            reference = row["plain"] or row["fixing"]
            row["same_objective"] = all(
                abs(row[m]["objective"] - reference["objective"])
                <= 1e-5 * max(1.0, abs(reference["objective"]))
                for m in METHODS
                if row[m] is not None
            )
            if row["plain"] is not None:
                row["speedup_vs_plain"] = row["plain"]["seconds"] / row["default"]["seconds"]
                row["time_ratio_vs_plain"] = row["default"]["seconds"] / row["plain"]["seconds"]
            rows.append(row)
            print(f"done {name} {solver}", flush=True)

    def cell(result: dict | None) -> str:
        if result is None:
            return "skipped"
        gap = "-" if result["gap"] is None else f"{result['gap']:.0e}"
        return f"{result['seconds']:.2f} s, {result['status']}, gap {gap}"

    print(
        "\n| instance | solver | plain PuLP model | + presolve, LP fixing | + incumbent, probing (default) | speedup | free vars | same optimum |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        speedup = f"{row['speedup_vs_plain']:.1f}x" if "speedup_vs_plain" in row else "-"
        print(
            f"| {row['instance']} | {row['solver']} | {cell(row['plain'])} | {cell(row['fixing'])} | "
            f"{cell(row['default'])} | {speedup} | {row['default']['free_variables']} | {row['same_objective']} |"
        )
    results = RESULTS.with_name("bench_mip_library.json") if args.only_library else RESULTS
    results = args.output or results
    results.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "bench_mip",
        "note": "seconds: median of `repeat` runs on a 2-core machine shared with other jobs: noisy; "
        "compare methods within a row",
        "highs_reduced_mip_options": REDUCED_MIP_HIGHS_OPTIONS,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "gap_rel": 1e-6,
        "repeat": args.repeat,
        "rows": rows,
    }
    temporary = results.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(payload, indent=2))
    temporary.replace(results)
    print(f"\nwrote {results}")


if __name__ == "__main__":
    main()
