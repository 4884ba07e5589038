"""puzzle.context: candidates rescored in the child's context (the child's own choices 0, the others their
increase over the child's damage, failed ones left out) and the kept round (lowest measured, first of equals)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any

import pytest

from puzzle.config.run import SearchConfig
from puzzle.context import best_round, context_candidates, context_rounds, implausible_prediction
from puzzle.problem import RunCandidates, run_problem
from puzzle.scores import Scores, VariantScore
from puzzle.search import search
from puzzle.search.types import SearchError, Solution
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
    # The case an independent re-run hit: two rounds predicted a KL of -0.62, then -0.033.
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


# The context-round loop (`context_rounds`) on a real search problem: six MLP blocks under an active-parameter
# budget, solved by the MIP as a run solves it. The scores stand for a model's: a child's damage is
# `_damage` (replace-one-block damages plus a penalty for neighbours both compressed, so scores measured in
# the parent do not add up and a round in context moves), and a round's scores in context are that damage
# of the child with one block replaced, as `score_variants(..., context=child)` measures them.
BLOCKS = 6
WIDE = ModelSpec(vocab_size=16, hidden_size=8, blocks=tuple(MLPSpec(width=16) for _ in range(BLOCKS)))
SPECS = (MLPSpec(width=16), MLPSpec(width=8), MLPSpec(width=4), NoOpSpec())
ALONE = {16: 0.0, 8: 0.05, 4: 0.12, None: 0.3}  # a block's damage in the parent, by width (None: no-op)


def _alone(variant: Variant) -> float:
    return ALONE[getattr(variant.spec, "width", None)] * (1 + 0.3 * variant.block_index)


def _damage(architecture: list[Variant]) -> float:
    alone = [_alone(variant) for variant in architecture]
    return sum(alone) + 8.0 * sum(a * b for a, b in itertools.pairwise(alone))


class _Rounds:
    """A run's two callables of `context_rounds` over WIDE under `budget`, recording every scoring call;
    from round `overshoot` on, the scores in context are those of a failed expansion: every variant other
    than the child's scores `gain` below the child, as if each upgrade were alone."""

    def __init__(self, root, budget: str, overshoot: int | None = None, gain: float = 0.3) -> None:
        self.root, self.budget, self.overshoot, self.gain = root, [budget], overshoot, gain
        self.candidates = RunCandidates(
            WIDE,
            [list(SPECS) for _ in range(BLOCKS)],
            [[_alone(Variant(block, spec)) for spec in SPECS] for block in range(BLOCKS)],
        )
        self.calls: list[tuple[int, str]] = []

    def first(self) -> list[Solution]:
        problem = run_problem(self.root, self.budget, candidates=self.candidates)
        return [search(problem.table, problem.problem.limits, problem.problem.rules)]

    def score_in_child(self, number: int, own: list[Variant], wanted: list[Variant], what: str) -> Scores:
        self.calls.append((number, what))
        child = _damage(own)
        records = {}
        for variant in wanted:
            if self.overshoot is not None and number >= self.overshoot and what == "round":
                kl = child if variant in own else child - self.gain
            else:
                kl = _damage([variant if mine.block_index == variant.block_index else mine for mine in own])
            records[variant] = VariantScore(variant, 100, kl, 0.0, 1.0, 1.0, 0.0)
        return Scores(records, 100, 1.0)

    def solve(self, candidates: RunCandidates, own: list[Variant]) -> Solution:
        problem = run_problem(self.root, self.budget, candidates=candidates)
        return search(problem.table, problem.problem.limits, problem.problem.rules)

    def run(self, **settings: Any) -> tuple[list[Solution], dict[str, Any]]:
        config = SearchConfig(**settings)
        return context_rounds("test", self.first(), self.candidates, config, self.score_in_child, self.solve)


def _timeless(solutions: list[Solution]) -> list[Solution]:
    """`solutions` without the solver's time, the one field that differs between two equal solves."""
    return [dataclasses.replace(solution, seconds=0.0) for solution in solutions]


def test_a_round_predicting_a_negative_kl_stops_and_the_measured_child_is_kept(tmp_path, caplog):
    """Issue 36's case: `context_rounds: 2`, a re-solve free to change every block adds up six upgrades
    each measured alone and predicts a KL below zero. The round is not taken: its child is never measured,
    the kept solution is the first search's child, and the reason is recorded and logged."""
    rounds = _Rounds(tmp_path, "active_params<=0.7x", overshoot=1)
    with caplog.at_level(logging.WARNING, logger="puzzle.context"):
        solutions, record = rounds.run(context_rounds=2)
    first = rounds.first()[0]
    own = [Variant(block, SPECS[index]) for block, index in enumerate(first.choices)]
    measured = _damage(own)
    entries = record["rounds"]
    assert len(entries) == 2 and record["stopped"] == 1 and record["kept"] == 0
    assert entries[0] == {"choices": first.names, "predicted": first.objective, "measured": measured}
    changed = sum(entries[1]["choices"][block] != first.names[block] for block in first.names)
    assert changed >= 4 and entries[1]["predicted"] < 0 and "measured" not in entries[1]
    assert entries[1]["predicted"] == pytest.approx(measured - changed * rounds.gain)
    assert entries[1]["rejected"] == implausible_prediction(entries[1]["predicted"], measured, 3.0)
    assert "below zero" in entries[1]["rejected"]
    # The fallback is the last measured child, with its own prediction: the first search's solution.
    assert _timeless(solutions) == _timeless([first])
    assert rounds.calls == [(1, "round")]  # the refused child was neither measured nor rescored
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "search test, context round 1 not taken" in message and f"{entries[1]['predicted']:.6g}" in message
    assert f"{measured:.6g}" in message and "guard factor 3" in message and "round 0's" in message

    # Without the guard the loop goes on as before it existed: the nonsense child is measured, and kept
    # only if it measures lowest (here it measures worse).
    caplog.clear()
    unguarded = _Rounds(tmp_path, "active_params<=0.7x", overshoot=1)
    _, plain = unguarded.run(context_rounds=2, context_guard=0)
    assert "stopped" not in plain and all("measured" in entry for entry in plain["rounds"])
    assert plain["rounds"][1]["choices"] == entries[1]["choices"] and plain["rounds"][1]["predicted"] < 0
    assert (1, "round") in unguarded.calls and len(unguarded.calls) > 1


def test_a_later_round_beyond_the_factor_falls_back_to_the_child_measured_before_it(tmp_path):
    """Round 1 is sane (it improves the measured KL); round 2's scores overshoot to a prediction more than
    `context_guard` below round 1's measured KL, though above zero: round 2 is refused and round 1's child,
    the last measured, is kept with its prediction."""
    rounds = _Rounds(tmp_path, "active_params<=0.7x", overshoot=2, gain=0.06)
    solutions, record = rounds.run(context_rounds=3, context_guard=1.5)
    entries = record["rounds"]
    assert len(entries) == 3 and record["stopped"] == 2 and record["kept"] == 1
    assert entries[1]["measured"] < entries[0]["measured"]  # round 1 improved on the first child
    assert 0 < entries[2]["predicted"] < entries[1]["measured"] / 1.5 and "measured" not in entries[2]
    assert "x below the last measured child's" in entries[2]["rejected"]
    assert solutions[0].names == entries[1]["choices"] and solutions[0].objective == entries[1]["predicted"]
    assert rounds.calls == [(1, "round"), (2, "round")]


def test_sane_rounds_run_as_before_the_guard(tmp_path):
    """Predictions within the factor: every round runs, measured and kept as before the guard existed
    (the record bit-equal to the guard off, and to main's loop before the guard: the literals)."""
    guarded = _Rounds(tmp_path, "active_params<=0.6x")
    solutions, record = guarded.run(context_rounds=3)
    off = _Rounds(tmp_path, "active_params<=0.6x")
    unguarded, unguarded_record = off.run(context_rounds=3, context_guard=0)
    assert _timeless(solutions) == _timeless(unguarded) and record == unguarded_record
    assert guarded.calls == off.calls == [(1, "round"), (2, "round")]
    assert "stopped" not in record and not any("rejected" in entry for entry in record["rounds"])
    # Round 1 changes the child, round 2 returns to the first child (a cycle, its measurement reused).
    assert [entry["predicted"] for entry in record["rounds"]] == [0.525, 0.83544, 0.7960400000000001]
    assert [entry["measured"] for entry in record["rounds"]] == [
        0.8470000000000001,
        0.8864000000000001,
        0.8470000000000001,
    ]
    assert record["kept"] == 0 and record["rounds"][2]["choices"] == record["rounds"][0]["choices"]
