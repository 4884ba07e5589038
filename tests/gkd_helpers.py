"""A tiny trained parent and a child of it with two smaller blocks, token data and GKD settings, shared by the GKD
tests and the resume subprocess (tests/test_gkd.py runs this file as a script for the kill-and-resume test)."""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
import sys
from pathlib import Path

import torch
from bld_helpers import SPEC, token_batches, trained_parent
from safetensors.torch import load_file, save_file

from puzzle.data import TokenSplit
from puzzle.gkd import GKDSettings, distill
from puzzle.model import HybridLM
from puzzle.prune import collect_importance, init_child
from puzzle.spec import MambaSpec, MLPSpec, ModelSpec, MoESpec

# Block 0 (Mamba, 4 heads) and block 2 (MoE, 5 experts) replaced by smaller variants; block 3 (MLP) narrowed.
CHILD_BLOCKS = {
    0: MambaSpec(num_heads=2, head_dim=4, state_size=6, n_groups=2, chunk_size=8),
    2: MoESpec(num_experts=3, top_k=2, expert_width=4, shared_width=8, latent_size=12),
    3: MLPSpec(width=4),
}
KILL_AT = 7  # the resume subprocess dies after this step (its last checkpoint is at step 6)


def make_child(parent: HybridLM) -> HybridLM:
    """The parent with `CHILD_BLOCKS` replaced by `init_child` of its blocks (activation importance)."""
    importance = collect_importance(parent, token_batches(4, seed=200), linear_fit=False)
    mixers = []
    for index, block in enumerate(parent.layers):
        if index in CHILD_BLOCKS:
            mixers.append(init_child(block.mixer, block.spec, CHILD_BLOCKS[index], importance[index]))
        else:
            mixers.append(copy.deepcopy(block.mixer))
    child = HybridLM(child_spec(), mixers=mixers)
    # Everything outside the mixers (embeddings, pre-norms, final norm, lm_head) is the parent's.
    outside = {k: v for k, v in parent.state_dict().items() if ".mixer." not in k}
    missing, unexpected = child.load_state_dict(outside, strict=False)
    assert not unexpected and all(".mixer." in k for k in missing), (missing, unexpected)
    return child.eval()


def near_lossless(parent: HybridLM, noise: float = 3e-3) -> HybridLM:
    """A copy of the parent with its mixer weights nudged by `noise` x N(0, 1): held-out KL ~1e-4, so GKD at a
    learning rate of 1e-2 (`TOO_HIGH_LR`) makes it worse at every evaluation."""
    child = copy.deepcopy(parent).requires_grad_(True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in child.named_parameters():
            if ".mixer." in name:
                p.add_(noise * torch.randn(p.shape, generator=generator))
    return child


TOO_HIGH_LR = 1e-2


def child_spec() -> ModelSpec:
    blocks = tuple(CHILD_BLOCKS.get(i, block) for i, block in enumerate(SPEC.blocks))
    return dataclasses.replace(SPEC, blocks=blocks)


def train_split(count: int = 12) -> TokenSplit:
    """`count` batches of `token_batches` as a TokenSplit (4 sequences of 16 tokens per batch)."""
    sequences = torch.cat(token_batches(count, seed=300)).to(torch.int32)
    return TokenSplit("train", sequences, "gkd-test-train-300", "the GKD test tokens")


def held_out() -> list[torch.Tensor]:
    return token_batches(2, seed=400)


def settings(**changes) -> GKDSettings:
    base = dict(
        lr=2e-3,
        warmup_tokens=2 * 4 * 16,
        steps=24,
        token_budget=None,
        batch_size=4,
        vocab_chunk=16,
        eval_every=8,
        checkpoint_every=3,
        lm_weight=0.0,
    )
    return GKDSettings(**{**base, **changes})


def save_setup(directory: Path) -> None:
    """Write the trained parent's and the child's weights for other processes."""
    parent = trained_parent()
    save_file(parent.state_dict(), str(directory / "parent.safetensors"))
    save_file(make_child(parent).state_dict(), str(directory / "child.safetensors"))


def load_setup(directory: Path) -> tuple[HybridLM, HybridLM]:
    """(parent, child) from `save_setup`'s files."""
    parent, child = HybridLM(SPEC), HybridLM(child_spec())
    parent.load_state_dict(load_file(str(directory / "parent.safetensors")))
    child.load_state_dict(load_file(str(directory / "child.safetensors")))
    return parent.eval().requires_grad_(False), child


def main(setup: Path, output: Path, kill_at: int | None) -> None:
    """Distil the child in `output`; with `kill_at`, SIGKILL this process right after that step."""
    parent, child = load_setup(setup)

    def callback(step: int, record: dict) -> None:
        if kill_at is not None and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    distill(child, parent, train_split(), held_out(), settings(), output, callback=callback)


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("PUZZLE_PROGRESS", "0")
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
