"""Free disk before a stage that writes much: the stage's planned disk (`puzzle plan`'s figure), less what
its folders already hold, against the free space under the run directory."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from puzzle import dist
from puzzle.files import existing_ancestor, tree_bytes
from puzzle.layout import CHILDREN_DIR, EXPORTS_DIR, RunLayout
from puzzle.ledger import RunError

_log = logging.getLogger("puzzle.run")

# Below this a stage's disk is not worth a plan: tiny runs, and the forward-only stages, write little.
MUCH_BYTES = 2**30


def stage_folders(layout: RunLayout, stage: str) -> list[Path]:
    """The folders stage `stage` writes under the run directory (what a resumed stage has already written)."""
    folders = {
        "importance": [layout.importance],
        "library": [layout.library],
        "scores": [layout.scores],
        "solutions": [layout.solutions],
        "distill": [layout.root / CHILDREN_DIR],
        "export": [layout.root / EXPORTS_DIR],
    }
    return folders.get(stage, [])


def disk_shortfall(stage: str, planned: float, written: int, free: int, where: Path) -> str | None:
    """Why stage `stage` cannot start (its `planned` disk less the `written` bytes already there is more than
    `free` at `where`), or None when it fits or writes little (under MUCH_BYTES)."""
    need = planned - written
    if planned < MUCH_BYTES or need <= free:
        return None
    done = f", {written / 2**30:.1f} GiB of it already written" if written else ""
    return (
        f"stage {stage} writes about {planned / 2**30:.1f} GiB{done}, more than the {free / 2**30:.1f} GiB "
        f"free at {where}: free space there, or point run_dir at a larger disk (`puzzle plan` shows each "
        "stage's disk)"
    )


def check_stage_disk(config: Any, layout: RunLayout, stage: str) -> None:
    """RunError before stage `stage` starts when its planned disk does not fit the free space under the run
    directory (`disk_shortfall`). Rank 0 decides, every rank raises the same error (no rank is left waiting
    in a collective). A config the planner cannot plan is logged and not checked: `puzzle run`'s preflight
    has planned it already."""
    from puzzle.plan import plan_config, run_hardware, world_from_env

    reason = None
    if dist.is_main():
        try:
            plan = plan_config(config, world_from_env(), run_hardware(config))
        except (ValueError, OSError) as error:
            _log.warning("stage %s: disk not checked: the plan failed (%s)", stage, error)
            plan = None
        planned = {s.name: s.disk for s in plan.stages} if plan is not None else {}
        if stage in planned and planned[stage] >= MUCH_BYTES:
            written = tree_bytes(*stage_folders(layout, stage))
            where = existing_ancestor(layout.root.absolute())
            reason = disk_shortfall(stage, planned[stage], written, shutil.disk_usage(where).free, where)
    reason = dist.broadcast_object(reason)
    if reason is not None:
        raise RunError(reason)
