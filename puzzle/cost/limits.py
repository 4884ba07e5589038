"""Budget syntax: `KEY<=VALUE`, `KEY>=VALUE`, `LO<=KEY<=HI`, with VALUE absolute (`7e9`, `70G`) or relative (`0.6x`).

A relative value is a factor of the parent's total for that key (the sum over the first variant of every
block plus the fixed part). The same syntax is used wherever the command line takes a budget.

A total meets a bound to `BOUND_RTOL` of the bound's magnitude (`within_bounds`): the one tolerance the search's
answer, the baselines and every other check of a child against its budgets hold it to, whatever the unit (a
decode step of 0.002 s and a memory of 8e10 bytes alike).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

# A child meets `total <= bound` when total <= bound + BOUND_RTOL * |bound|: float64 round-off of a sum over
# blocks (~1e-14 of it) passes, a solver's feasibility tolerance (1e-7 .. 1e-6 of the row) does not.
BOUND_RTOL = 1e-9


def within_bounds(total: Any, lower: float | None, upper: float | None) -> Any:
    """Whether `total` (a number, or an array of them) meets `lower <= total <= upper` (None: that side is
    unbounded), each side to `BOUND_RTOL` of that bound's magnitude: relative, so the same in seconds and
    in bytes. A bool for a number, a bool array for an array; NaN meets nothing."""
    total = np.asarray(total, dtype=np.float64)
    ok = ~np.isnan(total)
    if upper is not None:
        ok &= total <= upper + BOUND_RTOL * abs(upper)
    if lower is not None:
        ok &= total >= lower - BOUND_RTOL * abs(lower)
    return bool(ok) if ok.ndim == 0 else ok


class BudgetError(ValueError):
    """A budget that cannot be parsed or that contradicts another one."""


@dataclass(frozen=True)
class Relative:
    """A bound given as a factor of the parent's total, e.g. `0.6x`."""

    factor: float

    def resolve(self, parent_total: float) -> float:
        return self.factor * parent_total

    def __str__(self) -> str:
        return f"{self.factor:g}x"


Value = float | Relative

# Decimal suffixes people write for parameter counts and bytes ("70G", "2.5B" = 2.5e9).
_SUFFIXES = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "B": 1e9, "T": 1e12}
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


# A key whose last word is a unit other than a plain count (memory_mib, runtime_ms): a decimal suffix on
# its value would multiply that unit ("70G" MiB = 70e9 MiB), which nobody means, so it is refused there.
_UNIT_KEY = re.compile(r"(?:^|[_.\[])(?:[kmgtp]i?b|mb|gb|ms|us|ns|s|sec|seconds?|minutes?|hours?)\]?$", re.I)


def key_has_unit(key: str) -> bool:
    """Whether `key` names its unit in its last word (`stats.memory_mib`, `runtime_ms`, `seconds[chat]`)."""
    return _UNIT_KEY.search(key) is not None


def parse_value(text: str, key: str | None = None) -> Value:
    """`'0.6x'` -> Relative(0.6); `'7e9'`, `'70G'`, `'2.5B'` -> float (k, M, G/B, T: x1e3, 1e6, 1e9, 1e12).

    The number must be finite. With `key` given, a k/M/G/B/T suffix is refused when the key's name
    carries a unit (`memory_mib`, `runtime_ms`): the value is then written in that unit."""
    raw = text.strip()
    match = re.fullmatch(rf"({_NUMBER})\s*([xX]|[kKMGBT])?", raw)
    if match is None:
        raise BudgetError(
            f"cannot read budget value {text!r}: expected a number such as 32000, 7e9, 70G, or a "
            f"factor of the parent such as 0.6x"
        )
    number = float(match.group(1))
    suffix = match.group(2)
    if suffix in ("x", "X"):
        if not 0 < number < math.inf:
            raise BudgetError(f"relative budget value {text!r} must be a positive, finite factor")
        return Relative(number)
    if suffix and key is not None and key_has_unit(key):
        raise BudgetError(
            f"budget value {text!r} on {key!r}: the key names its unit, so write the value in that unit "
            f"without a k/M/G/B/T suffix (or relative, like 0.7x)"
        )
    value = number * _SUFFIXES[suffix] if suffix else number
    if not math.isfinite(value):
        raise BudgetError(f"budget value {text!r} overflows to {value}; expected a finite number")
    return value


def format_value(value: Value | None) -> str:
    return "" if value is None else str(value) if isinstance(value, Relative) else f"{value:g}"


@dataclass(frozen=True)
class Bound:
    """The search's bound on one summed cost column: `lower <= sum <= upper` (either may be None). A budget
    as the user writes it is a `puzzle.search.budget.DeploymentLimit`; pricing it makes these."""

    key: str
    upper: Value | None = None
    lower: Value | None = None

    def __post_init__(self) -> None:
        if not self.key:
            raise BudgetError("a budget needs a key, e.g. 'stats.memory_mib<=70000'")
        if self.upper is None and self.lower is None:
            raise BudgetError(f"budget on {self.key!r} has neither an upper nor a lower bound")

    def __str__(self) -> str:
        if self.upper is not None and self.lower is not None:
            return f"{format_value(self.lower)}<={self.key}<={format_value(self.upper)}"
        if self.upper is not None:
            return f"{self.key}<={format_value(self.upper)}"
        return f"{self.key}>={format_value(self.lower)}"

    def resolved(self, parent_total: float) -> tuple[float | None, float | None]:
        """(lower, upper) as absolute numbers, relative values taken against `parent_total`."""

        def absolute(value: Value | None) -> float | None:
            if value is None:
                return None
            return value.resolve(parent_total) if isinstance(value, Relative) else float(value)

        return absolute(self.lower), absolute(self.upper)


# The name this class had until the budget and the MIP's bound got names of their own; kept for callers.
Limit = Bound


def parse_limit(text: str) -> Bound:
    """Parse `KEY<=V`, `KEY>=V`, `V>=KEY`... or `LO<=KEY<=HI` into a Bound."""
    parts = re.split(r"(<=|>=)", text.replace(" ", ""))
    if len(parts) == 3:
        left, op, right = parts
        left_is_key = re.fullmatch(rf"{_NUMBER}[xXkKMGBT]?", left) is None
        key, value_text = (left, right) if left_is_key else (right, left)
        if not left_is_key:  # `V<=KEY` reads as KEY>=V
            op = "<=" if op == ">=" else ">="
        value = parse_value(value_text, key)
        return Bound(key, upper=value) if op == "<=" else Bound(key, lower=value)
    if len(parts) == 5 and parts[1] == parts[3]:
        low_text, _, key, _, high_text = parts if parts[1] == "<=" else parts[::-1]
        return Bound(key, upper=parse_value(high_text, key), lower=parse_value(low_text, key))
    raise BudgetError(
        f"cannot read budget {text!r}: expected KEY<=VALUE, KEY>=VALUE or LOW<=KEY<=HIGH "
        f"(VALUE absolute like 32000 or relative to the parent like 0.6x)"
    )


def merge_limits(limits: Iterable[Bound]) -> list[Bound]:
    """One Bound per key (`a<=5` and `a>=2` become `2<=a<=5`), in first-seen order."""
    merged: dict[str, Bound] = {}
    for limit in limits:
        previous = merged.get(limit.key)
        if previous is None:
            merged[limit.key] = limit
            continue
        for side in ("upper", "lower"):
            if getattr(previous, side) is not None and getattr(limit, side) is not None:
                raise BudgetError(f"two {side} bounds given for {limit.key!r}: {previous} and {limit}")
        merged[limit.key] = Bound(
            limit.key,
            upper=previous.upper if previous.upper is not None else limit.upper,
            lower=previous.lower if previous.lower is not None else limit.lower,
        )
    return list(merged.values())
