"""The demo parent: a deterministic stdlib corpus, a byte tokenizer that round-trips, reproducible training, a
cache that loads without training, and a checkpoint transformers' NemotronH reads with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close
from transformers import NemotronHForCausalLM

from puzzle.data import DOCUMENT_OFFSETS, DataError, TokenData, load_tokenizer
from puzzle.demo.corpus import (
    EOS_ID,
    TOKEN_TENSOR,
    build_corpus,
    decode,
    encode,
    read_corpus,
    stdlib_files,
    stdlib_root,
    write_tokenizer,
)
from puzzle.demo.parent import RECORD_FILE, TrainSettings, demo_parent, train_parent
from puzzle.nemotron_h.config import transformers_incompatibilities
from puzzle.presets import get_preset
from puzzle.presets.demo import demo_spec

# A small stdlib package keeps the tests fast; the corpus code is the same for the whole library.
SMALL_ROOT = stdlib_root() / "email"
TINY_SETTINGS = TrainSettings(
    seq_len=32, batch_size=4, steps=25, lr=1e-2, warmup_steps=3, held_out_sequences=4
)


def tiny_spec():
    return demo_spec("ME*E", 32, num_experts=4, top_k=2, num_heads=4)


def test_stdlib_corpus_is_deterministic_and_skips_tests():
    files = stdlib_files()
    names = [p.relative_to(stdlib_root()).as_posix() for p in files]
    assert names == sorted(names) and len(names) > 100
    assert not any(part in ("test", "tests", "site-packages") for n in names for part in n.split("/"))
    assert "json/decoder.py" in names and "email/parser.py" in names
    first, second = read_corpus(), read_corpus()
    assert first.fingerprint() == second.fingerprint()
    assert read_corpus(SMALL_ROOT).fingerprint() != first.fingerprint()


def test_byte_tokenizer_round_trips(tmp_path):
    data = bytes(range(256)) * 2 + "é ✓ \t\r\n".encode()
    assert decode(encode(data)) == data and max(encode(data)) < 256
    tokenizer = load_tokenizer(write_tokenizer(tmp_path / "tok"))  # as later stages load it
    assert (len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id) == (258, 256, 257)
    text = 'def f(x):\n    """é ✓"""\r\n\treturn x  # 0\x00\x7f\n'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == encode(text.encode())
    assert tokenizer.decode(ids) == text


def test_corpus_file_keeps_one_document_per_file(tmp_path):
    corpus = build_corpus(tmp_path / "cache", SMALL_ROOT)
    files = stdlib_files(SMALL_ROOT)
    data = TokenData.load(corpus.path, seq_len=16, tokenizer=corpus.tokenizer_dir, held_out_fraction=0.3)
    assert len(data.documents) == len(files) == corpus.files
    for index, path in enumerate(files):
        start, end = data.documents.offsets[index : index + 2].tolist()
        assert data.documents.tokens[start:end].tolist() == [*path.read_bytes(), EOS_ID]
    again = build_corpus(tmp_path / "cache", SMALL_ROOT)  # found, not rewritten
    assert again == corpus and again.path.stat().st_mtime_ns == corpus.path.stat().st_mtime_ns


def test_bad_document_offsets_are_named(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "bad.safetensors"
    save_file({TOKEN_TENSOR: torch.arange(10), DOCUMENT_OFFSETS: torch.tensor([0, 4, 9])}, str(path))
    with pytest.raises(DataError, match=r"document_offsets.*length \(10\)"):
        TokenData.load(path, seq_len=4)


def test_presets_are_registered_and_transformers_compatible():
    for name in ("demo", "demo-quick"):
        spec = get_preset(name)
        assert set(spec.pattern) == {"M", "E", "*"} and spec.vocab_size == 258
        assert transformers_incompatibilities(spec) == []


def test_training_is_deterministic_and_learns(tmp_path):
    corpus = build_corpus(tmp_path / "cache", SMALL_ROOT)
    data = TokenData.load(corpus.path, seq_len=32, tokenizer=corpus.tokenizer_dir, held_out_fraction=0.2)
    first, record = train_parent(tiny_spec(), data, TINY_SETTINGS, seed=3, show_progress=False)
    second, again = train_parent(tiny_spec(), data, TINY_SETTINGS, seed=3, show_progress=False)
    state = second.state_dict()
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert record["loss_curve"] == again["loss_curve"]
    curve = record["loss_curve"]
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5 - 0.5
    assert record["held_out_loss"] < curve[0]


def test_cache_hit_loads_without_training_and_transformers_agrees(tmp_path):
    kwargs = dict(cache_dir=tmp_path, spec=tiny_spec(), settings=TINY_SETTINGS, corpus_root=SMALL_ROOT)
    model, path, record, _ = demo_parent(progress=False, **kwargs)
    assert record["from_cache"] is False
    assert record["held_out_loss"] < record["unigram_held_out_loss"]
    written = (path / RECORD_FILE).stat().st_mtime_ns
    cached, cached_path, cached_record, _ = demo_parent(progress=False, **kwargs)
    assert cached_path == path and cached_record["from_cache"] is True
    assert (path / RECORD_FILE).stat().st_mtime_ns == written  # nothing trained or written again
    assert {k: v for k, v in cached_record.items() if k != "from_cache"} == json.loads(
        (path / RECORD_FILE).read_text()
    )
    ids = torch.tensor([encode(b"import os\nprint(os.getcwd())\n")])
    with torch.no_grad():
        ours = model(ids).logits
        assert torch.equal(cached(ids).logits, ours)
        theirs = NemotronHForCausalLM.from_pretrained(path).eval()(ids).logits
    assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    tokenizer = load_tokenizer(path)  # the checkpoint carries its tokenizer
    assert tokenizer.decode(ids[0].tolist()) == "import os\nprint(os.getcwd())\n"
    config = json.loads((path / "config.json").read_text())
    assert config["puzzle_demo_corpus"] == record["corpus"]["fingerprint"]
    other = demo_parent(progress=False, seed=1, **kwargs)  # another seed is another entry
    assert other.path != path and other.record["from_cache"] is False
