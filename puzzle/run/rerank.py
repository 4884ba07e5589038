"""The solutions stage's re-ranking by short GKD (`search.rerank: {by: short_gkd}`): every candidate child
distilled for a fraction of the GKD's tokens, its KL measured on the held-out tokens after it, the least kept.

It runs as the distill stage runs (`puzzle.run.distill`): each candidate's GKD (`puzzle.gkd.distill`) is a
collective over every rank, sharded by `gkd.shard`, in its own directory solutions/rerank/{name}/{key}/ (the
key: the fingerprint of the candidate's choices and of everything its figures depend on). A finished
candidate leaves its figures there (short_gkd.json) and its GKD's history, not its weights (a copy of the
child per candidate would be the stage's largest output), and is not trained again; a killed one resumes
from its last checkpoint (`gkd.checkpoint_every`). So a rerun after kill -9 redoes only the candidate it was
in, from its checkpoint, and chooses as an uninterrupted run does.
`puzzle.rerank` holds what does not need a run: the candidates, the short settings, the choice.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from puzzle import dist
from puzzle.artifacts import fingerprint_json
from puzzle.baselines import Baselines, budget_column
from puzzle.config import to_dict
from puzzle.files import atomic_write_bytes
from puzzle.gkd import WEIGHTS_FILE, distill
from puzzle.problem import RunProblem
from puzzle.rerank import (
    architecture_json,
    candidate_list,
    gkd_tokens,
    rerank_by_short_gkd,
    short_gkd_settings,
)
from puzzle.run.context import RunContext, on_main
from puzzle.search.types import Solution
from puzzle.settings import GKDSettings

# A finished candidate's figures and the key of their inputs, beside its GKD's history (its weights removed).
RECORD_FILE = "short_gkd.json"


def short_settings(run: RunContext) -> GKDSettings:
    """The GKD settings of each candidate's short GKD (`search.rerank.tokens` of the `gkd` section's)."""
    reranking = run.config.search.reranking()
    tokens = reranking.tokens if reranking is not None else 1.0
    return short_gkd_settings(run.config.gkd, tokens, run.config.data.seq_len)


def rerank_inputs(run: RunContext) -> dict[str, Any]:
    """What the short GKDs read beyond the search's inputs: the training tokens, the held-out tokens, the
    short GKD's settings and the world (GKD's sums run in its order)."""
    reranking = run.config.search.reranking()
    return {
        "by": "short_gkd",
        "k": reranking.candidates if reranking is not None else 0,
        "data": run.data.train.fingerprint(),
        "held_out": run.held_out_key(),
        "gkd": to_dict(short_settings(run)),
        "world": dist.world_size(),
    }


def _candidates(
    problem: RunProblem, searched: list[Solution], found: list[Solution], context: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The candidates (`puzzle.rerank.candidate_list`): the MIP's k best (`searched`, before the rounds),
    the rounds' children the guard took (the kept one as `found[0]` holds it), refilled greedy's and the
    best uniform pruning's children at the same budgets."""
    table = problem.table
    pairs: list[tuple[str, dict[str, Any] | None]] = [
        (f"mip-{index + 1}", solution.to_json()) for index, solution in enumerate(searched)
    ]
    if context is not None:
        for number, entry in enumerate(context["rounds"]):
            if number == 0 or "rejected" in entry:  # round 0 is the MIP's best; a refused round is not taken
                continue
            if number == context["kept"] and found:
                payload = found[0].to_json()
            else:
                names = entry["choices"]
                choices = [
                    table.variant_names[b].index(names[block]) for b, block in enumerate(table.block_names)
                ]
                payload = architecture_json(table, choices, entry["predicted"], "context")
            pairs.append((f"round-{number}", payload))
    baselines = Baselines(problem, budget=budget_column(problem))
    for source, arch in (("greedy", baselines.greedy()), ("uniform", baselines.uniform()[0])):
        if arch is None:
            pairs.append((source, None))
            continue
        choices = baselines.choices(arch)
        pairs.append((source, architecture_json(table, choices, baselines.score(choices), source)))
    return candidate_list(pairs)


def _finished(directory: Path, key: str) -> dict[str, Any] | None:
    """The figures of a candidate's finished short GKD in `directory` (its RECORD_FILE, of inputs `key`), or
    None when there is none of those inputs (never run, killed before the end, or other inputs)."""
    try:
        record = json.loads((directory / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    figures = {name: record[name] for name in ("kl", "kl_before", "tokens", "steps")}
    return {**figures, "seconds": record.get("seconds")}  # None: a record written before it was timed


def short_gkd_rerank(
    run: RunContext,
    name: str,
    problem: RunProblem,
    searched: list[Solution],
    found: list[Solution],
    context: dict[str, Any] | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The candidates of search `name` ordered by their KL after a short GKD (solution JSONs, the least
    first) and the record of the choice (`puzzle.rerank.rerank_by_short_gkd`, with the tokens of each
    short GKD). Collective: rank 0 lists the candidates, every rank distils each one."""
    candidates = on_main(lambda: {"list": _candidates(problem, searched, found, context)})["list"]
    settings = short_settings(run)
    # What each candidate's figures depend on besides its choices (its child is assembled from these).
    inputs = {
        "library": run.record("library")["manifest"],
        "scores": run.record("scores")["manifest"],
        "parent": run.parent_fingerprint(),
        **rerank_inputs(run),
    }

    def distil(index: int, payload: dict[str, Any]) -> dict[str, Any]:
        key = fingerprint_json({**inputs, "choices": payload["choices"]})
        directory = run.layout.solutions / "rerank" / name / key[:12]
        done = on_main(lambda: {"record": _finished(directory, key)})["record"]
        if done is not None:
            return done
        started = time.perf_counter()
        teacher = run.parent(settings.shard)  # first: the child is then sharded as the teacher is
        result = distill(
            run.child_of(payload),
            teacher,
            run.data.train,
            run.held_out_batches(),
            settings,
            directory,
            teacher_fp=run.parent_fingerprint(),
        )
        if result.resumed_from is not None:
            run.resumed.setdefault("solutions", []).append(
                f"{name} candidate {index + 1} from step {result.resumed_from}"
            )
        measured = {
            "kl": result.kept_eval["kl"],
            "kl_before": result.first_eval["kl"],
            "tokens": result.tokens,
            "steps": result.steps,
            # Its cost beside a full GKD's (the choice's record keeps it, a rerun reads it back).
            "seconds": time.perf_counter() - started,
        }
        if dist.is_main():
            # The figures are all the choice needs: the weights go (a candidate's copy of the child each),
            # the record stays, so a rerun neither trains nor assembles a finished candidate again.
            atomic_write_bytes(
                directory / RECORD_FILE, (json.dumps({"key": key, **measured}) + "\n").encode()
            )
            (directory / WEIGHTS_FILE).unlink(missing_ok=True)
        dist.barrier()
        return measured

    ordered, record = rerank_by_short_gkd(name, candidates, distil)
    return ordered, {**record, "tokens": gkd_tokens(settings, run.config.data.seq_len)}
