"""GKD on 2 gloo ranks holds its share of the student, not the whole of it (issue 22 section 5):
`keep_best`'s host copy keeps this rank's shards only, the output file is written one tensor at a time, and
`load_distilled` into a sharded model reads only the rows each rank holds, and the units GKD re-shards are
freed (FSDP units are cyclic garbage: `puzzle.shard.free_dropped_units`)."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from gloo_helpers import gloo_rank, spawn_ranks

MAX_SHARE = 0.6  # of the student's elements (or the file's bytes) on one rank: half, plus replicated norms


def _worker(rank: int, world: int, port: int, root: str) -> None:
    from gkd_helpers import child_spec, held_out, load_setup, settings, train_split

    from puzzle import gkd, shard
    from puzzle.model import HybridLM
    from puzzle.nemotron_h import sharded, stream

    with gloo_rank(rank, world, port):
        teacher, student = load_setup(Path(root))
        total = sum(p.numel() for p in student.parameters())
        shard.shard_parent(student, "fsdp")  # as the run assembles it from a sharded parent
        old_units = [weakref.ref(b.mixer) for b in student.layers if shard.has_params(b.mixer)]
        old_units.append(weakref.ref(student.embeddings))
        gc.disable()  # what GKD frees itself, not the cycle collector's own schedule
        kept, held, read = [], [], []
        snapshot = gkd._snapshot  # the real one, counted
        gkd._snapshot = lambda model: _counted(snapshot(model), kept)
        stream.held_observer = held.append
        try:
            result = gkd.distill(
                student,
                teacher,
                train_split(),
                held_out(),
                settings(steps=2, eval_every=1, shard="fsdp"),
                Path(root, "gkd"),
            )
        finally:
            gkd._snapshot, stream.held_observer = snapshot, None
            gc.enable()
        alive = sum(ref() is not None for ref in old_units)  # the units GKD re-sharded, dropped
        model = HybridLM(child_spec())
        shard.shard_parent(model, "fsdp")
        sharded.read_observer = lambda file, key, tensor: read.append(tensor.numel() * tensor.element_size())
        try:
            gkd.load_distilled(Path(root, "gkd"), model)
        finally:
            sharded.read_observer = None
        state = {k: shard.full(v) for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(state, Path(root, "loaded.pt"))
        facts = {"total": total, "kept": kept, "held": max(held, default=0), "read": sum(read)}
        facts["kept_step"], facts["alive"] = result.kept_step, alive
        Path(root, f"rank{rank}.json").write_text(json.dumps(facts))


def _counted(snapshot: dict[str, torch.Tensor], kept: list[int]) -> dict[str, torch.Tensor]:
    kept.append(sum(t.numel() for t in snapshot.values()))
    return snapshot


@pytest.mark.slow
def test_gkd_on_two_ranks_holds_its_shards_only(tmp_path: Path) -> None:
    from gkd_helpers import child_spec, save_setup
    from safetensors.torch import load_file

    from puzzle.gkd import WEIGHTS_FILE, load_distilled
    from puzzle.model import HybridLM

    save_setup(tmp_path)
    spawn_ranks(_worker, str(tmp_path))
    weights = tmp_path / "gkd" / WEIGHTS_FILE
    file_bytes = sum(t.numel() * t.element_size() for t in load_file(str(weights)).values())
    largest = max(t.numel() for t in load_file(str(weights)).values())
    for rank in range(2):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        total = facts["total"]
        print(
            f"rank {rank}: keep_best {facts['kept']} of {total}, write {facts['held']}, read {facts['read']}"
        )
        assert facts["kept"] and max(facts["kept"]) <= MAX_SHARE * total  # each evaluation's copy
        assert facts["held"] == largest  # one tensor at a time, never the student
        assert 0 < facts["read"] <= MAX_SHARE * file_bytes
        assert facts["alive"] == 0  # the student's units as it came, sharded, freed once re-sharded
    # What the ranks loaded is the file (gathered again), and the file is what one process loads.
    loaded = torch.load(tmp_path / "loaded.pt")
    plain = load_distilled(tmp_path / "gkd", HybridLM(child_spec()))
    for name, value in plain.state_dict().items():
        assert torch.equal(loaded[name], value), name
