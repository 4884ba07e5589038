"""`puzzle.artifacts.fingerprint_checkpoint`: a parent's fingerprint from its files (headers, sizes, a content
hash computed once and cached per file), a rewrite in place detected, a cached call reading no tensor data,
and 2 gloo ranks hashing their shares to the same fingerprint as one process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from gloo_helpers import gloo_rank, spawn_ranks

from puzzle.artifacts import checkpoint_hashes, fingerprint_checkpoint, read_hash_cache
from puzzle.model import HybridLM
from puzzle.nemotron_h.weights import weight_files
from puzzle.spec import AttentionSpec, MambaSpec, MLPSpec, ModelSpec

SPEC = ModelSpec(
    vocab_size=64,
    hidden_size=32,
    blocks=(
        MambaSpec(num_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=8),
        MLPSpec(width=48),
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
    ),
)
CHUNK = 4096  # small chunks: several per file, dealt over the ranks


def _checkpoint(path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    HybridLM(SPEC).save_pretrained(path, max_shard_bytes=20_000)  # a few shard files
    return path


class Counter:
    """Bytes of file data the hasher read (its `on_read` hook)."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self, count: int) -> None:
        self.bytes += count


def _data_offset(file: Path) -> tuple[str, int, int]:
    """(name, absolute byte offset, byte length) of the largest tensor of a safetensors file."""
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    name, entry = max(
        ((k, v) for k, v in header.items() if k != "__metadata__"),
        key=lambda item: item[1]["data_offsets"][1] - item[1]["data_offsets"][0],
    )
    begin, end = entry["data_offsets"]
    return name, 8 + length + begin, end - begin


def _rewrite_in_place(file: Path, restore_mtime: bool) -> None:
    """Change one tensor's bytes in place: same size, same inode; optionally the old mtime put back."""
    before = file.stat()
    _, offset, length = _data_offset(file)
    with open(file, "r+b") as handle:
        handle.seek(offset)
        old = handle.read(length)
        handle.seek(offset)
        handle.write(bytes(b ^ 0xFF for b in old))
    if restore_mtime:
        os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = file.stat()
    assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
    assert restore_mtime == (after.st_mtime_ns == before.st_mtime_ns)


def test_the_fingerprint_is_of_the_files_contents(tmp_path):
    first = _checkpoint(tmp_path / "a")
    assert len(weight_files(first)) > 1
    counter = Counter()
    fingerprint = fingerprint_checkpoint(first, tmp_path / "a.json", chunk_bytes=CHUNK, on_read=counter)
    weights = sum(file.stat().st_size for file in weight_files(first))
    assert counter.bytes == weights + (first / "config.json").stat().st_size  # every byte, once
    # A copy elsewhere (another path, inode, mtime) has the same fingerprint; another model does not.
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in first.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    assert fingerprint_checkpoint(copy, chunk_bytes=CHUNK) == fingerprint
    assert fingerprint_checkpoint(_checkpoint(tmp_path / "b", seed=1), chunk_bytes=CHUNK) != fingerprint


def test_a_cached_call_reads_no_tensor_data(tmp_path):
    folder = _checkpoint(tmp_path / "parent")
    cache = tmp_path / "run" / "parent_hash.json"
    fingerprint = fingerprint_checkpoint(folder, cache, chunk_bytes=CHUNK)
    assert cache.is_file() and len(read_hash_cache(cache)["files"]) == len(weight_files(folder)) + 1
    written = cache.stat().st_mtime_ns
    counter = Counter()
    assert fingerprint_checkpoint(folder, cache, chunk_bytes=CHUNK, on_read=counter) == fingerprint
    assert counter.bytes == 0
    assert cache.stat().st_mtime_ns == written  # an unchanged cache is not rewritten
    # Without the cache every byte is read again.
    assert fingerprint_checkpoint(folder, chunk_bytes=CHUNK, on_read=counter) == fingerprint
    assert counter.bytes > 0


@pytest.mark.parametrize("restore_mtime", [False, True], ids=["new-mtime", "mtime-set-back"])
def test_a_tensor_rewritten_in_place_changes_the_fingerprint_despite_the_cache(tmp_path, restore_mtime):
    folder = _checkpoint(tmp_path / "parent")
    cache = tmp_path / "parent_hash.json"
    before = fingerprint_checkpoint(folder, cache, chunk_bytes=CHUNK)
    file = weight_files(folder)[0]
    _rewrite_in_place(file, restore_mtime)
    counter = Counter()
    after = fingerprint_checkpoint(folder, cache, chunk_bytes=CHUNK, on_read=counter)
    assert after != before
    assert counter.bytes == file.stat().st_size  # only the changed file is read again
    # The new cache describes the new contents: the uncached fingerprint agrees.
    assert fingerprint_checkpoint(folder, chunk_bytes=CHUNK) == after


def test_a_foreign_or_damaged_cache_is_not_trusted(tmp_path):
    folder = _checkpoint(tmp_path / "parent")
    want, cache = checkpoint_hashes(folder, chunk_bytes=CHUNK)
    lying = json.loads(json.dumps(cache))
    for entry in lying["files"].values():
        entry["content"] = "0" * 64
    lying["chunk_bytes"] = CHUNK * 2  # made with other chunks: unusable
    assert checkpoint_hashes(folder, lying, chunk_bytes=CHUNK)[0] == want
    path = tmp_path / "parent_hash.json"
    path.write_text("{not json")
    assert fingerprint_checkpoint(folder, path, chunk_bytes=CHUNK) == want
    assert read_hash_cache(path) == cache


def _worker(rank: int, world: int, port: int, root: str) -> None:
    counter = Counter()
    with gloo_rank(rank, world, port):
        fingerprint = fingerprint_checkpoint(
            Path(root) / "parent", Path(root) / "cache.json", chunk_bytes=CHUNK, on_read=counter
        )
    (Path(root) / f"rank{rank}.json").write_text(json.dumps([fingerprint, counter.bytes]))


@pytest.mark.slow
def test_two_gloo_ranks_hash_their_shares_to_the_fingerprint_of_one_process(tmp_path):
    folder = _checkpoint(tmp_path / "parent")
    want = fingerprint_checkpoint(folder, chunk_bytes=CHUNK)
    spawn_ranks(_worker, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [fingerprint for fingerprint, _ in results] == [want, want]
    total = sum(file.stat().st_size for file in [folder / "config.json", *weight_files(folder)])
    read = [count for _, count in results]
    assert sum(read) == total and all(0 < count < 0.75 * total for count in read)  # each its share
    assert read_hash_cache(tmp_path / "cache.json") is not None  # written by rank 0
