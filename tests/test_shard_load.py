"""`load(path, shard=True)`: each of 2 gloo ranks builds, holds and reads only its shards of the parent, and
the sharded model is the plain load (logits within 1e-5 in fp32, every gathered tensor bit-equal).

Parents: transformers NemotronH checkpoints (latent MoE with Mamba and attention; dense MLP), one with fused
3-D expert tensors under `model.`, and a puzzle checkpoint of every block kind with experts of mixed widths
(bank shards that cut through an expert) and tied embeddings, split over several files with an index.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from gloo_helpers import gloo_rank, spawn_ranks
from nemotron_helpers import EVERY_KIND_SPEC, random_hf_model, save_hf, tiny_config, token_batch
from run_helpers import make_inputs, write_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import puzzle
from puzzle.model import HybridLM
from puzzle.nemotron_h import checkpoint, sharded
from puzzle.nemotron_h.weights import weight_files
from puzzle.shard import local_numel

# No rank may hold or read more than this share of the parent (half of it, plus the replicated norms).
MAX_SHARE = 0.6


def _fused(directory: Path) -> Path:
    """A transformers model saved with fused 3-D expert tensors under `model.` in one file."""
    parent = random_hf_model(tiny_config("plain_moe"), seed=3)
    saved = save_hf(parent, directory / "saved")
    source = directory / "fused"
    source.mkdir()
    (source / "config.json").write_text((saved / "config.json").read_text())
    state = {key: value.contiguous() for key, value in parent.state_dict().items()}
    assert any(".experts." in key and value.ndim == 3 for key, value in state.items())
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    return source


def _every_kind(directory: Path) -> Path:
    """A puzzle checkpoint of every block kind, mixed expert widths, tied embeddings, in several files."""
    torch.manual_seed(0)
    model = HybridLM(dataclasses.replace(EVERY_KIND_SPEC, tie_embeddings=True))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.2)
    path = model.save_pretrained(directory / "every_kind", max_shard_bytes=4096)
    assert len(weight_files(path)) > 1
    return path


@pytest.fixture(scope="module")
def parents(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shard_load")
    return {
        "latent_moe": save_hf(random_hf_model(tiny_config("latent_moe")), root / "latent_moe"),
        "dense_mlp": save_hf(random_hf_model(tiny_config("dense_mlp"), seed=1), root / "dense_mlp"),
        "fused": _fused(root),
        "every_kind": _every_kind(root),
    }


def _file_bytes(path: Path) -> int:
    """Bytes of tensor data in the checkpoint's safetensors files (the whole parent on disk)."""
    total = 0
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                piece = handle.get_slice(key)
                shape, dtype = piece.get_shape(), piece.get_dtype()
                total += torch.Size(shape).numel() * {"F32": 4, "BF16": 2, "F16": 2}[dtype]
    return total


def _compare(path: Path) -> dict[str, object]:
    """This rank's figures for the sharded load of `path` against the plain load (collectives inside)."""
    read: list[int] = []
    sharded.read_observer = lambda file, key, tensor: read.append(tensor.nbytes)
    try:
        model = puzzle.load(path, shard=True, dtype=torch.float32)
    finally:
        sharded.read_observer = None
    plain = checkpoint.load(path, dtype=torch.float32)
    diff = None
    if (
        not plain.spec.tie_embeddings
    ):  # a tied lm_head holds the embeddings' shard: it runs in the stages only
        ids = token_batch(seed=5) % plain.spec.vocab_size
        with torch.no_grad():
            diff = (model(ids).logits - plain(ids).logits).abs().max().item()
    want = plain.state_dict()
    got = model.state_dict()
    unequal = []
    for key, value in got.items():  # same keys and order on every rank: full_tensor is a collective
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if full.dtype != want[key].dtype or not torch.equal(full, want[key]):
            unequal.append(key)
    return {
        "numel": local_numel(model),
        "parent_numel": sum(p.numel() for p in plain.parameters()),
        "bytes_read": sum(read),
        "file_bytes": _file_bytes(path),
        "logit_diff": diff,
        "unequal": unequal,
        "missing": sorted(set(want) - set(got)),
        "tied": model.lm_head.weight is model.embeddings.weight,
        "want_tied": plain.lm_head.weight is plain.embeddings.weight,
    }


def _worker(rank: int, world: int, port: int, paths: dict[str, str], out: str) -> None:
    with gloo_rank(rank, world, port):
        results = {name: _compare(Path(path)) for name, path in paths.items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def measured(parents, tmp_path_factory) -> list[dict[str, dict]]:
    """Each rank's figures for each parent, from one 2-rank gloo run."""
    out = tmp_path_factory.mktemp("ranks")
    spawn_ranks(_worker, {name: str(path) for name, path in parents.items()}, str(out))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_each_rank_holds_at_most_0_6_of_the_parent(measured):
    for rank, results in enumerate(measured):
        for name, result in results.items():
            share = result["numel"] / result["parent_numel"]
            print(f"rank {rank} {name}: holds {share:.3f} of the parent's parameter elements")
            assert share <= MAX_SHARE, (rank, name, share)


@pytest.mark.slow
def test_each_rank_reads_at_most_0_6_of_the_files(measured):
    for rank, results in enumerate(measured):
        for name, result in results.items():
            share = result["bytes_read"] / result["file_bytes"]
            print(f"rank {rank} {name}: read {share:.3f} of the safetensors bytes")
            assert 0 < share <= MAX_SHARE, (rank, name, share)
    # Together the ranks read every byte at least once (the replicated tensors on both); a tied parent's
    # file also holds an lm_head.weight, which the load does not read.
    for name in (name for name, result in measured[0].items() if not result["want_tied"]):
        assert sum(results[name]["bytes_read"] for results in measured) >= measured[0][name]["file_bytes"]


@pytest.mark.slow
def test_sharded_logits_equal_the_plain_load(measured):
    for results in measured:
        compared = {name: result["logit_diff"] for name, result in results.items() if not result["want_tied"]}
        assert len(compared) == 3
        for name, diff in compared.items():
            print(f"{name}: logits differ by {diff:.2e}")
            assert diff <= 1e-5, (name, diff)


@pytest.mark.slow
def test_every_gathered_tensor_equals_the_plain_load_exactly(measured):
    for results in measured:
        for name, result in results.items():
            assert result["unequal"] == [] and result["missing"] == [], name
            assert result["tied"] == result["want_tied"], name
    assert measured[0]["every_kind"]["want_tied"]  # the tied case is covered


def _one_rank(rank: int, world: int, port: int, path: str) -> None:
    torch.set_num_threads(1)
    os.environ.pop("WORLD_SIZE", None)
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = puzzle.load(path, shard=True)
        plain = checkpoint.load(path)
        assert not any(hasattr(p, "device_mesh") for p in model.parameters())  # one rank: the plain load
        want = plain.state_dict()
        assert list(model.state_dict()) == list(want)
        for key, value in model.state_dict().items():
            assert torch.equal(value, want[key]), key
    finally:
        torch_dist.destroy_process_group()


@pytest.mark.slow
def test_one_rank_is_the_plain_load(parents):
    spawn_ranks(_one_rank, str(parents["latent_moe"]), world=1)


def test_shard_without_a_process_group_is_refused(parents):
    assert not torch_dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group"):
        puzzle.load(parents["dense_mlp"], shard=True)


@pytest.mark.slow
def test_a_run_with_fsdp_stages_loads_the_parent_sharded_under_torchrun(tmp_path):
    """`torchrun --nproc-per-node 2 -m puzzle run` with importance, BLD, scoring and GKD on "fsdp": those
    stages load the parent sharded (once per process: each rank logs its share, at most 0.6), the child is
    assembled sharded and distilled, and the importance and the library match one process's."""
    data = make_inputs(tmp_path)
    for stage in ("importance", "bld", "scoring", "gkd"):
        data.setdefault(stage, {})["shard"] = "fsdp"
    env = {
        **os.environ,
        "PUZZLE_PROGRESS": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    one = write_config(tmp_path / "one.yaml", {**data, "run_dir": str(tmp_path / "one")})
    two = write_config(tmp_path / "two.yaml", {**data, "run_dir": str(tmp_path / "two")})
    subprocess.run([sys.executable, "-m", "puzzle", "run", str(one), "--quiet"], env=env, check=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    subprocess.run([*torchrun, "-m", "puzzle", "run", str(two), "--quiet"], env=env, check=True, timeout=300)
    for rank in range(2):
        log = (tmp_path / "two" / "logs" / f"rank{rank}.log").read_text()
        shares = [
            int(held) / int(total)
            for held, total in re.findall(r"this rank holds (\d+) of its (\d+) parameter elements", log)
        ]
        # One parent per process: loaded sharded once, by importance, then shared by BLD, scoring, GKD's teacher.
        assert len(shares) == 1, log
        assert all(share <= MAX_SHARE for share in shares), shares
    # Every stage ran: the child assembled sharded, distilled and exported, streamed by both ranks together,
    # as one process exports it (GKD's steps equal up to float summation order).
    exports = sorted((tmp_path / "one" / "exports").glob("*/*.safetensors"))
    assert exports, "no export"
    for path in exports:
        want, got = (load_file(str(p)) for p in (path, tmp_path / "two" / path.relative_to(tmp_path / "one")))
        assert want.keys() == got.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=data["gkd"]["lr"] / 10, msg=key)
    for rank in range(2):  # the child was sharded on both ranks when exported: the export was theirs together
        assert "export: done" in (tmp_path / "two" / "logs" / f"rank{rank}.log").read_text()
    want, got = (
        load_file(str(tmp_path / run / "importance" / "importance.safetensors")) for run in ("one", "two")
    )
    assert want.keys() == got.keys()
    for key in want:  # the same sums, added in another order
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, msg=key)
    files = sorted((tmp_path / "one" / "library").glob("block*/*.safetensors"))
    assert files
    for path in files:  # as test_run's torchrun test: equal up to float summation order
        want, got = (
            load_file(str(path)),
            load_file(str(tmp_path / "two" / path.relative_to(tmp_path / "one"))),
        )
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=data["bld"]["lr"] / 100, msg=key)
