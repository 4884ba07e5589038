"""Stages on a parent sharded with FSDP2 over 2 gloo ranks equal one process: importance (each rank runs its
own batches through the sharded units, padded to the same number of forwards), the assembled child (built
sharded, no rank holding it whole) and HSDP (shard inside a node, replicate across nodes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gloo_helpers import gloo_rank, spawn_ranks
from nemotron_helpers import EVERY_KIND_SPEC as SPEC

from puzzle import dist, shard
from puzzle.model import HybridLM
from puzzle.prune.importance import ModelImportance, collect_importance, load_importance, save_importance

# No rank may hold more than this share of a model (half of it, plus the replicated norms).
MAX_SHARE = 0.6
# Uneven: 5 batches over 2 ranks (rank 1 pads one forward); one batch leaves rank 1 only padding.
BATCH_SHAPES = ((2, 12), (3, 8), (1, 20), (2, 16), (1, 9))


def _model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(SPEC).eval().requires_grad_(False)


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, SPEC.vocab_size, shape, generator=generator) for shape in BATCH_SHAPES]


def _assert_same_scores(got: ModelImportance, expected: ModelImportance) -> None:
    assert got.tokens == expected.tokens and got.blocks.keys() == expected.blocks.keys()
    for index, block in expected.blocks.items():
        assert got[index].tokens == block.tokens and got[index].scores.keys() == block.scores.keys()
        for name, value in block.scores.items():  # the same sums, added in another order
            torch.testing.assert_close(got[index][name], value, rtol=1e-5, atol=1e-7, msg=f"{index} {name}")


def _importance_worker(rank: int, world: int, port: int, out: str, mode: str, local_world: int) -> None:
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    with gloo_rank(rank, world, port):
        model = _model()
        total = sum(p.numel() for p in model.parameters())
        shard.shard_parent(model, mode)
        share = shard.local_numel(model) / total
        batches = _batches()
        for name, used in (("all", batches), ("one", batches[:1])):
            result = collect_importance(model, used, parent_fp="parent")
            save_importance(result, Path(out, f"{mode}{local_world}-{name}"))  # collective: rank 0 writes
        Path(out, f"share-{mode}{local_world}-{rank}.json").write_text(json.dumps(share))


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "local_world"), [("fsdp", 2)])
def test_importance_on_a_sharded_parent_equals_one_process(tmp_path, mode, local_world):
    spawn_ranks(_importance_worker, str(tmp_path), mode, local_world)
    model, batches = _model(), _batches()
    for name, used in (("all", batches), ("one", batches[:1])):
        expected = collect_importance(model, used, parent_fp="parent")
        _assert_same_scores(load_importance(tmp_path / f"{mode}{local_world}-{name}"), expected)
    for rank in range(2):
        share = json.loads((tmp_path / f"share-{mode}{local_world}-{rank}.json").read_text())
        print(f"importance {mode} LOCAL_WORLD_SIZE={local_world}: rank {rank} holds {share:.3f} of the parent")
        assert share <= MAX_SHARE, (rank, share)
