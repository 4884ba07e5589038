"""Heuristics that make the exact search fast: an incumbent (LP diving + swap local search) and LP probing.

None of them decides the answer: the incumbent only bounds which columns can be fixed, and every
fixing is justified by an LP bound, so the final MIP stays exact (see puzzle/search/exact.py).
"""

from __future__ import annotations

import time

import numpy as np

from puzzle.search.backend import LPSession, RowModel


def rows_hold(problem: RowModel, columns: np.ndarray, values: np.ndarray) -> bool:
    """Whether `values` on `columns` (every other column 0) satisfy every row, to a relative 1e-9."""
    full = np.zeros(len(problem.objective))
    full[columns] = values
    for row in problem.rows:
        activity = float(row.coefs @ full[row.cols])
        scale = 1e-9 * max(1.0, abs(activity))
        if activity < row.lower - scale or activity > row.upper + scale:
            return False
    return True


def dive(
    problem: RowModel,
    columns: np.ndarray,
    max_steps: int,
    deadline: float | None,
    lock_integral: bool = False,
) -> np.ndarray | None:
    """A feasible 0/1 point on `columns` by LP diving, or None: fix the fractional column nearest to 1
    (to 0 if that is infeasible), re-solve warm, until the LP solution is integral. `lock_integral` also
    fixes every column already at 1 at each step (shorter dives, which fail less often on tight budgets
    but stray further from the optimum)."""
    session = LPSession(problem, columns, deadline)
    result = session.solve()
    for _ in range(max_steps):
        if result.status != "optimal" or (deadline is not None and time.perf_counter() > deadline):
            return None
        values = result.values
        fractional = np.flatnonzero((values > 1e-6) & (values < 1 - 1e-6))
        if len(fractional) == 0:
            rounded = np.round(values)
            return rounded if rows_hold(problem, columns, rounded) else None
        if lock_integral:
            for position in np.flatnonzero(values >= 1 - 1e-6):
                session.set_bounds(position, 1.0, 1.0)
        pick = fractional[np.argmax(values[fractional])]
        session.set_bounds(pick, 1.0, 1.0)
        result = session.solve()
        if result.status == "infeasible":
            session.set_bounds(pick, 0.0, 0.0)
            result = session.solve()
    return None


def improve(
    problem: RowModel,
    columns: np.ndarray,
    values: np.ndarray,
    block_of_column: np.ndarray,
    num_block_rows: int,
    deadline: float | None,
    max_rounds: int = 500,
) -> np.ndarray:
    """Best-improvement local search from a feasible 0/1 point: swap one block's variant, or two blocks'
    at once (moving budget from one block to another), while every row holds.

    `block_of_column[k]` is the block of columns[k], or -1 for a rule column (held at its value).
    The first `num_block_rows` rows are the one-variant-per-block rows, which swaps keep by construction.
    """
    is_variant = block_of_column >= 0
    variant_positions = np.flatnonzero(is_variant)
    blocks = block_of_column[variant_positions]
    cost = problem.objective[columns[variant_positions]]
    # Every other row as dense coefficients on the variant columns, rule columns folded into a constant.
    position = -np.ones(len(problem.objective), dtype=np.int64)
    position[columns] = np.arange(len(columns))
    rows = problem.rows[num_block_rows:]
    matrix = np.zeros((len(rows), len(variant_positions)))
    constant = np.zeros(len(rows))
    variant_index = -np.ones(len(columns), dtype=np.int64)
    variant_index[variant_positions] = np.arange(len(variant_positions))
    for r, row in enumerate(rows):
        local = position[row.cols]
        present = local >= 0
        local, coefs = local[present], row.coefs[present]
        target = variant_index[local]
        np.add.at(matrix[r], target[target >= 0], coefs[target >= 0])
        constant[r] = float(coefs[target < 0] @ values[local[target < 0]])
    lower = np.array([row.lower for row in rows])
    upper = np.array([row.upper for row in rows])
    finite = np.where(np.isfinite(lower), np.abs(lower), 0.0) + np.where(
        np.isfinite(upper), np.abs(upper), 0.0
    )
    tolerance = 1e-9 * np.maximum(1.0, finite)
    chosen_values = values[variant_positions].copy()
    num_blocks = int(blocks.max()) + 1 if len(blocks) else 0
    current = np.full(num_blocks, -1)
    current[blocks[chosen_values > 0.5]] = np.flatnonzero(chosen_values > 0.5)
    activity = matrix @ chosen_values + constant

    def feasible(new_activity: np.ndarray) -> np.ndarray:
        return np.all(
            (new_activity >= (lower - tolerance)[:, None]) & (new_activity <= (upper + tolerance)[:, None]),
            axis=0,
        )

    for _ in range(max_rounds):
        if deadline is not None and time.perf_counter() > deadline:
            break
        incumbent_of_block = current[blocks]
        movable = incumbent_of_block != np.arange(len(blocks))
        delta = matrix - matrix[:, incumbent_of_block]  # [rows, moves]: swap block b to variant j
        gain = cost - cost[incumbent_of_block]  # < 0 improves
        eps = 1e-12 * max(1.0, float(np.abs(cost).max()))
        single = movable & (gain < -eps) & feasible(activity[:, None] + delta)
        best_gain, best_move = 0.0, None
        if single.any():
            j = int(np.flatnonzero(single)[np.argmin(gain[single])])
            best_gain, best_move = float(gain[j]), (j,)
        # Pairs: an improving move made feasible by a second move in another block.
        improving = np.flatnonzero(movable & (gain < -eps))
        partners = np.flatnonzero(movable)
        for i in improving:
            total = gain[i] + gain[partners]
            ok = (total < best_gain - eps) & (blocks[partners] != blocks[i])
            if not ok.any():
                continue
            candidates = partners[ok]
            fits = feasible(activity[:, None] + delta[:, [i]] + delta[:, candidates])
            if fits.any():
                k = int(candidates[fits][np.argmin(total[ok][fits])])
                best_gain, best_move = float(gain[i] + gain[k]), (int(i), k)
        if best_move is None:
            break
        for j in best_move:
            activity += delta[:, j]
            b = blocks[j]
            chosen_values[current[b]] = 0.0
            chosen_values[j] = 1.0
            current[b] = j
    improved = values.copy()
    improved[variant_positions] = chosen_values
    return improved


def probe(
    problem: RowModel,
    columns: np.ndarray,
    is_variant: np.ndarray,
    incumbent: float,
    slack: float,
    deadline: float | None,
) -> np.ndarray:
    """Columns (a mask over `columns`) that no solution better than `incumbent` uses: the LP with the
    column forced to 1 is infeasible or bounded above the incumbent. Reduced costs first, then one warm
    LP per remaining variant column; each fixing tightens the later probes (still valid: a fixed column
    is in no solution better than the incumbent)."""
    session = LPSession(problem, columns, deadline)
    root = session.solve()
    fixed = np.zeros(len(columns), dtype=bool)
    if root.status != "optimal":
        return fixed
    fixed |= is_variant & (root.reduced_costs > incumbent - root.objective + slack)
    for position in np.flatnonzero(fixed):
        session.set_bounds(position, 0.0, 0.0)
    candidates = np.flatnonzero(is_variant & ~fixed & (root.values < 1 - 1e-9))
    for position in candidates[np.argsort(-root.reduced_costs[candidates])]:
        if deadline is not None and time.perf_counter() > deadline:
            break
        session.set_bounds(position, 1.0, 1.0)
        result = session.solve()
        if result.status == "infeasible" or (
            result.status == "optimal" and result.objective > incumbent + slack
        ):
            fixed[position] = True
            session.set_bounds(position, 0.0, 0.0)
        else:
            session.set_bounds(position, 0.0, 1.0)
    return fixed
