"""benchmarks/bench_scale.py: its log parser reads the lines `puzzle run` really writes, and its comparison
(cumulative peaks, the stage that sets the peak, the plan's running maximum, the goals) is right."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from run_helpers import make_inputs, write_config

from puzzle.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_scale


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A real one-process `puzzle run --until importance` on the tiny parent, run twice (done, then reused)."""
    root = tmp_path_factory.mktemp("bench_scale")
    config = write_config(root / "run.yaml", make_inputs(root))
    torch.set_num_threads(1)
    for _ in range(2):
        assert main(["run", str(config), "--quiet", "--until", "importance"]) == 0
    return config, (root / "run" / "logs" / "rank0.log").read_text()


def test_the_parser_reads_the_peaks_puzzle_run_logs(logged: tuple[Path, str]) -> None:
    _, text = logged
    parsed = bench_scale.parse_log(text)
    assert parsed["baseline_mib"] is not None and parsed["baseline_mib"] > 10  # torch alone is more
    importance = parsed["records"]["importance"]
    # The second run reused the record: its figure is that process's (running maximum) peak again.
    assert importance["peak_mib"] >= parsed["baseline_mib"]
    assert importance["seconds"] == 0.0  # the last one logged is the reuse
    assert text.count("importance: peak resident memory") == 2
    first = bench_scale.parse_log(text.split("importance: reused")[0])
    assert first["records"]["importance"]["seconds"] > 0


def test_the_table_compares_with_the_plan(logged: tuple[Path, str]) -> None:
    config, text = logged
    parsed = bench_scale.parse_log(text)
    rank = {"rank": 0, "baseline_mib": parsed["baseline_mib"], "stages": bench_scale.stage_peaks(parsed)}
    plan = bench_scale.predicted(config, 1)
    assert list(plan) == list(bench_scale.PLAN_STAGES)
    comparison = bench_scale.compare({1: {"seconds": 1.0, "ranks": [rank], "predicted_mib": plan}})
    (row,) = comparison["rows"]
    assert row["stage"] == "importance" and row["predicted_stage_mib"] == plan["importance"]
    assert comparison["summary"][1]["set_by"] == "importance"
    assert "| 1 | importance |" in bench_scale.table(comparison)


def _line(name: str, mib: float, second: int) -> str:
    return f"2026-01-01 00:00:{second:02d},000 INFO puzzle.run: {name}: peak resident memory {mib:.1f} MiB"


def _event(name: str, event: str, second: int) -> str:
    return f"2026-01-01 00:00:{second:02d},000 INFO puzzle.run: {name}: {event}"


def _rank(peaks: dict[str, float], baseline: float) -> dict:
    lines = [_line("baseline", baseline, 0) + " (before the parent loads)"]
    for second, (name, mib) in enumerate(peaks.items(), start=1):
        lines += [
            _event(name, "running", second),
            _event(name, "done", second + 1),
            _line(name, mib, second + 1),
        ]
    parsed = bench_scale.parse_log("\n".join(lines))
    return {"rank": 0, "baseline_mib": parsed["baseline_mib"], "stages": bench_scale.stage_peaks(parsed)}


def test_the_peak_is_set_by_the_first_stage_reaching_it_and_goals_are_above_baseline() -> None:
    plan = {stage: 0.0 for stage in bench_scale.PLAN_STAGES}
    one = _rank({"importance": 600, "library": 1500, "export/a": 1500, "export": 1500}, baseline=500)
    two = _rank({"importance": 600, "library": 1000, "distill": 1040}, baseline=500)
    comparison = bench_scale.compare(
        {
            1: {"seconds": 9.0, "ranks": [one], "predicted_mib": {**plan, "library": 1100.0}},
            2: {
                "seconds": 9.0,
                "ranks": [two],
                "predicted_mib": {**plan, "importance": 200.0, "distill": 300.0},
            },
        }
    )
    first, second = comparison["summary"][1], comparison["summary"][2]
    assert first["set_by"] == "library" and second["set_by"] == "distill"
    assert first["above_baseline_mib"] == 1000 and first["predicted_over_measured"] == pytest.approx(1.1)
    assert first["plan_within_25pct"] and not second["plan_within_25pct"]  # 300 / 540
    assert second["ratio_to_1_above_baseline"] == pytest.approx(0.54) and second["goal_met"]
    assert second["ratio_to_1"] == pytest.approx(1040 / 1500)
    # The plan's figure next to a cumulative measurement is its running maximum: 200 up to distill.
    rows = {(r["world"], r["stage"]): r for r in comparison["rows"]}
    assert rows[(2, "library")]["predicted_mib"] == 200.0 and rows[(2, "distill")]["predicted_mib"] == 300.0
    assert rows[(1, "export")]["seconds"] == 1.0  # export/a's time is inside export's
