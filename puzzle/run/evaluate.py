"""The eval stage of a run: task accuracy (lm-evaluation-harness) of the parent and of each child, assembled
and distilled, on the config's `eval.tasks` (eval/{model}.json).

`evaluated(run, model)` records one model's evaluation as run.json's `eval/{model}` (the ledger's reuse
rule: the same settings, tasks and model reuse it while its file is unchanged); `record(run)` records every
model of the config's solutions, as `puzzle run` does once the children are exported; `damage(run,
outputs)` says how a record's file is checked; `puzzle.run.Run.evaluate` gives the typed call. A model is
"parent", "{solution}.assembled" (the child with the library's weights) or "{solution}.distilled" (the
weights GKD kept). Every rank runs the same evaluation (lm-eval sees one process; a sharded model's
forwards are collectives in step) and gets rank 0's results (`puzzle.eval.evaluate`), rank 0 writes the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from puzzle import dist
from puzzle.artifacts import fingerprint_json
from puzzle.config import to_dict
from puzzle.eval import LOCAL_TASKS, evaluate, summary, task_files
from puzzle.files import atomic_write_bytes
from puzzle.gkd import load_distilled
from puzzle.ledger import RunError
from puzzle.model import HybridLM
from puzzle.run.assemble import assembled
from puzzle.run.context import RunContext
from puzzle.run.distill import distilled

# The progress lines of every stage are the run's (`puzzle.run`): users filter on that logger.
_log = logging.getLogger("puzzle.run")

PARENT = "parent"
# A child's model name is its solution's and which weights: the Run's sources ("assemble", "distill").
WEIGHTS = {"assemble": "assembled", "distill": "distilled"}


def model_name(solution: str | None = None, source: str = "distill") -> str:
    """The eval record's model name: "parent" (no solution), else "{solution}.assembled" / ".distilled"."""
    return PARENT if solution is None else f"{solution}.{WEIGHTS[source]}"


def models(run: RunContext) -> list[str]:
    """The models `puzzle run` evaluates: the parent, then each of the config's solutions assembled and
    distilled."""
    names = [PARENT]
    for solution in run.record("solutions"):
        names += [model_name(solution, "assemble"), model_name(solution, "distill")]
    return names


def _split(model: str) -> tuple[str, str]:
    """(solution, "assembled" or "distilled") of a child's model name."""
    solution, _, weights = model.rpartition(".")
    if not solution or weights not in WEIGHTS.values():
        raise ValueError(f"model {model!r}: expected 'parent', 'NAME.assembled' or 'NAME.distilled'")
    return solution, weights


def _inputs(run: RunContext, model: str) -> dict[str, Any]:
    """What model `model`'s evaluation depends on: the eval settings, the local tasks' files, lm-eval's
    version and the model's weights (the parent's files, the assembled child's record, GKD's manifest)."""
    from importlib.metadata import version

    settings = run.config.eval
    inputs: dict[str, Any] = {
        "eval": to_dict(settings),
        "local_tasks": fingerprint_json(task_files(LOCAL_TASKS)),
        "lm_eval": version("lm-eval"),
        "parent": run.parent_fingerprint(),
    }
    if settings.include_path is not None:
        inputs["include_path"] = fingerprint_json(task_files(settings.include_path))
    if model != PARENT:
        solution, weights = _split(model)
        inputs["solution"] = run.solution_fp(solution)
        inputs["assemble"] = fingerprint_json(assembled(run, solution))
        if weights == "distilled":
            inputs["distill"] = distilled(run, solution)["manifest"]
    return inputs


def _model(run: RunContext, model: str) -> HybridLM:
    """The weights model `model` names: the run's parent, an assembled child or GKD's kept checkpoint."""
    if model == PARENT:
        return run.parent()
    solution, weights = _split(model)
    child = run.child(solution)
    return load_distilled(run.layout.child(solution), child) if weights == "distilled" else child


def _evaluate_one(run: RunContext, model: str) -> dict[str, Any]:
    """lm-eval on model `model`: its results written to eval/{model}.json (rank 0, atomically); the record's
    entry: the file, its fingerprint and the summary rows (task, metric, value, stderr)."""
    from puzzle.data import load_tokenizer

    settings = run.config.eval
    network = _model(run, model)
    results = evaluate(
        network,
        load_tokenizer(run.config.tokenizer_dir),
        list(settings.tasks),
        limit=settings.limit,
        batch_size=settings.batch_size,
        include_path=settings.include_path,
    )
    # lm-eval's dict holds a few objects JSON has no type for (task config callables): their text.
    content = (json.dumps(results, indent=2, default=str) + "\n").encode()
    path = run.layout.evaluation(model)
    if dist.is_main():
        atomic_write_bytes(path, content)
    rows = summary(results)
    for row in rows:
        stderr = "" if row["stderr"] is None else f" +- {row['stderr']:.4f}"
        _log.info("eval %s: %s %s %.4f%s", model, row["task"], row["metric"], row["value"], stderr)
    return {
        "file": str(path.relative_to(run.layout.root)),
        "fingerprint": hashlib.sha256(content).hexdigest(),
        "summary": rows,
    }


def evaluated(run: RunContext, model: str) -> dict[str, Any]:
    """Model `model`'s eval record entry ({"file", "fingerprint", "summary"}), run.json's `eval/{model}`:
    evaluated now unless a finished record of the same inputs has its file unchanged. RunError when the
    config names no task (`eval.tasks`)."""
    if not run.config.eval.tasks:
        raise RunError(
            "the run config's eval.tasks is empty: name the lm-eval tasks to evaluate on "
            "(e.g. eval: {tasks: [puzzle_next_line]})"
        )
    return run.stage(f"eval/{model}", _inputs(run, model), lambda: {model: _evaluate_one(run, model)})[model]


def results(run: RunContext, model: str) -> dict[str, Any]:
    """lm-eval's results dict of model `model` (evaluated first unless recorded), read from its file."""
    entry = evaluated(run, model)
    return json.loads((run.layout.root / entry["file"]).read_text())


def damage(run: RunContext, outputs: dict[str, Any]) -> str | None:
    """Why a recorded evaluation's file (eval/{model}.json) is not the one written, or None."""
    for entry in outputs.values():
        reason = run.ledger.file_damage(run.layout.root / entry["file"], entry["fingerprint"])
        if reason is not None:
            return reason
    return None


def record(run: RunContext) -> dict[str, Any]:
    """Every model of the config's solutions evaluated (`models`): {model: its record entry}; {} when the
    config names no task."""
    if not run.config.eval.tasks:
        return {}
    return {model: evaluated(run, model) for model in models(run)}
