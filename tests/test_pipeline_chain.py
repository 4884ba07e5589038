"""Issue 12's chain on a small trained parent: search solution -> assemble -> GKD (the held-out KL to the
parent goes down) -> export -> reload through `puzzle.load` and through transformers' `trust_remote_code`,
both giving the distilled child's logits."""

from __future__ import annotations

import torch
from assemble_helpers import build_small_library, held_out, library_scores, save_parent, solve
from bld_helpers import token_batches, trained_parent
from transformers import AutoModelForCausalLM

import puzzle
from puzzle.assemble import assemble, measured_kl
from puzzle.data import TokenSplit
from puzzle.export import export
from puzzle.gkd import GKDSettings, distill


def test_assembled_child_is_distilled_exported_and_reloads_both_ways(tmp_path, hf_modules_cache):
    parent_dir = save_parent(trained_parent(), tmp_path / "parent")
    parent = puzzle.load(parent_dir).eval().requires_grad_(False)
    library = build_small_library(parent, tmp_path / "library")
    scores = library_scores(parent, library, tmp_path / "scores")
    solution = solve(parent, library, scores, params_fraction=0.7)
    child = assemble(solution, library, parent, scores=scores)
    before = measured_kl(child, parent, held_out())
    assert before["kl"] > 0

    train = TokenSplit(
        "train", torch.cat(token_batches(12, seed=300)).to(torch.int32), "chain-300", "test tokens"
    )
    settings = GKDSettings(
        lr=2e-3,
        warmup_tokens=128,
        steps=30,
        token_budget=None,
        batch_size=4,
        vocab_chunk=16,
        eval_every=0,
        checkpoint_every=0,
    )
    result = distill(child, parent, train, held_out(), settings, tmp_path / "gkd")
    child.eval()
    after = measured_kl(child, parent, held_out())
    assert after["kl"] < 0.9 * before["kl"], (before, after)
    assert result.steps == 30

    out = export(child, tmp_path / "export", parent_dir=parent_dir, solution=solution, measured=after)
    ids = held_out()[0]
    with torch.no_grad():
        expected = child(ids).logits
        reloaded = puzzle.load(out)(ids).logits
        remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()(ids).logits
    assert torch.equal(reloaded, expected)
    assert torch.allclose(remote, expected, atol=1e-5, rtol=0)
