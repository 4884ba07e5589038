"""puzzle.eval and `puzzle eval`: lm-eval's loglikelihoods of our model equal a direct forward's, the local
task runs offline, unknown task names are refused with close matches. Real lm-eval, tiny fp32 models."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's HF model class imports it

from run_helpers import SPEC

from puzzle.cli import main
from puzzle.data import load_tokenizer
from puzzle.demo.corpus import write_tokenizer
from puzzle.eval import EvalAdapter, UnknownTaskError, evaluate, summary, task_manager
from puzzle.model import HybridLM

# The demo's byte-level tokenizer: 256 bytes + BOS + EOS.
TINY = dataclasses.replace(SPEC, vocab_size=258)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing from a hub: a task that tried would fail here rather than download."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(TINY).eval()


@pytest.fixture(scope="module")
def manager():
    """One index of lm-eval's tasks and ours for the module: building it takes seconds."""
    return task_manager()


def _direct_loglikelihood(model: HybridLM, tokenizer, context: str, continuation: str) -> float:
    """sum over the continuation's tokens of log-softmax of one forward of context + continuation.

    As lm-eval frames a request: the context's trailing whitespace moves to the start of the continuation
    (HFLM._encode_pair), so that a word-initial space is scored with the word.
    """
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped) :] + continuation
    ctx = tokenizer.encode(context, add_special_tokens=False)
    cont = tokenizer.encode(continuation, add_special_tokens=False)
    tokens = torch.tensor([ctx + cont])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(tokens[:, :-1]).logits.double(), dim=-1)[0]
    positions = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
    return float(logprobs[positions, torch.tensor(cont)].sum())


@pytest.mark.parametrize("batch_size", [1, 3])
def test_loglikelihood_matches_a_direct_forward(model: HybridLM, tokenizer, batch_size: int) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    pairs = [
        ("def f(x):\n", "    return x"),
        ("import torch\n", "from torch import nn"),
        ("a = 1\nb = 2\nc = a + b\nprint(", "c)"),  # lengths differ: the batch of 3 pads two rows
        ("class A:\n    pass\n", "\n"),
        ("x", " = [i for i in range(10)]"),
    ]
    lm = HFLM(pretrained=EvalAdapter(model), tokenizer=tokenizer, batch_size=batch_size, backend="causal")
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)
    ]
    found = [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    expected = [_direct_loglikelihood(model, tokenizer, *pair) for pair in pairs]
    assert found == pytest.approx(expected, abs=1e-5, rel=0)


def test_local_task_runs_offline_with_stderr(model: HybridLM, tokenizer, manager) -> None:
    shuffled = HybridLM(TINY).eval()  # a broken model: every tensor's entries permuted
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for (_, source), target in zip(model.state_dict().items(), shuffled.state_dict().values()):
            flat = source.flatten()
            target.copy_(flat[torch.randperm(flat.numel(), generator=generator)].view_as(source))
    results = evaluate(shuffled, tokenizer, ["puzzle_next_line"], limit=12, batch_size=4, manager=manager)
    metrics = results["results"]["puzzle_next_line"]
    for name in ("acc", "acc_norm"):
        assert 0 <= metrics[f"{name},none"] <= 1
        assert metrics[f"{name}_stderr,none"] > 0
    rows = {row["metric"]: row for row in summary(results)}
    assert set(rows) == {"acc", "acc_norm"} and rows["acc"]["stderr"] == metrics["acc_stderr,none"]


def test_unknown_task_names_close_matches(model: HybridLM, tokenizer, manager) -> None:
    with pytest.raises(UnknownTaskError, match="puzzle_next_lin'") as caught:
        evaluate(model, tokenizer, "puzzle_next_lin", manager=manager)
    assert isinstance(caught.value, ValueError)
    assert "puzzle_next_line" in caught.value.matches


def test_cli_evaluates_a_checkpoint_and_refuses_unknown_tasks(
    model: HybridLM, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = model.save_pretrained(tmp_path / "ckpt")
    write_tokenizer(path)
    assert main(["eval", str(path), "--tasks", "puzzle_next_lin"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "'puzzle_next_lin'" in error and "puzzle_next_line" in error

    assert main(["eval", str(path), "--tasks", "puzzle_next_line", "--limit", "4", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert 0 <= printed["puzzle_next_line"]["acc,none"] <= 1
