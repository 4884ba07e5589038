"""Replace-one-block scoring: the parent with exactly one block swapped for a library variant, on held-out tokens.

For every variant: mean KL(parent || child) of the next-token distributions (nats/token, the default search
objective), the change in LM loss, top-1 / top-5 agreement with the parent and the normalised MSE of the
final hidden state. Positions are those with a next token in the batch (`t - 1` per row of `[b, t]`).

Work per batch: the parent runs once and keeps the input of every block that has variants to score; for
block i every variant of block i runs on that input and only blocks i+1.. are recomputed (the suffix).
Logits never exist over the whole vocabulary: the lm_head runs one vocabulary chunk of `vocab_chunk` rows
at a time. The parent's logits stream once per batch for its per-token log-normaliser, top-5 ids and
target logit, which are kept with its final hidden state; its chunk logits are then recomputed from that
hidden state (one lm_head chunk matmul) once per (batch, block) and shared by all variants of the block,
instead of storing `[tokens, V]` fp32 log-probabilities (2 GB for 4,096 tokens at V = 131,072). Each
variant's logits stream once: online logsumexp, top-5, target logit and the KL's cross term together
(`puzzle.logits.LogitStream.kl` shows why one pass suffices), so a variant costs one lm_head matmul, as a full forward does.

Scale and resume: batches are data-parallel (`puzzle.dist.shard`), the per-variant sums all-reduced in
fp64. Variants are scored in waves (`ScoreSettings.variants_per_wave`); after each wave rank 0 saves every
finished variant atomically to `scores.partial.json`, so a killed run loses at most the wave in flight
and never scores a finished variant again. The final `scores.json` goes through `puzzle.artifacts.Artifact`
(inputs: parent, data and settings fingerprints).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from puzzle import dist
from puzzle.artifacts import (
    Artifact,
    fingerprint_json,
    fingerprint_model,
    fingerprint_spec,
    fingerprint_tensors,
    json_writer,
)
from puzzle.files import atomic_write

# Private aliases: the chunked next-token machinery moved to puzzle.logits (shared with puzzle.gkd).
from puzzle.logits import TOP_K
from puzzle.logits import LogitStream as _Stream
from puzzle.logits import chunk_logits as _logits
from puzzle.logits import vocab_chunks as _chunks
from puzzle.model import Block, HybridLM, RMSNorm
from puzzle.progress import progress
from puzzle.spec import NoOpSpec, Variant

SCORES_FILE = "scores.json"
PARTIAL_FILE = "scores.partial.json"
FORMAT = 1

# Per-variant fp64 sums, one row per variant (all-reduced together).
_KL, _CHILD_NLL, _PARENT_NLL, _TOP1, _TOP5, _SQ_ERR, _SQ_REF, _TOKENS, _NONFINITE = range(9)
_NUM_SUMS = 9

_log = logging.getLogger(__name__)

MixerSource = Mapping[Variant, nn.Module | None] | Callable[[Variant], nn.Module | None]


@dataclass(frozen=True)
class ScoreSettings:
    """How to score. `vocab_chunk`: lm_head rows per chunk (peak memory, see `score_variants`).
    `variants_per_wave`: variants whose mixers are held at once (None: all); the parent runs once per
    batch per wave. `parent_kl_tolerance`: the largest KL (nats/token) the parent's own mixer may score
    before the run is stopped as not reproducible (0 on the CPU; GPU kernels may add rounding noise)."""

    vocab_chunk: int = 4096
    variants_per_wave: int | None = None
    parent_kl_tolerance: float = 1e-6

    def __post_init__(self) -> None:
        if self.vocab_chunk < 1:
            raise ValueError(f"ScoreSettings.vocab_chunk must be >= 1, found {self.vocab_chunk}")
        if self.variants_per_wave is not None and self.variants_per_wave < 1:
            raise ValueError(
                f"ScoreSettings.variants_per_wave must be >= 1 or None, found {self.variants_per_wave}"
            )


@dataclass(frozen=True)
class VariantScore:
    """One variant's scores. `kl`: mean KL(parent || child) in nats/token; `lm_loss_delta`: child minus parent
    mean next-token cross-entropy (nats/token); `top1`: fraction of positions where the child's most likely
    token is the parent's; `top5`: fraction where the parent's most likely token is among the child's 5 most
    likely; `hidden_nmse`: sum |h_child - h_parent|^2 / sum |h_parent|^2 of the final hidden state (after the
    final norm, what lm_head reads). `failed`: why there are no scores (non-finite logits), else None."""

    variant: Variant
    tokens: int
    kl: float | None
    lm_loss_delta: float | None
    top1: float | None
    top5: float | None
    hidden_nmse: float | None
    failed: str | None = None
    mixer: str = ""  # the mixer's fingerprint, when known

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["variant"] = self.variant.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VariantScore:
        return cls(**{**data, "variant": Variant.from_dict(data["variant"])})


@dataclass
class Scores:
    """The scores of the requested variants, the token count, the parent's mean loss and the input fingerprints."""

    variants: dict[Variant, VariantScore]
    tokens: int
    parent_loss: float
    inputs: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, variant: Variant) -> VariantScore:
        return self.variants[variant]


# ----------------------------------------------------------------------------------------------------------
# Mixers and blocks.


def _mixer_fingerprint(mixer: nn.Module) -> str:
    """sha256 of a mixer's spec and a sample of each weight (as `fingerprint_model`, for a block)."""
    digest = hashlib.sha256(fingerprint_spec(mixer.spec).encode())
    for name, tensor in mixer.state_dict().items():
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // 64)
        sample = torch.cat([flat[:64], flat[::stride][:64]]).float().cpu().contiguous()
        digest.update(f"{name}|{tuple(tensor.shape)}|".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def _variant_block(parent: HybridLM, variant: Variant, mixer: nn.Module) -> Block:
    """Block `variant.block_index` of the parent with `mixer` in it (as `HybridLM.replace_mixer` would make it):
    the parent's pre-norm, or a fresh one (weight 1) where the parent's block had none; none for a no-op."""
    index = variant.block_index
    if getattr(mixer, "spec", None) != variant.spec:
        found = getattr(mixer, "spec", type(mixer).__name__)
        raise ValueError(
            f"variant {index}:{variant.id}: its mixer's spec is {found}, expected {variant.spec}"
        )
    own = parent.layers[index]
    hidden = parent.spec.hidden_size
    block = Block(NoOpSpec(), hidden, parent.norm_f.eps, mixer)  # no norm yet: set below
    if isinstance(variant.spec, NoOpSpec):
        block.norm = None
    elif own.norm is not None:
        block.norm = own.norm
    else:
        weight = parent.norm_f.weight
        block.norm = RMSNorm(hidden, parent.norm_f.eps).to(device=weight.device, dtype=weight.dtype)
    return block


def _get_mixer(parent: HybridLM, mixers: MixerSource, variant: Variant) -> nn.Module:
    """The variant's mixer; None (or no entry) for the parent's own block spec means the parent's mixer."""
    mixer = mixers(variant) if callable(mixers) else mixers.get(variant)
    if mixer is None:
        own = parent.layers[variant.block_index].mixer
        if variant.spec != own.spec:
            raise ValueError(
                f"variant {variant.block_index}:{variant.id}: no mixer given (None is allowed only for the "
                f"parent's own block, {own.spec.short_name()})"
            )
        return own
    return mixer


# ----------------------------------------------------------------------------------------------------------
# One batch.


@torch.no_grad()
def _score_batch(
    parent: HybridLM,
    ids: torch.Tensor,
    wave: Sequence[Variant],
    mixers: Mapping[Variant, nn.Module],
    sums: torch.Tensor,
    chunk: int,
) -> None:
    """Add this batch's sums for every variant of `wave` to `sums` [len(wave) + 1, _NUM_SUMS] (fp64); the last
    row is the parent's own (positions and cross-entropy)."""
    if ids.ndim != 2 or ids.dtype != torch.long:
        raise ValueError(
            f"a held-out batch must be int64 [batch, tokens], found {ids.dtype} {list(ids.shape)}"
        )
    if ids.shape[1] < 2:
        return  # no position has a next token
    weight = parent.lm_head.weight
    targets = ids[:, 1:].reshape(-1)
    n = targets.numel()
    chunks = _chunks(weight.shape[0], chunk)
    blocks_needed = {v.block_index for v in wave}
    # The parent once: the input of every block with a variant in this wave, and its final hidden state.
    x = parent.embeddings(ids)
    inputs: dict[int, torch.Tensor] = {}
    for index, block in enumerate(parent.layers):
        if index in blocks_needed:
            inputs[index] = x
        x = block(x)

    def final(x: torch.Tensor) -> torch.Tensor:
        return parent.norm_f(x)[:, :-1].reshape(n, x.shape[-1])

    parent_hidden = final(x)
    parent_stream = _Stream(n, targets)
    for start, stop in chunks:
        parent_stream.update(_logits(parent_hidden, weight, start, stop), start, stop)
    parent_top1 = parent_stream.top_ids[:, 0]
    top1_rows = weight[parent_top1]  # [N, H]: the logit of the parent's top-1 token, for the KL shift

    def top1_logit(hidden: torch.Tensor) -> torch.Tensor:
        return (hidden * top1_rows).float().sum(-1)

    parent_top1_logit = top1_logit(parent_hidden)
    parent_nll = parent_stream.log_normaliser - parent_stream.target_logit.double()
    parent_sq = parent_hidden.float().pow(2).sum(dtype=torch.float64)
    sums[-1, _TOKENS] += n
    sums[-1, _PARENT_NLL] += parent_nll.sum()
    rows = {variant: row for row, variant in enumerate(wave)}
    for index in sorted(blocks_needed):
        # Every variant of the block through the suffix; their final hidden states are kept ([N, H] each) so
        # that each parent chunk is computed once for the block, then every variant's same chunk.
        children: list[tuple[int, torch.Tensor, _Stream]] = []
        for variant in (v for v in wave if v.block_index == index):
            y = _variant_block(parent, variant, mixers[variant])(inputs[index])
            for block in parent.layers[index + 1 :]:
                y = block(y)
            hidden = final(y)
            shift = (parent_top1_logit - top1_logit(hidden)).double()
            children.append((rows[variant], hidden, _Stream(n, targets, shift)))
        for start, stop in chunks:
            parent_z = _logits(parent_hidden, weight, start, stop)
            parent_p = torch.exp(parent_z - parent_stream.log_normaliser.float()[:, None])
            for _, hidden, stream in children:
                stream.update(_logits(hidden, weight, start, stop), start, stop, (parent_z, parent_p))
            del parent_z, parent_p
        for row, hidden, stream in children:
            kl = stream.kl(parent_stream)
            bad = ~(torch.isfinite(kl) & torch.isfinite(stream.target_logit) & torch.isfinite(hidden).all(-1))
            sums[row, _TOKENS] += n
            if bool(bad.any()):
                sums[row, _NONFINITE] += bad.sum()
                continue
            sums[row, _KL] += kl.sum()
            sums[row, _CHILD_NLL] += (stream.log_normaliser - stream.target_logit.double()).sum()
            sums[row, _PARENT_NLL] += parent_nll.sum()
            sums[row, _TOP1] += (stream.top_ids[:, 0] == parent_top1).sum()
            sums[row, _TOP5] += (stream.top_ids == parent_top1[:, None]).any(-1).sum()
            sums[row, _SQ_ERR] += (hidden.float() - parent_hidden.float()).pow(2).sum(dtype=torch.float64)
            sums[row, _SQ_REF] += parent_sq


# ----------------------------------------------------------------------------------------------------------
# The stage.


def _record(variant: Variant, row: torch.Tensor, fingerprint: str) -> VariantScore:
    """A VariantScore from the all-reduced sums of one variant."""
    tokens = int(row[_TOKENS])
    if row[_NONFINITE] > 0:
        reason = f"non-finite logits or hidden states at {int(row[_NONFINITE])} of {tokens} positions"
        return VariantScore(variant, tokens, None, None, None, None, None, reason, fingerprint)
    if tokens == 0:
        return VariantScore(variant, 0, None, None, None, None, None, "no held-out positions", fingerprint)
    return VariantScore(
        variant,
        tokens,
        kl=float(row[_KL] / tokens),
        lm_loss_delta=float((row[_CHILD_NLL] - row[_PARENT_NLL]) / tokens),
        top1=float(row[_TOP1] / tokens),
        top5=float(row[_TOP5] / tokens),
        hidden_nmse=float(row[_SQ_ERR] / row[_SQ_REF]) if row[_SQ_REF] > 0 else None,
        mixer=fingerprint,
    )


def _key(variant: Variant) -> str:
    return f"{variant.block_index}:{variant.id}"


def _saved_records(data: Any, inputs: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(variant key -> record, totals) of a saved scores file made from `inputs`; ValueError etc. if malformed."""
    if not isinstance(data, dict) or data.get("inputs") != dict(inputs):
        raise ValueError("made from other inputs")
    totals = {"tokens": int(data["tokens"]), "parent_loss": data["parent_loss"]}
    records = [VariantScore.from_dict(record) for record in data["variants"]]  # validates every record
    return {_key(r.variant): r.to_dict() for r in records}, totals


def _load_done(
    directory: Path, inputs: Mapping[str, str]
) -> tuple[dict[str, dict[str, Any]], dict[str, Any], bool]:
    """(variant key -> saved record, totals, whether scores.json is current) from scores.json and
    scores.partial.json made from `inputs`; a damaged or foreign file is ignored (its variants are rescored)."""
    done: dict[str, dict[str, Any]] = {}
    totals: dict[str, Any] = {}
    artifact = Artifact(directory, "scores", FORMAT)
    current = False
    for path in (artifact.path(SCORES_FILE), directory / PARTIAL_FILE):
        if path.name == SCORES_FILE and artifact.why_not_current(inputs) is not None:
            continue
        if not path.is_file():
            continue
        try:
            records, saved_totals = _saved_records(json.loads(path.read_text()), inputs)
        except (ValueError, KeyError, TypeError) as error:  # JSONDecodeError and SpecError are ValueErrors
            _log.info("scores in %s are not reused: %s", path, error)
            continue
        current = current or path.name == SCORES_FILE
        done.update(records)
        totals = totals or saved_totals
    return done, totals, current


def _content(
    inputs: Mapping[str, str], records: Mapping[str, dict[str, Any]], totals: Mapping[str, Any]
) -> dict:
    ordered = [records[key] for key in sorted(records, key=lambda k: (int(k.split(":")[0]), k))]
    return {"inputs": dict(inputs), **totals, "variants": ordered}


def score_variants(
    parent: HybridLM,
    variants: Iterable[Variant],
    mixers: MixerSource,
    batches: Sequence[torch.Tensor] | Callable[[], Iterable[torch.Tensor]],
    out_dir: str | Path,
    settings: ScoreSettings | None = None,
    *,
    data_fingerprint: str | None = None,
    mixer_fingerprints: Mapping[Variant, str] | None = None,
) -> Scores:
    """Score every variant as the parent with only its block replaced, on held-out `batches`; write scores.json.

    `mixers`: variant -> its mixer (a module from `build_block`, same device and dtype as the parent), or a
    callable building / loading one on demand (called once per wave for the variants still to score, so a
    big library is never all in memory); None for a variant with the parent's own block spec means the
    parent's mixer, whose score is computed like any other and must be 0 KL and full agreement (checked).
    `batches`: held-out int64 `[b, t]` token batches, a sequence or a zero-argument callable returning a
    fresh iterable (the batches are read once per wave); each rank scores its `dist.shard` of them.
    `data_fingerprint`: names the data (e.g. `fingerprint_file` of the token file); default
    `fingerprint_tensors` of the batches. `mixer_fingerprints`: per variant, a fingerprint of its weights;
    a saved score with another fingerprint is recomputed. Without one, a mixer given in a mapping is
    fingerprinted from its weights; one from a callable is trusted by its id. A failed variant (non-finite
    logits) is a result too: it is not retried unless its fingerprint changes.

    Peak memory beyond the forward passes, per batch of N = b * (t - 1) positions: the kept block inputs
    (N * H per block with variants in the wave, parent dtype), each variant of the block being scored's
    final hidden state (N * H), the parent's chunk logits and probabilities and, for the variant in flight,
    its chunk logits and two temporaries: about 5 fp32 `[N, vocab_chunk]` tensors, 20 * N * vocab_chunk
    bytes (335 MB for N = 4,096 and the default chunk 4,096), whatever the vocabulary size; plus the
    `[N, H]` lm_head rows of the parent's top-1 tokens.

    Collective under torch.distributed (same arguments on every rank). Returns the requested variants'
    scores; scores.json holds every variant scored so far from the same parent, data and settings.
    """
    settings = settings or ScoreSettings()
    out_dir = Path(out_dir)
    requested = list(dict.fromkeys(variants))
    for variant in requested:
        if variant.block_index >= parent.spec.num_blocks:
            raise ValueError(f"variant {_key(variant)}: the parent has {parent.spec.num_blocks} blocks")
    if callable(batches) and not isinstance(batches, Sequence):
        read_batches = batches
    else:
        listed = list(batches)
        read_batches = lambda: listed  # noqa: E731
    if data_fingerprint is None:
        data_fingerprint = fingerprint_tensors(list(read_batches()))
    inputs = {
        "parent": fingerprint_model(parent),
        "data": data_fingerprint,
        "settings": fingerprint_json({"format": FORMAT, "top_k": TOP_K}),
    }

    def fingerprint_of(variant: Variant) -> str:
        if mixer_fingerprints is not None and variant in mixer_fingerprints:
            return mixer_fingerprints[variant]
        if not callable(mixers):  # also checks, before any work, that every variant has a mixer
            return _mixer_fingerprint(_get_mixer(parent, mixers, variant))
        return ""

    fingerprints = {variant: fingerprint_of(variant) for variant in requested}
    done, totals, current = _load_done(out_dir, inputs) if dist.is_main() else ({}, {}, False)
    done, totals, current = dist.broadcast_object((done, totals, current))
    # An unknown fingerprint ("": a mixer from a callable) trusts the saved score of the same variant id.
    pending = [
        v
        for v in requested
        if _key(v) not in done or fingerprints[v] not in ("", done[_key(v)].get("mixer", ""))
    ]
    pending.sort(key=lambda v: (v.block_index, v.id))
    size = settings.variants_per_wave or max(1, len(pending))
    waves = [pending[start : start + size] for start in range(0, len(pending), size)]
    device = parent.lm_head.weight.device
    parent_was_training = parent.training
    parent.eval()
    try:
        for number, wave in enumerate(waves):
            held = {v: _get_mixer(parent, mixers, v) for v in wave}
            sums = torch.zeros(len(wave) + 1, _NUM_SUMS, dtype=torch.float64, device=device)
            shard = dist.shard(read_batches())
            for ids in progress(shard, desc=f"scoring wave {number + 1}/{len(waves)}", unit="batch"):
                _score_batch(parent, ids.to(device), wave, held, sums, settings.vocab_chunk)
            dist.all_reduce_sum_([sums])
            sums = sums.cpu()
            for row, variant in enumerate(wave):
                record = _record(variant, sums[row], fingerprints[variant])
                own = held[variant] is parent.layers[variant.block_index].mixer
                if own and not (record.failed is None and record.kl <= settings.parent_kl_tolerance):
                    raise RuntimeError(
                        f"block {variant.block_index}: the parent's own mixer scores {record}, expected KL 0 "
                        f"and full agreement: the suffix recomputation does not reproduce the parent "
                        f"(non-deterministic kernels?)"
                    )
                done[_key(variant)] = record.to_dict()
            tokens = int(sums[-1, _TOKENS])
            totals = {
                "tokens": tokens,
                "parent_loss": float(sums[-1, _PARENT_NLL] / tokens) if tokens else None,
            }
            del held
            with dist.main_process_first():
                if dist.is_main():
                    atomic_write(out_dir / PARTIAL_FILE, json_writer(_content(inputs, done, totals)))
    finally:
        parent.train(parent_was_training)
    totals = totals or {"tokens": 0, "parent_loss": None}
    artifact = Artifact(out_dir, "scores", FORMAT)
    if waves or not current:
        content = _content(inputs, done, totals)
        artifact.write(inputs, {SCORES_FILE: json_writer(content)}, info={**totals, "variants": len(done)})
    with dist.main_process_first():
        if dist.is_main():
            (out_dir / PARTIAL_FILE).unlink(missing_ok=True)
    scores = {v: VariantScore.from_dict(done[_key(v)]) for v in requested}
    return Scores(scores, totals["tokens"], totals["parent_loss"], inputs)


def load_scores(out_dir: str | Path) -> Scores:
    """Every variant's scores from a finished scores.json (errors name the file)."""
    artifact = Artifact(Path(out_dir), "scores", FORMAT)
    manifest = artifact.read_manifest()
    saved = artifact.load_json(SCORES_FILE)
    records = [VariantScore.from_dict(r) for r in saved["variants"]]
    return Scores(
        {r.variant: r for r in records}, saved["tokens"], saved["parent_loss"], dict(manifest.inputs)
    )


# ----------------------------------------------------------------------------------------------------------
# Two whole models (an assembled or distilled child against its parent).


@dataclass(frozen=True)
class ModelComparison:
    """A child against its parent on held-out tokens: mean KL(parent || child) (nats/token), the child's
    minus the parent's mean next-token cross-entropy, top-1 agreement, positions counted."""

    kl: float
    lm_loss_delta: float
    top1: float
    tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _final_hidden(model: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    """What lm_head reads at the positions with a next token: [b * (t - 1), H]."""
    x = model.norm_f(model.backbone(ids))
    return x[:, :-1].reshape(-1, x.shape[-1])


@torch.no_grad()
def compare_models(
    parent: HybridLM,
    child: HybridLM,
    batches: Sequence[torch.Tensor] | Callable[[], Iterable[torch.Tensor]],
    vocab_chunk: int = 4096,
) -> ModelComparison:
    """Mean KL(parent || child) and agreement of two whole models on held-out int64 `[b, t]` batches.

    The same chunked computation as scoring (`_Stream`): each model's logits exist one vocabulary chunk of
    `vocab_chunk` rows at a time, each through its own lm_head. Batches are data-parallel under
    torch.distributed (`dist.shard`, sums all-reduced). Non-finite child logits are a ValueError.
    """
    if parent.spec.vocab_size != child.spec.vocab_size:
        raise ValueError(
            f"the child's vocabulary ({child.spec.vocab_size}) is not the parent's ({parent.spec.vocab_size})"
        )
    listed = batches() if callable(batches) and not isinstance(batches, Sequence) else batches
    device = parent.lm_head.weight.device
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # kl, child nll, parent nll, top1, tokens
    modes = parent.training, child.training
    parent.eval()
    child.eval()
    try:
        for ids in dist.shard(listed):
            ids = ids.to(device)
            if ids.ndim != 2 or ids.dtype != torch.long:
                raise ValueError(
                    f"a held-out batch must be int64 [batch, tokens], found {ids.dtype} {list(ids.shape)}"
                )
            if ids.shape[1] < 2:
                continue
            targets = ids[:, 1:].reshape(-1)
            n = targets.numel()

            parent_hidden, child_hidden = (_final_hidden(model, ids) for model in (parent, child))
            parent_weight, child_weight = parent.lm_head.weight, child.lm_head.weight
            chunks = _chunks(parent_weight.shape[0], vocab_chunk)
            parent_stream = _Stream(n, targets)
            for start, stop in chunks:
                parent_stream.update(_logits(parent_hidden, parent_weight, start, stop), start, stop)
            top1 = parent_stream.top_ids[:, 0]
            shift = (parent_hidden * parent_weight[top1]).float().sum(-1) - (
                child_hidden * child_weight[top1]
            ).float().sum(-1)
            child_stream = _Stream(n, targets, shift.double())
            for start, stop in chunks:
                parent_z = _logits(parent_hidden, parent_weight, start, stop)
                parent_p = torch.exp(parent_z - parent_stream.log_normaliser.float()[:, None])
                child_z = _logits(child_hidden, child_weight, start, stop)
                child_stream.update(child_z, start, stop, (parent_z, parent_p))
            kl = child_stream.kl(parent_stream)
            if not bool(torch.isfinite(kl).all()):
                raise ValueError("the child gives non-finite logits on the held-out batches")
            sums[0] += kl.sum()
            sums[1] += (child_stream.log_normaliser - child_stream.target_logit.double()).sum()
            sums[2] += (parent_stream.log_normaliser - parent_stream.target_logit.double()).sum()
            sums[3] += (child_stream.top_ids[:, 0] == top1).sum()
            sums[4] += n
    finally:
        parent.train(modes[0])
        child.train(modes[1])
    dist.all_reduce_sum_([sums])
    tokens = int(sums[4])
    if tokens == 0:
        raise ValueError("no held-out positions: every batch needs at least 2 tokens per row")
    return ModelComparison(
        kl=float(sums[0] / tokens),
        lm_loss_delta=float((sums[1] - sums[2]) / tokens),
        top1=float(sums[3] / tokens),
        tokens=tokens,
    )
