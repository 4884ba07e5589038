"""The search MIP as rows and columns: one binary per variant, one-per-block rows, budget rows, rule rows.

`build_problem` turns a `Table`, bounds and `Rules` into a `Problem` (a `RowModel` the back ends solve),
after a dominance presolve that drops per block the variants another one beats in every respect. Each budget
row is divided by its `row_scale`, so that the solvers' absolute feasibility tolerances (1e-7 .. 1e-6) are
relative to the bound, in seconds as in bytes; `feasible_choices` and `broken_limits` judge a choice on the
un-scaled sums, to `puzzle.cost.limits.BOUND_RTOL` of each bound.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from puzzle.cost.limits import Bound, within_bounds
from puzzle.search.backend import Row, RowModel
from puzzle.search.types import Rules, SearchError, Table


@dataclass
class Problem(RowModel):
    """The MIP for one search: RowModel's objective and rows, plus the table and the columns still alive.

    Columns 0..N-1 are the table's variants, N.. the rule binaries."""

    table: Table | None = None
    alive: np.ndarray | None = None  # [N + Z] bool: columns not removed by keep/presolve
    num_rule_columns: int = 0
    dropped: int = 0
    round_off: float = 1e-9  # objective differences below this are solver round-off (1e-9 of its range)


def resolve_limits(table: Table, limits: Sequence[Bound]) -> list[tuple[Bound, float | None, float | None]]:
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


def _absolute(bound: float | None, fixed: float) -> float | None:
    """A bound on the blocks' sum (`resolve_limits`) back on the whole total, as the budget states it."""
    return None if bound is None else bound + fixed


def feasible_choices(
    table: Table,
    choices: np.ndarray | Sequence[Sequence[int]],
    resolved: Sequence[tuple[Bound, float | None, float | None]],
    rules: Rules,
) -> np.ndarray:
    """Which rows of `choices` ([N, blocks], a variant index within each block) meet the `resolve_limits`
    bounds and the rules' shared attributes (one value among the chosen variants that have one). A bound
    holds on the whole total (blocks plus the fixed part) to a relative `BOUND_RTOL` of the bound
    (`within_bounds`), in any unit. Vectorised: baselines test thousands of architectures at once."""
    choices = np.atleast_2d(np.asarray(choices, dtype=np.int64))
    rows = table.offsets[:-1][None, :] + choices
    ok = np.ones(len(choices), dtype=bool)
    for limit, lower, upper in resolved:
        fixed = table.fixed.get(limit.key, 0.0)
        total = table.cost(limit.key)[rows].sum(axis=1) + fixed
        ok &= within_bounds(total, _absolute(lower, fixed), _absolute(upper, fixed))
    for attr in rules.shared_attributes():
        values = table.attrs.get(attr)
        if values is None:
            continue
        codes: dict[Hashable, int] = {}  # any hashable values (a library's attributes may be strings)
        coded = np.array([-1 if v is None else codes.setdefault(v, len(codes)) for v in values])[rows]
        low = np.where(coded >= 0, coded, np.iinfo(np.int64).max).min(axis=1)
        high = coded.max(axis=1)  # -1 where no chosen variant has the attribute
        ok &= (high < 0) | (low == high)
    return ok


@dataclass(frozen=True)
class Broken:
    """A limit that one choice breaks: its index in the `resolve_limits` list, the choice's whole total and
    the bound it breaks, as the budget states them (fixed part included), and by how much (> 0)."""

    index: int
    total: float
    bound: float
    excess: float

    @property
    def relative(self) -> float:
        """The excess as a fraction of the bound."""
        return self.excess / abs(self.bound) if self.bound else math.inf


def broken_limits(
    table: Table, choices: Sequence[int], resolved: Sequence[tuple[Bound, float | None, float | None]]
) -> list[Broken]:
    """The limits of `resolved` that `choices` (a variant index per block) do not meet as `feasible_choices`
    judges them, with the side each breaks (exact float64 sums of the table's un-scaled costs)."""
    rows = table.offsets[:-1] + np.asarray(choices, dtype=np.int64)
    broken = []
    for index, (limit, lower, upper) in enumerate(resolved):
        fixed = table.fixed.get(limit.key, 0.0)
        total = float(table.cost(limit.key)[rows].sum()) + fixed
        low, high = _absolute(lower, fixed), _absolute(upper, fixed)
        if within_bounds(total, low, high):
            continue
        if high is not None and total > high:
            broken.append(Broken(index, total, high, total - high))
        else:
            broken.append(Broken(index, total, low, low - total))
    return broken


def row_scale(table: Table, costs: np.ndarray, lower: float | None, upper: float | None) -> float:
    """What a budget row is divided by before a solver sees it: its bounds' largest magnitude, so the scaled
    bound is 1 and a solver's feasibility tolerance (`backend.FEASIBILITY_TOLERANCE`) is relative to the
    bound, as `within_bounds` is; without a nonzero bound, the largest sum its costs reach (each block's
    largest |cost|); for a row of zeros, 1."""
    bounds = [abs(bound) for bound in (lower, upper) if bound is not None and math.isfinite(bound)]
    if bounds and max(bounds) > 0:
        return max(bounds)
    reach = float(np.maximum.reduceat(np.abs(costs), table.offsets[:-1]).sum()) if len(costs) else 0.0
    return reach if reach > 0 else 1.0


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


def build_problem(
    table: Table,
    objective: np.ndarray,
    bounds: Sequence[tuple[str, np.ndarray, float | None, float | None]],
    rules: Rules,
    previous: Sequence[Sequence[int]] = (),
    min_diff: int = 1,
    presolve: bool = True,
) -> Problem:
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
        beaten = dominated(table, objective, bounds, shared, alive)
        dropped = int(beaten.sum())
        alive &= ~beaten

    rows: list[Row] = []
    for block in range(table.num_blocks):
        cols = np.arange(table.offsets[block], table.offsets[block + 1])
        rows.append(
            Row(cols, np.ones(len(cols)), 1.0, 1.0, f"one variant for block {table.block_names[block]!r}")
        )
    for label, costs, lower, upper in bounds:
        # Scaled to O(1): HiGHS's and CBC's feasibility tolerances are absolute (1e-6 / 1e-7), which on a
        # decode step of 0.002 s let a 0.03% overshoot through and on 8e10 bytes mean nothing at all.
        scale = row_scale(table, costs, lower, upper)
        rows.append(
            Row(
                np.arange(n_var),
                costs / scale,
                -math.inf if lower is None else lower / scale,
                math.inf if upper is None else upper / scale,
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
    return Problem(full_objective, rows, table, full_alive, next_column - n_var, dropped, round_off)


def dominated(
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
