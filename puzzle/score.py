"""Replace-one-block scoring: the parent with exactly one block swapped for a library variant, on held-out tokens.

For every variant: mean KL(parent || child) of the next-token distributions (nats/token, the default search
objective), the change in LM loss, top-1 / top-5 agreement with the parent and the normalised MSE of the
final hidden state. Positions are those with a next token in the batch (`t - 1` per row of `[b, t]`).

Work per batch: the parent runs once and keeps the input of every block that has variants to score; for
block i every variant of block i runs on that input and only blocks i+1.. are recomputed (the suffix). A
variant whose mixer is the parent's own is the parent: it gets the parent's sums (0 KL, full agreement)
without running anything; once per wave (first batch) one of them does run through its suffix, and its KL
must be 0 (`ScoreSettings.parent_kl_tolerance`), which checks that recomputing a suffix from a kept input
reproduces the parent. Logits never exist over the whole vocabulary: the lm_head runs one vocabulary chunk
of `vocab_chunk` rows at a time. The parent's logits stream once per batch for its per-token
log-normaliser, top-1 id and target logit; then one more pass over the chunks serves every variant of the
wave: each parent chunk (logits and probabilities) is computed once, then every variant's same chunk,
whose statistics (online logsumexp, target logit, the logit of the parent's top-1 token, the count of
logits above it, the KL's cross term; `_Child`) are taken in one pass, without a top-k. So a variant costs
its block, its suffix and one lm_head matmul, and the parent two lm_head matmuls per batch.

Scale: batches are data-parallel (`puzzle.dist.shard`, whole batches per rank), the per-variant sums
all-reduced in fp64. With `ScoreSettings.shard = "fsdp"` (the default) under torch.distributed with more
than one rank, the parent is sharded with FSDP2 exactly as in BLD (`puzzle.shard.shard_parent`: embeddings,
lm_head and each block's mixer one unit each, gathered for their own forward), in place; the lm_head weight
is all-gathered once per call for the chunk matmuls (V x H per rank while scoring). Variant mixers are
sharded too, each one as it is loaded (`puzzle.shard.shard_variant`, in place): they need no gradients, but
a wave of large variants (a Super MoE block is gigabytes) held whole on every rank would cost wave-size
times a variant per rank, where sharded it costs 1/world of that plus one variant gathered at a time; the
price is one all-gather of a variant per batch, small next to its suffix forward. Every rank then runs the
same number of batches (a rank short of one re-runs its first batch without counting it), since each
unit's forward is a collective. "none" keeps everything replicated.

Resume: variants are scored in waves (`ScoreSettings.variants_per_wave`); every variant of a wave finishes
at the wave's last batch, and after each wave rank 0 saves every finished variant atomically to
`scores.partial.json`: a killed run keeps every variant already scored and never scores one again. Within
the wave in flight, every `ScoreSettings.checkpoint_every` batches rank 0 saves the running fp64 sums of all
ranks (`scores.wave.json`, after an all-reduce; a few numbers per variant), so a killed run also resumes
inside its wave, at the last saved batch, to exactly the sums of an uninterrupted run (same world size and
sharding; else the wave starts over). The final `scores.json` goes through `puzzle.artifacts.Artifact`
(inputs: parent, data and settings fingerprints).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from puzzle import dist, shard
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
from puzzle.logits import TOP_K, ChunkBuffers
from puzzle.logits import chunk_logits as _logits
from puzzle.logits import vocab_chunks as _chunks
from puzzle.model import Block, HybridLM, RMSNorm
from puzzle.progress import progress

# The file format has its own home; its names stay importable from here.
from puzzle.scores import FORMAT, SCORES_FILE, Scores, VariantScore, load_scores  # noqa: F401
from puzzle.settings import ScoreSettings
from puzzle.spec import NoOpSpec, Variant

PARTIAL_FILE = "scores.partial.json"
WAVE_FILE = "scores.wave.json"


class _Sum(IntEnum):
    """The columns of the per-variant fp64 sums, one row per variant (all-reduced together; saved in this
    order in scores.wave.json)."""

    KL = 0  # KL(parent || child), nats
    CHILD_NLL = 1  # the child's next-token cross-entropy, nats
    PARENT_NLL = 2
    TOP1 = 3  # positions where the child's top-1 is the parent's
    TOP5 = 4  # positions where the parent's top-1 is in the child's top 5
    SQ_ERR = 5  # |h_child - h_parent|^2 of the final hidden state
    SQ_REF = 6  # |h_parent|^2
    TOKENS = 7  # positions counted
    NONFINITE = 8  # positions with non-finite logits or hidden states


_NUM_SUMS = len(_Sum)

_log = logging.getLogger(__name__)

MixerSource = Mapping[Variant, nn.Module | None] | Callable[[Variant], nn.Module | None]


# ----------------------------------------------------------------------------------------------------------
# Chunked next-token metrics.


def _pick(values: torch.Tensor, ids: torch.Tensor, start: int, stop: int, z: torch.Tensor) -> torch.Tensor:
    """`values` [N] with z[n, ids[n] - start] where ids[n] falls in this chunk (start..stop)."""
    inside = (ids >= start) & (ids < stop)
    local = (ids - start).clamp(0, stop - start - 1)
    return torch.where(inside, z.gather(-1, local[:, None])[:, 0], values)


class _Logsumexp:
    """Online log-sum-exp over vocabulary chunks: running max and sum in fp64 across chunks.

    A nan or +inf logit makes the running max, hence the result, non-finite (checked once at the end)."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.running_max = torch.full((n,), -math.inf, dtype=torch.float64, device=device)
        self.running_sum = torch.zeros(n, dtype=torch.float64, device=device)

    def update(self, z: torch.Tensor, chunk_max: torch.Tensor, scratch: torch.Tensor) -> None:
        """Add chunk logits z [N, C] (fp32) whose row maxima are `chunk_max` [N]; `scratch`: an [N, C] buffer."""
        new_max = torch.maximum(self.running_max, chunk_max.double())
        # -inf - -inf is nan: rows with no finite logit yet keep a zero sum (they are non-finite anyway).
        scale = torch.exp(torch.nan_to_num(self.running_max - new_max, nan=0.0))
        chunk_sum = torch.sub(z, new_max.float()[:, None], out=scratch).exp_().sum(-1).double()
        self.running_sum = self.running_sum * scale + chunk_sum
        self.running_max = new_max

    @property
    def value(self) -> torch.Tensor:
        """log sum_v exp(z_v) per token [N] (fp64)."""
        return self.running_max + self.running_sum.log()


@dataclass
class _Parent:
    """The parent's per-token statistics of one batch, from one pass over the vocabulary: final hidden state
    [N, H], log-normaliser [N] (fp64), top-1 ids [N] and their lm_head rows [N, H], next-token NLL [N] (fp64)."""

    hidden: torch.Tensor
    log_normaliser: torch.Tensor
    top1: torch.Tensor
    top1_rows: torch.Tensor
    nll: torch.Tensor

    @classmethod
    def of(
        cls, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: list[tuple[int, int]]
    ) -> _Parent:
        n = targets.numel()
        lse = _Logsumexp(n, hidden.device)
        best = torch.full((n,), -math.inf, device=hidden.device)
        top1 = torch.zeros(n, dtype=torch.long, device=hidden.device)
        target_logit = torch.zeros(n, device=hidden.device)
        buffers = ChunkBuffers(n, chunks, 2, hidden.device)
        for start, stop in chunks:
            z = _logits(hidden, weight, start, stop, out=buffers.view(0, start, stop))
            chunk_max, chunk_ids = z.max(-1)
            lse.update(z, chunk_max, buffers.view(1, start, stop))
            better = chunk_max > best  # strict: the first of equal maxima wins, as argmax over the whole row
            top1 = torch.where(better, chunk_ids + start, top1)
            best = torch.where(better, chunk_max, best)
            target_logit = _pick(target_logit, targets, start, stop, z)
        nll = lse.value - target_logit.double()
        return cls(hidden, lse.value, top1, weight[top1], nll)

    def top1_logit(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logit of the parent's top-1 token under final hidden states `hidden` [N, H] -> [N] (fp32, then
        rounded to the logits' dtype, as `_logits` rounds the matmul's output)."""
        return (hidden.float() * self.top1_rows.float()).sum(-1).to(hidden.dtype).float()


class _Child:
    """One variant's per-token statistics against the parent, fed one vocabulary chunk at a time (with the
    parent's chunk logits and probabilities, computed once per chunk for every variant of the batch).

    Kept per token: the log-normaliser, the target's logit, the child's exact logit of the parent's top-1
    token (`watched`), how many logits exceed an estimate of it (`above`, for top-5 agreement) and the KL's
    cross term (see `kl`). No top-k is tracked: the parent's top-1 token is the child's top-1 when its logit
    is the child's maximum, and among the child's top 5 when fewer than 5 other logits exceed it (strictly:
    a tie at the 5th place counts as agreement, where a top-k would pick by index).
    """

    def __init__(self, parent: _Parent, hidden: torch.Tensor, targets: torch.Tensor) -> None:
        n = targets.numel()
        device = hidden.device
        self.hidden = hidden
        self.targets = targets
        self.watch = parent.top1
        self.estimate = parent.top1_logit(hidden)  # the watched logit by a dot product, before the pass
        self.shift = (parent.top1_logit(parent.hidden) - self.estimate).double()
        self.lse = _Logsumexp(n, device)
        self.target_logit = torch.zeros(n, device=device)
        self.watched = torch.zeros(n, device=device)
        self.above = torch.zeros(n, dtype=torch.float64, device=device)
        self.cross = torch.zeros(n, dtype=torch.float64, device=device)

    def update(
        self,
        z: torch.Tensor,
        start: int,
        stop: int,
        parent_z: torch.Tensor,
        parent_p: torch.Tensor,
        scratch: torch.Tensor,
    ) -> None:
        """Add chunk logits z [N, C] (fp32), the parent's chunk logits and probabilities [N, C]; `scratch`:
        an [N, C] fp32 buffer (every step below writes into it, so no temporary of the chunk's size is made)."""
        self.lse.update(z, z.amax(-1), scratch)
        self.target_logit = _pick(self.target_logit, self.targets, start, stop, z)
        self.watched = _pick(self.watched, self.watch, start, stop, z)
        self.above += torch.gt(z, self.estimate[:, None], out=scratch).sum(-1).double()
        difference = torch.sub(parent_z, z, out=scratch).sub_(self.shift.float()[:, None])
        self.cross += torch.linalg.vecdot(parent_p, difference).double()

    def kl(self, parent: _Parent) -> torch.Tensor:
        """KL(parent || child) per token [N] (fp64), nats.

        KL = sum_v p_v (log p_v - log q_v) = sum_v p_v (zp_v - z_v - shift) + (Z - Zp + shift), with Z, Zp the
        log-normalisers: one pass over the vocabulary, since Zp is known before it and Z only enters as a
        per-token constant. `shift` = zp - z at the parent's top-1 token cancels a constant offset between
        the two logit vectors before the fp32 products, so near-equal distributions keep their precision.
        """
        return self.cross + (self.lse.value - parent.log_normaliser + self.shift)

    def agreement(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-1, top-5) agreement per token [N] (bool): the parent's top-1 token is the child's most likely,
        is among the child's 5 most likely. `above` counted the watched token itself when its exact logit
        exceeds the estimate; the others are those within the estimate's rounding of it (near ties)."""
        top1 = self.watched.double() >= self.lse.running_max
        others = self.above - (self.watched > self.estimate).double()
        return top1, others < TOP_K


# ----------------------------------------------------------------------------------------------------------
# Mixers and blocks.


def _mixer_fingerprint(mixer: nn.Module) -> str:
    """sha256 of a mixer's spec and a sample of each weight (as `fingerprint_model`, for a block)."""
    digest = hashlib.sha256(fingerprint_spec(mixer.spec).encode())
    for name, tensor in mixer.state_dict().items():
        flat = shard.replicated(tensor).detach().reshape(-1)  # a sharded mixer: every rank gathers
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


def _get_mixer(
    parent: HybridLM, mixers: MixerSource, variant: Variant, context: HybridLM | None = None
) -> nn.Module:
    """The variant's mixer; None (or no entry) for the parent's own block spec means the parent's mixer.

    With a `context` model, a variant with the context's own block spec is the context's own mixer (not
    asked of `mixers`): that variant is the context itself, scored without running anything."""
    if context is not None and variant.spec == context.spec.blocks[variant.block_index]:
        return context.layers[variant.block_index].mixer
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


def _order(variant: Variant) -> tuple[int, str]:
    return variant.block_index, variant.id


@torch.no_grad()
def _score_batch(
    parent: HybridLM,
    weight: torch.Tensor,
    ids: torch.Tensor,
    wave: Sequence[Variant],
    mixers: Mapping[Variant, nn.Module],
    sums: torch.Tensor,
    chunk: int,
    check: Variant | None = None,
    context: HybridLM | None = None,
) -> None:
    """Add this batch's sums for every variant of `wave` to `sums` [len(wave) + 2, _NUM_SUMS] (fp64; two
    rows more with a `context`).

    Row len(wave) is the parent's own (positions and cross-entropy). A variant whose mixer is the parent's
    own is the parent: its row gets the parent's sums (0 KL, full agreement) without any work. `check`, one
    such variant, is nevertheless run through the suffix like any other, into row len(wave) + 1: its KL must
    be 0 if recomputing the suffix from a kept block input reproduces the parent. `weight`: the whole lm_head
    weight [V, H] (gathered once per run when the parent is sharded).

    With a `context` model (same embeddings and lm_head as the parent, same number of blocks), the variants
    replace one block of the context instead: the context's prefix runs once and keeps the block inputs,
    each variant runs its block and the context's suffix, and the parent runs once, whole, for the
    reference logits. Row len(wave) + 2 is the context's own sums against the parent; a variant whose mixer
    is the context's own gets them without any work; `check` must reproduce them on its batch (row
    len(wave) + 3: the context's sums on the batches `check` ran).
    """
    targets = ids[:, 1:].reshape(-1)
    n = targets.numel()
    chunks = _chunks(weight.shape[0], chunk)
    model = parent if context is None else context  # whose blocks the variants replace
    own = {v for v in wave if mixers[v] is model.layers[v.block_index].mixer}
    rows = {variant: row for row, variant in enumerate(wave) if variant not in own}
    if check is not None:
        rows[check] = len(wave) + 1
    blocks_needed = {v.block_index for v in rows}
    # The model once: the input of every block with a variant to run, and its final hidden state.
    x = model.embeddings(ids)
    inputs: dict[int, torch.Tensor] = {}
    for index, block in enumerate(model.layers):
        if index in blocks_needed:
            inputs[index] = x
        x = block(x)

    def final(x: torch.Tensor) -> torch.Tensor:
        return model.norm_f(x)[:, :-1].reshape(n, x.shape[-1])

    if context is None:
        reference = _Parent.of(final(x), weight, targets, chunks)
    else:
        reference = _Parent.of(_final_hidden(parent, ids), weight, targets, chunks)
    parent_sq = reference.hidden.float().pow(2).sum(dtype=torch.float64)
    parent_nll = reference.nll.sum()
    parent_bad = ~(torch.isfinite(reference.nll) & torch.isfinite(reference.hidden).all(-1))
    sums[len(wave), _Sum.TOKENS] += n
    sums[len(wave), _Sum.PARENT_NLL] += parent_nll
    # With a context, its own sums are taken in the chunk pass below (as a child's) and copied to its own
    # variants' rows after it: `before` isolates this batch's share.
    context_row = len(wave) + 2
    before = sums[context_row].clone() if context is not None else None
    for variant in own if context is None else ():
        row = sums[wave.index(variant)]
        row[_Sum.TOKENS] += n
        if bool(parent_bad.any()):
            row[_Sum.NONFINITE] += parent_bad.sum()
            continue
        row[[_Sum.CHILD_NLL, _Sum.PARENT_NLL]] += parent_nll
        row[[_Sum.TOP1, _Sum.TOP5]] += n
        row[_Sum.SQ_REF] += parent_sq
    # Every variant to run through its suffix; its final hidden state is kept ([N, H] each) so that each
    # parent chunk is computed once per batch, then every variant's same chunk.
    children: list[tuple[int, _Child]] = []
    if context is not None:
        children.append((context_row, _Child(reference, final(x), targets)))
    for variant in sorted(rows, key=_order):
        index = variant.block_index
        y = _variant_block(parent, variant, mixers[variant])(inputs[index])
        for block in model.layers[index + 1 :]:
            y = block(y)
        children.append((rows[variant], _Child(reference, final(y), targets)))
        if not any(v.block_index == index for v in rows if _order(v) > _order(variant)):
            del inputs[index]  # the last variant of the block: free its input
    # The same 4 buffers every chunk (`ChunkBuffers`: a fresh tensor of that size costs its page faults).
    buffers = ChunkBuffers(n, chunks, 4, weight.device)
    for start, stop in chunks:
        parent_z = _logits(reference.hidden, weight, start, stop, out=buffers.view(0, start, stop))
        parent_p = torch.sub(
            parent_z, reference.log_normaliser.float()[:, None], out=buffers.view(1, start, stop)
        ).exp_()
        view = buffers.view(3, start, stop)
        for _, child in children:
            z = _logits(child.hidden, weight, start, stop, out=buffers.view(2, start, stop))
            child.update(z, start, stop, parent_z, parent_p, view)
    for row, child in children:
        kl = child.kl(reference)
        hidden = child.hidden
        bad = ~(torch.isfinite(kl) & torch.isfinite(child.target_logit) & torch.isfinite(hidden).all(-1))
        sums[row, _Sum.TOKENS] += n
        if bool(bad.any()):
            sums[row, _Sum.NONFINITE] += bad.sum()
            continue
        top1, top5 = child.agreement()
        sums[row, _Sum.KL] += kl.sum()
        sums[row, _Sum.CHILD_NLL] += (child.lse.value - child.target_logit.double()).sum()
        sums[row, _Sum.PARENT_NLL] += parent_nll
        sums[row, _Sum.TOP1] += top1.sum()
        sums[row, _Sum.TOP5] += top5.sum()
        sums[row, _Sum.SQ_ERR] += (hidden.float() - reference.hidden.float()).pow(2).sum(dtype=torch.float64)
        sums[row, _Sum.SQ_REF] += parent_sq
    if before is not None:
        share = sums[context_row] - before
        for variant in own:
            sums[wave.index(variant)] += share
        if check is not None:  # what the check must reproduce: the context on the same batch
            sums[context_row + 1] += share


def _check_context_head(weight: torch.Tensor, context: HybridLM) -> None:
    """ValueError unless the context model's lm_head is the parent's (`weight`, whole): the chunk pass
    computes every model's logits with that one weight."""
    own = shard.replicated(context.lm_head.weight)
    if own.shape != weight.shape or not torch.equal(own, weight):
        raise ValueError(
            "the context model's lm_head differs from the parent's: scoring in context needs a child "
            "assembled from this parent (its embeddings, final norm and lm_head), before any distillation"
        )


def _final_hidden(model: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    """`model`'s final hidden state (after its final norm) at the positions with a next token, [N, H]."""
    x = model.embeddings(ids)
    for block in model.layers:
        x = block(x)
    x = model.norm_f(x)[:, :-1]
    return x.reshape(-1, x.shape[-1])


# ----------------------------------------------------------------------------------------------------------
# The stage.


def _valid(batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The batches with a next-token position, each checked to be int64 [batch, tokens]."""
    for ids in batches:
        if ids.ndim != 2 or ids.dtype != torch.long:
            raise ValueError(
                f"a held-out batch must be int64 [batch, tokens], found {ids.dtype} {list(ids.shape)}"
            )
        if ids.shape[1] >= 2:  # else no position has a next token
            yield ids


def _steps(
    read_batches: Callable[[], Iterable[torch.Tensor]], sharded: bool
) -> tuple[list[tuple[torch.Tensor, bool]], int]:
    """This rank's (batch, counted) steps, its round-robin share of the batches (`dist.shard`), and how many
    steps every rank has (where a wave's running sums may be saved).

    Sharded units all-gather in every forward, so then every rank runs as many steps as rank 0: a rank with
    one batch fewer runs one more on the first batch, not counted (at most one batch per wave of extra work).
    """
    every = list(_valid(read_batches()))
    mine = [(ids, True) for ids in dist.shard(every)]
    world = dist.world_size()
    if not sharded:
        return mine, len(every) // world
    padded = -(-len(every) // world)
    return mine + [(every[0], False)] * (padded - len(mine)), padded


def _wave_state(inputs: Mapping[str, str], wave: Sequence[Variant], sharded: bool) -> dict:
    """What a wave's checkpoint must match: the inputs, the wave's variants, the world size and the sharding."""
    return {
        "inputs": dict(inputs),
        "wave": [_key(v) for v in wave],
        "world": dist.world_size(),
        "sharded": sharded,
    }


def _load_wave(directory: Path, state: Mapping[str, Any], rows: int) -> tuple[int, list] | None:
    """(steps done, running sums) of the wave in flight saved by a killed run with the same `state`, or None."""
    path = directory / WAVE_FILE
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        if {k: saved[k] for k in state} != dict(state):
            return None
        step, sums = int(saved["step"]), saved["sums"]
        if step < 1 or len(sums) != rows or any(len(row) != _NUM_SUMS for row in sums):
            raise ValueError(f"expected {rows} rows of {_NUM_SUMS} sums after at least 1 step")
    except (ValueError, KeyError, TypeError) as error:
        _log.info("the wave checkpoint %s is not reused: %s", path, error)
        return None
    return step, sums


def _save_wave(directory: Path, state: Mapping[str, Any], step: int, sums: torch.Tensor) -> None:
    """Rank 0 saves the wave's running sums over every rank after `step` steps of each (a collective)."""
    total = sums.clone()
    dist.all_reduce_sum_([total])
    with dist.main_process_first():
        if dist.is_main():
            atomic_write(directory / WAVE_FILE, json_writer({**state, "step": step, "sums": total.tolist()}))


def _check_parent(
    variant: Variant, row: torch.Tensor, tolerance: float, expected: torch.Tensor | None = None
) -> None:
    """RuntimeError unless the parent's own mixer, run through the suffix, scored the parent (KL <= tolerance);
    with `expected` (the context's own sums row), unless the context's own mixer scored the context's KL."""
    tokens = int(row[_Sum.TOKENS])
    target = 0.0 if expected is None else float(expected[_Sum.KL] / tokens) if tokens else 0.0
    model = "parent" if expected is None else "context model"
    wanted = f"KL <= {tolerance}" if expected is None else f"KL within {tolerance} of {target:.6g}"
    if tokens and (row[_Sum.NONFINITE] > 0 or abs(float(row[_Sum.KL] / tokens) - target) > tolerance):
        raise RuntimeError(
            f"block {variant.block_index}: the {model}'s own mixer scores {_record(variant, row, '')}, "
            f"expected {wanted} and finite: the suffix recomputation does not reproduce the {model} "
            f"(non-deterministic kernels?)"
        )


def _record(variant: Variant, row: torch.Tensor, fingerprint: str) -> VariantScore:
    """A VariantScore from the all-reduced sums of one variant."""
    tokens = int(row[_Sum.TOKENS])
    if row[_Sum.NONFINITE] > 0:
        reason = f"non-finite logits or hidden states at {int(row[_Sum.NONFINITE])} of {tokens} positions"
        return VariantScore(variant, tokens, None, None, None, None, None, reason, fingerprint)
    if tokens == 0:
        return VariantScore(variant, 0, None, None, None, None, None, "no held-out positions", fingerprint)
    return VariantScore(
        variant,
        tokens,
        kl=float(row[_Sum.KL] / tokens),
        lm_loss_delta=float((row[_Sum.CHILD_NLL] - row[_Sum.PARENT_NLL]) / tokens),
        top1=float(row[_Sum.TOP1] / tokens),
        top5=float(row[_Sum.TOP5] / tokens),
        hidden_nmse=float(row[_Sum.SQ_ERR] / row[_Sum.SQ_REF]) if row[_Sum.SQ_REF] > 0 else None,
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


def _wave_size(
    parent: HybridLM,
    pending: list[Variant],
    read_batches: Callable[[], Iterable[torch.Tensor]],
    settings: ScoreSettings,
) -> int:
    """Variants per wave: the setting, all of them for None, and for "auto" the most whose planned peak per
    rank fits this device (`puzzle.plan.scoring_wave_size_for`: the CUDA device's memory, else the host's),
    logged with the reason. `puzzle.Run` resolves "auto" itself, against the run's hardware settings."""
    wave = settings.variants_per_wave
    if wave != "auto":
        return wave or max(1, len(pending))
    first = next(iter(read_batches()), None)
    if not pending or first is None:
        return max(1, len(pending))
    from puzzle.cost.hardware import DEFAULT_MEMORY_FRACTION
    from puzzle.plan import device_memory_bytes, scoring_wave_size_for

    memory, what = device_memory_bytes()
    found = scoring_wave_size_for(
        parent.spec,
        pending,
        settings,
        batch=first.shape[0],
        seq_len=first.shape[-1],
        dtype_bytes=parent.embeddings.weight.element_size(),
        world=dist.world_size(),
        memory_bytes=memory * DEFAULT_MEMORY_FRACTION,
    )
    if dist.is_main():
        _log.info(
            "scoring: variants_per_wave auto -> %d: %s (%g x %s)",
            found.size,
            found.reason,
            DEFAULT_MEMORY_FRACTION,
            what,
        )
    return int(dist.broadcast_object(found.size))  # every rank runs the same waves (collectives)


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
    parent_fp: str | None = None,
    context: HybridLM | None = None,
    context_fp: str | None = None,
) -> Scores:
    """Score every variant as the parent with only its block replaced, on held-out `batches`; write scores.json.

    `mixers`: variant -> its mixer (a module from `build_block`, same device and dtype as the parent), or a
    callable building / loading one on demand (called once per wave for the variants still to score, so a
    big library is never all in memory); None for a variant with the parent's own block spec means the
    parent's mixer: that variant is the parent and scores 0 KL and full agreement (its suffix recomputation
    is checked once per wave, see the module docstring). Under FSDP (`ScoreSettings.shard`) the parent and
    the mixers are sharded in place: load fresh ones for other work.
    `batches`: held-out int64 `[b, t]` token batches, a sequence or a zero-argument callable returning a
    fresh iterable (the batches are read once per wave); each rank scores its `dist.shard` of them.
    `data_fingerprint`: names the data (e.g. `fingerprint_file` of the token file); default
    `fingerprint_tensors` of the batches. `mixer_fingerprints`: per variant, a fingerprint of its weights;
    a saved score with another fingerprint is recomputed. Without one, a mixer given in a mapping is
    fingerprinted from its weights; one from a callable is trusted by its id. A failed variant (non-finite
    logits) is a result too: it is not retried unless its fingerprint changes. `parent_fp`: the parent's
    fingerprint keying the saved scores (`puzzle.Run` passes one from the parent's files); default
    `fingerprint_model(parent)`.

    `context`: scores in context. Each variant replaces its block of `context` (e.g. an assembled child,
    `puzzle.assemble.assemble`) instead of the parent's; the KL etc. are still to the parent's next-token
    distributions. The context needs the parent's embeddings, final norm and lm_head (as an assembled child
    has them) and as many blocks; a variant with the context's own block spec is the context itself (its
    own mixer, scored once per batch, whatever `mixers` gives for it), so its record is the context's KL
    to the parent. The context's prefix runs once per batch as the parent's does without one, and the
    parent once more, whole, for the reference. `context_fp` keys the saved scores (default
    `fingerprint_model(context)`).

    Peak memory beyond the forward passes, per batch of N = b * (t - 1) positions: the kept block inputs
    (N * H per block with variants in the wave, parent dtype, each freed once its variants have run), the
    final hidden state of every variant of the wave that runs (N * H each: they wait for the shared chunk
    pass), and for the chunk pass the parent's chunk logits and probabilities, the chunk logits of the
    variant in flight and one scratch buffer: 4 fp32 `[N, vocab_chunk]` tensors, 16 * N * vocab_chunk bytes
    (268 MB for N = 4,096 and the default chunk 4,096) whatever the vocabulary size; plus the `[N, H]`
    lm_head rows of the parent's top-1 tokens. Under FSDP add the whole lm_head weight.

    Collective under torch.distributed (same arguments on every rank). Returns the requested variants'
    scores; scores.json holds every variant scored so far from the same parent, data and settings.
    """
    settings = settings or ScoreSettings()
    out_dir = Path(out_dir)
    if context is not None and context.spec.num_blocks != parent.spec.num_blocks:
        raise ValueError(
            f"the context model has {context.spec.num_blocks} blocks, the parent {parent.spec.num_blocks}: "
            "a context replaces the parent's blocks one for one"
        )
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
        "parent": parent_fp or fingerprint_model(parent),
        "data": data_fingerprint,
        "settings": fingerprint_json({"format": FORMAT, "top_k": TOP_K}),
    }
    if context is not None:
        inputs["context"] = context_fp or fingerprint_model(context)

    def fingerprint_of(variant: Variant) -> str:
        if mixer_fingerprints is not None and variant in mixer_fingerprints:
            return mixer_fingerprints[variant]
        if not callable(mixers):  # also checks, before any work, that every variant has a mixer
            return _mixer_fingerprint(_get_mixer(parent, mixers, variant, context))
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
    pending.sort(key=_order)
    size = _wave_size(parent, pending, read_batches, settings)
    waves = [pending[start : start + size] for start in range(0, len(pending), size)]
    sharded = shard.active(settings.shard)
    if sharded and waves:
        shard.shard_parent(parent, settings.shard)
        if context is not None:
            shard.shard_parent(context, settings.shard)
    # The whole lm_head for the chunk matmuls, all-gathered once when sharded (every rank, same order).
    with torch.no_grad():
        weight = shard.replicated(parent.lm_head.weight) if waves else parent.lm_head.weight
        if context is not None and waves:
            _check_context_head(weight, context)
    device = weight.device
    models = [parent] if context is None else [parent, context]
    was_training = [model.training for model in models]
    for model in models:
        model.eval()
    try:
        for number, wave in enumerate(waves):
            held = {}
            for v in wave:
                held[v] = mixer = _get_mixer(parent, mixers, v, context)
                if sharded:  # one variant at a time is whole, as loaded: shard it before the next
                    # Scored, never trained: and FSDP wants one dtype over a unit's trainable parameters,
                    # where a bf16 MoE keeps its router fp32 (`puzzle.blocks.moe`).
                    mixer.requires_grad_(False)
                    shard.shard_variant(mixer, settings.shard)
            model = parent if context is None else context
            own = [v for v in wave if held[v] is model.layers[v.block_index].mixer]
            check = min(own, key=_order) if own else None
            # + the parent's, the check's; with a context: its own, and its own on the check's batches
            rows = len(wave) + (2 if context is None else 4)
            sums = torch.zeros(rows, _NUM_SUMS, dtype=torch.float64, device=device)
            steps, common = _steps(read_batches, sharded)
            state = _wave_state(inputs, wave, sharded)
            resumed = _load_wave(out_dir, state, len(sums)) if dist.is_main() else None
            first, saved = dist.broadcast_object(resumed) or (0, None)
            if saved is not None and dist.is_main():  # the sums of every rank so far, on rank 0
                sums.copy_(torch.tensor(saved, dtype=torch.float64))
            desc = f"scoring wave {number + 1}/{len(waves)}"
            for step, (ids, counted) in enumerate(progress(steps, desc=desc, unit="batch")):
                if step < first:
                    continue  # scored before the run was killed
                into = sums if counted else torch.zeros_like(sums)  # a padding batch: collectives only
                checked = check if step == 0 else None
                _score_batch(
                    parent, weight, ids.to(device), wave, held, into, settings.vocab_chunk, checked, context
                )
                every = settings.checkpoint_every
                if every and (step + 1) % every == 0 and step + 1 < common:  # same steps on every rank
                    _save_wave(out_dir, state, step + 1, sums)
            dist.all_reduce_sum_([sums])
            sums = sums.cpu()
            if check is not None:
                expected = None if context is None else sums[len(wave) + 3]
                _check_parent(check, sums[len(wave) + 1], settings.parent_kl_tolerance, expected)
            for row, variant in enumerate(wave):
                done[_key(variant)] = _record(variant, sums[row], fingerprints[variant]).to_dict()
            tokens = int(sums[len(wave), _Sum.TOKENS])
            totals = {
                "tokens": tokens,
                "parent_loss": float(sums[len(wave), _Sum.PARENT_NLL] / tokens) if tokens else None,
            }
            del held
            if sharded:
                shard.free_dropped_units()  # this wave's sharded variants
            with dist.main_process_first():
                if dist.is_main():
                    atomic_write(out_dir / PARTIAL_FILE, json_writer(_content(inputs, done, totals)))
                    (out_dir / WAVE_FILE).unlink(missing_ok=True)
    finally:
        for model, training in zip(models, was_training):
            model.train(training)
    totals = totals or {"tokens": 0, "parent_loss": None}
    artifact = Artifact(out_dir, "scores", FORMAT)
    if waves or not current:
        content = _content(inputs, done, totals)
        artifact.write(inputs, {SCORES_FILE: json_writer(content)}, info={**totals, "variants": len(done)})
    with dist.main_process_first():
        if dist.is_main():
            (out_dir / PARTIAL_FILE).unlink(missing_ok=True)
            (out_dir / WAVE_FILE).unlink(missing_ok=True)
    scores = {v: VariantScore.from_dict(done[_key(v)]) for v in requested}
    return Scores(scores, totals["tokens"], totals["parent_loss"], inputs)
