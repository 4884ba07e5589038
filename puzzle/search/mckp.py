"""An exact multiple-choice knapsack solver for searches without rules: bounded dynamic programming over blocks.

Without rule columns the search is a multiple-choice knapsack problem (one variant per block, a few
budget rows `lo_k <= sum a_k x <= hi_k`). Blocks are added one at a time to a set of partial solutions
(states: score so far, each row's total so far). A state is dropped when
- it can no longer meet some row whatever the remaining blocks choose (it holds no feasible solution),
- another state is no worse in score and in every row (one row, one-sided: Pareto dominance), or
- its bound, the score so far plus a lower bound on the remaining blocks, is within the allowed gap of the
  incumbent (every solution through it is no better than incumbent minus the gap).
The bound on the remaining blocks is their LP relaxation for row 0 (exact: the sum of every block's lower
convex hull in the (a_0, score) plane, Sinha-Zoltners), with the other rows moved into the score by fixed
Lagrange multipliers (from maximising the root's Lagrangian dual). Any multipliers give a valid bound, so
the answer is exact; good ones only make it fast. A first pass keeps the best few hundred states per block
(a beam) for an incumbent; the exact pass then proves it or finds better. The least bound of every pruned
state is kept, so the gap reported is the proven one. Too many states: give up (None), the caller falls
back to the MIP.
"""

from __future__ import annotations

import math
import time

import numpy as np

BEAM_WIDTH = 64  # measured on the Llama-70B library: 32-256 all work, 64 fastest
MAX_STATES = 200_000  # per block in the exact pass; beyond it the MIP is the better tool
MAX_WORK = 20_000_000  # candidate states over one pass (about 10 s); beyond it, the MIP too


# With three or more budgets the Lagrangian bound over the extra rows is loose and the DP keeps many
# states: on bench_mip's correlated 88 x 20 instance with 3 budgets the knapsack path took ~2.5 s where the
# MIP proves the optimum in ~0.4 s; with one or two (the real libraries' runtime / memory budgets) it is
# the faster path by 10-30x.
MAX_BUDGET_ROWS = 2


def applies(problem) -> bool:
    """Whether `problem` (a puzzle.search.mip.Problem) is a plain MCKP: no rule columns, and every row after
    the one-per-block rows is a budget row over the variant columns, at most MAX_BUDGET_ROWS of them."""
    table = problem.table
    if table is None or problem.num_rule_columns:
        return False
    n_var = table.num_variants
    budget_rows = problem.rows[table.num_blocks :]
    if len(budget_rows) > MAX_BUDGET_ROWS:
        return False
    return all(len(row.cols) == n_var and not row.label.startswith("differs from") for row in budget_rows)


class _Blocks:
    """The alive variants as a dense [blocks, width] layout (padding is never chosen)."""

    def __init__(self, problem) -> None:
        table = problem.table
        n_var = table.num_variants
        alive = problem.alive[:n_var]
        self.members = [
            table.offsets[b] + np.flatnonzero(alive[table.offsets[b] : table.offsets[b + 1]])
            for b in range(table.num_blocks)
        ]
        rows = problem.rows[table.num_blocks :]
        self.objective = problem.objective[:n_var]
        self.weights = np.zeros((max(1, len(rows)), n_var))  # no budget: one row that always holds
        for k, row in enumerate(rows):
            self.weights[k, row.cols] = row.coefs
        self.lower = np.array([row.lower for row in rows] or [-math.inf])
        self.upper = np.array([row.upper for row in rows] or [math.inf])
        scale = np.where(np.isfinite(self.lower), np.abs(self.lower), 0.0) + np.where(
            np.isfinite(self.upper), np.abs(self.upper), 0.0
        )
        self.tol = 1e-9 * np.maximum(1.0, scale)  # rows_hold's tolerance

    def only(self, row: int) -> _Blocks:
        """The same blocks with row `row` alone (a relaxation)."""
        copy = object.__new__(_Blocks)
        copy.members, copy.objective = self.members, self.objective
        copy.weights, copy.lower = self.weights[[row]], self.lower[[row]]
        copy.upper, copy.tol = self.upper[[row]], self.tol[[row]]
        return copy

    def holds(self, problem, choices: tuple[int, ...]) -> bool:
        """Whether `choices` meet every row (to the rows' tolerance)."""
        flat = problem.table.offsets[:-1] + np.asarray(choices)
        totals = self.weights[:, flat].sum(axis=1)
        return bool(np.all((totals >= self.lower - self.tol) & (totals <= self.upper + self.tol)))

    def reorder(self, first: int) -> None:
        """Make row `first` row 0."""
        order = [first] + [k for k in range(len(self.lower)) if k != first]
        self.weights, self.lower = self.weights[order], self.lower[order]
        self.upper, self.tol = self.upper[order], self.tol[order]


def _dual_value(blocks: _Blocks, multipliers: np.ndarray) -> float:
    """The Lagrangian dual sum_b min_j (c + mu.a) - sum_k pen_k(mu_k) (a lower bound for any mu whose signs
    match the finite sides)."""
    alive = np.concatenate(blocks.members)
    starts = np.cumsum([0] + [len(m) for m in blocks.members[:-1]])
    folded = blocks.objective[alive] + multipliers @ blocks.weights[:, alive]
    total = float(np.minimum.reduceat(folded, starts).sum())
    penalty = 0.0
    for mu, lower, upper in zip(multipliers, blocks.lower, blocks.upper):
        penalty += mu * upper if mu > 0 else mu * lower if mu < 0 else 0.0
    return total - penalty


def _golden_max(function, low: float, high: float, steps: int = 40) -> float:
    """The argmax of a concave function on [low, high] by golden-section search."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = function(c), function(d)
    for _ in range(steps):
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = function(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = function(d)
    return (a + b) / 2


def _full_multipliers(blocks: _Blocks) -> np.ndarray:
    """Multipliers for every row by coordinate-wise golden-section ascent of the Lagrangian dual."""
    mu = np.zeros(len(blocks.lower))
    spread = sum(float(np.ptp(blocks.objective[m])) for m in blocks.members) + 1e-30
    for _ in range(3):
        for k in range(len(mu)):
            ranges = sum(float(np.ptp(blocks.weights[k, m])) for m in blocks.members)
            reach = 4.0 * spread / max(ranges, 1e-30)
            high = reach if math.isfinite(blocks.upper[k]) else 0.0
            low = -reach if math.isfinite(blocks.lower[k]) else 0.0

            def dual(x: float, k: int = k) -> float:
                trial = mu.copy()
                trial[k] = x
                return _dual_value(blocks, trial)

            mu[k] = _golden_max(dual, low, high, steps=30)
    return mu


def _multipliers(blocks: _Blocks) -> np.ndarray:
    """Multipliers for rows 1.. (row 0 is exact in the bound), by coordinate-wise golden-section ascent of
    the Lagrangian dual with row 0's multiplier maximised inside."""
    num_rows = len(blocks.lower)
    mu = np.zeros(num_rows)
    if num_rows < 2:
        return mu
    spread = sum(float(np.ptp(blocks.objective[m])) for m in blocks.members) + 1e-30

    def scale_of(k: int) -> float:
        ranges = sum(float(np.ptp(blocks.weights[k, m])) for m in blocks.members)
        return spread / max(ranges, 1e-30)

    def best_over(k: int, values: np.ndarray) -> float:
        """max over mu_k of the dual, the others held at `values`."""
        sign_high = 1.0 if math.isfinite(blocks.upper[k]) else 0.0
        sign_low = -1.0 if math.isfinite(blocks.lower[k]) else 0.0
        reach = 4.0 * scale_of(k)

        def dual(x: float) -> float:
            trial = values.copy()
            trial[k] = x
            return _dual_value(blocks, trial)

        return _golden_max(dual, sign_low * reach, sign_high * reach, steps=30)

    def inner(values: np.ndarray) -> float:
        values = values.copy()
        values[0] = best_over(0, values)
        return _dual_value(blocks, values)

    for _ in range(2 if num_rows > 2 else 1):
        for k in range(1, num_rows):
            sign_high = 1.0 if math.isfinite(blocks.upper[k]) else 0.0
            sign_low = -1.0 if math.isfinite(blocks.lower[k]) else 0.0
            reach = 4.0 * scale_of(k)

            def outer(x: float, k: int = k) -> float:
                trial = mu.copy()
                trial[k] = x
                return inner(trial)

            mu[k] = _golden_max(outer, sign_low * reach, sign_high * reach, steps=30)
    mu[0] = 0.0
    return mu


def _hull(weight: np.ndarray, score: np.ndarray) -> tuple[float, float, np.ndarray, np.ndarray]:
    """The lower convex hull of points (weight, score): its leftmost point and its segments' (dw > 0, ds),
    slopes increasing."""
    order = np.lexsort((score, weight))
    hull: list[int] = []
    for index in order:
        if hull and weight[hull[-1]] == weight[index]:
            continue  # same weight, higher score
        while len(hull) >= 2:
            o, a = hull[-2], hull[-1]
            cross = (weight[a] - weight[o]) * (score[index] - score[o]) - (score[a] - score[o]) * (
                weight[index] - weight[o]
            )
            if cross <= 0:
                hull.pop()
            else:
                break
        hull.append(int(index))
    points = np.array(hull)
    return (
        float(weight[points[0]]),
        float(score[points[0]]),
        np.diff(weight[points]),
        np.diff(score[points]),
    )


class _SuffixBound:
    """For every suffix of the block order: the LP value of its blocks as a convex piecewise-linear
    function of their row-0 total (breakpoints xs, values ys), and its minimiser."""

    def __init__(self, blocks: _Blocks, order: list[int], folded: np.ndarray) -> None:
        hulls = [_hull(blocks.weights[0, blocks.members[b]], folded[blocks.members[b]]) for b in order]
        self.xs: list[np.ndarray] = []
        self.ys: list[np.ndarray] = []
        self.best_x: list[float] = []
        for d in range(len(order) + 1):
            part = hulls[d:]
            x0 = sum(h[0] for h in part)
            y0 = sum(h[1] for h in part)
            dw = np.concatenate([h[2] for h in part]) if part else np.zeros(0)
            ds = np.concatenate([h[3] for h in part]) if part else np.zeros(0)
            by_slope = np.argsort(ds / dw, kind="stable") if len(dw) else np.zeros(0, dtype=np.int64)
            xs = x0 + np.concatenate([[0.0], np.cumsum(dw[by_slope])])
            ys = y0 + np.concatenate([[0.0], np.cumsum(ds[by_slope])])
            self.xs.append(xs)
            self.ys.append(ys)
            self.best_x.append(float(xs[int(np.argmin(ys))]))

    def value(self, depth: int, low: np.ndarray, high: np.ndarray) -> np.ndarray:
        """min over totals t in [low, high] of the suffix's LP value (inf where no t fits)."""
        xs, ys = self.xs[depth], self.ys[depth]
        t = np.clip(self.best_x[depth], low, high)
        values = np.interp(t, xs, ys)
        return np.where((high < xs[0]) | (low > xs[-1]), math.inf, values)


def _undominated(score: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Indices of states that no other state beats or ties in score and every total (smaller better);
    totals: [1 or 2, n]. With two totals, states compared within one chunk may both stay (harmless)."""
    if totals.shape[0] == 1:
        ranked = np.lexsort((score, totals[0]))
        best_before = np.minimum.accumulate(np.concatenate([[math.inf], score[ranked][:-1]]))
        return ranked[score[ranked] < best_before]
    ranked = np.lexsort((totals[1], totals[0], score))  # best score first
    first, second = totals[0][ranked], totals[1][ranked]
    # The staircase: accepted points' (first, second) Pareto front, first ascending, second descending.
    front_first = np.zeros(0)
    front_second = np.zeros(0)
    survivors = np.ones(len(ranked), dtype=bool)
    chunk = max(256, len(ranked) // 32)
    for start in range(0, len(ranked), chunk):
        a, b = first[start : start + chunk], second[start : start + chunk]
        if len(front_first):
            at = np.searchsorted(front_first, a, side="right") - 1
            beaten = (at >= 0) & (front_second[np.maximum(at, 0)] <= b)
            survivors[start : start + chunk] = ~beaten
            a, b = a[~beaten], b[~beaten]
        merged_first = np.concatenate([front_first, a])
        merged_second = np.concatenate([front_second, b])
        order = np.lexsort((merged_second, merged_first))
        merged_first, merged_second = merged_first[order], merged_second[order]
        lowest_before = np.minimum.accumulate(np.concatenate([[math.inf], merged_second[:-1]]))
        on_front = merged_second < lowest_before
        front_first, front_second = merged_first[on_front], merged_second[on_front]
    return ranked[survivors]


class _Search:
    def __init__(self, problem, order: list[int], blocks: _Blocks, multipliers: np.ndarray) -> None:
        self.problem, self.order, self.blocks, self.mu = problem, order, blocks, multipliers
        folded = blocks.objective + multipliers @ blocks.weights
        self.bound = _SuffixBound(blocks, order, folded)
        num_rows = len(blocks.lower)
        # Per suffix: the least and greatest total each row can still gain.
        self.gain_min = np.zeros((len(order) + 1, num_rows))
        self.gain_max = np.zeros((len(order) + 1, num_rows))
        for d in range(len(order) - 1, -1, -1):
            local = blocks.weights[:, blocks.members[order[d]]]
            self.gain_min[d] = self.gain_min[d + 1] + local.min(axis=1)
            self.gain_max[d] = self.gain_max[d + 1] + local.max(axis=1)
        # Dominance needs every row one-sided (smaller totals better, after flipping lower-bounded rows).
        one_sided = [math.isinf(lo) or math.isinf(hi) for lo, hi in zip(blocks.lower, blocks.upper)]
        self.directions = (
            np.where(np.isfinite(blocks.upper), 1.0, -1.0) if all(one_sided) and num_rows <= 2 else None
        )

    def _bounds(self, depth: int, score: np.ndarray, totals: np.ndarray) -> np.ndarray:
        """Lower bound on every completion of each state (inf: none meets the rows). totals: [rows, n]."""
        blocks = self.blocks
        low = blocks.lower[:, None] - blocks.tol[:, None] - totals
        high = blocks.upper[:, None] + blocks.tol[:, None] - totals
        feasible = np.all(
            (self.gain_max[depth][:, None] >= low) & (self.gain_min[depth][:, None] <= high), axis=0
        )
        rest = self.bound.value(depth, low[0], high[0])
        penalty = np.zeros(len(score))
        for k in range(1, len(blocks.lower)):
            mu = self.mu[k]
            if mu > 0:
                penalty += mu * high[k]
            elif mu < 0:
                penalty += mu * low[k]
        feasible &= np.isfinite(rest)
        rest = np.where(feasible, rest, 0.0)
        bound = score + rest - penalty
        # Float round-off in the sums must never lift a bound above the truth.
        bound -= 1e-11 * (np.abs(score) + np.abs(rest) + np.abs(penalty) + 1.0)
        return np.where(feasible, bound, math.inf)

    def run(self, cutoff: float, beam: int | None, deadline: float | None):
        """(best score, its choices or None, least pruned bound, truncated, distinct variants used) or
        None past MAX_STATES, MAX_WORK or the deadline. States with bound >= cutoff are pruned."""
        blocks, problem = self.blocks, self.problem
        num_rows = len(blocks.lower)
        score = np.zeros(1)
        totals = np.zeros((num_rows, 1))
        history: list[tuple[np.ndarray, np.ndarray]] = []
        pruned_bound = math.inf
        truncated = False
        used = 0
        work = 0
        for depth, block in enumerate(self.order):
            if deadline is not None and time.perf_counter() > deadline:
                return None
            members = blocks.members[block]
            work += len(score) * len(members)
            if beam is None and work > MAX_WORK:
                return None
            parent = np.repeat(np.arange(len(score)), len(members))
            variant = np.tile(members, len(score))
            score = score[parent] + blocks.objective[variant]
            totals = totals[:, parent] + blocks.weights[:, variant]
            bound = self._bounds(depth + 1, score, totals)
            finite = np.isfinite(bound)
            drop = finite & (bound >= cutoff)
            if drop.any():
                pruned_bound = min(pruned_bound, float(bound[drop].min()))
            keep = finite & ~drop
            if self.directions is not None and keep.any():
                candidates = np.flatnonzero(keep)
                keep[:] = False
                keep[
                    candidates[
                        _undominated(score[candidates], self.directions[:, None] * totals[:, candidates])
                    ]
                ] = True
            kept = np.flatnonzero(keep)
            if beam is not None and len(kept) > beam:
                truncated = True
                kept = kept[np.argsort(bound[kept], kind="stable")[:beam]]
            elif len(kept) > MAX_STATES:
                return None
            score, totals = score[kept], totals[:, kept]
            history.append((parent[kept], variant[kept]))
            # distinct columns; np.unique would import numpy.ma (~20 ms) on a search's first call
            used += int(np.count_nonzero(np.bincount(variant[kept])))
        if len(score) == 0:
            return math.inf, None, pruned_bound, truncated, used
        low = blocks.lower[:, None] - blocks.tol[:, None]
        high = blocks.upper[:, None] + blocks.tol[:, None]
        ok = np.all((totals >= low) & (totals <= high), axis=0)
        if not ok.any():
            return math.inf, None, pruned_bound, truncated, used
        best = int(np.flatnonzero(ok)[np.argmin(score[ok])])
        picks = [0] * problem.table.num_blocks
        state = best
        for depth in range(len(self.order) - 1, -1, -1):
            parents, variants = history[depth]
            flat = int(variants[state])
            block = self.order[depth]
            picks[block] = flat - int(problem.table.offsets[block])
            state = int(parents[state])
        return float(score[best]), tuple(picks), pruned_bound, truncated, used


def solve(problem, gap_rel: float, deadline: float | None):
    """(choices or None, proven lower bound, distinct variants the exact pass kept) for an MCKP `problem`
    (see `applies`), or None when the state set grows past MAX_STATES (MAX_WORK) or the deadline passes.

    choices None with the bound +inf: no architecture meets the rows."""
    blocks = _Blocks(problem)
    if any(len(m) == 0 for m in blocks.members):
        return None, math.inf, 0
    if len(blocks.lower) > 1:
        # Row 0 is the one the bound treats exactly: take the one whose multiplier weighs most when
        # every row is moved into the score (the most binding budget).
        full = _full_multipliers(blocks)
        weight = [
            abs(full[k]) * sum(float(np.ptp(blocks.weights[k, m])) for m in blocks.members)
            for k in range(len(full))
        ]
        # Often one budget binds and the others are slack at the optimum: the optimum with that row
        # alone (a relaxation, so its bound holds for the whole problem) then meets every row.
        for row in np.argsort(weight)[::-1]:
            relaxed = _solve_blocks(problem, blocks.only(int(row)), gap_rel, deadline)
            if relaxed is None:
                return None
            if relaxed[0] is None or blocks.holds(problem, relaxed[0]):
                return relaxed
        blocks.reorder(int(np.argmax(weight)))
    return _solve_blocks(problem, blocks, gap_rel, deadline)


def _solve_blocks(problem, blocks: _Blocks, gap_rel: float, deadline: float | None):
    mu = _multipliers(blocks)
    # Blocks with fewer alive variants first, so the state set branches late, where bounds are tight.
    order = sorted(range(len(blocks.members)), key=lambda b: (len(blocks.members[b]), b))
    search = _Search(problem, order, blocks, mu)
    first = search.run(math.inf, BEAM_WIDTH, deadline)
    if first is None:
        return None
    incumbent, choices, _, truncated, used = first
    if not truncated:
        return choices, (incumbent if choices is not None else math.inf), used

    def cutoff_of(value: float) -> float:
        return value - max(gap_rel * abs(value), problem.round_off) if math.isfinite(value) else math.inf

    for _ in range(3):
        second = search.run(cutoff_of(incumbent), None, deadline)
        if second is None:
            return None
        best, found, pruned_bound, _, used = second
        improved = found is not None and best < incumbent
        if improved:
            incumbent, choices = best, found
        if choices is None:
            return None, math.inf, used
        bound = min(incumbent, pruned_bound)
        # A better solution than the pass's cutoff was made for can leave the gap a hair above gap_rel
        # (the gap is relative to the new, smaller objective): one more pass with its cutoff settles it.
        if not improved or incumbent - bound <= max(gap_rel * abs(incumbent), problem.round_off):
            break
    return choices, bound, used
