"""The distill stage of a run: GKD of each assembled child against the parent (children/{name}/).

`record(run)` declares the stage's inputs and its work, and records its outputs through the run's ledger
(`RunContext.stage`); `damage(run, outputs)` says how those outputs are checked on disk before they are
reused; `puzzle.run.Run` gives the typed call.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from puzzle import dist
from puzzle.artifacts import fingerprint_json
from puzzle.config import to_dict
from puzzle.gkd import Selector
from puzzle.gkd import distill as distill_child
from puzzle.run.assemble import assembled
from puzzle.run.context import RunContext, manifest_fp

# The progress lines of every stage are the run's (`puzzle.run`): users filter on that logger.
_log = logging.getLogger("puzzle.run")


def distilled(run: RunContext, name: str) -> dict[str, Any]:
    """Solution `name`'s distill record (GKD's steps, evaluations and manifest fingerprint): the stage's own
    when `name` is one of the config's solutions, else a record distill/{name} of its own."""

    def inputs() -> dict[str, Any]:
        return {
            "assemble": fingerprint_json({name: assembled(run, name)}),
            "solutions": {name: run.solution_fp(name)},
            **_inputs(run),
        }

    return run.per_solution("distill", name, inputs, lambda: _distill_one(run, name))


def _inputs(run: RunContext) -> dict[str, Any]:
    inputs = {
        "data": run.data.train.fingerprint(),
        "held_out": run.held_out_key(),
        "gkd": to_dict(run.config.gkd),
        "world": dist.world_size(),
    }
    if run.config.gkd.select_task is not None:  # the kept checkpoint depends on how the task is scored
        inputs["select"] = _selector_fingerprint(run)
    return inputs


def _selector_fingerprint(run: RunContext) -> str:
    """What a task metric's score depends on beyond the weights: the eval settings, lm-eval's version and
    the task files (ours and include_path's)."""
    from importlib.metadata import version

    from puzzle.eval import LOCAL_TASKS, task_files

    settings = run.config.eval
    return fingerprint_json(
        {
            "select_by": run.config.gkd.select_by,
            "eval": to_dict(settings),
            "lm_eval": version("lm-eval"),
            "local_tasks": task_files(LOCAL_TASKS),
            "include_path": None if settings.include_path is None else task_files(settings.include_path),
        }
    )


def selector(run: RunContext) -> Selector | None:
    """GKD's Selector for the config's `gkd.select_by` (None for kl): lm-eval's TASK/METRIC of the student,
    on the eval section's limit, batch size and include_path, the task index built once."""
    selected = run.config.gkd.select_task
    if selected is None:
        return None
    from puzzle.data import load_tokenizer
    from puzzle.eval import evaluate, metric_value, task_manager

    task, metric = selected
    settings = run.config.eval
    tokenizer = load_tokenizer(run.config.tokenizer_dir)
    manager = task_manager(settings.include_path)

    def score(student: Any) -> tuple[float, bool]:
        results = evaluate(
            student,
            tokenizer,
            [task],
            limit=settings.limit,
            batch_size=settings.batch_size,
            include_path=settings.include_path,
            manager=manager,
        )
        return metric_value(results, task, metric)

    return Selector(run.config.gkd.select_by, score, _selector_fingerprint(run))


def _distill_one(run: RunContext, name: str) -> dict[str, Any]:
    teacher = run.parent(run.config.gkd.shard)  # first: the child is then sharded as the teacher is
    result = distill_child(
        run.child(name),
        teacher,
        run.data.train,
        run.held_out_batches(),
        run.config.gkd,
        run.layout.child(name),
        teacher_fp=run.parent_fingerprint(),
        selector=selector(run),
    )
    if result.resumed_from is not None:
        run.resumed.setdefault("distill", []).append(f"{name} from step {result.resumed_from}")
    _log.info(
        "distill %s: KL %.6g -> %.6g (kept step %d of %d)",
        name,
        result.first_eval.get("kl", math.nan),
        result.kept_eval.get("kl", math.nan),
        result.kept_step,
        result.steps,
    )
    return {
        "steps": result.steps,
        "tokens": result.tokens,
        "first_eval": result.first_eval,
        "last_eval": result.last_eval,
        "kept_step": result.kept_step,  # the weights distilled: the best held-out KL's step
        "kept_eval": result.kept_eval,
        "manifest": manifest_fp(run.layout.child(name), "gkd"),
    }


def damage(run: RunContext, outputs: dict[str, Any]) -> str | None:
    """Why a recorded distilled child (children/{name}/, its GKD manifest and the files it lists) is not as
    written, or None."""
    for name, entry in outputs.items():
        reason = run.ledger.manifest_damage(run.layout.child(name) / "gkd.manifest.json", entry["manifest"])
        if reason is not None:
            return reason
    return None


def record(run: RunContext) -> dict[str, Any]:
    """The distill stage's record: children/{name}/ (GKD of each assembled child) from the children and the
    training tokens: {name: its steps, evaluations and manifest fingerprint}."""
    upstream = run.record("assemble")
    inputs = {
        "assemble": fingerprint_json(upstream),
        "solutions": {n: e["fingerprint"] for n, e in run.record("solutions").items()},
        **_inputs(run),
    }
    return run.stage("distill", inputs, lambda: {name: _distill_one(run, name) for name in upstream})
