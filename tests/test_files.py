"""Atomic writes: the file (or directory) appears whole or not at all, with a plain file's permissions;
leftovers of killed writers are removed only when provably theirs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from puzzle.files import (
    OWNER_MARKER,
    atomic_write,
    atomic_write_bytes,
    default_mode,
    make_staging_dir,
    owner_is_gone,
    owner_record,
    read_owner_marker,
    remove_stale_staging,
    swap_directory_into_place,
)


def test_atomic_write_bytes_creates_parents_and_plain_permissions(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "scores.bin"
    assert atomic_write_bytes(target, b"abc") == target
    assert target.read_bytes() == b"abc"
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"")
    assert os.stat(target).st_mode & 0o777 == os.stat(plain).st_mode & 0o777 == default_mode()
    assert [p.name for p in target.parent.iterdir()] == ["scores.bin"]  # no temporary left


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    target.write_text("old")

    def broken(temporary: str) -> None:
        Path(temporary).write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_default_mode_follows_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        assert default_mode() == 0o640 and default_mode(directory=True) == 0o750
        made = tmp_path / "made"
        made.mkdir()
        assert os.stat(made).st_mode & 0o777 == default_mode(directory=True)
    finally:
        os.umask(previous)


def test_atomic_write_gives_default_mode_to_a_writer_that_recreates_the_file(tmp_path: Path) -> None:
    """safetensors' save_file recreates its file with mode 0o600; the output still gets default_mode."""
    import torch
    from safetensors.torch import save_file

    target = tmp_path / "scores.safetensors"
    atomic_write(target, lambda temporary: save_file({"a": torch.zeros(2)}, temporary))
    assert os.stat(target).st_mode & 0o777 == default_mode()


def _dead_pid() -> int:
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    return finished.pid


def test_owner_is_gone_only_when_provably_so() -> None:
    me = owner_record()
    assert me["pid"] == os.getpid() and me["host"] == socket.gethostname()
    assert not owner_is_gone(me)  # this process runs
    assert owner_is_gone({**me, "pid": _dead_pid()})
    assert not owner_is_gone({**me, "pid": _dead_pid(), "host": me["host"] + "-elsewhere"})  # cannot check
    assert not owner_is_gone({"host": me["host"]})  # no pid: nothing proves it
    if me["start"] is not None:  # Linux: a reused pid has another start time
        assert owner_is_gone({**me, "start": me["start"] - 1})
        zombie = subprocess.Popen([sys.executable, "-c", "pass"])
        while Path(f"/proc/{zombie.pid}/stat").read_text().split(") ")[1][0] != "Z":
            time.sleep(0.01)  # exited but not yet reaped: its pid still answers a signal
        assert owner_is_gone({**me, "pid": zombie.pid, "start": None})
        zombie.wait()


def test_remove_stale_staging_removes_only_provably_dead_owners(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    dead = {**owner_record(), "pid": _dead_pid()}

    def leftover(name: str, record: dict | None) -> Path:
        directory = tmp_path / name
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"x" * 100)
        if record is not None:
            (directory / OWNER_MARKER).write_text(json.dumps(record))
        return directory

    stale_tmp = leftover(".out.tmp-a1", dead)
    stale_old = leftover(".out.old-b2", dead)
    live = leftover(".out.tmp-c3", owner_record())  # a save still running
    unmarked = leftover(".out.tmp-d4", None)  # not provably ours
    other_target = leftover(".outer.tmp-e5", dead)  # another destination's
    assert sorted(remove_stale_staging(target)) == sorted([stale_tmp, stale_old])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["out", live.name, unmarked.name, other_target.name]
    )


def test_remove_stale_staging_restores_a_target_moved_aside(tmp_path: Path) -> None:
    """Killed between the two renames of a swap: the previous directory comes back, marker removed."""
    target = tmp_path / "out"
    old = tmp_path / ".out.old-x"
    old.mkdir()
    (old / "config.json").write_text("previous")
    (old / OWNER_MARKER).write_text(json.dumps({**owner_record(), "pid": _dead_pid()}))
    assert remove_stale_staging(target) == [old]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]
    assert (target / "config.json").read_text() == "previous"


def test_staging_dir_is_marked_and_swapped_in_without_its_marker(tmp_path: Path) -> None:
    target = tmp_path / "out"
    for content in ("first", "second"):
        staging = make_staging_dir(target)
        assert staging.name.startswith(".out.tmp-") and read_owner_marker(staging) == owner_record()
        assert os.stat(staging).st_mode & 0o777 == default_mode(directory=True)
        (staging / "config.json").write_text(content)
        swap_directory_into_place(staging, target)
        assert [p.name for p in tmp_path.iterdir()] == ["out"]
        assert [p.name for p in target.iterdir()] == ["config.json"]
        assert (target / "config.json").read_text() == content
