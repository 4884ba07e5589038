"""run.json, a run's ledger: one record per stage (or STAGE/SOLUTION) with its inputs' hash, its status and
its outputs, and the one reuse rule (`Ledger.run`; `puzzle.run.api`'s docstring states it).

A finished record of the same inputs is reused while its outputs are intact on disk (each stage declares its
check, built from the ledger's: `manifest_damage`, a stage's manifest by content hash and the files it lists
by stat key, re-hashed when the key changed; `file_damage`, a small file by content hash; `export_damage`, an
export's files against the digests its record holds), else its work runs and the record is rewritten.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from puzzle import dist, gathers, shard
from puzzle.artifacts import (
    damaged_files,
    fingerprint_file,
    fingerprint_json,
    manifest_damage,
    manifest_fingerprint,
    read_hash_cache,
    write_hash_cache,
)
from puzzle.checkpoint_files import safetensors_header
from puzzle.files import atomic_write_bytes
from puzzle.layout import RunLayout

MANIFEST_FORMAT = 1
DONE = ("done", "reused")
# RUN_DIR's record of output files hashed again since written (`Ledger.hashes`), beside parent_hash.json.
OUTPUTS_HASH_FILE = "outputs_hash.json"

# The run's progress lines (`NAME: running`, `done`, `reused`) keep the run's logger: users filter on it and
# benchmarks/bench_reuse_check.py reads them from the log.
_log = logging.getLogger("puzzle.run")


class RunError(ValueError):
    """A run directory that cannot be used for this run (another parent, a malformed manifest)."""


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (ru_maxrss is in KiB on Linux; a running maximum)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_device_peak() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def stage_measurement(seconds: float, cpu_seconds: float | None = None) -> dict[str, Any]:
    """What a stage that ran cost, for run.json (collective: every rank calls it): `seconds` of wall time on
    rank 0, `cpu_seconds` of CPU time rank 0's process used meanwhile (every thread's; on a CPU shared with
    other jobs, what the stage would take alone at one thread, which `puzzle plan` prices), the ranks, each rank's peak resident memory (MiB: the process's running peak, ru_maxrss, so a
    later stage's is at least an earlier one's) and, on CUDA, each rank's peak allocated memory in this stage
    (MiB). `puzzle report` sets them beside the plan's (`puzzle.plan`)."""
    import torch

    own: dict[str, float] = {"rss": round(peak_rss_mib(), 1)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        own["cuda"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    ranks = dist.all_gather_object(own)
    measured: dict[str, Any] = {
        "seconds": round(seconds, 3),
        **({} if cpu_seconds is None else {"cpu_seconds": round(cpu_seconds, 3)}),
        "ranks": len(ranks),
        "peak_rss_mib": [rank["rss"] for rank in ranks],
    }
    if all("cuda" in rank for rank in ranks):
        measured["peak_cuda_mib"] = [rank["cuda"] for rank in ranks]
    return measured


def truncated_safetensors(path: Path) -> str | None:
    """Why safetensors file `path` is not whole (a header that does not parse, or a size other than its
    header's tensors end at), or None: the check of export files recorded before their digests were."""
    try:
        header = safetensors_header(path)
        entries = json.loads(header)
        end = max((e["data_offsets"][1] for k, e in entries.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{path} is not a whole safetensors file ({error})"
    size = path.stat().st_size
    return (
        None
        if size == 8 + len(header) + end
        else f"{path} has {size} bytes, its header says {8 + len(header) + end}"
    )


class Ledger:
    """run.json of the run directory `layout`, and the reuse rule over its records. `label`: what the
    progress lines start with (`round 2: ` in an iterative run)."""

    def __init__(self, layout: RunLayout, label: str = "") -> None:
        self.layout = layout
        self.label = label
        self._output_hashes: dict[str, Any] | None = None  # `hashes`

    def manifest(self) -> dict[str, Any]:
        """run.json as it is on disk (an empty manifest before the first stage)."""
        path = self.layout.manifest
        if not path.is_file():
            return {"format": MANIFEST_FORMAT, "stages": {}}
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise RunError(f"{path} is not a run manifest: {error}") from None
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or "stages" not in data:
            raise RunError(f"{path} is not a run manifest of format {MANIFEST_FORMAT}")
        return data

    def write(self, data: dict[str, Any]) -> None:
        """run.json := `data` (rank 0, atomically)."""
        if dist.is_main():
            atomic_write_bytes(self.layout.manifest, (json.dumps(data, indent=2) + "\n").encode())

    def update(self, stage: str, record: dict[str, Any]) -> None:
        """run.json's record `stage` := `record`."""
        data = self.manifest()
        data["stages"][stage] = record
        self.write(data)

    def run(
        self,
        name: str,
        inputs: dict[str, Any],
        compute: Callable[[], dict[str, Any]],
        damage: Callable[[dict[str, Any]], str | None],
        resumed: Callable[[], list[str]] = list,
    ) -> dict[str, Any]:
        """Record `name` (a stage, or STAGE/SOLUTION): reused when a finished record of the same inputs
        exists and `damage(its outputs)` finds them unchanged on disk (None; else why not, e.g. the first
        damaged file: the stage declares how its outputs are checked, from this ledger's checks), else
        `compute()` and record it; returns its outputs."""
        key = fingerprint_json(inputs)
        record = dist.broadcast_object(self.manifest()["stages"].get(name))
        if (
            record is not None
            and record.get("status") in DONE
            and record.get("inputs_hash") == key
            and dist.broadcast_object(self.intact(name, record["outputs"], damage))
        ):
            _log.info("%s%s: reused (inputs unchanged)", self.label, name)
            _log.info("%s: peak resident memory %.1f MiB", name, peak_rss_mib())
            self.update(name, {**record, "status": "reused", "checked": now()})
            dist.barrier()
            return record["outputs"]
        _log.info("%s%s: running", self.label, name)
        shard.free_dropped_units()  # an earlier stage's sharded modules, dropped but not yet collected
        gathers.COUNTER.reset_peak()
        _reset_device_peak()
        clock, cpu_clock = time.perf_counter(), time.process_time()
        started = now()
        running = {"status": "running", "inputs_hash": key, "inputs": inputs, "started": started}
        self.update(name, running)
        try:
            outputs = compute()
        except BaseException as error:
            self.update(name, {**running, "status": "failed", "error": f"{type(error).__name__}: {error}"})
            raise
        outputs = dist.broadcast_object(outputs)
        shard.free_dropped_units()
        measured = stage_measurement(time.perf_counter() - clock, time.process_time() - cpu_clock)
        finished = {**running, "status": "done", "finished": now(), "measured": measured, "outputs": outputs}
        self.update(name, finished)
        dist.barrier()
        units = resumed()
        note = f" (resumed from a checkpoint: {', '.join(units)})" if units else ""
        _log.info("%s%s: done%s", self.label, name, note)
        _log.info("%s: peak resident memory %.1f MiB", name, peak_rss_mib())  # benchmarks/bench_scale.py
        if gathers.COUNTER.peak or dist.world_size() > 1:  # 0 says nothing in one unsharded process
            _log.info(  # whole tensors gathered from shards, held at once (tests/test_shard_memory.py)
                "%s: peak gathered parameter elements %d", name, gathers.COUNTER.peak
            )
        return outputs

    def intact(
        self, name: str, outputs: dict[str, Any], damage: Callable[[dict[str, Any]], str | None]
    ) -> bool:
        """Whether the recorded outputs of record `name` (a stage or STAGE/SOLUTION) are on disk, unchanged
        (`damage(outputs)` is None); why not is logged."""
        known = len(self.hashes())
        reason = damage(outputs)
        if len(self.hashes()) != known and dist.is_main():  # files re-hashed: their keys kept for next time
            write_hash_cache(self.layout.root / OUTPUTS_HASH_FILE, {"files": self.hashes()})
        if reason is not None:
            _log.info("%s%s: not reused: %s", self.label, name, reason)
        return reason is None

    # The checks a stage's outputs are made of (each stage module's `damage` picks its own).

    def manifest_damage(self, path: Path, fingerprint: str) -> str | None:
        """Why the stage manifest at `path` (recorded with content hash `fingerprint`) or the files it lists
        are not as written, or None: the manifest by content hash, then its outputs against it
        (`puzzle.artifacts.manifest_damage`: a stat per file while its stat key is the one recorded when it
        was written, a re-hash when it changed)."""
        if not path.is_file() or manifest_fingerprint(path) != fingerprint:
            return f"{path} is missing or was changed"
        return manifest_damage(path, self.hashes())

    @staticmethod
    def file_damage(path: Path, fingerprint: str) -> str | None:
        """Why a small output file (a solution, the frontier) is not the one recorded by content hash, or None."""
        if not path.is_file() or fingerprint_file(path) != fingerprint:
            return f"{path} is missing or was changed"
        return None

    def export_damage(self, entry: Mapping[str, Any]) -> str | None:
        """Why an export record's checkpoint is not as written (the export stage recorded its files), or None."""
        folder = self.layout.root / entry["path"]
        files = entry.get("files")
        if files is None:  # recorded before its files' digests were: their presence and whole weight files
            if not (folder / "config.json").is_file():
                return f"{folder / 'config.json'} is missing"
            return next(filter(None, map(truncated_safetensors, sorted(folder.glob("*.safetensors")))), None)
        damaged = damaged_files(folder, dict.fromkeys(files), files, self.hashes())
        return next(iter(damaged.values()), None)

    def hashes(self) -> dict[str, Any]:
        """{resolved path: {"key", "sha256"}} of output files hashed again since written (`damaged_files`),
        from RUN_DIR/outputs_hash.json; `_present` writes it back when a check added to it."""
        if self._output_hashes is None:
            cached = read_hash_cache(self.layout.root / OUTPUTS_HASH_FILE)
            self._output_hashes = dict(cached["files"]) if cached is not None else {}
        return self._output_hashes
