"""Atomic file and directory output: write beside the target under a temporary name, then rename over it.

A reader (or a resumed stage) never sees a half-written file, and a crash leaves the old file intact.
A directory is built in a staging directory that carries an owner marker (host, pid, process start
time), so a later write to the same target can prove a leftover from a killed process is its own
and remove it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Written first into every staging directory (and into a directory being moved aside): who owns it.
OWNER_MARKER = ".puzzle-owner.json"


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
    try:
        writer(temporary)
        # After the writer: some writers (safetensors) recreate the file with mode 0o600.
        os.chmod(temporary, default_mode())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically."""
    return atomic_write(path, lambda temporary: Path(temporary).write_bytes(data))


# ------------------------------------------------------------------------------------ directories


def _process_start(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of process `pid` from /proc; None where unavailable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[19])


def owner_record() -> dict[str, Any]:
    """This process as an owner marker records it: host name, pid and start time (None off Linux)."""
    started = _process_start(os.getpid())
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": started and started[1]}


def owner_is_gone(record: dict[str, Any]) -> bool:
    """True only when the process an owner record names provably no longer runs.

    It must be on this host (a pid on another host cannot be checked) and either have no process
    with its pid, be a zombie, or its pid now belong to a process started at another time (reuse).
    """
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: it exists
        pass
    current = _process_start(pid)
    if current is None:
        return False
    state, start = current
    return state == "Z" or (record.get("start") is not None and start != record["start"])


def write_owner_marker(directory: Path) -> None:
    """Mark `directory` as this process's own (see `owner_is_gone`)."""
    (directory / OWNER_MARKER).write_text(json.dumps(owner_record()) + "\n")


def read_owner_marker(directory: Path) -> dict[str, Any] | None:
    """The owner record in `directory`, or None when it has none (or an unreadable one)."""
    try:
        record = json.loads((directory / OWNER_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _leftover_name(target: Path, role: str) -> str:
    return f".{target.name}.{role}-"


def make_staging_dir(target: Path) -> Path:
    """A new marked staging directory `.NAME.tmp-XXXX` beside `target` (parents created), default mode."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=_leftover_name(target, "tmp"), dir=target.parent))
    try:
        staging.chmod(default_mode(directory=True))  # mkdtemp makes it 0o700, private to this user
        write_owner_marker(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def swap_directory_into_place(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`; an existing `target` is moved aside (`.NAME.old-XXXX`), then removed.

    The directory moved aside is marked first, so if this process is killed between the two renames
    `remove_stale_staging` puts it back; the staging directory's marker is removed once it is in place.
    """
    if not target.exists():
        os.rename(staging, target)
    else:
        old = Path(tempfile.mkdtemp(prefix=_leftover_name(target, "old"), dir=target.parent))
        os.rmdir(old)
        write_owner_marker(target)
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(old, target)
            (target / OWNER_MARKER).unlink(missing_ok=True)
            raise
        shutil.rmtree(old, ignore_errors=True)
    (target / OWNER_MARKER).unlink(missing_ok=True)


def remove_stale_staging(target: Path) -> list[Path]:
    """Remove what killed writes to `target` left beside it; returns the directories removed or restored.

    Only `.NAME.tmp-*` and `.NAME.old-*` directories whose owner marker names a process that is
    provably gone (`owner_is_gone`) are touched: a live writer's, another host's or an unmarked one
    stays. A marked `.old-` directory while `target` is missing is the previous `target` (its writer
    died between the two renames of `swap_directory_into_place`): it is renamed back, not removed.
    """
    if not target.parent.is_dir():
        return []
    handled = []
    # .old- first: restoring a missing target must happen whatever else is found.
    for role in ("old", "tmp"):
        prefix = _leftover_name(target, role)
        for entry in sorted(target.parent.iterdir()):
            if not entry.name.startswith(prefix) or entry.is_symlink() or not entry.is_dir():
                continue
            record = read_owner_marker(entry)
            if record is None or not owner_is_gone(record):
                continue
            if role == "old" and not target.exists():
                try:
                    os.rename(entry, target)
                except OSError:  # never remove the only copy of the previous checkpoint
                    continue
                (target / OWNER_MARKER).unlink(missing_ok=True)
                handled.append(entry)
                continue
            shutil.rmtree(entry, ignore_errors=True)
            handled.append(entry)
    return handled


# The model card of an export (`puzzle.card`): its file, and the line that marks it as ours.
CARD_FILE = "README.md"
CARD_MARKER = (
    "<!-- model card written by puzzle.export: a README.md without this line is never overwritten -->"
)


def card_owner(directory: str | Path) -> str | None:
    """Who wrote `directory`/README.md: "puzzle" (it carries CARD_MARKER), "user", or None when there is none."""
    path = Path(directory) / CARD_FILE
    if not path.is_file():
        return None
    try:
        return "puzzle" if CARD_MARKER in path.read_text(errors="replace") else "user"
    except OSError:
        return "user"  # unreadable: never ours to replace


# ---------------------------------------------------------------------------- outputs the user named


def existing_ancestor(path: Path) -> Path:
    """`path` if it exists, else the nearest folder above it that does (`.` for a relative path none of
    whose parents exist): where a directory still to be created will live."""
    return next((p for p in (path, *path.parents) if p.exists()), Path("."))


def tree_bytes(*folders: Path) -> int:
    """The bytes of the plain files under `folders` (absent ones count 0; links are not followed)."""
    return sum(
        f.stat().st_size
        for folder in folders
        if folder.is_dir()
        for f in folder.rglob("*")
        if f.is_file() and not f.is_symlink()
    )


def path_problem(path: Path, option: str) -> str | None:
    """Why directory `path` (named by the user as `option`) cannot be created or written, or None.

    Checked before any work: `path` or the nearest existing folder above it must be a directory this
    process can create entries in. That is proved by creating (and at once removing) an empty hidden
    folder there, since permission bits do not tell (root passes `os.access` on /proc, a read-only mount
    passes it too). The answer names the path, what was expected and what was found.
    """
    existing = existing_ancestor(path)
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under the file {existing}"
        return f"{option} {path} {where}: expected a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".puzzle-probe-", dir=existing))
    except OSError as error:
        found = "in it" if existing == path else f"in {existing}, the folder that would hold it,"
        reason = error.strerror or str(error)
        return (
            f"{option} {path}: expected a directory this user can write in, but creating a folder {found} "
            f"failed: {reason}"
        )
    return None


def describe_os_error(error: OSError) -> str:
    """An OSError as one sentence naming its path(s): "X: No space left on device" rather than
    Python's "[Errno 28] No space left on device: 'X'"."""
    reason = error.strerror or str(error)
    if error.filename is None:
        return reason
    target = f"{error.filename}" + (f" -> {error.filename2}" if error.filename2 is not None else "")
    return f"{target}: {reason}"


def foreign_entries(directory: Path, is_own: Callable[[Path], bool]) -> list[str]:
    """The names of the entries of `directory` that `is_own` does not claim, sorted; none for a missing one.

    The one rule every command that writes into a directory the user named applies (a checkpoint save,
    an export, `puzzle convert`, `puzzle report`, a run directory): whatever a command cannot prove is its
    own output is the user's, and is never replaced without an explicit overwrite.
    """
    if not directory.is_dir():
        return []
    return sorted(entry.name for entry in directory.iterdir() if not is_own(entry))


def refusal_to_overwrite(target: Path, foreign: list[str], what: str) -> str:
    """The first half of the refusal to write into `target`, which holds `foreign` (`foreign_entries`), none
    of them `what` (e.g. "checkpoint files"): the caller adds what its user can do about it."""
    shown = ", ".join(foreign[:5]) + (f" (and {len(foreign) - 5} more)" if len(foreign) > 5 else "")
    return f"refusing to write into {target}: it holds files that are not {what} ({shown})"


def move_files_beside(staging: Path, target: Path) -> None:
    """Move each entry of `staging` into the existing `target` (files one atomic rename each, folders
    swapped in whole by `swap_directory_into_place`), leaving `target`'s other entries alone; then remove
    `staging`. For an explicit overwrite of a directory that holds files of the user's."""
    for entry in sorted(staging.iterdir()):
        if entry.name == OWNER_MARKER:
            continue
        if entry.is_dir():
            if (target / entry.name).is_file():  # the overwrite the user asked for
                (target / entry.name).unlink()
            swap_directory_into_place(entry, target / entry.name)
        else:
            os.replace(entry, target / entry.name)
    shutil.rmtree(staging)
