"""The importance stage of a run: the parent's activation importance on calibration tokens (importance/).

`record(run)` declares the stage's inputs and its work, and records its outputs through the run's ledger
(`RunContext.stage`); `damage(run, outputs)` says how those outputs are checked on disk before they are
reused; `puzzle.run.Run` gives the typed call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from puzzle.config import to_dict
from puzzle.prune.importance import importance_for
from puzzle.run.context import RunContext, manifest_fp

# The progress lines of every stage are the run's (`puzzle.run`): users filter on that logger.
_log = logging.getLogger("puzzle.run")


def damage(run: RunContext, outputs: dict[str, Any]) -> str | None:
    """Why the recorded importance/ is not as written (its manifest by content hash, then the files it lists),
    or None."""
    return run.ledger.manifest_damage(run.layout.importance / "importance.manifest.json", outputs["manifest"])


def record(run: RunContext) -> dict[str, Any]:
    """The importance stage's record: importance/ from the parent and the training tokens: {"manifest": its
    fingerprint}."""
    run.check_budgets_up_front()
    settings = run.config.importance
    inputs = {
        "parent": run.parent_fingerprint(),
        "data": run.data.train.fingerprint(),
        "settings": to_dict(settings),
        "seed": run.config.seed,
    }

    def compute() -> dict[str, Any]:
        importance_for(
            run.parent(settings.shard),  # every rank runs its own batches (on its shards under fsdp)
            functools.partial(_calibration, run),
            run.layout.importance,
            linear_fit=settings.linear_fit,
            linear_fit_every=settings.linear_fit_every,
            parent_fp=run.parent_fingerprint(),
        )
        return {"manifest": manifest_fp(run.layout.importance, "importance")}

    return run.stage("importance", inputs, compute)


def _calibration(run: RunContext) -> Iterator[torch.Tensor]:
    # On the model's device: collect_importance runs the batches as given.
    settings = run.config.importance
    return run.calibration_batches(settings.tokens, settings.batch_size)
