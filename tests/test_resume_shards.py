"""A resumed run reads its share of the checkpoint, not all of it: on 2 gloo ranks, GKD and BLD resumed from a
checkpoint read, on each rank, only the rows of the sharded tensors (student or mixer weights, AdamW moments,
the best evaluation's weights) that rank holds (`puzzle.resume.CheckpointTensors`, counted through
`puzzle.nemotron_h.sharded.read_observer`), and the resumed GKD run ends with the weights and history of an
uninterrupted 2-rank run."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from gloo_helpers import gloo_rank, spawn_ranks
from safetensors import safe_open

MAX_SHARE = 0.6  # of the checkpoint's sharded tensors' bytes read by one rank: half, plus uneven shards


class _Crash(Exception):
    pass


def _sharded_sizes(file: Path) -> dict[str, int]:
    """Bytes of each tensor of a checkpoint file whose destination is sharded under FSDP2: every weight and
    AdamW moment (not the step counts, 0-d, nor the RNG state)."""
    sizes = {}
    with safe_open(str(file), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            tensor = handle.get_tensor(key)
            if tensor.ndim > 0 and not key.startswith("rng/"):
                sizes[key] = tensor.numel() * tensor.element_size()
    return sizes


def _resume_counted(checkpoint: Path, record_name: str, resume) -> dict:
    """Run `resume()` counting, per tensor, the bytes this rank reads from the checkpoint `record_name` names
    (which the run deletes when it finishes: its sizes are taken first)."""
    from puzzle.nemotron_h import sharded

    file = checkpoint / json.loads((checkpoint / record_name).read_text())["tensors"]
    sizes = _sharded_sizes(file)
    read: Counter[str] = Counter()

    def observe(source: Path, key: str, tensor: torch.Tensor) -> None:
        if Path(source) == file:
            read[key] += tensor.numel() * tensor.element_size()

    sharded.read_observer = observe
    try:
        result = resume()
    finally:
        sharded.read_observer = None
    return {"sizes": sizes, "read": dict(read), "result": result}


def _gkd_worker(rank: int, world: int, port: int, root: str) -> None:
    from gkd_helpers import held_out, load_setup, settings, train_split

    from puzzle.gkd import CHECKPOINT_DIR, distill

    # Evaluations at steps 0, 2, 4, 6 and checkpoints at 3 and 6: the step-3 checkpoint holds the best
    # (step-2) weights apart, so a resume from it reads the student, both AdamW moments and the best weights.
    run = settings(steps=6, eval_every=2, checkpoint_every=3)

    def crash(step: int, record: dict) -> None:
        if step == 4:
            raise _Crash

    with gloo_rank(rank, world, port):
        parent, child = load_setup(Path(root))
        distill(child, parent, train_split(), held_out(), run, Path(root, "whole"))
        parent, child = load_setup(Path(root))
        with pytest.raises(_Crash):
            distill(child, parent, train_split(), held_out(), run, Path(root, "resumed"), callback=crash)
        parent, child = load_setup(Path(root))
        facts = _resume_counted(
            Path(root, "resumed", CHECKPOINT_DIR),
            "checkpoint.json",
            lambda: distill(child, parent, train_split(), held_out(), run, Path(root, "resumed")),
        )
        facts["result"] = facts["result"].resumed_from
        Path(root, f"gkd-rank{rank}.json").write_text(json.dumps(facts))


def _bld_worker(rank: int, world: int, port: int, setup: str, output: str) -> None:
    from bld_helpers import load_setup, settings, token_batches, variants

    from puzzle.bld import CHECKPOINT_DIR, build_library

    train = token_batches(12, seed=300)
    calls = []

    def crashing():  # call 1 reads the first batch; in call 2 (the wave) both ranks fail at batch 7
        calls.append(1)
        for index, batch in enumerate(train):
            if len(calls) == 2 and index == 7:
                raise _Crash
            yield batch

    def build(stream):
        parent, importance = load_setup(Path(setup))
        return build_library(
            parent,
            variants(),
            stream,
            token_batches(2, seed=400),
            importance,
            settings(checkpoint_every=5),
            Path(output),
            data_fingerprint="train-300",
        )

    with gloo_rank(rank, world, port):
        with pytest.raises(_Crash):  # dies after its step-5 checkpoint of wave 0
            build(crashing)
        facts = _resume_counted(Path(output, CHECKPOINT_DIR), "wave0.json", lambda: build(lambda: train))
        facts["result"] = sorted(r.status for r in facts["result"].results.values())
        Path(f"{output}-rank{rank}.json").write_text(json.dumps(facts))


def _assert_each_rank_reads_its_share(facts: list[dict]) -> None:
    sizes = facts[0]["sizes"]
    total = sum(sizes.values())
    for rank, found in enumerate(facts):
        read = sum(found["read"].get(key, 0) for key in sizes)
        print(f"rank {rank}: read {read} of the checkpoint's {total} bytes of sharded tensors")
        assert 0 < read <= MAX_SHARE * total, (rank, read, total)
    for key, size in sizes.items():  # between them, the ranks read every row (a replicated buffer on each)
        assert sum(found["read"].get(key, 0) for found in facts) >= size, key


@pytest.mark.slow
def test_a_two_rank_gkd_resume_reads_each_ranks_rows_and_ends_as_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    from gkd_helpers import save_setup
    from safetensors.torch import load_file

    from puzzle.gkd import HISTORY_FILE, WEIGHTS_FILE

    save_setup(tmp_path)
    spawn_ranks(_gkd_worker, str(tmp_path))
    facts = [json.loads((tmp_path / f"gkd-rank{rank}.json").read_text()) for rank in range(2)]
    assert [found["result"] for found in facts] == [3, 3]  # resumed from the step-3 checkpoint
    assert {key.split("/")[0] for key in facts[0]["sizes"]} == {"param", "adam", "best"}
    _assert_each_rank_reads_its_share(facts)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert json.loads((resumed / HISTORY_FILE).read_text()) == json.loads((whole / HISTORY_FILE).read_text())
    expected, got = load_file(str(whole / WEIGHTS_FILE)), load_file(str(resumed / WEIGHTS_FILE))
    assert got.keys() == expected.keys()
    for name, value in got.items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.slow
def test_a_two_rank_bld_wave_resume_reads_each_ranks_rows(tmp_path: Path) -> None:
    from bld_helpers import save_setup

    setup = tmp_path / "setup"
    setup.mkdir()
    save_setup(setup)
    output = tmp_path / "library"
    spawn_ranks(_bld_worker, str(setup), str(output))
    facts = [json.loads(Path(f"{output}-rank{rank}.json").read_text()) for rank in range(2)]
    assert facts[0]["result"] == facts[1]["result"] and "trained" in facts[0]["result"]
    assert {key.split("/")[2] for key in facts[0]["sizes"]} == {"param", "adam"}
    _assert_each_rank_reads_its_share(facts)
