"""puzzle.dist at world size 1 and on 2 CPU processes (gloo): sharding, collectives, distributed importance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gloo_helpers import gloo_rank, spawn_ranks
from nemotron_helpers import EVERY_KIND_SPEC as SPEC

from puzzle import artifacts as artifacts_module
from puzzle import dist
from puzzle.artifacts import fingerprint_tensors
from puzzle.model import HybridLM
from puzzle.prune.importance import (
    MANIFEST_FILE,
    SCORES_FILE,
    ModelImportance,
    collect_importance,
    importance_for,
    load_importance,
    parent_fingerprint,
    save_importance,
)

# Uneven shapes: rank 0 gets batches 0, 2, 4 (the longest sequence, 20), rank 1 gets 1 and 3.
BATCH_SHAPES = ((2, 12), (3, 8), (1, 20), (2, 16), (1, 9))


def _model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(SPEC).eval()


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, SPEC.vocab_size, shape, generator=generator) for shape in BATCH_SHAPES]


def _assert_same_scores(got: ModelImportance, expected: ModelImportance, exact: bool = False) -> None:
    assert got.tokens == expected.tokens and got.parent == expected.parent
    assert got.blocks.keys() == expected.blocks.keys()
    for index, block in expected.blocks.items():
        assert got[index].tokens == block.tokens and got[index].scores.keys() == block.scores.keys()
        for name, value in block.scores.items():
            if exact:
                assert torch.equal(got[index][name], value), (index, name)
            else:  # the same sums, added in another order
                torch.testing.assert_close(
                    got[index][name], value, rtol=1e-5, atol=1e-7, msg=f"{index} {name}"
                )


# ----------------------------------------------------------------------------------------------------------
# World size 1: no process group, every helper is the identity or a no-op.


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("length", [0, 1, 4, 11])
def test_shard_covers_every_item_exactly_once(world, length):
    shares = [list(dist.shard(range(length), rank, world)) for rank in range(world)]
    assert sorted(item for share in shares for item in share) == list(range(length))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1  # balanced whatever the length
    assert all(share == list(range(rank, length, world)) for rank, share in enumerate(shares))  # round-robin
    # A stream without a length gives the same shares.
    assert [list(dist.shard(iter(range(length)), rank, world)) for rank in range(world)] == shares


def test_shard_world_one_is_the_identity_and_bad_ranks_are_errors():
    items = ["a", "b", "c"]
    assert list(dist.shard(items)) == items  # no process group: rank 0 of 1
    assert list(dist.shard(enumerate(items))) == list(enumerate(items))
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match=f"rank={rank}, world={world}"):
            dist.shard(items, rank, world)


def test_world_size_one_helpers_are_identities(tmp_path, monkeypatch):
    assert not dist.is_initialized()
    assert (dist.rank(), dist.world_size(), dist.is_main()) == (0, 1, True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dist.init_from_env() is False
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert dist.init_from_env() is False and not dist.is_initialized()
    sums = {"b": torch.tensor([1.0 + 1e-12], dtype=torch.float64), "a": torch.arange(3)}
    before = {key: value.clone() for key, value in sums.items()}
    dist.all_reduce_sum_(sums)
    dist.all_reduce_sum_(list(sums.values()))
    assert all(torch.equal(sums[key], before[key]) for key in sums)
    assert dist.broadcast_object({"x": 1}) == {"x": 1} and dist.all_gather_object(7) == [7]
    dist.barrier()
    ran = []
    with dist.main_process_first():
        ran.append(dist.rank())
    assert ran == [0]


def test_world_size_one_importance_for_writes_and_reuses(tmp_path):
    model, batches = _model(), _batches()
    measured, reused = importance_for(model, batches, tmp_path)
    assert not reused and sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST_FILE, SCORES_FILE]
    _assert_same_scores(load_importance(tmp_path), measured, exact=True)
    _assert_same_scores(measured, collect_importance(model, batches), exact=True)
    again, reused = importance_for(model, lambda: [], tmp_path, calibration=fingerprint_tensors(batches))
    assert reused and again.tokens == sum(b.numel() for b in batches)


# ----------------------------------------------------------------------------------------------------------
# Two ranks on gloo, launched the way torchrun launches them (environment variables).


def _check_collectives(rank: int, directory: Path) -> None:
    assert (dist.rank(), dist.world_size(), dist.is_main()) == (rank, 2, rank == 0)
    assert list(dist.shard(range(5))) == [[0, 2, 4], [1, 3]][rank]
    # fp64 sums stay fp64 (1e-12 would vanish in fp32), ints stay ints, keys pair up whatever their order.
    sums = {"x": torch.full((2, 3), 1.0 + 1e-12, dtype=torch.float64), "n": torch.arange(3) * (rank + 1)}
    if rank == 1:
        sums = dict(reversed(sums.items()))
    strided = torch.ones(4, 4, dtype=torch.float64)[:, ::2] * (rank + 1)
    columns = strided.t()  # not contiguous: reduced through a copy, written back in place
    dist.all_reduce_sum_(sums)
    dist.all_reduce_sum_([columns])
    assert sums["x"].dtype == torch.float64 and torch.equal(
        sums["x"], torch.full((2, 3), 2.0 + 2e-12, dtype=torch.float64)
    )
    assert sums["n"].dtype == torch.int64 and torch.equal(sums["n"], torch.arange(3) * 3)
    assert torch.equal(strided, torch.full((4, 2), 3.0, dtype=torch.float64))
    assert dist.broadcast_object({"from": rank}) == {"from": 0}
    assert dist.all_gather_object(rank * 10) == [0, 10]
    marker = directory / "marker"
    with dist.main_process_first():
        if dist.is_main():
            marker.write_text("rank 0 was here")
        else:
            assert marker.read_text() == "rank 0 was here"


def _run_importance(rank: int, directory: Path) -> None:
    model, batches = _model(), _batches()
    write = artifacts_module.atomic_write

    def logged_write(path: Path, writer):
        with open(directory / "writes.log", "a") as log:
            log.write(f"{rank} {Path(path).name}\n")
        return write(path, writer)

    artifacts_module.atomic_write = logged_write  # a spy: the real writer still runs
    try:
        measured, reused = importance_for(model, batches, directory / "run")
        assert not reused

        def no_data():
            raise AssertionError("reused scores must not read calibration data")

        calibration = fingerprint_tensors(batches)
        _, reused = importance_for(model, no_data, directory / "run", calibration=calibration)
        assert reused
    finally:
        artifacts_module.atomic_write = write
    # One batch for two ranks: rank 1 has no work and no sums, and still ends with the global scores.
    one_batch = collect_importance(model, batches[:1])
    # Every rank's result, written by rank 0 (saving is collective): pickled in memory, so bit-exact.
    for name, result in (("returned", measured), ("one_batch", one_batch)):
        for other_rank, other in enumerate(dist.all_gather_object(result)):
            save_importance(other, directory / f"{name}{other_rank}")


def _worker(rank: int, world: int, port: int, directory: str) -> None:
    with gloo_rank(rank, world, port):
        assert torch.distributed.get_backend() == "gloo"
        _check_collectives(rank, Path(directory))
        _run_importance(rank, Path(directory))


@pytest.mark.slow
def test_two_gloo_ranks_give_the_single_process_importance(tmp_path):
    spawn_ranks(_worker, str(tmp_path))
    model, batches = _model(), _batches()
    expected = collect_importance(model, batches)  # one process, every batch
    assert expected.tokens == sum(b.numel() for b in batches)

    # Written once, by rank 0, the manifest last; reused on the 2nd call.
    assert (tmp_path / "writes.log").read_text() == f"0 {SCORES_FILE}\n0 {MANIFEST_FILE}\n"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [MANIFEST_FILE, SCORES_FILE]
    shared = load_importance(tmp_path / "run")
    assert shared.parent == parent_fingerprint(model)
    _assert_same_scores(shared, expected)
    # Rank 1 loaded what rank 0 wrote: both ranks hold bit-identical scores.
    _assert_same_scores(load_importance(tmp_path / "returned0"), shared, exact=True)
    _assert_same_scores(load_importance(tmp_path / "returned1"), shared, exact=True)

    one_batch = collect_importance(model, batches[:1])
    for rank in (0, 1):
        _assert_same_scores(load_importance(tmp_path / f"one_batch{rank}"), one_batch)
