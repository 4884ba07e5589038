"""Re-ranking a search's candidates by a short GKD (`search.rerank: {by: short_gkd}`): which children, how
short a GKD, the choice and how often each source of candidates wins.

Users ship the child after GKD, and the child with the least KL before GKD is not always the one GKD
recovers best (docs/RESULTS.md). A short GKD of each candidate ranks them closer to the full GKD's order, so
the search distils every candidate for a fraction of the GKD's tokens and keeps the least KL after it. The
candidates (`candidate_list`) are the MIP's k best, the children of the rounds of scores in context and the
baselines' children at the same budgets (refilled greedy, the best uniform pruning): a search whose
candidates include greedy's child loses to greedy only by the noise of the short GKD's ranking. The
solutions stage runs it (`puzzle.run.rerank`); the benchmark study (benchmarks/ablations.py `gkd_rerank`)
uses the same short settings (`short_gkd_settings`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from puzzle.search.types import Table
from puzzle.settings import GKDSettings

_log = logging.getLogger("puzzle.run")

# The kinds of source a candidate comes from, in the order a record lists them.
SOURCE_KINDS = ("mip", "context", "greedy", "uniform")


def gkd_tokens(settings: GKDSettings, seq_len: int) -> int | None:
    """The tokens a full GKD of `settings` trains on (its token budget, or its steps' tokens where fewer);
    None when neither bounds it (it then runs to the end of finite data)."""
    step = settings.batch_size * seq_len
    bounds = [settings.token_budget, None if settings.steps is None else settings.steps * step]
    known = [bound for bound in bounds if bound is not None]
    return min(known) if known else None


def short_gkd_settings(settings: GKDSettings, tokens: float, seq_len: int) -> GKDSettings:
    """`settings` for a short GKD of `tokens`: a fraction (<= 1) of the full GKD's token budget and steps
    (each bound scaled), or a token count (> 1); at least one optimiser step either way. The other settings
    (learning rate, warm-up, evaluations, checkpoints) stay the full GKD's, except `select_by`: kl, as the
    candidates are ranked by the KL they reach (a task metric would need its scorer, at each evaluation)."""
    step = settings.batch_size * seq_len
    if tokens > 1:
        return dataclasses.replace(settings, token_budget=max(step, int(tokens)), steps=None, select_by="kl")
    changes: dict[str, Any] = {"select_by": "kl"}
    if settings.token_budget is not None:
        changes["token_budget"] = max(step, int(settings.token_budget * tokens))
    if settings.steps is not None:
        changes["steps"] = max(1, int(settings.steps * tokens))
    return dataclasses.replace(settings, **changes)


def source_kind(source: str) -> str:
    """The kind of a candidate's source: `mip-3` -> mip, `round-2` -> context, greedy, uniform."""
    if source.startswith("mip-"):
        return "mip"
    if source.startswith("round-"):
        return "context"
    return source


def architecture_json(table: Table, choices: Sequence[int], objective: float, solver: str) -> dict[str, Any]:
    """A solution's JSON (`puzzle.search.types.Solution.to_json`) of an architecture no MIP solve returned
    (a baseline's, a round's): `choices` a variant index per block of `table`, `objective` its prediction,
    `solver` what chose it (greedy, uniform, context)."""
    names = {
        block: table.variant_names[b][index]
        for b, (block, index) in enumerate(zip(table.block_names, choices))
    }
    return {
        "objective": float(objective),
        "status": "baseline" if solver != "context" else "context",
        "gap": None,
        "solver": solver,
        "seconds": 0.0,
        "choices": names,
        "totals": table.totals(choices),
        "presolve_dropped": 0,
        "free_variables": 0,
    }


def candidate_list(sources: Iterable[tuple[str, dict[str, Any] | None]]) -> list[dict[str, Any]]:
    """The distinct candidates of (source, solution JSON or None) pairs, in their order: [{"sources": the
    sources that proposed the child, "payload": the first one's JSON}]. Identical children (the same
    variant in every block) are one candidate; a source without a child (None) proposes none."""
    out: list[dict[str, Any]] = []
    for source, payload in sources:
        if payload is None:
            continue
        same = next((entry for entry in out if entry["payload"]["choices"] == payload["choices"]), None)
        if same is None:
            out.append({"sources": [source], "payload": payload})
        else:
            same["sources"].append(source)
    return out


def rerank_by_short_gkd(
    name: str,
    candidates: list[dict[str, Any]],
    distil: Callable[[int, dict[str, Any]], Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`candidates` (`candidate_list`) ordered by the KL each one measures after its short GKD
    (`distil(index, solution JSON)` -> {"kl": after it, "kl_before", "tokens", "steps", optionally "seconds"};
    ties keep the candidates' order) as solution JSONs, and the record of the choice: {"by": "short_gkd", "chosen": the
    winner's number (1 = the first candidate), "won_by": the kinds of its sources (`source_kind`),
    "candidates": [{"candidate", "sources", "predicted", "kl_before", "short_gkd_kl", "tokens", "steps",
    "seconds" (None where `distil` gave none), "choices"}, ...] in candidate order}."""
    records = []
    for index, entry in enumerate(candidates):
        payload = entry["payload"]
        measured = distil(index, payload)
        records.append(
            {
                "candidate": index + 1,
                "sources": list(entry["sources"]),
                "predicted": payload["objective"],
                "kl_before": measured["kl_before"],
                "short_gkd_kl": measured["kl"],
                "tokens": measured["tokens"],
                "steps": measured["steps"],
                "seconds": measured.get("seconds"),
                "choices": payload["choices"],
            }
        )
        _log.info(
            "search %s: candidate %d (%s), predicted %.6g, KL %.6g before and %.6g after a short GKD (%d tokens)",
            name,
            index + 1,
            ", ".join(entry["sources"]),
            payload["objective"],
            measured["kl_before"],
            measured["kl"],
            measured["tokens"],
        )
    order = sorted(range(len(records)), key=lambda i: (records[i]["short_gkd_kl"], i))
    won_by = list(dict.fromkeys(source_kind(source) for source in records[order[0]]["sources"]))
    _log.info(
        "search %s: re-ranking by short GKD chose candidate %d of %d (%s)",
        name,
        order[0] + 1,
        len(records),
        ", ".join(records[order[0]]["sources"]),
    )
    record = {"by": "short_gkd", "chosen": order[0] + 1, "won_by": won_by, "candidates": records}
    return [candidates[i]["payload"] for i in order], record


def rerank_wins(records: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """How often each kind of source won over the short-GKD re-rankings `records` (one per search; others
    and None are skipped): {"searches": how many, "wins": {kind: searches whose winner it proposed}}. A
    child several sources proposed counts for each of them."""
    searches, wins = 0, dict.fromkeys(SOURCE_KINDS, 0)
    for record in records:
        if not record or record.get("by") != "short_gkd":
            continue
        searches += 1
        for kind in record.get("won_by", []):
            wins[kind] = wins.get(kind, 0) + 1
    return {"searches": searches, "wins": wins}
