"""Next-token statistics over a large vocabulary, one lm_head chunk at a time: no `[tokens, V]` tensor is built.

`LogitStream` accumulates per-token statistics of one model's logits (online logsumexp, target logit,
top-k ids, the cross term of a KL to a reference model) as vocabulary chunks arrive; scoring uses it
forward-only. `distillation_head_loss` is the differentiable version for training a student against a
teacher: KL(teacher || student) and the student's LM loss from two chunked passes over the vocabulary,
with the gradients of the student's hidden states and lm_head weight made in the second pass (the teacher
is never needed in the backward, and no per-token probability table is kept for it).
"""

from __future__ import annotations

import math

import torch

TOP_K = 5

# Rows of the sums `distillation_head_loss` returns (fp64), summed over the positions given to it.
KL_SUM, NLL_SUM, TEACHER_NLL_SUM, TOP1_SUM, POSITIONS = range(5)
NUM_HEAD_SUMS = 5


def merge_top(
    values: torch.Tensor | None, ids: torch.Tensor | None, z: torch.Tensor, start: int, k: int = TOP_K
) -> tuple[torch.Tensor, torch.Tensor]:
    """Running top-k (values, ids) [N, <=k] merged with chunk logits z [N, C] whose ids start at `start`."""
    chunk_k = min(k, z.shape[-1])
    chunk_values, chunk_ids = z.topk(chunk_k, dim=-1)
    chunk_ids = chunk_ids + start
    if values is None:
        return chunk_values, chunk_ids
    values, picked = torch.cat([values, chunk_values], -1).topk(min(k, values.shape[-1] + chunk_k), dim=-1)
    return values, torch.cat([ids, chunk_ids], -1).gather(-1, picked)


def vocab_chunks(vocab: int, chunk: int) -> list[tuple[int, int]]:
    """(start, stop) of each run of `chunk` vocabulary rows (the last may be shorter)."""
    return [(start, min(start + chunk, vocab)) for start in range(0, vocab, chunk)]


def plain_fp32(*tensors: torch.Tensor) -> bool:
    """Whether products of `tensors` may write into a caller's fp32 buffer (`out=`) and give what the
    out-of-place op gives: every one fp32 and no autocast on their device (autocast does not apply to out=
    ops, so under it the ops stay out of place, cast as autocast casts them)."""
    device = tensors[0].device.type
    return all(t.dtype == torch.float32 for t in tensors) and not torch.is_autocast_enabled(device)


def chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, start: int, stop: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """hidden [N, H] -> fp32 logits [N, stop - start] of vocabulary rows start..stop (as HybridLM.forward).

    `out`: an fp32 [N, stop - start] buffer to write them into (the same product, bit for bit) where the
    operands are fp32 and no autocast is on; elsewhere they are made afresh and `out` is left alone. On the
    CPU a fresh tensor above glibc's mmap threshold (1 MiB once `puzzle.hostmem` has fixed it) is mapped and
    zero-filled page by page, which costs as much as the product at lm_head sizes, so reuse pays.
    """
    rows = weight[start:stop]
    if out is not None and plain_fp32(hidden, rows):
        return torch.mm(hidden, rows.t(), out=out)
    return torch.nn.functional.linear(hidden, rows).float()


class ChunkBuffers:
    """`count` fp32 buffers of [N, widest chunk] elements for a pass over `chunks` (`vocab_chunks`), handed
    out as contiguous [N, width] views chunk after chunk (`view`), so a chunked pass writes its per-chunk
    tensors into the same memory every chunk."""

    def __init__(self, n: int, chunks: list[tuple[int, int]], count: int, device: torch.device) -> None:
        self.n = n
        widest = max(stop - start for start, stop in chunks)
        self.storage = [torch.empty(n * widest, dtype=torch.float32, device=device) for _ in range(count)]

    def view(self, index: int, start: int, stop: int) -> torch.Tensor:
        """Buffer `index` as an [N, stop - start] tensor (its contents are whatever was written last)."""
        return self.storage[index][: self.n * (stop - start)].view(self.n, stop - start)


class LogitStream:
    """Per-token statistics of one model's logits [N, V], fed one vocabulary chunk at a time.

    Online logsumexp (running max and sum, fp64 across chunks), the target's logit and the `top_k` ids. A
    nan or +inf logit makes the running max, hence the log-normaliser, non-finite (checked once at the end,
    not per chunk). With a reference model's chunks (`update(..., parent=...)` or `add_cross`) and a
    per-token `shift`, also sum_v p_v (z_parent - z - shift) for the KL (see `kl`).
    """

    def __init__(
        self, n: int, targets: torch.Tensor, shift: torch.Tensor | None = None, top_k: int = TOP_K
    ) -> None:
        device = targets.device
        self.targets = targets
        self.top_k = top_k
        self.running_max = torch.full((n,), -math.inf, dtype=torch.float64, device=device)
        self.running_sum = torch.zeros(n, dtype=torch.float64, device=device)
        self.target_logit = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_values: torch.Tensor | None = None
        self.top_ids: torch.Tensor | None = None
        self.shift = shift
        self.cross = torch.zeros(n, dtype=torch.float64, device=device)

    def update(
        self,
        z: torch.Tensor,
        start: int,
        stop: int,
        parent: tuple[torch.Tensor, torch.Tensor] | None = None,
        scratch: torch.Tensor | None = None,
    ) -> None:
        """Add chunk logits z [N, stop - start] (fp32); `parent`: its (chunk logits, probabilities) [N, C];
        `scratch`: an fp32 [N, C] buffer the chunk's exps (and the KL's cross term) are written into instead
        of fresh tensors (`ChunkBuffers`)."""
        chunk_max, chunk_argmax = z.max(-1)
        new_max = torch.maximum(self.running_max, chunk_max.double())
        # -inf - -inf is nan: rows with no finite logit yet keep a zero sum (they are non-finite anyway).
        scale = torch.exp(torch.nan_to_num(self.running_max - new_max, nan=0.0))
        chunk_sum = torch.sub(z, new_max.float()[:, None], out=scratch).exp_().sum(-1).double()
        self.running_sum = self.running_sum * scale + chunk_sum
        self.running_max = new_max
        inside = (self.targets >= start) & (self.targets < stop)
        local = (self.targets - start).clamp(0, stop - start - 1)
        self.target_logit = torch.where(inside, z.gather(-1, local[:, None])[:, 0], self.target_logit)
        if self.top_k == 1:  # the chunk's max is already known: no topk
            chunk_max, chunk_ids = chunk_max[:, None], chunk_argmax[:, None] + start
            if self.top_values is None:
                self.top_values, self.top_ids = chunk_max, chunk_ids
            else:
                better = chunk_max > self.top_values
                self.top_values = torch.where(better, chunk_max, self.top_values)
                self.top_ids = torch.where(better, chunk_ids, self.top_ids)
        elif self.top_k > 1:
            self.top_values, self.top_ids = merge_top(self.top_values, self.top_ids, z, start, self.top_k)
        if parent is not None:
            self.add_cross(z, *parent, scratch=scratch)

    def add_cross(
        self,
        z: torch.Tensor,
        parent_z: torch.Tensor,
        parent_p: torch.Tensor,
        scratch: torch.Tensor | None = None,
    ) -> None:
        """Add sum_v p_v (zp_v - z_v - shift) of one chunk [N, C] to the KL's cross term (needs `shift`);
        `scratch`: an fp32 [N, C] buffer to compute it in (it may be `parent_z` itself, then overwritten)."""
        difference = torch.sub(parent_z, z, out=scratch)
        difference -= self.shift.float()[:, None]
        self.cross += difference.mul_(parent_p).sum(-1).double()

    @property
    def log_normaliser(self) -> torch.Tensor:
        """log sum_v exp(z_v) per token [N] (fp64)."""
        return self.running_max + self.running_sum.log()

    def kl(self, parent: LogitStream) -> torch.Tensor:
        """KL(parent || this) per token [N] (fp64), nats.

        KL = sum_v p_v (log p_v - log q_v) = sum_v p_v (zp_v - z_v - shift) + (Z - Zp + shift), with Z, Zp the
        log-normalisers: one pass over the vocabulary, since Zp is known before it and Z only enters as a
        per-token constant. `shift` = zp - z at the parent's top-1 token cancels a constant offset between
        the two logit vectors before the fp32 products, so near-equal distributions keep their precision
        (equal logits give exactly 0).
        """
        return self.cross + (self.log_normaliser - parent.log_normaliser + self.shift)


def head_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    kl_scale: float = 0.0,
    nll_scale: float = 0.0,
    gradients: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sums of KL(teacher || student), student and teacher LM loss and top-1 agreement over N positions, and
    optionally the gradients of `kl_scale * sum KL + nll_scale * sum NLL`; everything under no_grad.

    `hidden` [N, H] and `weight` [V, H]: the student's final normed hidden states and lm_head weight;
    `teacher_hidden` [N, H], `teacher_weight` [V, H] the teacher's; `targets` [N] the next tokens. Returns
    (sums [NUM_HEAD_SUMS] fp64 (rows KL_SUM, ...), grad of hidden [N, H] or None, grad of weight [V, H] or
    None). Logits are made in whatever dtype the inputs and an ambient autocast give (as `chunk_logits`).

    Pass 1 streams both models' chunks for their log-normalisers, target logits and top-1 ids. Pass 2
    recomputes each chunk and, with p = softmax(teacher), q = softmax(student), adds the KL's cross term
    (`LogitStream.kl`) and the gradient of the chunk's logits, kl_scale (q - p) + nll_scale (q - onehot),
    pushed at once through the chunk's rows: grad_hidden += g W_chunk, grad_weight[chunk] = g^T hidden.
    Every chunk writes into the same 3 fp32 [N, chunk] buffers (`ChunkBuffers`: on the CPU a fresh tensor of
    that size is mapped and zero-filled anew, as dear as its product), and with fp32 operands and no autocast
    the logits and g^T h go there too (`chunk_logits(out=)`); otherwise those are made afresh each chunk, the
    products in the dtype the inputs and autocast give. Peak beyond the inputs: about 5 fp32 [N, chunk]
    tensors (20 N chunk bytes), grad_weight [V, H] in the weight's dtype (the size of the gradient the
    backward produces anyway) and grad_hidden [N, H] fp32.
    """
    with torch.no_grad():
        n = targets.numel()
        chunks = vocab_chunks(weight.shape[0], chunk)
        buffers = ChunkBuffers(n, chunks, 3, targets.device)
        teacher = LogitStream(n, targets, top_k=1)
        student = LogitStream(n, targets, top_k=1)
        for start, stop in chunks:
            logits, scratch = buffers.view(0, start, stop), buffers.view(1, start, stop)
            z = chunk_logits(teacher_hidden, teacher_weight, start, stop, out=logits)
            teacher.update(z, start, stop, scratch=scratch)
            z = chunk_logits(hidden, weight, start, stop, out=logits)
            student.update(z, start, stop, scratch=scratch)
        top1 = teacher.top_ids[:, 0]
        # The teacher-minus-student logit at the teacher's top-1 token (see LogitStream.kl).
        teacher_top1 = (teacher_hidden * teacher_weight.index_select(0, top1)).float().sum(-1)
        student.shift = (teacher_top1 - (hidden * weight.index_select(0, top1)).float().sum(-1)).double()
        teacher_lse = teacher.log_normaliser.float()[:, None]
        student_lse = student.log_normaliser.float()[:, None]
        grad_hidden = grad_weight = None
        if gradients:
            grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            grad_weight = torch.zeros_like(weight)
        rows = torch.arange(n, device=targets.device)
        hidden_w = hidden.to(weight.dtype) if gradients else hidden
        # g^T h straight into grad_weight's rows: out= ops do not autocast, so only without it.
        into_grad = not torch.is_autocast_enabled(hidden.device.type)
        for start, stop in chunks:
            teacher_z = chunk_logits(
                teacher_hidden, teacher_weight, start, stop, out=buffers.view(0, start, stop)
            )
            p = torch.sub(teacher_z, teacher_lse, out=buffers.view(1, start, stop)).exp_()
            z = chunk_logits(hidden, weight, start, stop, out=buffers.view(2, start, stop))
            student.add_cross(z, teacher_z, p, scratch=teacher_z)  # teacher_z is not needed any more
            del teacher_z
            if not gradients:
                continue
            q = z.sub_(student_lse).exp_()  # in place: z is not needed any more
            g = q.mul_(kl_scale + nll_scale).sub_(p, alpha=kl_scale) if kl_scale else q.mul_(nll_scale)
            if nll_scale:
                inside = (targets >= start) & (targets < stop)
                g[rows[inside], targets[inside] - start] -= nll_scale
            g = g.to(weight.dtype)
            grad_hidden += (g @ weight[start:stop]).float()
            if into_grad:
                torch.mm(g.t(), hidden_w, out=grad_weight[start:stop])
            else:
                grad_weight[start:stop] = (g.t() @ hidden_w).to(weight.dtype)
            del p, z, q, g
        kl = student.kl(teacher)
        sums = torch.zeros(NUM_HEAD_SUMS, dtype=torch.float64, device=targets.device)
        sums[KL_SUM] = kl.sum()
        sums[NLL_SUM] = (student.log_normaliser - student.target_logit.double()).sum()
        sums[TEACHER_NLL_SUM] = (teacher.log_normaliser - teacher.target_logit.double()).sum()
        sums[TOP1_SUM] = (student.top_ids[:, 0] == top1).sum()
        sums[POSITIONS] = n
    return sums, grad_hidden, grad_weight


class _DistillationHeadLoss(torch.autograd.Function):
    """loss = kl_scale * sum KL + nll_scale * sum NLL, gradients made in the forward by `head_pass`."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, targets, chunk, kl_scale, nll_scale):
        sums, grad_hidden, grad_weight = head_pass(
            hidden,
            weight,
            teacher_hidden,
            teacher_weight,
            targets,
            chunk,
            kl_scale,
            nll_scale,
            gradients=True,
        )
        ctx.save_for_backward(grad_hidden.to(hidden.dtype))
        # Not saved for backward: it is scaled in place there (no second [V, H] tensor), so a second
        # backward through this graph (retain_graph) has nothing left to scale and raises.
        ctx.grad_weight = grad_weight
        loss = (kl_scale * sums[KL_SUM] + nll_scale * sums[NLL_SUM]).float()
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    def backward(ctx, grad_loss, grad_sums):
        (grad_hidden,) = ctx.saved_tensors
        grad_weight, ctx.grad_weight = ctx.grad_weight, None
        if grad_weight is None:
            raise RuntimeError("distillation_head_loss: its backward runs once (no retain_graph)")
        scale = grad_loss.to(grad_hidden.dtype)
        hidden_grad = grad_hidden * scale if ctx.needs_input_grad[0] else None
        weight_grad = grad_weight.mul_(scale.to(grad_weight.dtype)) if ctx.needs_input_grad[1] else None
        return hidden_grad, weight_grad, None, None, None, None, None, None


def distillation_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    kl_scale: float,
    nll_scale: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, sums): loss = kl_scale * sum_n KL_n(teacher || student) + nll_scale * sum_n NLL_n, a differentiable
    fp32 scalar of the student's `hidden` [N, H] and lm_head `weight` [V, H], computed in vocabulary chunks of
    `chunk` rows (see `head_pass` for the passes and the peak memory); `sums` [NUM_HEAD_SUMS] fp64, no grad.

    The teacher's `teacher_hidden` [N, H] and `teacher_weight` [V, H] are read in the forward only.
    """
    return _DistillationHeadLoss.apply(
        hidden, weight, teacher_hidden, teacher_weight, targets, chunk, kl_scale, nll_scale
    )
