"""The solutions stage of a run: one search per budget list (solutions/{name}.json), its rounds of scores in
context and re-ranking (measured, or by short GKD: `puzzle.run.rerank`), and the frontier record
(frontier.json).

`record(run)` declares the stage's inputs and its work, and records its outputs through the run's ledger
(`RunContext.stage`); `damage(run, outputs)` says how those outputs are checked on disk before they are
reused; `puzzle.run.Run` gives the typed call.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from puzzle import dist
from puzzle.artifacts import fingerprint_file, fingerprint_json
from puzzle.assemble import assemble as assemble_child
from puzzle.assemble import measured_kl
from puzzle.config import to_dict
from puzzle.context import context_rounds, limit_changes
from puzzle.cost.hardware import profile_to_json
from puzzle.files import atomic_write_bytes
from puzzle.library import Library, read_library
from puzzle.model import HybridLM
from puzzle.problem import RunCandidates, RunProblem, frontier_budgets, frontier_sweep, rerank_by_measurement
from puzzle.rerank import rerank_wins
from puzzle.run.context import RunContext, on_main
from puzzle.run.rerank import rerank_inputs, short_gkd_rerank
from puzzle.run.scores import score
from puzzle.scores import Scores
from puzzle.search import search, search_k
from puzzle.search.types import Solution
from puzzle.spec import Variant

if TYPE_CHECKING:
    from puzzle.search.budget import DeploymentLimit

# The progress lines of every stage are the run's (`puzzle.run`): users filter on that logger.
_log = logging.getLogger("puzzle.run")


def solution_bytes(payload: dict[str, Any]) -> bytes:
    """A solution's file, solutions/{name}.json: `Solution.to_json` as `puzzle search --json` prints it."""
    return (json.dumps(payload, indent=2) + "\n").encode()


def _search_on_main(problem: RunProblem, options: Any) -> Solution:
    """`search` of `problem` on rank 0 (`on_main`), its Solution on every rank."""
    table, limits, rules = problem.table, problem.problem.limits, problem.problem.rules
    return on_main(lambda: {"solution": search(table, limits, rules, options)})["solution"]


def solutions_inputs(run: RunContext, budgets: dict[str, list[str]]) -> dict[str, Any]:
    """The inputs of a search record under `budgets` ({name: texts}); stores the run's calibration."""
    search_settings = run.config.search
    inputs = {
        "library": run.record("library")["manifest"],
        "scores": run.record("scores")["manifest"],
        "budgets": budgets,
        "search": to_dict(dataclasses.replace(search_settings, budgets=(), sweep=None)),
        "hardware": to_dict(run.config.hardware),
    }
    _rerank_inputs(run, inputs)
    if search_settings.context_rounds:  # scores in context read the held-out tokens and score
        inputs.update(held_out=run.held_out_key(), scoring=to_dict(run.config.scoring))
    else:  # off: the inputs of the runs made before the key existed (the guard acts on rounds only)
        inputs["search"].pop("context_rounds")
        inputs["search"].pop("context_guard")
    if not search_settings.context_changes:  # likewise
        inputs["search"].pop("context_changes")
    run.prepare()  # the calibration is stored in the checked run directory
    if dist.is_main():
        run.cost_model()  # rank 0 measures and stores this machine's calibration once, if absent
    dist.barrier()
    device = run.cost_model().profile
    if not isinstance(device, str):  # this machine's calibration: new figures re-solve
        inputs["calibration"] = profile_to_json(device)
    return inputs


def damage(run: RunContext, outputs: dict[str, Any]) -> str | None:
    """Why a recorded solutions/{name}.json (or the frontier's file) is not the one written (by content
    hash), or None: the check of the solutions and the frontier records."""
    for entry in outputs.values():
        reason = run.ledger.file_damage(run.layout.root / entry["file"], entry["fingerprint"])
        if reason is not None:
            return reason
    return None


def record(run: RunContext) -> dict[str, Any]:
    """The solutions stage's record: solutions/{name}.json of every budget list of the config, from the
    library and scores (and the held-out tokens with re-ranking or rounds in context): {name: its
    record}; then the frontier's record."""
    inputs = solutions_inputs(run, run.budgets())
    outputs = run.stage("solutions", inputs, functools.partial(solve_all, run))
    # The frontier is a record of its own: the solution names stay the solutions stage's only outputs.
    frontier_inputs = {
        **inputs,
        "solutions": {name: entry["fingerprint"] for name, entry in outputs.items()},
    }
    run.stage("frontier", frontier_inputs, lambda: on_main(lambda: _sweep_frontier(run, outputs)))
    return outputs


def _sweep_frontier(run: RunContext, solutions: Mapping[str, Any]) -> dict[str, Any]:
    """The Pareto frontier against the budget keys of the config's solutions -> frontier.json, so that
    the report draws it without solving (`puzzle.problem.frontier_sweep`)."""
    cost_model = run.cost_model()
    problem = run.problem(frontier_budgets(cost_model), cost_model=cost_model)
    saved = {name: run.solution_json(name) for name in solutions}
    payload = frontier_sweep(problem, saved, run.config.search.solver)
    atomic_write_bytes(run.layout.frontier, (json.dumps(payload, indent=2) + "\n").encode())
    path = run.layout.frontier
    return {"frontier": {"file": path.name, "fingerprint": fingerprint_file(path)}}


def solve_all(run: RunContext) -> dict[str, Any]:
    """Every budget list of the config solved and saved: {solution name: its record} (collective)."""
    saved: dict[str, Any] = {}
    for name, limits in run.budget_limits().items():
        saved.update(solve_one(run, name, limits))
    tally = rerank_wins(entry.get("rerank") for entry in saved.values())
    if tally["searches"]:
        wins = ", ".join(f"{kind} {count}" for kind, count in tally["wins"].items())
        _log.info(
            "re-ranking by short GKD: the winner's source over %d searches: %s", tally["searches"], wins
        )
    return saved


def solve_one(run: RunContext, name: str, budgets: Sequence[str | DeploymentLimit]) -> dict[str, Any]:
    """The search under `budgets` (texts or the config's parsed budgets) -> solutions/{name}.json (and
    {name}-2, ... for `search.solutions`). Collective: rank 0 solves and saves; every rank takes part in
    the scoring of `search.context_rounds` (`_in_context`) and in measuring the candidates of
    `search.rerank` (`_rerank`)."""
    settings = run.config.search
    texts = [budget if isinstance(budget, str) else budget.text for budget in budgets]
    problem = run.problem(budgets)

    def first() -> dict[str, Any]:
        for note in problem.notes:
            _log.warning("search %s: %s", name, note)
        limits, rules = problem.problem.limits, problem.problem.rules
        wanted = settings.candidates_wanted()
        return {"found": search_k(problem.table, limits, rules, settings.solver, wanted, settings.min_diff)}

    searched = on_main(first)["found"]
    found, context = _in_context(run, name, budgets, problem, searched)
    reranking = settings.reranking()
    if reranking is not None and reranking.by == "short_gkd":
        payloads, reranked = short_gkd_rerank(run, name, problem, searched, found, context)
    else:
        payloads, reranked = _rerank(run, name, [solution.to_json() for solution in found])
    return on_main(lambda: _save(run, name, texts, payloads, reranked, context))


def _save(
    run: RunContext,
    name: str,
    texts: list[str],
    found: list[dict[str, Any]],
    reranked: dict[str, Any] | None,
    context: dict[str, Any] | None,
) -> dict[str, Any]:
    """The first `search.solutions` of `found` (solution JSONs, best first) written to
    solutions/{name}.json, {name}-2.json, ...: {label: its record}, with the records of the re-ranking
    (`_rerank`) and of the scores in context (`_in_context`: the rounds of the candidate that went
    through them, the first before any re-ranking)."""
    settings = run.config.search
    saved: dict[str, Any] = {}
    for index, payload in enumerate(found[: settings.solutions]):
        label = name if index == 0 else f"{name}-{index + 1}"
        path = run.layout.solution(label)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, solution_bytes(payload))
        saved[label] = {
            "budgets": texts,
            "file": str(path.relative_to(run.layout.root)),
            "fingerprint": fingerprint_file(path),
            "objective": payload["objective"],
        }
        _log.info("search %s: objective %.6g, %s", label, payload["objective"], payload["totals"])
    if reranked is not None:
        saved[name]["rerank"] = reranked
    if context is not None and saved:
        saved[name]["context"] = context
    wanted = settings.candidates_wanted()
    if len(found) < wanted:
        _log.warning(
            "search %s: only %d architectures differ in >= %d blocks", name, len(found), settings.min_diff
        )
    return saved


def _rerank_inputs(run: RunContext, inputs: dict[str, Any]) -> None:
    """The search record's inputs with re-ranking: it reads the held-out tokens too (and with a short GKD
    the training tokens and GKD's settings: `puzzle.run.rerank.rerank_inputs`). Off, the record's inputs are
    those of a run before the option existed (no `rerank` key), so old runs are reused; `rerank: K` and
    `{by: measured, candidates: K}` are one input."""
    inputs["search"].pop("rerank", 0)
    reranking = run.config.search.reranking()
    if reranking is None:
        return
    if reranking.by == "short_gkd":
        inputs["rerank"] = rerank_inputs(run)
        return
    inputs["rerank"] = {
        "k": reranking.candidates,
        "held_out": run.held_out_key(),
        "vocab_chunk": run.config.scoring.vocab_chunk,
    }


def _rerank(
    run: RunContext, name: str, found: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """`found` (solution JSONs, best predicted first) re-ranked by the KL each child measures on the
    held-out tokens (`puzzle.problem.rerank_by_measurement`), one candidate child in memory at a time;
    as it is, and None, with `search.rerank` off. Every rank calls it (the measurement is a collective)."""
    if run.config.search.reranking() is None:
        return found, None

    def measure(payload: dict[str, Any]) -> dict[str, Any]:
        child = run.child_of(payload)
        return measured_kl(child, run.parent(), run.held_out_batches(), run.config.scoring.vocab_chunk)

    return rerank_by_measurement(name, found, measure)


def _in_context(
    run: RunContext,
    name: str,
    budgets: Sequence[str | DeploymentLimit],
    problem: RunProblem,
    found: list[Solution],
) -> tuple[list[Solution], dict[str, Any] | None]:
    """(the solutions, the rounds' record) after `search.context_rounds` rounds of scores in context on
    the best one (`puzzle.context.context_rounds`); (found, None) when off. Collective: every rank
    scores (solutions/context/{name}/round-{r}/), rank 0 solves."""
    settings = run.config.search
    if not settings.context_rounds or not found:
        return found, None
    parent = run.parent(run.config.scoring.shard)
    library = read_library(run.layout.library)

    def score_in_child(number: int, own: list[Variant], wanted: list[Variant], what: str) -> Scores:
        return context_scores(run, name, number, parent, library, own, wanted, what)

    def solve(candidates: RunCandidates, own: list[Variant]) -> Solution:
        round_problem = run.problem(budgets, candidates=candidates)
        if settings.context_changes:
            limit_changes(round_problem, own, settings.context_changes)
        return _search_on_main(round_problem, settings.solver)

    return context_rounds(name, found, problem.candidates, settings, score_in_child, solve)


def context_scores(
    run: RunContext,
    name: str,
    number: int | str,
    parent: HybridLM,
    library: Library,
    own: list[Variant],
    wanted: list[Variant],
    what: str = "round",
) -> Scores:
    """`wanted` scored in the child whose blocks are `own` (assembled from the library; a collective),
    into solutions/context/{name}/{what}-{number}/."""
    choice = {variant.block_index: variant for variant in own}
    child = assemble_child(choice, library, parent, parent_fp=run.parent_fingerprint())
    context_fp = fingerprint_json(
        {"library": run.record("library")["manifest"], "choice": [v.to_dict() for v in own]}
    )
    out = run.layout.solutions / "context" / name / f"{what}-{number}"
    return score(run, parent, library, wanted, out, context=child, context_fp=context_fp)
