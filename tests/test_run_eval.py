"""The run config's `eval` section (puzzle/run/evaluate.py): a tiny `puzzle run` evaluates the parent and each
child, assembled and distilled, records lm-eval's results in eval/{model}.json and run.json, equal to lm-eval
run directly on the parent checkpoint and on the exported child; a rerun reuses them, a damaged file redoes
that one alone; `Run.evaluate` returns them; the report tabulates and plots them; bad `eval`
sections are refused naming the key. Real lm-eval, offline, on the local task, tiny fp32 models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's HF model class imports it

from run_helpers import SPEC, config_dict, token_stream, write_config
from safetensors.torch import save_file

from puzzle.cli import main
from puzzle.config import ConfigError, load_config_data
from puzzle.data import load_tokenizer
from puzzle.demo.corpus import write_tokenizer
from puzzle.eval import evaluate, load_target, summary
from puzzle.model import HybridLM
from puzzle.report import write_report
from puzzle.run import Run, RunError

# The demo's byte-level tokenizer (256 bytes + BOS + EOS) on the run helpers' tiny hybrid.
TINY = dataclasses.replace(SPEC, vocab_size=258)
EVAL = {"tasks": ["puzzle_next_line"], "limit": 6, "batch_size": 4}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _inputs(root: Path) -> dict:
    """A parent of the byte vocabulary with its tokenizer, token data, and a run config over them."""
    torch.manual_seed(0)
    HybridLM(TINY).save_pretrained(root / "parent")
    write_tokenizer(root / "parent")
    (root / "data").mkdir(parents=True)
    save_file({"input_ids": token_stream(16 * 400, seed=1)}, str(root / "data" / "tokens.safetensors"))
    config = config_dict(root)
    # The byte vocabulary's embeddings are most of this parent: 0.8x of its active parameters is out of reach.
    config["search"] = {"budgets": ["active_params<=0.9x"]}
    return {**config, "eval": dict(EVAL)}


def _stages(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())["stages"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_eval")
    data = _inputs(root)
    config = write_config(root / "run.yaml", data)
    torch.set_num_threads(1)
    assert main(["run", str(config), "--quiet"]) == 0
    return root, config, data


def test_the_run_evaluates_the_parent_and_each_child_as_lm_eval_does(finished):
    root, _, _ = finished
    run_dir = root / "run"
    stages = _stages(run_dir)
    (solution,) = stages["solutions"]["outputs"]
    models = ["parent", f"{solution}.assembled", f"{solution}.distilled"]
    assert sorted(n for n in stages if n.startswith("eval/")) == sorted(f"eval/{m}" for m in models)
    tokenizer = load_tokenizer(root / "parent")
    for model in models:
        record = stages[f"eval/{model}"]
        assert record["status"] == "done" and record["inputs"]["eval"]["tasks"] == EVAL["tasks"]
        entry = record["outputs"][model]
        saved = json.loads((run_dir / entry["file"]).read_text())
        assert entry["file"] == f"eval/{model}.json" and entry["summary"] == summary(saved)
        assert {(r["task"], r["metric"]) for r in entry["summary"]} == {
            ("puzzle_next_line", "acc"),
            ("puzzle_next_line", "acc_norm"),
        }
        assert saved["n-samples"]["puzzle_next_line"]["effective"] == EVAL["limit"]
    # The oracle: lm-eval itself on the parent checkpoint and on the exported distilled child (the weights
    # GKD kept, as every user of the export loads them).
    for model, path in (
        ("parent", root / "parent"),
        (f"{solution}.distilled", run_dir / "exports" / solution),
    ):
        network, _ = load_target(path)
        direct = evaluate(network, tokenizer, EVAL["tasks"], limit=EVAL["limit"], batch_size=1)
        recorded = stages[f"eval/{model}"]["outputs"][model]["summary"]
        assert [r["value"] for r in recorded] == pytest.approx(
            [r["value"] for r in summary(direct)], abs=1e-12
        )


def test_the_report_tables_and_plots_accuracy_beside_kl(finished):
    root, _, _ = finished
    report = write_report(root / "run").read_text()
    section = report.split("## Task accuracy", 1)[1].split("\n## ", 1)[0]
    stages = _stages(root / "run")
    (solution,) = stages["solutions"]["outputs"]
    kl = stages["distill"]["outputs"][solution]["kept_eval"]["kl"]
    distilled = stages[f"eval/{solution}.distilled"]["outputs"][f"{solution}.distilled"]["summary"]
    acc_norm = next(r for r in distilled if r["metric"] == "acc_norm")
    line = next(row for row in section.splitlines() if row.startswith(f"| {solution}.distilled |"))
    assert f"{acc_norm['value']:.3f} +- {acc_norm['stderr']:.3f}" in line
    assert f"{kl:.4g}"[:5] in line
    assert "| parent |" in section and f"| {solution}.assembled |" in section
    assert "(accuracy.png)" in section and (root / "run" / "report" / "accuracy.png").is_file()


def test_a_rerun_reuses_the_evaluations_and_redoes_a_damaged_one(finished):
    root, config, _ = finished
    run_dir = root / "run"
    before = _stages(run_dir)
    (solution,) = before["solutions"]["outputs"]
    assert main(["run", str(config), "--quiet"]) == 0
    after = _stages(run_dir)
    evals = [n for n in after if n.startswith("eval/")]
    assert {after[n]["status"] for n in evals} == {"reused"}
    assert all(after[n]["finished"] == before[n]["finished"] for n in evals)

    # Run.evaluate: the recorded results, nothing recomputed.
    run = Run.from_config(config)
    child = run.assemble(run.search()[0])
    assert run.evaluate(child) == json.loads((run_dir / "eval" / f"{solution}.assembled.json").read_text())
    assert run.evaluate()["results"] == json.loads((run_dir / "eval" / "parent.json").read_text())["results"]
    assert (
        _stages(run_dir)[f"eval/{solution}.assembled"]["finished"]
        == before[f"eval/{solution}.assembled"]["finished"]
    )

    # A damaged file: that evaluation alone is redone.
    damaged = run_dir / "eval" / "parent.json"
    damaged.write_text(damaged.read_text().replace('"acc,none"', '"acc,nope"', 1))
    assert main(["run", str(config), "--quiet"]) == 0
    again = _stages(run_dir)
    assert again["eval/parent"]["status"] == "done"
    assert (
        again["eval/parent"]["outputs"]["parent"]["summary"]
        == before["eval/parent"]["outputs"]["parent"]["summary"]
    )
    assert {again[n]["status"] for n in evals if n != "eval/parent"} == {"reused"}


@pytest.mark.parametrize(
    ("section", "key", "message"),
    [
        ({"tasks": ["puzzle_next_line,arc_easy"]}, "eval.tasks[0]", "one task name"),
        ({"tasks": ["puzzle_next_line", "puzzle_next_line"]}, "eval.tasks", "named twice"),
        ({"tasks": ["puzzle_next_line"], "limit": 0}, "eval.limit", "positive integer"),
        ({"tasks": ["puzzle_next_line"], "batch_size": 0}, "eval.batch_size", "positive integer"),
    ],
)
def test_a_bad_eval_section_is_refused_naming_its_key(tmp_path, section, key, message):
    with pytest.raises(ConfigError, match=message) as caught:
        load_config_data({**config_dict(tmp_path), "eval": section})
    assert caught.value.key == key


def test_config_check_refuses_an_unknown_task_naming_close_matches(finished, tmp_path, capsys):
    _, _, data = finished
    config = write_config(tmp_path / "run.yaml", {**data, "eval": {"tasks": ["puzzle_next_lines"]}})
    assert main(["config", "check", str(config)]) == 2
    error = capsys.readouterr().err
    assert "eval.tasks[0]" in error and "'puzzle_next_lines'" in error and "puzzle_next_line" in error
    missing = write_config(
        tmp_path / "run2.yaml", {**data, "eval": {"tasks": ["puzzle_next_line"], "include_path": "nowhere"}}
    )
    assert main(["config", "check", str(missing)]) == 2
    assert "eval.include_path" in capsys.readouterr().err


def test_a_run_without_eval_tasks_records_no_evaluation_and_run_evaluate_says_why(finished, tmp_path):
    root, _, data = finished
    config = load_config_data({**data, "eval": {}})
    run = Run(root / "run", config)
    with pytest.raises(RunError, match=r"eval\.tasks is empty"):
        run.evaluate()
