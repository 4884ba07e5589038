"""Budgets in seconds (1e-3 .. 1e-6) and in bytes (~1e11) are held to a relative 1e-9 of the bound by every
path of the search and by `feasible_choices` (the baselines'), against brute force over a tiny space.

Each instance puts the architecture of the best score just outside its bound, by a relative `excess` that an
absolute tolerance of 1e-6 (the old `feasible_choices`, HiGHS's and CBC's rows on seconds), 1e-9 (the
knapsack path on a bound of 1e-6 s) or a relative one of 1e-6 (the old check on bytes, and any solver on a
row scaled to O(1)) let through. The oracle enumerates every architecture and checks the float64 totals.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path

import numpy as np
import pytest

from puzzle.cost.limits import Bound
from puzzle.search import Choice, InfeasibleError, Rules, SolverOptions, Table, search
from puzzle.search.mip import feasible_choices, resolve_limits

BLOCKS, VARIANTS = 4, 3
RTOL = 1e-9  # puzzle.cost.limits.BOUND_RTOL, restated: the test holds the search to the documented figure


def _instance(magnitude: float, excess: float, side: str, seed: int, shared: bool):
    """(table, bound, the best-scoring architecture) where that architecture misses the bound by `excess`
    (relative). Costs per block ~ magnitude / BLOCKS, a fixed part of 5% (embeddings, lm_head); scores
    random. `shared`: every variant carries one state size, so the rules add columns (the MIP path)."""
    rng = np.random.default_rng(seed)
    blocks = {}
    for b in range(BLOCKS):
        costs = magnitude / BLOCKS * rng.uniform(0.3, 1.0, VARIANTS)
        scores = rng.uniform(0.0, 1.0, VARIANTS)
        attrs = {"state_size": 128} if shared else {}
        blocks[f"block_{b}"] = [
            Choice(f"v{j}", float(scores[j]), {"cost": float(costs[j])}, attrs) for j in range(VARIANTS)
        ]
    fixed = {"cost": 0.05 * magnitude}
    table = Table.from_choices(blocks, fixed=fixed)
    every = list(itertools.product(range(VARIANTS), repeat=BLOCKS))
    # The best score among architectures on the wrong side of a bound at their own total: for an upper
    # bound the best overall that is not also the cheapest, for a lower bound the best that is not the dearest.
    totals = {c: table.totals(c)["cost"] for c in every}
    objective = {c: float(sum(table.score[table.offsets[b] + j] for b, j in enumerate(c))) for c in every}
    extreme = min(totals.values()) if side == "upper" else max(totals.values())
    best = min((c for c in every if totals[c] != extreme), key=objective.get)
    if side == "upper":
        bound = Bound("cost", upper=totals[best] / (1.0 + excess))
    else:
        bound = Bound("cost", lower=totals[best] / (1.0 - excess))
    return table, bound, best, every, totals, objective


def _meets(total: float, bound: Bound) -> bool:
    if bound.upper is not None:
        return total <= bound.upper * (1.0 + RTOL)
    return total >= bound.lower * (1.0 - RTOL)


CASES = [
    # (magnitude, excess): seconds, each missed by an amount below 1e-6 absolute (the old check's slack on
    # a bound below 1); the 1e-6 s bound by 1e-10 s, below the knapsack path's old 1e-9 absolute slack too.
    (1e-3, 3e-4),
    (1e-4, 1e-4),
    (1e-6, 1e-4),
    # bytes: missed by 1e4 bytes (1e-7 relative, inside the old check's relative 1e-6) and by 5e-7 (inside
    # a solver's tolerance on a row scaled to O(1), so the search must re-solve tightened), and by 2e-9.
    (1e11, 1e-7),
    (1e11, 5e-7),
    (1e11, 2e-9),
]
PATHS = {
    "knapsack": (SolverOptions(gap_rel=0.0), False),
    "mip-highs": (SolverOptions(gap_rel=0.0, solver="highs"), True),
    "mip-cbc": (SolverOptions(gap_rel=0.0, solver="cbc"), True),
    "reduced-mip-highs": (SolverOptions(gap_rel=0.0, solver="highs", heuristics=False), False),
    "reduced-mip-cbc": (SolverOptions(gap_rel=0.0, solver="cbc", heuristics=False), False),
    "plain-mip-highs": (SolverOptions(gap_rel=0.0, solver="highs", fixing=False), False),
}


@pytest.mark.parametrize("side", ["upper", "lower"])
@pytest.mark.parametrize("magnitude, excess", CASES)
def test_feasible_choices_refuses_an_architecture_just_outside_its_bound(magnitude, excess, side):
    table, bound, best, every, totals, _ = _instance(magnitude, excess, side, seed=0, shared=False)
    got = feasible_choices(table, np.array(every), resolve_limits(table, [bound]), Rules())
    assert got.tolist() == [_meets(totals[c], bound) for c in every]
    assert not got[every.index(best)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("side", ["upper", "lower"])
@pytest.mark.parametrize("magnitude, excess", CASES)
def test_every_search_path_returns_the_best_architecture_inside_the_bound(magnitude, excess, side, path):
    options, shared = PATHS[path]
    for seed in range(3):
        table, bound, best, every, totals, objective = _instance(magnitude, excess, side, seed, shared)
        feasible = [c for c in every if _meets(totals[c], bound)]
        rules = Rules(shared_state_size=shared)
        solution = search(table, [bound], rules, options)
        assert solution.choices != best
        assert _meets(solution.totals["cost"], bound), (solution.totals["cost"], bound)
        assert solution.objective == pytest.approx(min(objective[c] for c in feasible), abs=1e-12)


@pytest.mark.parametrize("path", PATHS)
def test_an_answer_the_solver_takes_but_the_bound_does_not_is_solved_again_tightened(path, caplog):
    """A two-sided bound 0.5e11 <= cost <= 50 x that, the best architecture 1e-8 of the lower bound short of
    it: the row is scaled by its upper bound, so the solvers (and the knapsack path) take it (1e-8 of the
    lower bound is 2e-10 of the upper); the search re-solves with the lower bound tightened (logged) and
    returns the brute-force optimum."""
    options, shared = PATHS[path]
    table, lower, best, every, totals, objective = _instance(1e11, 1e-8, "lower", 0, shared)
    bound = Bound("cost", lower=lower.lower, upper=50 * lower.lower)
    with caplog.at_level(logging.INFO, logger="puzzle.search.exact"):
        solution = search(table, [bound], Rules(shared_state_size=shared), options)
    feasible = [c for c in every if totals[c] >= bound.lower * (1.0 - RTOL)]
    assert solution.choices != best and totals[solution.choices] >= bound.lower * (1.0 - RTOL)
    assert solution.objective == pytest.approx(min(objective[c] for c in feasible), abs=1e-12)
    assert any("solving again with the bound tightened" in r.getMessage() for r in caplog.records)


def test_a_bound_no_architecture_meets_to_its_tolerance_is_infeasible():
    """Every architecture above an upper bound by at least 2e-9 of it: infeasible, whichever path."""
    table, _, _, _, totals, _ = _instance(1e-6, 0.0, "upper", seed=0, shared=False)
    bound = Bound("cost", upper=min(totals.values()) / (1.0 + 2e-9))
    for options, shared in PATHS.values():
        with pytest.raises(InfeasibleError):
            search(table, [bound], Rules(shared_state_size=shared), options)


SUPER = Path(__file__).resolve().parents[1] / "examples" / "parents" / "nemotron3_super"


def test_the_cost_models_batch_at_a_speed_and_requests_that_fit_hold_the_same_tolerance():
    """Super on 8 x B200 at 8K in / 64K out: a speed 5e-10 above what its largest batch reaches still keeps
    that batch (the search's `user_speed` row takes it), 5e-9 above does not; the same for memory: usable
    memory 5e-10 short of R requests still holds R, 5e-9 short does not."""
    from puzzle import nemotron_h
    from puzzle.cost import Scenario, max_batch_at_speed, max_concurrent_requests, model_performance
    from puzzle.cost.analytic import model_weight_bytes, state_bytes_per_request
    from puzzle.cost.hardware import get_hardware

    spec = nemotron_h.spec_from_config(nemotron_h.read_config(SUPER))
    scenario = Scenario(1, 8192, 65536, recipe="nvfp4", compute_dtype="nvfp4")
    first = max_batch_at_speed(spec, scenario, "8xb200", user_speed=500.0)
    assert first.limited_by == "speed" and first.batch > 1
    at_batch = model_performance(spec, dataclasses.replace(scenario, batch_size=first.batch), "8xb200")
    reached = at_batch.per_user_tokens_per_s
    assert max_batch_at_speed(spec, scenario, "8xb200", user_speed=reached * (1 + 5e-10)).batch == first.batch
    assert max_batch_at_speed(spec, scenario, "8xb200", user_speed=reached * (1 + 5e-9)).batch < first.batch

    context, capacity = 1_000_000, get_hardware("h100-80gb").memory_bytes
    need = model_weight_bytes(spec, "nvfp4") + 3 * state_bytes_per_request(spec, context, "fp8")
    for short, expected in ((5e-10, 3), (5e-9, 2)):
        fraction = need / (1 + short) / capacity
        assert max_concurrent_requests(spec, "h100-80gb", context, "nvfp4", "fp8", fraction) == expected
