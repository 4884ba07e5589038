"""The seed's published Nemotron-3-Super -> Puzzle-75B-A9B figures, as our cost model reproduces them.

The assumptions behind each figure are written out in examples/nemotron3_super_budget.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from puzzle.cost.analytic import model_active_params, model_params, model_weight_bytes
from puzzle.cost.hardware import get_hardware
from puzzle.cost.roofline import max_concurrent_requests
from puzzle.presets import nemotron3_super, puzzle_75b_a9b_like

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nemotron3_super_budget.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("nemotron3_super_budget", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("build", "total", "active"),
    [(nemotron3_super, 120.7e9, 12.8e9), (puzzle_75b_a9b_like, 75.3e9, 9.3e9)],
    ids=["super", "puzzle-75b-like"],
)
def test_parameters_within_half_a_percent_of_published(build, total, active):
    spec = build()
    assert model_params(spec) == pytest.approx(total, rel=0.005)
    assert model_active_params(spec) == pytest.approx(active, rel=0.005)


def test_nvfp4_weight_memory_is_near_the_published_70_and_44_5_gb():
    parent, child = (
        model_weight_bytes(nemotron3_super(), "nvfp4"),
        model_weight_bytes(puzzle_75b_a9b_like(), "nvfp4"),
    )
    assert parent == pytest.approx(69.544e9, rel=1e-4)  # our figure (published: about 70 GB)
    assert child == pytest.approx(44.054e9, rel=1e-4)  # our figure (published: about 44.5 GB)
    assert parent == pytest.approx(70e9, rel=0.02) and child == pytest.approx(44.5e9, rel=0.02)


def test_regression_pin_concurrent_million_token_requests_at_a_fitted_memory_fraction():
    """A regression pin, not a check against the paper: the published 1 (parent) and 8 (child) concurrent
    1M-token requests on one H100 come out only at a usable-memory fraction (0.912) fitted to them; at
    vLLM's default 0.9 our model says 1 and 7. Only the brute-force count below is an independent check."""
    parent, child = nemotron3_super(), puzzle_75b_a9b_like()

    def count(spec, fraction):
        return max_concurrent_requests(spec, "h100-80gb", 1_000_000, "nvfp4", "fp8", fraction)

    # Our model at vLLM's default memory fraction: 1 and 7 (published: 1 and 8).
    assert (count(parent, 0.9), count(child, 0.9)) == (1, 7)
    # The published pair holds in a narrow window of usable memory: 0.912 is fitted to it, so this pins our
    # figures (weights, per-request state) rather than confirming them.
    assert (count(parent, 0.912), count(child, 0.912)) == (1, 8)
    # Brute force: the largest n whose weights + n requests fit.
    usable = 0.9 * get_hardware("h100-80gb").memory_bytes
    per_request = 4096 * 1_000_000 + 40 * (128 * 64 * 96 * 4 + 3 * (8192 + 2 * 8 * 96) * 2)
    n = 0
    while model_weight_bytes(child, "nvfp4") + (n + 1) * per_request <= usable:
        n += 1
    assert count(child, 0.9) == n


def test_example_prints_the_side_by_side_table_and_throughput_ratios(example, capsys):
    example.main()
    out = capsys.readouterr().out
    assert "| total parameters (B) | 120.70 | 120.67 | 75.30 | 75.35 |" in out
    assert "Assumptions" in out and "fp8" in out
    ratios = [float(line.rsplit("x", 1)[1]) for line in out.splitlines() if "output throughput x" in line]
    # Published on 8xB200: x1.60 (50K in / 2K out), x2.03-2.14 (8K in / 64K out); ours: one B200 roofline.
    assert ratios[0] == pytest.approx(1.60, abs=0.15)
    assert ratios[1] == pytest.approx(2.08, abs=0.2)
