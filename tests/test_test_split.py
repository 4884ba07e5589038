"""The test split (`data.test_fraction`): held-out documents that no stage of a run reads, not the parent's
training, scoring, search, GKD's evaluations or its checkpoint choice; train stays what it was without it.

Each document of the corpus here is one token repeated (document k: token k), so the tokens of anything read
name the documents it came from, whatever the packing."""

from __future__ import annotations

import copy

import pytest
import torch
from run_helpers import SPEC, make_inputs, write_config
from safetensors.torch import save_file

from puzzle.cli import main
from puzzle.config import ConfigError, load_config_data
from puzzle.data import DOCUMENT_OFFSETS, BatchStream, TokenData

DOCUMENTS = SPEC.vocab_size  # one per token id
LENGTH = 96  # tokens per document: 6 sequences of 16


def _corpus(path) -> None:
    tokens = torch.arange(DOCUMENTS, dtype=torch.int32).repeat_interleave(LENGTH)
    offsets = torch.arange(0, DOCUMENTS * LENGTH + 1, LENGTH, dtype=torch.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": tokens, DOCUMENT_OFFSETS: offsets}, str(path))


def _documents(tensor: torch.Tensor) -> set[int]:
    return set(torch.unique(tensor).tolist())


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("test_split")
    config = make_inputs(root)
    _corpus(root / "documents" / "tokens.safetensors")
    config["data"].update(
        sources=[str(root / "documents")], held_out_fraction=0.3, test_fraction=0.15, held_out_tokens=128
    )
    return root, config


def _load(root, **changes) -> TokenData:
    settings = {"seq_len": 16, "held_out_fraction": 0.3, "split_seed": 0, **changes}
    return TokenData.load(root / "documents", cache_dir=root / "cache", **settings)


def test_the_test_documents_are_in_no_other_split_and_train_is_unchanged(inputs):
    root, _ = inputs
    with_test, without = _load(root, test_fraction=0.15), _load(root)
    test = _documents(with_test.test.sequences)
    held, train = _documents(with_test.held_out.sequences), _documents(with_test.train.sequences)
    assert test and held and train
    assert test == {i for i, t in enumerate(with_test.test_documents.tolist()) if t}
    assert not test & held and not test & train and not held & train
    assert test | held | train == set(range(DOCUMENTS))
    # The test documents are some of the held-out ones: the train split (what the parent trained on) is the
    # same tensor, and the scoring held-out loses exactly the test documents.
    assert torch.equal(with_test.train.sequences, without.train.sequences)
    assert held == _documents(without.held_out.sequences) - test
    assert without.test is None and with_test.fingerprint() != without.fingerprint()
    # A larger test share keeps every test document of a smaller one.
    assert test <= _documents(_load(root, test_fraction=0.25).test.sequences)


def test_no_stage_of_a_run_reads_a_test_document(inputs, tmp_path, monkeypatch):
    root, config = inputs
    config = copy.deepcopy(config)
    config["run_dir"] = str(tmp_path / "run")
    read: dict[str, set[int]] = {}
    original = BatchStream.__next__

    def recording(self):  # every batch any stage draws from any split, by split
        batch = original(self)
        read.setdefault(self.split.name, set()).update(_documents(batch))
        return batch

    monkeypatch.setattr(BatchStream, "__next__", recording)
    torch.set_num_threads(1)
    assert main(["run", str(write_config(tmp_path / "run.yaml", config)), "--quiet"]) == 0
    test = _documents(_load(root, test_fraction=0.15).test.sequences)
    assert set(read) == {"train", "held_out"}  # importance, BLD, GKD train; scores, evals, checkpoint choice
    assert read["train"] and read["held_out"]
    assert not test & (read["train"] | read["held_out"])


def test_a_test_share_outside_the_held_out_one_is_refused(inputs):
    root, config = inputs
    bad = copy.deepcopy(config)
    bad["data"]["test_fraction"] = 0.3
    with pytest.raises(ConfigError, match="test_fraction"):
        load_config_data(bad)
    with pytest.raises(ValueError, match="test_fraction must be in"):
        _load(root, test_fraction=0.4)
