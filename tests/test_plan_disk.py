"""Disk, stated and bounded: the library stored in the parent's dtype (`bld.save_dtype`), `puzzle plan --disk`
refusing a run whose disk is larger and naming the stage and the space axes that cost the most, and the free
space a run is checked against (what its run directory already holds counts as written)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from bld_helpers import load_setup, save_setup, settings, token_batches, variants
from safetensors.torch import load_file

from puzzle.bld import build_library
from puzzle.cli import main
from puzzle.commands import byte_size
from puzzle.config import load_config
from puzzle.layout import RunLayout
from puzzle.ledger import RunError
from puzzle.library import LIBRARY_FILE
from puzzle.plan import disk_room, plan_config, run_hardware
from puzzle.run.disk import MUCH_BYTES, check_stage_disk, disk_shortfall
from puzzle.settings import BLDSettings

ROOT = Path(__file__).resolve().parent.parent
SUPER_H100 = ROOT / "examples" / "nemotron3_super" / "config.yaml"
H100S = ["--gpus", "64", "--hardware", "h100-80gb"]  # the seed's run trains there (it serves on 8xb200)


def _library_stage(config, save_dtype: str):
    bld = dataclasses.replace(config.bld, save_dtype=save_dtype)
    plan = plan_config(dataclasses.replace(config, bld=bld), 64, "h100-80gb")
    return {s.name: s for s in plan.stages}["library"]


def test_a_bf16_parents_library_is_planned_in_bf16_unless_the_config_says_float32():
    config = load_config(SUPER_H100)
    assert config.bld.save_dtype == "parent" and config.parent.dtype == "bfloat16"
    parent, fp32 = _library_stage(config, "parent"), _library_stage(config, "float32")
    library_bytes = fp32.disk - parent.disk  # the wave checkpoint is the same: training dtype
    assert library_bytes > 0.8 * parent.disk  # the library is most of the stage's disk
    assert _library_stage(config, "bfloat16").disk == parent.disk
    by_kind = next(n for n in parent.notes if n.startswith("library bytes by kind: moe "))
    assert "(1053 variants over expert_width (7 values) x top_k (4 values))" in by_kind
    assert "mamba" in by_kind and "(78 variants over state_size (2 values))" in by_kind


def test_bld_stores_the_kept_weights_in_save_dtype(tmp_path):
    (tmp_path / "setup").mkdir()
    save_setup(tmp_path / "setup")
    parent, importance = load_setup(tmp_path / "setup")

    def build(folder: str, **changes):
        build_library(
            parent,
            variants(),
            token_batches(12, seed=300),
            token_batches(2, seed=400),
            importance,
            settings(**changes),
            tmp_path / folder,
            data_fingerprint="train-300",
            max_steps=2,
        )
        files = sorted((tmp_path / folder).glob("block*/*.safetensors"))
        assert files and (tmp_path / folder / LIBRARY_FILE).is_file()
        return {f.relative_to(tmp_path / folder): load_file(str(f)) for f in files}

    as_parent, as_bf16 = build("parent"), build("bf16", save_dtype="bfloat16")
    assert as_parent.keys() == as_bf16.keys()
    for name, tensors in as_parent.items():
        for key, value in tensors.items():
            assert value.dtype == torch.float32  # the parent's (a float32 parent)
            assert as_bf16[name][key].dtype == torch.bfloat16
            assert torch.equal(as_bf16[name][key], value.to(torch.bfloat16)), (name, key)
    with pytest.raises(
        ValueError, match=r"save_dtype must be 'parent', 'float32' or 'bfloat16', found 'fp16'"
    ):
        BLDSettings(save_dtype="fp16")


def test_puzzle_plan_disk_refuses_a_run_that_does_not_fit_naming_the_stage_and_axes(capsys):
    assert main(["plan", str(SUPER_H100), *H100S, "--disk", "20TB"]) == 0
    capsys.readouterr()
    assert main(["plan", str(SUPER_H100), *H100S, "--disk", "5TiB"]) == 2
    err = capsys.readouterr().err
    assert "does not fit: disk: the run writes about 5965.1 GiB, more than the 5120.0 GiB free" in err
    assert "the most is stage library (5066.1 GiB)" in err
    assert "moe 4231.2 GiB (1053 variants over expert_width (7 values) x top_k (4 values))" in err


@pytest.mark.parametrize(
    ("text", "value"), [("1000", 1000), ("6TB", 6e12), ("5.5TiB", 5.5 * 2**40), ("800gib", 800 * 2**30)]
)
def test_disk_sizes_read_with_their_units(text, value):
    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["800x", "TB", "-1GB", "0"])
def test_a_bad_disk_size_is_an_error_quoting_it(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
        byte_size(text)


def test_what_a_run_directory_holds_counts_as_written(tmp_path):
    config = load_config(SUPER_H100)
    plan = plan_config(config, 64, "h100-80gb")
    short = plan.disk - 2**30
    assert plan.disk_misfits(short, "at /scratch")  # 1 GiB short
    assert plan.disk_misfits(short, "at /scratch", written=2**30) == []  # a resumed run: that GiB is there
    run_dir = tmp_path / "run"
    (run_dir / "library").mkdir(parents=True)
    (run_dir / "library" / "a.bin").write_bytes(b"x" * 1000)
    (run_dir / "b.json").write_bytes(b"y" * 24)
    free, written, where = disk_room(run_dir)
    assert written == 1024 and free > 0 and str(run_dir) in where
    _, nothing, where = disk_room(tmp_path / "not" / "yet")  # the nearest folder that exists holds it
    assert nothing == 0 and f"at {tmp_path}" in where


def test_a_stage_that_writes_more_than_the_free_disk_is_refused_before_it_starts(tmp_path):
    """The Super example's library (about 5 TiB planned) against this machine's real free space; the
    forward-only stages write too little to be checked."""
    config = load_config(SUPER_H100)
    layout = RunLayout(tmp_path / "run")
    free = shutil.disk_usage(tmp_path).free
    library = {s.name: s for s in plan_config(config, 1, run_hardware(config)).stages}["library"]
    assert library.disk > free, "this test needs a disk smaller than Super's library"
    with pytest.raises(
        RunError, match=r"stage library writes about \d+\.\d GiB, more than the .* GiB free at "
    ):
        check_stage_disk(config, layout, "library")
    check_stage_disk(config, layout, "scores")  # writes little: not checked


def test_a_resumed_stage_needs_only_what_it_has_not_written():
    gib = 2**30
    assert disk_shortfall("library", 10 * gib, 0, 4 * gib, Path("/r")).startswith("stage library writes")
    assert disk_shortfall("library", 10 * gib, 7 * gib, 4 * gib, Path("/r")) is None
    assert "7.0 GiB of it already written" in disk_shortfall(
        "library", 20 * gib, 7 * gib, 4 * gib, Path("/r")
    )
    assert disk_shortfall("scores", MUCH_BYTES - 1, 0, 0, Path("/r")) is None
