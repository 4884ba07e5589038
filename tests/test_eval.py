"""puzzle.eval and `puzzle eval`: lm-eval's loglikelihoods of our model (and of its export through transformers)
equal a direct forward's, the local task runs offline and a broken model scores at chance there, unknown
tasks and tasks whose data needs the hub are refused in one line. Real lm-eval, tiny fp32 models."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's HF model class imports it

from run_helpers import SPEC

from puzzle.cli import main
from puzzle.data import load_tokenizer
from puzzle.demo.corpus import write_tokenizer
from puzzle.eval import (
    LOCAL_TASKS,
    EvalAdapter,
    HubDataError,
    UnknownTaskError,
    evaluate,
    load_target,
    summary,
    task_manager,
)
from puzzle.model import HybridLM

# The demo's byte-level tokenizer: 256 bytes + BOS + EOS.
TINY = dataclasses.replace(SPEC, vocab_size=258)


# Requests of different lengths: a batch of 3 pads two rows.
PAIRS = [
    ("def f(x):\n", "    return x"),
    ("import torch\n", "from torch import nn"),
    ("a = 1\nb = 2\nc = a + b\nprint(", "c)"),
    ("class A:\n    pass\n", "\n"),
    ("x", " = [i for i in range(10)]"),
]


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

    lm = HFLM(pretrained=EvalAdapter(model), tokenizer=tokenizer, batch_size=batch_size, backend="causal")
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(PAIRS)
    ]
    found = [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    expected = [_direct_loglikelihood(model, tokenizer, *pair) for pair in PAIRS]
    assert found == pytest.approx(expected, abs=1e-5, rel=0)


def _shuffled(model: HybridLM, seed: int = 1) -> HybridLM:
    """A broken copy of `model`: each tensor's entries permuted, so it keeps its scale but learns nothing."""
    shuffled = HybridLM(model.spec).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for (_, source), target in zip(model.state_dict().items(), shuffled.state_dict().values()):
            flat = source.flatten()
            target.copy_(flat[torch.randperm(flat.numel(), generator=generator)].view_as(source))
    return shuffled


def test_shuffled_weights_score_at_chance_on_the_local_task(model: HybridLM, tokenizer, manager) -> None:
    """The first 300 items of puzzle_next_line (of 3000), offline: acc_norm within 3 stderr of chance (1/4).

    The other half of the check, a trained parent clearly above chance, is not here: the full one takes
    minutes to train (the quick demo parent's figures on the whole task are in README.md)."""
    limit = 300
    results = evaluate(
        _shuffled(model), tokenizer, ["puzzle_next_line"], limit=limit, batch_size=16, manager=manager
    )
    metrics = results["results"]["puzzle_next_line"]
    lines = LOCAL_TASKS.joinpath("next_line.jsonl").read_text().splitlines()
    assert len(lines) == 3000
    items = [json.loads(line) for line in lines[:limit]]
    assert results["n-samples"]["puzzle_next_line"]["effective"] == len(items) == limit
    chance = sum(1 / len(item["choices"]) for item in items) / len(items)
    # acc_norm (loglikelihood per byte) is the chance-level metric: a broken model's summed loglikelihood
    # favours the shortest choice, and the true lines run longer than the distractors (acc 0.107 +- 0.018).
    value, stderr = metrics["acc_norm,none"], metrics["acc_norm_stderr,none"]
    assert metrics["acc_stderr,none"] > 0 and stderr > 0
    assert abs(value - chance) < 3 * stderr, (value, stderr)
    rows = {row["metric"]: row for row in summary(results)}
    assert set(rows) == {"acc", "acc_norm"} and rows["acc"]["stderr"] == metrics["acc_stderr,none"]


def test_an_export_through_transformers_matches_a_direct_forward(
    model: HybridLM, tokenizer, tmp_path
) -> None:
    """A nemotron_h export loads (load_target) as transformers' NemotronHForCausalLM; lm-eval's
    loglikelihoods of it, batched with padding, equal a direct fp32 forward of our HybridLM within 1e-5."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import NemotronHForCausalLM

    path = model.save_pretrained(tmp_path / "export")
    write_tokenizer(path)
    loaded, loaded_tokenizer = load_target(path)
    assert isinstance(loaded, NemotronHForCausalLM) and next(loaded.parameters()).dtype == torch.float32
    lm = HFLM(pretrained=loaded, tokenizer=loaded_tokenizer, batch_size=3, backend="causal")
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(PAIRS)
    ]
    found = [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    expected = [_direct_loglikelihood(model, tokenizer, *pair) for pair in PAIRS]
    assert found == pytest.approx(expected, abs=1e-5, rel=0)


def test_a_task_whose_data_needs_the_hub_fails_in_one_line(
    model: HybridLM,
    tokenizer,
    manager,
    tmp_path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """arc_easy reads allenai/ai2_arc from the hub: offline, a HubDataError naming the task and its
    dataset (an EvalError, exit 2 from the CLI with one line), not a traceback."""
    import datasets
    import huggingface_hub

    # Offline even where datasets was imported before the environment said so (its config reads it once).
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        HubDataError, match=r"arc_easy \(dataset allenai/ai2_arc\) needs the Hugging Face hub"
    ):
        evaluate(model, tokenizer, ["arc_easy"], limit=2, manager=manager)
    path = model.save_pretrained(tmp_path / "ckpt")
    write_tokenizer(path)
    capsys.readouterr()
    assert main(["eval", str(path), "--tasks", "arc_easy", "--limit", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    # stderr also holds transformers' weight-loading progress bar; the error is one line of its own
    errors = [line for line in captured.err.splitlines() if "puzzle eval" in line]
    assert len(errors) == 1 and "Traceback" not in captured.err, captured.err
    assert errors[0].startswith("puzzle eval: error:") and "arc_easy" in errors[0] and "hub" in errors[0]


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


def test_cli_evaluates_a_run_directory_parent_and_children(
    model: HybridLM, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TARGET a run directory: its parent (the saved config's parent.path) and each exports/NAME/, a row
    per model in the table, {model: results} with --json."""
    import yaml

    from puzzle.layout import RunLayout

    parent = model.save_pretrained(tmp_path / "parent")
    write_tokenizer(parent)
    layout = RunLayout(tmp_path / "run")
    layout.root.mkdir()
    layout.config.write_text(yaml.safe_dump({"run_dir": str(layout.root), "parent": {"path": str(parent)}}))
    for name, seed in (("half", 2), ("quarter", 3)):
        write_tokenizer(_shuffled(model, seed).save_pretrained(layout.export(name)))
    (layout.root / "exports" / "not-a-checkpoint").mkdir()  # no config.json: not a model

    argv = ["eval", str(layout.root), "--tasks", "puzzle_next_line", "--limit", "6", "--batch-size", "4"]
    assert main([*argv, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert list(printed) == ["parent", "half", "quarter"]
    assert all(0 <= printed[n]["puzzle_next_line"]["acc,none"] <= 1 for n in printed)
    assert main(argv) == 0
    table = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert table[0] == ["model", "task", "metric", "value", "stderr"]
    assert [(row[0], row[2]) for row in table[1:]] == [
        (name, metric) for name in printed for metric in ("acc", "acc_norm")
    ]
    value = float(table[1][3])
    assert value == pytest.approx(printed["parent"]["puzzle_next_line"]["acc,none"], abs=5e-5)


def _greedy_match(model: nn.Module, tokenizer, context: str, continuation: str) -> bool:
    """Whether every token of `continuation` is the argmax of one forward of context + continuation."""
    ctx = tokenizer.encode(context, add_special_tokens=False)
    cont = tokenizer.encode(continuation, add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([ctx + cont])[:, :-1]).logits[0]
    return logits[len(ctx) - 1 :].argmax(-1).tolist() == cont


class _Copier(nn.Module):
    """A brute-force copying model in the shape HFLM takes (`.config`, `.device`, `forward(ids).logits`): at each
    position it predicts the token that followed the longest earlier match of the text ending there (the
    latest such match), as an induction head would; no match: token 0."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(max_position_embeddings=2048, vocab_size=vocab)
        self.vocab = vocab
        self.anchor = nn.Parameter(torch.zeros(()))  # a parameter, for the device

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    def tie_weights(self) -> None:
        """Nothing to tie."""

    def forward(self, input_ids: torch.Tensor, **_: object) -> object:
        logits = torch.zeros(*input_ids.shape, self.vocab)
        for row, ids in enumerate(input_ids.tolist()):
            length = [0] * len(ids)  # length[j]: the match of the text ending at j with the one ending at i
            for i in range(len(ids)):
                # new[j] = length[j - 1] + 1 where ids[j] == ids[i] (the matches ending at j and at i grow)
                length = [
                    (length[j - 1] + 1 if j and ids[j] == ids[i] else int(ids[j] == ids[i])) for j in range(i)
                ]
                if length and max(length) > 0:
                    best = max(range(i), key=lambda j: (length[j], j))
                    logits[row, i, ids[best + 1]] = 1.0
                else:
                    logits[row, i, 0] = 1.0
        return type("Output", (), {"logits": logits})()


def test_identifier_task_is_a_copy_that_a_copier_completes_and_shuffled_weights_do_not(
    model: HybridLM, tokenizer, manager
) -> None:
    """puzzle_identifiers: 3000 items that benchmarks/make_next_line_task.py rebuilds identically from this
    repository's history, each the code up to an identifier the lines before it use and its first 3
    characters, the rest to complete. lm-eval's acc is the share our own greedy decoding completes exactly:
    well above 0 for a model that copies from the context (a brute-force copier), 0 for shuffled weights."""
    import importlib.util
    import subprocess

    script = LOCAL_TASKS.parents[1] / "benchmarks" / "make_next_line_task.py"
    spec = importlib.util.spec_from_file_location("make_next_line_task", script)
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    items = [json.loads(line) for line in maker.IDENTIFIER_OUTPUT.read_text().splitlines()]
    assert len(items) == maker.IDENTIFIER_ITEMS == 3000
    for item in items:
        identifier, prefix = item["identifier"], maker.PREFIX_CHARS
        assert 5 <= len(identifier) <= 24 and item["completion"] == identifier[prefix:]
        assert item["context"].endswith(identifier[:prefix]) and identifier in item["context"][:-prefix]
    try:
        files = maker.source_files()
    except (subprocess.CalledProcessError, FileNotFoundError):
        files = None  # a checkout without the source commit's history (a shallow clone)
    if files is not None:
        assert maker.build_identifier_items(files) == items

    limit = 40
    scores = {}
    for name, candidate in [("copier", _Copier(TINY.vocab_size)), ("shuffled", _shuffled(model, seed=5))]:
        results = evaluate(
            candidate, tokenizer, ["puzzle_identifiers"], limit=limit, batch_size=8, manager=manager
        )
        expected = sum(
            _greedy_match(candidate, tokenizer, i["context"], i["completion"]) for i in items[:limit]
        )
        scores[name] = results["results"]["puzzle_identifiers"]["acc,none"]
        assert scores[name] == pytest.approx(expected / limit, abs=1e-9)
    assert scores["copier"] >= 0.5 and scores["shuffled"] == 0.0, scores


@pytest.mark.parametrize("quiet", [True, False])
def test_quiet_silences_lm_evals_bars_and_log_lines(
    model: HybridLM,
    tokenizer,
    manager,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    quiet: bool,
) -> None:
    """PUZZLE_PROGRESS=0 (`puzzle demo --quiet`, `puzzle run --quiet`): nothing of lm-eval's on stderr nor in
    its log, where otherwise its bars (drawn whatever stderr is) and its lines (INFO and the custom-loader
    warning) are; the bars and the log level come back afterwards. (pytest takes log records from the
    root logger, hence caplog for the lines; the demo's own test checks a real --quiet run's stderr.)"""
    import logging

    import tqdm as tqdm_module

    original = tqdm_module.tqdm
    caplog.set_level(logging.INFO, logger="lm_eval")
    if quiet:
        monkeypatch.setenv("PUZZLE_PROGRESS", "0")
    else:
        monkeypatch.delenv("PUZZLE_PROGRESS", raising=False)
    capfd.readouterr()
    results = evaluate(
        model, tokenizer, ["puzzle_next_line", "puzzle_identifiers"], limit=2, batch_size=4, manager=manager
    )
    err = capfd.readouterr().err
    lines = [record.getMessage() for record in caplog.records if record.name.startswith("lm_eval")]
    assert results["n-samples"]["puzzle_next_line"]["effective"] == 2
    if quiet:
        assert err == "" and lines == [], (err, lines)
    else:
        assert "Running loglikelihood requests" in err, err
        assert any("Custom kwargs" in line for line in lines), lines
    assert tqdm_module.tqdm is original and logging.getLogger("lm_eval").level == logging.INFO
