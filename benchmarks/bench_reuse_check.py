"""The cost of the reuse check of a finished run's stage outputs (`Run.output_damage`, each stage's check: manifests by content hash,
the files they list by stat key, re-hashed only when the key changed) against each stage's own time.

    python benchmarks/bench_reuse_check.py RUN_DIR [--repeat 20]

For each record of RUN_DIR/run.json: the stage's own time (from its `running` to its `done` line in
RUN_DIR/logs/rank0.log, millisecond stamps; else run.json's started/finished, whole seconds), the check's
time with the files as written (a stat per file) and after a copy of the run directory (every stat key
changed: every file hashed again), and their ratios. Prints one JSON object. Records written before output
digests existed are checked by size only (noted as `digests: false`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

from puzzle.config import load_config
from puzzle.run import Run

_LINE = re.compile(r"^(\S+ \S+) INFO puzzle\.run: (?:round \d+: )?(\S+): (running|done)")


def stage_seconds(run_dir: Path) -> dict[str, float]:
    """{record name: seconds from its first `running` to the next `done`} from the log, else run.json."""
    seconds: dict[str, float] = {}
    started: dict[str, datetime] = {}
    log = run_dir / "logs" / "rank0.log"
    for line in log.read_text().splitlines() if log.is_file() else []:
        match = _LINE.match(line)
        if match is None or match[2] in seconds:
            continue
        stamp = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f")
        if match[3] == "running":
            started[match[2]] = stamp
        elif match[2] in started:
            seconds[match[2]] = (stamp - started[match[2]]).total_seconds()
    for name, record in json.loads((run_dir / "run.json").read_text())["stages"].items():
        if name not in seconds and record.get("finished") and record.get("started"):
            span = datetime.fromisoformat(record["finished"]) - datetime.fromisoformat(record["started"])
            seconds[name] = span.total_seconds()
    return seconds


def check_seconds(run_dir: Path, repeat: int, fresh: bool = False) -> dict[str, float]:
    """{record name: median seconds of `Run.output_damage` of its recorded outputs} (each must find no damage).
    `fresh`: a new Run per call, so that files whose stat key changed are hashed each time (the first
    check after a copy; later ones find them in RUN_DIR/outputs_hash.json, which the check alone does not
    write); else one Run, as a rerun checks."""
    config = load_config(run_dir / "run.resolved.yaml")
    run = Run(run_dir, config)
    times: dict[str, float] = {}
    for name, record in run.manifest()["stages"].items():
        samples = []
        for _ in range(repeat):
            if fresh:
                run = Run(run_dir, config)
            begun = time.perf_counter()
            reason = run.output_damage(name, record["outputs"])
            samples.append(time.perf_counter() - begun)
            if reason is not None:
                raise SystemExit(f"{name}: {reason}")
        times[name] = statistics.median(samples)
    return times


def has_digests(run_dir: Path, name: str, outputs: dict) -> bool:
    stage = name.split("/", 1)[0]
    if stage in ("importance", "library", "scores"):
        return "digests" in json.loads((run_dir / stage / f"{stage}.manifest.json").read_text())
    if stage == "distill":
        return all(
            "digests" in json.loads((run_dir / "children" / n / "gkd.manifest.json").read_text())
            for n in outputs
        )
    if stage == "export":
        return all("files" in entry for entry in outputs.values())
    return True  # solutions, frontier: small files compared by content hash


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    run_dir = args.run_dir.absolute()
    own = stage_seconds(run_dir)
    as_written = check_seconds(run_dir, args.repeat)
    with tempfile.TemporaryDirectory() as scratch:
        copied = Path(scratch) / "run"
        shutil.copytree(run_dir, copied)  # new inodes and ctimes: every stat key changed
        copied_times = check_seconds(copied, args.repeat, fresh=True)
    records = json.loads((run_dir / "run.json").read_text())["stages"]
    report = {}
    for name, seconds in own.items():
        if name not in as_written:
            continue
        report[name] = {
            "stage_s": round(seconds, 3),
            "check_s": round(as_written[name], 6),
            "check_after_copy_s": round(copied_times[name], 6),
            "ratio": round(as_written[name] / seconds, 6) if seconds else None,
            "ratio_after_copy": round(copied_times[name] / seconds, 6) if seconds else None,
            "digests": has_digests(run_dir, name, records[name]["outputs"]),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
