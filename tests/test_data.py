"""Token data: every source format reads, packing, seeded order, a held-out split disjoint from train,
rank shards, exact resume, the cache, and a clear error for every kind of bad input.

The corpus is built from distinct words ("w0", "w1", ...) and the tokenizer is a WordLevel one over them
saved as a real tokenizer directory, so every token id except EOS occurs once: which tokens a split or a
batch holds says exactly which corpus positions it holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from puzzle.data import DataError, Position, TokenData, epoch_order, fingerprint_tokenizer, load_tokenizer

VOCAB = 4000
EOS = 0


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WordLevel tokenizer over "<eos>", "<unk>", "w0" ... saved as a transformers tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": EOS, "<unk>": 1} | {f"w{i}": i + 2 for i in range(VOCAB - 2)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>").save_pretrained(
        directory
    )
    return directory


def corpus(documents: int, words: int, first: int = 0) -> list[str]:
    """`documents` texts of `words` distinct words each, numbered from `first`."""
    return [" ".join(f"w{first + d * words + i}" for i in range(words)) for d in range(documents)]


def ids(texts: list[str]) -> set[int]:
    return {int(word[1:]) + 2 for text in texts for word in text.split()}


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "meta": 1}) + "\n" for t in texts))
    return path


def token_set(tensor: torch.Tensor) -> set[int]:
    return set(tensor.flatten().tolist()) - {EOS}


# ----------------------------------------------------------------------------------------------------------
# Formats and packing.


def test_jsonl_and_text_read_pack_and_agree(tmp_path: Path, tokenizer_dir: Path) -> None:
    texts = corpus(20, 9)  # 20 documents of 9 words + EOS = 200 tokens
    jsonl = write_jsonl(tmp_path / "a.jsonl", texts)
    text = tmp_path / "a.txt"
    text.write_text("\n\n".join(texts) + "\n")
    from_jsonl = TokenData.load(jsonl, seq_len=16, tokenizer=tokenizer_dir, held_out_fraction=0)
    from_text = TokenData.load(text, seq_len=16, tokenizer=tokenizer_dir, held_out_fraction=0)
    assert len(from_jsonl.documents) == 20 and from_jsonl.documents.tokens.numel() == 200
    assert torch.equal(from_jsonl.train.sequences, from_text.train.sequences)
    sequences = from_jsonl.train.sequences
    assert sequences.shape == (200 // 16, 16)  # the 8-token tail is dropped
    # Packed end to end: document d's words, then EOS, then document d + 1's.
    expected = []
    for t in texts:
        expected += [int(w[1:]) + 2 for w in t.split()] + [EOS]
    assert sequences.flatten().tolist() == expected[: 12 * 16]
    assert len(from_jsonl.held_out) == 0


def test_tokenising_in_chunks_equals_one_call(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", corpus(10, 3))
    whole = TokenData.load(path, seq_len=4, tokenizer=tokenizer_dir)
    monkeypatch.setattr("puzzle.data._TOKENISE_CHUNK", 3)  # 10 documents in 4 tokenizer calls
    chunked = TokenData.load(path, seq_len=4, tokenizer=tokenizer_dir)
    assert torch.equal(whole.documents.tokens, chunked.documents.tokens)
    assert torch.equal(whole.documents.offsets, chunked.documents.offsets)
    assert whole.documents.offsets.tolist() == list(range(0, 41, 4))


def test_token_files_1d_and_2d(tmp_path: Path, tokenizer_dir: Path) -> None:
    stream = torch.arange(2, 2 + 100, dtype=torch.int64)
    save_file({"input_ids": stream}, str(tmp_path / "stream.safetensors"))
    save_file({"ids": stream[:96].view(12, 8).to(torch.int32)}, str(tmp_path / "rows.safetensors"))
    one = TokenData.load(tmp_path / "stream.safetensors", seq_len=8, held_out_fraction=0)
    assert torch.equal(one.train.sequences.flatten(), stream[:96].to(torch.int32))
    two = TokenData.load(tmp_path / "rows.safetensors", seq_len=8, tensor_name="ids", tokenizer=tokenizer_dir)
    assert len(two.documents) == 12
    # Rows are documents: each packed sequence is one whole row, on one side of the split.
    rows = {tuple(r) for r in stream[:96].view(12, 8).tolist()}
    both = torch.cat([two.train.sequences, two.held_out.sequences])
    assert {tuple(r) for r in both.tolist()} == rows


def test_folder_of_sources_in_sorted_order(tmp_path: Path, tokenizer_dir: Path) -> None:
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "b.jsonl", corpus(3, 4, first=100))
    (tmp_path / "data" / "a.txt").write_text("\n\n".join(corpus(3, 4)))
    (tmp_path / "data" / "notes.csv").write_text("ignored")
    data = TokenData.load(tmp_path / "data", seq_len=5, tokenizer=tokenizer_dir, held_out_fraction=0)
    assert data.documents.tokens[:4].tolist() == [2, 3, 4, 5]  # a.txt first
    assert token_set(data.documents.tokens) == ids(corpus(3, 4)) | ids(corpus(3, 4, first=100))


def test_saved_dataset(tmp_path: Path, tokenizer_dir: Path) -> None:
    datasets = pytest.importorskip("datasets")
    texts = corpus(10, 7)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    data = TokenData.load(tmp_path / "ds", seq_len=8, tokenizer=tokenizer_dir, held_out_fraction=0)
    assert data.documents.tokens.numel() == 80 and token_set(data.documents.tokens) == ids(texts)


def test_saved_dataset_without_the_package_names_the_extra(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails, as where it is absent
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "dataset_info.json").write_text("{}")
    with pytest.raises(ImportError, match=r"datasets.*puzzle-nas\[data\]"):
        TokenData.load(tmp_path / "ds", seq_len=8, tokenizer=tokenizer_dir)


# ----------------------------------------------------------------------------------------------------------
# Split, order, shards, resume.


@pytest.fixture(scope="module")
def big(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> TokenData:
    path = write_jsonl(tmp_path_factory.mktemp("big") / "big.jsonl", corpus(100, 15))  # 1600 tokens
    return TokenData.load(path, seq_len=8, tokenizer=tokenizer_dir, held_out_fraction=0.2, split_seed=3)


def test_held_out_never_overlaps_train_and_covers_the_corpus(big: TokenData) -> None:
    train, held = token_set(big.train.sequences), token_set(big.held_out.sequences)
    assert train and held and not train & held
    assert 0.1 < len(big.held_out) / (len(big.train) + len(big.held_out)) < 0.3
    # Only the two packed tails (< one sequence each) are missing from the union.
    assert len(ids(corpus(100, 15)) - train - held) < 2 * 8


def test_held_out_is_stable_when_data_grows(tmp_path: Path, tokenizer_dir: Path) -> None:
    small = write_jsonl(tmp_path / "small.jsonl", corpus(40, 5))
    more = write_jsonl(tmp_path / "more.jsonl", corpus(40, 5, first=1000))
    before = TokenData.load(small, seq_len=6, tokenizer=tokenizer_dir, held_out_fraction=0.3)
    after = TokenData.load([more, small], seq_len=6, tokenizer=tokenizer_dir, held_out_fraction=0.3)
    # seq_len == document length: every packed sequence is one whole document.
    assert {tuple(r) for r in before.held_out.sequences.tolist()} <= {
        tuple(r) for r in after.held_out.sequences.tolist()
    }
    assert {tuple(r) for r in before.train.sequences.tolist()} <= {
        tuple(r) for r in after.train.sequences.tolist()
    }
    other_seed = TokenData.load(
        small, seq_len=6, tokenizer=tokenizer_dir, held_out_fraction=0.3, split_seed=1
    )
    assert not torch.equal(other_seed.held_out.sequences, before.held_out.sequences)


def test_same_seed_same_order_other_seed_other_order(big: TokenData) -> None:
    first = torch.stack(list(big.train.batches(4, seed=7, epochs=1)))
    again = torch.stack(list(big.train.batches(4, seed=7, epochs=1)))
    other = torch.stack(list(big.train.batches(4, seed=8, epochs=1)))
    assert first.shape == (len(big.train) // 4, 4, 8) and first.dtype == torch.int64
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    # An epoch visits each sequence at most once; the next epoch is another order.
    rows = [tuple(r) for r in first.flatten(0, 1).tolist()]
    assert len(rows) == len(set(rows)) == len(big.train) - len(big.train) % 4
    two = list(big.train.batches(4, seed=7, epochs=2))
    assert len(two) == 2 * first.shape[0] and not torch.equal(
        torch.stack(two[: first.shape[0]]), torch.stack(two[first.shape[0] :])
    )


def test_rank_shards_are_disjoint_and_make_the_global_batch(big: TokenData) -> None:
    rank0 = list(big.train.batches(3, seed=1, rank=0, world=2, epochs=1))
    rank1 = list(big.train.batches(3, seed=1, rank=1, world=2, epochs=1))
    single = list(big.train.batches(6, seed=1, rank=0, world=1, epochs=1))
    assert len(rank0) == len(rank1) == len(single) == len(big.train) // 6
    assert not token_set(torch.stack(rank0)) & token_set(torch.stack(rank1))
    for a, b, whole in zip(rank0, rank1, single):
        assert torch.equal(torch.cat([a, b]), whole)


def test_resume_from_saved_position_reproduces_the_rest(big: TokenData) -> None:
    uninterrupted = list(big.train.batches(4, seed=5, epochs=2))
    stream = big.train.batches(4, seed=5, epochs=2)
    stop = len(uninterrupted) // 2 + 3  # past the epoch boundary
    for _ in range(stop):
        next(stream)
    state = json.loads(json.dumps(stream.state_dict()))  # as a run's resume file holds it
    assert state["epoch"] == 1
    resumed = list(big.train.batches(4, seed=5, epochs=2, start=state))
    assert len(resumed) == len(uninterrupted) - stop
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[stop:]))
    # Two ranks of 2 resume the same stream as one rank of 4 (same global batch).
    halves = [list(big.train.batches(2, seed=5, rank=r, world=2, epochs=2, start=state)) for r in (0, 1)]
    assert all(torch.equal(torch.cat([a, b]), c) for a, b, c in zip(*halves, resumed))
    position = Position(state["epoch"], state["step"])
    assert torch.equal(next(big.train.batches(4, seed=5, start=position)), uninterrupted[stop])
    with pytest.raises(DataError, match=r"seed: saved 5, now 6"):
        big.train.batches(4, seed=6, start=state)
    with pytest.raises(DataError, match=r"global_batch: saved 4, now 8"):
        big.train.batches(8, seed=5, start=state)


def test_epoch_order_is_a_seeded_permutation() -> None:
    order = epoch_order(50, seed=2, epoch=0)
    assert sorted(order.tolist()) == list(range(50))
    assert (
        order.tolist()
        == epoch_order(50, seed=2, epoch=0).tolist()
        != epoch_order(50, seed=2, epoch=1).tolist()
    )


# ----------------------------------------------------------------------------------------------------------
# Fingerprint and cache.


def test_fingerprint_follows_sources_tokenizer_and_settings(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", corpus(10, 5))
    base = TokenData.load(path, seq_len=4, tokenizer=tokenizer_dir).fingerprint()
    assert TokenData.load(path, seq_len=4, tokenizer=tokenizer_dir).fingerprint() == base
    assert TokenData.load(path, seq_len=5, tokenizer=tokenizer_dir).fingerprint() != base
    assert TokenData.load(path, seq_len=4, tokenizer=tokenizer_dir, split_seed=1).fingerprint() != base
    write_jsonl(path, corpus(10, 5, first=1))
    assert TokenData.load(path, seq_len=4, tokenizer=tokenizer_dir).fingerprint() != base
    assert len(fingerprint_tokenizer(tokenizer_dir)) == 64


def test_tokenisation_is_cached_in_the_cache_dir_only(tmp_path: Path, tokenizer_dir: Path) -> None:
    (tmp_path / "in").mkdir()
    path = write_jsonl(tmp_path / "in" / "a.jsonl", corpus(10, 5))
    cache = tmp_path / "cache"
    first = TokenData.load(path, seq_len=4, tokenizer=tokenizer_dir, cache_dir=cache)
    cached = list(cache.iterdir())
    assert len(cached) == 1 and cached[0].suffix == ".safetensors"
    assert sorted(p.name for p in (tmp_path / "in").iterdir()) == ["a.jsonl"]
    # The second load reads the cache: the tokenizer is not needed to agree, only its fingerprint.
    again = TokenData.load(path, seq_len=4, tokenizer=tokenizer_dir, cache_dir=cache)
    assert torch.equal(first.train.sequences, again.train.sequences)
    assert list(cache.iterdir()) == cached
    # A damaged cache file is tokenised again and replaced.
    cached[0].write_bytes(b"garbage")
    damaged = TokenData.load(path, seq_len=4, tokenizer=tokenizer_dir, cache_dir=cache)
    assert torch.equal(first.train.sequences, damaged.train.sequences)
    # Changed input: a new cache entry.
    write_jsonl(path, corpus(10, 5, first=1))
    TokenData.load(path, seq_len=4, tokenizer=tokenizer_dir, cache_dir=cache)
    assert len(list(cache.iterdir())) == 2
    # Inside an input: the tokenizer's folder, a data folder given as a source, the data file itself.
    for source, cache_dir in (
        (path, tokenizer_dir / "cache"),
        (tmp_path / "in", tmp_path / "in" / "cache"),
        (path, path),
    ):
        with pytest.raises(DataError, match=r"cache directory .* is or lies inside .*, an input"):
            TokenData.load(source, seq_len=4, tokenizer=tokenizer_dir, cache_dir=cache_dir)
    # A folder that merely holds a data file is no input: project/data.jsonl, project/runs/x/tokens.
    beside = TokenData.load(
        path, seq_len=4, tokenizer=tokenizer_dir, cache_dir=tmp_path / "in" / "runs" / "x"
    )
    assert torch.equal(
        TokenData.load(path, seq_len=4, tokenizer=tokenizer_dir).train.sequences, beside.train.sequences
    )


# ----------------------------------------------------------------------------------------------------------
# Errors.


def test_empty_and_missing_sources(tmp_path: Path, tokenizer_dir: Path) -> None:
    for name in ("empty.txt", "empty.jsonl"):
        (tmp_path / name).write_text("")
        with pytest.raises(DataError, match=rf"{name} is empty"):
            TokenData.load(tmp_path / name, seq_len=4, tokenizer=tokenizer_dir)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"blank.jsonl is empty \(no records\)"):
        TokenData.load(tmp_path / "blank.jsonl", seq_len=4, tokenizer=tokenizer_dir)
    with pytest.raises(FileNotFoundError, match=r"data source .*missing.jsonl does not exist"):
        TokenData.load(tmp_path / "missing.jsonl", seq_len=4, tokenizer=tokenizer_dir)
    (tmp_path / "x.parquet").write_text("?")
    with pytest.raises(DataError, match=r"x.parquet: unknown file type '.parquet'"):
        TokenData.load(tmp_path / "x.parquet", seq_len=4, tokenizer=tokenizer_dir)


def test_missing_or_unusable_tokenizer(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", corpus(3, 3))
    with pytest.raises(FileNotFoundError, match=r"tokenizer directory .*nowhere does not exist"):
        TokenData.load(path, seq_len=4, tokenizer=tmp_path / "nowhere")
    (tmp_path / "bare").mkdir()
    with pytest.raises(DataError, match=r"no tokenizer in .*bare: expected one of tokenizer.json"):
        load_tokenizer(tmp_path / "bare")
    with pytest.raises(DataError, match=r"a.jsonl holds text: pass tokenizer="):
        TokenData.load(path, seq_len=4)


def test_bad_jsonl_lines_name_file_line_and_field(tmp_path: Path, tokenizer_dir: Path) -> None:
    cases = {
        '{"text": "w1"}\n{"text": "w2"\n': r"bad.jsonl, line 2: not JSON",
        '{"text": "w1"}\n\n{"body": "w2"}\n': r"bad.jsonl, line 3: no field 'text' \(found \['body'\]\)",
        '{"text": 5}\n': r"bad.jsonl, line 1: field 'text' is int, not a string",
        '["w1"]\n': r"bad.jsonl, line 1: no field 'text' \(found list\)",
    }
    for content, message in cases.items():
        (tmp_path / "bad.jsonl").write_text(content)
        with pytest.raises(DataError, match=message):
            TokenData.load(tmp_path / "bad.jsonl", seq_len=1, tokenizer=tokenizer_dir)


def test_fewer_tokens_than_one_batch_says_how_many(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", corpus(3, 4))  # 15 tokens
    with pytest.raises(DataError, match=r"15 tokens, fewer than one sequence of 16"):
        TokenData.load(path, seq_len=16, tokenizer=tokenizer_dir)
    data = TokenData.load(path, seq_len=4, tokenizer=tokenizer_dir, held_out_fraction=0)
    with pytest.raises(
        DataError,
        match=r"has 12 tokens in packed sequences \(3 sequences of 4\); one batch of 2 x 4 on each of 2 ranks needs 16 tokens",
    ):
        data.train.batches(2, rank=0, world=2)
    assert len(list(data.train.batches(3, epochs=1))) == 1
    with pytest.raises(DataError, match=r"held_out split .* has 0 tokens"):
        data.held_out.batches(1)


def test_token_file_errors_list_tensors_and_dtypes(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"tokens": torch.arange(10), "mask": torch.ones(10)}, str(path))
    with pytest.raises(DataError, match=r"has no tensor 'input_ids' \(it holds \['mask', 'tokens'\]\)"):
        TokenData.load(path, seq_len=4)
    with pytest.raises(DataError, match=r"tensor 'mask' is torch.float32; token ids must be integers"):
        TokenData.load(path, seq_len=4, tensor_name="mask")
    save_file({"input_ids": torch.tensor([1, VOCAB + 5])}, str(path))
    with pytest.raises(DataError, match=rf"token ids in \[1, {VOCAB + 5}\], outside \[0, {VOCAB}\)"):
        TokenData.load(path, seq_len=1, tokenizer=tokenizer_dir)
    save_file({"input_ids": torch.zeros(0, dtype=torch.int64)}, str(path))
    with pytest.raises(DataError, match=r"tensor 'input_ids' is empty"):
        TokenData.load(path, seq_len=1)
    path.write_bytes(b"not safetensors")
    with pytest.raises(DataError, match=r"t.safetensors is not a readable safetensors file"):
        TokenData.load(path, seq_len=1)


def test_a_remote_code_export_s_tokenizer_loads_without_asking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A nemotron_h_puzzle checkpoint (config.json's auto_map names trust_remote_code files) carries the
    parent's tokenizer: puzzle reads it without transformers asking whether to run that code (a 15 s wait
    on a terminal), as does AutoTokenizer with trust_remote_code=False, and both encode as the parent's."""
    from transformers import AutoTokenizer

    from puzzle.demo.corpus import write_tokenizer
    from puzzle.model import HybridLM
    from puzzle.nemotron_h import save_pretrained
    from puzzle.spec import MLPSpec, ModelSpec

    parent_tokenizer = write_tokenizer(tmp_path / "parent")
    child = HybridLM(ModelSpec(vocab_size=258, hidden_size=16, blocks=(MLPSpec(width=8), MLPSpec(width=12))))
    export = save_pretrained(
        child, tmp_path / "export", model_type="nemotron_h_puzzle", aux_source=parent_tokenizer
    )
    assert "auto_map" in json.loads((export / "config.json").read_text())  # the case transformers asks about
    asked: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "n")

    text = 'def f(x):\n    return "é ✓"  # 0\n'
    expected = load_tokenizer(parent_tokenizer)(text)["input_ids"]
    assert load_tokenizer(export)(text)["input_ids"] == expected
    assert AutoTokenizer.from_pretrained(export, trust_remote_code=False)(text)["input_ids"] == expected
    assert asked == []
