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

from puzzle import shard
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


def _check_share(share: float, local_world: int) -> None:
    """Sharded over a node of 2 ranks: at most MAX_SHARE each; nodes of 1 rank (HSDP across 2 "nodes"):
    pure replication, the whole model on each."""
    if local_world == 2:
        assert share <= MAX_SHARE, share
    else:
        assert share == 1.0, share


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
@pytest.mark.parametrize(("mode", "local_world"), [("fsdp", 2), ("hsdp", 1), ("hsdp", 2)])
def test_importance_on_a_sharded_parent_equals_one_process(tmp_path, mode, local_world):
    spawn_ranks(_importance_worker, str(tmp_path), mode, local_world)
    model, batches = _model(), _batches()
    for name, used in (("all", batches), ("one", batches[:1])):
        expected = collect_importance(model, used, parent_fp="parent")
        _assert_same_scores(load_importance(tmp_path / f"{mode}{local_world}-{name}"), expected)
    for rank in range(2):
        share = json.loads((tmp_path / f"share-{mode}{local_world}-{rank}.json").read_text())
        print(
            f"importance {mode} LOCAL_WORLD_SIZE={local_world}: rank {rank} holds {share:.3f} of the parent"
        )
        _check_share(share, local_world)


# ----------------------------------------------------------------------------------------------------------
# The child assembled from a sharded parent is sharded too; the measured KL and GKD take it as it is.


def _child_worker(
    rank: int, world: int, port: int, root: str, chosen: dict, out: str, mode: str, local_world: int
) -> None:
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    from assemble_helpers import held_out
    from gkd_helpers import settings as gkd_settings
    from gkd_helpers import train_split

    import puzzle
    from puzzle.assemble import assemble, measured_kl
    from puzzle.gkd import distill
    from puzzle.library import read_library
    from puzzle.spec import Variant

    with gloo_rank(rank, world, port):
        library = read_library(Path(root, "library"))
        parent = puzzle.load(Path(root, "parent"), shard=mode)
        variants = {int(i): _variant(library, Variant, int(i), name) for i, name in chosen.items()}
        child = assemble(variants, library, parent, check_parent=False)
        total = sum(p.numel() for p in child.parameters())
        share = shard.local_numel(child) / total
        state = {k: shard.full(v) for k, v in child.state_dict().items()}
        kl = measured_kl(child, parent, held_out(), vocab_chunk=16)["kl"]
        result = distill(
            child,
            parent,
            train_split(),
            held_out(),
            gkd_settings(steps=2, eval_every=0, shard=mode),
            Path(out + ".gkd"),
        )
        if rank == 0:
            torch.save({"share": share, "state": state, "kl": kl, "eval": result.first_eval}, Path(out))
        Path(out + f".share{rank}").write_text(json.dumps(share))


def _variant(library, variant_type, index: int, name: str):
    return next(v for v in library.results if v.block_index == index and v.id == name)


@pytest.fixture(scope="module")
def library_setup(tmp_path_factory):
    from assemble_helpers import build_small_library, save_parent
    from bld_helpers import trained_parent, variants

    import puzzle

    root = tmp_path_factory.mktemp("child")
    save_parent(trained_parent(), root / "parent")
    library = build_small_library(puzzle.load(root / "parent"), root / "library")
    table = variants()
    chosen = {0: table[0][0].id, 2: table[2][1].id, 3: table[3][0].id}
    return root, library, chosen


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "local_world"), [("fsdp", 2), ("hsdp", 1)])
def test_the_child_of_a_sharded_parent_is_sharded_and_equals_one_process(
    library_setup, tmp_path, mode, local_world
):
    from assemble_helpers import held_out

    import puzzle
    from puzzle.assemble import assemble, measured_kl

    root, library, chosen = library_setup
    out = str(tmp_path / "rank0.pt")
    spawn_ranks(_child_worker, str(root), chosen, out, mode, local_world)
    got = torch.load(out)
    parent = puzzle.load(root / "parent")
    variants = {i: _variant(library, None, i, name) for i, name in chosen.items()}
    child = assemble(variants, library, parent, check_parent=False)
    want = child.state_dict()
    assert list(got["state"]) == list(want)
    for key, value in want.items():
        assert torch.equal(got["state"][key], value), key
    expected_kl = measured_kl(child, parent, held_out(), vocab_chunk=16)["kl"]
    assert abs(got["kl"] - expected_kl) <= 1e-6 * max(1.0, expected_kl), (got["kl"], expected_kl)
    assert got["eval"]["kl"] == pytest.approx(expected_kl, rel=1e-5, abs=1e-7)
    for rank in range(2):
        share = json.loads(Path(out + f".share{rank}").read_text())
        print(f"child {mode} LOCAL_WORLD_SIZE={local_world}: rank {rank} holds {share:.3f} of its elements")
        _check_share(share, local_world)
