"""The statistics and the fine search space behind benchmarks/ablations.py (its replication's comparisons).

Pure functions over numbers and specs, so that each is tested on its own (tests/test_ablations.py):

- `fine_space`: every width and state size of each block kind at FINE_FRACTIONS of the parent's (and the
  expert count), one axis at a time, so that uniform pruning (one shape per kind) meets a budget within a
  few percent; `uniform_fractions` lists the sizes uniform pruning can reach in a space.
- `interpolate` / `curve_at`: a method's KL-vs-size curve (piecewise linear in log KL), to compare methods at
  equal size rather than only at the budget, which each method undershoots by its own amount.
- `paired_ratio`: one method's KL over Puzzle's on the same test batches, with a 95% interval (delta method
  on the log of the ratio of means, paired over batches).
- `hierarchical_ratio`: the same ratio over every GKD seed's test batches, with a 95% interval from a
  hierarchical bootstrap (the seeds resampled, then the batches within each drawn seed; paired: both methods
  take the same seed indices and batches), so that it holds across GKD seeds, not only within one.
- `crossover` / `bootstrap_crossover`: the compression at which Puzzle starts to beat uniform pruning, and its
  interval from resampling the test batches (and the GKD seeds).
- `spearman` and `within_level_spearman`: rank correlation of predicted and measured KL, pooled and per level.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from puzzle.cost.analytic import block_active_params, block_params
from puzzle.space import SearchSpace
from puzzle.spec import AttentionSpec, MambaSpec, ModelSpec, MoESpec

FINE_FRACTIONS = (0.875, 0.75, 0.625, 0.5, 0.375, 0.25)
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
REACH = 0.03  # how far past the sizes it reached a curve is read at equal size (fine-grid uniform: ~1% under)


# ------------------------------------------------------------------------------------------ the fine grid


def _scaled(value: int, fractions: Sequence[float], minimum: int = 1) -> list[int]:
    """`value` x each fraction, rounded half up, at least `minimum`, below `value`, largest first, no repeats."""
    return sorted({max(minimum, math.floor(f * value + 0.5)) for f in fractions} - {value}, reverse=True)


def fine_space(parent: ModelSpec, fractions: Sequence[float] = FINE_FRACTIONS) -> dict[str, Any]:
    """The space `kinds` of a fine grid over `parent` (the first block of each kind stands for all of them).

    One axis at a time (`decoupled`) so that the library stays about twice the coarse one's size: Mamba state
    size and head width; MoE routed expert width, shared expert width, expert count and top-1; attention KV
    heads (each divisor); a removed block for every kind. Sizes are absolute (rounding 1), so that a small
    parent gets every step."""
    first: dict[type, Any] = {}
    for block in parent.blocks:
        first.setdefault(type(block), block)
    kinds: dict[str, Any] = {}
    if MambaSpec in first:
        m = first[MambaSpec]
        kinds["mamba"] = {
            "state_size": _scaled(m.state_size, fractions),
            "head_dim": _scaled(m.head_dim, fractions),
            "mode": "decoupled",
            "rounding": 1,
            "noop": True,
        }
    if MoESpec in first:
        e = first[MoESpec]
        moe: dict[str, Any] = {
            "expert_width": _scaled(e.expert_width, fractions),
            "num_experts": _scaled(e.num_experts, fractions, minimum=e.top_k),
            "mode": "decoupled",
            "rounding": 1,
            "noop": True,
        }
        if e.shared_width:
            moe["shared_width"] = _scaled(e.shared_width, fractions)
        if e.top_k > 1:
            moe["top_k"] = [1]
        kinds["moe"] = moe
    if AttentionSpec in first:
        a = first[AttentionSpec]
        divisors = [d for d in range(1, a.num_kv_heads) if a.num_kv_heads % d == 0]
        kinds["attention"] = {"noop": True, **({"num_kv_heads": divisors} if divisors else {})}
    return kinds


def uniform_fractions(
    parent: ModelSpec,
    kinds: Mapping[str, Any],
    budget: str = "active_params",
    rounding: int = 8,
    noop: bool = True,
) -> list[float]:
    """Every size (a fraction of the parent's `budget`: active_params or params) that uniform pruning reaches
    in the space `kinds`: one shape per block kind in every block of that kind, the embeddings kept; sorted.
    Without `noop`, no kind is removed (width pruning only, as Minitron prunes). Assumes, as the demo parents
    do, that every block of a kind has the parent's shape of that kind."""
    cost = block_active_params if budget == "active_params" else block_params
    space = SearchSpace.from_dict({"rounding": rounding, "kinds": dict(kinds)})
    by_kind: dict[str, list[int]] = {}
    for index, block in enumerate(parent.blocks):
        by_kind.setdefault(block.kind, []).append(index)
    shapes = {
        kind: [v.spec for v in space.variants(parent, blocks[0]) if noop or v.spec.kind != "noop"]
        for kind, blocks in by_kind.items()
    }
    hidden = parent.hidden_size
    whole = sum(cost(block, hidden) for block in parent.blocks)
    from puzzle.cost.analytic import model_active_params, model_params

    total = model_active_params(parent) if budget == "active_params" else model_params(parent)
    fixed = total - whole
    sizes = set()
    for combo in itertools.product(*shapes.values()):
        used = sum(len(by_kind[kind]) * cost(spec, hidden) for kind, spec in zip(shapes, combo))
        sizes.add((fixed + used) / total)
    return sorted(sizes)


def closest_under(sizes: Sequence[float], level: float) -> float | None:
    """The largest of `sizes` at or under `level` (None when none is): where a method that fills its budget
    as well as it can lands."""
    under = [s for s in sizes if s <= level + 1e-12]
    return max(under) if under else None


# -------------------------------------------------------------------------------------- equal-size curves


def interpolate(points: Sequence[tuple[float, float]], x: float, reach: float = 0.0) -> float:
    """The curve through `points` (size, KL > 0) at size `x`: piecewise linear in log KL between the two
    nearest sizes; beyond the sizes the curve reached, the end segment extended by at most `reach` (a
    method lands a little under each budget, so its curve never reaches the largest one), else NaN. Points
    at one size average their logs."""
    by_x: dict[float, list[float]] = {}
    for size, value in points:
        if value > 0 and math.isfinite(value):
            by_x.setdefault(float(size), []).append(math.log(value))
    if not by_x:
        return math.nan
    xs = sorted(by_x)
    ys = [sum(by_x[s]) / len(by_x[s]) for s in xs]
    if x < xs[0] - reach - 1e-12 or x > xs[-1] + reach + 1e-12:
        return math.nan
    if xs[0] <= x <= xs[-1]:
        return float(math.exp(np.interp(x, xs, ys)))
    if len(xs) < 2:
        return math.nan
    (x0, y0), (x1, y1) = (
        ((xs[0], ys[0]), (xs[1], ys[1])) if x < xs[0] else ((xs[-2], ys[-2]), (xs[-1], ys[-1]))
    )
    return float(math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0)))


def curve_at(points: Sequence[tuple[float, float]], xs: Sequence[float], reach: float = 0.0) -> list[float]:
    return [interpolate(points, x, reach) for x in xs]


# --------------------------------------------------------------------------------------- paired intervals


def paired_ratio(method: Sequence[float], puzzle: Sequence[float], z: float = Z95) -> dict[str, float]:
    """mean(method) / mean(puzzle) over the same batches (per-batch KLs, paired by position), and its
    interval exp(log R -/+ z se), se^2 = (var a / a^2 + var b / b^2 - 2 cov(a, b) / (a b)) / n with a, b the
    means and the sample (co)variances (n - 1): the delta method on the log of a ratio of paired means.
    > 1: Puzzle lower; the interval excludes 1: beyond the noise of the batches."""
    a, b = np.asarray(method, dtype=np.float64), np.asarray(puzzle, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired per-batch values need one shape, found {a.shape} and {b.shape}")
    n = len(a)
    ma, mb = float(a.mean()), float(b.mean())
    ratio = ma / mb
    if n < 2:
        return {"ratio": ratio, "low": math.nan, "high": math.nan, "batches": n}
    cov = np.cov(a, b, ddof=1)
    var = (cov[0, 0] / ma**2 + cov[1, 1] / mb**2 - 2 * cov[0, 1] / (ma * mb)) / n
    se = math.sqrt(max(var, 0.0))
    return {"ratio": ratio, "low": ratio * math.exp(-z * se), "high": ratio * math.exp(z * se), "batches": n}


# Student's t 97.5% quantiles for 1..30 degrees of freedom (no scipy in the dependencies); beyond, Z95.
T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def t975(df: int) -> float:
    """Student's t 97.5% quantile with `df` >= 1 degrees of freedom (the normal's from 31 on)."""
    if df < 1:
        raise ValueError(f"a t quantile needs at least 1 degree of freedom, found {df}")
    return T975[df - 1] if df <= len(T975) else Z95


def hierarchical_ratio(
    method: Sequence[Sequence[float]],
    puzzle: Sequence[Sequence[float]],
    draws: int = 4000,
    seed: int = 0,
) -> dict[str, float]:
    """mean(method) / mean(puzzle) over every GKD seed's test batches, and a 95% interval from a two-level
    bootstrap that holds across GKD seeds.

    `method[s]` and `puzzle[s]` are the two children after GKD seed s (rows), measured on the same test
    batches (columns). Each draw resamples the seeds (with replacement, as many as there are), then for each
    drawn seed its batches (with replacement, independently per drawn seed), and takes the ratio of the two
    means over the draw; paired at both levels: a draw takes the same (seed, batch) cells of both methods.
    The seeds' disagreement thus widens the interval, which a bootstrap over one seed's batches misses.

    The interval is exp(log R -/+ t se): se the draws' standard deviation of the log ratio times
    sqrt(S / (S - 1)), t Student's 97.5% quantile with S - 1 degrees of freedom (S seeds). With 3 seeds a
    plain percentile interval of the same draws is only about the spread of the seeds' ratios (the seed level
    has 10 distinct draws) and covers a known ratio about 72% of the time when the seeds disagree more than
    the batches; this one about 95%, and more when the batches dominate (tests/test_ablations.py measures
    both). "low"/"high": that interval; "percentile_low"/"percentile_high": the plain percentile one. One
    seed: the batch bootstrap with the normal quantile. > 1: Puzzle lower; the interval excludes 1: beyond
    the noise of the seeds and the batches."""
    a, b = np.asarray(method, dtype=np.float64), np.asarray(puzzle, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2 or 0 in a.shape:
        raise ValueError(
            f"paired per-seed, per-batch values need one shape [seeds, batches], found {a.shape} and {b.shape}"
        )
    seeds, batches = a.shape
    ratio = float(a.mean() / b.mean())
    out: dict[str, float] = {"ratio": ratio, "seeds": seeds, "batches": batches, "draws": draws}
    if seeds * batches < 2:
        nan = math.nan
        return {**out, "low": nan, "high": nan, "percentile_low": nan, "percentile_high": nan}
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, seeds, size=(draws, seeds, 1))  # the seeds each draw takes
    cols = rng.integers(0, batches, size=(draws, seeds, batches))  # each drawn seed's batches
    # Every (seed, batch) cell weighs the same (each seed has the same batches), so a mean is a sum.
    samples = a[rows, cols].sum(axis=(1, 2)) / b[rows, cols].sum(axis=(1, 2))
    spread = float(np.log(samples).std(ddof=1))
    q = Z95 if seeds == 1 else t975(seeds - 1) * math.sqrt(seeds / (seeds - 1))
    low, high = np.quantile(samples, [0.025, 0.975])
    return {
        **out,
        "low": ratio * math.exp(-q * spread),
        "high": ratio * math.exp(q * spread),
        "percentile_low": float(low),
        "percentile_high": float(high),
    }


# ----------------------------------------------------------------------------------------------- crossover


def crossover(compressions: Sequence[float], puzzle: Sequence[float], uniform: Sequence[float]) -> float:
    """The compression from which on Puzzle's KL is below uniform pruning's at every larger compression given:
    d = log(uniform / puzzle) at each compression (ascending; NaN entries skipped), the zero of d linearly
    interpolated between the last compression where d <= 0 and the next. -inf: Puzzle lower everywhere (the
    crossover lies at or below the least compression); +inf: not lower at the largest (none in range)."""
    pts = sorted(
        (c, math.log(u / p))
        for c, p, u in zip(compressions, puzzle, uniform)
        if p > 0 and u > 0 and math.isfinite(p) and math.isfinite(u)
    )
    if not pts:
        return math.nan
    losing = [i for i, (_, d) in enumerate(pts) if d <= 0]
    if not losing:
        return -math.inf
    j = losing[-1]
    if j == len(pts) - 1:
        return math.inf
    (c0, d0), (c1, d1) = pts[j], pts[j + 1]
    return c0 + (c1 - c0) * (-d0) / (d1 - d0)


def bootstrap_crossover(
    levels: Sequence[float],
    puzzle: Mapping[float, tuple[float, np.ndarray]],
    uniform: Mapping[float, tuple[float, np.ndarray]],
    draws: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """The crossover (`crossover`) of the curves at equal size and its 95% percentile interval.

    `puzzle[level]` / `uniform[level]`: (the size the method reached, per-batch KLs [seeds, batches]) on the
    same test batches. Each draw resamples the batches (the same ones for every level and both methods:
    paired) and one GKD seed per method and level, takes the mean KL, interpolates each method's curve at the
    budgets (equal size) and finds the crossover there. ±inf draws count at their end (`crossover`)."""
    rng = np.random.default_rng(seed)
    grid = sorted(levels)
    usable = [lv for lv in grid if lv in puzzle and lv in uniform]
    if len(usable) < 2:
        return {"crossover": math.nan, "low": math.nan, "high": math.nan, "draws": 0}
    n = min(np.asarray(puzzle[lv][1]).shape[-1] for lv in usable)

    def one(index: np.ndarray | None, pick: bool) -> float:
        curves = []
        for table in (puzzle, uniform):
            points = []
            for lv in usable:
                size, values = table[lv][0], np.atleast_2d(np.asarray(table[lv][1], dtype=np.float64))[:, :n]
                row = values[rng.integers(len(values))] if pick else values.mean(axis=0)
                points.append((size, float((row if index is None else row[index]).mean())))
            curves.append(curve_at(points, usable, REACH))
        return crossover([1 - lv for lv in usable], curves[0], curves[1])

    point = one(None, pick=False)
    samples = np.array([one(rng.integers(0, n, size=n), pick=True) for _ in range(draws)])
    valid = np.sort(samples[~np.isnan(samples)])  # ±inf kept: they sort to the ends
    low, high = (_quantile(valid, q) for q in (0.025, 0.975)) if len(valid) else (math.nan, math.nan)
    return {
        "crossover": point,
        "low": low,
        "high": high,
        "draws": draws,
        "below_range": float(np.mean(samples == -math.inf)),
        "above_range": float(np.mean(samples == math.inf)),
        "compressions": [1 - lv for lv in usable],
    }


def _quantile(ordered: np.ndarray, q: float) -> float:
    """The nearest-rank quantile of sorted values (no interpolation, which ±inf would turn into NaN)."""
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


# ---------------------------------------------------------------------------------------------- Spearman


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties), without scipy; NaN under 3 points."""

    def ranks(values: Sequence[float]) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        order = np.argsort(values, kind="stable")
        out = np.empty(len(values))
        out[order] = np.arange(len(values), dtype=np.float64)
        for value in np.unique(values):
            tied = values == value
            out[tied] = out[tied].mean()
        return out

    if len(x) < 3:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def within_level_spearman(pairs: Mapping[float, Sequence[tuple[float, float]]]) -> dict[float, float]:
    """{level: Spearman of (predicted, measured) over that level's distinct children}: what the pooled
    figure hides, since compression raises both together."""
    return {level: spearman([p for p, _ in v], [m for _, m in v]) for level, v in pairs.items()}
