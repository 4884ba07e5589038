"""`puzzle.eval.evaluate` under torch.distributed (2 gloo ranks, as torchrun starts them): every rank runs the
requests and returns rank 0's results, equal to one process's; lm-eval alone returns them on local rank 0
only. This is what the run's eval stage and GKD's task selector do on every rank. Tiny fp32 model, offline."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's HF model class imports it

from gloo_helpers import gloo_rank, spawn_ranks
from run_helpers import SPEC

from puzzle.data import load_tokenizer
from puzzle.demo.corpus import write_tokenizer
from puzzle.eval import evaluate
from puzzle.model import HybridLM

TINY = dataclasses.replace(SPEC, vocab_size=258)
TASKS = ["puzzle_next_line", "puzzle_identifiers"]
LIMIT = 6


def _results(tokenizer_dir: str) -> dict:
    torch.manual_seed(0)
    model = HybridLM(TINY).eval()
    results = evaluate(model, load_tokenizer(tokenizer_dir), TASKS, limit=LIMIT, batch_size=4)
    return {key: results[key] for key in ("results", "n-samples", "higher_is_better")}


def _worker(rank: int, world: int, port: int, folder: str) -> None:
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    with gloo_rank(rank, world, port):
        found = _results(str(Path(folder) / "tokenizer"))
        Path(folder, f"rank{rank}.json").write_text(json.dumps(found, sort_keys=True))


def test_two_gloo_ranks_each_get_the_single_process_results(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tokenizer(tmp_path / "tokenizer")
    spawn_ranks(_worker, str(tmp_path))
    alone = json.loads(json.dumps(_results(str(tmp_path / "tokenizer")), sort_keys=True))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[1] == ranks[0]  # rank 1 gets the results, not lm-eval's None
    assert set(ranks[0]["results"]) == set(TASKS)
    for task in TASKS:
        assert ranks[0]["n-samples"][task]["effective"] == LIMIT
        for key, value in alone["results"][task].items():
            if isinstance(value, float):
                assert ranks[0]["results"][task][key] == pytest.approx(value, abs=1e-6), (task, key)
            else:
                assert ranks[0]["results"][task][key] == value
