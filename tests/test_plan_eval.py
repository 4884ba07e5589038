"""`puzzle plan` prices the eval stage when the run config names eval tasks: each task's requests as lm-eval
builds them (a multiple-choice document one per choice), tokenised by the run's tokenizer, one forward of
the model each, for the parent and each child assembled and distilled. The oracle: the task's JSONL read
here and encoded byte by byte (the demo's tokenizer). No eval tasks: no eval stage."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("lm_eval")

from run_helpers import SPEC, config_dict, write_config

from puzzle.config import load_config
from puzzle.demo.corpus import write_tokenizer
from puzzle.eval import LOCAL_TASKS
from puzzle.model import HybridLM
from puzzle.plan import forward_flops_per_token, plan_config

TINY = dataclasses.replace(SPEC, vocab_size=258)
LIMIT = 5


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _items(name: str) -> list[dict]:
    return [json.loads(line) for line in LOCAL_TASKS.joinpath(name).read_text().splitlines()][:LIMIT]


def test_the_plan_prices_each_eval_task_from_its_requests(tmp_path):
    torch.manual_seed(0)
    HybridLM(TINY).save_pretrained(tmp_path / "parent")
    write_tokenizer(tmp_path / "parent")
    (tmp_path / "data").mkdir()
    data = {**config_dict(tmp_path), "search": {"budgets": ["active_params<=0.9x"]}}
    plain = plan_config(load_config(write_config(tmp_path / "plain.yaml", data)), 1, "h100")
    assert "eval" not in [stage.name for stage in plain.stages]

    tasks = {"tasks": ["puzzle_next_line", "puzzle_identifiers"], "limit": LIMIT, "batch_size": 4}
    plan = plan_config(load_config(write_config(tmp_path / "eval.yaml", {**data, "eval": tasks})), 1, "h100")
    (stage,) = [s for s in plan.stages if s.name == "eval"]
    # lm-eval moves a context's trailing whitespace to the continuation: the same tokens in all.
    lengths = [len((i["context"] + c).encode()) for i in _items("next_line.jsonl") for c in i["choices"]]
    lengths += [len((i["context"] + i["completion"]).encode()) for i in _items("identifiers.jsonl")]
    assert len(lengths) == 4 * LIMIT + LIMIT
    per_parent = sum(n * forward_flops_per_token(TINY, n) for n in lengths)
    # The models in parent forwards: the parent, and one solution's child twice at its share of the parent.
    models = stage.flops / per_parent
    assert 1 < models <= 3
    assert stage.tokens == pytest.approx(models * sum(lengths), abs=1)
    assert f"puzzle_next_line: {4 * LIMIT} requests" in stage.notes[0]
    assert f"puzzle_identifiers: {LIMIT} requests" in stage.notes[0]
    assert stage.seconds and stage.seconds > 0
    assert "eval:" in plan.render()
