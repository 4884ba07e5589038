"""benchmarks/paired_eval.py: its paired comparison of two models' per-item scores against scipy's McNemar
(an exact binomial test on the discordant items) and a difference computed by hand."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from paired_eval import mcnemar_p, paired


@pytest.mark.parametrize(("a_only", "b_only"), [(0, 5), (3, 9), (12, 12), (40, 21), (1, 0)])
def test_mcnemar_matches_scipys_exact_binomial_test(a_only: int, b_only: int) -> None:
    binomtest = pytest.importorskip("scipy.stats").binomtest  # with the eval extra (lm-eval needs it)

    expected = binomtest(a_only, a_only + b_only, 0.5).pvalue
    assert mcnemar_p(a_only, b_only) == pytest.approx(expected, rel=1e-12)
    assert mcnemar_p(0, 0) == 1.0


def test_paired_counts_only_the_items_the_models_differ_on() -> None:
    # 10 items: both right on 3, both wrong on 4, a alone right on 2, b alone on 1
    a = [1, 1, 1, 0, 0, 0, 0, 1, 1, 0]
    b = [1, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    result = paired([float(x) for x in a], [float(x) for x in b])
    differences = [x - y for x, y in zip(a, b)]
    mean = sum(differences) / 10
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / 9)
    assert result["difference"] == pytest.approx(0.1) and result["stderr"] == pytest.approx(
        sd / math.sqrt(10)
    )
    assert (result["a_only"], result["b_only"]) == (2, 1)
    assert result["p_mcnemar"] == pytest.approx(1.0)  # 2 against 1: no evidence
    with pytest.raises(ValueError, match="same documents"):
        paired([1.0, 0.0], [1.0])
