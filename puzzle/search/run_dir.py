"""Search a run directory: its library (BLD), its scores (replace-one-block) and the cost model make the table.

    from puzzle.search.run_dir import CostModel, parse_scenario, search_run
    chat = parse_scenario("chat:batch=8,prompt=1024,generated=256")
    solution = search_run("run", ["active_params<=0.6x", "throughput[chat]>=1.6x"],
                          cost_model=CostModel(hardware="h100-80gb", scenarios={"chat": chat}))

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

Budgets (`BUDGET_KEYS`), in the syntax of `puzzle.search.limits` (`0.6x` = 0.6 x the parent's value):
params, active_params, weight_bytes (in `CostModel.recipe`) <= V; memory_bytes[S] <= V (weights + batch x
state at S's prompt + generated tokens); concurrent_requests[S] >= N (N requests of S's context fit in
memory_fraction x the hardware's memory); throughput[S] >= V (output tokens/s of S's batch, roofline on
the hardware); latency[S] <= V and ttft[S] <= V (seconds). `[chat,long]` names several scenarios: the
bound holds in each.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from puzzle.cost import HardwareProfile, Scenario
from puzzle.layout import RunDirError, RunLayout
from puzzle.search.budget import Budget, DeploymentProblem, ScenarioTarget, deployment_problem
from puzzle.search.exact import search
from puzzle.search.limits import BudgetError, Limit, Relative, parse_limit, parse_value
from puzzle.search.types import Rules, SearchError, Solution, SolverOptions, Table
from puzzle.spec import BlockSpec, ModelSpec, SpecError

_log = logging.getLogger(__name__)

METRICS: dict[str, str] = {
    "kl": "mean KL(parent || child), nats/token",
    "lm_loss_delta": "child minus parent LM loss, nats/token",
    "top1": "1 - top-1 agreement with the parent",
    "top5": "1 - top-5 agreement (the parent's top token among the child's 5)",
    "hidden_nmse": "normalised MSE of the final hidden state",
}
_AGREEMENTS = ("top1", "top5")

# key -> (the bound it takes, whether it names scenarios, what it bounds)
BUDGET_KEYS: dict[str, tuple[str, bool, str]] = {
    "params": ("<=", False, "total parameters"),
    "active_params": ("<=", False, "parameters used per token"),
    "weight_bytes": ("<=", False, "weight bytes in the recipe"),
    "memory_bytes": ("<=", True, "weights + the batch's KV cache and recurrent state, bytes"),
    "concurrent_requests": (">=", True, "requests of the scenario's context that fit in memory"),
    "throughput": (">=", True, "output tokens/s of the scenario's batch"),
    "latency": ("<=", True, "seconds for the scenario's batch (prefill + generation)"),
    "ttft": ("<=", True, "seconds to the first token (the batch's prefill)"),
}
_KEY = re.compile(r"(\w+)(?:\[([^\[\]]*)\])?")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")

# --scenario fields: short name -> Scenario field; the first three are required.
SCENARIO_FIELDS: dict[str, str] = {
    "batch": "batch_size",
    "prompt": "prompt_tokens",
    "generated": "generated_tokens",
    "recipe": "recipe",
    "kv_dtype": "kv_dtype",
    "ssm_dtype": "ssm_dtype",
    "conv_dtype": "conv_dtype",
    "activation_dtype": "activation_dtype",
    "compute_dtype": "compute_dtype",
}
SCENARIO_SYNTAX = "NAME:batch=B,prompt=P,generated=G[,recipe=R,kv_dtype=D,...]"


def parse_scenario(text: str, defaults: Mapping[str, str] | None = None) -> Scenario:
    """`'chat:batch=8,prompt=1k,generated=256'` -> Scenario(8, 1000, 256, name='chat').

    Counts take the budget syntax's suffixes (1k = 1000); `defaults` fills the dtype fields not given
    (recipe, kv_dtype, ssm_dtype... as `puzzle costs` names them). BudgetError naming the text otherwise.
    """
    name, separator, body = text.partition(":")
    name = name.strip()
    if not separator or not _NAME.fullmatch(name):
        raise BudgetError(f"cannot read scenario {text!r}: expected {SCENARIO_SYNTAX}")
    values: dict[str, Any] = dict(defaults or {})
    for item in body.split(","):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or key not in SCENARIO_FIELDS or not value:
            raise BudgetError(
                f"scenario {name!r}: cannot read {item.strip()!r}; expected KEY=VALUE with KEY one of "
                f"{', '.join(SCENARIO_FIELDS)} ({SCENARIO_SYNTAX})"
            )
        field_name = SCENARIO_FIELDS[key]
        if field_name.endswith("_tokens") or field_name == "batch_size":
            number = parse_value(value)
            if isinstance(number, Relative) or not float(number).is_integer() or number < 1:
                raise BudgetError(f"scenario {name!r}: {key} must be a whole number >= 1, found {value!r}")
            values[field_name] = int(number)
        else:
            values[field_name] = value
    missing = [key for key in ("batch", "prompt", "generated") if SCENARIO_FIELDS[key] not in values]
    if missing:
        raise BudgetError(f"scenario {name!r} needs {', '.join(missing)} ({SCENARIO_SYNTAX})")
    try:
        return Scenario(**values, name=name)
    except SpecError as error:
        raise BudgetError(f"scenario {name!r}: {error}") from None


@dataclass(frozen=True)
class CostModel:
    """How costs are counted: the hardware that times scenarios and holds concurrent requests (a name or a
    profile, as `get_hardware` takes it), the weight recipe of `weight_bytes`, the usable share of memory,
    and the scenarios budgets may name."""

    hardware: str | HardwareProfile = "h100-80gb"
    recipe: str = "bf16"
    memory_fraction: float = 0.9
    scenarios: Mapping[str, Scenario] = field(default_factory=dict)


@dataclass(frozen=True)
class DeploymentLimit:
    """One budget as written (`throughput[chat,long]>=1.5x`): its key, the scenarios it names, its bound."""

    text: str
    key: str
    scenarios: tuple[str, ...]
    value: float | Relative


def parse_budget(text: str, cost_model: CostModel | None = None) -> DeploymentLimit:
    """Read one budget; BudgetError naming the text, the known keys and scenarios otherwise."""
    scenarios = (cost_model or CostModel()).scenarios
    limit = parse_limit(text)
    match = _KEY.fullmatch(limit.key)
    known = ", ".join(f"{key}[S]" if named else key for key, (_, named, _) in BUDGET_KEYS.items())
    if match is None or match.group(1) not in BUDGET_KEYS:
        raise BudgetError(f"budget {text!r}: unknown key {limit.key!r}; known keys: {known}")
    key, listed = match.group(1), match.group(2)
    side, named, _ = BUDGET_KEYS[key]
    if named and not listed:
        raise BudgetError(f"budget {text!r}: {key} needs scenarios, e.g. {key}[chat] or {key}[chat,long]")
    if not named and listed is not None:
        raise BudgetError(f"budget {text!r}: {key} takes no scenario (write {key}{side}VALUE)")
    names = tuple(name.strip() for name in listed.split(",")) if listed else ()
    for name in names:
        if name not in scenarios:
            defined = ", ".join(sorted(scenarios)) or "none"
            raise BudgetError(
                f"budget {text!r} names scenario {name!r}, which is not defined (defined: {defined}); "
                f"define it with --scenario {name or 'NAME'}:batch=B,prompt=P,generated=G"
            )
    if len(set(names)) != len(names):
        raise BudgetError(f"budget {text!r} names a scenario twice")
    value = limit.upper if side == "<=" else limit.lower
    other = limit.lower if side == "<=" else limit.upper
    if value is None or other is not None:
        raise BudgetError(f"budget {text!r}: {key} takes a bound {key}{side}VALUE only")
    if key == "concurrent_requests" and (isinstance(value, Relative) or not float(value).is_integer()):
        raise BudgetError(
            f"budget {text!r}: concurrent_requests needs a whole number of requests (not a factor)"
        )
    if not isinstance(value, Relative) and value <= 0:
        raise BudgetError(f"budget {text!r}: the bound must be positive")
    return DeploymentLimit(text, key, names, value)


def _budgets(limit: DeploymentLimit, cost_model: CostModel) -> list[Budget]:
    """One `Budget` per scenario the limit names (one in all for a scenario-free key)."""
    hardware, value = cost_model.hardware, limit.value
    if limit.key in ("params", "active_params"):
        return [Budget(**{limit.key: value})]
    if limit.key == "weight_bytes":
        return [Budget(weight_bytes=value, recipe=cost_model.recipe)]
    budgets = []
    for name in limit.scenarios:
        scenario = cost_model.scenarios[name]
        if limit.key == "memory_bytes":
            budgets.append(Budget(memory_bytes=value, memory_scenario=scenario))
        elif limit.key == "concurrent_requests":
            budgets.append(
                Budget(
                    min_concurrent_requests=int(value),
                    concurrency_scenario=scenario,
                    hardware=hardware,
                    memory_fraction=cost_model.memory_fraction,
                )
            )
        else:
            target_field = {
                "throughput": "min_tokens_per_s",
                "latency": "max_latency_s",
                "ttft": "max_ttft_s",
            }
            target = ScenarioTarget(scenario, **{target_field[limit.key]: value})
            budgets.append(Budget(hardware=hardware, scenarios=(target,)))
    return budgets


@dataclass
class RunCandidates:
    """Per parent block: its candidate specs (the parent's first) and their objective values."""

    parent: ModelSpec
    variants: list[list[BlockSpec]]
    scores: list[list[float]]
    notes: list[str] = field(default_factory=list)  # variants left out, and why


def _damage(metric: str, record: Any) -> float | None:
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
    from puzzle.score import SCORES_FILE, load_scores

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
        value = _damage(objective, record)
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


def _merged(problems: Sequence[DeploymentProblem], objective: str) -> Table:
    """One table with every problem's cost columns (the blocks, variants and scores are the same in all)."""
    first = problems[0].table
    costs: dict[str, Any] = {}
    fixed: dict[str, float] = {}
    for problem in problems:
        costs.update(problem.table.costs)
        fixed.update(problem.table.fixed)
    return Table(
        block_names=first.block_names,
        variant_names=first.variant_names,
        score=first.score,
        costs=costs,
        attrs=first.attrs,
        fixed=fixed,
        maximize=False,
        objective_name=objective,
    )


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
) -> RunProblem:
    """The search problem of the run in `run_dir` under `budgets` (texts as `parse_budget` reads them).

    `keep_blocks`: block indices (or `block_{i}` names) held at the parent's block; `same_attributes`:
    `state_size`, `top_k` or `kind` held to one value over the chosen variants that have it;
    `shared_state_size` (on, as serving engines need): one SSM state size for every Mamba block;
    `parent`: the parent's spec, when it is not the run's parent.json; `candidates`: the table's candidates
    instead of the run's library and scores (nothing is then read from `run_dir`).
    """
    cost_model = cost_model or CostModel()
    layout = run_dir if isinstance(run_dir, RunLayout) else RunLayout(Path(run_dir))
    limits = [b if isinstance(b, DeploymentLimit) else parse_budget(b, cost_model) for b in budgets]
    if candidates is None:
        candidates = run_candidates(layout, objective, parent)
    rules = Rules(
        shared_state_size=shared_state_size,
        same_attributes=tuple(same_attributes),
        keep_blocks=tuple(int(b) if isinstance(b, str) and b.isdigit() else b for b in keep_blocks),
    )
    allowed = {"state_size", "top_k", "kind"}
    unknown = sorted(set(rules.same_attributes) - allowed)
    if unknown:
        raise SearchError(f"cannot hold {unknown} to one value: a run's variants have {sorted(allowed)}")

    def build(budget: Budget) -> DeploymentProblem:
        return deployment_problem(candidates.parent, candidates.variants, candidates.scores, budget)

    # Parameters and weight bytes are always reported; their limits only where a budget asks.
    problems = [
        build(
            Budget(
                params=Relative(1),
                active_params=Relative(1),
                weight_bytes=Relative(1),
                recipe=cost_model.recipe,
            )
        )
    ]
    all_limits: list[Limit] = []
    sources: dict[str, str] = {}
    for limit in limits:
        for budget in _budgets(limit, cost_model):
            problem = build(budget)
            problems.append(problem)
            for made in problem.limits:
                all_limits.append(made)
                sources[str(made)] = limit.text
    table = _merged(problems, objective)
    problem = DeploymentProblem(table, all_limits, rules)
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
) -> Solution:
    """The best architecture of the run in `run_dir` under `budgets` (see `run_problem` for the rest).

    Variants left out (failed in BLD or scoring) are reported through `note` (default: a logging warning).
    Raises InfeasibleError (naming the budget that cannot be met) as `puzzle.search.search` does.
    "this-machine" is the run's stored calibration (`RunLayout.hardware`), as `puzzle search RUN_DIR` prices.
    """
    layout = run_dir if isinstance(run_dir, RunLayout) else RunLayout(Path(run_dir))
    cost_model = cost_model or CostModel()
    cost_model = dataclasses.replace(cost_model, hardware=layout.hardware(cost_model.hardware))
    problem = run_problem(
        layout,
        budgets,
        objective=objective,
        cost_model=cost_model,
        keep_blocks=keep_blocks,
        same_attributes=same_attributes,
        shared_state_size=shared_state_size,
        parent=parent,
    )
    for text in problem.notes:
        (note or _log.warning)(text)
    return search(problem.table, problem.problem.limits, problem.problem.rules, options)
