"""Atomic writes: the file appears whole or not at all, with the permissions of a plainly created file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from puzzle.files import atomic_write, atomic_write_bytes, default_mode


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
