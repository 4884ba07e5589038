"""Atomic file output: write beside the target under a temporary name, then rename over it.

A reader (or a resumed stage) never sees a half-written file, and a crash leaves the old file intact.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, writer: Callable[[str], None]) -> Path:
    """Call `writer(temporary_path)` to produce the file, then rename it to `path` (parents created).

    The temporary file lives in the target's folder so the rename stays on one filesystem.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(handle)
    try:
        writer(temporary)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically."""
    return atomic_write(path, lambda temporary: Path(temporary).write_bytes(data))
