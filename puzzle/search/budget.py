"""Budgets in deployment terms, turned into linear sums over blocks through the cost model (`puzzle.cost`).

Each user-level target becomes one cost column of the search `Table` (per-variant value from the block's
spec, the rest of the model as the fixed part) and one `Limit` on it:

- total / active parameters and weight bytes under a quantisation recipe: block sums plus embeddings;
- memory at a scenario: weights + batch x (KV cache at the scenario's full context + recurrent state);
- at least R concurrent requests of a scenario's context on a hardware profile: weights + R x per-request
  state <= memory_fraction x capacity (floor(free / per_request) >= R is exactly that, R being an
  integer), weights and state in the scenario's recipe and dtypes as `puzzle costs` counts them;
- throughput per scenario: batch x generated / (prefill + generated x decode step) >= T is
  prefill + generated x step <= batch x generated / T, a sum of block latencies plus embeddings/lm_head;
- latency per scenario (the batch's prefill + generation) and time to first token (the prefill).

Relative targets (`Relative(0.6)`) are factors of the parent's value; for a throughput, `Relative(1.5)`
means 1.5x the parent's tokens/s, i.e. at most 1/1.5 of its seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from puzzle.cost import (
    Scenario,
    block_active_params,
    block_params,
    block_weight_bytes,
    get_hardware,
    model_active_params,
    model_params,
    model_performance,
    model_weight_bytes,
    state_bytes_per_request,
)
from puzzle.cost.roofline import LatencyFn, RooflineLatency
from puzzle.search.limits import BudgetError, Limit, Relative, Value, parse_value
from puzzle.search.types import Choice, Rules, SearchError, Table
from puzzle.spec import BlockSpec, MambaSpec, ModelSpec, MoESpec


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
    seconds of the batch, and time to first token (seconds). None = no target."""

    scenario: Scenario
    min_tokens_per_s: Value | None = None
    max_latency_s: Value | None = None
    max_ttft_s: Value | None = None

    def __post_init__(self) -> None:
        for name in ("min_tokens_per_s", "max_latency_s", "max_ttft_s"):
            object.__setattr__(self, name, _checked_value("ScenarioTarget", name, getattr(self, name)))


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
    memory_fraction: float = 0.9
    hardware: str | None = None
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


@dataclass
class DeploymentProblem:
    """A search problem built from specs: the table, its limits and rules, ready for `puzzle.search.search`."""

    table: Table
    limits: list[Limit]
    rules: Rules


def _scenario_name(scenario: Scenario) -> str:
    return (
        scenario.name or f"b{scenario.batch_size}:in{scenario.prompt_tokens}:out{scenario.generated_tokens}"
    )


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
    H = parent.hidden_size
    columns: dict[str, tuple] = {}  # key -> (per-block cost function, fixed part)
    limits: list[Limit] = []

    def add(key: str, per_block, whole_model_parent: float) -> None:
        fixed = whole_model_parent - sum(per_block(block) for block in parent.blocks)
        columns[key] = (per_block, fixed)

    if budget.params is not None:
        add("params", lambda s: block_params(s, H), model_params(parent))
        limits.append(Limit("params", upper=budget.params))
    if budget.active_params is not None:
        add("active_params", lambda s: block_active_params(s, H), model_active_params(parent))
        limits.append(Limit("active_params", upper=budget.active_params))
    if budget.weight_bytes is not None:
        key = f"weight_bytes[{budget.recipe}]"
        add(key, lambda s: block_weight_bytes(s, H, budget.recipe), model_weight_bytes(parent, budget.recipe))
        limits.append(Limit(key, upper=budget.weight_bytes))
    if budget.memory_bytes is not None:
        scenario = budget.memory_scenario
        if scenario is None:
            raise SearchError("Budget.memory_bytes needs memory_scenario (batch, context, dtypes)")
        context = scenario.prompt_tokens + scenario.generated_tokens

        def memory(s: BlockSpec, scenario: Scenario = scenario, context: int = context) -> float:
            state = state_bytes_per_request(
                s, context, scenario.kv_dtype, scenario.ssm_dtype, scenario.conv_dtype
            )
            return block_weight_bytes(s, H, scenario.recipe) + scenario.batch_size * state

        key = f"memory_bytes[{_scenario_name(scenario)}]"
        add(key, memory, sum(memory(b) for b in parent.blocks) + _fixed_weight_bytes(parent, scenario.recipe))
        limits.append(Limit(key, upper=budget.memory_bytes))
    if budget.min_concurrent_requests is not None:
        serving = budget.concurrency_scenario
        if budget.hardware is None or serving is None:
            raise SearchError("Budget.min_concurrent_requests needs hardware and concurrency_scenario")
        requests = budget.min_concurrent_requests
        context = serving.prompt_tokens + serving.generated_tokens

        def footprint(s: BlockSpec) -> float:
            state = state_bytes_per_request(
                s, context, serving.kv_dtype, serving.ssm_dtype, serving.conv_dtype
            )
            return block_weight_bytes(s, H, serving.recipe) + requests * state

        key = f"bytes_for_{requests}_requests[{_scenario_name(serving)}]"
        add(
            key,
            footprint,
            sum(footprint(b) for b in parent.blocks) + _fixed_weight_bytes(parent, serving.recipe),
        )
        capacity = budget.memory_fraction * get_hardware(budget.hardware).memory_bytes
        limits.append(Limit(key, upper=float(capacity)))
    if budget.scenarios:
        if budget.hardware is None:
            raise SearchError("scenario targets need Budget.hardware (it also times embeddings and lm_head)")
        hardware = get_hardware(budget.hardware)
        timer = latency_fn or RooflineLatency(hardware)
        for target in budget.scenarios:
            scenario = target.scenario
            name = _scenario_name(scenario)
            performance = model_performance(parent, scenario, hardware, timer)

            def seconds(s: BlockSpec, scenario: Scenario = scenario) -> float:
                latency = timer(s, H, scenario)
                return latency.prefill_s + scenario.generated_tokens * latency.decode_step_s

            def prefill(s: BlockSpec, scenario: Scenario = scenario) -> float:
                return timer(s, H, scenario).prefill_s

            if target.min_tokens_per_s is not None or target.max_latency_s is not None:
                add(f"seconds[{name}]", seconds, performance.total_s)
            if target.min_tokens_per_s is not None:
                wanted = target.min_tokens_per_s
                tokens = scenario.batch_size * scenario.generated_tokens
                bound = (
                    Relative(1.0 / wanted.factor) if isinstance(wanted, Relative) else tokens / float(wanted)
                )
                limits.append(Limit(f"seconds[{name}]", upper=bound))
            if target.max_latency_s is not None:
                limits.append(Limit(f"seconds[{name}]", upper=target.max_latency_s))
            if target.max_ttft_s is not None:
                add(f"prefill_seconds[{name}]", prefill, performance.prefill_s)
                limits.append(Limit(f"prefill_seconds[{name}]", upper=target.max_ttft_s))

    blocks: dict[str, list[Choice]] = {}
    cache: dict[tuple[str, BlockSpec], float] = {}
    for index, (candidates, block_scores) in enumerate(zip(variants, scores)):
        choices = []
        seen: dict[str, int] = {}
        for spec, score in zip(candidates, block_scores):
            costs = {}
            for key, (per_block, _) in columns.items():
                if (key, spec) not in cache:
                    cache[(key, spec)] = float(per_block(spec))
                costs[key] = cache[(key, spec)]
            name = spec.short_name()
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name = f"{name}#{seen[name]}"
            attrs = {"kind": spec.kind}
            if isinstance(spec, MambaSpec):
                attrs["state_size"] = spec.state_size
            if isinstance(spec, MoESpec):
                attrs["top_k"] = spec.top_k
            choices.append(Choice(name, float(score), costs, attrs))
        blocks[f"block_{index}"] = choices
    table = Table.from_choices(blocks, {key: fixed for key, (_, fixed) in columns.items()}, maximize)
    return DeploymentProblem(table, limits, budget.rules())


def _fixed_weight_bytes(parent: ModelSpec, recipe: str) -> float:
    """Weight bytes outside the blocks (embeddings, lm_head, final norm)."""
    H = parent.hidden_size
    return model_weight_bytes(parent, recipe) - sum(block_weight_bytes(b, H, recipe) for b in parent.blocks)


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
