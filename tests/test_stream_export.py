"""Streaming export and convert (`puzzle.nemotron_h.stream`): the weight files are byte-identical to those
safetensors' `save_file` writes for the whole state dict (`write_weights(hub_state(model))`, the export
before streaming), one file or several; under 2 gloo ranks a sharded model's export is byte-identical to the
one-process export while no rank holds more than its largest tensor (plus one expert) at once; `puzzle
convert` writes the files `load` + `save_pretrained` write.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from gloo_helpers import gloo_rank, spawn_ranks
from nemotron_helpers import EVERY_KIND_SPEC, random_hf_model, save_hf, tiny_config
from safetensors.torch import save_file

import puzzle
from puzzle import dist
from puzzle.blocks.moe import expert_banks
from puzzle.cli import main
from puzzle.export import export
from puzzle.model import HybridLM
from puzzle.nemotron_h import checkpoint, stream
from puzzle.nemotron_h.weights import (
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    SINGLE_FILE,
    LazyTensor,
    hub_state,
    plan_shards,
    tensor_nbytes,
)


def _model(tie: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0) -> HybridLM:
    """Every block kind (experts of mixed widths), random weights, `dtype` with the router in fp32 as `load`
    keeps it, and two extra (MTP) tensors."""
    torch.manual_seed(seed)
    model = HybridLM(dataclasses.replace(EVERY_KIND_SPEC, tie_embeddings=tie)).to(dtype)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_()
            if name.endswith("gate.weight"):
                parameter.data = parameter.data.float()
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias = module.e_score_correction_bias.float().normal_()
    model.extra_tensors = {
        "mtp.layers.0.norm.weight": torch.randn(16).to(dtype),
        "mtp.fc.weight": torch.randn(4, 8),
    }
    return model


def _files(directory: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(directory.iterdir())}


def write_weights(
    tensors: dict[str, torch.Tensor | LazyTensor], directory: Path, max_shard_bytes: int
) -> None:
    """How the export wrote its weights before streaming (the oracle): each shard whole in memory (lazy
    tensors, e.g. a loaded checkpoint's MTP tensors, read), handed to safetensors' `save_file`, then the
    index."""
    shards = plan_shards({name: tensor_nbytes(tensor) for name, tensor in tensors.items()}, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for number, names in enumerate(shards, start=1):
        file_name = (
            SINGLE_FILE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        )
        loaded = {name: tensors[name] for name in names}
        loaded = {name: t.load() if isinstance(t, LazyTensor) else t for name, t in loaded.items()}
        shard = {name: tensor.detach().to("cpu").contiguous() for name, tensor in loaded.items()}
        weight_map.update(dict.fromkeys(names, file_name))
        save_file(shard, str(directory / file_name), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(tensor_nbytes(tensor) for tensor in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _reference(model: HybridLM, directory: Path, max_shard_bytes: int) -> dict[str, bytes]:
    """The weight files of the export before streaming: each shard whole in memory through `save_file`."""
    directory.mkdir()
    write_weights(hub_state(model), directory, max_shard_bytes)
    return _files(directory)


def _streamed(model: HybridLM, directory: Path, max_shard_bytes: int) -> dict[str, bytes]:
    directory.mkdir()
    stream.stream_weights(model, directory, max_shard_bytes)
    return _files(directory)


def test_data_order_is_the_one_save_file_writes(tmp_path):
    tensors = {
        f"t{i}": torch.zeros(i + 1, dtype=dtype) for i, dtype in enumerate(SAFETENSORS_DTYPES.values())
    }
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    entries = [stream.Entry(n, stream.dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    header, _ = stream.file_header(entries)
    assert (tmp_path / "x.safetensors").read_bytes()[: len(header)] == header
    assert set(stream.DATA_ORDER) == set(SAFETENSORS_DTYPES)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_shard_bytes", [2**30, 3000])
def test_streamed_files_are_byte_identical_to_save_file(tmp_path, tie, dtype, max_shard_bytes):
    model = _model(tie, dtype)
    want = _reference(model, tmp_path / "want", max_shard_bytes)
    got = _streamed(model, tmp_path / "got", max_shard_bytes)
    assert list(got) == list(want)
    if max_shard_bytes < 2**30:
        assert len(want) > 3 and INDEX_FILE in want  # several shard files
    for name in want:
        assert got[name] == want[name], name


def test_save_pretrained_streams_the_same_files(tmp_path):
    model = _model()
    want = _reference(model, tmp_path / "want", 4096)
    path = model.save_pretrained(tmp_path / "saved", max_shard_bytes=4096)
    got = _files(path)
    for name in want:
        assert got[name] == want[name], name


def test_a_planned_tensor_of_the_wrong_shape_is_refused(tmp_path):
    writer = stream.StreamWriter([stream.Entry("a", "F32", (2, 3))], tmp_path, 2**30)
    with pytest.raises(checkpoint.CheckpointError, match=r"'a' is F32 \[3, 2\], planned as F32 \[2, 3\]"):
        writer.write("a", torch.zeros(3, 2))
    writer.abort()


# ---------------------------------------------------------------------------------------------- 2 ranks


def _sharded_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    """Load `path` sharded; stream its weights (rank 0 writes) recording each rank's peak; `save_pretrained`
    on every rank; a save rank 0 refuses (the directory holds a user's file)."""
    peaks: list[int] = []
    with gloo_rank(rank, world, port):
        model = puzzle.load(path, shard=True)
        directory = Path(out, "sharded") if dist.is_main() else None
        if directory is not None:
            directory.mkdir()
            Path(out, "busy").mkdir()
            Path(out, "busy", "notes.txt").write_text("the user's")
        stream.held_observer = peaks.append
        try:
            stream.stream_weights(model, directory, 4096)
        finally:
            stream.held_observer = None
        largest = max(
            (t.full_tensor() if hasattr(t, "full_tensor") else t).numel() for t in model.state_dict().values()
        )
        model.save_pretrained(Path(out, "saved"), max_shard_bytes=4096)
        export(model, Path(out, "exported"), max_shard_bytes=4096)  # puzzle.export on every rank
        dist.barrier()
        try:
            model.save_pretrained(Path(out, "busy"))
            refused = ""
        except (checkpoint.CheckpointError, RuntimeError) as error:
            refused = f"{type(error).__name__}: {error}"
        dist.barrier()
    figures = {"peak": max(peaks), "largest": largest, "refused": refused}
    Path(out, f"rank{rank}.json").write_text(json.dumps(figures))


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_a_sharded_export_is_byte_identical_and_holds_one_tensor_at_a_time(tmp_path, tie):
    path = _model(tie).save_pretrained(tmp_path / "parent", max_shard_bytes=4096)
    plain = checkpoint.load(path)
    want = _streamed(plain, tmp_path / "one", 4096)
    out = tmp_path / "out"
    out.mkdir()
    spawn_ranks(_sharded_worker, str(path), str(out))
    got = _files(out / "sharded")
    assert list(got) == list(want)
    for name in want:
        assert got[name] == want[name], name
    # save_pretrained and export on every rank write what one process's save_pretrained and export write.
    saved, want_saved = _files(out / "saved"), _files(plain.save_pretrained(tmp_path / "one_saved", 4096))
    assert sorted(saved) == sorted(want_saved)
    for name in want_saved:
        assert saved[name] == want_saved[name], name
    exported = _files(out / "exported")
    want_exported = _files(export(plain, tmp_path / "one_exported", max_shard_bytes=4096))
    assert sorted(exported) == sorted(want_exported)
    for name in want_exported:
        assert exported[name] == want_exported[name], name
    model_numel = sum(p.numel() for p in plain.parameters())
    expert = max(max(bank.widths) * bank.up.shape[1] for bank in expert_banks(plain).values())
    figures = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, figure in enumerate(figures):
        print(f"rank {rank}: at most {figure['peak']} elements held at once, model {model_numel}")
        assert figure["peak"] <= figure["largest"] + expert
        assert figure["peak"] < model_numel / 4
    # A refusal on rank 0 reaches every rank (none waits in a collective) and writes nothing.
    assert figures[0]["refused"].startswith("CheckpointError: refusing to write into")
    assert figures[1]["refused"].startswith("RuntimeError: rank 0 failed to save")
    assert sorted(p.name for p in (out / "busy").iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------------------------------------- convert


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_convert_writes_the_files_load_and_save_pretrained_write(tmp_path, dtype):
    source = save_hf(random_hf_model(tiny_config("latent_moe")), tmp_path / "source")
    argv = [] if dtype is None else ["--dtype", dtype]
    assert main(["convert", str(source), str(tmp_path / "out"), "--max-shard-size", "8kB", *argv]) == 0
    model = checkpoint.load(source, dtype=dtype)
    want = _reference(model, tmp_path / "want", 8000)
    got = _files(tmp_path / "out")
    assert len(want) > 2
    for name in want:
        assert got[name] == want[name], name


def test_convert_of_fused_experts_and_tied_embeddings(tmp_path):
    """Fused 3-D expert tensors under `model.` read expert by expert; a tied lm_head written as a copy."""
    tied = _model(tie=True).save_pretrained(tmp_path / "tied", max_shard_bytes=4096)
    parent = random_hf_model(tiny_config("plain_moe"), seed=3)
    saved = save_hf(parent, tmp_path / "saved")
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((saved / "config.json").read_text())
    state = {key: value.contiguous() for key, value in parent.state_dict().items()}
    assert any(".experts." in key and value.ndim == 3 for key, value in state.items())
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    for source in (tied, fused):
        out = tmp_path / f"{source.name}-out"
        assert main(["convert", str(source), str(out), "--max-shard-size", "5kB"]) == 0
        want = _reference(checkpoint.load(source), tmp_path / f"{source.name}-want", 5000)
        got = _files(out)
        for name in want:
            assert got[name] == want[name], (source.name, name)
