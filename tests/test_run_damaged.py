"""A damaged output of a finished run is not reused (`puzzle run`, `puzzle.ledger.Ledger.intact`): a truncated,
deleted or replaced (same size, other bytes) file is found; only the damaged part is redone (one library
variant retrained, the others' files untouched; one export re-exported; the scores rescored), and a file
that cannot be redone in part (library.json) exits 2 naming it and the command that repairs it."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from run_helpers import config_dict, make_inputs, write_config
from safetensors.torch import load_file

from puzzle.artifacts import _file_key
from puzzle.cli import main


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    config = write_config(root / "run.yaml", config_dict(root))
    make_inputs(root)
    assert _run(config) == 0
    return root / "run"


def _run(config: Path) -> int:
    torch.set_num_threads(1)
    return main(["run", str(config), "--quiet"])


def _copy(run_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    return copied, write_config(tmp_path / "run.yaml", config_dict(run_dir.parent, run_dir=str(copied)))


def _statuses(run_dir: Path) -> dict[str, str]:
    return {k: v["status"] for k, v in json.loads((run_dir / "run.json").read_text())["stages"].items()}


def _state(path: Path) -> tuple[bytes, int, int]:
    stat = path.stat()
    return path.read_bytes(), stat.st_mtime_ns, stat.st_ino


def _damage(path: Path, how: str) -> None:
    """Truncate, delete, or replace `path` by other bytes of the same size (its mtime put back)."""
    if how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "delete":
        path.unlink()
    else:
        data, stat = bytearray(path.read_bytes()), path.stat()
        data[len(data) // 2 + 3] ^= 0xFF  # inside the tensor data: the file still loads
        path.write_bytes(bytes(data))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("how", ["truncate", "delete", "replace"])
def test_a_damaged_library_variant_is_retrained_alone(finished, tmp_path, how):
    run_dir, config = _copy(finished, tmp_path)
    variants = sorted((run_dir / "library").rglob("block*/*.safetensors"))
    assert len(variants) >= 2
    damaged, others = variants[0], variants[1:]
    before = {path: _state(path) for path in others}
    records = json.loads((run_dir / "library" / "library.json").read_text())["variants"]
    _damage(damaged, how)
    assert _run(config) == 0
    assert {path: _state(path) for path in others} == before  # same bytes, same mtime and inode
    load_file(damaged)  # trained again: a whole file
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "library: not reused" in log and "BLD: 1 damaged variant file(s)" in log
    assert "BLD plan: 1 variants in 1 wave(s)" in log
    after = json.loads((run_dir / "library" / "library.json").read_text())["variants"]
    name = str(damaged.relative_to(run_dir / "library"))
    assert [r for r in after if r["file"] != name] == [r for r in records if r["file"] != name]
    statuses = _statuses(run_dir)
    assert statuses["importance"] == "reused" and statuses["library"] == "done"
    assert all(status in ("done", "reused") for status in statuses.values())
    assert _run(config) == 0 and set(_statuses(run_dir).values()) == {"reused"}  # and now it stays


def test_a_damaged_export_is_exported_again_alone(finished, tmp_path):
    run_dir, config = _copy(finished, tmp_path)
    (export,) = (run_dir / "exports").iterdir()
    weights = export / "model.safetensors"
    good = weights.read_bytes()
    _damage(weights, "replace")
    assert _run(config) == 0
    assert weights.read_bytes() == good  # the same child exported again
    statuses = _statuses(run_dir)
    assert statuses["export"] == "done"
    assert all(status == "reused" for stage, status in statuses.items() if stage != "export")


def test_damaged_scores_are_rescored(finished, tmp_path):
    run_dir, config = _copy(finished, tmp_path)
    scores = run_dir / "scores" / "scores.json"
    library = {path: _state(path) for path in (run_dir / "library").rglob("*") if path.is_file()}
    _damage(scores, "replace")
    assert _run(config) == 0
    json.loads(scores.read_text())
    assert {path: _state(path) for path in library} == library
    statuses = _statuses(run_dir)
    assert statuses["library"] == "reused" and statuses["scores"] == "done"
    # The copy's files were hashed again once (new inodes), their keys kept: the next check is a stat.
    digests = json.loads((run_dir / "library" / "library.manifest.json").read_text())["digests"]
    known = json.loads((run_dir / "outputs_hash.json").read_text())["files"]
    for name, entry in digests.items():
        path = (run_dir / "library" / name).resolve()
        assert known[str(path)] == {"key": _file_key(path), "sha256": entry["sha256"]}


def test_a_damaged_library_record_exits_2_naming_it_and_the_repair(finished, tmp_path, capsys):
    run_dir, config = _copy(finished, tmp_path)
    record = run_dir / "library" / "library.json"
    _damage(record, "truncate")
    weights = {path: _state(path) for path in (run_dir / "library").rglob("*.safetensors")}
    capsys.readouterr()
    assert _run(config) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(record) in lines[0]
    assert f"rm -r {run_dir / 'library'} && puzzle run {run_dir / 'run.resolved.yaml'}" in lines[0]
    assert {path: _state(path) for path in weights} == weights  # nothing of it was touched
    started = time.perf_counter()
    shutil.rmtree(run_dir / "library")  # the repair it names
    assert main(["run", str(run_dir / "run.resolved.yaml"), "--quiet"]) == 0
    assert _statuses(run_dir)["library"] == "done", time.perf_counter() - started


def test_a_damaged_distilled_child_is_distilled_again(finished, tmp_path):
    run_dir, config = _copy(finished, tmp_path)
    (child,) = (run_dir / "children").iterdir()
    _damage(child / "student.safetensors", "replace")
    assert _run(config) == 0
    load_file(child / "student.safetensors")
    statuses = _statuses(run_dir)
    assert statuses["distill"] == "done"
    assert all(statuses[stage] == "reused" for stage in ("importance", "library", "scores", "assemble"))
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "distill: not reused" in log and "has other bytes than were written" in log


def test_damaged_importance_is_recomputed_and_nothing_downstream_is_redone(finished, tmp_path):
    run_dir, config = _copy(finished, tmp_path)
    (scores,) = [p for p in (run_dir / "importance").iterdir() if not p.name.endswith(".manifest.json")][:1]
    _damage(scores, "replace")
    assert _run(config) == 0
    statuses = _statuses(run_dir)
    # Recomputed into the same bytes: its manifest's fingerprint is unchanged, so the library is reused.
    assert statuses["importance"] == "done"
    assert all(status == "reused" for stage, status in statuses.items() if stage != "importance")


def test_an_export_recorded_before_digests_is_checked_for_whole_weight_files(finished, tmp_path):
    run_dir, config = _copy(finished, tmp_path)
    manifest = json.loads((run_dir / "run.json").read_text())
    for entry in manifest["stages"]["export"]["outputs"].values():
        del entry["files"]  # as recorded before export files had digests
    (run_dir / "run.json").write_text(json.dumps(manifest, indent=2) + "\n")
    assert _run(config) == 0 and set(_statuses(run_dir).values()) == {"reused"}  # not redone for that alone
    (export,) = (run_dir / "exports").iterdir()
    _damage(export / "model.safetensors", "truncate")
    assert _run(config) == 0
    load_file(export / "model.safetensors")
    assert _statuses(run_dir)["export"] == "done"


def test_every_stage_declares_how_its_outputs_are_checked():
    """Each stage module declares the check of its recorded outputs (the ledger has no per-stage branches):
    every stage of STAGES and the frontier's record has one, and a record of another stage is refused by
    name instead of being reused unchecked."""
    from puzzle.layout import STAGES
    from puzzle.run import Run

    assert set(Run.OUTPUT_CHECKS) == {*STAGES, "frontier", "eval"}
    run = Run.__new__(Run)  # the table is the class's: no run directory is needed to consult it
    with pytest.raises(ValueError, match="no output check for stage 'bogus'"):
        run.output_damage("bogus/x", {})
