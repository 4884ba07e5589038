"""benchmarks/ablation_stats.hierarchical_ratio: the interval over GKD seeds and test batches together holds
where the one-seed batch interval does not, covers a known ratio in simulation, is paired, and is exact."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from ablation_helpers import benchmark_module

stats = benchmark_module("ablation_stats")


def _children(rng: np.random.Generator, ratios, batches: int, seed_sd: float, batch_sd: float):
    """Per-batch KLs [seeds, batches] of a method and of Puzzle after each GKD seed: the batches' shared
    difficulty (what pairing cancels), each seed's own offset of the method (`ratios`, times a lognormal of
    `seed_sd`) and of Puzzle, and per-cell noise `batch_sd`."""
    seeds = len(ratios)
    difficulty = rng.lognormal(0.0, 0.5, size=batches)
    puzzle = np.exp(rng.normal(0.0, seed_sd, (seeds, 1)) + rng.normal(0.0, batch_sd, (seeds, batches)))
    method = np.exp(
        np.log(np.asarray(ratios, dtype=np.float64))[:, None]
        + rng.normal(0.0, seed_sd, (seeds, 1))
        + rng.normal(0.0, batch_sd, (seeds, batches))
    )
    return method * difficulty, puzzle * difficulty


def test_seeds_that_disagree_more_than_batches_widen_the_interval_to_cover_them():
    # The case: greedy / Puzzle 0.97 in one GKD seed and 0.87 in another (with a third between),
    # each tight over its batches.
    rng = np.random.default_rng(0)
    method, puzzle = _children(rng, (0.97, 0.87, 0.92), batches=16, seed_sd=0.0, batch_sd=0.02)
    per_seed = [stats.paired_ratio(m, p) for m, p in zip(method, puzzle)]
    values = [r["ratio"] for r in per_seed]
    # Each seed's batch interval excludes another seed's ratio: it does not hold across seeds.
    for r in per_seed:
        assert any(not r["low"] <= v <= r["high"] for v in values)
    pooled = stats.hierarchical_ratio(method, puzzle)
    assert pooled["ratio"] == pytest.approx(method.mean() / puzzle.mean())
    assert pooled["low"] < min(values) and max(values) < pooled["high"]
    assert pooled["high"] > 1  # 0.87-0.97 over three seeds is not "beyond the noise"
    # The plain percentile interval of the same draws spans about the seeds' ratios, no wider.
    assert pooled["percentile_low"] == pytest.approx(min(values), abs=0.01)
    assert pooled["percentile_high"] == pytest.approx(max(values), abs=0.01)


def _coverage(seeds: int, seed_sd: float, batch_sd: float, reps: int = 200) -> tuple[float, float]:
    """How often each interval (t-scaled, percentile) holds the true ratio 1.1 over `reps` simulations."""
    hits = np.zeros(2)
    for rep in range(reps):
        rng = np.random.default_rng(1000 + rep)
        method, puzzle = _children(rng, [1.1] * seeds, batches=16, seed_sd=seed_sd, batch_sd=batch_sd)
        found = stats.hierarchical_ratio(method, puzzle, draws=500, seed=rep)
        hits += [
            found["low"] <= 1.1 <= found["high"],
            found["percentile_low"] <= 1.1 <= found["percentile_high"],
        ]
    return tuple(hits / reps)


def test_the_interval_covers_a_known_ratio_with_three_seeds():
    # Seeds disagree more than batches (as in the replication): the t-scaled interval holds about 95% of
    # the time; the plain percentile one (what a two-level bootstrap gives by itself) about 72%.
    scaled, percentile = _coverage(3, seed_sd=0.05, batch_sd=0.02)
    assert 0.90 <= scaled <= 0.99
    assert percentile < 0.85
    # Batch noise dominant: the seed level's few degrees of freedom make it conservative, never short.
    scaled, _ = _coverage(3, seed_sd=0.005, batch_sd=0.05)
    assert scaled >= 0.93


def test_it_is_paired_by_seed_and_batch():
    # A method exactly 2x Puzzle in every (seed, batch) cell is 2x with no doubt, however much the seeds
    # and batches vary; the same cells shuffled across seeds and batches leave a wide interval.
    rng = np.random.default_rng(3)
    puzzle = rng.lognormal(0.0, 0.8, size=(3, 8))
    exact = stats.hierarchical_ratio(2 * puzzle, puzzle)
    assert exact["low"] == pytest.approx(2.0) and exact["high"] == pytest.approx(2.0)
    shuffled = stats.hierarchical_ratio(2 * rng.permutation(puzzle.ravel()).reshape(3, 8), puzzle)
    assert shuffled["high"] / shuffled["low"] > 1.5


def test_the_draws_follow_the_two_level_resampling_exactly():
    # On 2 seeds x 2 batches every draw is one of 4 seed picks x 4 batch picks per drawn seed: the exact
    # distribution of the draws' log ratio, enumerated, against the bootstrap's standard deviation.
    method = np.array([[1.0, 3.0], [2.0, 5.0]])
    puzzle = np.array([[1.0, 2.0], [1.5, 2.5]])
    picks = list(itertools.product(range(2), repeat=2))
    logs = []
    for rows in picks:  # each of the 4 equally likely seed draws
        for cols in itertools.product(picks, repeat=2):  # each drawn seed's batches, 4 x 4
            m = sum(method[r, c] for r, row in zip(rows, cols) for c in row)
            p = sum(puzzle[r, c] for r, row in zip(rows, cols) for c in row)
            logs.append(math.log(m / p))
    exact_sd = float(np.std(logs))
    found = stats.hierarchical_ratio(method, puzzle, draws=200_000, seed=5)
    q = stats.t975(1) * math.sqrt(2)
    ratio = method.mean() / puzzle.mean()
    assert found["ratio"] == pytest.approx(ratio)
    assert math.log(found["high"] / ratio) / q == pytest.approx(exact_sd, rel=0.01)
    # A fixed rng gives the same numbers, another seed others.
    again = stats.hierarchical_ratio(method, puzzle, draws=200_000, seed=5)
    assert again == found
    assert stats.hierarchical_ratio(method, puzzle, draws=2000, seed=6)["low"] != pytest.approx(
        stats.hierarchical_ratio(method, puzzle, draws=2000, seed=7)["low"], rel=1e-9
    )


def test_shapes_and_the_t_quantiles():
    with pytest.raises(ValueError, match=r"\[seeds, batches\]"):
        stats.hierarchical_ratio([[1.0, 2.0]], [[1.0, 2.0, 3.0]])
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 10, 30):
        assert stats.t975(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=1e-3)
    assert stats.t975(31) == stats.Z95
