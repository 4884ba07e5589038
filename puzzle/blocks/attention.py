"""Grouped-query causal self-attention with a KV cache; no positional encoding unless the spec asks for RoPE."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from puzzle.blocks.tensors import TensorInfo, linear_tensors
from puzzle.spec import AttentionSpec, SpecError

# `enable_gqa` lets SDPA read each KV head for its group of query heads without materialising copies.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, in buffers that grow by doubling.

    `key`, `value`: [b, num_kv_heads, capacity, head_dim]; only the first `length` positions are
    filled. Appending past the capacity reallocates to at least twice the size, so a decode of T
    tokens copies O(T) elements in total; pass `max_length` to `init_cache` to preallocate instead.
    """

    key: torch.Tensor
    value: torch.Tensor
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.key.shape[2]

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store key/value [b, nkv, t, hd] after the cached ones; return all keys and values [b, nkv, length, hd]."""
        if key.shape[:2] != self.key.shape[:2] or key.shape[3] != self.key.shape[3]:
            raise ValueError(
                f"KV cache holds [batch, kv_heads, _, head_dim] = {list(self.key.shape[:2])} + [{self.key.shape[3]}], "
                f"but the new keys have shape {list(key.shape)}"
            )
        end = self.length + key.shape[2]
        if end > self.capacity:
            capacity = max(end, 2 * self.capacity)
            self.key = self._grow(self.key, capacity)
            self.value = self._grow(self.value, capacity)
        self.key[:, :, self.length : end] = key
        self.value[:, :, self.length : end] = value
        self.length = end
        return self.key[:, :, :end], self.value[:, :, :end]

    def _grow(self, buffer: torch.Tensor, capacity: int) -> torch.Tensor:
        grown = buffer.new_zeros(*buffer.shape[:2], capacity, buffer.shape[3])
        grown[:, :, : self.length] = buffer[:, :, : self.length]
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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """Causal SDPA of q [b, nq, t, hd] over k, v [b, nkv, offset + t, hd] -> [b, nq, t, hd].

    Query i sits at position offset + i and sees keys 0 .. offset + i. SDPA's own `is_causal` aligns
    the mask top-left, which is right only when there is no cached prefix.
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
    if offset == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, **extra)
    if t == 1:  # one new token sees everything cached
        return F.scaled_dot_product_attention(q, k, v, **extra)
    query_pos = torch.arange(offset, offset + t, device=q.device)
    mask = torch.arange(total, device=q.device)[None, :] <= query_pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)


class AttentionMixer(nn.Module):
    """GQA: q_proj [nq*hd, H], k_proj / v_proj [nkv*hd, H], o_proj [H, nq*hd] (+ biases if spec.bias).

    NoPE by default, as Nemotron-H; RoPE on the first `rotary_fraction` of each head when
    `spec.rope_theta` is set, positions counted from the cache length. `norm_eps` is unused.
    """

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
        """An empty KV cache (device and dtype default to the weights'); `max_length` preallocates."""
        weight = self.k_proj.weight
        shape = (batch_size, self.spec.num_kv_heads, max_length, self.spec.head_dim)
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        return KVCache(
            key=torch.zeros(shape, device=device, dtype=dtype),
            value=torch.zeros(shape, device=device, dtype=dtype),
        )

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """x: [b, t, H] -> [b, t, H]; with a cache, attend to its keys too and append this chunk's."""
        batch, t, _ = x.shape
        spec = self.spec
        q = self.q_proj(x).view(batch, t, spec.num_heads, spec.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, t, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, t, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        offset = 0 if cache is None else cache.length
        if self.rotary_dim:
            positions = torch.arange(offset, offset + t, device=x.device)
            q = apply_rope(q, positions, spec.rope_theta, self.rotary_dim)
            k = apply_rope(k, positions, spec.rope_theta, self.rotary_dim)
        if cache is not None:
            k, v = cache.append(k, v)
        y = causal_attention(q, k, v, offset)
        return self.o_proj(y.transpose(1, 2).reshape(batch, t, spec.num_heads * spec.head_dim))

    def step(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One-token decode: x [b, 1, H] -> [b, 1, H], appending to `cache`."""
        return self.forward(x, cache)
