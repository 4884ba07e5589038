"""Run every benchmark under benchmarks/ and write one table of their figures to docs/PERFORMANCE.md.

    python benchmarks/run_all.py                      # full sizes (tens of minutes on a small CPU)
    python benchmarks/run_all.py --quick              # tiny sizes, fewer repeats: a few minutes
    python benchmarks/run_all.py --only child mip     # re-run some; the others' rows come from their JSONs
    python benchmarks/run_all.py --library /tmp/block_library.json   # adds the real NVlabs library rows
    python benchmarks/run_all.py --args mip="--repeat 5"             # extra arguments for one benchmark

Each benchmark runs as a subprocess of this Python (one torch thread where it takes `--threads`) and writes
its JSON under the results folder (benchmarks/results, or benchmarks/results/quick with --quick); this
script then reads the JSONs and writes the table (a `--quick` run writes it beside its JSONs, not over
docs/PERFORMANCE.md): what is compared, the ratio, the goal, whether it is met
and the command that reproduces it, then a short section per benchmark and the machine it ran on. A
benchmark that fails is reported as failed (with the end of its stderr), the others' rows are kept, and
the exit status is 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass
class Row:
    """One line of the table: what is compared, the ratio (as text), the goal (as text), whether it is met."""

    compared: str
    ratio: str
    goal: str
    met: bool | None


@dataclass
class Bench:
    """A benchmark script, its arguments at full and quick size, and how its JSON becomes rows and details."""

    name: str
    script: str
    full: list[str]
    quick: list[str]
    summarize: Callable[[dict], tuple[list[Row], list[str]]]
    output_flag: str = "--output"
    needs_cuda: bool = False
    extra: list[str] = field(default_factory=list)


def _yes(ok: bool) -> bool:
    return bool(ok)


def blocks_rows(data: dict) -> tuple[list[Row], list[str]]:
    rows, details = [], []
    for r in data["rows"]:
        rows.append(
            Row(
                f"Mamba-2/MoE mixer, ours / transformers time: {r['case']}",
                f"{r['ratio']:.2f}",
                "<= 0.67 (1.5x faster); <= 1.0 required",
                _yes(r["ratio"] <= 0.67),
            )
        )
        details.append(
            f"{r['case']}: ours {r['ours_ms']:.2f} ms, transformers {r['theirs_ms']:.2f} ms (ratio {r['ratio']:.2f},"
            f" of minima {r['ratio_of_mins']:.2f}, of CPU time {r['cpu_ratio']:.2f}); max abs diff {r['max_abs_diff']:.1e}"
        )
    return rows, details


def importance_rows(data: dict) -> tuple[list[Row], list[str]]:
    rows, details = [], []
    for r in data["rows"]:
        if r["run"] == "forward":
            continue
        rows.append(
            Row(
                f"importance collection ({r['run']}) / plain forward time",
                f"{r['ratio_to_forward']:.2f}",
                "<= 1.3",
                _yes(r["ratio_to_forward"] <= 1.3),
            )
        )
    for r in data["rows"]:
        details.append(
            f"{r['run']}: median {r['median_s']:.3f} s, ratio {r['ratio_to_forward']:.2f} (of minima {r['ratio_of_mins']:.2f})"
        )
    return rows, details


def _training_rows(data: dict, what: str, key: str) -> tuple[list[Row], list[str]]:
    rows, details = [], []
    for r in data["rows"]:
        label = f"V={r['variants_per_block']}" if "variants_per_block" in r else f"vocab {r['vocab']}"
        if r.get("activation_checkpointing"):
            # The ideal has no recomputation: a checkpointed step runs each block's forward once more.
            label += ", activation checkpointing (the default)"
        med, mins = r["median"], r["min"]
        rows.append(
            Row(
                f"{what} step / ideal time, {label}",
                f"{med['ratio_vs_ideal']:.2f}",
                "<= 1.3" + ("" if what == "BLD" else " (as BLD; no goal set)"),
                _yes(med["ratio_vs_ideal"] <= 1.3),
            )
        )
        extra = f", vs plain (unchunked) {med['ratio_vs_plain']:.2f}" if "ratio_vs_plain" in med else ""
        details.append(
            f"{label}: {med[key + '_tokens_per_s']:.0f} tokens/s vs ideal {med['ideal_tokens_per_s']:.0f}; ratio vs ideal"
            f" {med['ratio_vs_ideal']:.2f} (minima {mins['ratio_vs_ideal']:.2f}), vs ideal+optimiser"
            f" {med['ratio_vs_ideal_opt']:.2f}{extra}"
        )
    return rows, details


def bld_rows(data: dict) -> tuple[list[Row], list[str]]:
    return _training_rows(data, "BLD", "bld")


def gkd_rows(data: dict) -> tuple[list[Row], list[str]]:
    return _training_rows(data, "GKD", "gkd")


def scoring_rows(data: dict) -> tuple[list[Row], list[str]]:
    rows, details = [], []
    for depth in data["depths"]:
        r = next(r for r in depth["rows"] if r["run"] != "naive_full_forward")
        rows.append(
            Row(
                f"scoring ({r['run']}) / naive full forwards time, {depth['blocks']} blocks",
                f"{r['ratio_to_naive']:.2f}",
                "<= 0.6",
                _yes(r["ratio_to_naive"] <= 0.6),
            )
        )
        details.append(
            f"{depth['blocks']} blocks, {depth['variants']} variants: time ratio {r['ratio_to_naive']:.2f} (minima"
            f" {r['ratio_of_mins']:.2f}, CPU time {r.get('cpu_ratio_of_medians', float('nan')):.2f}), peak memory ratio"
            f" {r.get('peak_ratio_to_naive', float('nan')):.2f}; max |KL difference| {depth['max_abs_kl_difference']:.1e}"
        )
    return rows, details


SYNTHETIC = ("correlated", "uniform", "NVlabs-format")


def mip_rows(data: dict) -> tuple[list[Row], list[str]]:
    rows, details = [], []
    for r in data["rows"]:
        default, plain = r["default"], r["plain"]
        optimal = default["status"] == "optimal"
        ratio = f"{default['seconds'] / plain['seconds']:.2f}" if plain else "-"
        plain_text = f"{plain['seconds']:.2f} s" if plain else "skipped"
        details.append(
            f"{r['instance']} ({r['solver']}): default {default['seconds']:.2f} s ({default['status']}), plain"
            f" {plain_text}, same optimum {r['same_objective']}"
        )
        if not r["instance"].startswith(SYNTHETIC):  # the real library given with --library
            rows.append(
                Row(
                    f"MIP solve, ours / plain PuLP time: {r['instance']} ({r['solver']})",
                    ratio,
                    "<= 0.25, optimal",
                    _yes(optimal and plain is not None and default["seconds"] <= 0.25 * plain["seconds"]),
                )
            )
        elif r["instance"] in ("correlated 88x100", "correlated 88x500"):
            limit = 1.0 if r["instance"].endswith("100") else 5.0
            rows.append(
                Row(
                    f"MIP solve {r['instance']} ({r['solver']}): {default['seconds']:.2f} s; ours / plain time",
                    ratio,
                    f"optimal in < {limit:g} s",
                    _yes(optimal and default["seconds"] < limit),
                )
            )
    return rows, details


def cost_model_rows(data: dict) -> tuple[list[Row], list[str]]:
    s = data["summary"]
    rows = [
        Row(
            "cost model predicted vs measured block latency: median relative error",
            f"{s['median_relative_error']:.0%}",
            "< 25%",
            _yes(s["median_relative_error"] < 0.25),
        )
    ]
    details = [
        f"median relative error {s['median_relative_error']:.1%} (prefill {s['median_relative_error_prefill']:.1%},"
        f" decode {s['median_relative_error_decode']:.1%}), worst {s['worst_relative_error']:.1%} over"
        f" {len(data['rows'])} measurements"
    ]
    return rows, details


def child_rows(data: dict) -> tuple[list[Row], list[str]]:
    measured, predicted = data["measured_speedup"], data["predicted_speedup"]
    rows = [
        Row(
            f"compressed / parent decode tokens/s: measured {measured:.2f}x, cost model predicts {predicted:.2f}x",
            f"{predicted / measured:.2f}",
            "predicted / measured in [0.8, 1.25]",
            _yes(0.8 <= predicted / measured <= 1.25),
        )
    ]
    details = [
        f"measured speed-up {measured:.2f}x (of minima {data['measured_speedup_of_minima']:.2f}x), predicted"
        f" {predicted:.2f}x, on the calibrated this-machine profile"
    ] + [
        f"{name} ({data['settings']['preset']} {'parent' if name == 'parent' else 'child'}): measured"
        f" {r['measured_tokens_per_s']:.0f} tokens/s, predicted {r['predicted_tokens_per_s']:.0f} tokens/s;"
        f" blocks {' '.join(r['blocks'])}"
        for name, r in data["rows"].items()
    ]
    return rows, details


def scale_rows(data: dict) -> tuple[list[Row], list[str]]:
    rows, details = [], []
    parent = data["settings"]["parent_mib"]
    for world, s in data["summary"].items():
        if "goal" in s:
            rows.append(
                Row(
                    f"peak RSS per rank above baseline, {world} ranks / 1 rank ({parent:.0f} MiB fp32 parent,"
                    " every stage, FSDP)",
                    f"{s['ratio_to_1_above_baseline']:.2f}",
                    f"<= {s['goal']}",
                    _yes(s["goal_met"]),
                )
            )
        ratio = s["predicted_over_measured"]
        rows.append(
            Row(
                f"`puzzle plan` peak per rank / measured above baseline, {world} rank(s)",
                "-" if ratio is None else f"{ratio:.2f}",
                "in [0.75, 1.25]",
                _yes(s["plan_within_25pct"]),
            )
        )
        details.append(
            f"{world} rank(s): peak {s['peak_mib']:.0f} MiB per rank ({s['above_baseline_mib']:.0f} above the"
            f" {s['baseline_mib']:.0f} MiB baseline), set by {s['set_by']}; plan {s['predicted_mib']:.0f} MiB;"
            f" {s['seconds']:.0f} s"
        )
    return rows, details


def remote_cache_rows(data: dict) -> tuple[list[Row], list[str]]:
    rows, details = [], []
    for r in data["rows"]:
        rows.append(
            Row(
                f"exported remote code, generate with / without KV+SSM cache, prompt {r['prompt']}",
                f"{r['speedup']:.1f}x",
                ">= 1 and the same tokens",
                _yes(r["speedup"] >= 1 and r["same_tokens"]),
            )
        )
        details.append(
            f"prompt {r['prompt']}: {r['with cache']['tokens_per_s']:.1f} tokens/s with the cache,"
            f" {r['without cache']['tokens_per_s']:.1f} without; same tokens: {r['same_tokens']}"
        )
    return rows, details


def gkd_checkpointing_rows(data: dict) -> tuple[list[Row], list[str]]:
    ratio = data["on_over_off"]
    rows = [
        Row(
            "GKD step with / without activation checkpointing: peak step memory",
            f"{ratio['peak_step_bytes']:.2f}",
            "< 1",
            _yes(ratio["peak_step_bytes"] < 1),
        ),
        Row(
            "GKD step with / without activation checkpointing: time",
            f"{ratio['step_s']:.2f}",
            "<= 1.4 (one extra forward at most)",
            _yes(ratio["step_s"] <= 1.4),
        ),
    ]
    details = [
        f"{mode}: saved {data[mode]['saved_bytes'] / 2**20:.0f} MiB, peak step {data[mode]['peak_step_bytes'] / 2**20:.0f}"
        f" MiB ({data[mode]['peak_kind']}), step {data[mode]['step_s']:.2f} s"
        for mode in ("off", "on")
    ]
    return rows, details


def gpu_rows(data: dict) -> tuple[list[Row], list[str]]:
    return [Row("GPU path vs CPU reference (outputs within tolerance)", "-", "passes", True)], [
        "see benchmarks/results/gpu_check.json"
    ]


BENCHES = [
    Bench(
        "blocks",
        "bench_blocks.py",
        [],
        ["--quick", "--repeats", "3", "--decode-steps", "10"],
        blocks_rows,
    ),
    Bench(
        "importance",
        "bench_importance.py",
        [],
        ["--hidden", "256", "--vocab", "1024", "--batch", "2", "--seq", "256", "--repeats", "3"],
        importance_rows,
    ),
    Bench(
        "bld",
        "bench_bld.py",
        [],
        ["--hidden", "256", "--vocab", "256", "--seq", "64", "--variants", "4", "--repeats", "2"],
        bld_rows,
    ),
    Bench(
        "gkd",
        "bench_gkd.py",
        [],
        ["--hidden", "256", "--vocab", "512", "--vocab-chunk", "256", "--seq", "64", "--repeats", "2"],
        gkd_rows,
    ),
    Bench(
        "scoring",
        "bench_scoring.py",
        [],
        shlex.split("--blocks 8 --hidden 256 --vocab 512 --vocab-chunk 256 --seq 64 --batches 1 --repeats 1"),
        scoring_rows,
    ),
    Bench("mip", "bench_mip.py", [], ["--quick", "--repeat", "1"], mip_rows),
    Bench(
        "cost_model",
        "bench_cost_model.py",
        [],
        ["--hidden", "128", "--prompt", "64", "--generated", "16", "--repeats", "5", "--rounds", "1"],
        cost_model_rows,
    ),
    Bench("child", "bench_child.py", [], ["--quick"], child_rows),
    Bench(
        "scale",
        "bench_scale.py",
        # 399 MiB fp32: at 4 ranks about 9 GiB together, what a 24 GiB machine holds beside other jobs; a
        # >= 1 GB parent (`--hidden 1024 --blocks 32 --vocab 32768`) needs ~25 GiB at 4 ranks.
        shlex.split("--hidden 768 --blocks 15 --vocab 32768"),
        shlex.split("--hidden 256 --blocks 5 --vocab 4096 --ranks 1 2"),
        scale_rows,
    ),
    Bench(
        "remote_cache",
        "bench_remote_cache.py",
        [],
        ["--quick", "--prompts", "16"],
        remote_cache_rows,
    ),
    Bench(
        "gkd_checkpointing",
        "bench_gkd_checkpointing.py",
        [],
        shlex.split("--hidden 256 --vocab 512 --vocab-chunk 512 --batch 2 --seq 128 --repeats 1"),
        gkd_checkpointing_rows,
    ),
    Bench("gpu_check", "gpu_check.py", [], [], gpu_rows, needs_cuda=True),
]


def machine_info() -> dict:
    """CPU model, core count, torch version, date and the load average when the run starts."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch  # imported here: the table-writing half needs no torch

    load = os.getloadavg()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average": load,
    }


def bench_output(bench: Bench, results: Path) -> Path:
    """Where a benchmark's JSON lands in the results folder."""
    return results / f"bench_{bench.name}.json" if bench.name != "gpu_check" else results / "gpu_check.json"


def bench_argv(bench: Bench, args: argparse.Namespace) -> tuple[list[str], str]:
    """The benchmark's arguments for this run, and the command line that reproduces it (for the table)."""
    argv = list(bench.quick if args.quick else bench.full)
    if bench.name == "mip" and args.library is not None:
        argv += ["--library", str(args.library)]
    argv += shlex.split(args.extra.get(bench.name, ""))
    shown = ["python", f"benchmarks/{bench.script}", *argv]
    return argv, "PYTHONPATH=.:benchmarks " + shlex.join(shown)


def summarize_output(bench: Bench, output: Path, command: str) -> dict:
    """Rows and details from a benchmark's JSON, or a failed outcome naming the file and the error."""
    try:
        rows, details = bench.summarize(json.loads(output.read_text()))
    except (KeyError, TypeError, ValueError, StopIteration, ZeroDivisionError) as error:
        note = f"{output} could not be read: {type(error).__name__}: {error}"
        return {"status": "failed", "command": command, "note": note}
    return {"status": "ok", "command": command, "rows": rows, "details": details}


def kept_bench(bench: Bench, args: argparse.Namespace, results: Path) -> dict | None:
    """A benchmark `--only` did not run: its rows from the JSON an earlier run left, or None when there is none.

    Why: `--only scale` should refresh the scale rows, not drop every other benchmark's rows from the document.
    """
    output = bench_output(bench, results)
    if not output.exists():
        return None
    _, command = bench_argv(bench, args)
    outcome = summarize_output(bench, output, command)
    when = datetime.datetime.fromtimestamp(output.stat().st_mtime, datetime.timezone.utc)
    outcome["kept"] = when.strftime("%Y-%m-%d %H:%M UTC")
    return outcome


def run_bench(bench: Bench, args: argparse.Namespace, results: Path) -> dict:
    """Run one benchmark; returns its status, command, rows and details (or the error)."""
    output = bench_output(bench, results)
    argv, command = bench_argv(bench, args)
    if bench.needs_cuda and not args.cuda:
        return {"status": "skipped", "command": command, "note": "needs CUDA; none on this machine"}
    if not bench.needs_cuda:
        argv += [bench.output_flag, str(output)]
    output.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    print(f"[run_all] {command}", flush=True)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(HERE / bench.script), *argv], cwd=ROOT, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - started
    (results / f"{bench.name}.log").write_text(done.stdout + done.stderr)
    if bench.needs_cuda:
        output = HERE / "results" / "gpu_check.json"
    if done.returncode != 0 or not output.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        why = f"exit status {done.returncode}" if done.returncode else f"no {output.name} written"
        return {
            "status": "failed",
            "command": command,
            "seconds": seconds,
            "note": f"{why}: {' / '.join(tail)}",
        }
    return {**summarize_output(bench, output, command), "seconds": seconds}


def _met(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "**no**")


def _kept_sentence(outcomes: dict[str, dict]) -> list[str]:
    """A line naming the benchmarks whose rows come from an earlier run's JSON (`--only`), if any."""
    kept = [f"{name} ({outcome['kept']})" for name, outcome in outcomes.items() if "kept" in outcome]
    if not kept:
        return []
    return [f"Not re-run this time, rows kept from their earlier JSON: {', '.join(kept)}.", ""]


def render(outcomes: dict[str, dict], machine: dict, args: argparse.Namespace) -> str:
    """The Markdown document: the table, details per benchmark, the machine."""
    load1, load_end = machine["load_average"][0], machine["load_average_end"][0]
    shared = max(load1, load_end) > (machine["cores"] or 1)
    mode = (
        "a `--quick` run (tiny sizes, few repeats: ratios are indicative only)"
        if args.quick
        else "a full run"
    )
    lines = [
        "# Performance",
        "",
        f"Every benchmark under `benchmarks/`, run by `python benchmarks/run_all.py{' --quick' if args.quick else ''}`"
        f" on {machine['date']}: {mode}. Ratios compare two things measured in the same process, interleaved;"
        " absolute times on this CPU are noisy and are not the point. Ratios of times: < 1 means the first is"
        f" faster. 1-minute load average {load1:.2f} at the start, {load_end:.2f} at the end, on {machine['cores']}"
        " cores" + (": **the machine was shared with other jobs**, expect noise." if shared else "."),
        "",
        *([args.note, ""] if args.note else []),
        *_kept_sentence(outcomes),
        "| benchmark | what is compared | ratio | goal | met? | command |",
        "|---|---|---:|---|---|---|",
    ]
    for name, outcome in outcomes.items():
        command = f"`{outcome['command']}`"
        if outcome["status"] != "ok":
            lines.append(f"| {name} | {outcome['status']}: {outcome['note']} | - | - | - | {command} |")
            continue
        for row in outcome["rows"]:
            lines.append(
                f"| {name} | {row.compared} | {row.ratio} | {row.goal} | {_met(row.met)} | {command} |"
            )
    if "mip" in outcomes and args.library is None:
        lines += [
            "",
            "The real NVlabs Llama-3.3-70B library rows are skipped: pass its file with `--library PATH`.",
        ]
    lines += ["", "## Details", ""]
    for name, outcome in outcomes.items():
        took = f" ({outcome['seconds']:.0f} s)" if "seconds" in outcome else ""
        took += f" (kept from the run of {outcome['kept']})" if "kept" in outcome else ""
        lines += [f"### {name}{took}", "", f"`{outcome['command']}`", ""]
        if outcome["status"] != "ok":
            lines += [f"{outcome['status']}: {outcome['note']}", ""]
            continue
        lines += [f"- {detail}" for detail in outcome["details"]] + [""]
    lines += [
        "## Machine",
        "",
        f"- CPU: {machine['cpu']}, {machine['cores']} cores; benchmarks use 1 torch thread",
        f"- torch {machine['torch']} (CUDA: {machine['cuda']}), Python {machine['python']}",
        f"- date: {machine['date']}",
        "- load average at start (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in machine["load_average"]),
        "- load average at end (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in machine["load_average_end"]),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    names = [bench.name for bench in BENCHES]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (a few minutes)")
    parser.add_argument("--only", nargs="+", choices=names, help="run these benchmarks only")
    parser.add_argument(
        "--library", type=Path, help="NVlabs block_library.json for the real-library MIP rows"
    )
    parser.add_argument(
        "--args", action="append", default=[], metavar="NAME=ARGS", help="extra arguments for one benchmark"
    )
    parser.add_argument(
        "--results", type=Path, help="folder for the JSONs (default benchmarks/results[/quick])"
    )
    parser.add_argument("--note", help="a sentence to print under the introduction (how the run was made)")
    parser.add_argument(
        "--doc",
        type=Path,
        help="the Markdown to write (default docs/PERFORMANCE.md; with --quick, PERFORMANCE.md in the results"
        " folder, so indicative quick figures never replace the full ones)",
    )
    args = parser.parse_args(argv)
    args.extra = {}
    for item in args.args:
        name, sep, value = item.partition("=")
        if not sep or name not in names:
            parser.error(f"--args expects NAME=ARGS with NAME one of {names}, found {item!r}")
        args.extra[name] = value
    if args.library is not None and not args.library.exists():
        print(f"[run_all] {args.library} does not exist: the real-library rows are skipped", flush=True)
        args.library = None
    results = args.results or (HERE / "results" / "quick" if args.quick else HERE / "results")
    results.mkdir(parents=True, exist_ok=True)
    if args.doc is None:
        args.doc = results / "PERFORMANCE.md" if args.quick else ROOT / "docs" / "PERFORMANCE.md"

    machine = machine_info()
    args.cuda = machine["cuda"]
    outcomes = {}
    for bench in BENCHES:
        if args.only and bench.name not in args.only:
            kept = kept_bench(bench, args, results)
            if kept is not None:
                outcomes[bench.name] = kept
            continue
        outcomes[bench.name] = outcome = run_bench(bench, args, results)
        print(f"[run_all] {bench.name}: {outcome['status']} {outcome.get('note', '')}", flush=True)

    machine["load_average_end"] = os.getloadavg()
    document = render(outcomes, machine, args)
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.doc.with_suffix(".md.tmp")
    tmp.write_text(document)
    tmp.replace(args.doc)
    print(document)
    print(f"[run_all] wrote {args.doc}")
    return 1 if any(outcome["status"] == "failed" for outcome in outcomes.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
