"""benchmarks/run_all.py: the table row comes from the benchmark's JSON; a failing benchmark is reported, not lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """One quick run of the cheap `child` benchmark plus `cost_model` given an argument it rejects."""
    out = tmp_path_factory.mktemp("run_all")
    # An earlier run's JSON of a benchmark that `--only` leaves out: its rows must be kept, not dropped.
    kept = ROOT / "benchmarks" / "results" / "bench_remote_cache.json"
    (out / "bench_remote_cache.json").write_text(kept.read_text())
    done = subprocess.run(
        [
            *(
                sys.executable,
                str(ROOT / "benchmarks" / "run_all.py"),
                "--quick",
                "--only",
                "child",
                "cost_model",
            ),
            *("--args", "cost_model=--no-such-flag", "--results", str(out), "--doc", str(out / "PERF.md")),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, out


def table_rows(document: str, name: str) -> list[list[str]]:
    """The cells of the table rows of benchmark `name`."""
    rows = [line.strip("|").split(" | ") for line in document.splitlines() if line.startswith(f"| {name} |")]
    return [[cell.strip() for cell in row] for row in rows]


@pytest.mark.slow
def test_row_is_made_from_the_json(run: tuple[subprocess.CompletedProcess, Path]) -> None:
    _, out = run
    data = json.loads((out / "bench_child.json").read_text())
    (row,) = table_rows((out / "PERF.md").read_text(), "child")
    _, compared, ratio, goal, met, command = row
    assert f"measured {data['measured_speedup']:.2f}x" in compared
    assert f"predicts {data['predicted_speedup']:.2f}x" in compared
    assert ratio == f"{data['predicted_speedup'] / data['measured_speedup']:.2f}"
    assert met in ("yes", "**no**") and goal
    assert command == "`PYTHONPATH=.:benchmarks python benchmarks/bench_child.py --quick`"
    assert data["rows"]["child"]["blocks"][-1] == "noop"


@pytest.mark.slow
def test_failing_benchmark_is_reported_and_exit_is_nonzero(
    run: tuple[subprocess.CompletedProcess, Path],
) -> None:
    done, out = run
    assert done.returncode == 1, done.stdout + done.stderr
    document = (out / "PERF.md").read_text()
    (row,) = table_rows(document, "cost_model")
    assert row[1].startswith("failed: exit status 2") and "--no-such-flag" in row[1]
    assert len(table_rows(document, "child")) == 1  # the other benchmark's row is kept
    assert not (out / "bench_cost_model.json").exists()


@pytest.mark.slow
def test_only_keeps_the_rows_of_the_benchmarks_it_did_not_run(
    run: tuple[subprocess.CompletedProcess, Path],
) -> None:
    _, out = run
    data = json.loads((out / "bench_remote_cache.json").read_text())
    document = (out / "PERF.md").read_text()
    rows = table_rows(document, "remote_cache")
    assert [row[2] for row in rows] == [f"{r['speedup']:.1f}x" for r in data["rows"]]
    assert "rows kept from their earlier JSON: remote_cache (" in document
    assert "### remote_cache (kept from the run of " in document
    assert not table_rows(document, "gkd_checkpointing")  # no JSON in the folder: no row, no failure


def test_a_quick_run_does_not_replace_the_full_document(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run_all
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    before = (ROOT / "docs" / "PERFORMANCE.md").read_bytes()
    # gpu_check is skipped without CUDA, so this runs no benchmark; on a GPU machine it is skipped here.
    if run_all.machine_info()["cuda"]:
        pytest.skip("gpu_check would run on this machine")
    assert run_all.main(["--quick", "--only", "gpu_check", "--results", str(tmp_path)]) == 0
    assert (tmp_path / "PERFORMANCE.md").read_text().startswith("# Performance")
    assert (ROOT / "docs" / "PERFORMANCE.md").read_bytes() == before
