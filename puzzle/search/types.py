"""The search's data: per-block variant tables, global rules, solver options, solutions, and its errors."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SOLVERS = ("auto", "highs", "cbc")


class SearchError(ValueError):
    """A search problem that is malformed (missing costs, unknown blocks) or cannot be solved."""


class InfeasibleError(SearchError):
    """No architecture meets the budgets. `budget` names the one that cannot be met (None: the rules
    alone cannot), `best` is the best value this library reaches for it (same units as the budget)."""

    def __init__(
        self, message: str, budget: str | None, best: float | None, details: Sequence[tuple[str, float]]
    ):
        super().__init__(message)
        self.budget = budget
        self.best = best
        self.details = list(details)  # (budget, best reachable value) for every budget that misses


@dataclass(frozen=True)
class Choice:
    """One variant of one block: its score, its named costs, and attributes the global rules read
    (`kind`: "mamba" | "attention" | "moe" | ..., `state_size`, `top_k`; absent = unconstrained)."""

    name: str
    score: float
    costs: Mapping[str, float] = field(default_factory=dict)
    attrs: Mapping[str, Hashable] = field(default_factory=dict)


@dataclass
class Table:
    """Every block's variants as flat arrays. Variant j of block b is row `offsets[b] + j`; the first
    variant of each block is the parent's. Costs are per variant; `fixed` costs lie outside the blocks."""

    block_names: tuple[str, ...]
    variant_names: tuple[tuple[str, ...], ...]
    score: np.ndarray  # [N] float64, the objective per variant
    costs: dict[str, np.ndarray]  # key -> [N] float64
    attrs: dict[str, list[Hashable]] = field(default_factory=dict)  # key -> [N] values (None = free)
    fixed: dict[str, float] = field(default_factory=dict)
    maximize: bool = False
    objective_name: str = "score"

    def __post_init__(self) -> None:
        if not self.block_names:
            raise SearchError("the search table has no blocks")
        if len(set(self.block_names)) != len(self.block_names):
            raise SearchError("block names in the search table are not unique")
        sizes = [len(names) for names in self.variant_names]
        if len(sizes) != len(self.block_names):
            raise SearchError(
                f"{len(self.block_names)} block names but {len(sizes)} variant lists in the search table"
            )
        for name, size in zip(self.block_names, sizes):
            if size == 0:
                raise SearchError(f"block {name!r} has no variants")
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.block_of = np.repeat(np.arange(len(sizes)), sizes)
        total = int(self.offsets[-1])
        self.score = np.asarray(self.score, dtype=np.float64)
        if self.score.shape != (total,):
            raise SearchError(f"score has shape {self.score.shape}, expected ({total},) (one per variant)")
        if not np.all(np.isfinite(self.score)):
            raise SearchError(
                f"{self.objective_name} is not finite for {self._name(np.flatnonzero(~np.isfinite(self.score))[0])}"
            )
        for key, values in list(self.costs.items()):
            array = np.asarray(values, dtype=np.float64)
            if array.shape != (total,):
                raise SearchError(f"cost {key!r} has shape {array.shape}, expected ({total},)")
            if not np.all(np.isfinite(array)):
                bad = int(np.flatnonzero(~np.isfinite(array))[0])
                raise SearchError(
                    f"cost {key!r} is {array[bad]} for {self._name(bad)}, expected a finite number"
                )
            self.costs[key] = array
        for key, value in self.fixed.items():
            if key not in self.costs:
                raise SearchError(
                    f"fixed cost {key!r} is not a cost of the search table; known costs: {sorted(self.costs)}"
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SearchError(f"fixed cost {key!r} is {value!r}, expected a finite number")
        for key, values in self.attrs.items():
            if len(values) != total:
                raise SearchError(f"attribute {key!r} has {len(values)} entries, expected {total}")

    @classmethod
    def from_choices(
        cls,
        blocks: Mapping[str, Sequence[Choice]],
        fixed: Mapping[str, float] | None = None,
        maximize: bool = False,
        objective_name: str = "score",
    ) -> Table:
        """Build from {block name: [Choice, ...]} (parent first). Every choice must carry every cost key."""
        keys = sorted({key for choices in blocks.values() for choice in choices for key in choice.costs})
        attr_keys = sorted({key for choices in blocks.values() for choice in choices for key in choice.attrs})
        flat = [(block, choice) for block, choices in blocks.items() for choice in choices]
        costs: dict[str, np.ndarray] = {}
        for key in keys:
            values = np.empty(len(flat))
            for index, (block, choice) in enumerate(flat):
                if key not in choice.costs:
                    raise SearchError(f"block {block!r} variant {choice.name!r} has no cost {key!r}")
                values[index] = float(choice.costs[key])
            costs[key] = values
        return cls(
            block_names=tuple(blocks),
            variant_names=tuple(tuple(choice.name for choice in choices) for choices in blocks.values()),
            score=np.array([float(choice.score) for _, choice in flat]),
            costs=costs,
            attrs={key: [choice.attrs.get(key) for _, choice in flat] for key in attr_keys},
            fixed=dict(fixed or {}),
            maximize=maximize,
            objective_name=objective_name,
        )

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    @property
    def num_variants(self) -> int:
        return int(self.offsets[-1])

    def _name(self, flat_index: int) -> str:
        block = int(self.block_of[flat_index])
        return f"block {self.block_names[block]!r} variant {self.variant_names[block][flat_index - self.offsets[block]]!r}"

    def cost(self, key: str) -> np.ndarray:
        if key not in self.costs:
            raise SearchError(f"no cost {key!r} in the search table; known costs: {sorted(self.costs)}")
        return self.costs[key]

    def parent_total(self, key: str) -> float:
        """The parent's total for `key`: first variant of every block plus the fixed part."""
        return float(self.cost(key)[self.offsets[:-1]].sum() + self.fixed.get(key, 0.0))

    def totals(self, choices: Sequence[int]) -> dict[str, float]:
        """Every cost summed over the chosen variants (index within each block) plus its fixed part."""
        rows = self.offsets[:-1] + np.asarray(choices)
        return {
            key: float(values[rows].sum() + self.fixed.get(key, 0.0)) for key, values in self.costs.items()
        }


@dataclass(frozen=True)
class Rules:
    """Global rules, each linear in the MIP.

    shared_state_size: every chosen variant with a `state_size` attribute (Mamba) has the same one.
    same_top_k: every chosen variant with a `top_k` attribute (MoE) has the same one.
    same_attributes: further attribute names held to one value the same way (e.g. from a library file).
    keep_blocks: blocks (name or index) held at the parent's variant.
    min_attention_blocks: at least this many chosen variants have `kind == "attention"`.
    """

    shared_state_size: bool = False
    same_top_k: bool = False
    same_attributes: tuple[str, ...] = ()
    keep_blocks: tuple[str | int, ...] = ()
    min_attention_blocks: int = 0

    def shared_attributes(self) -> list[str]:
        names = list(self.same_attributes)
        if self.shared_state_size:
            names.append("state_size")
        if self.same_top_k:
            names.append("top_k")
        return list(dict.fromkeys(names))


@dataclass(frozen=True)
class SolverOptions:
    """solver: "auto" (HiGHS if highspy is installed, else CBC), "highs" or "cbc".
    time_limit_s: wall-clock limit for one search in seconds (None = none, else > 0). gap_rel: the relative
    optimality gap to prove, in [0, 1) (see `Solution` for how the gap is measured). presolve: drop
    dominated variants. fixing: LP bound + reduced-cost fixing (off = the plain PuLP model of every
    variant). heuristics: without rules, the exact knapsack search (`mckp`) first; with HiGHS as the
    solver, an incumbent by LP diving and swap local search, then LP probing, before the one MIP (off, and
    always with CBC: grow the fixing threshold until it certifies)."""

    solver: str = "auto"
    time_limit_s: float | None = None
    gap_rel: float = 1e-6
    presolve: bool = True
    fixing: bool = True
    heuristics: bool = True

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise SearchError(f"unknown solver {self.solver!r}; choose one of {', '.join(SOLVERS)}")
        limit = self.time_limit_s
        if limit is not None and (
            isinstance(limit, bool)
            or not isinstance(limit, (int, float))
            or not math.isfinite(limit)
            or limit <= 0
        ):
            raise SearchError(
                f"SolverOptions.time_limit_s must be a positive number of seconds or None, found {limit!r}"
            )
        gap = self.gap_rel
        if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap < 1:
            raise SearchError(
                f"SolverOptions.gap_rel must be a relative gap in [0, 1) such as 1e-6, found {gap!r}"
            )
        for name in ("presolve", "fixing", "heuristics"):
            if not isinstance(getattr(self, name), bool):
                raise SearchError(
                    f"SolverOptions.{name} must be True or False, found {getattr(self, name)!r}"
                )


@dataclass
class Solution:
    """One architecture: the variant chosen for every block, its objective and cost totals, and how it
    was found.

    `gap` is the relative gap proven for the whole problem: (objective - bound) / |objective|, the
    objective taken as minimised (negated when maximising) and `bound` the best lower bound proven on it
    (the LP relaxation, the bounds behind every variable fixed, the final MIP's dual bound). A difference
    within 1e-9 of the objective's range S (sum over blocks of the largest |score|) counts as 0, and
    |objective| is floored at that too. None when no bound is known. `status` is "optimal" exactly when
    gap <= the requested `gap_rel`, else "time_limit" (feasible, not proven within it)."""

    choices: tuple[int, ...]  # variant index within each block
    names: dict[str, str]  # block name -> variant name
    objective: float
    totals: dict[str, float]
    status: str
    gap: float | None
    solver: str  # "highs" or "cbc" (the MIP back end), "mckp" when the knapsack search answered
    seconds: float
    presolve_dropped: int = 0
    free_variables: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "objective": self.objective,
            "status": self.status,
            "gap": self.gap,
            "solver": self.solver,
            "seconds": self.seconds,
            "choices": dict(self.names),
            "totals": dict(self.totals),
            "presolve_dropped": self.presolve_dropped,
            "free_variables": self.free_variables,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], table: Table) -> Solution:
        """The Solution whose `to_json` is `data`, its `choices` (variant index per block) found by name in
        `table`, the search table it was solved on. SearchError naming the block when `data` chose a block
        or variant that `table` does not have."""
        names = dict(data["choices"])
        choices = []
        for block, variants in zip(table.block_names, table.variant_names):
            if names.get(block) not in variants:
                raise SearchError(
                    f"solution chooses {names.get(block)!r} for block {block!r}; the search table's "
                    f"variants there are {', '.join(variants)}"
                )
            choices.append(variants.index(names[block]))
        if set(names) != set(table.block_names):
            raise SearchError(
                f"solution blocks {sorted(names)} differ from the table's {list(table.block_names)}"
            )
        # The values as saved (no conversions), so that `to_json` gives back exactly `data`.
        return cls(
            choices=tuple(choices),
            names=names,
            objective=data["objective"],
            totals=dict(data["totals"]),
            status=data["status"],
            gap=data["gap"],
            solver=data["solver"],
            seconds=data["seconds"],
            presolve_dropped=data.get("presolve_dropped", 0),
            free_variables=data.get("free_variables", 0),
        )
