"""The search MIP: choose one variant per block to optimise the summed score under budgets and global rules.

A grouped (multiple-choice) knapsack, solved exactly and fast:
1. presolve: per block, drop variants another one beats or ties in score and every budgeted cost;
2. the LP relaxation (HiGHS) gives a bound z_LP and reduced costs r;
3. an incumbent z_inc (LP diving, then one- and two-block swap local search; re-checked on every row);
4. every variable with r > z_inc - z_LP is fixed to 0 (an LP argument: any solution using it costs more
   than z_inc), then LP probing fixes each remaining variable whose LP with it forced to 1 exceeds z_inc;
5. one MIP (HiGHS through PuLP, CBC when highspy is missing) on what is left, with z_inc as HiGHS's
   cutoff; skipped when z_inc is within gap_rel of z_LP or one variant per block is left. Every fixing
   only removed solutions worse than z_inc, so the MIP's optimum (or z_inc) is the whole problem's.
Without highspy (or with heuristics off) step 3-4 become: fix r > g for a guessed g, solve, and accept
the answer z when z - z_LP <= g; otherwise set g = z - z_LP and solve once more (which then certifies).
The gap reported is proven: the least of the bounds behind each fixing (z_inc, or z_LP + g) and the
reduced MIP's dual bound, never below z_LP; "optimal" means that gap is within gap_rel.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from puzzle.budget import Limit
from puzzle.search_backend import (
    REDUCED_MIP_HIGHS_OPTIONS,
    Row,
    RowModel,
    highspy,
    solve_lp,
    solve_with_pulp,
)
from puzzle.search_heuristics import dive, improve, probe, rows_hold
from puzzle.search_types import (
    Choice,
    InfeasibleError,
    Rules,
    SearchError,
    Solution,
    SolverOptions,
    Table,
)

__all__ = [
    "Choice",
    "InfeasibleError",
    "Rules",
    "SearchError",
    "Solution",
    "SolverOptions",
    "Table",
    "search",
    "search_k",
]

_log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ the problem


@dataclass
class _Problem(RowModel):
    """The MIP for one search: RowModel's objective and rows, plus the table and the columns still alive.

    Columns 0..N-1 are the table's variants, N.. the rule binaries."""

    table: Table | None = None
    alive: np.ndarray | None = None  # [N + Z] bool: columns not removed by keep/presolve
    num_rule_columns: int = 0
    dropped: int = 0
    round_off: float = 1e-9  # objective differences below this are solver round-off (1e-9 of its range)


def _tolerance(value: float) -> float:
    return 1e-9 * max(1.0, abs(value))


def _resolve_limits(table: Table, limits: Sequence[Limit]) -> list[tuple[Limit, float | None, float | None]]:
    """(limit, lower, upper) on the blocks' sum: absolute totals minus the fixed part."""
    resolved = []
    for limit in limits:
        table.cost(limit.key)  # a clear error if the key is unknown
        lower, upper = limit.resolved(table.parent_total(limit.key))
        fixed = table.fixed.get(limit.key, 0.0)
        resolved.append(
            (limit, None if lower is None else lower - fixed, None if upper is None else upper - fixed)
        )
    return resolved


def _keep_indices(table: Table, rules: Rules) -> list[int]:
    blocks = []
    for block in rules.keep_blocks:
        if isinstance(block, int) and not isinstance(block, bool):
            if not 0 <= block < table.num_blocks:
                raise SearchError(f"keep block {block} is out of range (0..{table.num_blocks - 1})")
            blocks.append(block)
        elif block in table.block_names:
            blocks.append(table.block_names.index(block))
        else:
            raise SearchError(
                f"keep block {block!r} is not a block of this table; blocks: {list(table.block_names)[:8]}..."
            )
    return blocks


def _attention_indicator(table: Table) -> np.ndarray:
    kinds = table.attrs.get("kind")
    if kinds is None:
        return np.zeros(table.num_variants)
    return np.array([kind == "attention" for kind in kinds], dtype=np.float64)


def _build_problem(
    table: Table,
    objective: np.ndarray,
    bounds: Sequence[tuple[str, np.ndarray, float | None, float | None]],
    rules: Rules,
    previous: Sequence[Sequence[int]] = (),
    min_diff: int = 1,
    presolve: bool = True,
) -> _Problem:
    """Rows and alive columns for: minimise objective.x under `bounds` [(label, costs, lo, hi)] and `rules`."""
    n_var = table.num_variants
    alive = np.ones(n_var, dtype=bool)
    for block in _keep_indices(table, rules):
        start, stop = table.offsets[block], table.offsets[block + 1]
        alive[start + 1 : stop] = False

    bounds = list(bounds)
    if rules.min_attention_blocks > 0:
        bounds.append(
            (
                f"attention_blocks>={rules.min_attention_blocks}",
                _attention_indicator(table),
                rules.min_attention_blocks,
                None,
            )
        )

    shared = rules.shared_attributes()
    dropped = 0
    if presolve and not previous:
        dominated = _dominated(table, objective, bounds, shared, alive)
        dropped = int(dominated.sum())
        alive &= ~dominated

    rows: list[Row] = []
    for block in range(table.num_blocks):
        cols = np.arange(table.offsets[block], table.offsets[block + 1])
        rows.append(
            Row(cols, np.ones(len(cols)), 1.0, 1.0, f"one variant for block {table.block_names[block]!r}")
        )
    for label, costs, lower, upper in bounds:
        rows.append(
            Row(
                np.arange(n_var),
                costs,
                -math.inf if lower is None else lower,
                math.inf if upper is None else upper,
                label,
            )
        )

    # One binary per value of each shared attribute; a variant with that value needs its binary.
    rule_objective: list[float] = []
    next_column = n_var
    for attr in shared:
        values = table.attrs.get(attr)
        if values is None:
            continue
        codes = {value for value, ok in zip(values, alive) if ok and value is not None}
        value_columns = {}
        for value in sorted(codes, key=repr):
            value_columns[value] = next_column
            next_column += 1
            rule_objective.append(0.0)
        if not value_columns:
            continue
        rows.append(
            Row(
                np.array(list(value_columns.values())),
                np.ones(len(value_columns)),
                -math.inf,
                1.0,
                f"one {attr}",
            )
        )
        value_array = np.array(
            [value_columns.get(value, -1) if value is not None else -1 for value in values]
        )
        for block in range(table.num_blocks):
            start, stop = table.offsets[block], table.offsets[block + 1]
            block_values = value_array[start:stop]
            for column in np.unique(block_values[block_values >= 0]):
                members = start + np.flatnonzero(block_values == column)
                rows.append(
                    Row(
                        np.append(members, column),
                        np.append(np.ones(len(members)), -1.0),
                        -math.inf,
                        0.0,
                        f"same {attr}",
                    )
                )

    for index, earlier in enumerate(previous):
        cols = table.offsets[:-1] + np.asarray(earlier)
        rows.append(
            Row(
                cols,
                np.ones(len(cols)),
                -math.inf,
                float(table.num_blocks - min_diff),
                f"differs from solution {index + 1}",
            )
        )

    # Solvers stop on absolute tolerances too (HiGHS mip_abs_gap 1e-6, CBC's cutoff increment ~1e-4),
    # which on KL sums of ~0.05 would end the search well short of a 1e-6 relative gap: scale the
    # objective so that its largest possible total is ~1e6. Reported objectives come from the table.
    spread = sum(
        float(np.abs(objective[table.offsets[b] : table.offsets[b + 1]]).max())
        for b in range(table.num_blocks)
    )
    scale = 1e6 / spread if spread > 0 else 1.0
    full_objective = np.concatenate([objective * scale, np.array(rule_objective)])
    full_alive = np.concatenate([alive, np.ones(next_column - n_var, dtype=bool)])
    round_off = 1e-9 * spread * scale if spread > 0 else 1e-12
    return _Problem(full_objective, rows, table, full_alive, next_column - n_var, dropped, round_off)


def _dominated(
    table: Table,
    objective: np.ndarray,
    bounds: Sequence[tuple[str, np.ndarray, float | None, float | None]],
    shared: Sequence[str],
    alive: np.ndarray,
) -> np.ndarray:
    """Variants that another alive variant of the same block beats or ties in every respect.

    w dominates v when w's objective and every bounded cost are no worse (<= for upper bounds, >= for
    lower bounds, equal for two-sided bounds), w's shared attributes are the same as v's or free, and
    w is strictly better somewhere or comes first (so exactly one of several identical variants stays).
    """
    features = [objective]
    for _, costs, lower, upper in bounds:
        if upper is not None:
            features.append(costs)
        if lower is not None:
            features.append(-costs)
    matrix = np.stack(features, axis=1)  # [N, F], smaller is better everywhere
    codes = []
    for attr in shared:
        values = table.attrs.get(attr)
        if values is None:
            continue
        lookup: dict[Hashable, int] = {}
        codes.append(
            np.array([-1 if value is None else lookup.setdefault(value, len(lookup)) for value in values])
        )
    code_matrix = np.stack(codes, axis=1) if codes else np.zeros((table.num_variants, 0), dtype=np.int64)

    def beats(winners: np.ndarray, losers: np.ndarray, square: bool = False) -> np.ndarray:
        """[w, l]: variant winners[w] beats losers[l] (no worse everywhere, and better or earlier).
        `square`: winners and losers are the same list (exact ties then come from one transpose)."""
        won, lost = matrix[winners], matrix[losers]
        no_worse = np.ones((len(winners), len(losers)), dtype=bool)
        for f in range(matrix.shape[1]):  # one feature at a time keeps the temporaries [w, l]
            no_worse &= won[:, f, None] <= lost[None, :, f]
        if square:
            equal = no_worse & no_worse.T
        else:
            equal = no_worse.copy()
            for f in range(matrix.shape[1]):
                equal &= won[:, f, None] >= lost[None, :, f]
        # Of several identical variants only the earliest wins, so exactly one of them stays.
        result = no_worse & (~equal | (winners[:, None] < losers[None, :]))
        for code in code_matrix.T:
            result &= (code[winners, None] == code[None, losers]) | (code[winners, None] == -1)
        return result

    # "Beats" is a strict partial order, so a variant beaten by anyone is beaten by an unbeaten one. First
    # a cheap pass against a few strong candidates (the best few in each feature) drops most of the
    # dominated variants; then the survivors are compared with each other (exact, and m'^2 << m^2).
    few = 8
    dominated = np.zeros(table.num_variants, dtype=bool)
    for block in range(table.num_blocks):
        start, stop = int(table.offsets[block]), int(table.offsets[block + 1])
        members = start + np.flatnonzero(alive[start:stop])
        if len(members) < 2:
            continue
        if len(members) > 4 * few:
            best = np.argsort(matrix[members], axis=0, kind="stable")[:few]
            strong = members[np.unique(best)]
            members = members[~beats(strong, members).any(axis=0)]
            dominated[start:stop] |= alive[start:stop]
            dominated[members] = False
        pairwise = beats(members, members, square=True)
        np.fill_diagonal(pairwise, False)
        dominated[members[pairwise.any(axis=0)]] = True
    return dominated


# -------------------------------------------------------------------------------------------- solving


@dataclass
class _Outcome:
    """A solve's answer: the choices (None: no solution), status, proven relative gap, free columns."""

    choices: tuple[int, ...] | None
    status: str
    gap: float | None
    free: int


def _extract(problem: _Problem, columns: np.ndarray, values: np.ndarray) -> tuple[int, ...]:
    table = problem.table
    chosen = np.zeros(len(problem.objective))
    chosen[columns] = values
    picks = []
    for block in range(table.num_blocks):
        start, stop = table.offsets[block], table.offsets[block + 1]
        picks.append(int(np.argmax(chosen[start:stop])))
    return tuple(picks)


def proven_gap(objective: float, bound: float | None, round_off: float) -> float | None:
    """(objective - bound) / |objective| for a minimisation, 0 when the difference is within `round_off`
    (solver tolerance), None without a bound. `round_off` also floors the denominator (objective ~ 0)."""
    if bound is None or not math.isfinite(bound):
        return None
    difference = objective - bound
    if difference <= round_off:
        return 0.0
    return difference / max(abs(objective), round_off)


def _finish(
    problem: _Problem, choices: tuple[int, ...], bound: float | None, free: int, gap_rel: float
) -> _Outcome:
    """The outcome for `choices` given a proven lower `bound` on the whole problem's (scaled) objective:
    "optimal" exactly when the proven gap is at most `gap_rel`, else "time_limit"."""
    rows = problem.table.offsets[:-1] + np.asarray(choices)
    objective = float(problem.objective[rows].sum())
    gap = proven_gap(objective, bound, problem.round_off)
    return _Outcome(choices, "optimal" if gap is not None and gap <= gap_rel else "time_limit", gap, free)


def _best_bound(lp_bound: float, *bounds: float | None) -> float:
    """The whole problem's lower bound from the parts it was split into (min over the parts, each None =
    unknown), never below the LP bound, which holds for everything."""
    parts = [-math.inf if bound is None else bound for bound in bounds]
    return max(lp_bound, min(parts))


def _solve_plain(problem: _Problem, options: SolverOptions, deadline: float | None) -> _Outcome:
    """The MIP on every alive column, as the solver gives it."""
    alive = np.flatnonzero(problem.alive)
    result = solve_with_pulp(problem, alive, True, options.solver_name(), options.gap_rel, deadline)
    if result.values is None:
        return _Outcome(None, result.status, None, len(alive))
    choices = _extract(problem, alive, result.values)
    return _finish(problem, choices, result.bound, len(alive), options.gap_rel)


def _solve_problem(problem: _Problem, options: SolverOptions, deadline: float | None) -> _Outcome:
    """Optimise `problem` exactly: LP bound, reduced-cost fixing, reduced MIP, certificate (see module doc).

    The reported gap is proven for the whole problem: every fixing step records the bound it rests on
    (solutions it removed cost at least that), and the whole bound is the least of those and the reduced
    MIP's own bound (and never below the LP's)."""
    solver_name = options.solver_name()
    alive = np.flatnonzero(problem.alive)
    n_var = problem.table.num_variants
    if not options.fixing:
        return _solve_plain(problem, options, deadline)

    lp = solve_lp(problem, alive, solver_name, deadline)
    if lp.status == "infeasible":
        return _Outcome(None, "infeasible", None, 0)
    if lp.status != "optimal" or lp.reduced_costs is None or lp.objective is None:
        return _solve_plain(problem, options, deadline)  # the LP did not finish cleanly

    lp_bound = lp.objective
    reduced = lp.reduced_costs.copy()
    is_variant = alive < n_var
    # Numerical slack so that a reduced cost a hair above g (simplex round-off) never cuts the optimum.
    slack = 1e-7 * max(1.0, abs(lp_bound)) + 1e-9
    # First guess: keep about 4 variables per block (the LP support plus its nearest neighbours).
    target = min(int(is_variant.sum()), 4 * problem.table.num_blocks + 50)
    sorted_costs = np.sort(reduced[is_variant])
    threshold = max(float(sorted_costs[target - 1]) if target > 0 else 0.0, slack)
    if highspy is not None and options.heuristics and solver_name == "highs":
        # With an incumbent the fixing is certified at once (threshold = incumbent - LP bound), and
        # probing shrinks the free set further before the only MIP. Not for CBC: its fast branch and
        # bound on the guessed fixing certified sooner than diving + probing in every benchmark row.
        initial = alive[(reduced <= threshold + slack) | ~is_variant | (lp.values > 1e-9)]
        incumbent = _incumbent(problem, initial, deadline)
        if incumbent is not None:
            return _solve_from_incumbent(problem, options, deadline, alive, lp, incumbent, initial, slack)
    for _ in range(60):
        free_mask = (reduced <= threshold + slack) | ~is_variant | (lp.values > 1e-9)
        columns = alive[free_mask]
        everything = len(columns) == len(alive)
        result = solve_with_pulp(
            problem,
            columns,
            True,
            solver_name,
            options.gap_rel,
            deadline,
            highs_options=REDUCED_MIP_HIGHS_OPTIONS,
        )
        if result.values is None:
            if result.status == "infeasible" and not everything:
                threshold = max(
                    threshold * 4.0,
                    float(np.quantile(sorted_costs, min(1.0, 4 * len(columns) / len(sorted_costs)))),
                )
                continue
            return _Outcome(None, result.status, None, len(columns))
        choices = _extract(problem, columns, result.values)
        objective = float(problem.objective[columns] @ result.values)
        # A fixed column has reduced cost > threshold + slack: every solution using it costs at least this.
        fixed_bound = math.inf if everything else lp_bound + threshold + slack
        certified = objective <= fixed_bound
        _log.debug(
            "LP bound %.9g, reduced MIP %.9g (%s), threshold %.3g, %d free columns",
            lp_bound,
            objective,
            result.status,
            threshold,
            len(columns),
        )
        if certified or result.status != "optimal":
            bound = _best_bound(lp_bound, result.bound, fixed_bound)
            return _finish(problem, choices, bound, len(columns), options.gap_rel)
        threshold = objective - lp_bound + slack
    raise SearchError("reduced-cost fixing did not converge")  # pragma: no cover - bounded by the loop


def _incumbent(problem: _Problem, columns: np.ndarray, deadline: float | None) -> np.ndarray | None:
    """The best of two LP dives (free and locking), each improved by swap local search; 0/1 values on
    `columns`, or None when both dives fail. Every candidate is re-checked on every row: the fixing's
    certificate rests on the incumbent being feasible."""
    n_var = problem.table.num_variants
    block_of_column = np.where(columns < n_var, problem.table.block_of[np.minimum(columns, n_var - 1)], -1)
    best, best_value = None, math.inf
    for lock in (False, True):
        start = dive(problem, columns, 4 * problem.table.num_blocks + 20, deadline, lock_integral=lock)
        if start is None:
            continue
        improved = improve(problem, columns, start, block_of_column, problem.table.num_blocks, deadline)
        for candidate in (improved, start):
            value = float(problem.objective[columns] @ candidate)
            if value < best_value and rows_hold(problem, columns, candidate):
                best, best_value = candidate, value
                break
    return best


def _solve_from_incumbent(
    problem: _Problem,
    options: SolverOptions,
    deadline: float | None,
    alive: np.ndarray,
    lp,
    incumbent_values: np.ndarray,
    incumbent_columns: np.ndarray,
    slack: float,
) -> _Outcome:
    """Reduced-cost fixing against a known incumbent (certified by construction), probing, one MIP."""
    incumbent = float(problem.objective[incumbent_columns] @ incumbent_values)
    is_variant = alive < problem.table.num_variants
    threshold = max(incumbent - lp.objective, 0.0)
    columns = alive[(lp.reduced_costs <= threshold + slack) | ~is_variant | (lp.values > 1e-9)]
    fixed = probe(problem, columns, columns < problem.table.num_variants, incumbent, slack, deadline)
    columns = columns[~fixed]
    # Reduced-cost fixing and probing removed only columns whose LP bound exceeds incumbent + slack.
    fixed_bound = incumbent + slack
    incumbent_choices = _extract(problem, incumbent_columns, incumbent_values)
    variant_columns = columns[columns < problem.table.num_variants]
    if len(variant_columns) == problem.table.num_blocks:
        # Fixing left one variant per block (every block keeps the incumbent's): nothing else remains.
        return _finish(problem, incumbent_choices, incumbent, len(columns), options.gap_rel)
    lp_gap = proven_gap(incumbent, lp.objective, problem.round_off)
    if lp_gap is not None and lp_gap <= options.gap_rel:
        return _finish(problem, incumbent_choices, lp.objective, len(columns), options.gap_rel)
    # The incumbent is the MIP's cutoff (HiGHS prunes every node whose bound reaches it); the slack
    # keeps the incumbent itself below the cutoff, so the MIP normally returns it or something better.
    cutoff = incumbent + slack
    result = solve_with_pulp(
        problem,
        columns,
        True,
        options.solver_name(),
        options.gap_rel,
        deadline,
        cutoff=cutoff,
        highs_options=REDUCED_MIP_HIGHS_OPTIONS,
    )
    _log.debug(
        "LP bound %.9g, incumbent %.9g, %d free columns after fixing and probing, MIP %s",
        lp.objective,
        incumbent,
        len(columns),
        result.status,
    )
    if result.status == "infeasible":
        # Nothing below the cutoff among the free columns: the incumbent is optimal.
        return _finish(problem, incumbent_choices, incumbent, len(columns), options.gap_rel)
    bound = _best_bound(lp.objective, result.bound, fixed_bound)
    if result.values is None:
        # The MIP stopped (time limit) without a solution: the incumbent is what there is.
        return _finish(problem, incumbent_choices, bound, len(columns), options.gap_rel)
    objective = float(problem.objective[columns] @ result.values)
    # No better than the incumbent (within the MIP's tolerance): keep the incumbent.
    choices = incumbent_choices if objective > incumbent else _extract(problem, columns, result.values)
    return _finish(problem, choices, bound, len(columns), options.gap_rel)


def _check(table: Table, choices: Sequence[int], resolved, rules: Rules) -> None:
    """The solver's answer is re-checked on the tables, never trusted blindly."""
    totals = table.totals(choices)
    for limit, lower, upper in resolved:
        total = totals[limit.key] - table.fixed.get(limit.key, 0.0)
        if upper is not None and total > upper + 1e-6 * max(1.0, abs(upper)):
            raise SearchError(f"internal error: solution breaks {limit} ({total} > {upper})")
        if lower is not None and total < lower - 1e-6 * max(1.0, abs(lower)):
            raise SearchError(f"internal error: solution breaks {limit} ({total} < {lower})")
    rows = table.offsets[:-1] + np.asarray(choices)
    for attr in rules.shared_attributes():
        values = table.attrs.get(attr)
        if values is not None and len({values[row] for row in rows if values[row] is not None}) > 1:
            raise SearchError(f"internal error: solution mixes {attr} values")


def _make_solution(
    table: Table, choices: tuple[int, ...], outcome: _Outcome, solver: str, seconds: float, dropped: int
) -> Solution:
    rows = table.offsets[:-1] + np.asarray(choices)
    return Solution(
        choices=choices,
        names={
            block: table.variant_names[b][c] for b, (block, c) in enumerate(zip(table.block_names, choices))
        },
        objective=float(table.score[rows].sum()),
        totals=table.totals(choices),
        status=outcome.status,
        gap=outcome.gap,
        solver=solver,
        seconds=seconds,
        presolve_dropped=dropped,
        free_variables=outcome.free,
    )


def _objective_vector(table: Table) -> np.ndarray:
    return -table.score if table.maximize else table.score


def search(
    table: Table,
    limits: Sequence[Limit] = (),
    rules: Rules | None = None,
    options: SolverOptions | None = None,
    previous: Sequence[Sequence[int]] = (),
    min_diff: int = 1,
) -> Solution:
    """The best architecture under `limits` and `rules` (differing from each of `previous` in >= min_diff blocks).

    Raises InfeasibleError naming the budget that cannot be met and the best value reachable for it.
    """
    rules, options = rules or Rules(), options or SolverOptions()
    started = time.perf_counter()
    deadline = None if options.time_limit_s is None else started + options.time_limit_s
    resolved = _resolve_limits(table, limits)
    bounds = [(str(limit), table.cost(limit.key), lower, upper) for limit, lower, upper in resolved]
    problem = _build_problem(
        table, _objective_vector(table), bounds, rules, previous, min_diff, options.presolve
    )
    outcome = _solve_problem(problem, options, deadline)
    if outcome.choices is None:
        if outcome.status == "infeasible":
            if previous:
                raise InfeasibleError(
                    f"no further architecture differs from the {len(previous)} found in >= {min_diff} blocks",
                    None,
                    None,
                    [],
                )
            raise _diagnose(table, resolved, rules, options)
        raise SearchError(f"the solver stopped without a solution (status {outcome.status})")
    _check(table, outcome.choices, resolved, rules)
    return _make_solution(
        table, outcome.choices, outcome, options.solver_name(), time.perf_counter() - started, problem.dropped
    )


def search_k(
    table: Table,
    limits: Sequence[Limit] = (),
    rules: Rules | None = None,
    options: SolverOptions | None = None,
    k: int = 1,
    min_diff: int = 1,
) -> list[Solution]:
    """Up to k architectures, each the best that differs from every earlier one in >= min_diff blocks.

    The first is `search`'s; fewer than k come back when the library runs out of distinct ones.
    Dominance presolve is used for the first only (a dominated variant may be the second best).
    """
    rules, options = rules or Rules(), options or SolverOptions()
    if k < 1 or min_diff < 1:
        raise SearchError(f"need k >= 1 and min_diff >= 1, found k={k}, min_diff={min_diff}")
    solutions = [search(table, limits, rules, options)]
    while len(solutions) < k:
        try:
            solutions.append(search(table, limits, rules, options, [s.choices for s in solutions], min_diff))
        except InfeasibleError:
            break
    return solutions


def _best_reachable(
    table: Table, costs: np.ndarray, sense: int, bounds, rules: Rules, options: SolverOptions
) -> float | None:
    """min (sense=+1) or max (sense=-1) of the blocks' sum of `costs` under `bounds` and `rules`; None if none."""
    problem = _build_problem(table, sense * costs, bounds, rules, presolve=options.presolve)
    outcome = _solve_problem(problem, options, None)
    if outcome.choices is None:
        return None
    rows = table.offsets[:-1] + np.asarray(outcome.choices)
    return float(costs[rows].sum())


def _diagnose(table: Table, resolved, rules: Rules, options: SolverOptions) -> InfeasibleError:
    """Which budget cannot be met: first each alone (under the rules), then each given all the others."""
    exact = dataclasses.replace(options, time_limit_s=None, gap_rel=0.0)
    zero = np.zeros(table.num_variants)
    if _best_reachable(table, zero, 1, [], rules, exact) is None:
        return InfeasibleError(
            "the global rules cannot be met by this library, whatever the budgets", None, None, []
        )

    def misses(lower, upper, low_best, high_best) -> bool:
        return (upper is not None and low_best > upper + _tolerance(upper)) or (
            lower is not None and high_best < lower - _tolerance(lower)
        )

    def best_pair(index: int, others) -> tuple[float, float, float]:
        limit, lower, upper = resolved[index]
        costs = table.cost(limit.key)
        low = _best_reachable(table, costs, 1, others, rules, exact) if upper is not None else None
        high = _best_reachable(table, costs, -1, others, rules, exact) if lower is not None else None
        fixed = table.fixed.get(limit.key, 0.0)
        # The best value for this budget is the side it misses on (the smallest reachable for an upper bound).
        low = -math.inf if low is None else low
        high = math.inf if high is None else high
        return low, high, fixed

    for together in (False, True):
        details = []
        for index, (limit, lower, upper) in enumerate(resolved):
            others = []
            if together:
                others = [
                    (str(other), table.cost(other.key), lo, hi)
                    for j, (other, lo, hi) in enumerate(resolved)
                    if j != index
                ]
            low, high, fixed = best_pair(index, others)
            if not math.isfinite(low) and not math.isfinite(high):
                continue
            if misses(lower, upper, low, high):
                upper_misses = upper is not None and low > upper + _tolerance(upper)
                best = low if upper_misses else high
                target = f"<= {upper + fixed:g}" if upper_misses else f">= {lower + fixed:g}"
                details.append((str(limit), best + fixed, target))
        if details:
            name, best, target = details[0]
            where = "on its own" if not together else "while the other budgets hold"
            listing = "; ".join(f"{n}: best reachable {b:g}" for n, b, _ in details)
            return InfeasibleError(
                f"budget {name} (total {target}) cannot be met {where}: the best this library reaches is "
                f"{best:g} ({listing})",
                name,
                best,
                [(n, b) for n, b, _ in details],
            )
    names = ", ".join(str(limit) for limit, _, _ in resolved)
    return InfeasibleError(
        f"the budgets {names} cannot be met together under the global rules", None, None, []
    )
