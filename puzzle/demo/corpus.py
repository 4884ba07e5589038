"""The demo's corpus: this Python's standard library `.py` sources, byte-level tokenised, one document per file.

Every machine that runs puzzle has it, so the demo needs no download. The stdlib differs a little between
Python builds, so the corpus carries a fingerprint (every file's relative path and bytes, and the
tokenizer's version) that keys the caches built from it and is recorded in the parent's metadata.

The tokenizer is byte-level: token i < 256 is byte i, then BOS (256) and EOS (257); each file's bytes are
followed by EOS, as `puzzle.data` joins documents. It is also written as a transformers tokenizer
(`tokenizer.json`, GPT-2's byte-to-unicode alphabet and no merges) so later stages decode text with
`puzzle.data.load_tokenizer` like any parent's.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from puzzle.files import atomic_write, atomic_write_bytes
from puzzle.presets.demo import EOS_ID  # the demo parent's vocabulary, kept beside it

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
TOKENIZER_VERSION = 1  # of the byte-level scheme above; part of the corpus fingerprint
FORMAT_VERSION = 1  # of the corpus file
CORPUS_FILE = "corpus.safetensors"
TOKEN_TENSOR = "input_ids"  # puzzle.data's default tensor_name
# Folders that are not library code (test suites, installed packages, caches): left out everywhere.
SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "config-3"}
)


class CorpusError(ValueError):
    """The standard library sources cannot be found or read."""


def encode(data: bytes) -> list[int]:
    """Bytes -> token ids (one per byte)."""
    return list(data)


def decode(ids: list[int]) -> bytes:
    """Token ids -> bytes; BOS and EOS are dropped."""
    return bytes(i for i in ids if i < 256)


def stdlib_root() -> Path:
    """The folder of this Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The `.py` files under `root` (default: the stdlib), sorted by relative path, skipping `SKIPPED_DIRS`.

    Symbolic links are not followed, so the list depends only on the tree itself.
    """
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise CorpusError(f"the standard library folder {root} does not exist")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("config-"))
        found.extend(Path(folder, name) for name in files if name.endswith(".py"))
    if not found:
        raise CorpusError(f"no .py files under {root}: is this a Python standard library?")
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


@dataclass(frozen=True)
class Corpus:
    """The files' bytes, in order, and what identifies them."""

    root: Path
    names: tuple[str, ...]  # relative posix paths
    contents: tuple[bytes, ...]

    @property
    def total_bytes(self) -> int:
        return sum(len(c) for c in self.contents)

    def fingerprint(self) -> str:
        """sha256 over the tokenizer version and each file's relative path and content hash."""
        from puzzle.artifacts import fingerprint_json  # imports torch: not for `puzzle.presets`

        return fingerprint_json(
            {
                "format": FORMAT_VERSION,
                "tokenizer": TOKENIZER_VERSION,
                "files": [[n, hashlib.sha256(c).hexdigest()] for n, c in zip(self.names, self.contents)],
            }
        )


def read_corpus(root: str | Path | None = None, max_files: int | None = None) -> Corpus:
    """Read the stdlib's `.py` files (the first `max_files` of the sorted list when given)."""
    root = Path(root) if root is not None else stdlib_root()
    files = stdlib_files(root)[:max_files]
    contents = []
    for path in files:
        try:
            contents.append(path.read_bytes())
        except OSError as error:
            raise CorpusError(f"cannot read {path}: {error}") from error
    names = tuple(path.relative_to(root).as_posix() for path in files)
    return Corpus(root, names, tuple(contents))


def corpus_tensors(corpus: Corpus) -> dict[str, Any]:
    """{"input_ids": [total] int16 stream (each file's bytes then EOS), "document_offsets": [files + 1] int64}."""
    import numpy as np
    import torch

    parts, lengths = [], [0]
    eos = np.array([EOS_ID], dtype=np.int16)
    for content in corpus.contents:
        parts.append(np.frombuffer(content, dtype=np.uint8).astype(np.int16))
        parts.append(eos)
        lengths.append(len(content) + 1)
    tokens = torch.from_numpy(np.concatenate(parts))
    offsets = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    from puzzle.data import DOCUMENT_OFFSETS

    return {TOKEN_TENSOR: tokens, DOCUMENT_OFFSETS: offsets}


def write_tokenizer(directory: str | Path) -> Path:
    """Write the byte-level tokenizer as transformers files (tokenizer.json, tokenizer_config.json) into `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()  # byte -> printable character, as GPT-2's byte-level BPE
    tokenizer = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS_TOKEN, EOS_TOKEN])  # ids 256, 257
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory


@dataclass(frozen=True)
class CorpusFiles:
    """A tokenised corpus on disk: the safetensors file `puzzle.data.TokenData.load` reads, and its tokenizer."""

    path: Path
    tokenizer_dir: Path
    fingerprint: str
    files: int
    tokens: int


def build_corpus(cache_dir: str | Path, root: str | Path | None = None) -> CorpusFiles:
    """The tokenised stdlib corpus under `cache_dir/<fingerprint>/`, written (atomically) unless already there."""
    import json

    from safetensors.torch import save_file

    corpus = read_corpus(root)
    fingerprint = corpus.fingerprint()
    folder = Path(cache_dir) / fingerprint[:16]
    path, tokenizer_dir, info = folder / CORPUS_FILE, folder / "tokenizer", folder / "corpus.json"
    summary = {
        "fingerprint": fingerprint,
        "root": str(corpus.root),
        "files": len(corpus.names),
        "tokens": corpus.total_bytes + len(corpus.names),
    }
    done = info.is_file() and json.loads(info.read_text()).get("fingerprint") == fingerprint
    if not done:
        tensors = corpus_tensors(corpus)
        metadata = {"fingerprint": fingerprint, "root": str(corpus.root)}
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
        write_tokenizer(tokenizer_dir)
        atomic_write_bytes(info, (json.dumps(summary, indent=2) + "\n").encode())  # last: marks it complete
    return CorpusFiles(path, tokenizer_dir, fingerprint, summary["files"], summary["tokens"])
