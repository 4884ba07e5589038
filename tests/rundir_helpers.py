"""A tiny real run directory (parent.json, a BLD library, its scores) for the `puzzle search RUN_DIR` tests.

The parent is bld_helpers' EVERY_KIND_SPEC model trained a few steps; blocks 0-3 get 2-3 variants each,
trained by `build_library` for a few steps and scored by `score_variants`. With `failures`, one variant
fails in BLD (its initial weights are NaN) and one in scoring (its trained mixer is replaced by NaNs
before scoring), as a diverging or broken variant would.
"""

from __future__ import annotations

from pathlib import Path

import torch
from bld_helpers import SPEC, settings, token_batches, trained_parent

from puzzle.bld import build_library, default_init
from puzzle.blocks import build_block
from puzzle.layout import RunLayout
from puzzle.library import read_library
from puzzle.prune import collect_importance
from puzzle.score import ScoreSettings, score_variants
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, MoESpec, NoOpSpec, Variant

# Block 0 Mamba, 1 attention, 2 MoE, 3 MLP (blocks 4 linear and 5 no-op have no variants).
VARIANT_SPECS = {
    0: [SPEC.blocks[0], MambaSpec(num_heads=2, head_dim=4, state_size=6, n_groups=2, chunk_size=8)],
    1: [AttentionSpec(num_heads=4, num_kv_heads=1, head_dim=4), LinearSpec(), NoOpSpec()],
    2: [MoESpec(num_experts=3, top_k=2, expert_width=4, shared_width=8, latent_size=12), NoOpSpec()],
    3: [MLPSpec(width=6), LinearSpec(), NoOpSpec()],
}
BLD_FAILURE = Variant(3, LinearSpec())  # NaN weights from the start: BLD records it as failed
SCORE_FAILURE = Variant(1, LinearSpec())  # NaN weights when scored: scoring records it as failed


def variants() -> dict[int, list[Variant]]:
    return {block: [Variant(block, spec) for spec in specs] for block, specs in VARIANT_SPECS.items()}


def make_run(root: Path, failures: bool = True, bld_steps: int = 3) -> RunLayout:
    """Build the run in `root` (created); returns its layout."""
    layout = RunLayout(root)
    root.mkdir(parents=True, exist_ok=True)
    layout.write_parent(SPEC)
    parent = trained_parent(steps=8)
    base = default_init(parent, collect_importance(parent, token_batches(2, seed=200)))

    def init(variant: Variant) -> torch.nn.Module:
        mixer = base(variant)
        if failures and variant == BLD_FAILURE:
            for parameter in mixer.parameters():
                parameter.data.fill_(float("nan"))
        return mixer

    build_library(
        parent,
        variants(),
        token_batches(4, seed=300),
        token_batches(1, seed=400),
        None,
        settings(),
        layout.library,
        init=init,
        max_steps=bld_steps,
    )
    library = read_library(layout.library)
    mixers: dict[Variant, torch.nn.Module | None] = {}
    for variant, result in library.results.items():
        if result.status == "failed":
            continue
        if result.status == "parent":
            mixers[variant] = None
        elif result.status == "noop":
            mixers[variant] = build_block(variant.spec, SPEC.hidden_size)
        else:
            mixers[variant] = library.load_mixer(variant, SPEC.hidden_size)
        if failures and variant == SCORE_FAILURE:
            for parameter in mixers[variant].parameters():
                parameter.data.fill_(float("nan"))
    score_variants(
        parent, mixers, mixers, token_batches(2, seed=500), layout.scores, ScoreSettings(vocab_chunk=16)
    )
    return layout
