"""The scores stage of a run: replace-one-block scores of every usable library variant (scores/), and the
scoring that the search's rounds in context reuse (`score`).

`record(run)` declares the stage's inputs and its work, and records its outputs through the run's ledger
(`RunContext.stage`); `damage(run, outputs)` says how those outputs are checked on disk before they are
reused; `puzzle.run.Run` gives the typed call.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from puzzle import dist, nemotron_h
from puzzle.artifacts import fingerprint_file, fingerprint_json
from puzzle.blocks import build_block
from puzzle.config import to_dict
from puzzle.library import Library, read_library
from puzzle.model import HybridLM
from puzzle.plan import run_memory, scoring_wave_size
from puzzle.run.context import RunContext, manifest_fp
from puzzle.score import score_variants
from puzzle.scores import Scores
from puzzle.settings import ScoreSettings
from puzzle.spec import Variant

# The progress lines of every stage are the run's (`puzzle.run`): users filter on that logger.
_log = logging.getLogger("puzzle.run")


def damage(run: RunContext, outputs: dict[str, Any]) -> str | None:
    """Why the recorded scores/ is not as written (its manifest by content hash, then the files it lists),
    or None."""
    return run.ledger.manifest_damage(run.layout.scores / "scores.manifest.json", outputs["manifest"])


def record(run: RunContext) -> dict[str, Any]:
    """The scores stage's record: scores/ (every usable library variant scored in the parent) from the library
    and the held-out tokens: {"manifest": its fingerprint}."""
    run.check_budgets_up_front()
    upstream = run.record("library")
    inputs = {
        "library": upstream["manifest"],
        "held_out": run.held_out_key(),
        "scoring": to_dict(run.config.scoring),
    }

    def compute() -> dict[str, Any]:
        parent = run.parent(run.config.scoring.shard)
        library = read_library(run.layout.library)
        usable = [v for v, r in library.results.items() if r.status != "failed"]
        score(run, parent, library, usable, run.layout.scores)
        return {"manifest": manifest_fp(run.layout.scores, "scores")}

    return run.stage("scores", inputs, compute)


def _mixer_source(parent: HybridLM, library: Library) -> Callable[[Variant], torch.nn.Module | None]:
    """The scorer's mixers of the library's variants, loaded on demand (None: the parent's own block)."""
    hidden, eps = parent.spec.hidden_size, parent.spec.norm_eps

    def mixer(variant: Variant) -> torch.nn.Module | None:
        result = library.results.get(variant)
        if result is None or result.status == "parent":
            return None
        if result.status == "noop":
            return build_block(variant.spec, hidden).to(dist.device())
        module = library.load_mixer(variant, hidden, eps)
        return module.to(device=dist.device(), dtype=parent.embeddings.weight.dtype)

    return mixer


def score(
    run: RunContext, parent: HybridLM, library: Library, variants: list[Variant], out: Path, **context: Any
) -> Scores:
    """`score_variants` of `variants` into `out` with this run's scoring settings and held-out tokens
    (the scores stage, and each round of scores in context with `context=` the child)."""
    return score_variants(
        parent,
        variants,
        _mixer_source(parent, library),
        run.held_out_batches(),
        out,
        scoring_settings(run, parent, variants),
        data_fingerprint=run.held_out_key(),
        mixer_fingerprints=_mixer_fingerprints(run, library),
        parent_fp=run.parent_fingerprint(),
        **context,
    )


def scoring_settings(run: RunContext, parent: HybridLM, variants: list[Variant]) -> ScoreSettings:
    """The run's scoring settings, `variants_per_wave: auto` resolved from the plan (`puzzle.plan.
    scoring_wave_size`: the most variants whose planned peak per rank fits `run_memory`, the CUDA
    device's or else this machine's share, times hardware.memory_fraction), logged with why."""
    settings = run.config.scoring
    if settings.variants_per_wave != "auto":
        return settings
    by_block: dict[int, list[Variant]] = {}
    for variant in variants:
        by_block.setdefault(variant.block_index, []).append(variant)
    memory, where = run_memory(run.config)  # on the CPU: this machine's, not a GPU profile's
    found = scoring_wave_size(
        run.config,
        parent.spec,
        dist.world_size(),
        memory,
        variants=by_block,
        checkpoint=nemotron_h.read_config(run.config.parent.path),
    )
    size = int(dist.broadcast_object(found.size))  # every rank runs the same waves (collectives)
    _log.info("scores: variants_per_wave auto -> %d: %s of %s", size, found.reason, where)
    return dataclasses.replace(settings, variants_per_wave=size)


def _mixer_fingerprints(run: RunContext, library: Library) -> dict[Variant, str]:
    """Each usable variant's status, file and file hash: read once per library manifest (every round of
    scores in context would otherwise hash every variant file again)."""
    key = manifest_fp(run.layout.library, "library")
    if run.mixer_fps is None or run.mixer_fps[0] != key:

        def file_fp(result: Any) -> str | None:
            return None if result.file is None else fingerprint_file(Path(library.directory) / result.file)

        fingerprints = {
            v: fingerprint_json([r.status, r.file, file_fp(r)])
            for v, r in library.results.items()
            if r.status != "failed"
        }
        run.mixer_fps = (key, fingerprints)
    return run.mixer_fps[1]
