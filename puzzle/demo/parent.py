"""Train (or fetch from the per-user cache) the demo's parent on the stdlib corpus; `python -m puzzle.demo.parent`.

The parent is `puzzle.presets.demo_parent_spec()` (or the quick one), trained from a seeded initialisation
in fp32 with AdamW, a linear warm-up and a cosine decay, on sequences drawn by `puzzle.data` from the
byte-level stdlib corpus (`puzzle.demo.corpus`). Routers are kept balanced without an auxiliary loss, as in
DeepSeek-V3: after each step every MoE block's expert-choice bias moves towards under-used experts.

The cache entry is keyed by the spec, the corpus fingerprint, the training settings, the seed and the
trainer's version: a second demo finds it and loads it at once. It is a NemotronH checkpoint (config.json,
model.safetensors) with the byte-level tokenizer's files and `puzzle_demo.json`, the training record
(settings, loss curve, held-out loss against a unigram baseline, tokens, seconds), written atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from puzzle import __version__
from puzzle.artifacts import fingerprint_json
from puzzle.data import DataError, TokenData
from puzzle.demo.corpus import CorpusFiles, build_corpus
from puzzle.files import atomic_write_bytes, make_staging_dir, remove_stale_staging, swap_directory_into_place
from puzzle.model import HybridLM
from puzzle.nemotron_h.checkpoint import load
from puzzle.presets.demo import BOS_ID, EOS_ID, VOCAB_SIZE, demo_parent_spec, demo_quick_parent_spec
from puzzle.progress import progress_bar
from puzzle.spec import ModelSpec, MoESpec

TRAINER_VERSION = 1  # bump when training changes what a given key would produce
RECORD_FILE = "puzzle_demo.json"
SPLIT_SEED = 0  # later stages evaluate on the same held-out files (the record says which split)


@dataclass(frozen=True)
class TrainSettings:
    """How the parent is trained: `steps` AdamW steps of `batch_size` x `seq_len` tokens."""

    seq_len: int = 256
    batch_size: int = 8
    steps: int = 60
    lr: float = 4e-3
    warmup_steps: int = 6
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    router_bias_rate: float = 1e-3  # per step, towards balanced expert loads
    held_out_sequences: int = 32  # evaluated at the end (and against the unigram baseline)
    held_out_fraction: float = 0.05  # of the files, never trained on

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FULL_SETTINGS = TrainSettings()
QUICK_SETTINGS = TrainSettings(steps=20, lr=5e-3, warmup_steps=4)


class DemoParent(NamedTuple):
    """The trained parent, its checkpoint directory, and its training record (`from_cache` says whether it
    was found there rather than trained now)."""

    model: HybridLM
    path: Path
    record: dict[str, Any]
    corpus: CorpusFiles | None = None  # the tokenised corpus it was trained on (the later stages' data)


def default_cache_dir() -> Path:
    """$PUZZLE_CACHE, else ~/.cache/puzzle (XDG_CACHE_HOME respected)."""
    if os.environ.get("PUZZLE_CACHE"):
        return Path(os.environ["PUZZLE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "puzzle"


def cache_key(spec: ModelSpec, corpus_fingerprint: str, settings: TrainSettings, seed: int) -> str:
    """What a cached parent was made from: spec, corpus, settings, seed, trainer and puzzle versions."""
    return fingerprint_json(
        {
            "spec": spec.to_dict(),
            "corpus": corpus_fingerprint,
            "settings": settings.to_dict(),
            "seed": seed,
            "trainer": TRAINER_VERSION,
            "puzzle": __version__,
        }
    )


def _lr_factor(step: int, settings: TrainSettings) -> float:
    """Linear warm-up to 1, then a cosine down to `min_lr_ratio` at the last step."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    span = max(1, settings.steps - settings.warmup_steps)
    progress = min(1.0, (step - settings.warmup_steps) / span)
    return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def lm_loss(model: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of ids [b, t]."""
    logits = model(ids[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class _RouterBalancer:
    """Counts the experts each MoE router picks and nudges its choice bias towards the under-used ones."""

    def __init__(self, model: HybridLM, rate: float) -> None:
        self.rate = rate
        self.routers = [block.mixer.gate for block in model.layers if isinstance(block.spec, MoESpec)]
        self.loads = [torch.zeros(r.e_score_correction_bias.numel()) for r in self.routers]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, index: int) -> Any:
        def count(module: Any, inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            indices = output[1].detach().reshape(-1)
            self.loads[index] += torch.bincount(indices, minlength=self.loads[index].numel()).float()

        return count

    @torch.no_grad()
    def step(self) -> None:
        for router, counts in zip(self.routers, self.loads):
            router.e_score_correction_bias += self.rate * torch.sign(counts.mean() - counts)
            counts.zero_()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def held_out_loss(model: HybridLM, sequences: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token loss (nats per token, i.e. per byte) over `sequences` [n, t]."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, sequences.shape[0], batch_size):
        ids = sequences[start : start + batch_size].to(torch.int64)
        n = ids[:, 1:].numel()
        total += float(lm_loss(model, ids)) * n
        count += n
    model.train(was_training)
    return total / count


def unigram_loss(train: torch.Tensor, held_out: torch.Tensor, vocab_size: int) -> float:
    """Held-out loss (nats per token) of the train split's token frequencies (add-one smoothed): the bar
    a model that ignores context reaches; the parent must be well below it."""
    counts = torch.bincount(train.reshape(-1).to(torch.int64), minlength=vocab_size).double() + 1
    log_probs = (counts / counts.sum()).log()
    targets = held_out[:, 1:].reshape(-1).to(torch.int64)
    return float(-log_probs[targets].mean())


def train_parent(
    spec: ModelSpec, data: TokenData, settings: TrainSettings, seed: int = 0, show_progress: bool = True
) -> tuple[HybridLM, dict[str, Any]]:
    """Train a fresh `spec` on `data.train`; returns the model (eval mode) and the training record.

    Deterministic given the seed on a given machine and thread count (fp32, one process).
    """
    if len(data.held_out) == 0:
        raise DataError(f"no held-out sequence of {settings.seq_len} tokens: raise held_out_fraction")
    # Adam's second moments of rarely used experts decay into subnormal floats, which CPUs compute 10-100x
    # slower; flushing them to zero keeps late steps as fast as early ones (and runs stay deterministic).
    flush = torch.set_flush_denormal(True)
    try:
        return _train(spec, data, settings, seed, show_progress)
    finally:
        if flush:
            torch.set_flush_denormal(False)


def _train(
    spec: ModelSpec, data: TokenData, settings: TrainSettings, seed: int, show_progress: bool
) -> tuple[HybridLM, dict[str, Any]]:
    torch.manual_seed(seed)
    model = HybridLM(spec).float().train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embeddings" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    balancer = _RouterBalancer(model, settings.router_bias_rate)
    batches = data.train.batches(settings.batch_size, seed=seed, rank=0, world=1)
    tokens_per_step = settings.batch_size * settings.seq_len
    total = settings.steps * tokens_per_step
    bar = (
        progress_bar("training the demo parent", total=total, unit="tok")
        if show_progress
        else tqdm(disable=True)
    )
    losses: list[float] = []
    started = time.perf_counter()
    try:
        for step in range(settings.steps):
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * _lr_factor(step, settings)
            loss = lm_loss(model, next(batches))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
            optimizer.step()
            balancer.step()
            losses.append(float(loss.detach()))
            bar.update(tokens_per_step)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    finally:
        bar.close()
        balancer.close()
    seconds = time.perf_counter() - started
    model.eval()
    held = data.held_out.sequences[: settings.held_out_sequences]
    record = {
        "settings": settings.to_dict(),
        "seed": seed,
        "loss_curve": losses,
        "final_train_loss": sum(losses[-10:]) / len(losses[-10:]),
        "held_out_loss": held_out_loss(model, held),
        "unigram_held_out_loss": unigram_loss(data.train.sequences, held, spec.vocab_size),
        "held_out_tokens": int(held.numel()),
        "loss_unit": "nats per token (one token per byte)",
        "train_tokens": settings.steps * tokens_per_step,
        "train_seconds": seconds,
        "tokens_per_second": settings.steps * tokens_per_step / seconds,
        "threads": torch.get_num_threads(),
    }
    return model, record


def _find(path: Path) -> dict[str, Any] | None:
    """The record of a finished cache entry at `path`, or None."""
    try:
        record = json.loads((path / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and (path / "config.json").is_file() else None


def demo_parent(
    cache_dir: str | Path | None = None,
    quick: bool = False,
    seed: int = 0,
    progress: bool = True,
    *,
    spec: ModelSpec | None = None,
    settings: TrainSettings | None = None,
    corpus_root: str | Path | None = None,
) -> DemoParent:
    """The demo's trained parent: loaded from the cache when it holds one, else trained now and cached.

    `cache_dir` defaults to `default_cache_dir()`; the corpus goes to `cache_dir/demo-corpus/<fingerprint>`
    and the parent to `cache_dir/demo-parent/<key>` (see `cache_key`). `spec` and `settings` override the
    preset's (the quick one with `quick`); `corpus_root` reads the `.py` files under another folder than the
    stdlib's (for tests). Returns (model in eval mode, checkpoint path, record).
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    spec = spec or (demo_quick_parent_spec() if quick else demo_parent_spec())
    settings = settings or (QUICK_SETTINGS if quick else FULL_SETTINGS)
    corpus = build_corpus(cache / "demo-corpus", corpus_root)
    key = cache_key(spec, corpus.fingerprint, settings, seed)
    target = cache / "demo-parent" / key[:24]
    record = _find(target)
    if record is not None:
        return DemoParent(load(target), target, {**record, "from_cache": True}, corpus)
    data = TokenData.load(
        corpus.path,
        seq_len=settings.seq_len,
        tokenizer=corpus.tokenizer_dir,
        held_out_fraction=settings.held_out_fraction,
        split_seed=SPLIT_SEED,
    )
    model, record = train_parent(spec, data, settings, seed, show_progress=progress)
    record = {
        "puzzle_version": __version__,
        "trainer_version": TRAINER_VERSION,
        "key": key,
        "spec": spec.to_dict(),
        "corpus": {"fingerprint": corpus.fingerprint, "files": corpus.files, "tokens": corpus.tokens},
        "data": {
            "held_out_fraction": settings.held_out_fraction,
            "split_seed": SPLIT_SEED,
            "seq_len": settings.seq_len,
            "fingerprint": data.fingerprint(),
        },
        "tokenizer": {
            "kind": "bytes",
            "vocab_size": VOCAB_SIZE,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
        },
        "python": platform.python_version(),
        "torch": torch.__version__,
        **record,
    }
    _save(model, target, record, corpus.tokenizer_dir)
    return DemoParent(load(target), target, {**record, "from_cache": False}, corpus)


def _save(model: HybridLM, target: Path, record: dict[str, Any], tokenizer_dir: Path) -> None:
    """Checkpoint + tokenizer files + record, built in a staging directory and renamed into place."""
    # Carried into config.json by save_pretrained (and on into every child saved from this parent).
    model.source_config = {
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "puzzle_demo_corpus": record["corpus"]["fingerprint"],
    }
    remove_stale_staging(target)
    staging = make_staging_dir(target)
    try:
        for file in sorted(tokenizer_dir.iterdir()):
            if file.is_file():
                atomic_write_bytes(staging / file.name, file.read_bytes())
        atomic_write_bytes(staging / RECORD_FILE, (json.dumps(record, indent=1) + "\n").encode())
        model.save_pretrained(staging, overwrite=True)  # beside the record, which is not a checkpoint file
        swap_directory_into_place(staging, target)
    except BaseException:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        raise


def summary(parent: DemoParent) -> str:
    """A few lines on the parent: where, how big, how well it learned, how long it took."""
    from puzzle.cost.analytic import model_active_params, model_params

    record, spec = parent.record, parent.model.spec
    held, unigram = record["held_out_loss"], record["unigram_held_out_loss"]
    source = "from the cache" if record.get("from_cache") else f"trained in {record['train_seconds']:.0f} s"
    return "\n".join(
        [
            f"demo parent {spec.pattern}: {model_params(spec):,} parameters ({model_active_params(spec):,} active)",
            f"  {parent.path} ({source}; {record['train_tokens']:,} tokens at {record['tokens_per_second']:.0f} tok/s)",
            f"  held-out loss {held:.3f} nats/byte vs unigram {unigram:.3f} ({held / unigram:.0%} of it)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m puzzle.demo.parent", description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the small parent of `puzzle demo --quick`")
    size.add_argument("--full", action="store_true", help="the full demo parent (the default)")
    parser.add_argument(
        "--cache", type=Path, default=None, help="cache directory (default $PUZZLE_CACHE or ~/.cache/puzzle)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    parent = demo_parent(args.cache, quick=args.quick, seed=args.seed, progress=not args.quiet)
    print(summary(parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
