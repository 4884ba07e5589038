"""`puzzle convert SRC DST`: layout conversions keep the logits bit for bit, transformers reads the output,
dtype conversions, DST inside SRC refused, bad arguments exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from nemotron_helpers import random_hf_model, tiny_config, token_batch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import NemotronHForCausalLM

import puzzle
from puzzle.cli import main
from puzzle.commands import parse_size

TOKENIZER = json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}}})


@pytest.fixture(scope="module")
def fused(tmp_path_factory) -> tuple[NemotronHForCausalLM, Path]:
    """A transformers model saved with fused 3-D expert tensors under `model.` in one file (fp32)."""
    parent = random_hf_model(tiny_config("plain_moe"), seed=3)
    saved = tmp_path_factory.mktemp("saved")
    parent.save_pretrained(saved)
    source = tmp_path_factory.mktemp("fused")
    (source / "config.json").write_text((saved / "config.json").read_text())
    (source / "tokenizer.json").write_text(TOKENIZER)
    state = {key: value.contiguous() for key, value in parent.state_dict().items()}
    assert any(".experts." in key and value.ndim == 3 for key, value in state.items())  # fused banks
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    return parent, source


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _keys(directory: Path) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                tensor = handle.get_slice(key)
                out[key] = (tensor.get_dtype(), list(tensor.get_shape()))
    return out


def test_layout_conversions_keep_logits_identical(fused, tmp_path, capsys):
    parent, source = fused
    ids = token_batch(seed=7)
    reference = _logits(puzzle.load(source), ids)
    sharded = tmp_path / "sharded"
    assert (
        main(["convert", str(source), str(sharded), "--format", "nemotron_h", "--max-shard-size", "8kB"]) == 0
    )
    assert capsys.readouterr().out.strip() == str(sharded)
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    keys = _keys(sharded)
    experts = {key: shape for key, (_, shape) in keys.items() if ".experts." in key}
    assert experts and all(
        len(shape) == 2 for shape in experts.values()
    )  # one by one, as the hub stores them
    assert any(".experts.0.up_proj.weight" in key for key in keys)
    assert (sharded / "tokenizer.json").read_text() == TOKENIZER
    assert torch.equal(_logits(puzzle.load(sharded), ids), reference)
    # transformers reads the converted checkpoint and computes what the original model computes.
    loaded = NemotronHForCausalLM.from_pretrained(sharded).eval()
    assert torch.equal(_logits(loaded, ids), _logits(parent, ids))
    # Back to one file.
    single = tmp_path / "single"
    assert main(["convert", str(sharded), str(single)]) == 0
    assert (single / "model.safetensors").is_file() and not list(single.glob("model-*-of-*"))
    assert torch.equal(_logits(puzzle.load(single), ids), reference)


def test_dtype_conversion(fused, tmp_path):
    _, source = fused
    out = tmp_path / "bf16"
    assert main(["convert", str(source), str(out), "--dtype", "bfloat16"]) == 0
    dtypes = {key: dtype for key, (dtype, _) in _keys(out).items()}
    assert dtypes["backbone.embeddings.weight"] == "BF16"
    # The router stays fp32, as transformers keeps it.
    assert all(dtype == "F32" for key, dtype in dtypes.items() if key.endswith("gate.weight"))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = puzzle.load(out)
    assert model.embeddings.weight.dtype == torch.bfloat16
    assert torch.isfinite(_logits(model, token_batch(seed=1)).float()).all()


def test_destination_inside_source_is_refused(fused, capsys):
    _, source = fused
    before = sorted(p.name for p in source.iterdir())
    assert main(["convert", str(source), str(source / "inner")]) == 2
    err = capsys.readouterr().err
    assert "inside" in err and str(source) in err and "Traceback" not in err
    assert main(["convert", str(source), str(source.parent)]) == 2
    assert sorted(p.name for p in source.iterdir()) == before


def test_a_destination_with_other_files_is_refused_unless_overwrite(fused, tmp_path, capsys):
    """The refusal says what the command line can do (another DST, or --overwrite), before SRC is loaded;
    --overwrite writes the checkpoint beside the other files, which stay untouched."""
    _, source = fused
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert main(["convert", str(source), str(target)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"puzzle convert: error: refusing to write into {target}: it holds files that are not checkpoint "
        "files (notes.txt); choose a new or empty DST, or add --overwrite to write the checkpoint files "
        "beside them\n"
    )
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    assert main(["convert", str(source), str(target), "--overwrite"]) == 0
    assert (target / "notes.txt").read_text() == "mine"
    torch.testing.assert_close(
        _logits(puzzle.load(target), token_batch(seed=2)), _logits(puzzle.load(source), token_batch(seed=2))
    )
    # --overwrite never reaches into SRC: DST inside SRC, or SRC itself, is still refused.
    before = sorted(p.name for p in source.iterdir())
    for dst in (source, source / "inner"):
        assert main(["convert", str(source), str(dst), "--overwrite"]) == 2
        assert "inside" in capsys.readouterr().err
    assert sorted(p.name for p in source.iterdir()) == before


def test_bad_arguments_exit_2(fused, tmp_path, capsys):
    _, source = fused
    for argv in (
        ["--dtype", "int8"],
        ["--format", "gguf"],
        ["--max-shard-size", "lots"],
        ["--max-shard-size", "0"],
    ):
        with pytest.raises(SystemExit) as exit:
            main(["convert", str(source), str(tmp_path / "out"), *argv])
        assert exit.value.code == 2, argv
        assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "missing" in capsys.readouterr().err


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1024") == 1024
    assert parse_size("8kB") == 8000
    for bad in ("", "GB", "5XB", "-1GB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize("where", ["a-file", "a-file/below", "/proc/nope"])
def test_a_destination_that_cannot_be_a_directory_is_one_sentence(fused, tmp_path, capsys, where):
    """DST a file, under a file, or where no folder can be created (/proc, even for root): exit 2 before SRC
    is loaded, one line naming DST and what was expected, no `[Errno N]`."""
    if where.startswith("/proc") and not Path("/proc").is_dir():
        pytest.skip("needs /proc")
    _, source = fused
    (tmp_path / "a-file").write_text("the user's\n")
    target = Path(where) if where.startswith("/") else tmp_path / where
    assert main(["convert", str(source), str(target)]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and str(target) in err and "expected a directory" in err and "Errno" not in err
    )
    assert (tmp_path / "a-file").read_text() == "the user's\n"
