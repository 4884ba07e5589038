"""Grouped-query causal self-attention with a KV cache; no positional encoding unless the spec asks for RoPE."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from puzzle.blocks.tensors import TensorInfo, linear_tensors
from puzzle.kv_cache import quantize_kv_fp8
from puzzle.spec import AttentionSpec, SpecError

# `enable_gqa` lets SDPA read each KV head for its group of query heads without materialising copies.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, in buffers that grow by doubling.

    `key`, `value`: [b, num_kv_heads, capacity, head_dim]; only the first `stored` positions are
    filled; `length` counts every token seen (the position of the next one). Appending past the
    capacity reallocates to at least twice the size, so a decode of T tokens copies O(T) elements in
    total; pass `max_length` to `init_cache` to preallocate instead.

    `window` W (sliding-window attention): after each append only the last W - 1 tokens stay, all a
    later query can still see beside itself, so the cache never holds more than W positions (the
    chunk being attended included), whatever the context.
    """

    key: torch.Tensor
    value: torch.Tensor
    length: int = 0
    window: int | None = None
    stored: int = 0

    @property
    def capacity(self) -> int:
        return self.key.shape[2]

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store key/value [b, nkv, t, hd] after the cached ones; return the stored keys and values followed
        by these, [b, nkv, stored + t, hd] (what this chunk's queries attend to)."""
        if key.shape[:2] != self.key.shape[:2] or key.shape[3] != self.key.shape[3]:
            raise ValueError(
                f"KV cache holds [batch, kv_heads, _, head_dim] = {list(self.key.shape[:2])} + [{self.key.shape[3]}], "
                f"but the new keys have shape {list(key.shape)}"
            )
        t = key.shape[2]
        if self.window is not None:
            return self._append_windowed(key, value)
        end = self.stored + t
        if end > self.capacity:
            capacity = max(end, 2 * self.capacity)
            self.key = self._grow(self.key, capacity)
            self.value = self._grow(self.value, capacity)
        self.key[:, :, self.stored : end] = key
        self.value[:, :, self.stored : end] = value
        self.stored = self.length = end
        return self.key[:, :, :end], self.value[:, :, :end]

    def _append_windowed(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Attend over the kept tokens and this chunk, then keep the last window - 1 of them (a trimmed copy:
        # the buffer is at most window - 1 long, so each step copies O(window), not O(context)).
        keys = torch.cat((self.key[:, :, : self.stored], key), dim=2)
        values = torch.cat((self.value[:, :, : self.stored], value), dim=2)
        keep = min(keys.shape[2], self.window - 1)
        self.key = keys[:, :, keys.shape[2] - keep :].clone()
        self.value = values[:, :, values.shape[2] - keep :].clone()
        self.stored = keep
        self.length += key.shape[2]
        return keys, values

    def _grow(self, buffer: torch.Tensor, capacity: int) -> torch.Tensor:
        grown = buffer.new_zeros(*buffer.shape[:2], capacity, buffer.shape[3])
        grown[:, :, : self.stored] = buffer[:, :, : self.stored]
        return grown


def rotary_dim(spec: AttentionSpec) -> int:
    """Channels of each head that RoPE rotates (the first `rotary_fraction` of head_dim); 0 without RoPE."""
    if spec.rope_theta is None:
        return 0
    dim = int(spec.head_dim * spec.rotary_fraction)  # floored, as transformers does
    if dim < 2 or dim % 2:
        raise SpecError(
            f"AttentionSpec.rotary_fraction {spec.rotary_fraction} of head_dim {spec.head_dim} gives "
            f"{dim} rotary channels; RoPE needs an even number >= 2"
        )
    return dim


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, dim: int) -> torch.Tensor:
    """Rotate the first `dim` channels of x [b, heads, t, hd] at integer `positions` [t] (rotate-half layout).

    Angles are computed in fp32 and the result cast back to x's dtype.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [t, dim/2]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    rotated, passed = x[..., :dim].float(), x[..., dim:]
    half = dim // 2
    rotate_half = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    rotated = rotated * cos + rotate_half * sin
    return torch.cat((rotated.to(x.dtype), passed), dim=-1)


def band_mask(t: int, total: int, window: int | None, device: torch.device | None = None) -> torch.Tensor:
    """Which of `total` keys each of `t` queries sees: bool [t, total], the queries being the last `t` tokens.

    Query i sits `total - t + i` keys in, so it sees key j when 0 <= (total - t + i) - j, and with a
    `window` W also when that distance is below W (W keys, its own included).
    """
    distance = (
        torch.arange(total - t, total, device=device)[:, None] - torch.arange(total, device=device)[None, :]
    )
    mask = distance >= 0
    if window is not None:
        mask &= distance < window
    return mask


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, window: int | None = None
) -> torch.Tensor:
    """Causal SDPA of q [b, nq, t, hd] over k, v [b, nkv, offset + t, hd] -> [b, nq, t, hd].

    Query i sits at key offset + i and sees keys 0 .. offset + i; with a `window` W only the last W
    of those (`band_mask`). SDPA's own `is_causal` aligns the mask top-left, which is right only when
    there is no cached prefix and no window.
    """
    t, total = q.shape[2], k.shape[2]
    num_q, num_kv = q.shape[1], k.shape[1]
    extra = {}
    if num_q != num_kv:
        if _SDPA_HAS_GQA:
            extra["enable_gqa"] = True
        else:
            k = k.repeat_interleave(num_q // num_kv, dim=1)
            v = v.repeat_interleave(num_q // num_kv, dim=1)
    if window is None or total <= window:  # the band is the whole causal triangle
        if offset == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, **extra)
        if t == 1:  # one new token sees everything cached
            return F.scaled_dot_product_attention(q, k, v, **extra)
        window = None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band_mask(t, total, window, q.device), **extra)


class AttentionMixer(nn.Module):
    """GQA: q_proj [nq*hd, H], k_proj / v_proj [nkv*hd, H], o_proj [H, nq*hd] (+ biases if spec.bias).

    NoPE by default, as Nemotron-H; RoPE on the first `rotary_fraction` of each head when
    `spec.rope_theta` is set, positions counted from the cache length. With `spec.window` W a query
    sees the last W tokens (its own included) and the cache keeps only those. `norm_eps` is unused.

    `kv_scales` (fp32 [2]: k_scale, v_scale; None by default): the block's KV cache is fp8 with these static
    scales (`puzzle.kv_cache`): keys and values are fake-quantized before they are cached or attended to, as
    a served fp8 cache stores them. `kv_observer` (a callable of k, v): sees them, for calibration.
    """

    kv_scales: torch.Tensor | None = None
    kv_observer = None

    def __init__(self, spec: AttentionSpec, hidden_size: int, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.spec = spec
        self.rotary_dim = rotary_dim(spec)
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.q_proj = nn.Linear(hidden_size, q_size, bias=spec.bias)
        self.k_proj = nn.Linear(hidden_size, kv_size, bias=spec.bias)
        self.v_proj = nn.Linear(hidden_size, kv_size, bias=spec.bias)
        self.o_proj = nn.Linear(q_size, hidden_size, bias=spec.bias)

    @staticmethod
    def hub_tensors(spec: AttentionSpec, hidden_size: int) -> list[TensorInfo]:
        """The tensors this mixer stores (names as in NemotronH checkpoints, relative to the mixer), in order."""
        H, q_size, kv_size = hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return (
            linear_tensors("q_proj", q_size, H, "attention_proj", spec.bias)
            + linear_tensors("k_proj", kv_size, H, "attention_proj", spec.bias)
            + linear_tensors("v_proj", kv_size, H, "attention_proj", spec.bias)
            + linear_tensors("o_proj", H, q_size, "attention_proj", spec.bias)
        )

    def init_cache(
        self,
        batch_size: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        max_length: int = 0,
    ) -> KVCache:
        """An empty KV cache (device and dtype default to the weights'); `max_length` preallocates.

        A windowed block's cache holds at most window - 1 tokens between calls, so it preallocates no more.
        """
        weight = self.k_proj.weight
        window = self.spec.window
        if window is not None:
            max_length = min(max_length, window - 1)
        shape = (batch_size, self.spec.num_kv_heads, max_length, self.spec.head_dim)
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        return KVCache(
            key=torch.zeros(shape, device=device, dtype=dtype),
            value=torch.zeros(shape, device=device, dtype=dtype),
            window=window,
        )

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """x: [b, t, H] -> [b, t, H]; with a cache, attend to its keys too and append this chunk's."""
        batch, t, _ = x.shape
        spec = self.spec
        q = self.q_proj(x).view(batch, t, spec.num_heads, spec.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, t, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, t, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        position = 0 if cache is None else cache.length  # of this chunk's first token
        if self.rotary_dim:
            positions = torch.arange(position, position + t, device=x.device)
            q = apply_rope(q, positions, spec.rope_theta, self.rotary_dim)
            k = apply_rope(k, positions, spec.rope_theta, self.rotary_dim)
        if self.kv_observer is not None:
            self.kv_observer(k, v)
        if self.kv_scales is not None:  # what the fp8 cache holds (and the kernel reads) in place of k, v
            k, v = quantize_kv_fp8(k, self.kv_scales[0]), quantize_kv_fp8(v, self.kv_scales[1])
        if cache is not None:
            k, v = cache.append(k, v)
        y = causal_attention(q, k, v, k.shape[2] - t, spec.window)
        return self.o_proj(y.transpose(1, 2).reshape(batch, t, spec.num_heads * spec.head_dim))

    def step(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One-token decode: x [b, 1, H] -> [b, 1, H], appending to `cache`."""
        return self.forward(x, cache)
