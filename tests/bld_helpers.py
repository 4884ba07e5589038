"""A tiny trained parent, its importance and a hand-built variant library, shared by the BLD tests and the
resume subprocess (tests/test_bld.py runs this file as a script for the kill-and-resume test)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from nemotron_helpers import EVERY_KIND_SPEC as SPEC

from puzzle.bld import BLDSettings, build_library
from puzzle.model import HybridLM
from puzzle.prune.importance import collect_importance, load_importance, save_importance
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, MoESpec, NoOpSpec, Variant

BATCH, LENGTH = 4, 16


def token_batches(count: int, seed: int) -> list[torch.Tensor]:
    """Sequences with structure a model can learn: each token is a fixed function of the previous two, with noise."""
    generator = torch.Generator().manual_seed(seed)
    vocab = SPEC.vocab_size
    batches = []
    for _ in range(count):
        rows = torch.randint(0, vocab, (BATCH, 2), generator=generator)
        tokens = [rows[:, 0], rows[:, 1]]
        for _ in range(LENGTH - 2):
            nxt = (3 * tokens[-1] + tokens[-2] + 1) % vocab
            noise = torch.rand(BATCH, generator=generator) < 0.1
            nxt = torch.where(noise, torch.randint(0, vocab, (BATCH,), generator=generator), nxt)
            tokens.append(nxt)
        batches.append(torch.stack(tokens, dim=1))
    return batches


def trained_parent(steps: int = 30) -> HybridLM:
    """EVERY_KIND_SPEC trained a few dozen steps on `token_batches`, so its activations are not random."""
    torch.manual_seed(0)
    model = HybridLM(SPEC)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in token_batches(steps, seed=100):
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, SPEC.vocab_size), batch[:, 1:].reshape(-1)
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval().requires_grad_(False)


def variants() -> dict[int, list[Variant]]:
    """A small library over the parent's blocks 0-3: shrunk, linear, no-op and parent-equal variants."""
    blocks = SPEC.blocks
    table = {
        0: [
            MambaSpec(num_heads=2, head_dim=4, state_size=6, n_groups=2, chunk_size=8),
            MambaSpec(num_heads=4, head_dim=2, state_size=6, n_groups=2, chunk_size=8),
            blocks[0],
        ],
        1: [AttentionSpec(num_heads=4, num_kv_heads=1, head_dim=4), LinearSpec(), NoOpSpec()],
        2: [
            MoESpec(num_experts=3, top_k=2, expert_width=4, shared_width=8, latent_size=12),
            MoESpec(num_experts=5, top_k=1, expert_width=(8, 6, 8, 8, 4), shared_width=8, latent_size=12),
        ],
        3: [MLPSpec(width=6), LinearSpec()],
    }
    return {index: [Variant(index, spec) for spec in specs] for index, specs in table.items()}


def settings(**changes) -> BLDSettings:
    base = dict(
        lr=3e-3, warmup_tokens=2 * BATCH * LENGTH, token_budget=12 * BATCH * LENGTH, checkpoint_every=0
    )
    return BLDSettings(**{**base, **changes})


def save_setup(directory: Path) -> None:
    """Write the trained parent's weights and importance for a subprocess."""
    from safetensors.torch import save_file

    parent = trained_parent()
    save_file(parent.state_dict(), str(directory / "parent.safetensors"))
    save_importance(collect_importance(parent, token_batches(4, seed=200)), directory / "importance")


def load_setup(directory: Path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    parent = HybridLM(SPEC)
    parent.load_state_dict(load_file(str(directory / "parent.safetensors")))
    return parent.eval().requires_grad_(False), load_importance(directory / "importance")


def main(directory: Path, output: Path, stall_at: int | None) -> None:
    """Build the library in `output`; with `stall_at`, announce and then sleep at that batch of wave 1 (to be
    killed: wave 0 is then finished and wave 1 has a checkpoint)."""
    parent, importance = load_setup(directory)
    train = token_batches(12, seed=300)
    calls = []

    def stream():
        # Call 1 reads the first batch (fingerprint, plan), call 2 is wave 0, call 3 wave 1.
        calls.append(1)
        for index, batch in enumerate(train):
            if stall_at is not None and len(calls) == 3 and index == stall_at:
                (output.parent / "stalled").write_text("1")
                time.sleep(600)
            yield batch

    build_library(
        parent,
        variants(),
        stream,
        token_batches(2, seed=400),
        importance,
        settings(checkpoint_every=3, memory_limit_bytes=MEMORY_LIMIT),
        output,
        data_fingerprint="train-300",
    )


MEMORY_LIMIT = 150_000  # several waves for `variants()` (see test_wave_plan_respects_the_memory_limit)

if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("PUZZLE_PROGRESS", "0")
    stall = int(sys.argv[3]) if len(sys.argv) > 3 else None
    main(Path(sys.argv[1]), Path(sys.argv[2]), stall)
