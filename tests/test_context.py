"""puzzle.context: candidates rescored in the child's context (the child's own choices 0, the others their
increase over the child's damage, failed ones left out) and the kept round (lowest measured, first of equals)."""

from __future__ import annotations

import pytest

from puzzle.context import best_round, context_candidates
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
