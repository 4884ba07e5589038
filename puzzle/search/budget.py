"""Budgets in deployment terms: one grammar, one row per key, turned into linear sums over blocks by the cost
model (`puzzle.cost`).

A budget is written `KEY<=V` or `KEY>=V`, `KEY[S]` for a key measured at scenario S (`[chat,long]` = the
bound holds in each), V absolute or a factor of the parent (`0.6x`). `parse_budget` reads it once into a
`DeploymentLimit`; the config, `puzzle search RUN_DIR`, the run's solutions stage and the report all use
that parser and hand on its objects. Each key is one row of `BUDGET_ROWS`: its side, whether it takes
scenarios, its cost per block (from the block's spec), the whole parent's value (the fixed part is that
minus the parent's blocks, so totals equal the cost model's whole-model figures), its cost column's name
and the bound on that column. `priced_table` loops over the rows; it makes one column and one `Bound`
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
means 1.5x the parent's tokens/s, i.e. at most 1/1.5 of its seconds. `Budget` is the one budget value:
these limits, the `CostModel` that prices them and the rules, built from texts (`Budget.parse`, what the
config, the CLI and `Run.search` do) or in Python (`Budget.of`), and priced by `deployment_problem`. The
search's own bound on a table column (`lower <= sum <= upper`) is a `Bound` of `puzzle.cost.limits`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
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
from puzzle.cost.hardware import HardwareProfile
from puzzle.cost.limits import Bound, BudgetError, Relative, Value, parse_limit, parse_value
from puzzle.cost.roofline import LatencyFn, RooflineLatency

# The cost model and the scenario grammar live in puzzle.cost.serving; named here for the budget's callers.
from puzzle.cost.serving import SCENARIO_FIELDS, SCENARIO_SYNTAX, CostModel, parse_scenario  # noqa: F401
from puzzle.search.kinds import search_attributes
from puzzle.search.price_as import priced_model, priced_variants
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

    def absolute(self, parent_value: float) -> float:
        """The bound as a number: a factor (`0.6x`) taken of `parent_value`, the parent's value of the key."""
        return self.value.resolve(parent_value) if isinstance(self.value, Relative) else float(self.value)


# Where a budget was written -> how to define a scenario it names there: the hint its error carries.
SCENARIO_HINTS: dict[str, str] = {
    "cli": f"define it with --scenario {SCENARIO_SYNTAX}",
    "config": "define it under hardware.scenarios",
    "python": "add it to the CostModel's scenarios (CostModel(scenarios={'NAME': Scenario(...)}))",
}


def parse_budget(text: str, cost_model: CostModel | None = None, *, where: str = "cli") -> DeploymentLimit:
    """Read one budget; BudgetError naming the text, the known keys and scenarios otherwise. `where` (a key
    of `SCENARIO_HINTS`: cli, config, python) says how the error tells to define a missing scenario."""
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
    value = limit.upper if row.side == "<=" else limit.lower
    other = limit.lower if row.side == "<=" else limit.upper
    if value is None or other is not None:
        raise BudgetError(f"budget {text!r}: {key} takes a bound {key}{row.side}VALUE only")
    return _checked_limit(text, key, names, value, cost_model or CostModel(), where=where)


def _checked_limit(
    text: str, key: str, names: tuple[str, ...], value: Value, cost_model: CostModel, *, where: str
) -> DeploymentLimit:
    """The budget `text` (key, scenario names, bound) once its scenarios and bound are checked: the one
    check both `parse_budget` and `Budget.of` make."""
    if where not in SCENARIO_HINTS:
        raise ValueError(f"where={where!r}: expected one of {', '.join(SCENARIO_HINTS)}")
    scenarios = cost_model.scenarios
    for name in names:
        if name not in scenarios:
            defined = ", ".join(sorted(scenarios)) or "none"
            hint = SCENARIO_HINTS[where].replace("NAME", name or "NAME", 1)
            raise BudgetError(
                f"budget {text!r} names scenario {name!r}, which is not defined (defined: {defined}); {hint}"
            )
    if len(set(names)) != len(names):
        raise BudgetError(f"budget {text!r} names a scenario twice")
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
    attributes: Callable[[BlockSpec], Mapping[str, Hashable]] | None = None,
    named: Sequence[Sequence[BlockSpec]] | None = None,
) -> tuple[Table, list[tuple[Term, Bound]]]:
    """The search table of `variants[i]` (block i's candidates, the parent's block first) scored by
    `scores[i][j]`, with one cost column per term's row and scenario, and the limit each bounded term makes
    (in the order of `terms`). Every cost comes from the variant's spec through `puzzle.cost`; the choices'
    names and the rules' attributes (`attributes(spec)`, default `search_attributes`) from `named[i][j]`
    (default `variants`: with `CostModel.price_as`, the run's own variants, priced as their full-size
    shapes in `variants`)."""
    attributes = attributes or search_attributes
    named = variants if named is None else named
    _check_candidates(parent, variants, scores)
    per_block: dict[str, Callable[[BlockSpec], float]] = {}
    fixed: dict[str, float] = {}
    limits: list[tuple[Term, Bound]] = []
    for term in _expand_terms(pricing, terms):
        row = BUDGET_ROWS[term.key]
        column = row.column(pricing, term)
        if column not in per_block:  # throughput and latency of one scenario share `seconds[S]`
            cost = functools.partial(row.block_cost, pricing, term)
            per_block[column] = cost
            fixed[column] = row.parent_total(pricing, term) - sum(cost(b) for b in parent.blocks)
        if term.value is not None:
            limits.append((term, Bound(column, upper=row.bound(pricing, term))))

    blocks: dict[str, list[Choice]] = {}
    cache: dict[tuple[str, BlockSpec], float] = {}
    for index, (candidates, block_scores) in enumerate(zip(variants, scores)):
        choices = []
        seen: dict[str, int] = {}
        for spec, own, score in zip(candidates, named[index], block_scores):
            costs = {}
            for column, cost in per_block.items():
                if (column, spec) not in cache:
                    cache[(column, spec)] = float(cost(spec))
                costs[column] = cache[(column, spec)]
            name = own.short_name()
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name = f"{name}#{seen[name]}"
            choices.append(Choice(name, float(score), costs, dict(attributes(own))))
        blocks[f"block_{index}"] = choices
    table = Table.from_choices(blocks, fixed, maximize, objective_name)
    return table, limits


# --------------------------------------------------------------------------------------------- the Budget


def _bound_text(value: Value) -> str:
    """A bound as the grammar writes it, exactly (`0.6x`, `70000000000`): the text a Python budget shows."""
    if isinstance(value, Relative):
        return f"{value.factor!r}x"
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


def _python_value(key: str, value: object) -> Value:
    """A bound given in Python: a number, `Relative(f)`, or the command line's text ('0.7x', '70G')."""
    if isinstance(value, Relative):
        return value
    if isinstance(value, str):
        return parse_value(value, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BudgetError(
            f"Budget.of({key}=...): a bound is a number, Relative(...) or a string such as '0.7x' or '70G', "
            f"found {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class Budget:
    """What the child must meet: the budgets (`DeploymentLimit`s, each read once), the `CostModel` that
    prices them (hardware, memory fraction, recipe, the scenarios they name) and the global rules.

    The one budget value of every front door: the run config, `puzzle search RUN_DIR` and `Run.search` read
    texts into it (`Budget.parse`), Python builds it with `Budget.of`, and `deployment_problem` prices it.
    `rules` default to one SSM state size for every Mamba block (serving engines need it)::

        cost_model = CostModel("h100", scenarios={"chat": Scenario(8, 512, 256)})
        Budget.of(active_params="0.6x", throughput={"chat": "1.5x"}, cost_model=cost_model)
        Budget.parse(["active_params<=0.6x", "throughput[chat]>=1.5x"], cost_model)  # the same budget
    """

    limits: tuple[DeploymentLimit, ...] = ()
    cost_model: CostModel = field(default_factory=CostModel)
    rules: Rules = field(default_factory=lambda: Rules(shared_state_size=True))

    def __post_init__(self) -> None:
        limits = tuple(self.limits)
        wrong = [limit for limit in limits if not isinstance(limit, DeploymentLimit)]
        if wrong:
            raise BudgetError(
                f"Budget.limits holds DeploymentLimits (parse_budget, Budget.parse or Budget.of), found "
                f"{wrong[0]!r}"
            )
        for limit in limits:  # a limit read against another cost model must name this one's scenarios
            limit.terms(self.cost_model)
        object.__setattr__(self, "limits", limits)

    @classmethod
    def parse(
        cls,
        texts: Iterable[str | DeploymentLimit],
        cost_model: CostModel | None = None,
        rules: Rules | None = None,
        *,
        where: str = "python",
    ) -> Budget:
        """The budget of `texts` (`active_params<=0.6x`, `throughput[chat]>=1.5x`), each read by
        `parse_budget` against `cost_model`'s scenarios; `where` picks the hint an undefined scenario gets."""
        cost_model = cost_model if cost_model is not None else CostModel()
        limits = tuple(
            text if isinstance(text, DeploymentLimit) else parse_budget(text, cost_model, where=where)
            for text in texts
        )
        return cls(limits, cost_model, rules if rules is not None else Rules(shared_state_size=True))

    @classmethod
    def of(
        cls,
        cost_model: CostModel | None = None,
        rules: Rules | None = None,
        **bounds: object,
    ) -> Budget:
        """The budget of one bound per key of `BUDGET_ROWS`, in the grammar's names and sides: a number,
        `Relative(f)` or text ('0.7x', '70G') for `params`, `active_params` and `weight_bytes`; for a key
        measured at scenarios, `{scenario name: bound}` (names of `cost_model.scenarios`). E.g.
        `Budget.of(params="0.8x", concurrent_requests={"long": 8}, cost_model=...)`. Each bound is checked
        exactly as the text `params<=0.8x`, `concurrent_requests[long]>=8` would be."""
        cost_model = cost_model if cost_model is not None else CostModel()
        limits = []
        for key, given in bounds.items():
            row = BUDGET_ROWS.get(key)
            if row is None:
                raise BudgetError(f"Budget.of({key}=...): unknown key; known keys: {', '.join(BUDGET_ROWS)}")
            if row.scenarios != isinstance(given, Mapping):
                example = f"{key}={{'chat': ...}}" if row.scenarios else f"{key}=0.6x"
                raise BudgetError(
                    f"Budget.of({key}=...): {key} {'is' if row.scenarios else 'is not'} measured at scenarios, "
                    f"so give {example}; found {given!r}"
                )
            per_scenario = given.items() if isinstance(given, Mapping) else [(None, given)]
            for scenario, value in per_scenario:
                bound = _python_value(key, value)
                name = f"{key}[{scenario}]" if scenario is not None else key
                text = f"{name}{row.side}{_bound_text(bound)}"
                names = () if scenario is None else (str(scenario),)
                limits.append(_checked_limit(text, key, names, bound, cost_model, where="python"))
        return cls(tuple(limits), cost_model, rules if rules is not None else Rules(shared_state_size=True))

    def terms(self) -> list[Term]:
        """The budget as terms of `BUDGET_ROWS`, its limits' scenarios taken from its cost model."""
        return [term for limit in self.limits for term in limit.terms(self.cost_model)]

    def __str__(self) -> str:
        return ", ".join(limit.text for limit in self.limits) or "no budget"


@dataclass
class DeploymentProblem:
    """A search problem built from specs: the table, its bounds and rules, ready for `puzzle.search.search`;
    `sources`: the budget text each bound was made from (by the bound's text), for messages."""

    table: Table
    limits: list[Bound]
    rules: Rules
    sources: dict[str, str] = field(default_factory=dict)


def deployment_problem(
    parent: ModelSpec,
    variants: Sequence[Sequence[BlockSpec]],
    scores: Sequence[Sequence[float]],
    budget: Budget,
    latency_fn: LatencyFn | None = None,
    maximize: bool = False,
    *,
    reported: Sequence[str] = (),
    objective_name: str = "score",
    attributes: Callable[[BlockSpec], Mapping[str, Hashable]] | None = None,
) -> DeploymentProblem:
    """The search problem for `variants[i]` (block i's candidates, `variants[i][0]` the parent's block)
    scored by `scores[i][j]` (e.g. replace-one-block KL), under `budget` (priced by its cost model).

    Every cost is computed by `puzzle.cost` from the variant's spec; the fixed part of each cost (embeddings,
    lm_head, final norm) is the parent model's value minus its blocks', so totals equal the cost model's
    whole-model functions for every architecture. `reported`: scenario-free keys whose columns the table
    sums without a bound (a run always reports params, active_params and weight_bytes). `attributes`: what
    the rules read of a variant (default `puzzle.search.kinds.search_attributes`).
    """
    if not isinstance(budget, Budget):
        raise BudgetError(
            f"deployment_problem needs a Budget (Budget.of(...) or Budget.parse([...])), found {budget!r}"
        )
    _check_candidates(parent, variants, scores)
    pricing = cost_model_pricing(parent, budget.cost_model, latency_fn)
    terms = [Term(key) for key in reported] + budget.terms()
    table, bounded = priced_table(
        pricing.parent,
        priced_variants(parent, variants, pricing.parent),  # `variants` themselves without price_as
        scores,
        terms,
        pricing,
        maximize=maximize,
        objective_name=objective_name,
        attributes=attributes,
        named=variants,
    )
    sources = {str(made): term.source for term, made in bounded}
    return DeploymentProblem(table, [made for _, made in bounded], budget.rules, sources)


def cost_model_pricing(
    parent: ModelSpec, cost_model: CostModel, latency_fn: LatencyFn | None = None
) -> _Pricing:
    """How `cost_model` prices budgets on `parent`, or on its `price_as` model when it names one (its
    hardware looked up only when a budget needs it)."""
    model = priced_model(parent, cost_model)
    return _Pricing(model, cost_model.recipe, cost_model.memory_fraction, cost_model.profile, latency_fn)


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
