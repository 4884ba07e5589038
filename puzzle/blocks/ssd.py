"""Mamba-2 in plain torch: the chunked SSD scan (prefill), its one-step recurrence (decode), and the causal conv.

Notation: b batch, t time, h heads, p head_dim, g groups (h = g * r heads share one B/C group), n state size,
c chunks of q positions, k conv taps. The SSM is, per head, with a = dt * A (A < 0):

    S_t = exp(a_t) * S_{t-1} + dt_t * x_t B_t^T      (S: [p, n])
    y_t = S_t C_t

The chunked form computes the same thing with matmuls: inside each chunk an attention-like product masked by
the decay, across chunks a short recurrence over the chunk-boundary states. B and C are never repeated per head:
every product that involves them runs per group with the group's r heads side by side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# exp(-80) < 2e-35: decays below it are already invisible in fp32 next to the terms they are added to, and
# clamping there keeps exp (and everything downstream) off the subnormal slow path, 10-30x slower on CPUs.
_MIN_LOG_DECAY = -80.0


def _decay(log_decay: torch.Tensor, inplace: bool) -> torch.Tensor:
    """exp of a log decay (<= 0) floored at exp(_MIN_LOG_DECAY); anything above 0 becomes 1."""
    if inplace:
        return log_decay.clamp_(min=_MIN_LOG_DECAY, max=0.0).exp_()
    return log_decay.clamp(min=_MIN_LOG_DECAY, max=0.0).exp()


def _scale(tensor: torch.Tensor, factor: torch.Tensor, inplace: bool) -> torch.Tensor:
    """tensor * factor, in place when no gradient has to flow through (3x faster on CPU for big tensors)."""
    return tensor.mul_(factor) if inplace else tensor * factor


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    silu: bool = False,
    overwrite_input: bool = False,
    block_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over time, channels last, optionally followed by SiLU.

    x: [b, t, ch]; weight: [ch, k]; bias: [ch] or None; initial_state: [b, ch, k-1] (the k-1 inputs before x,
    oldest first; zeros if None). With `overwrite_input` (inference only) the result is written over x.
    Returns (y [b, t, ch] in x's dtype, final_state [b, ch, k-1]: the last k-1 inputs, for the next call).

    Works through time in blocks of `block_size` rows, last block first, so that each block's taps and SiLU
    run on cache-resident rows and y can take the place of x (no second [b, t, ch] tensor).
    """
    b, t, ch = x.shape
    k = weight.shape[-1]
    if initial_state is None:
        previous = x.new_zeros(b, k - 1, ch)
    else:
        previous = initial_state.transpose(1, 2).to(x.dtype)  # [b, k-1, ch]
    if t >= k - 1:
        final_state = x[:, t - (k - 1) :].transpose(1, 2)
    else:
        final_state = torch.cat([previous[:, t:], x], dim=1).transpose(1, 2)
    if overwrite_input:
        final_state = final_state.clone()
        out = x
    else:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)

    for start in reversed(range(0, t, block_size)):
        end = min(start + block_size, t)
        # The inputs this block sees: rows start-(k-1) .. end-1, reaching into the cached ones at the start.
        if start >= k - 1:
            window = x[:, start - (k - 1) : end]
        else:
            window = torch.cat([previous[:, start:], x[:, :end]], dim=1)
        rows = end - start
        block = window[:, k - 1 :] * weight[:, k - 1]
        for tap in range(k - 1):
            block.addcmul_(window[:, tap : tap + rows], weight[:, tap])
        if bias is not None:
            block += bias
        if silu:
            block = F.silu(block)
        out[:, start:end] = block
    return out, final_state


def causal_conv1d_update(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """One step of `causal_conv1d`: x [b, ch] -> y [b, ch]; `state` [b, ch, k-1] is shifted in place."""
    window = torch.cat([state, x.unsqueeze(-1).to(state.dtype)], dim=-1)  # [b, ch, k]
    y = (window.to(x.dtype) * weight).sum(-1)
    if bias is not None:
        y += bias
    state.copy_(window[..., 1:])
    return y


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked SSD scan (no D skip, no gate), computed in fp32.

    x: [b, t, h, p]; dt: [b, t, h] (already softplus-ed and clamped); A: [h] (negative);
    B, C: [b, t, g, n]; initial_state: [b, h, p, n] or None (zeros).
    Returns (y [b, t, h, p] fp32, final state [b, h, p, n] fp32, or None unless `return_final_state`).
    Any t works: the last chunk is simply shorter.

    Chunks are visited in order, carrying the state from one to the next. Every temporary is one chunk's
    worth (cache-sized, and memory stays O(chunk) instead of O(t * chunk)); the matmuls are per group, with
    the group's r heads side by side as r * p columns.
    """
    b, t, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    f32 = torch.float32
    # Training needs the autograd graph intact; inference overwrites the chunk temporaries in place.
    inplace = not (
        torch.is_grad_enabled()
        and any(v is not None and v.requires_grad for v in (x, dt, A, B, C, initial_state))
    )

    # 0. Discretize: a = dt * A is the log decay of each step, x is fed in scaled by dt.
    dt = dt.to(f32)
    a = dt * A.to(f32)  # [b, t, h]
    if initial_state is None:
        state = torch.zeros(b, h, p, n, dtype=f32, device=x.device)
    else:
        state = initial_state.to(f32).clone(memory_format=torch.contiguous_format)
    out = torch.empty(b, t, h, p, dtype=f32, device=x.device)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()

    for start in range(0, t, chunk_size):
        end = min(start + chunk_size, t)
        q = end - start
        x_dt = x[:, start:end].to(f32) * dt[:, start:end, :, None]  # [b, q, h, p]
        B_c = B[:, start:end].to(f32).transpose(1, 2).contiguous()  # [b, g, q, n]
        C_c = C[:, start:end].to(f32).transpose(1, 2).contiguous()
        a_cum = a[:, start:end].transpose(1, 2).cumsum(dim=-1)  # [b, h, q]: log decay since the chunk start

        # 1. Inside the chunk: y[l] = sum_{s <= l} (C_l . B_s) exp(a_cum[l] - a_cum[s]) x_dt[s].
        #    C B^T per group; the per-head decay is broadcast into it. The causal mask goes on the (smaller)
        #    per-group scores, so above the diagonal the decay may be anything finite (it is clamped to 1).
        scores = torch.matmul(C_c, B_c.transpose(-1, -2)).masked_fill_(~causal[:q, :q], 0.0)  # [b, g, q, q]
        decay = _decay(a_cum[..., :, None] - a_cum[..., None, :], inplace)  # [b, h, q, q]
        weights = _scale(decay.view(b, g, r, q, q), scores[:, :, None], inplace).view(b, h, q, q)
        y = torch.matmul(weights, x_dt.transpose(1, 2))  # [b, h, q, p]

        # 2. The state entering the chunk, read out by C and decayed to each position: [b, g, q, r * p].
        state_g = state.view(b, g, r * p, n)
        y_state = torch.matmul(C_c, state_g.transpose(-1, -2)).view(b, g, q, r, p)
        from_start = _decay(a_cum.clone(), inplace).view(b, g, r, q).transpose(-1, -2)[..., None]
        y_state = _scale(y_state, from_start, inplace)
        both = y.view(b, g, r, q, p).permute(0, 3, 1, 2, 4) + y_state.transpose(1, 2)  # [b, q, g, r, p]
        out[:, start:end] = both.reshape(b, q, h, p)

        # 3. The state leaving the chunk: the entering one decayed over the whole chunk, plus the chunk's own
        #    inputs decayed to its end, sum_s exp(a_cum[-1] - a_cum[s]) x_dt[s] B_s^T (per group).
        to_end = _decay(a_cum[..., -1:] - a_cum, inplace).transpose(1, 2)  # [b, q, h]
        x_end = (x_dt * to_end[..., None]).reshape(b, q, g, r * p).transpose(1, 2)  # [b, g, q, r * p]
        own = torch.matmul(x_end.transpose(-1, -2), B_c).view(b, h, p, n)
        chunk_decay = _decay(a_cum[..., -1].clone(), inplace)[..., None, None]  # [b, h, 1, 1]
        state = state.mul_(chunk_decay).add_(own) if inplace else state * chunk_decay + own

    return out, (state if return_final_state else None)


def ssd_state_update(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> torch.Tensor:
    """One recurrent step (no D skip): S = exp(dt A) S + dt x B^T, y = S C. Updates `state` in place.

    state: [b, h, p, n] fp32, contiguous (a decode cache; no autograd through it); x: [b, h, p];
    dt: [b, h] (softplus-ed, clamped); A: [h]; B, C: [b, g, n]. Returns y: [b, h, p] fp32.
    """
    b, h, p, n = state.shape
    g = B.shape[1]
    r = h // g
    dt = dt.to(state.dtype)
    grouped = state.view(b, g, r, p, n)
    grouped.mul_(_decay(dt * A.to(state.dtype), inplace=True).view(b, g, r, 1, 1))
    x_dt = (x.to(state.dtype) * dt.unsqueeze(-1)).view(b, g, r, p, 1)
    grouped.addcmul_(x_dt, B.to(state.dtype).view(b, g, 1, 1, n))
    # S C per group: [b, g, r*p, n] x [b, g, n, 1].
    y = torch.matmul(state.view(b, g, r * p, n), C.to(state.dtype).view(b, g, n, 1))
    return y.view(b, h, p)
