"""Scores in context: the search's candidates rescored in the solved child instead of the parent.

Replace-one-block scores (`puzzle.score`) measure each variant in the parent. At high compression they stop
adding up: a block replaced in a child whose other blocks are already replaced does more damage than in the
parent, so the MIP's sum predicts far less than the assembled child measures. After a first solve, every
candidate of block i is scored again with the *current child* as the context (`score_variants(...,
context=child)`: the child with block i := v, KL still to the parent) and expressed as the increase over the
child's own:

    score(i, v) = D(child with block i := v) - D(child)

where D is the search objective's damage (`puzzle.problem.objective_damage`: the KL by default). The child's
own choice scores exactly 0 in every block, and the objective's constant is D(child): a solve on these
scores predicts D(child) + sum_i score(i, v_i), exact for any architecture that differs from the child in
at most one block, a first-order expansion around the child for the others. `puzzle.Run` repeats
(`search.context_rounds`) until the choice repeats or the rounds run out, and keeps the round whose child
measured lowest (see `best_round`). `search.context_changes` bounds how many blocks a round may change
(`limit_changes`: a trust region around the child, where the expansion holds). `search.context_guard`
stops the rounds at a prediction the expansion cannot have meant (`implausible_prediction`: below zero,
or more than a factor from the KL its child measured); the best child measured so far is kept.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from puzzle.cost.limits import Bound
from puzzle.problem import RunCandidates, RunProblem, objective_damage
from puzzle.scores import Scores, VariantScore
from puzzle.search.types import SearchError, Solution
from puzzle.spec import Variant

_log = logging.getLogger(__name__)


def child_variants(solution: Solution, candidates: RunCandidates) -> list[Variant]:
    """The child's Variant of every block, from a solution over `candidates`' table (choices index them)."""
    return [Variant(block, candidates.variants[block][index]) for block, index in enumerate(solution.choices)]


def context_damage(scores: Scores, own: list[Variant], objective: str) -> float:
    """The child's own damage D(child) from scores in its context: the record of any own variant (all equal)."""
    record = scores[own[0]]
    value = None if record.failed else objective_damage(objective, record)
    if value is None:
        raise SearchError(
            f"the child itself has no {objective} score in context ({record.failed or 'none recorded'}): "
            "its forward is not finite on the held-out tokens"
        )
    return value


def context_candidates(
    candidates: RunCandidates, scores: Mapping[Variant, VariantScore], own: list[Variant], objective: str
) -> tuple[RunCandidates, float]:
    """(`candidates` with every score replaced by its increase over the child's damage in the child's
    context, D(child)). `scores`: every candidate's record from `score_variants(..., context=child)`; `own`:
    the child's variant of every block. A candidate whose scoring in context failed is left out (a note says
    so), but for the parent's block, which the table needs first: it keeps a score above every other.
    """
    base = context_damage(Scores(dict(scores), 0, 0.0), own, objective)
    variants: list[list[Any]] = []
    values: list[list[float]] = []
    notes = list(candidates.notes)
    for block, specs in enumerate(candidates.variants):
        kept, kept_values = [], []
        for spec in specs:
            variant = Variant(block, spec)
            record = scores.get(variant)
            if record is None:
                raise SearchError(f"block {block} variant {variant.id} has no score in context")
            value = None if record.failed else objective_damage(objective, record)
            if value is None:
                notes.append(
                    f"block {block} variant {variant.id}: scoring in context failed ({record.failed})"
                )
                if spec is not specs[0]:
                    continue
                value = float("inf")
            # The child's own choice is the child: exactly 0 (its record is the child's own sums).
            kept.append(spec)
            kept_values.append(0.0 if variant in own else value - base)
        finite = [v for v in kept_values if v != float("inf")]
        ceiling = 2 * max([abs(v) for v in finite] + [1.0])
        values.append([ceiling if v == float("inf") else v for v in kept_values])
        variants.append(kept)
    return RunCandidates(candidates.parent, variants, values, notes), base


def predict_in_context(
    scores: Mapping[Variant, VariantScore], own: list[Variant], other: list[Variant], objective: str
) -> float:
    """The damage of the architecture `other` (a Variant per block) predicted around the child `own` from
    `scores` in the child's context: D(child) + sum over the blocks where `other` differs of
    D(child with that block := other's) - D(child). Exact where `other` differs in at most one block; the
    same first-order expansion a round of scores in context solves on, for any architecture (the search's
    own prediction, and a ranking of other children at the child's size; see benchmarks/ablations.py
    --additivity). SearchError for a changed block with no finite score in context."""
    base = context_damage(Scores(dict(scores), 0, 0.0), own, objective)
    if len(other) != len(own):
        raise SearchError(f"the architecture has {len(other)} blocks; the child in context has {len(own)}")
    total = base
    for mine, theirs in zip(own, other):
        if theirs == mine:
            continue
        record = scores.get(theirs)
        value = None if record is None or record.failed else objective_damage(objective, record)
        if value is None:
            reason = "none recorded" if record is None else record.failed or f"no {objective}"
            raise SearchError(
                f"block {theirs.block_index} variant {theirs.id} has no score in context ({reason})"
            )
        total += value - base
    return total


# The objectives no child can score below zero: a prediction under zero is the expansion failing. The
# LM-loss delta may go below zero (a child can predict the held-out tokens better than its parent).
NONNEGATIVE = ("kl", "hidden_nmse", "top1", "top5")


def implausible_prediction(
    predicted: float, measured: float, factor: float, objective: str = "kl"
) -> str | None:
    """Why a context round's prediction `predicted` is not to be taken, or None where it may be: below zero
    (for the objectives in NONNEGATIVE), not finite, or more than `factor` times above or below `measured`,
    the damage of the last measured child (the one the round's scores are around). `factor` 0: no check.
    The ratio is checked only where `measured` > 0 and `predicted` >= 0: with no positive scale there is
    nothing to take a factor of (a predicted 0 from a positive measurement is infinitely far)."""
    if not factor:
        return None
    last = f"the last measured child's {measured:.6g}"
    if not math.isfinite(predicted):
        return f"the predicted {objective} {predicted} is not finite ({last}; guard factor {factor:g})"
    if objective in NONNEGATIVE and predicted < 0:
        return (
            f"the predicted {objective} {predicted:.6g} is below zero, which no child measures "
            f"({last}; guard factor {factor:g})"
        )
    if measured > 0 and predicted >= 0:
        ratio = math.inf if predicted == 0 else max(predicted / measured, measured / predicted)
        if ratio > factor:
            far = "infinitely" if ratio == math.inf else f"{ratio:.3g}x"
            side = "above" if predicted > measured else "below"
            return (
                f"the predicted {objective} {predicted:.6g} is {far} {side} {last} (guard factor {factor:g})"
            )
    return None


CHANGED = "changed_blocks"  # the trust region's cost column: 1 for a variant other than the child's own


def limit_changes(problem: RunProblem, own: list[Variant], most: int) -> RunProblem:
    """`problem` (a round's, over scores in context) with at most `most` blocks changed from the child: a
    trust region. The scores in context are exact for one change and a first-order expansion for several;
    a re-solve free to change every block adds up many upgrades as if each were alone, and overshoots."""
    table = problem.table
    mine = {(v.block_index, v.spec) for v in own}
    changed = [
        0.0 if (block, spec) in mine else 1.0
        for block, specs in enumerate(problem.candidates.variants)
        for spec in specs
    ]
    table.costs[CHANGED] = np.asarray(changed, dtype=np.float64)
    problem.problem.limits.append(Bound(CHANGED, upper=float(most)))
    return problem


def best_round(rounds: list[dict[str, Any]]) -> int:
    """The index of the round whose child measured lowest (the first of equals): the measured damage on the
    held-out tokens is what the search tries to minimise, and the first solve is a round too, so context
    rounds never return a child that measured worse than the plain search's. A round the guard rejected
    (`implausible_prediction`) has no measurement and is never kept."""
    measured = [(entry["measured"], number) for number, entry in enumerate(rounds) if "measured" in entry]
    return min(measured)[1]


def context_rounds(
    name: str,
    found: list[Solution],
    candidates: RunCandidates,
    settings: Any,
    score_in_child: Callable[[int, list[Variant], list[Variant], str], Scores],
    solve: Callable[[RunCandidates, list[Variant]], Solution],
) -> tuple[list[Solution], dict[str, Any]]:
    """(the solutions, the rounds' record) after `settings.context_rounds` rounds of scores in context on
    the best of `found` (the search's solutions, best first). `settings`: the search settings (its
    `context_rounds` and `objective`); `name`: the budget list's, for the log.

    Round r scores every candidate in the child of round r - 1 (`score_in_child(r, the child's variants,
    the variants to score, "round")`), solves on those scores (`solve(the rescored candidates, the child's
    variants)`) and predicts D(child) + the sum; the rounds stop when the choice repeats (the previous
    round's, or an earlier one's: a cycle). The kept architecture is the round whose child measured lowest
    (`best_round`), with its predicted damage as its objective; the other solutions stay as the first
    search found them (one equal to the kept one is dropped). The record: {"rounds": [{"choices",
    "predicted", "measured", "sum"}, ...], "kept": the kept round, "objective"}.

    A round whose prediction `implausible_prediction` refuses (`settings.context_guard`) stops the rounds:
    its child is neither measured nor kept nor rescored (the expansion around its parent round's child has
    failed, so nothing built on it is trusted); its record has "rejected" (the reason) and no "measured",
    and the record gets "stopped" (that round's number). The kept child is then the best measured before
    it (the last measured child where the rounds were improving).
    """
    solutions = [found[0]]
    rounds: list[dict[str, Any]] = [{"choices": dict(found[0].names), "predicted": found[0].objective}]
    wanted = [Variant(block, spec) for block, specs in enumerate(candidates.variants) for spec in specs]
    stopped: int | None = None
    for number in range(1, settings.context_rounds + 1):
        own = child_variants(solutions[-1], candidates)
        scores = score_in_child(number, own, wanted, "round")
        rescored, base = context_candidates(candidates, scores.variants, own, settings.objective)
        rounds[-1]["measured"] = base
        solved = solve(rescored, own)
        solution = dataclasses.replace(solved, objective=base + solved.objective)
        rounds.append(
            {"choices": dict(solution.names), "predicted": solution.objective, "sum": solved.objective}
        )
        solutions.append(solution)
        _log.info(
            "search %s, context round %d: child measured %.6g; re-solved, predicted %.6g",
            name,
            number,
            base,
            solution.objective,
        )
        rejected = implausible_prediction(
            solution.objective, base, settings.context_guard, settings.objective
        )
        if rejected is not None:
            # The expansion around the child failed: its child is not measured, nor a round built on it.
            rounds[-1]["rejected"] = rejected
            stopped, fallback = number, best_round(rounds)
            _log.warning(
                "search %s, context round %d not taken: %s; the rounds stop and keep the best measured child, "
                "round %d's (measured %.6g)",
                name,
                number,
                rejected,
                fallback,
                rounds[fallback]["measured"],
            )
            break
        earlier = [entry for entry in rounds[:-1] if entry["choices"] == rounds[-1]["choices"]]
        if earlier:  # the choice repeats (the last child's, or a cycle): its child was measured before
            rounds[-1]["measured"] = earlier[-1]["measured"]
            break
    if stopped is None and "measured" not in rounds[-1]:  # the last round's child: its own variants alone
        own = child_variants(solutions[-1], candidates)
        scores = score_in_child(len(rounds) - 1, own, own[:1], "measured")
        rounds[-1]["measured"] = context_damage(scores, own, settings.objective)
    kept = best_round(rounds)
    best = solutions[kept]
    others = [solution for solution in found[1:] if solution.names != best.names]
    record: dict[str, Any] = {"rounds": rounds, "kept": kept, "objective": settings.objective}
    if stopped is not None:  # only then: a record of rounds that all ran is the one written before the guard
        record["stopped"] = stopped
    return [best, *others], record
