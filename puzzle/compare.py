"""Two whole models on held-out tokens: an assembled or distilled child against its parent (KL, LM-loss change,
top-1 agreement), with the chunked logits of scoring (`puzzle.logits`), data-parallel under torch.distributed."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from puzzle import dist, shard
from puzzle.logits import (
    KL_SUM,
    NLL_SUM,
    NUM_HEAD_SUMS,
    POSITIONS,
    TEACHER_NLL_SUM,
    TOP1_SUM,
    ChunkBuffers,
    LogitStream,
    chunk_logits,
    vocab_chunks,
)
from puzzle.model import HybridLM


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

    The same chunked computation as scoring (`puzzle.logits.LogitStream`): each model's logits exist one vocabulary chunk of
    `vocab_chunk` rows at a time, each through its own lm_head. Batches are data-parallel under
    torch.distributed (`dist.shard`, sums all-reduced). A parent sharded with FSDP2 (`puzzle.Run` shares
    one parent that BLD, scoring and GKD shard in place) all-gathers its units in every forward, a
    collective: then every rank runs every batch, with the whole lm_head gathered once, and no sums are
    reduced; the same when the child is sharded (assembled from a sharded parent). Non-finite child logits are a ValueError.
    """
    if parent.spec.vocab_size != child.spec.vocab_size:
        raise ValueError(
            f"the child's vocabulary ({child.spec.vocab_size}) is not the parent's ({parent.spec.vocab_size})"
        )
    listed = batches() if callable(batches) and not isinstance(batches, Sequence) else batches
    sharded = any(isinstance(module, FSDPModule) for model in (parent, child) for module in model.modules())
    # The whole lm_heads, gathered once when sharded (every rank, in the same order).
    parent_weight = shard.replicated(parent.lm_head.weight) if sharded else parent.lm_head.weight
    child_weight = shard.replicated(child.lm_head.weight) if sharded else child.lm_head.weight
    device = parent_weight.device
    sums = torch.zeros(NUM_HEAD_SUMS, dtype=torch.float64, device=device)  # the child is the student
    modes = parent.training, child.training
    parent.eval()
    child.eval()
    try:
        for ids in listed if sharded else dist.shard(listed):
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
            chunks = vocab_chunks(parent_weight.shape[0], vocab_chunk)
            # The same 4 buffers every chunk (`ChunkBuffers`: a fresh tensor of that size costs its page faults).
            buffers = ChunkBuffers(n, chunks, 4, device)
            parent_stream = LogitStream(n, targets)
            for start, stop in chunks:
                z = chunk_logits(parent_hidden, parent_weight, start, stop, out=buffers.view(0, start, stop))
                parent_stream.update(z, start, stop, scratch=buffers.view(1, start, stop))
            top1 = parent_stream.top_ids[:, 0]
            shift = (parent_hidden * parent_weight[top1]).float().sum(-1) - (
                child_hidden * child_weight[top1]
            ).float().sum(-1)
            child_stream = LogitStream(n, targets, shift.double())
            for start, stop in chunks:
                view = [buffers.view(index, start, stop) for index in range(4)]
                parent_z = chunk_logits(parent_hidden, parent_weight, start, stop, out=view[0])
                parent_p = torch.sub(
                    parent_z, parent_stream.log_normaliser.float()[:, None], out=view[1]
                ).exp_()
                child_z = chunk_logits(child_hidden, child_weight, start, stop, out=view[2])
                child_stream.update(child_z, start, stop, (parent_z, parent_p), scratch=view[3])
            kl = child_stream.kl(parent_stream)
            if not bool(torch.isfinite(kl).all()):
                raise ValueError("the child gives non-finite logits on the held-out batches")
            sums[KL_SUM] += kl.sum()
            sums[NLL_SUM] += (child_stream.log_normaliser - child_stream.target_logit.double()).sum()
            sums[TEACHER_NLL_SUM] += (
                parent_stream.log_normaliser - parent_stream.target_logit.double()
            ).sum()
            sums[TOP1_SUM] += (child_stream.top_ids[:, 0] == top1).sum()
            sums[POSITIONS] += n
    finally:
        parent.train(modes[0])
        child.train(modes[1])
    if not sharded:  # else every rank measured every batch
        dist.all_reduce_sum_([sums])
    tokens = int(sums[POSITIONS])
    if tokens == 0:
        raise ValueError("no held-out positions: every batch needs at least 2 tokens per row")
    return ModelComparison(
        kl=float(sums[KL_SUM] / tokens),
        lm_loss_delta=float((sums[NLL_SUM] - sums[TEACHER_NLL_SUM]) / tokens),
        top1=float(sums[TOP1_SUM] / tokens),
        tokens=tokens,
    )
