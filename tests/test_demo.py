"""`puzzle demo`: the whole pipeline on a trained demo parent, its table against the exported children, a rerun
that reuses every stage, the real `puzzle demo --quick` from the command line, and bad --out directories."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from puzzle.config.run import load_config, load_config_data
from puzzle.cost import model_performance
from puzzle.cost.analytic import model_active_params
from puzzle.cost.hardware import profile_from_json
from puzzle.demo.corpus import stdlib_root
from puzzle.demo.parent import TrainSettings, demo_parent
from puzzle.demo.pipeline import DEMO_FILE, DEMO_JSON, ENGINES, FULL, DemoSize, demo_config, run_demo
from puzzle.layout import RunLayout
from puzzle.nemotron_h.checkpoint import load
from puzzle.presets.demo import demo_spec
from puzzle.run import RunError

ROOT = Path(__file__).resolve().parents[1]
SMALL_ROOT = stdlib_root() / "email"
TINY_PARENT = TrainSettings(seq_len=32, batch_size=4, steps=25, lr=1e-2, warmup_steps=3, held_out_sequences=4)
TINY = DemoSize(
    seq_len=32,
    held_out_tokens=512,
    importance_tokens=256,
    bld_tokens=1024,
    gkd_tokens=1024,
    batch_size=4,
    decode_prompt=8,
    decode_steps=4,
    decode_repeats=2,
    eval_limit=4,
    # What vLLM and llama.cpp serve (the demo's ENGINES); the no-op blocks are offered and left out. The
    # tiny parent is mostly embeddings: 83% of its active parameters at the least, hence its own budgets.
    space={
        "mamba": {"state_size": [8], "noop": True},
        "moe": {"top_k": [1], "shared_width_fraction": [0.5]},
        "attention": {"num_kv_heads": [1], "noop": True},
    },
    sweep="active_params<=0.95x,0.9x",
)


def _parent(cache: Path, seed: int = 0):
    # hidden 64: llama.cpp's converter wants a Mamba inner width (4 heads x 16) that is a multiple of 64
    spec = demo_spec("ME*E", 64, num_experts=4, top_k=2, num_heads=4)
    return demo_parent(
        cache, seed=seed, progress=False, spec=spec, settings=TINY_PARENT, corpus_root=SMALL_ROOT
    )


def _finished(run_dir: Path) -> dict[str, str]:
    stages = json.loads((run_dir / "run.json").read_text())["stages"]
    return {name: entry["finished"] for name, entry in stages.items()}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    parent = _parent(root / "cache")
    return run_demo(root / "out", size=TINY, parent=parent, progress=False), parent, root


def test_the_demo_compresses_for_two_budgets_and_tables_the_exports(demo):
    result, parent, _ = demo
    parent_row, *children = result.rows
    assert parent_row.name == "parent" and parent_row.kl == 0.0
    assert parent_row.active_params == model_active_params(parent.model.spec)
    assert [row.budget for row in children] == ["active_params<=0.95x", "active_params<=0.9x"]
    for row, fraction in zip(children, (0.95, 0.9), strict=True):
        child = load(result.exports[row.name])  # the exported checkpoint itself
        # Servable by the demo's engines: exported with format "engine" for them, no block they refuse.
        record = json.loads((result.exports[row.name] / "puzzle.json").read_text())
        assert record["checked_engines"] == list(ENGINES)
        assert all(record["engines"][engine] == [] for engine in ENGINES)
        assert "noop" not in row.blocks
        assert [block.short_name() for block in child.spec.blocks] == row.blocks
        assert row.active_params == model_active_params(child.spec) <= fraction * parent_row.active_params
        assert row.kl > 0 and row.kl_before_gkd > 0 and row.kl_predicted > 0
        assert 0 < row.top1 < 1 and row.lm_loss > 0
        assert row.measured_tokens_per_s > 0 and row.predicted_tokens_per_s > 0
        solution = json.loads((result.out / "solutions" / f"{row.name}.json").read_text())
        assert list(solution["choices"].values()) == row.blocks
        assert solution["objective"] == pytest.approx(row.kl_predicted)
    table = result.table.read_text()
    # puzzle_next_line's acc_norm (with lm-eval's stderr) of every model, before and after GKD, as recorded.
    stages = json.loads((result.out / "run.json").read_text())["stages"]
    for row in result.rows:
        model = "parent" if row.name == "parent" else f"{row.name}.distilled"
        rows = stages[f"eval/{model}"]["outputs"][model]["summary"]
        recorded = next(r for r in rows if r["metric"] == "acc_norm")
        assert row.accuracy == (recorded["value"], recorded["stderr"])
        assert (row.accuracy_before_gkd is None) == (row.name == "parent")
        assert f"{row.accuracy[0]:.3f} +- {row.accuracy[1]:.3f}" in table
    assert "KL and accuracy rank the children" in table or "do not rank the children alike" in table
    for row in result.rows:
        assert f"| {row.name} |" in table and f"{row.active_params:,}" in table
    saved = json.loads((result.out / DEMO_JSON).read_text())
    assert [r["name"] for r in saved["rows"]] == [r.name for r in result.rows]
    report = result.report.read_text()
    assert all(row.name in report for row in children)
    # Predicted decode speed: the cost model on the run's calibration of this machine, made at one thread as
    # the decode is measured, stored in the run (the search priced the children with it).
    hardware = profile_from_json(json.loads((result.out / "hardware.json").read_text()), "hardware.json")
    assert "(1 torch threads)" in hardware.source
    scenario = load_config(RunLayout(result.out).resolved_config).hardware.scenarios["decode"]
    for row in result.rows:
        spec = parent.model.spec if row.name == "parent" else load(result.exports[row.name]).spec
        step = model_performance(spec, scenario, hardware).decode_step_s
        assert row.predicted_tokens_per_s == pytest.approx(1 / step, rel=1e-12)


def test_a_second_demo_into_the_same_directory_reuses_every_stage(demo):
    result, parent, _ = demo
    before = _finished(result.out)
    again = run_demo(result.out, size=TINY, parent=parent, progress=False)
    assert _finished(result.out) == before  # nothing recomputed
    assert [(r.name, r.kl, r.blocks) for r in again.rows] == [(r.name, r.kl, r.blocks) for r in result.rows]
    # The same predicted speeds: the run's stored calibration, not a new measurement.
    assert [r.predicted_tokens_per_s for r in again.rows] == [r.predicted_tokens_per_s for r in result.rows]


def test_a_demo_of_another_parent_refuses_the_directory(demo):
    result, _, root = demo
    other = _parent(root / "cache", seed=1)
    before = _finished(result.out)
    with pytest.raises(RunError, match="another parent"):
        run_demo(result.out, size=TINY, parent=other, progress=False)
    assert _finished(result.out) == before


def test_the_example_config_is_the_demo_config():
    example = yaml.safe_load((ROOT / "examples" / "configs" / "demo.yaml").read_text())
    paths = {"run_dir": "/x/run", "parent": "/x/parent", "corpus": "/x/corpus.safetensors"}
    example["run_dir"], example["parent"]["path"] = paths["run_dir"], paths["parent"]
    example["data"]["sources"] = [paths["corpus"]]
    expected = demo_config(paths["parent"], paths["corpus"], paths["run_dir"], FULL)
    assert load_config_data(example) == load_config_data(expected)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "puzzle", "demo", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_puzzle_demo_quick_from_the_command_line(tmp_path):
    """The README's first command, for real: trains the quick parent, runs every stage, prints the table."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    done = _cli("--quick", "--quiet", "--out", str(out), "--cache", str(cache), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "| parent |" in done.stdout and "active_params<=0.7x" in done.stdout
    # --quiet: none of lm-eval's bars or log lines (its five evaluations and the plan's request counts).
    for noise in ("%|", "Running loglikelihood", "Building contexts", "Custom kwargs", "lm_eval"):
        assert noise not in done.stderr, done.stderr
    # Its last line is its own wall time, the figure README's Quickstart quotes.
    assert re.fullmatch(
        r"puzzle demo: done in \d+ s wall time on \d+ CPU core\(s\)", done.stdout.splitlines()[-1]
    )
    assert (out / DEMO_FILE).is_file() and (out / "report" / "report.md").is_file()
    assert sorted(p.name for p in (out / "exports").iterdir()) == [
        "active_params-le-0.7x",
        "active_params-le-0.85x",
    ]
    config = load_config(out / "config.yaml", check_paths=True)  # the config it ran, as `puzzle run` reads it
    assert config.run_dir == out.resolve()
    before = _finished(out)
    rerun = subprocess.run(
        [sys.executable, "-m", "puzzle", "run", "--quiet", str(out / "config.yaml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert _finished(out) == before  # `puzzle run` on it finds every stage done


def test_dry_run_writes_nothing_and_bad_directories_are_refused(tmp_path):
    done = _cli("--dry-run", "--out", "new", "--cache", "cache", cwd=tmp_path)
    assert done.returncode == 0 and "would write" in done.stdout, done.stderr
    assert list(tmp_path.iterdir()) == []
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    refused = _cli("--quick", "--out", str(project), cwd=tmp_path)
    assert refused.returncode == 2 and "not a puzzle run" in refused.stderr, refused.stderr
    assert [p.name for p in project.iterdir()] == ["notes.txt"]
    (tmp_path / "a-file").write_text("x")
    for bad in ("a-file", "a-file/out"):
        refused = _cli("--quick", "--out", bad, cwd=tmp_path)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_cache_nothing_can_be_created_in_is_refused_before_anything_is_written(tmp_path, dry_run):
    """--cache /proc/nope (no folder can be made in /proc, even by root, whom permission bits let through):
    one sentence naming it and what was expected, exit 2, and DIR (its logs/ included) never created; the
    dry run makes the same check."""
    argv = ["--dry-run"] if dry_run else []
    refused = _cli("--quick", "--quiet", *argv, "--out", "run", "--cache", "/proc/nope", cwd=tmp_path)
    err = refused.stderr
    assert refused.returncode == 2 and err.count("\n") == 1, err
    assert "--cache /proc/nope" in err and "expected a directory" in err and "Errno" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_report_folder_of_the_users_in_dir_is_refused_before_any_stage(tmp_path):
    """DIR/report holding the user's report.md: the demo would replace it at its end; refused up front (the
    dry run too), nothing written."""
    mine = tmp_path / "run" / "report"
    mine.mkdir(parents=True)
    (mine / "report.md").write_text("mine\n")
    for argv in (["--dry-run"], []):
        refused = _cli("--quick", "--quiet", *argv, "--out", "run", "--cache", "cache", cwd=tmp_path)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert "report.md" in refused.stderr and str(mine) in refused.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "run",
        "run/report",
        "run/report/report.md",
    ]
    assert (mine / "report.md").read_text() == "mine\n"
