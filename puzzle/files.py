"""Atomic file output: write beside the target under a temporary name, then rename over it.

A reader (or a resumed stage) never sees a half-written file, and a crash leaves the old file intact.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def default_mode(directory: bool = False) -> int:
    """Permission bits a plainly created file (0o666) or directory (0o777) gets under the process umask.

    tempfile creates its files 0o600 and directories 0o700; outputs renamed into place get these instead,
    so a checkpoint or score file is as readable as anything else the user writes.
    """
    return (0o777 if directory else 0o666) & ~_umask()


def _umask() -> int:
    try:  # Linux reports it without changing it (no window where other threads see another umask)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere it can only be read by setting it; put it straight back
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, writer: Callable[[str], None]) -> Path:
    """Call `writer(temporary_path)` to produce the file, then rename it to `path` (parents created).

    The temporary file lives in the target's folder so the rename stays on one filesystem; the result
    has the permissions of a plainly created file (`default_mode`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(handle)
    os.chmod(temporary, default_mode())
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
