"""gkd.select_by TASK/METRIC: GKD keeps the evaluated checkpoint whose lm-eval task metric is best, not the one
of least KL. The oracle: every evaluated checkpoint's weights (taken in GKD's callback) evaluated by lm-eval
here, apart from GKD; the kept step is the best of those, and the output is its weights. Real lm-eval, offline,
tiny fp32 models; the config refuses a select_by whose task the eval section does not list."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's HF model class imports it

from run_helpers import SPEC, config_dict

from puzzle.config import ConfigError, load_config_data
from puzzle.data import load_tokenizer
from puzzle.demo.corpus import write_tokenizer
from puzzle.eval import LOCAL_TASKS, evaluate, metric_value, task_manager
from puzzle.gkd import Selector, distill, load_distilled
from puzzle.model import HybridLM
from puzzle.settings import GKDSettings

TINY = dataclasses.replace(SPEC, vocab_size=258)  # the demo's byte vocabulary
TASK = "tiny_identifiers_ppl"
LIMIT = 4


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _task_folder(folder):
    """A task of our own (--include-path): puzzle_identifiers' items scored by perplexity, a metric that moves
    with every step and whose best is the lowest (lm-eval's higher_is_better: false)."""
    folder.mkdir()
    (folder / f"{TASK}.yaml").write_text(
        f"include: {LOCAL_TASKS / 'puzzle_identifiers.yaml'}\n"
        f"task: {TASK}\n"
        "metric_list:\n"
        "  - metric: perplexity\n"
        "    aggregation: perplexity\n"
        "    higher_is_better: false\n"
    )
    return folder


def test_the_kept_checkpoint_is_the_best_by_the_task_metric(tmp_path):
    tokenizer = load_tokenizer(write_tokenizer(tmp_path / "tokenizer"))
    manager = task_manager(_task_folder(tmp_path / "tasks"))

    def perplexity(model: HybridLM) -> tuple[float, bool]:
        results = evaluate(model, tokenizer, [TASK], limit=LIMIT, batch_size=8, manager=manager)
        return metric_value(results, TASK, "perplexity")

    # A teacher of peaked random predictions and a student of flat ones: distilling lowers the KL at every
    # step while the student's perplexity on real identifiers rises, so the task metric keeps another step.
    torch.manual_seed(0)
    teacher = HybridLM(TINY).eval()
    torch.manual_seed(1)
    student = HybridLM(TINY)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(3.0)
        student.lm_head.weight.zero_()
    generator = torch.Generator().manual_seed(2)
    train = [torch.randint(0, 256, (4, 16), generator=generator) for _ in range(6)]
    held_out = [torch.randint(0, 256, (4, 16), generator=generator) for _ in range(2)]
    settings = GKDSettings(
        lr=3e-2,
        steps=4,
        token_budget=None,
        batch_size=4,
        vocab_chunk=64,
        eval_every=1,
        checkpoint_every=0,
        shard="none",
        select_by=f"{TASK}/perplexity",
    )
    weights = {0: copy.deepcopy(student.state_dict())}
    result = distill(
        student,
        teacher,
        train,
        held_out,
        settings,
        tmp_path / "gkd",
        callback=lambda step, _record: weights.__setitem__(step, copy.deepcopy(student.state_dict())),
        selector=Selector(settings.select_by, perplexity, "tiny-perplexity"),
    )

    evaluations = result.history["eval"]
    assert [e["step"] for e in evaluations] == list(range(5))
    # lm-eval on each evaluated checkpoint, here: the values GKD recorded, and the best of them kept.
    measured = {}
    for step, state in weights.items():
        model = HybridLM(TINY)
        model.load_state_dict(state)
        measured[step], higher_is_better = perplexity(model.eval())
        assert higher_is_better is False
    assert [e["select"]["value"] for e in evaluations] == pytest.approx([measured[s] for s in range(5)])
    best = min(measured, key=lambda s: (measured[s], s))
    assert result.kept_step == best
    by_kl = min(evaluations, key=lambda e: (e["kl"], e["step"]))["step"]
    assert best not in (by_kl, 4), "the metric must pick another step than KL or the last for this to test it"
    kept = load_distilled(tmp_path / "gkd", HybridLM(TINY))
    for name, tensor in kept.state_dict().items():
        torch.testing.assert_close(tensor, weights[best][name], rtol=0, atol=0)


def test_a_select_by_without_its_selector_or_task_is_refused(tmp_path):
    with pytest.raises(ValueError, match="select_by must be 'kl' or 'TASK/METRIC'"):
        GKDSettings(select_by="puzzle_next_line")
    settings = GKDSettings(steps=1, token_budget=None, select_by="puzzle_next_line/acc_norm")
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="needs its Selector"):
        distill(HybridLM(TINY), HybridLM(TINY), [], [], settings, tmp_path / "gkd")
    data = {**config_dict(tmp_path), "search": {"budgets": ["active_params<=0.9x"]}}
    data["gkd"] = {**data.get("gkd", {}), "select_by": "puzzle_next_line/acc_norm"}
    with pytest.raises(ConfigError, match=r"gkd\.select_by.*eval\.tasks does not list"):
        load_config_data({**data, "eval": {"tasks": ["puzzle_identifiers"]}})
    config = load_config_data({**data, "eval": {"tasks": ["puzzle_next_line"]}})
    assert config.gkd.select_task == ("puzzle_next_line", "acc_norm")
