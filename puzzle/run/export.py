"""The export stage of a run: each distilled child as a checkpoint with its model card (exports/{name}/);
with `search.engines`, in the export format "engine" for those engines (a child one refuses stops the run).

`record(run)` declares the stage's inputs and its work, and records its outputs through the run's ledger
(`RunContext.stage`); `damage(run, outputs)` says how those outputs are checked on disk before they are
reused; `puzzle.run.Run` gives the typed call.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from puzzle import dist, shard
from puzzle.artifacts import file_digest, fingerprint_json
from puzzle.export import ExportError
from puzzle.export import export as export_checkpoint
from puzzle.gkd import load_distilled
from puzzle.ledger import DONE
from puzzle.model import HybridLM
from puzzle.run.assemble import assembled
from puzzle.run.context import RunContext, on_main

# The progress lines of every stage are the run's (`puzzle.run`): users filter on that logger.
_log = logging.getLogger("puzzle.run")


def export_one(run: RunContext, name: str, source: str, out: Path) -> dict[str, Any]:
    """{name: its export record}: the child built on every rank, sharded as the parent is (assembling from
    a sharded parent is a collective). A sharded child is written by every rank together: the weights
    stream out one tensor at a time, gathered on every rank and written by rank 0
    (`puzzle.nemotron_h.stream`), so no rank holds the whole child; a whole one by rank 0 alone."""
    child = run.child(name)
    if source == "distill":
        child = load_distilled(run.layout.child(name), child)  # into each rank's shards
        child = run.with_kv_cache(child)  # an fp8 cache's scales, of the distilled weights
    if shard.local_numel(child) < sum(p.numel() for p in child.parameters()):  # sharded: a collective
        return {name: _write(run, name, source, child, out)}
    return on_main(lambda: {name: _write(run, name, source, child, out)})  # whole: rank 0 writes


def _card_info(run: RunContext, name: str, source: str) -> dict[str, Any]:
    """What the model card (`puzzle.card`) says of this run's solution `name` exported from its `source` ("assemble" or "distill"):
    budgets, solution file, GKD evaluations when distilled, the run config's fingerprint. Read from the
    manifest only: never runs a stage."""
    info: dict[str, Any] = {
        "solution": name,
        "source": source,
        "solution_file": str(run.layout.solution(name).relative_to(run.layout.root)),
        "config_fingerprint": fingerprint_json(run.config.to_dict()),
        "budgets": None,
        "distill": None,
    }
    for record_name, record in run.manifest()["stages"].items():
        stage = record_name.split("/", 1)[0]
        if record.get("status") not in ("done", "reused") or name not in record.get("outputs", {}):
            continue
        if stage == "solutions":
            info["budgets"] = list(record["outputs"][name].get("budgets", []))
        elif stage == "distill" and source == "distill":
            info["distill"] = dict(record["outputs"][name])
    return info


def _write(run: RunContext, name: str, source: str, child: HybridLM, out: Path) -> dict[str, Any]:
    # A search held to engines (search.engines) exports for them: format "engine" refuses a child any of
    # them could not load (e.g. an fp8 KV cache one of them does not read), so the run stops here loudly
    # rather than hand over a checkpoint the engine it was searched for refuses.
    engines = tuple(run.config.search.engines)
    try:
        written = export_checkpoint(
            child,
            out,
            parent_dir=run.config.parent.path,
            solution=run.solution_json(name),  # as saved: the search's table is not rebuilt to read it
            measured=assembled(run, name)["measured"],
            overwrite=True,
            run_info=_card_info(run, name, source),
            **({"format": "engine", "engines": engines} if engines else {}),
        )
    except ExportError as error:
        if not engines:
            raise
        raise ExportError(f"child {name!r} of a run with search.engines {list(engines)}: {error}") from None
    root = run.layout.root
    entry: dict[str, Any] = {
        "path": str(written.relative_to(root)) if written.is_relative_to(root) else str(written)
    }
    if (
        dist.is_main()
    ):  # rank 0 wrote the files; its record is the one kept (`RunContext.stage` broadcasts it)
        # Each file's digest and stat key, hashed as written: the reuse check is then a stat per file.
        entry["files"] = {
            str(path.relative_to(written)): file_digest(path)
            for path in sorted(written.rglob("*"))
            if path.is_file()
        }
    return entry


def _intact(
    run: RunContext, before: Mapping[str, Any] | None, name: str, made_from: str
) -> dict[str, Any] | None:
    """The finished export record `before`'s entry of child `name` when it was exported from the same
    distilled child (`made_from`: its GKD manifest's fingerprint) and its files are as written: the
    export stage then redoes only the other children's exports (e.g. a damaged one)."""
    if before is None or before.get("status") not in DONE or name not in before.get("outputs", {}):
        return None
    entry = before["outputs"][name]
    if before.get("inputs", {}).get("distill", {}).get(name) != made_from or "files" not in entry:
        return None
    reason = dist.broadcast_object(run.ledger.export_damage(entry) if dist.is_main() else None)
    return entry if reason is None else None


def damage(run: RunContext, outputs: dict[str, Any]) -> str | None:
    """Why a recorded export's checkpoint is not as written (its files against the digests its record
    holds), or None."""
    return next(filter(None, map(run.ledger.export_damage, outputs.values())), None)


def record(run: RunContext) -> dict[str, Any]:
    """The export stage's record: exports/{name}/ of each distilled child: {name: its path and files'
    digests}. An export intact on disk from the same distilled child is kept; only the others are
    written again."""
    upstream = run.record("distill")
    inputs = {"distill": {name: entry["manifest"] for name, entry in upstream.items()}}
    before = dist.broadcast_object(run.manifest()["stages"].get("export"))

    def compute() -> dict[str, Any]:
        outputs: dict[str, Any] = {}
        for name in upstream:  # one child at a time
            kept = _intact(run, before, name, inputs["distill"][name])
            if kept is not None:
                outputs[name] = kept
                continue
            outputs.update(export_one(run, name, "distill", run.layout.export(name)))
        return outputs

    return run.stage("export", inputs, compute)
