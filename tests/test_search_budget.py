"""Deployment budgets through the cost model: the MIP's answer equals enumeration with whole-model cost functions."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from puzzle.cost import (
    Scenario,
    max_concurrent_requests,
    model_active_params,
    model_params,
    model_performance,
    model_weight_bytes,
)
from puzzle.cost.limits import BudgetError, Relative
from puzzle.presets.tiny import tiny_hybrid
from puzzle.problem import RunCandidates, run_problem
from puzzle.search import InfeasibleError, Rules, search
from puzzle.search.budget import (
    BUDGET_KEYS,
    BUDGET_ROWS,
    Budget,
    CostModel,
    choices_to_spec,
    deployment_problem,
    parse_budget,
)
from puzzle.spec import LinearSpec, MambaSpec, MLPSpec, MoESpec, NoOpSpec, SpecError

HARDWARE = "h100"
CHAT = Scenario(batch_size=8, prompt_tokens=512, generated_tokens=256, name="chat")
LONG = Scenario(batch_size=2, prompt_tokens=8192, generated_tokens=64, name="long")
CONTEXT = 100_000
# Requests of CONTEXT tokens with the default dtypes (bf16 weights and KV cache, fp32 SSM state).
SERVING = Scenario(batch_size=1, prompt_tokens=CONTEXT - 1000, generated_tokens=1000, name="serving")
# A workload at a per-user decode speed the tiny parent keeps up to a batch of about 270 on an H100.
SPEEDY = Scenario(batch_size=1, prompt_tokens=2048, generated_tokens=512, name="speedy", user_speed=12000.0)
COST_MODEL = CostModel(HARDWARE, scenarios={s.name: s for s in (CHAT, LONG, SERVING, SPEEDY)})


def _variants(parent):
    """Three candidates per block of the tiny hybrid `M*EM-E`, parent first."""
    variants = []
    for block in parent.blocks:
        if isinstance(block, MambaSpec):
            options = [block, dataclasses.replace(block, state_size=8), NoOpSpec()]
        elif isinstance(block, MoESpec):
            options = [block, dataclasses.replace(block, top_k=1), NoOpSpec()]
        elif isinstance(block, MLPSpec):
            options = [block, MLPSpec(width=block.width // 2), NoOpSpec()]
        else:
            options = [block, dataclasses.replace(block, num_kv_heads=1), LinearSpec()]
        variants.append(options)
    return variants


def _concurrency(spec) -> float:
    try:
        return max_concurrent_requests(spec, HARDWARE, CONTEXT)
    except SpecError:  # no per-request state at all: memory does not bound the batch
        return float("inf")


def test_budget_equals_enumeration_with_model_functions():
    parent = tiny_hybrid(hidden_size=64)
    variants = _variants(parent)
    rng = np.random.default_rng(0)
    scores = [[0.0, *rng.uniform(0.1, 1.0, len(options) - 1)] for options in variants]
    parent_chat = model_performance(parent, CHAT, HARDWARE)
    required_requests = int(_concurrency(parent) * 1.15)
    budget = Budget.of(
        cost_model=COST_MODEL,
        params=Relative(0.8),
        active_params=0.9 * model_active_params(parent),
        memory_bytes={"long": Relative(0.95)},
        concurrent_requests={"serving": required_requests},
        throughput={"chat": Relative(1.1)},
        ttft={"long": Relative(0.97)},
    )
    problem = deployment_problem(parent, variants, scores, budget)
    solution = search(problem.table, problem.limits, problem.rules)

    def memory(spec) -> float:
        from puzzle.cost import state_bytes_per_request

        state = state_bytes_per_request(spec, LONG.prompt_tokens + LONG.generated_tokens)
        return model_weight_bytes(spec) + LONG.batch_size * state

    parent_long = model_performance(parent, LONG, HARDWARE)
    best, best_choices = np.inf, None
    for choices in itertools.product(*[range(len(options)) for options in variants]):
        child = choices_to_spec(parent, variants, choices)
        states = {b.state_size for b in child.blocks if isinstance(b, MambaSpec)}
        if len(states) > 1:
            continue
        if model_params(child) > 0.8 * model_params(parent):
            continue
        if model_active_params(child) > 0.9 * model_active_params(parent):
            continue
        if memory(child) > 0.95 * memory(parent):
            continue
        if _concurrency(child) < required_requests:
            continue
        if (
            model_performance(child, CHAT, HARDWARE).output_tokens_per_s
            < 1.1 * parent_chat.output_tokens_per_s
        ):
            continue
        if model_performance(child, LONG, HARDWARE).prefill_s > 0.97 * parent_long.prefill_s:
            continue
        score = sum(scores[i][c] for i, c in enumerate(choices))
        if score < best:
            best, best_choices = score, choices
    assert best_choices is not None, "the budget should leave some architecture"
    assert solution.objective == pytest.approx(best, abs=1e-12)

    child = choices_to_spec(parent, variants, solution.choices)
    totals = solution.totals
    assert totals["params"] == pytest.approx(model_params(child))
    assert totals["active_params"] == pytest.approx(model_active_params(child))
    assert totals["seconds[chat]"] == pytest.approx(
        model_performance(child, CHAT, HARDWARE).total_s, rel=1e-9
    )
    assert totals["prefill_seconds[long]"] == pytest.approx(
        model_performance(child, LONG, HARDWARE).prefill_s, rel=1e-9
    )
    assert _concurrency(child) >= required_requests


def test_throughput_target_out_of_reach_is_named():
    parent = tiny_hybrid(hidden_size=64)
    variants = _variants(parent)
    scores = [[0.0] + [1.0] * (len(options) - 1) for options in variants]
    budget = Budget.of(cost_model=COST_MODEL, throughput={"chat": Relative(50.0)})
    problem = deployment_problem(parent, variants, scores, budget)
    with pytest.raises(InfeasibleError) as caught:
        search(problem.table, problem.limits, problem.rules)
    assert caught.value.budget == "seconds[chat]<=0.02x"
    fastest = min(
        model_performance(choices_to_spec(parent, variants, c), CHAT, HARDWARE).total_s
        for c in itertools.product(*[range(len(o)) for o in variants])
        if len(
            {b.state_size for b in choices_to_spec(parent, variants, c).blocks if isinstance(b, MambaSpec)}
        )
        <= 1
    )
    assert caught.value.best == pytest.approx(fastest, rel=1e-9)


def test_budget_values_accept_the_command_line_syntax_and_reject_garbage():
    budget = Budget.of(
        active_params="0.7x",
        weight_bytes="70G",
        params=2_000_000,
        throughput={"chat": "1.5x"},
        cost_model=COST_MODEL,
    )
    assert {limit.key: limit.value for limit in budget.limits} == {
        "active_params": Relative(0.7),
        "weight_bytes": 70e9,
        "params": 2e6,
        "throughput": Relative(1.5),
    }
    assert (
        str(budget)
        == "active_params<=0.7x, weight_bytes<=70000000000, params<=2000000, throughput[chat]>=1.5x"
    )
    with pytest.raises(BudgetError, match=r"cannot read budget value '0.7y'"):
        Budget.of(active_params="0.7y")
    with pytest.raises(BudgetError, match=r"Budget\.of\(params=\.\.\.\): a bound is a number.*found \[1\]"):
        Budget.of(params=[1])
    with pytest.raises(BudgetError, match=r"unknown key; known keys: params, active_params"):
        Budget.of(min_tokens_per_s=2.0)
    with pytest.raises(
        BudgetError, match=r"throughput is measured at scenarios, so give throughput=\{'chat'"
    ):
        Budget.of(throughput=1.5, cost_model=COST_MODEL)
    with pytest.raises(BudgetError, match=r"params is not measured at scenarios"):
        Budget.of(params={"chat": 0.5}, cost_model=COST_MODEL)
    with pytest.raises(BudgetError, match=r"concurrent_requests needs a whole number"):
        Budget.of(concurrent_requests={"serving": 2.5}, cost_model=COST_MODEL)
    with pytest.raises(BudgetError, match=r"Budget\.limits holds DeploymentLimits.*found 'params<=0\.5x'"):
        Budget(("params<=0.5x",))


def test_an_undefined_scenario_is_told_how_to_define_it_where_the_budget_was_written():
    """The command line, the config and Python define scenarios differently; the error says the right way."""
    hints = {
        "cli": r"define it with --scenario fast:batch=B,prompt=P,generated=G",
        "config": r"define it under hardware\.scenarios",
        "python": r"add it to the CostModel's scenarios \(CostModel\(scenarios=\{'fast': Scenario",
    }
    for where, hint in hints.items():
        with pytest.raises(
            BudgetError, match=r"names scenario 'fast', which is not defined \(defined: chat, long.*; " + hint
        ):
            parse_budget("throughput[fast]>=1.5x", COST_MODEL, where=where)
    with pytest.raises(BudgetError, match=hints["python"]):
        Budget.of(throughput={"fast": 1.5}, cost_model=COST_MODEL)
    with pytest.raises(ValueError, match=r"where='yaml': expected one of cli, config, python"):
        parse_budget("params<=0.5x", where="yaml")


def test_a_budget_read_against_one_cost_model_is_refused_by_another():
    limit = parse_budget("throughput[chat]>=1.5x", COST_MODEL)
    with pytest.raises(
        BudgetError, match=r"budget 'throughput\[chat\]>=1\.5x': the cost model has no scenario 'chat'"
    ):
        Budget((limit,), CostModel(HARDWARE))


@pytest.mark.parametrize(
    ("kv_dtype", "ssm_dtype", "recipe"), [("fp8", "fp32", "fp8"), ("bf16", "bf16", "bf16")]
)
def test_concurrency_budget_agrees_with_puzzle_costs(kv_dtype, ssm_dtype, recipe):
    """The search and `puzzle costs` count concurrent requests of the same child with the same dtypes:
    the most requests the search lets a child serve is exactly `puzzle costs`' max_concurrent_requests."""
    from puzzle.commands.costs import compute_costs

    parent = tiny_hybrid(hidden_size=64)
    variants = _variants(parent)
    serving = Scenario(1, CONTEXT - 1000, 1000, recipe=recipe, kv_dtype=kv_dtype, ssm_dtype=ssm_dtype)
    children = [(0,) * parent.num_blocks, (1,) * parent.num_blocks]
    for choices in children:
        child = choices_to_spec(parent, variants, choices)
        costs = compute_costs(child, HARDWARE, CONTEXT, recipe, kv_dtype, ssm_dtype)
        most = costs["max_concurrent_requests"]
        assert most is not None and most > 1
        pinned = [[options[c]] for options, c in zip(variants, choices)]  # only this child to choose
        for requests, fits in ((most, True), (most + 1, False)):
            budget = Budget.of(
                cost_model=CostModel(HARDWARE, scenarios={"serving": serving}),
                rules=Rules(shared_state_size=False),
                concurrent_requests={"serving": requests},
            )
            problem = deployment_problem(child, pinned, [[0.0]] * parent.num_blocks, budget)
            if fits:
                assert (
                    search(problem.table, problem.limits, problem.rules).choices == (0,) * parent.num_blocks
                )
            else:
                with pytest.raises(InfeasibleError):
                    search(problem.table, problem.limits, problem.rules)


# One budget per row of the table, as text (config, `puzzle search RUN_DIR`) and as `Budget.of` keywords.
_BOTH_WAYS = {
    "params<=0.8x": {"params": Relative(0.8)},
    "active_params<=0.9x": {"active_params": Relative(0.9)},
    "weight_bytes<=0.9x": {"weight_bytes": Relative(0.9)},
    "memory_bytes[long]<=0.95x": {"memory_bytes": {"long": Relative(0.95)}},
    "concurrent_requests[serving]>=3": {"concurrent_requests": {"serving": 3}},
    "throughput[chat]>=1.1x": {"throughput": {"chat": Relative(1.1)}},
    "latency[chat]<=0.9x": {"latency": {"chat": Relative(0.9)}},
    "ttft[long]<=0.97x": {"ttft": {"long": Relative(0.97)}},
    "user_speed[chat]>=1.05x": {"user_speed": {"chat": Relative(1.05)}},
    "throughput_at_speed[speedy]>=1.2x": {"throughput_at_speed": {"speedy": Relative(1.2)}},
}


def test_the_table_has_one_row_per_budget_key_and_the_docs_list_them():
    assert {parse_budget(text, COST_MODEL).key for text in _BOTH_WAYS} == set(BUDGET_ROWS)
    assert {k: (r.side, r.scenarios, r.meaning) for k, r in BUDGET_ROWS.items()} == BUDGET_KEYS


@pytest.mark.parametrize("text", list(_BOTH_WAYS))
def test_a_budget_prices_the_same_read_from_text_or_given_as_objects(text):
    """Both roads go through the same row: the same bound on the same column, the same costs."""
    parent = tiny_hybrid(hidden_size=64)
    variants = _variants(parent)
    scores = [[0.0] * len(options) for options in variants]
    cost_model = dataclasses.replace(COST_MODEL, recipe="fp8" if text.startswith("weight_bytes") else "bf16")
    python = Budget.of(cost_model=cost_model, **_BOTH_WAYS[text])
    assert python == Budget.parse([text], cost_model)  # the same value, whichever door it came in by
    given = deployment_problem(parent, variants, scores, python)
    read = run_problem(
        "unused",
        [parse_budget(text, cost_model)],
        cost_model=cost_model,
        candidates=RunCandidates(parent, variants, scores),
    )
    # One limit per budget, except throughput_at_speed's three (throughput, speed, requests at one batch).
    assert read.problem.limits == given.limits and read.sources == {
        str(limit): text for limit in given.limits
    }
    column = given.limits[0].key
    np.testing.assert_array_equal(read.table.costs[column], given.table.costs[column])
    assert read.table.fixed[column] == given.table.fixed[column]
