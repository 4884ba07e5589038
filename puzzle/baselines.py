"""The baselines a Puzzle search is compared with, on the search's own table and at its own budgets.

    from puzzle.baselines import Baselines
    found = Baselines(problem).all(seed=0)     # problem: puzzle.problem.run_problem(RUN_DIR, budgets)

Each baseline picks one variant per block of a `RunProblem` (the run's library and scores under deployment
budgets) and meets the same limits and rules as the MIP:

- `greedy`: from the least damaging variant of every block, repeatedly the one-block downgrade that adds
  the least predicted damage per unit of the budget's cost it saves, until the budgets hold (one descent per
  shared Mamba state size, the best kept); then `refill`s: one-block upgrades, the most damage removed per
  unit of cost added first, while the budgets still hold. Without the refill the descent stops at the
  first architecture that fits, well under the budget, and is a weak baseline (`greedy(refill=False)`).
- `random`: a uniform draw among the architectures that meet the budgets and use at least (level - band) of
  the parent's budget column (rejection sampling): equal size, not a far smaller model.
- `random_walk`: from the parent, random one-block downgrades until the budgets hold, then random upgrades
  while they still hold: a random architecture just under the budget, anywhere in the space.
- `uniform`: uniform pruning, one shape per block kind for every block of that kind (with no-op blocks, or
  without: `uniform(noop=False)`, width pruning only), the least predicted damage among those that fit.

`restrict` with `same_state` / `same_width` takes an axis out of the candidates (the search without Mamba
state pruning, or without expert-width pruning), for ablations of the space itself.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from puzzle.problem import RunCandidates, RunProblem
from puzzle.search import InfeasibleError, search
from puzzle.search.mip import feasible_choices, resolve_limits
from puzzle.spec import BlockSpec, MambaSpec, MoESpec

Arch = tuple[BlockSpec, ...]  # one spec per parent block
# A random architecture uses at least (level - this) x the parent's budget column (`Baselines.random`).
RANDOM_BAND = 0.05
# The baselines `Baselines.all` returns, in the order `puzzle search --baselines` prints them.
NAMES = ("greedy", "greedy-norefill", "uniform", "uniform-width", "random", "random-walk")


def restrict(candidates: RunCandidates, keep: Callable[[BlockSpec, BlockSpec], bool]) -> RunCandidates:
    """The candidates whose spec `keep(spec, parent block)` accepts (the parent's own block always stays)."""
    variants, scores = [], []
    for b, (specs, values) in enumerate(zip(candidates.variants, candidates.scores)):
        kept = [
            (s, v)
            for j, (s, v) in enumerate(zip(specs, values))
            if j == 0 or keep(s, candidates.parent.blocks[b])
        ]
        variants.append([s for s, _ in kept])
        scores.append([v for _, v in kept])
    return RunCandidates(candidates.parent, variants, scores, list(candidates.notes))


def same_state(spec: BlockSpec, parent: BlockSpec) -> bool:
    """A variant without the Mamba state axis: the parent's state size (or no state at all)."""
    return not isinstance(spec, MambaSpec) or spec.state_size == getattr(parent, "state_size", None)


def same_width(spec: BlockSpec, parent: BlockSpec) -> bool:
    """A variant without the expert-width axis: the parent's expert width (or no experts at all)."""
    return not isinstance(spec, MoESpec) or spec.expert_width == getattr(parent, "expert_width", None)


def budget_column(problem: RunProblem) -> str:
    """The cost column the baselines trade against under `problem`'s budgets: the first upper-bounded
    budget's key, else the table's first cost column."""
    bounded = [limit.key for limit in problem.problem.limits if limit.upper is not None]
    return bounded[0] if bounded else next(iter(problem.table.costs))


class Baselines:
    """The baselines over `problem` (its table, limits and rules). `budget`: the cost column the descent,
    refill and random draws trade against (active_params, params or weight_bytes). `level`: that column's
    bound as a fraction of the parent's, for `random`'s band; None reads it from the problem's limits."""

    def __init__(
        self, problem: RunProblem, budget: str = "active_params", level: float | None = None
    ) -> None:
        self.problem = problem
        self.candidates = problem.candidates
        self.table = problem.table
        self.limits = problem.problem.limits
        self.rules = problem.problem.rules
        self.resolved = resolve_limits(self.table, self.limits)
        self.budget = budget
        self.level = self._level() if level is None else level

    def _level(self) -> float | None:
        """The tightest upper bound on the budget column's total over the parent's (None: no such bound)."""
        if self.budget not in self.table.costs:
            return None
        fixed, total = self.table.fixed.get(self.budget, 0.0), self.table.parent_total(self.budget)
        uppers = [
            upper + fixed
            for limit, _, upper in self.resolved
            if limit.key == self.budget and upper is not None
        ]
        return min(uppers) / total if uppers and total > 0 else None

    def arch(self, choices: Sequence[int]) -> Arch:
        """The specs of `choices` (a variant index per block of the table)."""
        return tuple(self.candidates.variants[b][j] for b, j in enumerate(choices))

    def mip(self) -> Arch | None:
        """The search's own answer on the same table (the exact MIP); None when the budgets cannot be met."""
        try:
            solution = search(self.table, self.limits, self.rules)
        except InfeasibleError:
            return None
        return self.arch(solution.choices)

    def feasible(self, choices: np.ndarray) -> np.ndarray:
        """Which rows of `choices` ([N, blocks] variant index per block) meet the limits and the rules."""
        return feasible_choices(self.table, choices, self.resolved, self.rules)

    def score(self, choices: Sequence[int]) -> float:
        """The predicted damage of `choices`: the sum of their scores (the search's objective)."""
        return float(self.table.score[self.table.offsets[:-1] + np.asarray(choices)].sum())

    def choices(self, arch: Arch) -> list[int]:
        """The variant index per block of `arch` (the inverse of `arch`)."""
        return [self.candidates.variants[b].index(spec) for b, spec in enumerate(arch)]

    def all(self, seed: int = 0) -> dict[str, Arch | None]:
        """{name: its architecture, None where it found none that meets the budgets} for every name of
        `NAMES`; the random ones from `seed`."""
        return {
            "greedy": self.greedy(),
            "greedy-norefill": self.greedy(refill=False),
            "uniform": self.uniform()[0],
            "uniform-width": self.uniform(noop=False)[0],
            "random": self.random(seed),
            "random-walk": self.random_walk(seed),
        }

    # -- greedy ------------------------------------------------------------------------------------------

    def greedy(self, refill: bool = True) -> Arch | None:
        """Best of one greedy descent per shared state size (the rule holds at every step), each refilled
        (`_refill`) unless `refill` is False: the descent stops at the first architecture that fits, well
        under the budget, which makes a weak baseline."""
        states = self.table.attrs.get("state_size", [])
        values = sorted({v for v in states if v is not None}) or [None]
        best: tuple[float, list[int]] | None = None
        for state in values:
            found = self._descend(state)
            if found is not None and refill:
                found = self._refill(found, self._allowed(state))
            if found is not None and (best is None or self.score(found) < best[0]):
                best = (self.score(found), found)
        return None if best is None else self.arch(best[1])

    def _allowed(self, state: int | None) -> np.ndarray:
        """Which rows of the table a descent with shared state size `state` may choose."""
        states = self.table.attrs.get("state_size", [None] * self.table.num_variants)
        return np.array([state is None or s is None or s == state for s in states])

    def _descend(self, state: int | None) -> list[int] | None:
        table, cost = self.table, self.table.cost(self.budget)
        allowed = self._allowed(state)
        current = []
        for b in range(table.num_blocks):  # start from the least damaging allowed variant of each block
            rows = np.arange(table.offsets[b], table.offsets[b + 1])
            rows = rows[allowed[rows]]
            current.append(int(rows[np.argmin(table.score[rows])] - table.offsets[b]))
        while not self.feasible(np.array([current]))[0]:
            best = None
            for b in range(table.num_blocks):
                here = table.offsets[b] + current[b]
                for row in range(table.offsets[b], table.offsets[b + 1]):
                    saved = cost[here] - cost[row]
                    if not allowed[row] or saved <= 0:
                        continue
                    ratio = (table.score[row] - table.score[here]) / saved
                    if best is None or ratio < best[0]:
                        best = (ratio, b, int(row - table.offsets[b]))
            if best is None:
                return None
            current[best[1]] = best[2]
        return current

    def _refill(self, current: list[int], allowed: np.ndarray) -> list[int]:
        """`current` with blocks upgraded while the budget holds: each step takes the one-block swap that
        lowers the predicted damage most per unit of cost it adds (a swap that adds none first), among the
        swaps whose architecture still meets the limits and rules; until no swap lowers it and fits."""
        table, cost = self.table, self.table.cost(self.budget)
        current = list(current)
        while True:
            swaps: list[tuple[float, int, int]] = []  # (-gain per unit of cost, block, variant)
            for b in range(table.num_blocks):
                here = table.offsets[b] + current[b]
                for row in range(table.offsets[b], table.offsets[b + 1]):
                    gain = table.score[here] - table.score[row]
                    if not allowed[row] or gain <= 0:
                        continue
                    added = cost[row] - cost[here]
                    swaps.append((-math.inf if added <= 0 else -gain / added, b, int(row - table.offsets[b])))
            swaps.sort()
            upgraded = self._first_fit(current, [(b, v) for _, b, v in swaps])
            if upgraded is None:
                return current
            current = upgraded

    def _first_fit(self, current: list[int], swaps: Sequence[tuple[int, int]]) -> list[int] | None:
        """`current` with the first of `swaps` ((block, variant), in order) whose architecture still meets the
        limits and rules; None when none does (or there are none)."""
        if not swaps:
            return None
        trials = np.array([current] * len(swaps))
        trials[np.arange(len(swaps)), [b for b, _ in swaps]] = [v for _, v in swaps]
        fits = np.flatnonzero(self.feasible(trials))
        return trials[fits[0]].tolist() if len(fits) else None

    # -- random ------------------------------------------------------------------------------------------

    def random(
        self, seed: int, draws: int = 20_000, rounds: int = 100, band: float = RANDOM_BAND
    ) -> Arch | None:
        """A uniform draw among the feasible architectures that use at least (level - `band`) of the
        parent's budget column (rejection sampling of the whole product): equal budget, not a far smaller
        model, which a uniform draw over all feasible ones mostly is. Without a level (no upper bound on the
        column), any feasible draw."""
        rng = np.random.default_rng(seed)
        sizes = np.diff(self.table.offsets)
        cost = self.table.cost(self.budget)
        floor = -math.inf
        if self.level is not None:
            fixed = self.table.fixed.get(self.budget, 0.0)
            floor = (self.level - band) * self.table.parent_total(self.budget) - fixed
        for _ in range(rounds):
            choices = rng.integers(0, sizes[None, :], size=(draws, len(sizes)))
            used = cost[self.table.offsets[:-1][None, :] + choices].sum(axis=1)
            hits = np.flatnonzero(self.feasible(choices) & (used >= floor))
            if len(hits):
                return self.arch(choices[hits[0]].tolist())
        return None

    def random_walk(self, seed: int, steps: int = 10_000) -> Arch | None:
        """A random architecture at the budget: from the parent (one shared state size drawn at random), random
        one-block downgrades until it fits, then random one-block upgrades while it still fits. Unlike
        `random`'s uniform draw, which rarely fits a deep parent at high compression, every walk ends just
        under the budget, anywhere in the space: a ranking test for predictors that favours none of them."""
        rng = np.random.default_rng(seed)
        table, cost = self.table, self.table.cost(self.budget)
        states = sorted({v for v in self.table.attrs.get("state_size", []) if v is not None}) or [None]
        allowed = self._allowed(states[int(rng.integers(len(states)))])
        rows = [
            np.flatnonzero(allowed[table.offsets[b] : table.offsets[b + 1]]) for b in range(table.num_blocks)
        ]
        if any(not len(r) for r in rows):
            return None
        current = [int(r[0]) for r in rows]
        for _ in range(steps):
            if self.feasible(np.array([current]))[0]:
                break
            b = int(rng.integers(table.num_blocks))
            here = cost[table.offsets[b] + current[b]]
            cheaper = [int(v) for v in rows[b] if cost[table.offsets[b] + v] < here]
            if cheaper:
                current[b] = cheaper[int(rng.integers(len(cheaper)))]
        else:
            return None
        while True:  # upgrades in random order, the first that still fits each time
            swaps = [
                (b, int(v))
                for b in range(table.num_blocks)
                for v in rows[b]
                if cost[table.offsets[b] + v] > cost[table.offsets[b] + current[b]]
            ]
            upgraded = self._first_fit(current, [swaps[i] for i in rng.permutation(len(swaps))])
            if upgraded is None:
                return self.arch(current)
            current = upgraded

    # -- uniform pruning ---------------------------------------------------------------------------------

    def uniform(self, noop: bool = True) -> tuple[Arch | None, int]:
        """The least predicted damage among one-shape-per-kind architectures that meet the budget, and how
        many such architectures there are; without `noop`, no kind is removed (width pruning only)."""
        parent = self.candidates.parent
        kinds: dict[str, list[int]] = {}
        for b, block in enumerate(parent.blocks):
            kinds.setdefault(block.kind, []).append(b)
        shapes: dict[str, list[BlockSpec]] = {}
        for kind, blocks in kinds.items():
            common = [
                s
                for s in self.candidates.variants[blocks[0]]
                if all(s in self.candidates.variants[b] for b in blocks)
            ]
            # Without `noop` no block is removed (a parent's own no-op block stays one).
            shapes[kind] = [s for s in common if noop or s.kind != "noop" or kind == "noop"]
        best: tuple[float, list[int]] | None = None
        count = 0
        for combo in itertools.product(*shapes.values()):
            by_kind = dict(zip(shapes, combo))
            choices = [
                self.candidates.variants[b].index(by_kind[block.kind])
                for b, block in enumerate(parent.blocks)
            ]
            if not self.feasible(np.array([choices]))[0]:
                continue
            count += 1
            if best is None or self.score(choices) < best[0]:
                best = (self.score(choices), choices)
        return (None if best is None else self.arch(best[1])), count
