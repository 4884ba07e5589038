"""Stage outputs in a run directory: a manifest per output, fingerprints of its inputs, atomic rank-0 writes, reuse.

A stage (importance, library, scores, search, distillation) writes its files through an `Artifact`: each
output file atomically (`puzzle.files.atomic_write`), then the manifest `<name>.manifest.json` last, so a
manifest on disk always describes complete files. The manifest records the format version of the stage's
files, what produced them (puzzle version and stage name), a fingerprint of every input (the parent, the
calibration tokens, the settings) and the output files with their sizes, and per file the sha256 of the
bytes written and its stat key (`_file_key`: size, mtime, ctime, inode, device). A stage asks
`load_if_current(inputs)` before working: the saved output is reused only when the manifest is readable,
its format version equals the stage's and every input fingerprint matches exactly (same names, same
values); otherwise it gets None and the reason is logged (`logging`, logger "puzzle.artifacts").

Decisions: a missing, unreadable or foreign manifest, or a listed output file that is damaged
(`damaged_outputs`: missing, another size, or other bytes than were written), makes `load_if_current`
answer None (the stage recomputes and overwrites: a stage output is
reproducible from its inputs, and a half-written or damaged one is worth nothing); reading an artifact
explicitly (`read_manifest`, `load_tensors`, `load_json`) instead raises an error naming the file.
`write` deletes the old manifest before touching any output, so a crash in the middle leaves no manifest
that describes half-replaced files.

The damage check costs a stat per file while files are as written: a file whose stat key is the recorded
one is trusted (any write changes its ctime, see `_file_key`); one whose key changed (rewritten, or the
directory copied) is hashed again and compared. Manifests written before digests were recorded list sizes
only: their files are checked by size (a same-size replacement goes unnoticed there), never recomputed
for that alone.

Under torch.distributed every rank makes the same calls with the same inputs (checked: unequal inputs
are an error naming the ranks and keys): rank 0 alone reads the manifest and broadcasts its decision, so
all ranks take the same branch; rank 0 alone writes while the others wait at a barrier, then they read the
manifest rank 0 wrote. The directory must be on a filesystem every rank sees.

Files are safetensors for tensors and JSON for everything else; nothing is ever pickled to disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from puzzle import __version__, dist, gathers
from puzzle.checkpoint_files import safetensors_header, weight_files
from puzzle.files import atomic_write, atomic_write_bytes
from puzzle.spec import BlockSpec, ModelSpec, block_to_dict

MANIFEST_VERSION = 1  # the layout of the manifest itself; a stage's files have their own `format`
MANIFEST_SUFFIX = ".manifest.json"
_CHUNK_BYTES = 1 << 20

_log = logging.getLogger(__name__)


class ArtifactError(ValueError):
    """An artifact file that exists but cannot be used (malformed, wrong layout, unreadable tensors)."""


# ----------------------------------------------------------------------------------------------------------
# Fingerprints: sha256 hex digests, equal on every rank and every machine for equal inputs.


def fingerprint_json(value: Any) -> str:
    """sha256 of `value` as canonical JSON (sorted keys, no spaces): for settings and config dicts.

    Raises TypeError for values JSON cannot represent (a config should be plain data).
    """
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint_spec(spec: ModelSpec | BlockSpec) -> str:
    """sha256 of a model's or a block's architecture (its JSON form)."""
    data = spec.to_dict() if isinstance(spec, ModelSpec) else block_to_dict(spec)
    return fingerprint_json(data)


def fingerprint_tensors(tensors: Iterable[torch.Tensor] | Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's dtype, shape and bytes, in order (a mapping: in sorted key order, keys included).

    For calibration token batches (a few MB: 1M int64 tokens are 8 MB, hashed in milliseconds). Tensors on
    a GPU are copied to the CPU first, so every rank and device gets the same digest for the same values;
    the order and the split into batches count (batches of another shape give another digest).
    """
    digest = hashlib.sha256()
    items = sorted(tensors.items()) if isinstance(tensors, Mapping) else enumerate(tensors)
    for key, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"fingerprint_tensors: item {key!r} is a {type(tensor).__name__}, not a tensor")
        digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(flat.view(torch.uint8).numpy().tobytes())  # via uint8: numpy has no bfloat16
    return digest.hexdigest()


def fingerprint_file(path: str | Path) -> str:
    """sha256 of a file's bytes (read in 1 MiB chunks): for token files, configs and other small inputs."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"cannot fingerprint {path}: no such file")
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint_model(model: torch.nn.Module) -> str:
    """sha256 of a model's spec and of a sample of every weight: enough to tell two parents apart cheaply.

    `model` has a `.spec` (a `HybridLM`). Per tensor: its name, shape, first 64 values and 64 values at an
    even stride, as fp32 (a full hash would read every weight of a 120B model; this reads a few hundred
    bytes per tensor). The same weights in another dtype give another fingerprint.
    """
    digest = hashlib.sha256(model.spec.to_json(indent=None).encode())
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):  # a sharded (FSDP2) model: the whole tensor, gathered on every rank
            tensor = gathers.track(tensor.full_tensor())
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // 64)
        sample = torch.cat([flat[:64], flat[::stride][:64]]).float().cpu().contiguous()
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------------------
# A checkpoint's fingerprint from its files: headers, sizes and a content hash computed once and cached.

CHECKPOINT_HASH_FORMAT = 1
HASH_CHUNK_BYTES = 64 << 20  # the unit of work of the parallel content hash (and of its reads)
_CONFIG_FILE = "config.json"


def _file_key(path: Path) -> dict[str, int]:
    """What identifies a file's current contents without reading it. The ctime too: a rewrite whose mtime
    is set back (os.utime) still changes it, and only the system clock can set it back."""
    stat = path.stat()
    return {
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
        "inode": stat.st_ino,
        "device": stat.st_dev,
    }


def _hash_range(path: Path, offset: int, length: int, on_read: Callable[[int], None] | None) -> bytes:
    """sha256 of `length` bytes of `path` from `offset`, read 1 MiB at a time (`on_read(bytes)` per read)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        handle.seek(offset)
        left = length
        while left > 0:
            chunk = handle.read(min(_CHUNK_BYTES, left))
            if not chunk:
                raise OSError(f"{path} ended at byte {offset + length - left}, expected {offset + length}")
            if on_read is not None:
                on_read(len(chunk))
            digest.update(chunk)
            left -= len(chunk)
    return digest.digest()


def _content_hashes(
    files: list[tuple[Path, int]], chunk_bytes: int, on_read: Callable[[int], None] | None
) -> list[str]:
    """sha256 of each (file, size)'s bytes as the hash of its `chunk_bytes` chunks' digests, in order.

    Under torch.distributed the chunks of all the files are numbered and dealt round-robin: each rank
    reads and hashes only its own (contiguous byte ranges), and the digests are all-gathered. The result
    does not depend on the world size: the same chunks, combined in chunk order.
    """
    chunks = [
        (number, offset, min(chunk_bytes, size - offset))
        for number, (_, size) in enumerate(files)
        for offset in range(0, size, chunk_bytes)
    ]
    mine = {
        index: _hash_range(files[number][0], offset, length, on_read)
        for index, (number, offset, length) in dist.shard(enumerate(chunks))
    }
    digests: dict[int, bytes] = {}
    for gathered in dist.all_gather_object(mine):
        digests.update(gathered)
    combined = [hashlib.sha256(f"{size}|{chunk_bytes}|".encode()) for _, size in files]
    for index, (number, _, _) in enumerate(chunks):
        combined[number].update(digests[index])
    return [digest.hexdigest() for digest in combined]


def checkpoint_hashes(
    folder: str | Path,
    cached: Mapping[str, Any] | None = None,
    *,
    chunk_bytes: int = HASH_CHUNK_BYTES,
    on_read: Callable[[int], None] | None = None,
) -> tuple[str, dict[str, Any]]:
    """(fingerprint, cache) of checkpoint `folder`: see `fingerprint_checkpoint`, which reads and writes the
    cache; here `cached` is a cache as returned before (or None) and the new one is returned unwritten.

    Collective under torch.distributed: rank 0 decides which files need hashing (its stat and cache),
    every rank hashes its share of them.
    """
    folder = Path(folder)
    files = [folder / _CONFIG_FILE, *weight_files(folder)]
    if not files[0].is_file():
        raise FileNotFoundError(f"cannot fingerprint checkpoint {folder}: it has no {_CONFIG_FILE}")
    cached = dict(cached or {})
    usable = cached.get("format") == CHECKPOINT_HASH_FORMAT and cached.get("chunk_bytes") == chunk_bytes
    entries: dict[str, Any] = dict(cached.get("files", {})) if usable else {}
    keys = {str(path.resolve()): _file_key(path) for path in files}
    stale = [name for name, key in keys.items() if entries.get(name, {}).get("key") != key]
    stale, keys, entries = dist.broadcast_object((stale, keys, entries))  # rank 0's view decides
    hashed = _content_hashes([(Path(name), keys[name]["size"]) for name in stale], chunk_bytes, on_read)
    entries = {name: entries[name] for name in keys if name not in stale}
    entries.update({name: {"key": keys[name], "content": digest} for name, digest in zip(stale, hashed)})
    digest = hashlib.sha256(b"puzzle checkpoint fingerprint 1\n")
    digest.update(files[0].read_bytes())
    for path in files[1:]:
        name = str(path.resolve())
        header = safetensors_header(path)
        digest.update(f"{path.name}|{keys[name]['size']}|{len(header)}|".encode())
        digest.update(header)
        digest.update(entries[name]["content"].encode())
    cache = {"format": CHECKPOINT_HASH_FORMAT, "chunk_bytes": chunk_bytes, "files": entries}
    return digest.hexdigest(), cache


def read_hash_cache(path: str | Path) -> dict[str, Any] | None:
    """A cache `checkpoint_hashes` returned, as written to `path`; None when absent or unreadable (then
    every file is hashed again: a cache is never trusted beyond its per-file keys)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def write_hash_cache(path: str | Path, cache: Mapping[str, Any]) -> None:
    """Write `cache` to `path` atomically on rank 0, unless it is there already (a rerun writes nothing)."""
    if dist.is_main() and read_hash_cache(path) != cache:
        atomic_write_bytes(path, (json.dumps(cache, indent=2, sort_keys=True) + "\n").encode())


def fingerprint_checkpoint(
    folder: str | Path,
    cache: str | Path | None = None,
    *,
    chunk_bytes: int = HASH_CHUNK_BYTES,
    on_read: Callable[[int], None] | None = None,
) -> str:
    """sha256 of a checkpoint directory: its config.json, and per safetensors file (`weight_files`) its
    name, size, header (tensor names, dtypes, shapes, offsets) and a content hash of all its bytes.

    The content hash reads every byte once: in parallel under torch.distributed (each rank its share of
    `chunk_bytes` chunks, `_content_hashes`; the same result at any world size) and cached in the JSON file
    `cache` (e.g. RUN_DIR/parent_hash.json, written atomically by rank 0), per file under its resolved
    path with its size, mtime, ctime, inode and device. A file whose key is unchanged is not read again
    (its header is: it is small); any write to a file changes its ctime, so a file rewritten in place,
    even with its size and mtime put back, is hashed again. `on_read(bytes)` is called per read of file
    data (a test hook). Collective under torch.distributed (every rank calls it with the same arguments).
    """
    cached = read_hash_cache(cache) if cache is not None and dist.is_main() else None
    fingerprint, new = checkpoint_hashes(folder, cached, chunk_bytes=chunk_bytes, on_read=on_read)
    if cache is not None:
        write_hash_cache(cache, new)
        dist.barrier()
    return fingerprint


def loaded_fingerprint(checkpoint: str, dtype: torch.dtype) -> str:
    """The fingerprint of a model loaded in `dtype` (that of its embeddings) from a checkpoint of
    fingerprint `checkpoint` (`fingerprint_checkpoint`): how `puzzle.Run` keys the stages by their parent
    without reading its weights."""
    return fingerprint_json({"checkpoint": checkpoint, "dtype": str(dtype)})


# ----------------------------------------------------------------------------------------------------------
# Writers for `Artifact.write`: each takes the temporary path to write to.


def safetensors_writer(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> Callable[[str], None]:
    """A writer of `tensors` (name -> tensor, any device) as one safetensors file."""
    contiguous = {name: value.detach().contiguous() for name, value in tensors.items()}
    return lambda path: save_file(contiguous, path, metadata=dict(metadata) if metadata else None)


def json_writer(value: Any) -> Callable[[str], None]:
    """A writer of `value` as indented JSON."""
    text = json.dumps(value, indent=2)
    return lambda path: Path(path).write_text(text + "\n")


# ----------------------------------------------------------------------------------------------------------
# Manifest and artifact.


@dataclass(frozen=True)
class Manifest:
    """What a stage wrote: `stage` and its files' `format` version, the `inputs` fingerprints they were made
    from, `outputs` (file name relative to the directory -> size in bytes), the `puzzle_version` that wrote
    them, `created` (UTC, ISO 8601) and `info` (the stage's own small facts, e.g. token counts; JSON). On
    disk the producer is written as {"puzzle": version, "stage": stage}."""

    stage: str
    format: int
    inputs: dict[str, str]
    outputs: dict[str, int]
    puzzle_version: str = __version__
    created: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    # output -> {"sha256": digest of the bytes written, "key": their `_file_key`}; empty in older manifests.
    digests: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = {
            "manifest": MANIFEST_VERSION,
            "stage": self.stage,
            "format": self.format,
            "producer": {"puzzle": self.puzzle_version, "stage": self.stage},
            "created": self.created,
            "inputs": dict(self.inputs),
            "outputs": dict(self.outputs),
            "info": self.info,
        }
        if self.digests:
            data["digests"] = dict(self.digests)
        return data

    @classmethod
    def from_dict(cls, data: Any, source: str) -> Manifest:
        """Parse and validate; errors (ArtifactError) name `source` and the offending key."""
        if not isinstance(data, dict):
            raise ArtifactError(f"{source}: a manifest is a JSON object, found {type(data).__name__}")
        if data.get("manifest") != MANIFEST_VERSION:
            raise ArtifactError(
                f"{source}: manifest layout {data.get('manifest')!r}, expected {MANIFEST_VERSION} "
                "(not written by this version of puzzle's artifacts)"
            )
        expected = {"stage": str, "format": int, "producer": dict, "created": str, "inputs": dict}
        expected |= {"outputs": dict, "info": dict}
        for key, kind in expected.items():
            if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
                found = type(data[key]).__name__ if key in data else "nothing"
                raise ArtifactError(f"{source}: key {key!r} should be a {kind.__name__}, found {found}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["inputs"].items()):
            raise ArtifactError(f"{source}: 'inputs' should map names to fingerprint strings")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in data["outputs"].values()):
            raise ArtifactError(f"{source}: 'outputs' should map file names to sizes in bytes")
        digests = data.get("digests", {})
        if not isinstance(digests, dict) or not all(_is_digest(v) for v in digests.values()):
            raise ArtifactError(f"{source}: 'digests' should map file names to {{'sha256', 'key'}} objects")
        return cls(
            stage=data["stage"],
            format=data["format"],
            inputs=dict(data["inputs"]),
            outputs=dict(data["outputs"]),
            puzzle_version=str(data["producer"].get("puzzle", "unknown")),
            created=data["created"],
            info=data["info"],
            digests=dict(digests),
        )


def _is_digest(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("sha256"), str)
        and isinstance(value.get("key"), dict)
    )


def file_digest(path: str | Path) -> dict[str, Any]:
    """{"sha256", "key"} of a file just written: its bytes' digest and its stat key (`_file_key`), taken
    before the read, so a write racing the hash changes the key and the file is hashed again when checked."""
    path = Path(path)
    key = _file_key(path)
    return {"sha256": fingerprint_file(path), "key": key}


def file_damage(path: Path, size: int | None, digest: Mapping[str, Any] | None) -> str | None:
    """Why file `path` is not the one recorded (a sentence), or None when it is. `size`: the recorded size
    (None: take the digest's key's); `digest`: a `file_digest` recorded when it was written (None: an older
    record, checked by size only). A file whose stat key is the recorded one is trusted without a read."""
    return _check_file(path, size, digest)


def _check_file(
    path: Path,
    size: int | None,
    digest: Mapping[str, Any] | None,
    cache: dict[str, Any] | None = None,
) -> str | None:
    """`file_damage`, with `cache` ({resolved path: {"key", "sha256"}}, see `damaged_files`) consulted
    before a file whose stat key changed is hashed again, and told what an intact re-hashed file's key is."""
    if not path.is_file():
        return f"{path} is missing"
    key = _file_key(path)  # before the read: a write racing the hash changes the key again
    if size is None and digest is not None:
        size = digest["key"].get("size")
    if size is not None and key["size"] != size:
        return f"{path} has {key['size']} bytes, {size} were written"
    if digest is None or digest["key"] == key:
        return None
    known = None if cache is None else cache.get(str(path.resolve()))
    if known is not None and known.get("key") == key and known.get("sha256") == digest["sha256"]:
        return None
    if fingerprint_file(path) != digest["sha256"]:
        return f"{path} has other bytes than were written (same size, another sha256)"
    if cache is not None:
        cache[str(path.resolve())] = {"key": key, "sha256": digest["sha256"]}
    return None


def damaged_files(
    directory: Path,
    sizes: Mapping[str, int | None],
    digests: Mapping[str, Any],
    cache: dict[str, Any] | None = None,
) -> dict[str, str]:
    """{file: why} of the files `sizes` lists (relative to `directory`) that are damaged (`file_damage`).

    `cache`: {resolved path: {"key", "sha256"}} of files hashed again since they were written (their stat
    key changed: copied, or touched, with the same bytes); consulted and filled, so that the caller can keep
    it (`puzzle.Run` keeps RUN_DIR/outputs_hash.json, as the parent's content hashes are kept) and the next
    check of such a file is a stat again, the manifests themselves never rewritten by a check."""
    found = {}
    for name, size in sizes.items():
        reason = _check_file(directory / name, size, digests.get(name), cache)
        if reason is not None:
            found[name] = reason
    return found


def manifest_damage(path: str | Path, cache: dict[str, Any] | None = None) -> str | None:
    """Why the outputs of the manifest at `path` are not as written (the first damaged file; `file_damage`),
    or why the manifest itself is unusable; None when all is well (`cache`: see `damaged_files`). For
    `puzzle.Run`'s reuse check, which knows a stage's manifest by its path only."""
    path = Path(path)
    try:
        manifest = Manifest.from_dict(json.loads(path.read_text()), str(path))
    except (OSError, ValueError) as error:
        return f"unusable manifest {path}: {error}"
    damaged = damaged_files(path.parent, manifest.outputs, manifest.digests, cache)
    return next(iter(damaged.values()), None)


def manifest_fingerprint(path: str | Path) -> str:
    """What a manifest says about its stage's output, as a sha256: how `puzzle.Run` keys the stages
    downstream of it. A manifest with digests: its content less the time it was written and the files' stat
    keys, so a stage redone into the same bytes (a damaged file repaired) keeps its fingerprint and nothing
    downstream is redone. One without digests (written before them): `fingerprint_file`, as recorded then."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("digests"), dict):
        return fingerprint_file(path)
    content = {key: value for key, value in data.items() if key != "created"}
    content["digests"] = {
        name: entry.get("sha256") if isinstance(entry, dict) else entry
        for name, entry in data["digests"].items()
    }
    return fingerprint_json(content)


class DamagedOutputError(ArtifactError):
    """A finished output whose damaged file cannot be redone on its own; `path` names the file."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


def _check_output_name(name: str) -> None:
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or name.endswith(MANIFEST_SUFFIX):
        raise ValueError(
            f"artifact output {name!r}: expected a relative path inside the artifact's directory "
            f"(no '..', not ending in {MANIFEST_SUFFIX})"
        )


@dataclass(frozen=True)
class Artifact:
    """The output of one stage, `name`, in `directory`, whose files have layout version `format`.

    The manifest is `directory / f"{name}.manifest.json"`; the outputs are files in `directory` (relative
    paths, subfolders allowed). Bump `format` whenever the files' layout or meaning changes: older outputs
    are then recomputed instead of misread.
    """

    directory: Path
    name: str
    format: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", Path(self.directory))

    @property
    def manifest_path(self) -> Path:
        return self.directory / f"{self.name}{MANIFEST_SUFFIX}"

    def path(self, output: str) -> Path:
        """Where output file `output` lives."""
        _check_output_name(output)
        return self.directory / output

    def read_manifest(self) -> Manifest:
        """The manifest on disk, on this rank; FileNotFoundError or ArtifactError naming the file if unusable
        (missing, not JSON, another layout, another stage, another format version)."""
        path = self.manifest_path
        if not path.is_file():
            raise FileNotFoundError(f"{self.name} manifest {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ArtifactError(f"{path} is not valid JSON: {error}") from error
        manifest = Manifest.from_dict(data, str(path))
        if manifest.stage != self.name:
            raise ArtifactError(f"{path}: written by stage {manifest.stage!r}, expected {self.name!r}")
        if manifest.format != self.format:
            raise ArtifactError(f"{path}: {self.name} format {manifest.format}, expected {self.format}")
        return manifest

    def why_not_current(self, inputs: Mapping[str, str]) -> str | None:
        """Why the saved output cannot be reused for `inputs` (a sentence for logs), or None if it can.

        Reads only this rank's view of the directory; `load_if_current` is the collective version.
        """
        try:
            manifest = self.read_manifest()
        except FileNotFoundError:
            return f"no manifest {self.manifest_path}"
        except ArtifactError as error:
            return f"unusable manifest: {error}"
        if manifest.inputs != dict(inputs):
            changed = sorted(
                key
                for key in set(manifest.inputs) | set(inputs)
                if manifest.inputs.get(key) != inputs.get(key)
            )
            return f"{self.manifest_path} was made from other inputs: {', '.join(changed)} differ"
        for output, reason in self.damaged_outputs(manifest).items():
            if not (self.directory / output).is_file():
                return f"output {self.directory / output} listed in {self.manifest_path} is missing"
            return f"output {reason} (listed in {self.manifest_path})"
        return None

    def damaged_outputs(self, manifest: Manifest | None = None) -> dict[str, str]:
        """{output: why} of the outputs `manifest` (default: the one on disk) lists that are missing, of
        another size or of other bytes than were written (`file_damage`); empty when all are intact."""
        manifest = self.read_manifest() if manifest is None else manifest
        return damaged_files(self.directory, manifest.outputs, manifest.digests)

    def damaged_if_current(self, inputs: Mapping[str, str]) -> dict[str, str] | None:
        """{output: why} of the damaged outputs of a manifest made from exactly `inputs` (empty: none is
        damaged); None when there is no usable manifest of those inputs. What a stage that can redo part
        of its output asks after `load_if_current` said no. Collective: rank 0 decides."""
        inputs = dict(inputs)
        decision = None
        if dist.is_main():
            try:
                manifest = self.read_manifest()
            except (FileNotFoundError, ArtifactError):
                manifest = None
            if manifest is not None and manifest.inputs == inputs:
                decision = self.damaged_outputs(manifest)
        return dist.broadcast_object(decision)

    def load_if_current(self, inputs: Mapping[str, str]) -> Manifest | None:
        """The saved manifest if it may be reused for `inputs` (exact match, see the module docstring), else None.

        Collective under torch.distributed: every rank calls it with equal `inputs` (an error otherwise);
        rank 0 decides and every rank gets its answer. The reason for a None is logged at INFO level.
        """
        inputs = dict(inputs)
        _same_on_every_rank(inputs, f"{self.name} inputs")
        if dist.is_main():
            reason = self.why_not_current(inputs)
            decision = (self.read_manifest() if reason is None else None, reason)
        else:
            decision = (None, None)
        manifest, reason = dist.broadcast_object(decision)
        if manifest is None and dist.is_main():
            # Not "recomputed": the stage may still resume from checkpoints of its own (and says so).
            _log.info("%s in %s: no finished output to reuse (%s)", self.name, self.directory, reason)
        return manifest

    def write(
        self,
        inputs: Mapping[str, str],
        outputs: Mapping[str, Callable[[str], None]],
        info: Mapping[str, Any] | None = None,
        keep: Iterable[str] = (),
    ) -> Manifest:
        """Write the stage's output: `outputs` maps a file name to a writer called with a temporary path;
        `keep` names outputs already in place, left untouched (a stage that redid part of its output):
        their digests are the old manifest's while their stat keys are unchanged.

        Rank 0 removes the old manifest, writes every output atomically, then the manifest; the other ranks
        wait, then read that manifest (an ArtifactError if it is missing or was made from other inputs, e.g.
        rank 0 failed). Collective under torch.distributed; returns the manifest on every rank.
        """
        inputs = dict(inputs)
        keep = list(keep)
        for output in [*outputs, *keep]:
            _check_output_name(output)
        info = dict(info or {})
        json.dumps(info)  # fail on every rank, before anything is written, if info is not JSON
        with dist.main_process_first():
            if dist.is_main():
                try:
                    old = self.read_manifest().digests if keep else {}
                except (FileNotFoundError, ArtifactError):
                    old = {}
                self.manifest_path.unlink(missing_ok=True)
                sizes, digests = {}, {}
                for output in keep:
                    path = self.directory / output
                    recorded = old.get(output)
                    current = recorded is not None and recorded["key"] == _file_key(path)
                    digests[output] = recorded if current else file_digest(path)
                for output, writer in outputs.items():
                    # Hashed as written: the read is cheap beside making the file, and makes the reuse
                    # check of every later run a stat while the file is untouched.
                    digests[output] = file_digest(atomic_write(self.directory / output, writer))
                for output in [*keep, *outputs]:
                    sizes[output] = digests[output]["key"]["size"]
                created = datetime.now(timezone.utc).isoformat(timespec="seconds")
                manifest = Manifest(
                    self.name, self.format, inputs, sizes, created=created, info=info, digests=digests
                )
                # The manifest goes last: its presence means the outputs it lists are complete.
                atomic_write(self.manifest_path, json_writer(manifest.to_dict()))
                return manifest
        try:
            manifest = self.read_manifest()
        except FileNotFoundError as error:
            raise ArtifactError(f"rank 0 did not write {self.manifest_path} (did it fail?)") from error
        if manifest.inputs != inputs:
            raise ArtifactError(
                f"{self.manifest_path} was not written for this rank's inputs (did rank 0 fail to write it?)"
            )
        return manifest

    def load_tensors(self, output: str) -> dict[str, torch.Tensor]:
        """Read a safetensors output (CPU tensors); errors name the file."""
        path = self.path(output)
        if not path.is_file():
            raise FileNotFoundError(f"{self.name} output {path} does not exist")
        try:
            return load_file(str(path))
        except Exception as error:  # safetensors raises its own types for truncated or corrupt files
            raise ArtifactError(f"cannot read {self.name} tensors {path}: {error}") from error

    def load_json(self, output: str) -> Any:
        """Read a JSON output; errors name the file."""
        path = self.path(output)
        if not path.is_file():
            raise FileNotFoundError(f"{self.name} output {path} does not exist")
        try:
            return json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ArtifactError(f"{path} is not valid JSON: {error}") from error


def _same_on_every_rank(value: Any, what: str) -> None:
    """Raise on every rank if the ranks passed different `value`s (a cheap all-gather of small objects)."""
    values = dist.all_gather_object(value)
    if any(other != values[0] for other in values[1:]):
        ranks = [rank for rank, other in enumerate(values) if other != values[0]]
        keys = []
        if isinstance(value, dict):
            keys = sorted({k for other in values for k in other if other.get(k) != values[0].get(k)})
        raise ValueError(
            f"{what} differ between rank 0 and rank(s) {ranks}"
            + (f" in {keys}" if keys else "")
            + ": every rank must pass the same inputs (e.g. the same calibration batches in the same order)"
        )
