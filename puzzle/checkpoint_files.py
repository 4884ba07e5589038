"""A checkpoint's files on disk, before any model reads them: the error that names a bad one, the weight files
a folder holds (an index, one file, or a folder of shards) and a safetensors header read without its data.

The stage outputs' fingerprints (`puzzle.artifacts`) and the NemotronH reader (`puzzle.nemotron_h`) both
stand on these, so that fingerprinting a checkpoint needs no model code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors' own limit on the JSON header; a bigger length is a corrupt file, not a header to read.
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as (or written as) a NemotronH model."""


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of checkpoint `path`: from the index if there is one, else all of them."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index} is not a valid safetensors index: {error}") from error
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index} names {file.name}, which does not exist")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no safetensors weights ({SINGLE_FILE} or {INDEX_FILE})")
    return files


def safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (names, dtypes, shapes, data offsets, metadata), read from its
    8-byte length and the header alone: no tensor data is read."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        length = int.from_bytes(handle.read(8), "little") if size >= 8 else -1
        if not 0 <= length <= min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(
                f"safetensors file {path} is truncated or corrupt: header length {length}, file size {size}"
            )
        return handle.read(length)
