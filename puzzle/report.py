"""`puzzle report RUN`: a Markdown report with PNG plots of what a run directory holds.

    from puzzle.report import write_report
    path = write_report("run")          # run/report/report.md and its PNGs

Sections, each skipped with a one-line note when its inputs are missing: the Pareto frontier of the
summed predicted KL against each budget key of the run's solutions (swept by the run's solutions stage
into frontier.json, `puzzle.problem.frontier_sweep`; the report solves nothing), a per-block map of each chosen architecture (parent row above
child row, coloured by kind, shaded by active parameters relative to the parent's block, as Figure 6 of
the Puzzle paper), the rounds of scores in context and the candidates of `search.rerank` with their
predicted and measured KL, before and after the short GKD, and how often each source won (run.json's
solutions record; only where the run had them), the cost breakdown parent vs child, the library's BLD losses, the GKD curves
(children/{name}/history.json), measured vs predicted KL (exports/{name}/puzzle.json) and the task
accuracy of the parent and the children beside their KL and active parameters (run.json's eval records:
`eval.tasks`). Rounds r >= 2
of an iterative run (round-{r}/) get a report of their own in OUT/round-{r}, linked from the first.

Plots need matplotlib (the optional `plot` extra); each is drawn on its own `Figure` with the Agg canvas,
so the caller's pyplot state and backend are never touched. Without matplotlib the tables are written
and the report says how to get the plots. Nothing but RUN_DIR/report (or `out_dir`: built in a staging
directory beside it and swapped in whole; a directory holding anything but an earlier report is refused
unless `overwrite`) is written, and
RUN_DIR/hardware.json when the run prices on "this-machine" and has no stored calibration yet (measured
once, then read back: the report's figures are the search's and do not change between reports).
"""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from puzzle.cost.analytic import (
    block_active_params,
    model_active_params,
    model_params,
    model_weight_bytes,
    state_bytes_per_request,
)
from puzzle.files import (
    atomic_write_bytes,
    foreign_entries,
    make_staging_dir,
    move_files_beside,
    path_problem,
    refusal_to_overwrite,
    remove_stale_staging,
    swap_directory_into_place,
)
from puzzle.layout import CHILDREN_DIR, EVAL_DIR, EXPORTS_DIR, RunDirError, RunLayout
from puzzle.rerank import rerank_wins
from puzzle.spec import (
    AttentionSpec,
    BlockSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
)

REPORT_FILE = "report.md"
# report.md's first two lines: the marker proves a report.md is this module's (`is_earlier_report`), so a
# later report may replace it; a report.md of the user's is never replaced without an explicit overwrite.
REPORT_MARKER = "<!-- written by `puzzle report`: a report.md without this line is never replaced -->"
REPORT_TITLE = "# Puzzle report: "
PLOT_HINT = "plots need matplotlib: pip install 'puzzle-nas[plot]'"
# The context of the KV + SSM state row of the cost table when the run names no scenario.
STATE_CONTEXT = 4096
# The GKD curves plotted (the tables list every recorded value).
_GKD_CURVES = {"train": ("loss", "kl"), "eval": ("kl", "lm_loss_delta")}
# Costs of the table above that the search also sums (the others are per scenario).
_MODEL_COSTS = ("params", "active_params", "weight_bytes")


@dataclass(frozen=True)
class KindStyle:
    """How a report shows one block kind: its colour in the layout plot, and whether it mixes tokens.

    A model without a token mixer predicts each token from itself alone (MoE, MLP, linear and no-op
    blocks act on each position separately).
    """

    colour: str
    mixes_tokens: bool = False


KIND_STYLES: dict[type, KindStyle] = {
    MambaSpec: KindStyle("tab:green", mixes_tokens=True),
    AttentionSpec: KindStyle("tab:blue", mixes_tokens=True),
    MoESpec: KindStyle("tab:orange"),
    MLPSpec: KindStyle("tab:purple"),
    LinearSpec: KindStyle("tab:grey"),
    NoOpSpec: KindStyle("white"),
}
KIND_COLOURS = {spec_type.kind: style.colour for spec_type, style in KIND_STYLES.items()}
TOKEN_MIXERS = tuple(spec_type.kind for spec_type, style in KIND_STYLES.items() if style.mixes_tokens)
# The GKD evaluations a report tables in full; a longer run's table shows the first and the last.
GKD_EVAL_ROWS = 12
# Font size of tick labels, legends and annotations: readable at the PNG's own size (dpi 100).
SMALL_FONT = 8


def mixes_tokens(spec: ModelSpec) -> bool:
    """Whether any block of `spec` mixes tokens (Mamba or attention)."""
    return any(block.kind in TOKEN_MIXERS for block in spec.blocks)


NO_TOKEN_MIXER = (
    "it keeps no Mamba or attention block, so nothing in it mixes tokens: each position is predicted "
    "from its own token alone (a bigram model). The search space allowed it (every Mamba and attention "
    "block may become a no-op)"
)


def _figure_class() -> Any:
    """matplotlib's Figure, or None when the optional extra is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


class _Report:
    """The Markdown lines and PNG files of one report, written at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.lines: list[str] = []
        self.figure = _figure_class()

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def save(self, figure: Any, name: str, alt: str) -> None:
        """Render `figure` (Agg canvas: savefig on a bare Figure uses it) to NAME.png and link it."""
        image = io.BytesIO()
        figure.tight_layout()
        figure.savefig(image, format="png", dpi=100)
        atomic_write_bytes(self.out / name, image.getvalue())
        self.add(f"![{alt}]({name})", "")

    def plot_note(self) -> None:
        self.add(f"_({PLOT_HINT})_", "")


def _format(value: Any) -> str:
    """A table cell: numbers as `readable_number` writes them, booleans as yes / no, None as "-"."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return readable_number(value)
    return str(value)


# Below this a number is shown as "≈0": positional notation has no room for its digits.
_TINY = 1e-12


def readable_number(value: float) -> str:
    """`value` as a reader takes it in at a glance, never in scientific notation: counts and other values of
    1,000 or more with thousands separators and no decimals (1,029,360), smaller ones to 4 significant
    digits (383.4, 0.04212, 0.00008107), trailing zeros dropped."""
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 1000):
        return f"{int(value):,}"
    if not math.isfinite(value):
        return str(value)  # nan, inf, -inf
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if value == 0:
        return "0"
    if abs(value) < _TINY:
        return "≈0"
    decimals = max(0, 3 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    if abs(float(text)) >= 1000:  # 999.99 rounds up to four digits
        return f"{float(text):,.0f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


# The bound of a budget text: `weight_bytes[bf16]<=1.02936e+06`, `active_params<=0.75x`.
_BOUND = re.compile(r"(<=|>=|<|>|=)(-?\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)(x?)$")


def readable_budget(text: str) -> str:
    """A budget text with its bound written by `readable_number` (`weight_bytes[bf16]<=1,029,360` for
    `...<=1.02936e+06`); any other text as it is."""
    found = _BOUND.search(text)
    if found is None:
        return text
    number = float(found.group(2))
    shown = readable_number(int(number) if number.is_integer() else number)
    return f"{text[: found.start()]}{found.group(1)}{shown}{found.group(3)}"


def _file_name(text: str) -> str:
    """`weight_bytes[bf16]` -> `weight_bytes_bf16`: a PNG name a Markdown link and every filesystem take."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "plot"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_format(cell) for cell in row) + " |" for row in rows]
    return [*lines, ""]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise RunDirError(f"{path}: cannot read it as JSON ({error})") from None


def _current(layout: RunLayout) -> set[str] | None:
    """The solutions of the run's last search (its manifest's `solutions` stage), or None when the directory
    has no such record (a `puzzle search` run directory): then every saved solution is current. Earlier
    budgets' solutions, children and exports stay on disk (a return to them reuses them) but are not shown."""
    if not layout.manifest.is_file():
        return None
    stage = (_read_json(layout.manifest).get("stages") or {}).get("solutions") or {}
    outputs = stage.get("outputs") if stage.get("status") == "done" else None
    return set(outputs) if isinstance(outputs, dict) else None


def _is_current(name: str, current: set[str] | None) -> bool:
    return current is None or name in current


def _context(report: _Report, layout: RunLayout) -> None:
    """The rounds of scores in context (`search.context_rounds`) of each solution that went through them,
    from the solutions record in run.json: each round's predicted and measured objective, the kept round,
    and a round `search.context_guard` refused with its reason. Nothing for a run without such rounds."""
    if not layout.manifest.is_file():
        return
    stage = (_read_json(layout.manifest).get("stages") or {}).get("solutions") or {}
    outputs = stage.get("outputs") if stage.get("status") == "done" else None
    rows, objectives = [], set()
    for name, entry in (outputs if isinstance(outputs, dict) else {}).items():
        context = entry.get("context") if isinstance(entry, dict) else None
        if not isinstance(context, dict):
            continue
        objectives.add(str(context.get("objective", "kl")))
        for number, entry_round in enumerate(context.get("rounds") or []):
            if number == context.get("kept"):
                note = "kept"
            elif "rejected" in entry_round:  # the guard's reason, as the log gave it
                note = f"not taken: {entry_round['rejected']}"
            else:
                note = ""
            rows.append([name, number, entry_round.get("predicted"), entry_round.get("measured"), note])
    if not rows:
        return
    objective = ", ".join(sorted(objectives))
    report.add(
        "## Scores in context",
        "",
        f"Each round of `search.context_rounds`: the {objective} its solve predicted and its child measured on "
        "the held-out tokens (round 0 is the first search's). A round whose prediction is below zero or "
        "beyond `search.context_guard` of the child it started from is not taken: its child is not measured "
        "and the rounds stop there.",
        "",
        *_table(["solution", "round", f"predicted {objective}", f"measured {objective}", "note"], rows),
    )


def _reranking(report: _Report, layout: RunLayout) -> None:
    """The candidates of each search `search.rerank` re-ranked, from the solutions record in run.json: each
    one's sources, its prediction, its KL before GKD and (by short GKD) after the short GKD, the kept one
    marked; then how often each kind of source won (`puzzle.rerank.rerank_wins`). Nothing without one."""
    if not layout.manifest.is_file():
        return
    stage = (_read_json(layout.manifest).get("stages") or {}).get("solutions") or {}
    outputs = stage.get("outputs") if stage.get("status") == "done" else None
    records = {
        name: entry["rerank"]
        for name, entry in (outputs if isinstance(outputs, dict) else {}).items()
        if isinstance(entry, dict) and isinstance(entry.get("rerank"), dict)
    }
    if not records:
        return
    rows = []
    for name, record in records.items():
        for candidate in record.get("candidates") or []:
            rows.append(
                [
                    name,
                    candidate.get("candidate"),
                    ", ".join(candidate.get("sources") or ["mip-" + str(candidate.get("candidate"))]),
                    candidate.get("predicted", candidate.get("objective")),
                    candidate.get("kl_before", candidate.get("measured_kl")),
                    candidate.get("short_gkd_kl"),
                    "kept" if candidate.get("candidate") == record.get("chosen") else "",
                ]
            )
    lines = [
        "## Re-ranking",
        "",
        "The candidates of `search.rerank`: where each came from (mip-k: the MIP's k-th best; round-r: the "
        "child of context round r; greedy: refilled greedy's; uniform: the best uniform pruning's), the "
        "objective its source predicted, its KL to the parent on the held-out tokens before GKD and after the "
        "short GKD (`by: short_gkd`; the least is kept, and the distill stage distils it in full).",
        "",
        *_table(
            ["solution", "candidate", "sources", "predicted", "KL before GKD", "KL after short GKD", "note"],
            rows,
        ),
    ]
    tally = rerank_wins(records.values())
    if tally["searches"]:
        wins = ", ".join(f"{kind} {count}" for kind, count in tally["wins"].items())
        lines += [
            f"The kept child's source over {tally['searches']} search(es): {wins} (a child several sources "
            "proposed counts for each).",
            "",
        ]
    report.add(*lines)


def _solutions(layout: RunLayout) -> dict[str, dict[str, Any]]:
    if not layout.solutions.is_dir():
        return {}
    found = {}
    current = _current(layout)
    for path in sorted(layout.solutions.glob("*.json")):
        if not _is_current(path.stem, current):
            continue
        data = _read_json(path)
        if not isinstance(data, dict) or not isinstance(data.get("choices"), dict):
            raise RunDirError(f"{path}: not a solution (expected the JSON of `puzzle search --json`)")
        found[path.stem] = data
    return found


def _child_spec(parent: ModelSpec, library: Any, solution: dict[str, Any]) -> ModelSpec:
    from puzzle.assemble import AssemblyError, solution_variants

    choices = {}
    for block, variant_id in solution["choices"].items():
        prefix, _, number = block.partition("_")
        if prefix != "block" or not number.isdigit():
            raise RunDirError(f"solution block name {block!r} is not 'block_<index>'")
        choices[int(number)] = variant_id
    try:
        variants = solution_variants(choices, library, parent)
    except AssemblyError as error:
        raise RunDirError(str(error)) from None
    return ModelSpec(
        vocab_size=parent.vocab_size,
        hidden_size=parent.hidden_size,
        blocks=tuple(variant.spec for variant in variants),
        norm_eps=parent.norm_eps,
        tie_embeddings=parent.tie_embeddings,
    )


# ------------------------------------------------------------------------------------------- sections


def _frontier(report: _Report, layout: RunLayout, solutions: dict[str, dict[str, Any]]) -> None:
    report.add("## Pareto frontier", "")
    if not solutions:
        report.add(f"_Skipped: no solutions in {layout.solutions}._", "")
        return
    if not layout.frontier.is_file():
        report.add(
            f"_Skipped: no frontier in {layout.frontier} (the solutions stage of `puzzle run` sweeps it; "
            "run it again to add one to an older run)._",
            "",
        )
        return
    swept = _read_json(layout.frontier)
    keys = swept.get("keys") if isinstance(swept, dict) else None
    if not isinstance(keys, dict):
        raise RunDirError(f"{layout.frontier}: not a frontier (expected the JSON of the solutions stage)")
    if not keys:
        report.add("_Skipped: the solutions record no budget key the run's search sums._", "")
        return
    for key, entry in keys.items():
        parent_value, points = entry["parent"], entry["points"]
        rows = [
            [readable_budget(p["budget"]), p["total"], p["objective"], p["on_frontier"]]
            if p["total"] is not None
            else [readable_budget(p["budget"]), None, "infeasible", False]
            for p in points
        ]
        report.add(f"### KL against `{key}`", "")
        report.add(*_table(["budget", key, "predicted KL", "on frontier"], rows))
        if report.figure is None:
            report.plot_note()
            continue
        figure = report.figure(figsize=(6, 4))
        axis = figure.subplots()
        frontier = sorted(
            (p for p in points if p["total"] is not None and p["on_frontier"]), key=lambda p: p["total"]
        )
        axis.plot(
            [p["total"] for p in frontier],
            [p["objective"] for p in frontier],
            "o-",
            color="tab:blue",
            label="Pareto frontier",
        )
        axis.scatter([parent_value], [0.0], marker="*", s=150, color="black", label="parent", zorder=3)
        for name, solution in solutions.items():
            axis.scatter([solution["totals"][key]], [solution["objective"]], marker="D", zorder=3, label=name)
        axis.set_xlabel(key)
        axis.set_ylabel("predicted KL (nats/token)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=SMALL_FONT)
        report.save(figure, f"frontier_{_file_name(key)}.png", f"KL against {key}")


def _block_map(
    report: _Report, parent: ModelSpec, children: dict[str, ModelSpec], solutions: dict[str, Any]
) -> None:
    report.add("## Architecture per block", "")
    if not children:
        report.add("_Skipped: no solutions._", "")
        return
    hidden = parent.hidden_size

    def relative(block: BlockSpec, index: int) -> float:
        own = block_active_params(parent.blocks[index], hidden)
        return block_active_params(block, hidden) / own if own else 1.0

    for name, child in children.items():
        report.add(f"### {name}", "")
        header = ["", *(str(i) for i in range(parent.num_blocks))]
        rows = [
            ["parent", *(b.short_name() for b in parent.blocks)],
            ["child", *(b.short_name() if b != p else "=" for b, p in zip(child.blocks, parent.blocks))],
            ["active params vs parent", *(relative(b, i) for i, b in enumerate(child.blocks))],
        ]
        report.add(*_table(header, rows))
        if not mixes_tokens(child):
            report.add(f"_Note: {name}: {NO_TOKEN_MIXER}._", "")
        if report.figure is None:
            report.plot_note()
            continue
        from matplotlib.colors import to_rgba
        from matplotlib.patches import Patch, Rectangle

        count = parent.num_blocks
        figure = report.figure(figsize=(max(6.5, 0.35 * count + 2.5), 2.6))
        axis = figure.subplots()
        for row, spec in enumerate((parent, child)):
            for index, block in enumerate(spec.blocks):
                size = 1.0 if row == 0 else relative(block, index)
                alpha = 0.25 + 0.75 * min(1.0, max(0.0, size))  # lighter = smaller than the parent's
                colour = to_rgba(KIND_COLOURS.get(block.kind, "black"), alpha)
                axis.add_patch(Rectangle((index, 1 - row), 0.9, 0.9, facecolor=colour, edgecolor="black"))
        axis.set_xlim(-0.1, count)
        axis.set_ylim(-0.1, 2)
        axis.set_yticks([0.45, 1.45], ["child", "parent"])
        axis.set_xticks([i + 0.45 for i in range(count)], [str(i) for i in range(count)], fontsize=SMALL_FONT)
        axis.set_xlabel("block")
        kinds = sorted({b.kind for b in (*parent.blocks, *child.blocks)})
        axis.legend(
            handles=[
                Patch(facecolor=KIND_COLOURS.get(k, "black"), edgecolor="black", label=k) for k in kinds
            ],
            fontsize=SMALL_FONT,
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
        )
        # Two lines, wrapped, so that a long solution name stays inside the figure (tight_layout does not
        # shrink a title).
        title = textwrap.fill(name, 60) + "\nshade: active params relative to the parent's block"
        axis.set_title(title, fontsize=9)
        report.save(figure, f"blocks_{_file_name(name)}.png", f"architecture of {name}")


def _scenario_metrics(layout: RunLayout, hardware: Any) -> list[tuple[str, Callable[[ModelSpec], float]]]:
    """Predicted throughput per scenario of the run config's hardware section (none without one), on the
    run's hardware ("this-machine": its stored calibration, `RunLayout.hardware`); for a scenario with a
    `user_speed`, also the throughput at the largest batch keeping that speed per user."""
    if hardware is None:
        return []
    from puzzle.cost import max_batch_at_speed, model_performance, model_throughput

    device = layout.hardware(hardware.profile)
    metrics = []
    for name, scenario in hardware.scenarios.items():
        # Two speeds that differ by the prefill: the batch's generated tokens over the whole request
        # (the prompt's prefill included: what a search budget on throughput[S] bounds), and one request's
        # decode speed, 1 / decode step (what `puzzle demo` measures and predicts as "decode tok/s").
        metrics += [
            (
                f"throughput {name} (generated tokens/s of the batch, prefill of the "
                f"{scenario.prompt_tokens}-token prompts included, {hardware.profile})",
                lambda spec, scenario=scenario: model_throughput(spec, scenario, device),
            ),
            (
                f"decode speed {name} (tokens/s per request, decode steps only, {hardware.profile})",
                lambda spec, scenario=scenario: (
                    model_performance(spec, scenario, device).per_user_tokens_per_s
                ),
            ),
        ]
    metrics += [
        (
            f"throughput {name} at {scenario.user_speed:g} tokens/s/user (tokens/s, {hardware.profile})",
            lambda spec, scenario=scenario: (
                max_batch_at_speed(
                    spec, scenario, device, memory_fraction=hardware.memory_fraction
                ).throughput
            ),
        )
        for name, scenario in hardware.scenarios.items()
        if scenario.user_speed is not None
    ]
    return metrics


def _hardware(report: _Report, layout: RunLayout) -> Any:
    """The hardware section of the run's saved config (profile, recipe, scenarios); None without one."""
    path = layout.resolved_config
    if not path.is_file():
        return None
    from puzzle.config import ConfigError, load_config

    try:
        return load_config(path, check_paths=False).hardware
    except (ConfigError, OSError) as error:
        report.add(f"_Scenario costs skipped: cannot read {path} ({error})._", "")
        return None


def _costs(
    report: _Report,
    layout: RunLayout,
    parent: ModelSpec,
    children: dict[str, ModelSpec],
    solutions: dict[str, Any],
    hardware: Any,
) -> None:
    report.add("## Costs, parent vs child", "")
    if not children:
        report.add("_Skipped: no solutions._", "")
        return
    metrics: list[tuple[str, Callable[[ModelSpec], float]]] = [
        ("params", model_params),
        ("active params", model_active_params),
        ("weight bytes (bf16)", lambda spec: model_weight_bytes(spec, "bf16")),
        (
            f"KV + SSM state bytes / request ({STATE_CONTEXT} tokens)",
            lambda s: state_bytes_per_request(s, STATE_CONTEXT),
        ),
    ]
    metrics += _scenario_metrics(layout, hardware)
    names = list(children)
    rows = []
    for label, function in metrics:
        base = function(parent)
        rows.append([label, base, *(function(children[n]) for n in names)])
    # Scenario costs the search summed (throughput[S], latency[S]...): the child's predicted value.
    extra = sorted(
        {k for n in names for k in solutions[n]["totals"] if k.partition("[")[0] not in _MODEL_COSTS}
    )
    for key in extra:
        rows.append([f"{key} (predicted)", None, *(solutions[n]["totals"].get(key) for n in names)])
    report.add(*_table(["cost", "parent", *names], rows))
    if report.figure is None:
        report.plot_note()
        return
    figure = report.figure(figsize=(max(7.0, 1.4 * len(metrics) + 1), 4))
    axis = figure.subplots()
    width = 0.8 / (len(names) + 1)
    for column, (label, values) in enumerate(
        [("parent", [1.0] * len(metrics))]
        + [
            (n, [row[2 + i] / row[1] if row[1] else 0.0 for row in rows[: len(metrics)]])
            for i, n in enumerate(names)
        ]
    ):
        axis.bar([m + column * width for m in range(len(metrics))], values, width, label=label)
    axis.set_xticks(
        [m + 0.4 - width / 2 for m in range(len(metrics))],
        # Wrapped: the labels of neighbouring bars must not run into each other.
        [textwrap.fill(label.split(" (")[0], 14) for label, _ in metrics],
        fontsize=SMALL_FONT,
    )
    axis.set_ylabel("relative to the parent")
    axis.legend(fontsize=SMALL_FONT)
    axis.grid(axis="y", alpha=0.3)
    report.save(figure, "costs.png", "costs parent vs child")


def _bld(report: _Report, library: Any) -> None:
    report.add("## BLD losses", "")
    results = sorted(library.results.values(), key=lambda r: (r.variant.block_index, r.variant.id))
    rows = [
        [r.variant.block_index, r.variant.id, r.status, r.kept or "", r.init_nmse, r.final_nmse, r.tokens]
        for r in results
        if r.status not in ("parent",)
    ]
    if not rows:
        report.add("_Skipped: the library holds no trained variant._", "")
        return
    report.add(
        "Held-out normalised MSE of each variant's block output, at initialisation and after BLD (of the weights "
        'kept: the initial ones where training made the variant worse, `kept` "init").',
        "",
    )
    report.add(*_table(["block", "variant", "status", "kept", "nMSE init", "nMSE after", "tokens"], rows))
    failed = [r for r in results if r.status == "failed"]
    if failed:
        report.add("Failed variants:", "")
        report.add(
            *(f"- block {r.variant.block_index} `{r.variant.id}`: {r.reason or 'no reason'}" for r in failed)
        )
        report.add("")
    trained = [
        r for r in results if r.status != "parent" and r.init_nmse is not None and r.final_nmse is not None
    ]
    if report.figure is None:
        report.plot_note()
        return
    if not trained:
        return
    # Horizontal bars: the variants' labels (block: spec) are long, and read level at a legible size.
    figure = report.figure(figsize=(8, max(3.0, 0.32 * len(trained) + 1.2)))
    axis = figure.subplots()
    positions = range(len(trained))
    axis.barh([p - 0.2 for p in positions], [r.init_nmse for r in trained], 0.4, label="init")
    axis.barh([p + 0.2 for p in positions], [r.final_nmse for r in trained], 0.4, label="after BLD")
    axis.set_yticks(
        list(positions),
        [f"{r.variant.block_index}: {r.variant.id}" for r in trained],
        fontsize=SMALL_FONT,
    )
    axis.invert_yaxis()  # block 0 on top, as in the table
    axis.set_xlabel("held-out nMSE")
    if all(v > 0 for r in trained for v in (r.init_nmse, r.final_nmse)):
        axis.set_xscale("log")  # a bad variant's nMSE can be orders of magnitude above the rest
    axis.legend(fontsize=SMALL_FONT)
    report.save(figure, "bld.png", "BLD losses")


def _numeric_series(records: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    series: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key in ("step", "tokens") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            series.setdefault(key, []).append((record.get("step", 0), float(value)))
    return series


def _gkd(report: _Report, layout: RunLayout, names: list[str]) -> None:
    report.add("## Global knowledge distillation", "")
    found = [(n, layout.child(n) / "history.json") for n in names]
    found += [
        (p.parent.name, p)
        for p in sorted((layout.root / CHILDREN_DIR).glob("*/history.json"))
        if p.parent.name not in names and _is_current(p.parent.name, _current(layout))
    ]
    found = [(n, p) for n, p in found if p.is_file()]
    if not found:
        report.add(f"_Skipped: no {CHILDREN_DIR}/NAME/history.json._", "")
        return
    for name, path in found:
        history = _read_json(path)
        evals = history.get("eval", []) if isinstance(history, dict) else []
        train = history.get("train", []) if isinstance(history, dict) else []
        shown = evals if len(evals) <= GKD_EVAL_ROWS else [evals[0], evals[-1]]
        which = "" if shown is evals else " (the first and the last below)"
        kept = history.get("kept_step") if isinstance(history, dict) else None
        kept_note = "" if kept is None else f" The weights kept are step {kept}'s (the lowest held-out KL)."
        if isinstance(history, dict) and history.get("stopped_early_at") is not None:
            kept_note += f" Stopped early at step {history['stopped_early_at']}."
        report.add(
            f"### {name}", "", f"{len(train)} training steps, {len(evals)} evaluations{which}.{kept_note}", ""
        )
        if evals:
            keys = sorted(_numeric_series(evals))
            report.add(
                *_table(["", *keys], [[f"step {e.get('step')}", *(e.get(k) for k in keys)] for e in shown])
            )
        if report.figure is None:
            report.plot_note()
            continue
        figure = report.figure(figsize=(6, 3.5))
        axis = figure.subplots()
        for label, records in (("train", train), ("eval", evals)):
            for key, points in _numeric_series(records).items():
                if key not in _GKD_CURVES[label]:
                    continue
                axis.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    "-" if label == "train" else "o--",
                    label=f"{label} {key}",
                )
        axis.set_xlabel("step")
        if all(
            p[1] > 0
            for label, r in (("train", train), ("eval", evals))
            for key, s in _numeric_series(r).items()
            if key in _GKD_CURVES[label]
            for p in s
        ):
            axis.set_yscale("log")
        axis.legend(fontsize=SMALL_FONT)
        axis.grid(alpha=0.3)
        report.save(figure, f"gkd_{_file_name(name)}.png", f"GKD of {name}")


def _kl_after_gkd(layout: RunLayout, name: str, record: dict[str, Any]) -> Any:
    """Child `name`'s KL to the parent after GKD as the run recorded it: the export record's GKD evaluation
    of the weights kept (`run.distill.kept_eval`, what `puzzle run` exports), else the kept step's
    evaluation in children/NAME/history.json; None when neither is recorded."""
    distill = (record.get("run") or {}).get("distill") if isinstance(record.get("run"), dict) else None
    if isinstance(distill, dict) and isinstance(distill.get("kept_eval"), dict):
        return distill["kept_eval"].get("kl")
    path = layout.child(name) / "history.json"
    if not path.is_file():
        return None
    history = _read_json(path)
    if not isinstance(history, dict):
        return None
    evals = [e for e in history.get("eval") or [] if isinstance(e, dict)]
    kept = history.get("kept_step")
    chosen = [e for e in evals if e.get("step") == kept] if kept is not None else evals[-1:]
    return chosen[0].get("kl") if chosen else None


# What the weights of an export are, from the source its record names (`run.source`).
_EXPORTED = {"distill": "after GKD", "assemble": "before GKD"}


def _measured(report: _Report, layout: RunLayout) -> None:
    report.add("## Measured vs predicted KL", "")
    rows = []
    current = _current(layout)
    for path in sorted((layout.root / EXPORTS_DIR).glob("*/puzzle.json")):
        name = path.parent.name
        if not _is_current(name, current):
            continue
        record = _read_json(path)
        measured = record.get("measured") or {}
        predicted = measured.get("predicted_kl")
        if predicted is None:
            predicted = (record.get("predicted") or {}).get("kl")
        if predicted is None and isinstance(record.get("search"), dict):
            predicted = record["search"].get("objective")
        run = record.get("run") if isinstance(record.get("run"), dict) else {}
        exported = _EXPORTED.get(run.get("source"), "-")
        after = _kl_after_gkd(layout, name, record)
        rows.append([name, predicted, measured.get("kl"), after, exported, measured.get("tokens")])
    if not rows:
        report.add(f"_Skipped: no {EXPORTS_DIR}/NAME/puzzle.json._", "")
        return
    report.add(
        "KL (nats/token) of each exported child to the parent on the run's held-out tokens: predicted by the "
        "search (the sum of its blocks' replace-one-block KL), measured on the assembled child before global "
        "distillation (what the prediction estimates), and after GKD (the evaluation of the weights GKD kept). "
        '"exported weights" says which of the two the export holds (`puzzle run` exports the distilled ones).',
        "",
    )
    report.add(
        *_table(
            [
                "export",
                "predicted KL",
                "measured KL before GKD",
                "measured KL after GKD",
                "exported weights",
                "tokens",
            ],
            rows,
        )
    )
    points = [r for r in rows if isinstance(r[1], (int, float)) and isinstance(r[2], (int, float))]
    if report.figure is None:
        report.plot_note()
        return
    if not points:
        return
    figure = report.figure(figsize=(5, 4.5))
    axis = figure.subplots()
    axis.scatter([p[1] for p in points], [p[2] for p in points], label="before GKD (assembled)")
    distilled = [p for p in points if isinstance(p[3], (int, float))]
    if distilled:
        axis.scatter([p[1] for p in distilled], [p[3] for p in distilled], marker="v", label="after GKD")
    top = max(max(p[1], p[2], p[3] if isinstance(p[3], (int, float)) else 0.0) for p in points) * 1.1 or 1.0
    for name, x, y, *_ in points:  # labels towards the middle, so that none runs off the plot
        right = x > top / 2
        axis.annotate(
            name,
            (x, y),
            xytext=(-5 if right else 5, 5),
            textcoords="offset points",
            ha="right" if right else "left",
            fontsize=SMALL_FONT,
        )
    axis.plot([0, top], [0, top], ":", color="grey")
    axis.set_xlabel("predicted KL (sum of replace-one-block)")
    axis.set_ylabel("measured KL")
    axis.legend(fontsize=SMALL_FONT)
    report.save(figure, "kl_measured.png", "measured vs predicted KL")


def _eval_rows(layout: RunLayout) -> dict[str, list[dict[str, Any]]]:
    """{model: its summary rows (task, metric, value, stderr)} of run.json's finished `eval/{model}` records."""
    if not layout.manifest.is_file():
        return {}
    stages = _read_json(layout.manifest).get("stages") or {}
    found: dict[str, list[dict[str, Any]]] = {}
    for name, record in stages.items():
        if not name.startswith(f"{EVAL_DIR}/") or record.get("status") not in ("done", "reused"):
            continue
        for model, entry in (record.get("outputs") or {}).items():
            if isinstance(entry, dict) and isinstance(entry.get("summary"), list):
                found[model] = entry["summary"]
    return found


def _recorded_kl(layout: RunLayout, solution: str, weights: str) -> Any:
    """The KL to the parent run.json records for a child: measured once assembled (the assemble record), or
    GKD's evaluation of the weights it kept (the distill record); None when not recorded."""
    stages = _read_json(layout.manifest).get("stages") or {}
    stage = "assemble" if weights == "assembled" else "distill"
    for name in (stage, f"{stage}/{solution}"):
        entry = ((stages.get(name) or {}).get("outputs") or {}).get(solution)
        if isinstance(entry, dict):
            figures = entry.get("measured") if stage == "assemble" else entry.get("kept_eval")
            return (figures or {}).get("kl")
    return None


def _accuracy(report: _Report, layout: RunLayout, parent: ModelSpec, children: dict[str, ModelSpec]) -> None:
    evaluated = _eval_rows(layout)
    models: list[tuple[str, str, str, ModelSpec]] = []  # (model, solution, weights, spec)
    if "parent" in evaluated:
        models.append(("parent", "parent", "parent", parent))
    for solution, spec in children.items():
        for weights in ("assembled", "distilled"):
            if f"{solution}.{weights}" in evaluated:
                models.append((f"{solution}.{weights}", solution, weights, spec))
    if not models:  # a run without eval.tasks: no section, as a run without rerank has none
        return
    report.add("## Task accuracy", "")
    metrics = list(dict.fromkeys((r["task"], r["metric"]) for m, *_ in models for r in evaluated[m]))
    kls = {
        m: 0.0 if weights == "parent" else _recorded_kl(layout, solution, weights)
        for m, solution, weights, _ in models
    }
    report.add(
        "lm-evaluation-harness on the run's eval.tasks (eval/MODEL.json holds lm-eval's results): the parent and "
        "each child with the library's weights (assembled, before GKD) and with the weights GKD kept "
        "(distilled), value +- lm-eval's stderr, beside the child's KL (nats/token) to the parent on the "
        "run's held-out tokens.",
        "",
    )
    rows = []
    for model, _, _, spec in models:
        cells: dict[tuple[str, str], str] = {}
        for row in evaluated[model]:
            stderr = row.get("stderr")
            shown = f"{row['value']:.3f}" + (f" +- {stderr:.3f}" if isinstance(stderr, (int, float)) else "")
            cells[(row["task"], row["metric"])] = shown
        rows.append([model, model_active_params(spec), kls[model], *(cells.get(k, "-") for k in metrics)])
    header = ["model", "active params", "KL to the parent", *(f"{t} {m}" for t, m in metrics)]
    report.add(*_table(header, rows))
    if report.figure is None:
        report.plot_note()
        return
    figure = report.figure(figsize=(10, 4))
    accuracy, divergence = figure.subplots(1, 2)
    markers = {"parent": "*", "assembled": "o", "distilled": "v"}
    # A colour per task metric, the right panel's marker per weights, nudged apart so the bars do not overlap.
    nudge = {"parent": 1.0, "assembled": 0.985, "distilled": 1.015}
    for index, (task, metric) in enumerate(metrics):
        labelled = False
        for weights, marker in markers.items():
            points = [
                (model_active_params(spec), row["value"], row.get("stderr") or 0.0)
                for model, _, w, spec in models
                if w == weights
                for row in evaluated[model]
                if (row["task"], row["metric"]) == (task, metric)
            ]
            if points:
                accuracy.errorbar(
                    [p[0] * nudge[weights] for p in points],
                    [p[1] for p in points],
                    yerr=[p[2] for p in points],
                    fmt=marker,
                    color=f"C{index % 10}",
                    capsize=3,
                    label=None if labelled else f"{task} {metric}",
                )
                labelled = True
    accuracy.set_xlabel("active parameters")
    accuracy.set_ylabel("task metric (+- stderr; markers as on the right)")
    accuracy.legend(fontsize=SMALL_FONT)
    accuracy.grid(alpha=0.3)
    for weights, marker in markers.items():
        points = [
            (model_active_params(spec), kls[model])
            for model, _, w, spec in models
            if w == weights and isinstance(kls[model], (int, float))
        ]
        if points:
            divergence.scatter(
                [p[0] for p in points], [p[1] for p in points], marker=marker, color="k", label=weights
            )
    divergence.set_xlabel("active parameters")
    divergence.set_ylabel("KL to the parent (nats/token)")
    divergence.legend(fontsize=SMALL_FONT)
    divergence.grid(alpha=0.3)
    report.save(figure, "accuracy.png", "task accuracy and KL against active parameters")


def _stage_plan(layout: RunLayout, parent: ModelSpec, ranks: int) -> tuple[dict[str, Any], str | None]:
    """{plan stage name: StagePlan} of the run's saved config on `ranks` ranks of its hardware profile (the
    run's calibration for "this-machine"), or ({}, why not)."""
    try:
        from puzzle.config import load_config
        from puzzle.plan import plan_hardware, plan_run

        config = load_config(layout.resolved_config, check_paths=False)
        _, profile = plan_hardware(layout.hardware(config.hardware.profile))
        plan = plan_run(config, parent, ranks, profile)
    except Exception as error:  # a report is still written: the plan is one section of it
        return {}, f"{type(error).__name__}: {error}"
    return {stage.name: stage for stage in plan.stages}, None


def _stage_costs(report: _Report, layout: RunLayout, parent: ModelSpec) -> None:
    """Each stage that ran: its measured wall time and peak memory per rank (run.json's `measured`) beside
    the plan's (`puzzle plan` of the run's config on as many ranks)."""
    path = layout.manifest
    stages = (_read_json(path) or {}).get("stages", {}) if path.is_file() else {}
    measured = {name: record["measured"] for name, record in stages.items() if record.get("measured")}
    if not measured:
        return
    ranks = max(m.get("ranks", 1) for m in measured.values())
    planned, problem = _stage_plan(layout, parent, ranks)
    report.add(
        "## Stages, planned and measured",
        "",
        "Wall time and peak memory per rank of each stage as it last ran (run.json), beside `puzzle plan`'s "
        "for the run's config on the same ranks of its hardware profile. Peak resident memory is the "
        "process's running peak (a later stage's is at least an earlier one's). Tokens/s: the plan's "
        "tokens over the measured time. CPU s: rank 0's CPU time in the stage (on a CPU shared with other "
        "jobs, what one thread would take alone; benchmarks/plan_vs_measured.py compares the plan with it)."
        + (f" _No plan: {problem}._" if problem else ""),
        "",
    )
    rows = []
    for name, m in measured.items():
        stage = planned.get(name.split("/", 1)[0])  # a solution's record: its stage's plan
        seconds = m.get("seconds")
        plan_seconds = None if stage is None else stage.seconds
        ratio = seconds / plan_seconds if seconds and plan_seconds else None
        tokens = None if stage is None or not stage.tokens or not seconds else stage.tokens / seconds
        peak = max(m.get("peak_cuda_mib") or m.get("peak_rss_mib") or [0.0])
        plan_peak = None if stage is None else stage.resident / 2**20
        rows.append([name, seconds, m.get("cpu_seconds"), plan_seconds, ratio, tokens, peak, plan_peak])
    report.add(
        *_table(
            [
                "stage",
                "measured s",
                "CPU s",
                "planned s",
                "measured / planned",
                "tokens/s",
                "peak MiB per rank",
                "planned peak MiB",
            ],
            rows,
        )
    )


def _rounds(report: _Report, layout: RunLayout, out: Path) -> None:
    """Rounds r >= 2 of an iterative run: a report of its own each, in OUT/round-{r}, linked here."""
    number = 2
    lines = []
    while layout.round(number).root.is_dir():
        name = f"round-{number}"
        try:
            write_report(layout.round(number).root, out / name)
            lines.append(f"- [round {number}]({name}/report.md)")
        except RunDirError as error:
            lines.append(f"- round {number}: no report ({error})")
        number += 1
    if lines:
        report.add("## Later rounds", "", *lines, "")


# ------------------------------------------------------------------------------------------------- API


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write the report of the run in `run_dir` to `out_dir` (default RUN_DIR/report); returns report.md.

    The report is built in a staging directory beside `out_dir` and swapped in whole, replacing an earlier
    report (`is_own_report_entry`). RunDirError naming the path when the run has no parent.json or no
    finished library, when `out_dir` is a file, or when it holds anything but an earlier report (the
    user's files: nothing is written) unless `overwrite`, which writes the report's files beside them
    (each replaced atomically; files of the same names are replaced, no other is touched).
    """
    from puzzle.library import read_library  # late: torch

    layout = RunLayout(Path(run_dir))
    library_dir = layout.require_library()
    parent = layout.read_parent()
    library = read_library(library_dir)
    out = (Path(out_dir) if out_dir is not None else layout.report).absolute()
    problem = report_dir_problem(out, overwrite)
    if problem is not None:
        raise RunDirError(problem)
    remove_stale_staging(out)  # what a killed report left beside it
    foreign = foreign_entries(out, own_report_entries(out))
    staging = make_staging_dir(out)
    try:
        _write_into(staging, layout, parent, library)
        if foreign:
            move_files_beside(staging, out)
        else:
            swap_directory_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out / REPORT_FILE


def report_dir_problem(
    out: Path,
    overwrite: bool = False,
    remedy: str = "choose a new or empty directory, or overwrite (--overwrite) to write the report's files "
    "beside them",
) -> str | None:
    """Why a report cannot be written into `out`, or None: it is a file or lies where nothing can be
    created (`puzzle.files.path_problem`), or it holds anything but an earlier report and not `overwrite`
    (`remedy`: what the user can do then). Checked by `write_report` and, before any stage runs, by `puzzle demo` for DIR/report."""
    problem = path_problem(out, "report directory")
    if problem is not None:
        return problem
    foreign = foreign_entries(out, own_report_entries(out))
    if foreign and not overwrite:
        return f"{refusal_to_overwrite(out, foreign, 'an earlier report')}; {remedy} (nothing was written)"
    return None


def is_earlier_report(path: Path) -> bool:
    """Whether `path` is a report.md this module wrote: it carries REPORT_MARKER, or (a report written
    before the marker) starts with the report's title."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return False  # unreadable: never ours to replace
    return REPORT_MARKER in text or text.startswith(REPORT_TITLE)


def own_report_entries(out: Path) -> Callable[[Path], bool]:
    """The entries of `out` a report may replace (`puzzle.files.foreign_entries`): all of an earlier
    report's (report.md, its PNGs and later rounds' folders) when `out` holds one, none otherwise."""
    earlier = (out / REPORT_FILE).is_file() and is_earlier_report(out / REPORT_FILE)

    def own(entry: Path) -> bool:
        if not earlier or entry.is_symlink():
            return False
        if entry.is_dir():
            return re.fullmatch(r"round-\d+", entry.name) is not None
        return entry.name == REPORT_FILE or entry.suffix == ".png"

    return own


def _write_into(out: Path, layout: RunLayout, parent: ModelSpec, library: Any) -> None:
    """The report's files, written into the (new, empty) directory `out`."""
    report = _Report(out)
    report.add(REPORT_MARKER, f"{REPORT_TITLE}{layout.root.name}", "")
    report.add(
        f"Parent: {parent.num_blocks} blocks, hidden size {parent.hidden_size}, "
        f"{_format(model_params(parent))} parameters ({_format(model_active_params(parent))} active).",
        "",
    )
    if report.figure is None:
        report.add(f"_Tables only: {PLOT_HINT}._", "")
    solutions = _solutions(layout)
    children = {name: _child_spec(parent, library, solution) for name, solution in solutions.items()}
    if solutions:
        rows = [[n, s.get("objective"), s.get("status"), s.get("solver")] for n, s in solutions.items()]
        report.add("## Solutions", "", *_table(["name", "predicted KL", "status", "solver"], rows))
    _context(report, layout)
    _reranking(report, layout)
    hardware = _hardware(report, layout)
    _frontier(report, layout, solutions)
    _block_map(report, parent, children, solutions)
    _costs(report, layout, parent, children, solutions, hardware)
    _bld(report, library)
    _gkd(report, layout, list(solutions))
    _measured(report, layout)
    _accuracy(report, layout, parent, children)
    _stage_costs(report, layout, parent)
    _rounds(report, layout, out)
    atomic_write_bytes(out / REPORT_FILE, "\n".join(report.lines).encode())
