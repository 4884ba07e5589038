"""The assemble stage of a run: each solution's child built from the library, its KL to the parent measured.

`record(run)` declares the stage's inputs and its work, and records its outputs through the run's ledger
(`RunContext.stage`); `damage(run, outputs)` says how those outputs are checked on disk before they are
reused; `puzzle.run.Run` gives the typed call.
"""

from __future__ import annotations

import logging
from typing import Any

from puzzle.artifacts import fingerprint_json
from puzzle.assemble import measured_kl
from puzzle.config import to_dict
from puzzle.run.context import RunContext

# The progress lines of every stage are the run's (`puzzle.run`): users filter on that logger.
_log = logging.getLogger("puzzle.run")


def assembled(run: RunContext, name: str) -> dict[str, Any]:
    """Solution `name`'s assemble record ({"measured": its KL to the parent, "spec"}): the stage's own when
    `name` is one of the config's solutions, else a record assemble/{name} of its own."""

    def inputs() -> dict[str, Any]:
        return {"solution": run.solution_fp(name), **_inputs(run)}

    return run.per_solution("assemble", name, inputs, lambda: _measure(run, name))


def _inputs(run: RunContext) -> dict[str, Any]:
    inputs = {
        "library": run.record("library")["manifest"],
        "held_out": run.held_out_key(),
        "vocab_chunk": run.config.scoring.vocab_chunk,
    }
    if (
        run.config.kv_cache.dtype != "bf16"
    ):  # the children measured with a quantized cache (bf16 runs keep their keys)
        inputs["kv_cache"] = to_dict(run.config.kv_cache)
    return inputs


def _measure(run: RunContext, name: str) -> dict[str, Any]:
    child = run.child(name)
    parent = run.parent()
    measured = measured_kl(child, parent, run.held_out_batches(), run.config.scoring.vocab_chunk)
    _log.info("assemble %s: measured KL %.6g, predicted %s", name, measured["kl"], measured["predicted_kl"])
    return {"measured": measured, "spec": fingerprint_json(child.spec.to_dict())}


def damage(run: RunContext, outputs: dict[str, Any]) -> str | None:
    """None: the assemble record holds figures only (each child's measured KL and spec fingerprint), no
    files; the children are assembled again from the solutions whenever a later stage needs them."""
    return None


def record(run: RunContext) -> dict[str, Any]:
    """The assemble stage's record: each solution's child assembled and its KL to the parent measured: {name:
    {"measured", "spec"}}."""
    upstream = run.record("solutions")
    inputs = {"solutions": {name: entry["fingerprint"] for name, entry in upstream.items()}}
    inputs.update(_inputs(run))

    return run.stage("assemble", inputs, lambda: {name: _measure(run, name) for name in upstream})
