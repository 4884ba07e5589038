"""`puzzle demo`: the demo parent compressed for two budgets by the whole pipeline, and what it gained and lost.

`run_demo` trains (or finds in the per-user cache) the demo parent (`puzzle.demo.parent`), writes a run
config over it into the output directory, runs every stage there (`puzzle.run.Run`: importance, library,
scores, solutions, assemble, distill, export; resumable, so a second demo into the same directory only
re-measures), then measures parent and children side by side on held-out text and on this CPU and writes
`demo.md` (the table), `demo.json` (the same figures) and the run's report (`report/report.md`).

The config it runs is `config.yaml` in the output directory: `puzzle run DIR/config.yaml` reruns it, and
it is the starting point for one's own experiments (every key is in docs/CONFIG.md).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from puzzle.artifacts import fingerprint_json
from puzzle.files import atomic_write_bytes

if TYPE_CHECKING:
    from puzzle.demo.parent import DemoParent
    from puzzle.run import Run

DEMO_FILE = "demo.md"
DEMO_JSON = "demo.json"
DEMO_CONFIG = "config.yaml"
PROGRESS_ENV = "PUZZLE_PROGRESS"
# The two children: 85% and 70% of the parent's active parameters. Both children are held to what vLLM and
# llama.cpp serve (ENGINES), which excludes no-op blocks and per-block Mamba and attention shapes: within
# that space the quick parent reaches 65% at the least (its embeddings and its one attention block stay)
# and the full one 65%, so 1/2 is out of reach for either; 70% leaves the search a choice in both.
SWEEP = "active_params<=0.85x,0.7x"
# The engines the demo's children are searched for and exported to (search.engines, export format "engine").
ENGINES = ("vllm", "llama.cpp")
# The local lm-eval task the demo's table reports (puzzle/eval_tasks: offline), and its chance-level metric:
# acc prefers short choices (a sum of log-probabilities), acc_norm divides by the choice's length.
EVAL_TASK = "puzzle_next_line"
EVAL_METRIC = "acc_norm"
EVAL_CHANCE = 0.25  # four choices
# The second local task, beside the first in the closing note: the rest of an identifier the context already
# holds, given its first characters (a greedy exact match: chance about 0).
COPY_TASK = "puzzle_identifiers"
COPY_METRIC = "acc"


@dataclass(frozen=True)
class DemoSize:
    """How much work each stage of a demo does (the full demo and `--quick` differ only in these)."""

    seq_len: int
    held_out_tokens: int
    importance_tokens: int
    bld_tokens: int
    gkd_tokens: int
    batch_size: int
    decode_prompt: int = 64
    decode_steps: int = 32
    decode_repeats: int = 7
    space: dict[str, Any] = field(default_factory=dict)
    # The budgets (a tiny test parent, mostly embeddings, reaches less than the demo's parents).
    sweep: str = SWEEP
    # Documents of each local task (EVAL_TASK, COPY_TASK) per model, the first ones (None: all 3000); the
    # parent and each child, before and after GKD, are evaluated: five models, the demo's slowest part on a
    # CPU after GKD (0.54 s a next-line item, 0.15 s an identifier, per model for the quick parent on one thread of a loaded 2-core machine).
    eval_limit: int | None = 40


FULL = DemoSize(
    seq_len=256,
    held_out_tokens=16_384,
    importance_tokens=8_192,
    bld_tokens=49_152,
    gkd_tokens=98_304,
    batch_size=8,
    # Twice the 300 items the task had: stderr 0.019 at acc_norm ~0.33. All 3000 would take hours here
    # (five models); benchmarks/paired_eval.py compares the models item by item on more.
    eval_limit=600,
    # What vLLM and llama.cpp serve: Mamba and attention shapes one for all blocks (the search holds them
    # to one value), MoE width, top-k and experts per block; no no-op blocks.
    space={
        "mamba": {"state_size": [8], "num_heads": [2]},
        "moe": {"top_k": [2, 1], "expert_width_fraction": [0.5], "num_experts": [8]},
        "attention": {"num_kv_heads": [1]},
    },
)
QUICK = DemoSize(
    seq_len=128,
    held_out_tokens=8_192,
    importance_tokens=4_096,
    bld_tokens=16_384,
    gkd_tokens=32_768,
    batch_size=8,
    decode_steps=16,
    decode_repeats=5,
    eval_limit=100,
    # Servable as FULL's; the shared expert (half the MoE's active parameters here) is the quick parent's
    # largest cut: without it 70% would be out of reach.
    space={
        "mamba": {"state_size": [8], "num_heads": [2]},
        "moe": {"top_k": [1], "shared_width_fraction": [0.5]},
        "attention": {"num_kv_heads": [1]},
    },
)


def default_out(quick: bool) -> Path:
    """Where a demo writes when no --out is given: ./puzzle-demo (./puzzle-demo-quick for --quick)."""
    return Path("puzzle-demo-quick" if quick else "puzzle-demo")


def demo_config(
    parent_dir: str | Path, corpus_file: str | Path, run_dir: str | Path, size: DemoSize, seed: int = 0
) -> dict[str, Any]:
    """The run config (plain data, as `puzzle run` reads it) of a demo over `parent_dir` and its corpus."""
    tokens = size.batch_size * size.seq_len
    return {
        "run_dir": str(run_dir),
        "seed": seed,
        "parent": {"path": str(parent_dir), "dtype": "float32"},
        "data": {
            "sources": [str(corpus_file)],
            "seq_len": size.seq_len,
            "held_out_fraction": 0.05,  # the parent's own split (puzzle.demo.parent): never trained on
            "batch_size": size.batch_size,
            "eval_batch_size": size.batch_size,
            "held_out_tokens": size.held_out_tokens,
        },
        "space": {"rounding": 8, "kinds": size.space},
        "importance": {"tokens": size.importance_tokens, "batch_size": size.batch_size},
        "bld": {
            "lr": 1e-3,
            # At least 4 steps: AdamW's first steps move every weight by about lr whatever its gradient, which
            # undoes the best inits (the quick demo's 1.6-step warm-up left block 6's top-2 variant worse).
            "warmup_tokens": max(size.bld_tokens // 10, 4 * tokens),
            "token_budget": size.bld_tokens,
            "checkpoint_every": 20,
            "dtype": "float32",
            "shard": "none",
        },
        "scoring": {"vocab_chunk": 4096},
        "search": {"sweep": size.sweep, "objective": "kl", "engines": list(ENGINES)},
        "gkd": {
            "lr": 5e-4,
            "warmup_tokens": tokens * 2,
            "token_budget": size.gkd_tokens,
            "batch_size": size.batch_size,
            "eval_every": max(1, size.gkd_tokens // tokens // 2),
            "checkpoint_every": 20,
            "shard": "none",
        },
        "eval": {"tasks": [EVAL_TASK, COPY_TASK], "limit": size.eval_limit, "batch_size": 16},
        "hardware": {
            "profile": "this-machine",
            "scenarios": {
                "decode": {
                    "batch_size": 1,
                    "prompt_tokens": size.decode_prompt,
                    "generated_tokens": size.decode_steps,
                    "recipe": "fp32",
                    "kv_dtype": "fp32",
                    "conv_dtype": "fp32",
                    "activation_dtype": "fp32",
                    "compute_dtype": "fp32",
                }
            },
        },
    }


@dataclass(frozen=True)
class ModelRow:
    """One line of the demo's table: a model's size, quality on held-out text and decode speed here."""

    name: str
    budget: str
    params: int
    active_params: int
    weight_bytes: float
    kl: float
    kl_predicted: float | None
    kl_before_gkd: float | None
    lm_loss: float
    top1: float
    predicted_tokens_per_s: float
    measured_tokens_per_s: float
    blocks: list[str]
    mixes_tokens: bool = True  # some block is Mamba or attention (`puzzle.report.mixes_tokens`)
    # EVAL_TASK's EVAL_METRIC (value, lm-eval's stderr) of the weights in the table (after GKD) and of the
    # assembled child (before GKD); None where not evaluated.
    accuracy: tuple[float, float] | None = None
    accuracy_before_gkd: tuple[float, float] | None = None
    # COPY_TASK's COPY_METRIC (value, stderr) of the weights in the table; None where not evaluated.
    copy_accuracy: tuple[float, float] | None = None


@dataclass(frozen=True)
class DemoResult:
    """What `run_demo` made: the output directory, the table's rows (parent first) and the files written."""

    out: Path
    rows: list[ModelRow]
    table: Path
    report: Path
    exports: dict[str, Path]
    seconds: float


def run_demo(
    out: str | Path | None = None,
    *,
    quick: bool = False,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    size: DemoSize | None = None,
    parent: DemoParent | None = None,
    log: Callable[[str], None] | None = None,
) -> DemoResult:
    """The demo, end to end (see the module docstring).

    `out` defaults to `default_out(quick)`; `cache_dir` to puzzle.demo.parent's cache; `size` and `parent`
    (a `puzzle.demo.parent.demo_parent` result) replace the preset's (tests use tiny ones); `log` receives
    one line per step (default: nothing).
    """
    say = log or (lambda _line: None)
    started = time.perf_counter()
    out = Path(out if out is not None else default_out(quick)).expanduser().resolve()
    size = size or (QUICK if quick else FULL)
    saved = os.environ.get(PROGRESS_ENV)
    if not progress:
        os.environ[PROGRESS_ENV] = "0"  # puzzle.progress reads it for every bar
    try:
        return _run_demo(out, quick, seed, cache_dir, progress, size, parent, say, started)
    finally:
        if saved is None:
            os.environ.pop(PROGRESS_ENV, None)
        else:
            os.environ[PROGRESS_ENV] = saved


def _run_demo(
    out: Path,
    quick: bool,
    seed: int,
    cache_dir: str | Path | None,
    progress: bool,
    size: DemoSize,
    parent: DemoParent | None,
    say: Callable[[str], None],
    started: float,
) -> DemoResult:
    from puzzle.config.run import dump_config, load_config_data
    from puzzle.demo.parent import demo_parent
    from puzzle.report import write_report
    from puzzle.run import Run

    if parent is None:
        say("the parent: " + ("the quick demo parent" if quick else "the demo parent"))
        parent = demo_parent(cache_dir, quick=quick, seed=seed, progress=progress)
    if parent.corpus is None:
        raise ValueError(f"the demo parent at {parent.path} comes without its corpus (DemoParent.corpus)")
    say(
        f"the parent: {parent.path} ({'from the cache' if parent.record.get('from_cache') else 'trained now'})"
    )
    data = demo_config(parent.path, parent.corpus.path, out, size, seed)
    config = load_config_data(data)
    pipeline = Run(out, config)
    pipeline.check_run_dir()
    pipeline.check_budgets(config.validate_paths())
    # The demo's own config for the user to rerun or copy (the run saves its resolved copy apart).
    atomic_write_bytes(out / DEMO_CONFIG, dump_config(config).encode())
    say(f"the pipeline: {out}")
    calibrate(pipeline)
    pipeline.run()
    say("measuring parent and children")
    stages = pipeline.manifest()["stages"]
    rows = measure(pipeline, size, stages)
    exported = stages["export"]["outputs"]
    exports = {name: out / entry["path"] for name, entry in exported.items()}
    report = write_report(out)
    seconds = time.perf_counter() - started
    table = write_table(out, rows, parent.record, size, seconds, quick)
    return DemoResult(out, rows, table, report, exports, seconds)


def calibrate(pipeline: Run) -> Any:
    """This machine's calibration of the demo's run, at one torch thread as the decode is measured: measured
    and stored in the run directory (RUN_DIR/hardware.json) before the search needs it, read back when
    there (a rerun, `puzzle report`, `puzzle search RUN_DIR` all price with it)."""
    pipeline.layout.root.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return pipeline.layout.hardware("this-machine")
    finally:
        torch.set_num_threads(threads)


def measure(pipeline: Run, size: DemoSize, stages: dict[str, Any] | None = None) -> list[ModelRow]:
    """Parent and exported children: sizes from the cost model, held-out quality from distillation's last
    evaluation, decode tokens/s predicted (cost model, with the run's stored calibration of this machine,
    `calibrate`) and measured (interleaved, one thread, medians over `size.decode_repeats`). `stages`: the
    run manifest's, when already read."""
    from puzzle.cost.analytic import model_active_params, model_params, model_weight_bytes
    from puzzle.cost.measure import decode_seconds
    from puzzle.cost.roofline import model_performance
    from puzzle.nemotron_h.checkpoint import load
    from puzzle.report import mixes_tokens
    from puzzle.run.evaluate import model_name

    manifest = stages if stages is not None else pipeline.manifest()["stages"]
    distilled = manifest["distill"]["outputs"]
    exported = manifest["export"]["outputs"]
    solutions = manifest["solutions"]["outputs"]
    models = {"parent": load(pipeline.config.parent.path).float().eval()}
    for name, entry in exported.items():
        models[name] = load(pipeline.layout.root / entry["path"]).float().eval()
    scenario = pipeline.config.hardware.scenarios["decode"]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, models["parent"].spec.vocab_size, (1, size.decode_prompt), generator=generator)
    hardware = calibrate(pipeline)  # the run's, as its search priced the children
    predicted = {
        name: model_performance(m.spec, scenario, hardware).decode_step_s for name, m in models.items()
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier on a shared CPU, and the calibration's thread count
    try:
        for model in models.values():  # warm-up: first calls allocate
            decode_seconds(model, prompt, 2)
        measured: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(size.decode_repeats):
            for name, model in models.items():
                measured[name].append(decode_seconds(model, prompt, size.decode_steps) / size.decode_steps)
    finally:
        torch.set_num_threads(threads)

    first = next(iter(distilled.values()))["last_eval"]
    rows = []
    for name, model in models.items():
        spec = model.spec
        if name == "parent":
            kl, predicted_kl, before, lm, top1, budget = 0.0, None, None, first["parent_lm_loss"], 1.0, "-"
        else:
            entry = distilled[name]
            last, initial = (
                entry.get("kept_eval", entry["last_eval"]),
                entry["first_eval"],
            )  # the weights kept
            kl, before, lm, top1 = last["kl"], initial.get("kl"), last["lm_loss"], last["top1"]
            solution = solutions.get(name, {})
            budget = " & ".join(solution.get("budgets", [name]))
            predicted_kl = solution.get("objective")
        rows.append(
            ModelRow(
                name=name,
                budget=str(budget),
                params=model_params(spec),
                active_params=model_active_params(spec),
                weight_bytes=model_weight_bytes(spec, "fp32"),
                kl=kl,
                kl_predicted=predicted_kl,
                kl_before_gkd=before,
                lm_loss=lm,
                top1=top1,
                predicted_tokens_per_s=1.0 / predicted[name],
                measured_tokens_per_s=1.0 / statistics.median(measured[name]),
                blocks=[block.short_name() for block in spec.blocks],
                mixes_tokens=mixes_tokens(spec),
                accuracy=task_accuracy(manifest, model_name(None if name == "parent" else name)),
                copy_accuracy=task_accuracy(
                    manifest, model_name(None if name == "parent" else name), COPY_TASK, COPY_METRIC
                ),
                accuracy_before_gkd=(
                    None if name == "parent" else task_accuracy(manifest, model_name(name, "assemble"))
                ),
            )
        )
    return rows


def task_accuracy(
    stages: dict[str, Any], model: str, task: str = EVAL_TASK, metric: str = EVAL_METRIC
) -> tuple[float, float] | None:
    """(value, stderr) of `task`'s `metric` in run.json's finished `eval/{model}` record, or None."""
    record = stages.get(f"eval/{model}") or {}
    if record.get("status") not in ("done", "reused"):
        return None
    for row in record["outputs"][model]["summary"]:
        if (row["task"], row["metric"]) == (task, metric):
            return row["value"], row["stderr"] if row["stderr"] is not None else math.nan
    return None


def render_table(
    rows: list[ModelRow], record: dict[str, Any], size: DemoSize, seconds: float, quick: bool
) -> str:
    """The Markdown of demo.md: the table of parent vs children, then the chosen architecture per block."""
    from puzzle.report import readable_budget  # numbers as the report's tables write them

    parent = rows[0]
    nan = float("nan")
    # Two held-out losses of the parent, on different windows of the same held-out files: its trainer's
    # (beside the unigram baseline, from the cached record) and the run's (the table's LM loss column).
    trained_on = record.get("data", {}).get("seq_len", "?")
    lines = [
        f"# puzzle demo{' --quick' if quick else ''}",
        "",
        f"Parent: the {'quick ' if quick else ''}demo hybrid trained on the Python standard library's source "
        f"({record.get('train_tokens', 0):,} tokens; when trained, its loss on {record.get('held_out_tokens', 0):,} "
        f"held-out tokens in sequences of {trained_on} was {record.get('held_out_loss', nan):.3f} nats/byte "
        f"against {record.get('unigram_held_out_loss', nan):.3f} for a unigram model). "
        f"Children: the search's choice for each budget, distilled against the parent. KL (nats/token) to the "
        f"parent: predicted by the search (the sum of each chosen block's replace-one-block score), measured "
        f"once assembled, and after global distillation (GKD). Held-out figures (KL, LM loss in nats/byte, "
        f"top-1) on the run's {size.held_out_tokens:,} held-out tokens in sequences of {size.seq_len} (the same "
        f"held-out files as the parent's figure above, other windows: hence another loss); decode tokens/s "
        f"at batch 1 after a {size.decode_prompt}-token "
        f"prompt, one thread, measured here (median of {size.decode_repeats}) and predicted by the cost model "
        f'calibrated on this machine: 1 / its decode step, the "decode speed" row of the report\'s costs '
        f"(the report's \"throughput\" row is lower: it also counts the prompt's prefill). "
        f"Whole demo: {seconds:.0f} s.",
        "",
        "| model | budget | params | active params | weights (fp32) | KL predicted | KL assembled | KL after GKD "
        f"| {EVAL_TASK} {EVAL_METRIC} assembled | after GKD "
        "| LM loss (run's held-out) | top-1 agreement | decode tok/s measured | predicted "
        "| speed-up measured / predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        predicted = f"{row.kl_predicted:.4f}" if row.kl_predicted is not None else "-"
        before = f"{row.kl_before_gkd:.4f}" if row.kl_before_gkd is not None else "-"
        speedup = row.measured_tokens_per_s / parent.measured_tokens_per_s
        predicted_speedup = row.predicted_tokens_per_s / parent.predicted_tokens_per_s
        lines.append(
            f"| {row.name} | {readable_budget(row.budget)} | {row.params:,} ({row.params / parent.params:.0%}) "
            f"| {row.active_params:,} ({row.active_params / parent.active_params:.0%}) "
            f"| {row.weight_bytes / 2**20:.2f} MiB | {predicted} | {before} | {row.kl:.4f} "
            f"| {_shown(row.accuracy_before_gkd)} | {_shown(row.accuracy)} | {row.lm_loss:.3f} "
            f"| {row.top1:.1%} "
            f"| {row.measured_tokens_per_s:,.0f} | {row.predicted_tokens_per_s:,.0f} "
            f"| {speedup:.2f}x / {predicted_speedup:.2f}x |"
        )
    lines += ["", "Chosen architecture per block (the parent's where unchanged):", ""]
    lines.append("| block | " + " | ".join(row.name for row in rows) + " |")
    lines.append("|---:|" + "---|" * len(rows))
    for index, parent_block in enumerate(parent.blocks):
        cells = [parent_block] + [
            row.blocks[index] if row.blocks[index] != parent_block else "=" for row in rows[1:]
        ]
        lines.append(f"| {index} | " + " | ".join(cells) + " |")
    lines += _no_token_mixer_notes(rows[1:])
    lines += _accuracy_notes(rows, size)
    lines += [
        "",
        "Report with plots: [report/report.md](report/report.md). Exported children: "
        + ", ".join(f"[exports/{row.name}](exports/{row.name})" for row in rows[1:])
        + ". The run: `puzzle run config.yaml` (resumes; every key in docs/CONFIG.md).",
        "",
    ]
    return "\n".join(lines)


def _shown(accuracy: tuple[float, float] | None) -> str:
    """A task accuracy cell: value +- stderr, or "-" where not evaluated."""
    return "-" if accuracy is None else f"{accuracy[0]:.3f} +- {accuracy[1]:.3f}"


def _accuracy_notes(rows: list[ModelRow], size: DemoSize) -> list[str]:
    """The closing note on task accuracy: each model's EVAL_TASK EVAL_METRIC with its stderr next to its KL,
    and whether KL (after GKD, lower first) and accuracy (after GKD, higher first) rank the children the
    same way, and whether their accuracies differ by more than the stderr of the difference."""
    parent, children = rows[0], rows[1:]
    if parent.accuracy is None or any(row.accuracy is None for row in children):
        return []
    items = "every item" if size.eval_limit is None else f"the first {size.eval_limit} items"
    lines = [
        "",
        f"Task accuracy (lm-evaluation-harness, the local task {EVAL_TASK}: the true next line of this "
        f"repository's Python source, held out from the parent's corpus, against three lines of other files; "
        f"{EVAL_METRIC} +- lm-eval's stderr on {items}; chance {EVAL_CHANCE}): parent {_shown(parent.accuracy)}"
        + "".join(
            f"; {row.name} {_shown(row.accuracy)} after GKD (KL {row.kl:.4f}), "
            f"{_shown(row.accuracy_before_gkd)} assembled"
            + (f" (KL {row.kl_before_gkd:.4f})" if row.kl_before_gkd is not None else "")
            for row in children
        )
        + ".",
    ]
    if parent.copy_accuracy is not None and all(row.copy_accuracy is not None for row in children):
        lines[-1] += (
            f" {COPY_TASK} (the rest of an identifier the context already holds, given its first 4 "
            f"characters; greedy exact match, {COPY_METRIC} +- stderr; chance about 0): parent "
            f"{_shown(parent.copy_accuracy)}"
            + "".join(f"; {row.name} {_shown(row.copy_accuracy)} after GKD" for row in children)
            + "."
        )
    by_kl = [row.name for row in sorted(children, key=lambda r: r.kl)]
    by_accuracy = [row.name for row in sorted(children, key=lambda r: -r.accuracy[0])]  # type: ignore[index]
    first, second = (next(r for r in children if r.name == n) for n in by_kl[:2])
    gap = first.accuracy[0] - second.accuracy[0]  # type: ignore[index]
    spread = math.hypot(first.accuracy[1], second.accuracy[1])  # type: ignore[index]
    same = "rank the children the same way" if by_kl == by_accuracy else "rank the children differently"
    if len({row.accuracy[0] for row in children}) < len(children):  # type: ignore[index]
        # a stable sort keeps tied children in KL's order: that is no agreement
        same = "do not rank the children alike: some children's accuracies tie, which KL separates"
    lines.append(
        f"KL and accuracy {same} (by KL after GKD, least first: {', '.join(by_kl)}; by "
        f"accuracy, highest first: {', '.join(by_accuracy)}); the accuracy gap between the two of least KL, "
        f"{gap:+.3f}, is {'more' if abs(gap) > 2 * spread else 'less'} than twice its stderr ({spread:.3f})"
        + ("" if abs(gap) > 2 * spread else ": on this task the difference does not show")
        + "."
    )
    return lines


def _no_token_mixer_notes(children: list[ModelRow]) -> list[str]:
    """A line for each child without a Mamba or attention block: legitimate, but worth saying."""
    from puzzle.report import NO_TOKEN_MIXER

    lines = []
    for row in children:
        if not row.mixes_tokens:
            lines += ["", f"Note: {row.name}: {NO_TOKEN_MIXER}."]
    return lines


def write_table(
    out: Path, rows: list[ModelRow], record: dict[str, Any], size: DemoSize, seconds: float, quick: bool
) -> Path:
    """demo.md and demo.json in `out`, written atomically; returns demo.md's path."""
    text = render_table(rows, record, size, seconds, quick)
    atomic_write_bytes(out / DEMO_FILE, text.encode())
    data = {
        "quick": quick,
        "seconds": seconds,
        "size": fingerprint_json(size.__dict__),
        "rows": [row.__dict__ for row in rows],
    }
    atomic_write_bytes(out / DEMO_JSON, (json.dumps(data, indent=2) + "\n").encode())
    return out / DEMO_FILE
