"""Budgets in deployment terms: one grammar, one row per key, turned into linear sums over blocks by the cost
model (`puzzle.cost`).

A budget is written `KEY<=V` or `KEY>=V`, `KEY[S]` for a key measured at scenario S (`[chat,long]` = the
bound holds in each), V absolute or a factor of the parent (`0.6x`). `parse_budget` reads it once into a
`DeploymentLimit`; the config, `puzzle search RUN_DIR`, the run's solutions stage and the report all use
that parser and hand on its objects. Each key is one row of `BUDGET_ROWS`: its side, whether it takes
scenarios, its cost per block (from the block's spec), the whole parent's value (the fixed part is that
minus the parent's blocks, so totals equal the cost model's whole-model figures), its cost column's name
and the bound on that column. `priced_table` loops over the rows; it makes one column and one `Limit`
per (budget, scenario):

- total / active parameters and weight bytes in the cost model's recipe: block sums plus embeddings;
- memory at a scenario: weights + batch x (KV cache at the scenario's full context + recurrent state);
- at least R concurrent requests of a scenario's context on the hardware: weights + R x per-request
  state <= memory_fraction x capacity (floor(free / per_request) >= R is exactly that, R being an
  integer), weights and state in the scenario's recipe and dtypes as `puzzle costs` counts them;
- throughput per scenario: batch x generated / (prefill + generated x decode step) >= T is
  prefill + generated x step <= batch x generated / T, a sum of block latencies plus embeddings/lm_head;
- latency per scenario (the batch's prefill + generation) and time to first token (the prefill);
- per-user decode speed at a scenario's batch: 1 / decode step >= V is decode step <= 1/V, a sum;
- throughput at the scenario's per-user speed (`speed=` in the scenario): the largest batch meeting the speed
  is not a sum over blocks, so the key is linearised at a fixed batch b: b = ceil(T / T_parent x b_parent),
  the parent's largest batch at that speed scaled by the wanted throughput over the parent's. The child
  must then carry b requests at the speed (decode step at b <= 1/speed), hold them (b requests' state
  beside the weights fit), and give T at b (throughput at b >= T): three sums, which `priced_table` makes
  from three rows (`expand`). Together they imply the child's largest batch at the speed is >= b and
  its throughput there >= T (throughput grows with the batch); they are sufficient, not necessary (a
  child reaching T at another batch is not seen).

Relative targets (`Relative(0.6)`) are factors of the parent's value; for a throughput, `Relative(1.5)`
means 1.5x the parent's tokens/s, i.e. at most 1/1.5 of its seconds. `Budget` is the same in Python
objects (scenarios given as `Scenario`s rather than names) for `deployment_problem`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from puzzle.cost import (
    Scenario,
    SpeedPoint,
    block_active_params,
    block_params,
    block_weight_bytes,
    get_hardware,
    max_batch_at_speed,
    model_active_params,
    model_params,
    model_performance,
    model_weight_bytes,
    state_bytes_per_request,
)
from puzzle.cost.hardware import DEFAULT_MEMORY_FRACTION, HardwareProfile
from puzzle.cost.limits import BudgetError, Limit, Relative, Value, parse_limit, parse_value
from puzzle.cost.roofline import LatencyFn, RooflineLatency

# The cost model and the scenario grammar live in puzzle.cost.serving; named here for the budget's callers.
from puzzle.cost.serving import SCENARIO_FIELDS, SCENARIO_SYNTAX, CostModel, parse_scenario  # noqa: F401
from puzzle.search.kinds import search_attributes
from puzzle.search.types import Choice, Rules, SearchError, Table
from puzzle.spec import BlockSpec, ModelSpec


def _scenario_name(scenario: Scenario) -> str:
    return (
        scenario.name or f"b{scenario.batch_size}:in{scenario.prompt_tokens}:out{scenario.generated_tokens}"
    )


# ------------------------------------------------------------------------------------------ one row per key


class _Pricing:
    """What a row prices with: the parent, the weight recipe, the usable share of memory, and the hardware
    and its timer, looked up (a calibration for "this-machine") only when a row needs them."""

    def __init__(
        self,
        parent: ModelSpec,
        recipe: str,
        memory_fraction: float,
        profile: str | HardwareProfile | None,
        latency_fn: LatencyFn | None = None,
    ) -> None:
        self.parent, self.recipe, self.memory_fraction = parent, recipe, memory_fraction
        self._profile, self._latency_fn = profile, latency_fn

    @functools.cached_property
    def hardware(self) -> HardwareProfile:
        if self._profile is None:
            raise SearchError("this budget needs hardware (it times the scenarios or holds the requests)")
        return get_hardware(self._profile)

    @functools.cached_property
    def timer(self) -> LatencyFn:
        return self._latency_fn or RooflineLatency(self.hardware)


@dataclass(frozen=True)
class Term:
    """One bound of one budget at one scenario: a row's key, its scenario (None for a scenario-free key),
    and the bound as written (None: the cost column only, reported but not bounded); `source`: the budget
    text it was read from, for messages."""

    key: str
    scenario: Scenario | None = None
    value: Value | None = None
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class BudgetRow:
    """How one budget key is priced. `side`: the bound it takes as written (`<=`, or `>=` for throughput and
    concurrent requests); `scenarios`: whether it names scenarios; `meaning`: what it bounds, in words.

    The functions take the `_Pricing` and the `Term`: `column` names the cost column (`seconds[chat]`),
    `block_cost` is one block's value from its spec, `parent_total` the whole parent's value (the column's
    fixed part is that minus the parent's blocks), `bound` the upper bound on the column's sum (a number or
    a factor of the parent's sum)."""

    side: str
    scenarios: bool
    meaning: str
    column: Callable[[_Pricing, Term], str]
    block_cost: Callable[[_Pricing, Term, BlockSpec], float]
    parent_total: Callable[[_Pricing, Term], float]
    bound: Callable[[_Pricing, Term], Value] = lambda pricing, term: term.value
    # A key that is not one sum: the terms of other rows it stands for (priced instead of it).
    expand: Callable[[_Pricing, Term], list[Term]] | None = None


def _plus_weights_outside(
    block_cost: Callable[[_Pricing, Term, BlockSpec], float],
) -> Callable[[_Pricing, Term], float]:
    """The parent's value of a memory column: its blocks' values plus the weights outside the blocks
    (embeddings, lm_head, final norm) in the scenario's recipe."""

    def parent_total(pricing: _Pricing, term: Term) -> float:
        parent, recipe = pricing.parent, term.scenario.recipe
        outside = model_weight_bytes(parent, recipe) - sum(
            block_weight_bytes(b, parent.hidden_size, recipe) for b in parent.blocks
        )
        return sum(block_cost(pricing, term, b) for b in parent.blocks) + outside

    return parent_total


def _state_bytes(term: Term, spec: BlockSpec) -> float:
    """One request's KV cache and recurrent state in `spec` at the scenario's full context, its dtypes."""
    s = term.scenario
    return state_bytes_per_request(
        spec, s.prompt_tokens + s.generated_tokens, s.kv_dtype, s.ssm_dtype, s.conv_dtype
    )


def _memory_bytes(pricing: _Pricing, term: Term, spec: BlockSpec) -> float:
    weights = block_weight_bytes(spec, pricing.parent.hidden_size, term.scenario.recipe)
    return weights + term.scenario.batch_size * _state_bytes(term, spec)


def _bytes_for_requests(pricing: _Pricing, term: Term, spec: BlockSpec) -> float:
    weights = block_weight_bytes(spec, pricing.parent.hidden_size, term.scenario.recipe)
    return weights + int(term.value) * _state_bytes(term, spec)


def _seconds(pricing: _Pricing, term: Term, spec: BlockSpec) -> float:
    latency = pricing.timer(spec, pricing.parent.hidden_size, term.scenario)
    return latency.prefill_s + term.scenario.generated_tokens * latency.decode_step_s


def _prefill_seconds(pricing: _Pricing, term: Term, spec: BlockSpec) -> float:
    return pricing.timer(spec, pricing.parent.hidden_size, term.scenario).prefill_s


def _performance(pricing: _Pricing, term: Term) -> Any:
    return model_performance(pricing.parent, term.scenario, pricing.hardware, pricing.timer)


def _seconds_for_tokens(pricing: _Pricing, term: Term) -> Value:
    """throughput >= T as a bound on the batch's seconds: tokens / T, or 1/f of the parent's for `fx`."""
    wanted = term.value
    if isinstance(wanted, Relative):
        return Relative(1.0 / wanted.factor)
    return term.scenario.batch_size * term.scenario.generated_tokens / float(wanted)


def _decode_seconds(pricing: _Pricing, term: Term, spec: BlockSpec) -> float:
    return pricing.timer(spec, pricing.parent.hidden_size, term.scenario).decode_step_s


def _seconds_per_step(pricing: _Pricing, term: Term) -> Value:
    """user_speed >= V tokens/s as a bound on the decode step: 1/V seconds, or 1/f of the parent's for `fx`."""
    wanted = term.value
    return Relative(1.0 / wanted.factor) if isinstance(wanted, Relative) else 1.0 / float(wanted)


def parent_at_speed(pricing: _Pricing, scenario: Scenario) -> SpeedPoint:
    """The parent's largest batch at the scenario's user speed and its throughput there (SearchError if
    the scenario has no speed or the parent cannot serve one request at it)."""
    name = _scenario_name(scenario)
    if scenario.user_speed is None:
        raise SearchError(
            f"scenario {name!r} has no user speed: define it with speed=TOKENS_PER_S ({SCENARIO_SYNTAX})"
        )
    point = max_batch_at_speed(
        pricing.parent,
        scenario,
        pricing.hardware,
        memory_fraction=pricing.memory_fraction,
        latency_fn=pricing.timer,
    )
    if point.batch == 0:
        raise SearchError(
            f"scenario {name!r}: the parent cannot serve one request at {scenario.user_speed:g} tokens/s per "
            f"user on {pricing.hardware.name} ({point.limited_by}), so no throughput at that speed to compare"
        )
    return point


def _terms_at_speed(pricing: _Pricing, term: Term) -> list[Term]:
    """throughput_at_speed[S] >= T as three sums at the fixed batch b (see the module's docstring)."""
    scenario = term.scenario
    parent = parent_at_speed(pricing, scenario)
    wanted = term.value.resolve(parent.throughput) if isinstance(term.value, Relative) else float(term.value)
    batch = max(1, math.ceil(wanted / parent.throughput * parent.batch - 1e-9))
    at_batch = dataclasses.replace(scenario, batch_size=batch, name=f"{_scenario_name(scenario)}@b{batch}")
    return [
        Term("throughput", at_batch, wanted, term.source),
        Term("user_speed", at_batch, scenario.user_speed, term.source),
        Term("concurrent_requests", at_batch, batch, term.source),
    ]


def _expanded_only(*_: Any) -> Any:
    raise AssertionError("throughput_at_speed is priced through the rows it expands to")


BUDGET_ROWS: dict[str, BudgetRow] = {
    "params": BudgetRow(
        "<=",
        False,
        "total parameters",
        column=lambda p, t: "params",
        block_cost=lambda p, t, s: block_params(s, p.parent.hidden_size),
        parent_total=lambda p, t: model_params(p.parent),
    ),
    "active_params": BudgetRow(
        "<=",
        False,
        "parameters used per token",
        column=lambda p, t: "active_params",
        block_cost=lambda p, t, s: block_active_params(s, p.parent.hidden_size),
        parent_total=lambda p, t: model_active_params(p.parent),
    ),
    "weight_bytes": BudgetRow(
        "<=",
        False,
        "weight bytes in the recipe",
        column=lambda p, t: f"weight_bytes[{p.recipe}]",
        block_cost=lambda p, t, s: block_weight_bytes(s, p.parent.hidden_size, p.recipe),
        parent_total=lambda p, t: model_weight_bytes(p.parent, p.recipe),
    ),
    "memory_bytes": BudgetRow(
        "<=",
        True,
        "weights + the batch's KV cache and recurrent state, bytes",
        column=lambda p, t: f"memory_bytes[{_scenario_name(t.scenario)}]",
        block_cost=_memory_bytes,
        parent_total=_plus_weights_outside(_memory_bytes),
    ),
    "concurrent_requests": BudgetRow(
        ">=",
        True,
        "requests of the scenario's context that fit in memory",
        column=lambda p, t: f"bytes_for_{int(t.value)}_requests[{_scenario_name(t.scenario)}]",
        block_cost=_bytes_for_requests,
        parent_total=_plus_weights_outside(_bytes_for_requests),
        bound=lambda p, t: float(p.memory_fraction * p.hardware.memory_bytes),
    ),
    "throughput": BudgetRow(
        ">=",
        True,
        "output tokens/s of the scenario's batch",
        column=lambda p, t: f"seconds[{_scenario_name(t.scenario)}]",
        block_cost=_seconds,
        parent_total=lambda p, t: _performance(p, t).total_s,
        bound=_seconds_for_tokens,
    ),
    "latency": BudgetRow(
        "<=",
        True,
        "seconds for the scenario's batch (prefill + generation)",
        column=lambda p, t: f"seconds[{_scenario_name(t.scenario)}]",
        block_cost=_seconds,
        parent_total=lambda p, t: _performance(p, t).total_s,
    ),
    "ttft": BudgetRow(
        "<=",
        True,
        "seconds to the first token (the batch's prefill)",
        column=lambda p, t: f"prefill_seconds[{_scenario_name(t.scenario)}]",
        block_cost=_prefill_seconds,
        parent_total=lambda p, t: _performance(p, t).prefill_s,
    ),
    "user_speed": BudgetRow(
        ">=",
        True,
        "decode tokens/s per user at the scenario's batch (1 / decode step)",
        column=lambda p, t: f"decode_seconds[{_scenario_name(t.scenario)}]",
        block_cost=_decode_seconds,
        parent_total=lambda p, t: _performance(p, t).decode_step_s,
        bound=_seconds_per_step,
    ),
    "throughput_at_speed": BudgetRow(
        ">=",
        True,
        "output tokens/s at the largest batch meeting the scenario's per-user speed (`speed=`); "
        "linearised at a fixed batch",
        column=_expanded_only,
        block_cost=_expanded_only,
        parent_total=_expanded_only,
        expand=_terms_at_speed,
    ),
}

# key -> (the bound it takes, whether it names scenarios, what it bounds): the rows as the docs show them.
BUDGET_KEYS: dict[str, tuple[str, bool, str]] = {
    key: (row.side, row.scenarios, row.meaning) for key, row in BUDGET_ROWS.items()
}


# ------------------------------------------------------------------------------------------- the grammar

_KEY = re.compile(r"(\w+)(?:\[([^\[\]]*)\])?")


@dataclass(frozen=True)
class DeploymentLimit:
    """One budget as written (`throughput[chat,long]>=1.5x`), read once by `parse_budget`: the text, its key
    (a row of `BUDGET_ROWS`), the scenarios it names (names in the cost model it was read with) and its
    bound (a number or `Relative`)."""

    text: str
    key: str
    scenarios: tuple[str, ...]
    value: float | Relative

    @property
    def name(self) -> str:
        """The key as the search's syntax writes it: `throughput[chat,long]`, `params`."""
        return f"{self.key}[{','.join(self.scenarios)}]" if self.scenarios else self.key

    def terms(self, cost_model: CostModel) -> list[Term]:
        """One term per scenario named (one in all for a scenario-free key), scenarios from `cost_model`."""
        if not self.scenarios:
            return [Term(self.key, None, self.value, self.text)]
        missing = [name for name in self.scenarios if name not in cost_model.scenarios]
        if missing:
            raise BudgetError(f"budget {self.text!r}: the cost model has no scenario {missing[0]!r}")
        return [Term(self.key, cost_model.scenarios[name], self.value, self.text) for name in self.scenarios]


def parse_budget(text: str, cost_model: CostModel | None = None) -> DeploymentLimit:
    """Read one budget; BudgetError naming the text, the known keys and scenarios otherwise."""
    scenarios = (cost_model or CostModel()).scenarios
    limit = parse_limit(text)
    match = _KEY.fullmatch(limit.key)
    known = ", ".join(f"{key}[S]" if row.scenarios else key for key, row in BUDGET_ROWS.items())
    if match is None or match.group(1) not in BUDGET_ROWS:
        raise BudgetError(f"budget {text!r}: unknown key {limit.key!r}; known keys: {known}")
    key, listed = match.group(1), match.group(2)
    row = BUDGET_ROWS[key]
    if row.scenarios and not listed:
        raise BudgetError(f"budget {text!r}: {key} needs scenarios, e.g. {key}[chat] or {key}[chat,long]")
    if not row.scenarios and listed is not None:
        raise BudgetError(f"budget {text!r}: {key} takes no scenario (write {key}{row.side}VALUE)")
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
    value = limit.upper if row.side == "<=" else limit.lower
    other = limit.lower if row.side == "<=" else limit.upper
    if value is None or other is not None:
        raise BudgetError(f"budget {text!r}: {key} takes a bound {key}{row.side}VALUE only")
    if key == "concurrent_requests" and (isinstance(value, Relative) or not float(value).is_integer()):
        raise BudgetError(
            f"budget {text!r}: concurrent_requests needs a whole number of requests (not a factor)"
        )
    if not isinstance(value, Relative) and value <= 0:
        raise BudgetError(f"budget {text!r}: the bound must be positive")
    return DeploymentLimit(text, key, names, value)


# ----------------------------------------------------------------------------------- the priced table


def _check_candidates(
    parent: ModelSpec, variants: Sequence[Sequence[BlockSpec]], scores: Sequence[Sequence[float]]
) -> None:
    if len(variants) != parent.num_blocks or len(scores) != parent.num_blocks:
        raise SearchError(
            f"need one variant list and one score list per parent block ({parent.num_blocks}), found "
            f"{len(variants)} and {len(scores)}"
        )
    for index, (candidates, block_scores) in enumerate(zip(variants, scores)):
        if not candidates or candidates[0] != parent.blocks[index]:
            raise SearchError(f"variants[{index}][0] must be the parent's block {parent.blocks[index]}")
        if len(block_scores) != len(candidates):
            raise SearchError(f"block {index}: {len(candidates)} variants but {len(block_scores)} scores")


def _expand_terms(pricing: _Pricing, terms: Sequence[Term]) -> list[Term]:
    """`terms` with each term of an `expand` row replaced by the terms it stands for (none without a bound)."""
    expanded: list[Term] = []
    for term in terms:
        expand = BUDGET_ROWS[term.key].expand
        if expand is None:
            expanded.append(term)
        elif term.value is not None:
            expanded.extend(expand(pricing, term))
    return expanded


def priced_table(
    parent: ModelSpec,
    variants: Sequence[Sequence[BlockSpec]],
    scores: Sequence[Sequence[float]],
    terms: Sequence[Term],
    pricing: _Pricing,
    *,
    maximize: bool = False,
    objective_name: str = "score",
) -> tuple[Table, list[tuple[Term, Limit]]]:
    """The search table of `variants[i]` (block i's candidates, the parent's block first) scored by
    `scores[i][j]`, with one cost column per term's row and scenario, and the limit each bounded term makes
    (in the order of `terms`). Every cost comes from the variant's spec through `puzzle.cost`."""
    _check_candidates(parent, variants, scores)
    per_block: dict[str, Callable[[BlockSpec], float]] = {}
    fixed: dict[str, float] = {}
    limits: list[tuple[Term, Limit]] = []
    for term in _expand_terms(pricing, terms):
        row = BUDGET_ROWS[term.key]
        column = row.column(pricing, term)
        if column not in per_block:  # throughput and latency of one scenario share `seconds[S]`
            cost = functools.partial(row.block_cost, pricing, term)
            per_block[column] = cost
            fixed[column] = row.parent_total(pricing, term) - sum(cost(b) for b in parent.blocks)
        if term.value is not None:
            limits.append((term, Limit(column, upper=row.bound(pricing, term))))

    blocks: dict[str, list[Choice]] = {}
    cache: dict[tuple[str, BlockSpec], float] = {}
    for index, (candidates, block_scores) in enumerate(zip(variants, scores)):
        choices = []
        seen: dict[str, int] = {}
        for spec, score in zip(candidates, block_scores):
            costs = {}
            for column, cost in per_block.items():
                if (column, spec) not in cache:
                    cache[(column, spec)] = float(cost(spec))
                costs[column] = cache[(column, spec)]
            name = spec.short_name()
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name = f"{name}#{seen[name]}"
            choices.append(Choice(name, float(score), costs, search_attributes(spec)))
        blocks[f"block_{index}"] = choices
    table = Table.from_choices(blocks, fixed, maximize, objective_name)
    return table, limits


# ------------------------------------------------------------------------------ budgets as Python objects


def _checked_value(owner: str, name: str, value: object) -> Value | None:
    """A budget value as the search uses it: None, a number, Relative, or the command line's text ('0.7x', '70G')."""
    if value is None or isinstance(value, Relative):
        return value
    if isinstance(value, str):
        return parse_value(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BudgetError(
            f"{owner}.{name} must be a number, Relative(...) or a string such as '0.7x' or '70G', "
            f"found {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class ScenarioTarget:
    """Targets for one serving scenario: output tokens/s of the batch (prefill included), end-to-end
    seconds of the batch, time to first token (seconds), decode tokens/s per user at the batch, and output
    tokens/s at the largest batch meeting the scenario's `user_speed`. None = no target."""

    scenario: Scenario
    min_tokens_per_s: Value | None = None
    max_latency_s: Value | None = None
    max_ttft_s: Value | None = None
    min_user_speed: Value | None = None
    min_tokens_per_s_at_speed: Value | None = None

    def __post_init__(self) -> None:
        for name in _TARGET_KEYS:
            object.__setattr__(self, name, _checked_value("ScenarioTarget", name, getattr(self, name)))


# ScenarioTarget field -> the budget key it is
_TARGET_KEYS = {
    "min_tokens_per_s": "throughput",
    "max_latency_s": "latency",
    "max_ttft_s": "ttft",
    "min_user_speed": "user_speed",
    "min_tokens_per_s_at_speed": "throughput_at_speed",
}


@dataclass(frozen=True)
class Budget:
    """What the child must meet, in deployment terms, plus the global rules of the search.

    memory_bytes is checked at `memory_scenario` (its batch, prompt + generated tokens of context, its
    recipe and state dtypes). min_concurrent_requests is checked on `hardware` at `concurrency_scenario`:
    requests of its prompt + generated tokens, weights in its recipe, KV cache / SSM / conv state in its
    dtypes (its batch size is not used: the number of requests is what is bounded), exactly as
    `puzzle.cost.max_concurrent_requests` (and `puzzle costs`) count them with the same dtypes.
    `hardware` also times the scenarios (roofline) unless a latency function is given to
    `deployment_problem`.

    Values are numbers, `Relative(f)` (f x the parent's value) or the command line's text ('0.7x', '70G').
    `shared_state_size` is on by default (unlike `Rules`): serving engines need one SSM state size for
    every Mamba block, so a deployment budget asks for it unless told otherwise.
    """

    params: Value | None = None
    active_params: Value | None = None
    weight_bytes: Value | None = None
    recipe: str = "bf16"
    memory_bytes: Value | None = None
    memory_scenario: Scenario | None = None
    min_concurrent_requests: int | None = None
    concurrency_scenario: Scenario | None = None
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    hardware: str | HardwareProfile | None = None
    scenarios: tuple[ScenarioTarget, ...] = ()
    shared_state_size: bool = True
    same_top_k: bool = False
    keep_blocks: tuple[int, ...] = ()
    min_attention_blocks: int = 0

    def __post_init__(self) -> None:
        for name in ("params", "active_params", "weight_bytes", "memory_bytes"):
            object.__setattr__(self, name, _checked_value("Budget", name, getattr(self, name)))
        requests = self.min_concurrent_requests
        if requests is not None and (
            isinstance(requests, bool) or not isinstance(requests, int) or requests < 1
        ):
            raise BudgetError(f"Budget.min_concurrent_requests must be an integer >= 1, found {requests!r}")
        if not 0 < self.memory_fraction <= 1:
            raise BudgetError(f"Budget.memory_fraction must be in (0, 1], found {self.memory_fraction!r}")

    def rules(self) -> Rules:
        return Rules(
            shared_state_size=self.shared_state_size,
            same_top_k=self.same_top_k,
            keep_blocks=tuple(self.keep_blocks),
            min_attention_blocks=self.min_attention_blocks,
        )

    def terms(self) -> list[Term]:
        """The budget as terms of `BUDGET_ROWS`, in the order its limits are listed."""
        terms = [Term(key, None, getattr(self, key)) for key in ("params", "active_params", "weight_bytes")]
        if self.memory_bytes is not None:
            if self.memory_scenario is None:
                raise SearchError("Budget.memory_bytes needs memory_scenario (batch, context, dtypes)")
            terms.append(Term("memory_bytes", self.memory_scenario, self.memory_bytes))
        if self.min_concurrent_requests is not None:
            if self.hardware is None or self.concurrency_scenario is None:
                raise SearchError("Budget.min_concurrent_requests needs hardware and concurrency_scenario")
            terms.append(Term("concurrent_requests", self.concurrency_scenario, self.min_concurrent_requests))
        if self.scenarios and self.hardware is None:
            raise SearchError("scenario targets need Budget.hardware (it also times embeddings and lm_head)")
        for target in self.scenarios:
            for name, key in _TARGET_KEYS.items():
                terms.append(Term(key, target.scenario, getattr(target, name)))
        return [term for term in terms if term.value is not None]


@dataclass
class DeploymentProblem:
    """A search problem built from specs: the table, its limits and rules, ready for `puzzle.search.search`."""

    table: Table
    limits: list[Limit]
    rules: Rules


def deployment_problem(
    parent: ModelSpec,
    variants: Sequence[Sequence[BlockSpec]],
    scores: Sequence[Sequence[float]],
    budget: Budget,
    latency_fn: LatencyFn | None = None,
    maximize: bool = False,
) -> DeploymentProblem:
    """The search problem for `variants[i]` (block i's candidates, `variants[i][0]` the parent's block)
    scored by `scores[i][j]` (e.g. replace-one-block KL), under `budget`.

    Every cost is computed by `puzzle.cost` from the variant's spec; the fixed part of each cost (embeddings,
    lm_head, final norm) is the parent model's value minus its blocks', so totals equal the cost model's
    whole-model functions for every architecture.
    """
    _check_candidates(parent, variants, scores)
    pricing = _Pricing(parent, budget.recipe, budget.memory_fraction, budget.hardware, latency_fn)
    table, limits = priced_table(parent, variants, scores, budget.terms(), pricing, maximize=maximize)
    return DeploymentProblem(table, [limit for _, limit in limits], budget.rules())


def cost_model_pricing(
    parent: ModelSpec, cost_model: CostModel, latency_fn: LatencyFn | None = None
) -> _Pricing:
    """How `cost_model` prices budgets on `parent` (its hardware looked up only when a budget needs it)."""
    return _Pricing(parent, cost_model.recipe, cost_model.memory_fraction, cost_model.profile, latency_fn)


def choices_to_spec(
    parent: ModelSpec, variants: Sequence[Sequence[BlockSpec]], choices: Sequence[int]
) -> ModelSpec:
    """The child ModelSpec of a solution (`Solution.choices`: variant index per block)."""
    return ModelSpec(
        vocab_size=parent.vocab_size,
        hidden_size=parent.hidden_size,
        blocks=tuple(variants[i][c] for i, c in enumerate(choices)),
        norm_eps=parent.norm_eps,
        tie_embeddings=parent.tie_embeddings,
    )


# Keys that count parameters or bytes: a bare bound below 1 of them cannot be meant, a factor (`0.75x`) can.
_SIZE_KEYS = ("params", "active_params", "weight_bytes", "memory_bytes")


def factor_hints(limits: Sequence[DeploymentLimit], parent: ModelSpec, cost_model: CostModel) -> list[str]:
    """A "did you mean 0.75x?" line for each budget whose bare value looks like a forgotten `x`: a count of
    parameters or bytes below 1 and orders of magnitude below the parent's (`active_params<=0.75`, which
    asks for at most 0 parameters, where 0.75x was meant). Priced by `cost_model` from the spec alone."""
    hints = []
    pricing = cost_model_pricing(parent, cost_model)
    for limit in limits:
        value = limit.value
        if limit.key not in _SIZE_KEYS or isinstance(value, Relative) or not 0 < value < 1:
            continue
        row = BUDGET_ROWS[limit.key]
        total = min(row.parent_total(pricing, term) for term in limit.terms(cost_model))
        if value < total * 1e-3:
            hints.append(
                f"budget {limit.text!r} bounds the {row.meaning} at {value:g} (the parent's: {total:,.0f}); "
                f"did you mean {limit.name}{row.side}{value:g}x?"
            )
    return hints
