"""Search a run directory: its library (BLD), its scores (replace-one-block) and the cost model make the table.

    from puzzle.problem import CostModel, parse_scenario, search_run
    chat = parse_scenario("chat:batch=8,prompt=1024,generated=256")
    solution = search_run("run", ["active_params<=0.6x", "throughput[chat]>=1.6x"],
                          cost_model=CostModel("h100-80gb", scenarios={"chat": chat}))

Only files are read (`RunLayout`: parent.json, library/library.json, scores/scores.json): nothing is trained,
scored or written (but for `search_run` on "this-machine": the run's calibration, hardware.json, stored
once when absent, `RunLayout.hardware`). Block i's candidates are the parent's block (first, as `deployment_problem` wants) and
every library variant of block i; a variant that BLD or scoring recorded as failed is left out (a note
says which). Costs come from each variant's spec through `puzzle.search.budget.deployment_problem`, so
totals equal the cost model's whole-model figures (`puzzle costs`) for every architecture.

Objectives (`METRICS`), each minimised and summed over blocks, 0 for the parent's own block: `kl`
(default), `lm_loss_delta`, `hidden_nmse`, and for agreements the disagreement `top1` = 1 - top-1
agreement, `top5` = 1 - top-5 agreement (a sum of disagreements keeps "0 = the parent" and makes the
reported gap relative to the damage rather than to the number of blocks).

Budgets (one row each in `puzzle.search.budget.BUDGET_ROWS`, read by `puzzle.search.budget.parse_budget`, whose
objects `run_problem` also takes; `0.6x` = 0.6 x the parent's value):
params, active_params, weight_bytes (in `CostModel.recipe`) <= V; memory_bytes[S] <= V (weights + batch x
state at S's prompt + generated tokens); concurrent_requests[S] >= N (N requests of S's context fit in
memory_fraction x the hardware's memory); throughput[S] >= V (output tokens/s of S's batch, roofline on
the hardware); latency[S] <= V and ttft[S] <= V (seconds); user_speed[S] >= V (decode tokens/s per user at
S's batch); throughput_at_speed[S] >= V (tokens/s at the largest batch keeping S's user_speed; linearised
at a fixed batch, see `puzzle.search.budget`). `[chat,long]` names several scenarios: the bound holds in each.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from puzzle.cost.serving import CostModel, parse_scenario
from puzzle.layout import RunDirError, RunLayout
from puzzle.search.budget import Budget, DeploymentLimit, DeploymentProblem, deployment_problem, parse_budget
from puzzle.search.exact import search
from puzzle.search.frontier import sweep
from puzzle.search.kinds import search_attributes
from puzzle.search.types import Rules, SearchError, Solution, SolverOptions, Table
from puzzle.spec import BlockSpec, ModelSpec

_log = logging.getLogger(__name__)

__all__ = [
    "METRICS",
    "CostModel",
    "DeploymentLimit",
    "RunCandidates",
    "RunProblem",
    "SWEEP_FRACTIONS",
    "frontier_budgets",
    "frontier_sweep",
    "parse_budget",
    "parse_scenario",
    "run_candidates",
    "run_problem",
    "search_run",
]

METRICS: dict[str, str] = {
    "kl": "mean KL(parent || child), nats/token",
    "lm_loss_delta": "child minus parent LM loss, nats/token",
    "top1": "1 - top-1 agreement with the parent",
    "top5": "1 - top-5 agreement (the parent's top token among the child's 5)",
    "hidden_nmse": "normalised MSE of the final hidden state",
}
_AGREEMENTS = ("top1", "top5")
_REPORTED = ("params", "active_params", "weight_bytes")  # columns of every run's table, bounded or not


@dataclass
class RunCandidates:
    """Per parent block: its candidate specs (the parent's first) and their objective values."""

    parent: ModelSpec
    variants: list[list[BlockSpec]]
    scores: list[list[float]]
    notes: list[str] = field(default_factory=list)  # variants left out, and why


def objective_damage(metric: str, record: Any) -> float | None:
    value = getattr(record, metric)
    if value is None:
        return None
    return 1.0 - value if metric in _AGREEMENTS else float(value)


def run_candidates(
    layout: RunLayout, objective: str = "kl", parent: ModelSpec | None = None
) -> RunCandidates:
    """Read the run's library and scores (and parent.json unless `parent` is given) into candidates."""
    if objective not in METRICS:
        raise SearchError(f"unknown objective {objective!r}; recorded metrics: {', '.join(METRICS)}")
    from puzzle.library import read_library  # late: torch, which a library-file search never needs
    from puzzle.scores import SCORES_FILE, load_scores

    parent = parent if parent is not None else layout.read_parent()
    library = read_library(layout.require_library())
    scores_dir = layout.require_scores()
    try:
        scores = load_scores(scores_dir)
    except (KeyError, TypeError) as error:
        raise RunDirError(f"{scores_dir / SCORES_FILE}: malformed scores ({error!r})") from None
    scored_parent = scores.inputs.get("parent")
    if scored_parent is not None and scored_parent != library.parent:
        raise RunDirError(
            f"{scores_dir} scores another parent than {layout.library} was built from "
            f"(parent fingerprints {scored_parent[:12]} and {library.parent[:12]}): rescore the library"
        )
    count = parent.num_blocks
    variants: list[list[BlockSpec]] = [[block] for block in parent.blocks]
    values: list[list[float]] = [[0.0] for _ in parent.blocks]
    notes: list[str] = []
    for variant, result in library.results.items():
        where = f"block {variant.block_index} variant {variant.id}"
        if variant.block_index >= count:
            raise RunDirError(f"{layout.library}: {where}, but the parent has {count} blocks")
        own = variant.spec == parent.blocks[variant.block_index]
        if own != (result.status == "parent"):  # BLD marks exactly the parent's own blocks "parent"
            raise RunDirError(
                f"{layout.library} was built from another parent: BLD recorded {where} as "
                f"{result.status!r}, but this parent's block {variant.block_index} is "
                f"{parent.blocks[variant.block_index].short_name()}"
            )
        if result.status == "failed":
            notes.append(f"{where} left out: BLD failed ({result.reason or 'no reason recorded'})")
            continue
        record = scores.variants.get(variant)
        if record is None:
            if own:  # the parent's own block: 0 by definition
                continue
            raise RunDirError(
                f"{scores_dir / SCORES_FILE} has no score for {where} of the library: score the whole "
                f"library (puzzle.score.score_variants) into {scores_dir}"
            )
        if record.failed is not None:
            notes.append(f"{where} left out: scoring failed ({record.failed})")
            continue
        value = objective_damage(objective, record)
        if value is None:
            raise RunDirError(f"{scores_dir / SCORES_FILE}: {where} has no {objective} score")
        if own:
            values[variant.block_index][0] = value
        else:
            variants[variant.block_index].append(variant.spec)
            values[variant.block_index].append(value)
    return RunCandidates(parent, variants, values, notes)


@dataclass
class RunProblem:
    """The search problem of a run: table, limits and rules, which --budget each limit comes from, and notes."""

    problem: DeploymentProblem
    sources: dict[str, str]  # str(limit) -> the budget text it was made from
    notes: list[str]
    candidates: RunCandidates

    @property
    def table(self) -> Table:
        return self.problem.table


def servable(
    candidates: RunCandidates, engines: Iterable[str]
) -> tuple[RunCandidates, Callable[[BlockSpec], dict[str, Any]], tuple[str, ...]]:
    """Candidates held to what every engine of `engines` serves: (the candidates without the variants an
    engine refuses in their block, whatever the other blocks are, each left out with a note; the rules'
    attributes of a variant; the attributes held to one value, the parts of a block an engine reads from
    its globals). A search under those rules returns only children the engines' checks accept
    (`puzzle.nemotron_h.engines.engine_problems`). A parent block an engine refuses is a SearchError: the
    parent's block is every block's first candidate."""
    from puzzle.nemotron_h.engines import VariantCheck, check_engines, engine_attributes  # late: the replays

    engines = check_engines(engines)
    check = VariantCheck(candidates.parent, engines)
    variants: list[list[BlockSpec]] = []
    scores: list[list[float]] = []
    notes = list(candidates.notes)
    names: dict[str, None] = {}
    for index, (block_variants, block_scores) in enumerate(zip(candidates.variants, candidates.scores)):
        own = check.problems(index, block_variants[0])
        if own:
            raise SearchError(
                f"search.engines {list(engines)}: the parent's block {index} ({block_variants[0].short_name()}) "
                f"is not served: {'; '.join(own)}"
            )
        kept = [
            (spec, score)
            for spec, score in zip(block_variants, block_scores)
            if not check.problems(index, spec)
        ]
        for spec in block_variants:
            problems = check.problems(index, spec)
            if problems:
                notes.append(f"block {index} variant {spec.short_name()} left out: {'; '.join(problems)}")
        variants.append([spec for spec, _ in kept])
        scores.append([score for _, score in kept])
        for spec, _ in kept:
            names.update(dict.fromkeys(engine_attributes(spec, engines)))

    def attributes(spec: BlockSpec) -> dict[str, Any]:
        return {**search_attributes(spec), **engine_attributes(spec, engines)}

    return RunCandidates(candidates.parent, variants, scores, notes), attributes, tuple(names)


def run_problem(
    run_dir: str | Path | RunLayout,
    budgets: Iterable[str | DeploymentLimit] = (),
    *,
    objective: str = "kl",
    cost_model: CostModel | None = None,
    keep_blocks: Iterable[int | str] = (),
    same_attributes: Iterable[str] = (),
    shared_state_size: bool = True,
    parent: ModelSpec | None = None,
    candidates: RunCandidates | None = None,
    engines: Iterable[str] = (),
) -> RunProblem:
    """The search problem of the run in `run_dir` under `budgets` (texts as `parse_budget` reads them).

    `keep_blocks`: block indices (or `block_{i}` names) held at the parent's block; `same_attributes`:
    `state_size`, `top_k` or `kind` held to one value over the chosen variants that have it;
    `shared_state_size` (on, as serving engines need): one SSM state size for every Mamba block;
    `parent`: the parent's spec, when it is not the run's parent.json; `candidates`: the table's candidates
    instead of the run's library and scores (nothing is then read from `run_dir`). `engines` (names in
    `puzzle.nemotron_h.engines.ENGINES`): only children every one of them serves (`servable`).
    """
    cost_model = cost_model or CostModel()
    layout = run_dir if isinstance(run_dir, RunLayout) else RunLayout(Path(run_dir))
    if candidates is None:
        candidates = run_candidates(layout, objective, parent)
    same_attributes = tuple(same_attributes)
    allowed = {"state_size", "top_k", "kind"}
    unknown = sorted(set(same_attributes) - allowed)
    if unknown:
        raise SearchError(f"cannot hold {unknown} to one value: a run's variants have {sorted(allowed)}")
    attributes = None
    if engines:
        candidates, attributes, engine_rules = servable(candidates, engines)
        same_attributes += engine_rules
    rules = Rules(
        shared_state_size=shared_state_size,
        same_attributes=same_attributes,
        keep_blocks=tuple(int(b) if isinstance(b, str) and b.isdigit() else b for b in keep_blocks),
    )
    budget = Budget.parse(budgets, cost_model, rules)  # the one budget value; texts read once here
    # Parameters and weight bytes are always reported (columns without a bound); then each budget's terms.
    problem = deployment_problem(
        candidates.parent,
        candidates.variants,
        candidates.scores,
        budget,
        reported=_REPORTED,
        objective_name=objective,
        attributes=attributes,
    )
    sources = problem.sources
    return RunProblem(problem, sources, candidates.notes, candidates)


def search_run(
    run_dir: str | Path | RunLayout,
    budgets: Iterable[str | DeploymentLimit] = (),
    *,
    objective: str = "kl",
    cost_model: CostModel | None = None,
    keep_blocks: Iterable[int | str] = (),
    same_attributes: Iterable[str] = (),
    shared_state_size: bool = True,
    parent: ModelSpec | None = None,
    options: SolverOptions | None = None,
    note: Callable[[str], None] | None = None,
    engines: Iterable[str] = (),
) -> Solution:
    """The best architecture of the run in `run_dir` under `budgets` (see `run_problem` for the rest).

    Variants left out (failed in BLD or scoring) are reported through `note` (default: a logging warning).
    Raises InfeasibleError (naming the budget that cannot be met) as `puzzle.search.search` does.
    "this-machine" is the run's stored calibration (`RunLayout.hardware`), as `puzzle search RUN_DIR` prices.
    """
    layout = run_dir if isinstance(run_dir, RunLayout) else RunLayout(Path(run_dir))
    cost_model = cost_model or CostModel()
    cost_model = dataclasses.replace(cost_model, profile=layout.hardware(cost_model.profile))
    problem = run_problem(
        layout,
        budgets,
        objective=objective,
        cost_model=cost_model,
        keep_blocks=keep_blocks,
        same_attributes=same_attributes,
        shared_state_size=shared_state_size,
        parent=parent,
        engines=engines,
    )
    for text in problem.notes:
        (note or _log.warning)(text)
    return search(problem.table, problem.problem.limits, problem.problem.rules, options)


# The fractions of the parent's value a run's frontier sweeps at (`frontier_sweep`).
SWEEP_FRACTIONS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def frontier_budgets(cost_model: CostModel) -> list[DeploymentLimit]:
    """Budgets that bound nothing (1x the parent) but make the table sum each scenario's latency, TTFT and
    memory, so that a frontier can be swept against them."""
    return [
        parse_budget(f"{key}[{name}]<=1x", cost_model)
        for name in cost_model.scenarios
        for key in ("latency", "ttft", "memory_bytes")
    ]


def frontier_sweep(
    problem: RunProblem, solutions: Mapping[str, Mapping[str, Any]], options: SolverOptions | None = None
) -> dict[str, Any]:
    """The Pareto frontier of `problem` against every budget key that all `solutions` (name -> saved
    solution JSON) total and the table sums: per key, the parent's value and one solve per fraction of it
    (`SWEEP_FRACTIONS`, plus each solution's own fraction, so that the curve reaches the tightest budget),
    under the problem's rules and no other bound. JSON-ready; `puzzle report` draws it without solving.
    """
    table = problem.table
    totals = [set(solution["totals"]) for solution in solutions.values()]
    keys = sorted(key for key in set.intersection(*totals) if key in table.costs) if totals else []
    starts = table.offsets[:-1]
    swept: dict[str, Any] = {}
    for key in keys:
        parent_value = float(table.costs[key][starts].sum() + table.fixed.get(key, 0.0))
        own = {s["totals"][key] / parent_value for s in solutions.values() if parent_value > 0}
        fractions = sorted(set(SWEEP_FRACTIONS) | {f for f in own if 0 < f < 1})
        values = [parent_value * fraction for fraction in fractions]
        points = sweep(table, [], key, "upper", values, problem.problem.rules, options)
        swept[key] = {
            "parent": parent_value,
            "points": [
                {
                    "budget": str(point.limit),
                    "total": point.solution.totals[key] if point.solution else None,
                    "objective": point.solution.objective if point.solution else None,
                    "on_frontier": point.on_frontier,
                }
                for point in points
            ],
        }
    return {"objective": problem.table.objective_name, "keys": swept}


def rerank_by_measurement(
    name: str, found: list[dict[str, Any]], measure: Callable[[dict[str, Any]], Mapping[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`found` (the MIP's candidates as solution JSONs, best predicted first) ordered by the KL to the
    parent that `measure(candidate)` returns for each (`puzzle.assemble.measured_kl`'s record: "kl",
    "predicted_kl", "lm_loss_delta", "top1"; ties keep the MIP's order), and the record of the choice:
    {"chosen": the winner's MIP rank (1 = the MIP's best), "candidates": [{"candidate", "objective",
    "predicted_kl", "measured_kl", "lm_loss_delta", "top1", "choices"}, ...] in MIP order}."""
    candidates = []
    for index, payload in enumerate(found):
        measured = measure(payload)
        candidates.append(
            {
                "candidate": index + 1,
                "objective": payload["objective"],
                "predicted_kl": measured["predicted_kl"],
                "measured_kl": measured["kl"],
                "lm_loss_delta": measured["lm_loss_delta"],
                "top1": measured["top1"],
                "choices": payload["choices"],
            }
        )
        _log.info(
            "search %s: candidate %d, predicted KL %s, measured KL %.6g",
            name,
            index + 1,
            measured["predicted_kl"],
            measured["kl"],
        )
    order = sorted(range(len(found)), key=lambda i: (candidates[i]["measured_kl"], i))
    _log.info("search %s: re-ranking chose candidate %d of %d", name, order[0] + 1, len(found))
    return [found[i] for i in order], {"chosen": order[0] + 1, "candidates": candidates}
