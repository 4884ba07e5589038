"""The search MIP against brute-force enumeration on random small instances (the oracle is exhaustive)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from puzzle.cost.limits import Bound, Relative, merge_limits, parse_limit, parse_value
from puzzle.search import Choice, InfeasibleError, Rules, SearchError, SolverOptions, Table, search, search_k
from puzzle.search.mip import feasible_choices, resolve_limits

COST_KEYS = ("memory", "runtime", "params")


@st.composite
def instances(draw):
    num_blocks = draw(st.integers(1, 6))
    blocks = {}
    for block in range(num_blocks):
        choices = []
        for variant in range(draw(st.integers(1, 4))):
            costs = {key: draw(st.integers(0, 20)) for key in COST_KEYS}
            state = draw(st.sampled_from([None, 64, 128]))
            choices.append(Choice(f"v{variant}", draw(st.integers(0, 30)) / 4, costs, {"state_size": state}))
        blocks[f"block_{block}"] = choices
    fixed = {"memory": draw(st.integers(0, 5))}
    table = Table.from_choices(blocks, fixed=fixed, maximize=draw(st.booleans()))
    limits = []
    for key in draw(st.permutations(COST_KEYS))[: draw(st.integers(1, 3))]:
        parent = table.parent_total(key)
        kind = draw(st.sampled_from(["upper", "upper", "relative", "lower", "both"]))
        value = draw(st.integers(0, int(parent) + 10))
        if kind == "upper":
            limits.append(Bound(key, upper=float(value)))
        elif kind == "relative":
            limits.append(Bound(key, upper=Relative(draw(st.sampled_from([0.3, 0.5, 0.8, 1.0])))))
        elif kind == "lower":
            limits.append(Bound(key, lower=float(value)))
        else:
            limits.append(Bound(key, lower=float(value), upper=float(value + draw(st.integers(0, 15)))))
    rules = Rules(shared_state_size=draw(st.booleans()))
    k = draw(st.integers(1, 3))
    min_diff = draw(st.integers(1, 2))
    options = SolverOptions(gap_rel=0.0, heuristics=draw(st.booleans()))
    return table, limits, rules, k, min_diff, options


def _all_choices(table: Table):
    return itertools.product(*[range(len(names)) for names in table.variant_names])


def _meets_rules(table: Table, choices, rules: Rules) -> bool:
    rows = table.offsets[:-1] + np.asarray(choices)
    if rules.shared_state_size:
        states = {table.attrs["state_size"][row] for row in rows} - {None}
        return len(states) <= 1
    return True


def _meets(table: Table, choices, limits) -> bool:
    totals = table.totals(choices)
    for limit in limits:
        lower, upper = limit.resolved(table.parent_total(limit.key))
        if upper is not None and totals[limit.key] > upper + 1e-9:
            return False
        if lower is not None and totals[limit.key] < lower - 1e-9:
            return False
    return True


def _objective(table: Table, choices) -> float:
    return float(table.score[table.offsets[:-1] + np.asarray(choices)].sum())


def _best(values, maximize: bool):
    return max(values) if maximize else min(values)


def _expected_binding(table: Table, limits, rules: Rules):
    """(budget name, best value) that the diagnosis must report, by enumeration; budget None = rules."""
    ruled = [c for c in _all_choices(table) if _meets_rules(table, c, rules)]
    if not ruled:
        return None, None
    for together in (False, True):
        for index, limit in enumerate(limits):
            others = [other for j, other in enumerate(limits) if j != index] if together else []
            pool = [c for c in ruled if _meets(table, c, others)]
            if not pool:
                continue
            values = [table.totals(c)[limit.key] for c in pool]
            lower, upper = limit.resolved(table.parent_total(limit.key))
            if upper is not None and min(values) > upper + 1e-9:
                return str(limit), min(values)
            if lower is not None and max(values) < lower - 1e-9:
                return str(limit), max(values)
    return "together", None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_mip_equals_brute_force(instance):
    table, limits, rules, k, min_diff, options = instance
    feasible = [c for c in _all_choices(table) if _meets_rules(table, c, rules) and _meets(table, c, limits)]
    if not feasible:
        expected_budget, expected_best = _expected_binding(table, limits, rules)
        event(f"infeasible: {'rules' if expected_budget is None else expected_budget.split('<')[0][:8]}")
        with pytest.raises(InfeasibleError) as caught:
            search_k(table, limits, rules, options, k=k, min_diff=min_diff)
        if expected_budget == "together":
            assert caught.value.budget is None
        else:
            assert caught.value.budget == expected_budget
            if expected_best is not None:
                assert caught.value.best == pytest.approx(expected_best, abs=1e-6)
        return

    solutions = search_k(table, limits, rules, options, k=k, min_diff=min_diff)
    event(f"feasible, {len(solutions)} of k={k}, shared state {rules.shared_state_size}")
    earlier: list[tuple[int, ...]] = []
    for solution in solutions:
        # Each solution is the best of those differing from every earlier one in >= min_diff blocks.
        pool = [c for c in feasible if all(sum(a != b for a, b in zip(c, e)) >= min_diff for e in earlier)]
        assert pool, "the MIP found a solution where enumeration finds none"
        best = _best([_objective(table, c) for c in pool], table.maximize)
        assert solution.objective == pytest.approx(best, abs=1e-6)
        assert solution.choices in pool  # every budget and rule holds, diversity too
        assert solution.status == "optimal"
        assert solution.totals == pytest.approx(table.totals(solution.choices))
        earlier.append(solution.choices)
    # Fewer than k only when enumeration has no further distinct architecture.
    if len(solutions) < k:
        assert not [
            c for c in feasible if all(sum(a != b for a, b in zip(c, e)) >= min_diff for e in earlier)
        ]


def _correlated_table(num_blocks: int, num_variants: int, seed: int = 0) -> Table:
    """Costs grow with a variant's size, scores fall with it, like a real library."""
    rng = np.random.default_rng(seed)
    size = rng.uniform(0.05, 1.0, (num_blocks, num_variants))
    size[:, 0] = 1.0  # the parent is the largest
    score = np.clip(0.05 * (1 - size) ** 2 * rng.uniform(0.5, 1.5, size.shape), 0, None)
    score[:, 0] = 0.0
    costs = {
        "memory": (size * rng.uniform(0.9, 1.1, size.shape)).ravel(),
        "runtime": (size**0.8 * rng.uniform(0.9, 1.1, size.shape)).ravel(),
        "params": (size * rng.uniform(0.95, 1.05, size.shape)).ravel(),
    }
    return Table(
        block_names=tuple(f"block_{b}" for b in range(num_blocks)),
        variant_names=tuple(tuple(f"v{v}" for v in range(num_variants)) for _ in range(num_blocks)),
        score=score.ravel(),
        costs=costs,
    )


@pytest.mark.parametrize(
    ("solver", "heuristics"), [("highs", True), ("highs", False), ("cbc", True), ("cbc", False)]
)
def test_fast_path_matches_plain_model(solver, heuristics):
    """Presolve + reduced-cost fixing (+ diving, local search, probing) give the plain model's optimum."""
    table = _correlated_table(12, 30, seed=3)
    limits = [
        Bound("memory", upper=Relative(0.6)),
        Bound("runtime", upper=Relative(0.7)),
        Bound("params", upper=Relative(0.65)),
    ]
    fast = search(table, limits, options=SolverOptions(solver=solver, heuristics=heuristics))
    plain = search(table, limits, options=SolverOptions(solver=solver, presolve=False, fixing=False))
    assert fast.status == plain.status == "optimal"
    assert fast.objective == pytest.approx(plain.objective, rel=1e-5, abs=1e-9)
    assert fast.presolve_dropped > 0
    assert fast.free_variables < table.num_variants - fast.presolve_dropped


def test_rules_keep_min_attention_and_same_top_k():
    kinds = ["attention", "noop"]
    blocks = {
        f"b{i}": [
            Choice("parent", 0.0, {"mem": 10.0}, {"kind": kinds[i % 2], "top_k": 8}),
            Choice("small", 1.0 + i, {"mem": 4.0}, {"kind": kinds[i % 2], "top_k": 4}),
            Choice("noop", 0.5 + i, {"mem": 0.0}, {"kind": "noop"}),
        ]
        for i in range(4)
    }
    table = Table.from_choices(blocks)
    limits = [parse_limit("mem<=20")]
    base = search(table, limits)
    assert base.totals["mem"] <= 20
    kept = search(table, limits, Rules(keep_blocks=("b3",)))
    assert kept.names["b3"] == "parent"
    attention = search(table, limits, Rules(min_attention_blocks=2))
    rows = table.offsets[:-1] + np.array(attention.choices)
    assert sum(table.attrs["kind"][r] == "attention" for r in rows) >= 2
    same = search(table, [parse_limit("mem<=24")], Rules(same_top_k=True))
    ks = {table.attrs["top_k"][r] for r in table.offsets[:-1] + np.array(same.choices)} - {None}
    assert len(ks) <= 1
    with pytest.raises(InfeasibleError) as caught:
        search(table, limits, Rules(keep_blocks=(0, 1, 2)))
    assert caught.value.budget == "mem<=20"
    assert caught.value.best == pytest.approx(30.0)


def test_budget_syntax():
    assert parse_value("0.6x") == Relative(0.6)
    assert parse_value("70G") == 70e9
    assert parse_limit("stats.memory_mib<=70000") == Bound("stats.memory_mib", upper=70000.0)
    assert parse_limit("a>=0.5x") == Bound("a", lower=Relative(0.5))
    assert parse_limit("10<=a<=0.9x") == Bound("a", upper=Relative(0.9), lower=10.0)
    assert parse_limit("5>=a") == Bound("a", upper=5.0)
    assert merge_limits([parse_limit("a<=5"), parse_limit("a>=2")]) == [Bound("a", upper=5.0, lower=2.0)]
    assert str(Bound("a", upper=5.0, lower=2.0)) == "2<=a<=5"
    for bad in ("a<5", "a<=five", "<=3"):
        with pytest.raises(ValueError, match="budget"):
            parse_limit(bad)
    with pytest.raises(SearchError, match="no cost 'nope'"):
        search(_correlated_table(2, 2), [Bound("nope", upper=1.0)])
    assert math.isclose(_correlated_table(3, 2).parent_total("params"), 3 * 1.0, rel_tol=0.1)


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_reduced_mip_cutoff_contract(solver):
    """The final MIP's cutoff (HiGHS objective_bound) never hides a better solution: below the optimum it
    reports nothing better (infeasible, or a solution no better than the cutoff); above, the optimum."""
    from puzzle.search.backend import REDUCED_MIP_HIGHS_OPTIONS, Row, RowModel, solve_with_pulp

    rng = np.random.default_rng(7)
    blocks, variants = 6, 4
    cost = rng.uniform(0, 10, blocks * variants)
    weight = rng.uniform(0, 10, blocks * variants)
    rows = [
        Row(np.arange(b * variants, (b + 1) * variants), np.ones(variants), 1.0, 1.0, f"b{b}")
        for b in range(blocks)
    ]
    # A binding budget: 40% of the heaviest choice in every block.
    budget = 0.4 * weight.reshape(blocks, variants).max(axis=1).sum()
    rows.append(Row(np.arange(blocks * variants), weight, -math.inf, budget, "weight"))
    model = RowModel(cost, rows)
    columns = np.arange(blocks * variants)
    best = min(
        sum(cost[b * variants + c] for b, c in enumerate(choice))
        for choice in itertools.product(range(variants), repeat=blocks)
        if sum(weight[b * variants + c] for b, c in enumerate(choice)) <= rows[-1].upper
    )
    exact = solve_with_pulp(model, columns, True, solver, 0.0, None, highs_options=REDUCED_MIP_HIGHS_OPTIONS)
    assert exact.objective == pytest.approx(best, abs=1e-6)
    above = solve_with_pulp(model, columns, True, solver, 0.0, None, cutoff=best + 1e-3)
    assert above.status == "optimal" and above.objective == pytest.approx(best, abs=1e-6)
    below = solve_with_pulp(model, columns, True, solver, 0.0, None, cutoff=best - 1e-3)
    assert below.status == "infeasible" or below.objective >= best - 1e-6


def _random_library(seed: int) -> tuple[Table, list[Bound]]:
    """2-5 blocks of 2-5 variants, two costs, budgets at 30-90% of the parent's (a random small library)."""
    rng = np.random.default_rng(seed)
    num_blocks, num_variants = int(rng.integers(2, 6)), int(rng.integers(2, 6))
    blocks = {
        f"b{b}": [
            Choice(
                f"v{v}",
                0.0 if v == 0 else float(rng.uniform(0, 1)),
                {key: 10.0 if v == 0 else float(rng.uniform(0, 10)) for key in ("m", "r")},
            )
            for v in range(num_variants)
        ]
        for b in range(num_blocks)
    }
    table = Table.from_choices(blocks, maximize=bool(rng.integers(0, 4) == 0))
    limits = [Bound(key, upper=float(rng.uniform(0.3, 0.9)) * table.parent_total(key)) for key in ("m", "r")]
    return table, limits


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_status_optimal_means_the_proven_gap_is_within_the_requested_one(solver):
    """Against brute force: the reported gap is never below the true one (it is proven, not the requested
    tolerance), and "optimal" means gap <= requested (with gap 0 requested: the brute-force optimum)."""
    checked = optimal = 0
    for seed in range(20):
        table, limits = _random_library(seed)
        feasible = [c for c in _all_choices(table) if _meets(table, c, limits)]
        if not feasible:
            continue
        best = _best([_objective(table, c) for c in feasible], table.maximize)
        for heuristics, gap_rel in itertools.product((True, False), (0.0, 0.05, 0.3)):
            options = SolverOptions(solver=solver, gap_rel=gap_rel, heuristics=heuristics)
            solution = search(table, limits, options=options)
            checked += 1
            assert solution.choices in feasible
            # The gap of the answer to the true optimum, measured as the search measures it (minimised).
            sign = -1.0 if table.maximize else 1.0
            true_gap = max(0.0, sign * (solution.objective - best)) / max(abs(solution.objective), 1e-12)
            assert solution.gap is not None
            assert solution.gap >= true_gap - 1e-9, (seed, heuristics, gap_rel, solution.gap, true_gap)
            assert solution.status in ("optimal", "time_limit")
            if solution.status == "optimal":
                optimal += 1
                assert solution.gap <= gap_rel
                if gap_rel == 0.0:
                    assert solution.objective == pytest.approx(best, abs=1e-9)
    assert checked >= 80 and optimal == checked  # no time limit: every solve ends proven


def test_solver_options_reject_what_makes_no_sense():
    for bad in (
        {"gap_rel": -1.0},
        {"gap_rel": 5.0},
        {"gap_rel": 1.0},
        {"gap_rel": math.nan},
        {"gap_rel": True},
        {"time_limit_s": -1.0},
        {"time_limit_s": 0.0},
        {"time_limit_s": math.inf},
        {"time_limit_s": math.nan},
        {"solver": "gurobi"},
        {"presolve": "yes"},
    ):
        with pytest.raises(SearchError, match=r"SolverOptions|unknown solver"):
            SolverOptions(**bad)
    assert SolverOptions(gap_rel=0.0, time_limit_s=0.5).gap_rel == 0.0


def _knapsack_library(seed: int) -> tuple[Table, list[Bound]]:
    """2-6 blocks of 1-6 variants with real-valued scores and two costs; 1 or 2 budgets, upper, lower or
    both (both often binding, so the knapsack search's two-row path runs, not only its relaxations)."""
    rng = np.random.default_rng(seed)
    num_blocks = int(rng.integers(2, 7))
    blocks = {
        f"b{b}": [
            Choice(f"v{v}", float(rng.uniform(0, 1)), {key: float(rng.uniform(0, 10)) for key in ("m", "r")})
            for v in range(int(rng.integers(1, 7)))
        ]
        for b in range(num_blocks)
    }
    table = Table.from_choices(blocks, maximize=bool(rng.integers(0, 3) == 0))
    limits = []
    for key in ("m", "r")[: int(rng.integers(1, 3))]:
        parent = table.parent_total(key)
        kind = rng.choice(["upper", "upper", "lower", "both"])
        low, high = sorted(rng.uniform(0.3, 1.2, 2) * parent)
        limits.append(
            Bound(key, upper=float(high))
            if kind == "upper"
            else Bound(key, lower=float(low))
            if kind == "lower"
            else Bound(key, lower=float(low), upper=float(high))
        )
    return table, limits


@pytest.mark.parametrize("gap_rel", [0.0, 1e-6, 0.1])
def test_knapsack_search_equals_brute_force(gap_rel):
    """The knapsack search (no rules) against enumeration: proven gap >= the true one, optimal iff the
    proven gap is within the requested one, the exact optimum with gap 0, infeasible when nothing fits."""
    from puzzle.search import mckp
    from puzzle.search.exact import _objective_vector
    from puzzle.search.mip import build_problem, resolve_limits

    two_row_passes = 0
    for seed in range(150):
        table, limits = _knapsack_library(seed)
        bounds = [(str(lim), table.cost(lim.key), lo, hi) for lim, lo, hi in resolve_limits(table, limits)]
        problem = build_problem(table, _objective_vector(table), bounds, Rules())
        assert mckp.applies(problem)
        assert mckp.solve(problem, gap_rel, None) is not None  # small: never falls back to the MIP
        if len(limits) == 2:
            blocks = mckp._Blocks(problem)
            answer = mckp._solve_blocks(problem, blocks, gap_rel, None)  # the two-row pass on its own
            two_row_passes += 1
        feasible = [c for c in _all_choices(table) if _meets(table, c, limits)]
        if not feasible:
            with pytest.raises(InfeasibleError):
                search(table, limits, options=SolverOptions(gap_rel=gap_rel))
            continue
        best = _best([_objective(table, c) for c in feasible], table.maximize)
        sign = -1.0 if table.maximize else 1.0
        if len(limits) == 2:
            assert answer[0] in feasible
            assert sign * _objective(table, answer[0]) <= sign * best + gap_rel * abs(best) + 1e-9
        solution = search(table, limits, options=SolverOptions(gap_rel=gap_rel))
        assert solution.choices in feasible
        true_gap = max(0.0, sign * (solution.objective - best)) / max(abs(solution.objective), 1e-12)
        assert solution.gap is not None and solution.gap >= true_gap - 1e-9
        assert solution.status == ("optimal" if solution.gap <= gap_rel else "time_limit")
        assert solution.status == "optimal"  # no time limit: every solve ends proven
        if gap_rel == 0.0:
            assert solution.objective == pytest.approx(best, abs=1e-9)
    assert two_row_passes > 30


def test_knapsack_search_hands_over_to_the_mip_when_it_gives_up(monkeypatch):
    """Past its state limit the knapsack search returns None and the MIP answers, still exactly."""
    from puzzle.search import mckp
    from puzzle.search.exact import _objective_vector
    from puzzle.search.mip import build_problem, resolve_limits

    monkeypatch.setattr(mckp, "MAX_STATES", 1)
    monkeypatch.setattr(mckp, "BEAM_WIDTH", 1)
    gave_up = 0
    for seed in range(40):
        table, limits = _knapsack_library(seed)
        bounds = [(str(lim), table.cost(lim.key), lo, hi) for lim, lo, hi in resolve_limits(table, limits)]
        problem = build_problem(table, _objective_vector(table), bounds, Rules())
        feasible = [c for c in _all_choices(table) if _meets(table, c, limits)]
        if not feasible:
            continue
        gave_up += mckp.solve(problem, 0.0, None) is None
        solution = search(table, limits, options=SolverOptions(gap_rel=0.0))
        assert solution.status == "optimal"
        assert solution.objective == pytest.approx(
            _best([_objective(table, c) for c in feasible], table.maximize), abs=1e-9
        )
    assert gave_up >= 5  # 6 of these seeds need more than one state somewhere


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_feasible_choices_agrees_with_the_scalar_check_on_every_architecture(instance):
    table, limits, rules, *_ = instance
    every = np.array(list(_all_choices(table)))
    got = feasible_choices(table, every, resolve_limits(table, limits), rules)
    expected = [_meets(table, c, limits) and _meets_rules(table, c, rules) for c in every]
    assert got.tolist() == expected


def test_feasible_choices_holds_any_hashable_attribute_to_one_value():
    blocks = {
        f"b{b}": [
            Choice(f"v{v}", 0.0, {"m": 1}, {"dtype": dtype}) for v, dtype in enumerate(["bf16", "fp8", None])
        ]
        for b in range(2)
    }
    table = Table.from_choices(blocks)
    rules = Rules(same_attributes=("dtype",))
    got = feasible_choices(table, [[0, 0], [0, 1], [1, 2], [2, 2], [1, 1]], [], rules)
    assert got.tolist() == [True, False, True, True, True]
