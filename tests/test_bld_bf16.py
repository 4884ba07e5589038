"""BLD of a bf16 parent on the CPU (`bld.dtype: bfloat16`, no autocast there): a MoE block keeps its router in
fp32 whatever its dtype, and the held-out nMSE and the training steps feed every mixer its own compute dtype
(that of most of its parameters), not its first parameter's (the router's)."""

from __future__ import annotations

import math

import torch
from bld_helpers import token_batches, trained_parent
from bld_helpers import variants as every_variant

from puzzle.bld import build_library
from puzzle.prune.importance import collect_importance
from puzzle.settings import BLDSettings


def test_a_bf16_latent_moe_trains_and_is_measured_on_the_cpu(tmp_path):
    parent = trained_parent().to(torch.bfloat16)
    moe = parent.layers[2].mixer
    assert moe.gate.weight.dtype == torch.float32 and moe.fc1_latent_proj.weight.dtype == torch.bfloat16
    variants = {2: every_variant()[2]}
    importance = collect_importance(parent, token_batches(2, seed=200))
    settings = BLDSettings(lr=3e-3, token_budget=4 * 4 * 16, checkpoint_every=0, dtype="bfloat16")
    library = build_library(
        parent,
        variants,
        token_batches(4, seed=300),
        token_batches(1, seed=400),
        importance,
        settings,
        tmp_path,
    )
    assert len(library.results) == 2
    for result in library.results.values():
        assert (
            result.status == "trained"
            and math.isfinite(result.init_nmse)
            and math.isfinite(result.final_nmse)
        )
