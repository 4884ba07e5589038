"""A small trained parent saved as a checkpoint (with tokenizer and generation files), its BLD library built
in a few steps, and replace-one-block scores: shared by tests/test_assemble.py and tests/test_export.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from bld_helpers import settings, token_batches, variants

import puzzle
from puzzle.bld import build_library
from puzzle.blocks import build_block
from puzzle.library import Library
from puzzle.model import HybridLM
from puzzle.prune.importance import collect_importance
from puzzle.score import Scores, score_variants
from puzzle.search import deployment_problem, search
from puzzle.search.budget import Budget
from puzzle.search.types import Solution
from puzzle.spec import Variant

AUX_FILES = {
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}}}),
    "tokenizer_config.json": json.dumps({"model_max_length": 64}),
    "generation_config.json": json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}),
}


def save_parent(model: HybridLM, directory: Path) -> Path:
    """`model` saved as a checkpoint directory with tokenizer and generation files beside it."""
    model.save_pretrained(directory)
    for name, text in AUX_FILES.items():
        (directory / name).write_text(text)
    return directory


def held_out() -> list[torch.Tensor]:
    return token_batches(3, seed=500)


def build_small_library(
    parent: HybridLM, directory: Path, table: dict[int, list[Variant]] | None = None
) -> Library:
    """BLD for a few steps over `table` (default: bld_helpers.variants()), child init from importance."""
    return build_library(
        parent,
        table or variants(),
        token_batches(4, seed=300),
        token_batches(1, seed=400),
        collect_importance(parent, token_batches(2, seed=200)),
        settings(),
        directory,
        data_fingerprint="train-300",
        max_steps=3,
    )


def library_scores(parent: HybridLM, library: Library, directory: Path) -> Scores:
    """Replace-one-block KL of every library variant (trained ones from their files)."""

    def mixer(variant: Variant):
        status = library.results[variant].status
        if status == "trained":
            return library.load_mixer(variant, parent.spec.hidden_size, parent.spec.norm_eps)
        if status == "noop":
            return build_block(variant.spec, parent.spec.hidden_size)
        return None

    return score_variants(parent, list(library.results), mixer, held_out(), directory)


def solve(parent: HybridLM, library: Library, scores: Scores, params_fraction: float) -> Solution:
    """The MIP's best child under `params <= fraction x parent`: candidates = parent block + library variants."""
    candidates, block_scores = [], []
    for index, block in enumerate(parent.spec.blocks):
        listed = [v for v in library.results if v.block_index == index and v.spec != block]
        candidates.append([block, *(v.spec for v in listed)])
        block_scores.append([0.0, *(scores[v].kl for v in listed)])
    problem = deployment_problem(
        parent.spec, candidates, block_scores, Budget.of(params=puzzle.Relative(params_fraction))
    )
    return search(problem.table, problem.limits, problem.rules)
