"""The library stage of a run: BLD of every variant of the search space (library/), resumable by wave.

`record(run)` declares the stage's inputs and its work, and records its outputs through the run's ledger
(`RunContext.stage`); `damage(run, outputs)` says how those outputs are checked on disk before they are
reused; `puzzle.run.Run` gives the typed call.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from puzzle import dist
from puzzle.artifacts import DamagedOutputError, fingerprint_json
from puzzle.bld import build_library
from puzzle.config import to_dict
from puzzle.ledger import RunError
from puzzle.library import Library
from puzzle.model import HybridLM
from puzzle.plan import run_memory
from puzzle.prune.importance import load_importance
from puzzle.run.context import RunContext, manifest_fp
from puzzle.spec import Variant

# The progress lines of every stage are the run's (`puzzle.run`): users filter on that logger.
_log = logging.getLogger("puzzle.run")


def damage(run: RunContext, outputs: dict[str, Any]) -> str | None:
    """Why the recorded library/ is not as written (its manifest by content hash, then the files it lists),
    or None."""
    return run.ledger.manifest_damage(run.layout.library / "library.manifest.json", outputs["manifest"])


def record(run: RunContext) -> dict[str, Any]:
    """The library stage's record: library/ (BLD of the space's variants) from the importance, the training
    and held-out tokens: {"manifest": its fingerprint}. The budgets are checked against the space
    first."""
    run.check_budgets_up_front()
    upstream = run.record("importance")
    inputs = {
        "parent": run.parent_fingerprint(),
        "importance": upstream["manifest"],
        "space": to_dict(run.config.search_space()),
        "data": run.data.train.fingerprint(),
        "held_out": run.held_out_key(),
        "batch_size": run.config.data.batch_size,
        "bld": run.config.bld.library_dict(),  # the waves change nothing in the library
        "seed": run.config.seed,
        "world": dist.world_size(),
    }

    def compute() -> dict[str, Any]:
        parent = run.parent(run.config.bld.shard)
        split, batch = run.data.train, run.config.data.batch_size
        with _repair_command(run, run.layout.library):
            library = _build(run, parent, split, batch)
        run.resumed["library"] = [
            f"wave {number + 1} from step {step}" for number, step in library.resumed.items()
        ]
        return {"manifest": manifest_fp(run.layout.library, "library")}

    return run.stage("library", inputs, compute)


def _variants(run: RunContext, parent: HybridLM) -> dict[int, list[Variant]]:
    return run.config.search_space().all_variants(parent.spec, load_importance(run.layout.importance))


def _build(run: RunContext, parent: HybridLM, split: Any, batch: int) -> Library:
    return build_library(
        parent,
        _variants(run, parent),
        lambda: split.batches(batch, run.config.seed, rank=0, world=1),
        run.held_out_batches(),
        load_importance(run.layout.importance),
        run.config.bld,
        run.layout.library,
        data_fingerprint=fingerprint_json([split.fingerprint(), batch, run.config.seed]),
        parent_fp=run.parent_fingerprint(),
        memory_bytes=library_memory(run),
    )


def library_memory(run: RunContext) -> float:
    """The usable memory per rank that BLD's `variants_per_wave: auto` sizes its waves against, as `puzzle plan`
    does: hardware.memory_fraction of the CUDA device's memory, or on the CPU of this machine's share
    (`puzzle.plan.run_memory`); the same on every rank (rank 0's), since every rank trains the same waves."""
    memory, _ = run_memory(run.config)
    return float(dist.broadcast_object(memory * run.config.hardware.memory_fraction))


@contextlib.contextmanager
def _repair_command(run: RunContext, folder: Path) -> Iterator[None]:
    """A damaged output that its stage cannot redo in part (`DamagedOutputError`) as a RunError (`puzzle
    run` exits 2) of one line: the file, and the command that redoes the stage (its folder removed,
    the run resumed from this run's saved config)."""
    try:
        yield
    except DamagedOutputError as error:
        root = run.layout.root.parent if run.round_number > 1 else run.layout.root
        config = root / run.layout.config.name
        raise RunError(f"{error}; to redo it: rm -r {folder} && puzzle run {config}") from None
