"""Token batches for every stage that needs them: calibration, blockwise and global distillation, scoring.

Sources are text files (`.txt`, `.text`, `.md`: documents separated by blank lines), JSONL files
(`.jsonl`: one document per line, its text under `text_field`), already tokenised safetensors files
(`.safetensors`: a tensor `tensor_name`, 1-D a token stream, 2-D one document per row; a 1-D stream with a
`document_offsets` tensor beside it has those document boundaries) and `datasets`
datasets saved to disk (`save_to_disk`; needs the `data` extra). A folder that is not a saved dataset
stands for the files with those suffixes under it, in sorted order. Text is tokenised with the parent's
own tokenizer (a local directory read by `transformers.AutoTokenizer`, never the hub), each document
followed by the tokenizer's EOS token.

Documents are split into train and held-out by a seeded hash of their tokens, so the two never share a
document, a repeated document lands on one side only, and a document keeps its side when more data is
added. A test split (`test_fraction`, optional) takes the held-out documents whose hash falls under a smaller
threshold out of the held-out split, so it shares no document with it or with train (the demo corpus's
documents are its files), and train is the same with or without it. Each split's documents are packed end to end into one stream and cut into sequences of `seq_len`
tokens (the tail shorter than one sequence is dropped). Batches are `[batch_size, seq_len]` int64 in a
seeded order per epoch; under torch.distributed each step's global batch of `batch_size * world`
sequences is cut into one slice per rank, so the ranks' shares are disjoint, their union is the step's
global batch, and the order depends on the global batch size only (a run resumed on another number of
ranks with the same global batch continues on the same sequences). A `BatchStream` knows its position
(epoch, step); its `state_dict()` restarts another stream exactly where it stopped.

Tokenisation is cached per source file as safetensors (`tokens` int32, `offsets` int64 document
boundaries) in a cache directory the caller names, written atomically, keyed by the file's and the
tokenizer's content; nothing is written beside the inputs or into the tokenizer's (parent's) directory.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from puzzle import dist
from puzzle.artifacts import fingerprint_file, fingerprint_json
from puzzle.files import atomic_write
from puzzle.progress import progress

FORMAT_VERSION = 1  # of the cache files and of what `fingerprint()` covers
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl",)
TOKEN_SUFFIXES = (".safetensors",)
# Files that define a tokenizer (hashed for fingerprints; a parent's weights beside them are not).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "*.model",
    "*.tiktoken",
)
# What `Dataset.save_to_disk` / `DatasetDict.save_to_disk` leave in their folder.
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_TOKENISE_CHUNK = 1024  # documents per tokenizer call
# In a tokenised safetensors file: [documents + 1] int64 boundaries of the 1-D stream (0 first, its length last).
DOCUMENT_OFFSETS = "document_offsets"

_log = logging.getLogger(__name__)


class DataError(ValueError):
    """Training data that exists but cannot be used (empty, malformed, too small, wrong tensor)."""


# ----------------------------------------------------------------------------------------------------------
# Tokenizer.


def tokenizer_files(directory: Path) -> list[Path]:
    """The tokenizer files (TOKENIZER_FILES) in `directory`, sorted; empty when it holds no tokenizer."""
    found = {path for pattern in TOKENIZER_FILES for path in directory.glob(pattern) if path.is_file()}
    return sorted(found)


def load_tokenizer(directory: str | Path) -> Any:
    """The tokenizer saved in `directory` (a parent checkpoint or a tokenizer folder), read offline.

    Raises FileNotFoundError when the folder is missing, DataError when it holds no tokenizer, or one
    without an EOS token (documents are joined with it).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory} does not exist (or is not a directory)")
    if not tokenizer_files(directory):
        raise DataError(
            f"no tokenizer in {directory}: expected one of {', '.join(TOKENIZER_FILES)} "
            "(the parent checkpoint's tokenizer files)"
        )
    from transformers import AutoTokenizer  # import on use: most stages never tokenise

    try:
        # trust_remote_code=False: a tokenizer needs no code, and transformers would otherwise ask (and wait
        # 15 s) whether to run the code a nemotron_h_puzzle config.json names, since it reads config.json too.
        tokenizer = AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError) as error:
        raise DataError(f"cannot load the tokenizer in {directory}: {error}") from error
    if tokenizer.eos_token_id is None:
        raise DataError(f"the tokenizer in {directory} has no EOS token; documents are joined with it")
    return tokenizer


def fingerprint_tokenizer(directory: str | Path) -> str:
    """sha256 over the tokenizer files in `directory` (names and bytes), not over anything else there."""
    directory = Path(directory)
    return fingerprint_json({path.name: fingerprint_file(path) for path in tokenizer_files(directory)})


# ----------------------------------------------------------------------------------------------------------
# Sources.


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in _DATASET_MARKERS)


def resolve_sources(sources: str | Path | Sequence[str | Path]) -> list[Path]:
    """The source files and saved datasets that `sources` names, in order (folders expanded, sorted).

    Raises FileNotFoundError for a missing path, DataError for a file of unknown type or a folder with
    no data in it.
    """
    items = [sources] if isinstance(sources, (str, Path)) else list(sources)
    if not items:
        raise DataError("no data sources given")
    known = TEXT_SUFFIXES + JSONL_SUFFIXES + TOKEN_SUFFIXES
    resolved: list[Path] = []
    for item in items:
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(f"data source {path} does not exist")
        if _is_saved_dataset(path):
            resolved.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in known)
            if not found:
                raise DataError(f"data folder {path} holds no data files (looked for {', '.join(known)})")
            resolved.extend(found)
        elif path.suffix.lower() in known:
            resolved.append(path)
        else:
            raise DataError(f"data source {path}: unknown file type {path.suffix!r}; expected one of {known}")
    return resolved


def fingerprint_source(path: Path) -> str:
    """sha256 of a source file, or of every file of a saved dataset (relative names and bytes)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return fingerprint_json({str(p.relative_to(path)): fingerprint_file(p) for p in files})
    return fingerprint_file(path)


@dataclass(frozen=True)
class Documents:
    """Token documents end to end: `tokens` [total] int32, document i is `tokens[offsets[i]:offsets[i+1]]`."""

    tokens: torch.Tensor
    offsets: torch.Tensor  # [documents + 1] int64, offsets[0] == 0

    @staticmethod
    def from_lists(documents: Sequence[Sequence[int]]) -> Documents:
        lengths = torch.tensor([0] + [len(d) for d in documents], dtype=torch.int64)
        tokens = torch.tensor([t for d in documents for t in d], dtype=torch.int32)
        return Documents(tokens, lengths.cumsum(0))

    @staticmethod
    def concat(parts: Sequence[Documents]) -> Documents:
        tokens = torch.cat([p.tokens for p in parts])
        shifts = torch.tensor([0] + [p.tokens.numel() for p in parts]).cumsum(0)
        offsets = torch.cat(
            [torch.zeros(1, dtype=torch.int64)] + [p.offsets[1:] + s for p, s in zip(parts, shifts)]
        )
        return Documents(tokens, offsets)

    def __len__(self) -> int:
        return self.offsets.numel() - 1


def _read_text(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    documents = [block.strip("\n") for block in text.split("\n\n")]
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise DataError(f"text file {path} is empty (no text to tokenise)")
    return documents


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    documents = []
    seen_record = False
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            seen_record = True
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}, line {number}: not JSON ({error.msg})") from error
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}, line {number}: no field {text_field!r} (found {keys})")
            text = record[text_field]
            if not isinstance(text, str):
                raise DataError(
                    f"{path}, line {number}: field {text_field!r} is {type(text).__name__}, not a string"
                )
            if text:
                documents.append(text)
    if not seen_record:
        raise DataError(f"JSONL file {path} is empty (no records)")
    if not documents:
        raise DataError(f"JSONL file {path} has no text: every {text_field!r} is empty")
    return documents


def _read_saved_dataset(path: Path, text_field: str, dataset_split: str | None) -> list[str] | Documents:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"reading the saved dataset {path} needs the `datasets` package: pip install 'puzzle-nas[data]'"
        ) from error
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        names = sorted(loaded)
        name = dataset_split or ("train" if "train" in loaded else None)
        if name is None or name not in loaded:
            raise DataError(f"saved dataset {path} has splits {names}: choose one with dataset_split=")
        loaded = loaded[name]
    columns = loaded.column_names
    if len(loaded) == 0:
        raise DataError(f"saved dataset {path} is empty (no rows)")
    if text_field in columns:
        texts = [t for t in loaded[text_field] if t]
        if not texts:
            raise DataError(f"saved dataset {path} has no text: every {text_field!r} is empty")
        return texts
    if "input_ids" in columns:  # already tokenised
        return Documents.from_lists(loaded["input_ids"])
    raise DataError(f"saved dataset {path} has no column {text_field!r} or 'input_ids' (found {columns})")


def _tokenise(texts: list[str], tokenizer: Any, path: Path) -> Documents:
    eos = tokenizer.eos_token_id
    parts = []  # one Documents per chunk: Python lists of ids live for one chunk only
    chunks = range(0, len(texts), _TOKENISE_CHUNK)
    for start in progress(chunks, desc=f"tokenising {path.name}", unit="chunk"):
        encoded = tokenizer(texts[start : start + _TOKENISE_CHUNK], add_special_tokens=False, verbose=False)
        parts.append(Documents.from_lists([[*ids, eos] for ids in encoded["input_ids"]]))
    return Documents.concat(parts)


def _read_token_file(path: Path, tensor_name: str, seq_len: int, vocab_size: int | None) -> Documents:
    """A tokenised safetensors file: 2-D rows are documents; a 1-D stream is split at its `document_offsets`
    when the file has them, else cut into `seq_len` documents."""
    offsets = None
    try:
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
            if tensor_name not in names:
                raise DataError(f"{path} has no tensor {tensor_name!r} (it holds {names or 'no tensors'})")
            tokens = handle.get_tensor(tensor_name)
            if DOCUMENT_OFFSETS in names:
                offsets = handle.get_tensor(DOCUMENT_OFFSETS)
    except SafetensorError as error:
        raise DataError(f"{path} is not a readable safetensors file: {error}") from error
    if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint16, torch.uint8, torch.uint32):
        raise DataError(f"{path}: tensor {tensor_name!r} is {tokens.dtype}; token ids must be integers")
    if tokens.dim() not in (1, 2):
        raise DataError(f"{path}: tensor {tensor_name!r} has shape {list(tokens.shape)}; expected 1-D or 2-D")
    if tokens.numel() == 0:
        raise DataError(f"{path}: tensor {tensor_name!r} is empty (no tokens)")
    tokens = tokens.to(torch.int64)
    low, high = int(tokens.min()), int(tokens.max())
    limit = vocab_size if vocab_size is not None else 2**31
    if low < 0 or high >= limit:
        raise DataError(
            f"{path}: tensor {tensor_name!r} holds token ids in [{low}, {high}], outside [0, {limit})"
            + (" (the tokenizer's vocabulary)" if vocab_size is not None else "")
        )
    total = tokens.numel()
    if offsets is not None:
        _check_offsets(path, offsets, tokens, total)
        return Documents(tokens.to(torch.int32), offsets.to(torch.int64))
    if tokens.dim() == 2:
        offsets = torch.arange(0, total + 1, tokens.shape[1], dtype=torch.int64)
    else:
        offsets = torch.cat([torch.arange(0, total, seq_len), torch.tensor([total])]).to(torch.int64)
    return Documents(tokens.flatten().to(torch.int32), offsets)


def _check_offsets(path: Path, offsets: torch.Tensor, tokens: torch.Tensor, total: int) -> None:
    where = f"{path}: tensor {DOCUMENT_OFFSETS!r}"
    if tokens.dim() != 1:
        raise DataError(f"{where} needs a 1-D token stream, found shape {list(tokens.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 2 or offsets.is_floating_point() or offsets.is_complex():
        raise DataError(
            f"{where} must be 1-D integer document boundaries [documents + 1], "
            f"found {offsets.dtype} of shape {list(offsets.shape)}"
        )
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last != total or bool((offsets.diff() < 0).any()):
        raise DataError(
            f"{where} must rise from 0 to the stream's length ({total}), found {first} ... {last}"
            + (" (not non-decreasing)" if bool((offsets.diff() < 0).any()) else "")
        )


# ----------------------------------------------------------------------------------------------------------
# Cache of tokenised sources.


def input_holding(directory: Path, sources: Sequence[str | Path], tokenizer_dir: Path | None) -> Path | None:
    """The input that `directory` (a token cache or a run directory) is or lies inside, or None: a source
    directory (rescanned later, it would read the run's files as data), a source file (writing there would
    overwrite it) or the tokenizer's folder; `sources` as given (folders not expanded). A folder that merely
    holds a data file is not an input: `project/data.jsonl` with the run in `project/runs/x` is the ordinary
    layout. `RunConfig.validate_paths` checks the same before a run starts."""
    resolved = directory.resolve()
    inputs = [Path(p).resolve() for p in sources]
    if tokenizer_dir is not None:
        inputs.append(tokenizer_dir.resolve())
    return next((place for place in inputs if resolved == place or place in resolved.parents), None)


def _check_cache_dir(cache_dir: Path, sources: Sequence[str | Path], tokenizer_dir: Path | None) -> None:
    place = input_holding(cache_dir, sources, tokenizer_dir)
    if place is not None:
        raise DataError(
            f"cache directory {cache_dir} is or lies inside {place}, an input (a data source or the parent's "
            "tokenizer); choose a cache directory of its own (e.g. in the run directory)"
        )


def _load_cache(path: Path, key: str) -> Documents | None:
    try:
        with safe_open(str(path), framework="pt") as handle:
            if (handle.metadata() or {}).get("key") != key:
                return None
            return Documents(handle.get_tensor("tokens"), handle.get_tensor("offsets"))
    except (SafetensorError, OSError, KeyError) as error:
        _log.info("tokenising again: cache file %s unreadable (%s)", path, error)
        return None


def _documents_of(
    path: Path,
    *,
    tokenizer: Any,
    tokenizer_fingerprint: str | None,
    source_fingerprint: str,
    text_field: str,
    tensor_name: str,
    dataset_split: str | None,
    seq_len: int,
    cache_dir: Path | None,
) -> Documents:
    if path.is_file() and path.suffix.lower() in TOKEN_SUFFIXES:
        vocab = len(tokenizer) if tokenizer is not None else None
        return _read_token_file(path, tensor_name, seq_len, vocab)
    if path.is_file() and path.stat().st_size == 0:
        raise DataError(f"data file {path} is empty")
    if tokenizer is None and not _is_saved_dataset(path):
        raise DataError(f"{path} holds text: pass tokenizer= (the parent checkpoint's directory)")
    key = fingerprint_json(
        {
            "format": FORMAT_VERSION,
            "source": source_fingerprint,
            "tokenizer": tokenizer_fingerprint,
            "text_field": text_field,
            "dataset_split": dataset_split,
        }
    )
    cache_file = cache_dir / f"{path.stem}-{key[:24]}.safetensors" if cache_dir is not None else None
    if cache_file is not None and cache_file.is_file():
        cached = _load_cache(cache_file, key)
        if cached is not None:
            return cached
    if _is_saved_dataset(path):
        read = _read_saved_dataset(path, text_field, dataset_split)
        if isinstance(read, Documents):
            return read
        if tokenizer is None:
            raise DataError(
                f"saved dataset {path} holds text: pass tokenizer= (the parent checkpoint's directory)"
            )
        texts = read
    elif path.suffix.lower() in JSONL_SUFFIXES:
        texts = _read_jsonl(path, text_field)
    else:
        texts = _read_text(path)
    documents = _tokenise(texts, tokenizer, path)
    if cache_file is not None:
        tensors = {"tokens": documents.tokens, "offsets": documents.offsets}
        atomic_write(
            cache_file, lambda tmp: save_file(tensors, tmp, metadata={"key": key, "source": str(path)})
        )
    return documents


# ----------------------------------------------------------------------------------------------------------
# Split, packing, order.


def held_out_documents(documents: Documents, fraction: float, seed: int) -> torch.Tensor:
    """[documents] bool: True for the held-out ones, decided by a seeded hash of each document's tokens.

    A document's side depends only on its tokens, `seed` and `fraction`, never on its position or on
    the other documents; a larger fraction keeps every document held out by a smaller one held out.
    """
    if fraction <= 0:
        return torch.zeros(len(documents), dtype=torch.bool)
    tokens = documents.tokens.numpy().astype("<i4", copy=False)
    bounds = documents.offsets.tolist()
    salt = seed.to_bytes(8, "little", signed=True)
    threshold = fraction * 2.0**64
    held = [
        int.from_bytes(hashlib.blake2b(tokens[s:e].tobytes(), digest_size=8, salt=salt).digest(), "little")
        < threshold
        for s, e in itertools.pairwise(bounds)
    ]
    return torch.tensor(held, dtype=torch.bool)


@dataclass(frozen=True)
class Position:
    """Where a batch stream is: the next batch is step `step` (0-based, counted in global steps) of `epoch`."""

    epoch: int = 0
    step: int = 0


def epoch_order(sequences: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of `sequences` indices that epoch `epoch` visits under `seed` (numpy PCG64)."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, found seed={seed}, epoch={epoch}")
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(sequences)


class TokenSplit:
    """One split's packed sequences, `sequences` [N, seq_len] int32, and the batches drawn from them."""

    def __init__(self, name: str, sequences: torch.Tensor, fingerprint: str, description: str) -> None:
        self.name = name
        self.sequences = sequences
        self.seq_len = sequences.shape[1]
        self._fingerprint = fingerprint
        self._description = description

    def __len__(self) -> int:
        return self.sequences.shape[0]

    @property
    def tokens(self) -> int:
        """Tokens in the packed sequences (the dropped tail not counted)."""
        return self.sequences.numel()

    def fingerprint(self) -> str:
        """sha256 of the data this split is drawn from and which split it is (for reuse keys)."""
        return fingerprint_json({"data": self._fingerprint, "split": self.name})

    def steps_per_epoch(self, batch_size: int, world: int = 1) -> int:
        """Global steps in one epoch: each takes `batch_size * world` sequences (the rest is dropped)."""
        return len(self) // (batch_size * world)

    def batches(
        self,
        batch_size: int,
        seed: int = 0,
        *,
        rank: int | None = None,
        world: int | None = None,
        start: Position | Mapping[str, Any] | None = None,
        epochs: int | None = None,
    ) -> BatchStream:
        """This rank's batches, [batch_size, seq_len] int64 on the CPU, from `start` (a `Position` or a
        `BatchStream.state_dict()`) to the end of epoch `epochs - 1` (forever when None).

        `rank` and `world` default to `puzzle.dist`'s. Raises DataError when the split has fewer
        sequences than one global step (`batch_size * world`), saying how many tokens it has and needs.
        """
        rank = dist.rank() if rank is None else rank
        world = dist.world_size() if world is None else world
        if batch_size < 1 or world < 1 or not 0 <= rank < world:
            raise ValueError(
                f"need batch_size >= 1 and 0 <= rank < world, found {batch_size}, {rank}, {world}"
            )
        needed = batch_size * world
        if len(self) < needed:
            ranks = f" on each of {world} ranks" if world > 1 else ""
            raise DataError(
                f"the {self.name} split of {self._description} has {self.tokens} tokens in packed sequences "
                f"({len(self)} sequences of {self.seq_len}); one batch of {batch_size} x {self.seq_len}{ranks} "
                f"needs {needed * self.seq_len} tokens"
            )
        if isinstance(start, Mapping):
            start = self._check_state(start, seed, needed)
        return BatchStream(self, batch_size, seed, rank, world, start or Position(), epochs)

    def _check_state(self, state: Mapping[str, Any], seed: int, global_batch: int) -> Position:
        expected = {"data": self.fingerprint(), "seed": seed, "global_batch": global_batch}
        differ = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in expected.items() if state.get(k) != v]
        if differ:
            raise DataError("cannot resume this batch stream from the saved state; " + "; ".join(differ))
        return Position(int(state["epoch"]), int(state["step"]))


class BatchStream(Iterator[torch.Tensor]):
    """An iterator of one rank's batches; `position` is that of the next batch, `state_dict()` saves it."""

    def __init__(
        self,
        split: TokenSplit,
        batch_size: int,
        seed: int,
        rank: int,
        world: int,
        start: Position,
        epochs: int | None,
    ) -> None:
        self.split, self.batch_size, self.seed, self.rank, self.world = split, batch_size, seed, rank, world
        self.epochs = epochs
        self.steps_per_epoch = split.steps_per_epoch(batch_size, world)
        if start.epoch < 0 or not 0 <= start.step < self.steps_per_epoch:
            raise DataError(f"position {start} is outside an epoch of {self.steps_per_epoch} steps")
        self.position = start
        self._order: tuple[int, np.ndarray] | None = None

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> torch.Tensor:
        epoch, step = self.position.epoch, self.position.step
        if self.epochs is not None and epoch >= self.epochs:
            raise StopIteration
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(len(self.split), self.seed, epoch))
        first = (step * self.world + self.rank) * self.batch_size
        indices = torch.from_numpy(self._order[1][first : first + self.batch_size])
        step += 1
        self.position = Position(epoch + 1, 0) if step == self.steps_per_epoch else Position(epoch, step)
        return self.split.sequences[indices].to(torch.int64)

    def state_dict(self) -> dict[str, Any]:
        """The position and what it means (data, seed, global batch size): JSON-ready, for a run's resume file."""
        return {
            "epoch": self.position.epoch,
            "step": self.position.step,
            "seed": self.seed,
            "global_batch": self.batch_size * self.world,
            "data": self.split.fingerprint(),
        }


# ----------------------------------------------------------------------------------------------------------
# Entry point.


class TokenData:
    """Token documents from one or more sources, split into `train` and `held_out` packed sequences."""

    def __init__(
        self,
        documents: Documents,
        held_out: torch.Tensor,
        seq_len: int,
        fingerprint: str,
        description: str,
        test: torch.Tensor | None = None,
    ):
        """`held_out` / `test`: [documents] bool, which documents each split takes (`test` None: no test
        split); a test document is in neither train nor held_out whatever `held_out` says of it."""
        self.documents = documents
        self.seq_len = seq_len
        self._fingerprint = fingerprint
        lengths = documents.offsets.diff()
        testing = torch.zeros_like(held_out) if test is None else test
        token_held = torch.repeat_interleave(held_out & ~testing, lengths)
        token_test = torch.repeat_interleave(testing, lengths)
        self.train = TokenSplit(
            "train", _pack(documents.tokens[~token_held & ~token_test], seq_len), fingerprint, description
        )
        self.held_out = TokenSplit(
            "held_out", _pack(documents.tokens[token_held], seq_len), fingerprint, description
        )
        self.test_documents = testing  # [documents] bool, for checks that no other split reads them
        self.test: TokenSplit | None = (
            None
            if test is None
            else TokenSplit("test", _pack(documents.tokens[token_test], seq_len), fingerprint, description)
        )

    @classmethod
    def load(
        cls,
        sources: str | Path | Sequence[str | Path],
        *,
        seq_len: int,
        tokenizer: str | Path | None = None,
        cache_dir: str | Path | None = None,
        text_field: str = "text",
        tensor_name: str = "input_ids",
        dataset_split: str | None = None,
        held_out_fraction: float = 0.05,
        split_seed: int = 0,
        test_fraction: float = 0.0,
    ) -> TokenData:
        """Read, tokenise (cached in `cache_dir` when given) and split `sources` into sequences of `seq_len`.

        `tokenizer` is a directory with the parent's tokenizer files (needed for text; for token files it
        bounds the ids). `held_out_fraction` of the documents (in expectation) go to `held_out`, chosen by
        a hash seeded with `split_seed`; `test_fraction` (below `held_out_fraction`; 0: none) of them, by the
        same hash, go to `test` instead, and never to `held_out`. Under torch.distributed rank 0 tokenises and fills the cache
        first, then the other ranks read it. Raises FileNotFoundError for missing paths and DataError for
        empty or malformed sources or fewer tokens than one sequence.
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, found {seq_len}")
        if not 0 <= held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in [0, 1), found {held_out_fraction}")
        if test_fraction < 0 or (test_fraction and test_fraction >= held_out_fraction):
            raise ValueError(
                f"test_fraction must be in [0, held_out_fraction = {held_out_fraction}) (the test documents "
                f"are some of the held-out ones), found {test_fraction}"
            )
        paths = resolve_sources(sources)
        tokenizer_dir = Path(tokenizer) if tokenizer is not None else None
        loaded_tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
        tokenizer_fingerprint = fingerprint_tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
        cache = Path(cache_dir) if cache_dir is not None else None
        if cache is not None:
            given = [sources] if isinstance(sources, (str, Path)) else list(sources)
            _check_cache_dir(cache, given, tokenizer_dir)
        source_fingerprints = [fingerprint_source(p) for p in paths]
        with dist.main_process_first():
            parts = [
                _documents_of(
                    path,
                    tokenizer=loaded_tokenizer,
                    tokenizer_fingerprint=tokenizer_fingerprint,
                    source_fingerprint=source_fingerprint,
                    text_field=text_field,
                    tensor_name=tensor_name,
                    dataset_split=dataset_split,
                    seq_len=seq_len,
                    cache_dir=cache,
                )
                for path, source_fingerprint in zip(paths, source_fingerprints)
            ]
        documents = Documents.concat(parts)
        description = ", ".join(str(p) for p in paths[:3]) + (
            f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        )
        if documents.tokens.numel() < seq_len:
            raise DataError(
                f"{description}: {documents.tokens.numel()} tokens, fewer than one sequence of {seq_len}"
            )
        fingerprint = fingerprint_json(
            {
                "format": FORMAT_VERSION,
                "sources": source_fingerprints,
                "tokenizer": tokenizer_fingerprint,
                "text_field": text_field,
                "tensor_name": tensor_name,
                "dataset_split": dataset_split,
                "seq_len": seq_len,
                "held_out_fraction": held_out_fraction,
                "split_seed": split_seed,
                # Only when set, so that the data of runs made before the test split keep their fingerprint.
                **({"test_fraction": test_fraction} if test_fraction else {}),
            }
        )
        held_out = held_out_documents(documents, held_out_fraction, split_seed)
        # The same hash under a lower threshold: a subset of the held-out documents, so train stays the same.
        test = held_out_documents(documents, test_fraction, split_seed) if test_fraction else None
        return cls(documents, held_out, seq_len, fingerprint, description, test)

    def fingerprint(self) -> str:
        """sha256 of the source files, the tokenizer files and the settings (for `puzzle.artifacts` reuse keys)."""
        return self._fingerprint


def _pack(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[n] tokens -> [n // seq_len, seq_len], the tail shorter than one sequence dropped."""
    count = tokens.numel() // seq_len
    return tokens[: count * seq_len].view(count, seq_len)
