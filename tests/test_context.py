"""puzzle.context: candidates rescored in the child's context (the child's own choices 0, the others their
increase over the child's damage, failed ones left out) and the kept round (lowest measured, first of equals)."""

from __future__ import annotations

import pytest

from puzzle.context import best_round, context_candidates, implausible_prediction
from puzzle.problem import RunCandidates
from puzzle.scores import VariantScore
from puzzle.search.types import SearchError
from puzzle.spec import MLPSpec, ModelSpec, NoOpSpec, Variant

PARENT = ModelSpec(vocab_size=16, hidden_size=8, blocks=(MLPSpec(width=8), MLPSpec(width=8)))


def _score(variant: Variant, kl: float | None, failed: str | None = None) -> VariantScore:
    return VariantScore(variant, 10, kl, 0.0, 1.0, 1.0, 0.0, failed)


def _candidates() -> RunCandidates:
    specs = [[MLPSpec(width=8), MLPSpec(width=4), NoOpSpec()] for _ in range(2)]
    return RunCandidates(PARENT, specs, [[0.0, 0.1, 0.2], [0.0, 0.1, 0.2]])


def test_the_childs_own_choices_score_zero_and_the_others_their_increase():
    candidates = _candidates()
    own = [Variant(0, MLPSpec(width=4)), Variant(1, NoOpSpec())]
    child_kl = 0.5
    scores = {
        Variant(0, MLPSpec(width=8)): _score(Variant(0, MLPSpec(width=8)), 0.3),
        own[0]: _score(own[0], child_kl),
        Variant(0, NoOpSpec()): _score(Variant(0, NoOpSpec()), 0.9),
        Variant(1, MLPSpec(width=8)): _score(Variant(1, MLPSpec(width=8)), 0.35),
        Variant(1, MLPSpec(width=4)): _score(Variant(1, MLPSpec(width=4)), None, "non-finite logits"),
        own[1]: _score(own[1], child_kl),
    }
    rescored, base = context_candidates(candidates, scores, own, "kl")
    assert base == child_kl
    assert rescored.scores[0] == [pytest.approx(-0.2), 0.0, pytest.approx(0.4)]
    # The failed variant of block 1 is left out, with a note; the parent's block stays first.
    assert rescored.variants[1] == [MLPSpec(width=8), NoOpSpec()]
    assert rescored.scores[1] == [pytest.approx(-0.15), 0.0]
    assert any("block 1" in note and "failed" in note for note in rescored.notes)
    # A failed parent block cannot be left out (the table needs it first): it scores above every other.
    scores[Variant(1, MLPSpec(width=8))] = _score(Variant(1, MLPSpec(width=8)), None, "non-finite logits")
    rescored, _ = context_candidates(candidates, scores, own, "kl")
    assert rescored.variants[1][0] == MLPSpec(width=8) and rescored.scores[1][0] > 0
    # A child that is not finite itself has nothing to rescore against.
    scores[own[0]] = _score(own[0], None, "non-finite logits")
    with pytest.raises(SearchError, match="the child itself has no kl score"):
        context_candidates(candidates, scores, own, "kl")


def test_the_kept_round_measured_lowest_and_is_the_first_of_equals():
    assert best_round([{"measured": 0.3}, {"measured": 0.2}, {"measured": 0.25}]) == 1
    assert best_round([{"measured": 0.2}, {"measured": 0.2}]) == 0
    # A round the guard refused was never measured: it is never kept.
    assert (
        best_round([{"measured": 0.3}, {"measured": 0.25}, {"predicted": -0.6, "rejected": "below zero"}])
        == 1
    )


def test_a_prediction_below_zero_or_beyond_the_factor_is_refused_with_its_reason():
    # The case of issue 36: two rounds predicted a KL of -0.62, then -0.033.
    for predicted in (-0.62, -0.033):
        reason = implausible_prediction(predicted, 0.41, 3.0)
        assert reason is not None and "below zero" in reason
        assert f"{predicted:.6g}" in reason and "0.41" in reason and "guard factor 3" in reason
    # A factor either way: 0.41 / 0.1 = 4.1 below, 2 / 0.41 = 4.9 above; 3x itself is still taken.
    assert implausible_prediction(0.1, 0.41, 3.0) == (
        "the predicted kl 0.1 is 4.1x below the last measured child's 0.41 (guard factor 3)"
    )
    assert "4.88x above" in implausible_prediction(2.0, 0.41, 3.0)
    assert (
        implausible_prediction(0.41 / 3, 0.41, 3.0) is None
        and implausible_prediction(1.23, 0.41, 3.0) is None
    )
    assert implausible_prediction(0.3, 0.41, 3.0) is None and implausible_prediction(0.41, 0.41, 1.01) is None
    # A predicted 0 from a positive measurement is infinitely far; a child that measured 0 gives no scale.
    assert "infinitely below" in implausible_prediction(0.0, 0.41, 3.0)
    assert implausible_prediction(0.2, 0.0, 3.0) is None and implausible_prediction(0.0, 0.0, 3.0) is None
    for value in (float("nan"), float("-inf")):
        assert "not finite" in implausible_prediction(value, 0.41, 3.0)
    # The objectives that cannot go below zero (top1/top5 as disagreements); the LM-loss delta can.
    for objective in ("hidden_nmse", "top1", "top5"):
        assert f"predicted {objective} -0.01 is below zero" in implausible_prediction(
            -0.01, 0.2, 3.0, objective
        )
    assert implausible_prediction(-0.01, 0.2, 3.0, "lm_loss_delta") is None
    assert "5x below" in implausible_prediction(0.04, 0.2, 3.0, "lm_loss_delta")
    # Factor 0: off, nothing refused.
    assert implausible_prediction(-0.62, 0.41, 0.0) is None and implausible_prediction(0.0, 0.41, 0.0) is None
