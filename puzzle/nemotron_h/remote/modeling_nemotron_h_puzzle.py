"""NemotronH-Puzzle in plain PyTorch: a Nemotron-H model whose every block has its own shape.

Written by the `puzzle` library next to the `nemotron_h_puzzle` checkpoints it exports, so that
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` builds any of them: Mamba-2 blocks
with their own heads / state size / groups, GQA attention (no positional encoding; full or
sliding-window per block), mixtures of relu^2
experts (sigmoid router with correction bias, group-limited routing, optional latent projections and
shared expert, a width per expert), dense MLPs, and puzzle's `linear` and `noop` (removed) blocks.
Tensor names are the hub's: `backbone.layers.{i}.mixer...`, routed experts one by one.

Supported: forward (logits, loss with `labels`, hidden states) and `generate` (greedy, sampling, beam
search; from `input_ids` or `inputs_embeds`), with a cache unless `use_cache=False`: `NemotronHPuzzleCache`,
transformers' cache conventions for NemotronH (a `LinearAttentionLayer` with the conv and SSM states per
Mamba block, a `DynamicLayer` with keys and values per attention block, a `DynamicSlidingWindowLayer` holding
only the window for an attention block with a `sliding_window`, a `DummyLayer` for the others), so
each new token costs one step, not a re-run of the sequence; `use_cache=False` re-runs the whole sequence
per token (same tokens, O(n^2)). A forward call keeps a cache when given one or `use_cache=True`. Not
supported: padding (an `attention_mask` must be all ones), fused kernels. Mamba-2 runs as a chunked scan
in fp32 (a one-token step in its recurrent form), the router in fp32. A checkpoint whose
`quantization_config` has a `kv_cache_scheme` (an fp8 KV cache, puzzle's `kv_cache`) gives each attention
block fp32 `k_scale` / `v_scale`, and its keys and values are stored as fp8 E4M3 with them and read back
before the cache and the attention, as vLLM's fp8 cache holds them.
Tested with transformers 5.24 and torch 2.13 (`puzzle`'s tests/test_remote_code.py).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_nemotron_h_puzzle import NemotronHPuzzleConfig

ACTIVATIONS = {
    "relu2": lambda x: torch.square(F.relu(x)),
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
}


class NemotronHPuzzleRMSNorm(nn.Module):
    """RMSNorm over the last dim in fp32, scaled by `weight`, cast back to the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class NemotronHPuzzleGatedRMSNorm(nn.Module):
    """RMSNorm of `y * silu(z)` over groups of d / n_groups channels, then the scale `weight` [d] (fp32 out)."""

    def __init__(self, size: int, n_groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.n_groups = n_groups
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = (y.float() * F.silu(z.float())).unflatten(-1, (self.n_groups, -1))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.flatten(-2) * self.weight


def ssd_scan(x, dt, A, B, C, chunk_size: int, state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 SSM, S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T and y_t = S_t C_t, chunk by chunk (fp32).

    x [b, t, h, p]; dt [b, t, h] (after softplus and clamp); A [h] (< 0); B, C [b, t, g, n]; `state`
    [b, h, p, n] the state before the first token (None: zeros) -> (y [b, t, h, p], state after the last).
    Inside a chunk the sum over earlier positions is one masked matmul; the state carries across chunks.
    """
    b, t, h, p = x.shape
    B = B.repeat_interleave(h // B.shape[2], dim=2)  # [b, t, h, n]: heads of a group share its B and C
    C = C.repeat_interleave(h // C.shape[2], dim=2)
    state = x.new_zeros(b, h, p, B.shape[-1]) if state is None else state.to(x.dtype)
    outputs = []
    for start in range(0, t, chunk_size):
        xc, dtc, Bc, Cc = (v[:, start : start + chunk_size] for v in (x, dt, B, C))
        q = xc.shape[1]
        log_decay = torch.cumsum(dtc * A, dim=1)  # [b, q, h]: log decay from the chunk start
        causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
        gap = log_decay[:, :, None] - log_decay[:, None, :]  # [b, q (to), q (from), h]
        decay = torch.exp(gap.masked_fill(~causal, -math.inf))
        scores = torch.einsum("blhn,bshn->blsh", Cc, Bc) * decay
        y = torch.einsum("blsh,bshp->blhp", scores, xc * dtc[..., None])
        y = y + torch.einsum("blhn,bhpn->blhp", Cc, state) * torch.exp(log_decay)[..., None]
        to_end = torch.exp(log_decay[:, -1:] - log_decay) * dtc  # [b, q, h]
        state = state * torch.exp(log_decay[:, -1])[..., None, None] + torch.einsum(
            "bsh,bshp,bshn->bhpn", to_end, xc, Bc
        )
        outputs.append(y)
    return torch.cat(outputs, dim=1), state


class NemotronHPuzzleMamba2Mixer(nn.Module):
    """Mamba-2: in_proj (rows z | x | B | C | dt) -> causal conv + SiLU over x | B | C -> SSM (+ D x) -> gated norm -> out_proj."""

    def __init__(self, f: dict, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = f["mamba_num_heads"], f["mamba_head_dim"]
        self.n_groups, self.state_size = f["n_groups"], f["ssm_state_size"]
        self.chunk_size = f["chunk_size"]
        self.dt_min, self.dt_max = f["time_step_min"], f["mamba_dt_clamp_max"]
        if f["mamba_hidden_act"] != "silu":
            raise ValueError(f"Mamba blocks use silu, config.json says {f['mamba_hidden_act']!r}")
        d = self.num_heads * self.head_dim
        conv_dim = d + 2 * self.n_groups * self.state_size
        k = self.conv_kernel = f["conv_kernel"]
        self.in_proj = nn.Linear(f["hidden_size"], d + conv_dim + self.num_heads, bias=f["use_bias"])
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, k, groups=conv_dim, padding=k - 1, bias=f["use_conv_bias"]
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = NemotronHPuzzleGatedRMSNorm(d, self.n_groups, f["layer_norm_epsilon"])
        self.out_proj = nn.Linear(d, f["hidden_size"], bias=f["use_bias"])

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        """x [b, t, H]; with a `cache`, continues from its conv and SSM states and leaves the new ones there."""
        b, t, _ = x.shape
        d, gn = self.num_heads * self.head_dim, self.n_groups * self.state_size
        z, xbc, dt = self.in_proj(x).split([d, d + 2 * gn, self.num_heads], dim=-1)
        step = cache is not None and t == 1 and cache.has_previous_state(self.layer_idx)
        xbc = F.silu(self._conv(xbc.transpose(1, 2), cache, step).transpose(1, 2))
        xs, B, C = xbc.split([d, gn, gn], dim=-1)
        xs = xs.reshape(b, t, self.num_heads, self.head_dim)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        dt = dt.clamp(min=self.dt_min, max=math.inf if self.dt_max is None else self.dt_max)
        A = -torch.exp(self.A_log.float())
        B, C = B.reshape(b, t, self.n_groups, -1).float(), C.reshape(b, t, self.n_groups, -1).float()
        state = None if cache is None else cache.get_recurrent_state(self.layer_idx)
        if step:
            y, state = ssm_step(xs.float(), dt, A, B, C, state)
        else:
            y, state = ssd_scan(xs.float(), dt, A, B, C, self.chunk_size, state)
        if cache is not None:
            cache.update_recurrent_state(state, self.layer_idx)
        y = y + xs.float() * self.D.float()[:, None]
        return self.out_proj(self.norm(y.flatten(2), z).to(x.dtype))

    def _conv(self, xbc: torch.Tensor, cache: Cache | None, step: bool) -> torch.Tensor:
        """The causal depthwise conv of xbc [b, conv_dim, t] (before SiLU); a cache holds the inputs before these.

        `step` (one token after cached ones): the kernel times the last conv_kernel inputs, no padded conv.
        """
        t = xbc.shape[-1]
        if cache is not None:  # the last conv_kernel inputs before these (zeros at the start), then these
            xbc = cache.update_conv_state(xbc, self.layer_idx, conv_kernel_size=self.conv_kernel)
        if step:
            out = (xbc[..., -self.conv_kernel :] * self.conv1d.weight[:, 0]).sum(-1, keepdim=True)
            return out if self.conv1d.bias is None else out + self.conv1d.bias[:, None]
        return self.conv1d(xbc)[..., : xbc.shape[-1]][..., -t:]


def ssm_step(x, dt, A, B, C, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the SSM in its recurrent form (what `ssd_scan` computes for t = 1), shapes as there (fp32).

    Heads are viewed as [groups, heads per group] so that a group's B and C broadcast (no copies).
    """
    b, _, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    decay = torch.exp(dt[:, 0] * A).view(b, g, h // g, 1, 1)
    dx = (x[:, 0] * dt[:, 0, :, None]).view(b, g, h // g, p, 1)
    state = state.to(x.dtype).view(b, g, h // g, p, n) * decay + dx * B.view(b, g, 1, 1, n)
    y = (state * C.view(b, g, 1, 1, n)).sum(-1)  # [b, g, h / g, p]
    return y.view(b, 1, h, p), state.view(b, h, p, n)


def band_mask(t: int, total: int, window: int | None, device: torch.device) -> torch.Tensor:
    """bool [t, total]: which keys each of the last `t` of `total` tokens sees. Query i is `total - t + i`
    keys in; it sees key j at distance d = (total - t + i) - j when 0 <= d, and d < window with a window."""
    distance = (
        torch.arange(total - t, total, device=device)[:, None] - torch.arange(total, device=device)[None, :]
    )
    return (distance >= 0) & (distance < window) if window is not None else distance >= 0


def fp8_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` stored in fp8 E4M3 with one static `scale` and read back: e4m3(clamp(x / scale, +-448)) * scale, in fp32."""
    scale = scale.to(device=x.device, dtype=torch.float32).reshape(())
    stored = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (stored.float() * scale).to(x.dtype)


def kv_cache_scheme(config) -> dict | None:
    """The `kv_cache_scheme` of the config's compressed-tensors `quantization_config` (a dict, or the object
    transformers makes of it), or None."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    return quantization.get("kv_cache_scheme")


class NemotronHPuzzleAttention(nn.Module):
    """Causal grouped-query attention without positional encoding (NoPE), as in Nemotron-H.

    `sliding_window` N (config): each query attends to the last N tokens, its own included, and the block's
    cache layer (`DynamicSlidingWindowLayer`) keeps only the last N - 1 of them.
    """

    def __init__(self, f: dict, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = f["num_attention_heads"]
        self.num_kv_heads = f["num_key_value_heads"] or self.num_heads
        self.head_dim = f["head_dim"] or f["attention_head_dim"] or f["hidden_size"] // self.num_heads
        self.sliding_window = f.get("sliding_window")
        hidden, bias = f["hidden_size"], f["attention_bias"]
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)

    def use_fp8_kv_cache(self) -> None:
        """Store keys and values as an fp8 cache does (the checkpoint's `kv_cache_scheme`): `k_scale` and
        `v_scale` (fp32 [1], loaded from `backbone.layers.{i}.mixer.k_scale` / `.v_scale`)."""
        self.k_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        self.v_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        """x [b, t, H]; with a `cache`, attends to its keys and values too and appends this step's."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "k_scale"):  # an fp8 cache holds these in place of k, v (vLLM's fp8 KV cache)
            k, v = fp8_per_tensor(k, self.k_scale), fp8_per_tensor(v, self.v_scale)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # the kept keys (a window's last N - 1), then these
        repeat = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        past = k.shape[2] - t
        window = self.sliding_window
        if window is not None and k.shape[2] > window:  # the band cuts: mask it
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=band_mask(t, k.shape[2], window, x.device))
        elif past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif t == 1:  # one new token sees everything
            y = F.scaled_dot_product_attention(q, k, v)
        else:  # several new tokens after cached ones: query i sees keys up to past + i (is_causal aligns top-left)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=band_mask(t, k.shape[2], None, x.device))
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def per_token(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` with `x` seen as [1, tokens, features]: compressed-tensors quantizes a dynamic per-token
    (fp8) activation per index of its first two dims and a 2-D input as one tensor; vLLM quantizes per token."""
    return linear(x.reshape(1, -1, x.shape[-1])).reshape(*x.shape[:-1], -1)


class NemotronHPuzzleExpert(nn.Module):
    """A non-gated relu^2 MLP: down(relu(up(x))^2). Routed and shared experts alike."""

    def __init__(self, size: int, width: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(size, width, bias=False)
        self.down_proj = nn.Linear(width, size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return per_token(self.down_proj, torch.square(F.relu(per_token(self.up_proj, x))))


class NemotronHPuzzleRouter(nn.Module):
    """Sigmoid top-k router (fp32): the correction bias steers the choice, not the weights; group-limited routing."""

    def __init__(self, f: dict) -> None:
        super().__init__()
        self.num_experts, self.top_k = f["n_routed_experts"], f["num_experts_per_tok"]
        self.n_group, self.topk_group = f["n_group"], f["topk_group"]
        self.norm_topk_prob, self.scaling = f["norm_topk_prob"], f["routed_scaling_factor"]
        self.weight = nn.Parameter(torch.empty(self.num_experts, f["hidden_size"]))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, H] -> (weights [n, top_k] fp32, expert indices [n, top_k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_group < self.n_group:  # only experts of the topk_group groups with the best top-2 sums
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            kept = group_scores.topk(self.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = choice.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=1), -math.inf)
        indices = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, indices


class NemotronHPuzzleMoE(nn.Module):
    """out = fc2(sum_k w_k expert_k(fc1(x))) + shared(x); fc1 / fc2 only when latent, shared only when its width > 0."""

    def __init__(self, f: dict, layer_idx: int) -> None:
        super().__init__()
        hidden, latent = f["hidden_size"], f["moe_latent_size"]
        widths = f["moe_intermediate_size"]
        widths = list(widths) if isinstance(widths, (list, tuple)) else [widths] * f["n_routed_experts"]
        if f["mlp_hidden_act"] != "relu2" or f["mlp_bias"]:
            raise ValueError("MoE experts are relu2 without bias; config.json says otherwise")
        self.gate = NemotronHPuzzleRouter(f)
        self.experts = nn.ModuleList(NemotronHPuzzleExpert(latent or hidden, width) for width in widths)
        self.latent = latent is not None
        if self.latent:
            self.fc1_latent_proj = nn.Linear(hidden, latent, bias=False)
            self.fc2_latent_proj = nn.Linear(latent, hidden, bias=False)
        shared = f["moe_shared_expert_intermediate_size"] * f["n_shared_experts"]
        self.shared_experts = NemotronHPuzzleExpert(hidden, shared) if shared > 0 else None

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat)
        h = per_token(self.fc1_latent_proj, flat) if self.latent else flat
        routed = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        if flat.shape[0] == 1:  # one token (a generation step): its experts in turn, no gather / scatter
            for slot, j in enumerate(indices[0].tolist()):
                routed += self.experts[j](h).float() * weights[:, slot, None]
        else:
            for j in indices.unique().tolist():
                token, slot = (indices == j).nonzero(as_tuple=True)
                routed.index_add_(0, token, self.experts[j](h[token]).float() * weights[token, slot, None])
        out = routed.to(h.dtype)
        out = (per_token(self.fc2_latent_proj, out) if self.latent else out).view(x.shape)
        return out + self.shared_experts(x) if self.shared_experts is not None else out


class NemotronHPuzzleMLP(nn.Module):
    """A dense non-gated MLP: down(act(up(x)))."""

    def __init__(self, f: dict, layer_idx: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(f["hidden_size"], f["intermediate_size"], bias=f["mlp_bias"])
        self.down_proj = nn.Linear(f["intermediate_size"], f["hidden_size"], bias=f["mlp_bias"])
        self.act = ACTIVATIONS[f["mlp_hidden_act"]]

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHPuzzleLinear(nn.Module):
    """puzzle's `linear` block: one hidden x hidden matrix in place of the mixer."""

    def __init__(self, f: dict, layer_idx: int) -> None:
        super().__init__()
        self.linear = nn.Linear(f["hidden_size"], f["hidden_size"], bias=f["linear_bias"])

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        return self.linear(x)


MIXERS = {
    "mamba": NemotronHPuzzleMamba2Mixer,
    "attention": NemotronHPuzzleAttention,
    "moe": NemotronHPuzzleMoE,
    "mlp": NemotronHPuzzleMLP,
    "linear": NemotronHPuzzleLinear,
}


class NemotronHPuzzleBlock(nn.Module):
    """x + mixer(norm(x)); a `noop` block (removed) has neither norm nor mixer and returns x."""

    def __init__(self, config: NemotronHPuzzleConfig, index: int) -> None:
        super().__init__()
        kind = config.block_kinds()[index]
        self.block_type = kind
        if kind == "noop":
            self.norm = self.mixer = None
            return
        self.norm = NemotronHPuzzleRMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = MIXERS[kind](config.block_fields(index), index)
        if kind == "attention" and kv_cache_scheme(config) is not None:
            self.mixer.use_fp8_kv_cache()

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        if self.mixer is None:
            return x
        return x + self.mixer(self.norm(x.to(self.norm.weight.dtype)), cache)


def _attention_cache_layer(fields: dict) -> DynamicLayer:
    # A windowed block keeps only its window (transformers' sliding layer: the last N - 1 keys and values).
    window = fields.get("sliding_window")
    return DynamicLayer() if window is None else DynamicSlidingWindowLayer(sliding_window=window)


# What each block kind keeps between generation steps, as transformers' NemotronH: a Mamba block its conv
# and SSM states (linear attention), an attention block its keys and values (a window's worth when it has
# one); the others nothing. Each entry makes a fresh cache layer from the block's config fields.
CACHE_LAYERS = {
    "mamba": lambda fields: LinearAttentionLayer(),
    "attention": _attention_cache_layer,
}


class NemotronHPuzzleCache(Cache):
    """The generation cache of a NemotronH-Puzzle model: one transformers cache layer per block.

    Mamba blocks: `LinearAttentionLayer` (conv state [b, conv_dim, conv_kernel], SSM state [b, heads,
    head_dim, state_size], each block its own shapes); attention blocks: `DynamicLayer` (keys and values
    [b, kv_heads, seen, head_dim]); moe, mlp, linear and noop blocks: `DummyLayer`.
    """

    def __init__(self, block_kinds: list[str], block_fields: list[dict] | None = None) -> None:
        super().__init__(layers=cache_layers(block_kinds, block_fields))
        self.seen_tokens = 0  # the sequence length when no attention block keeps keys to count them

    # Grown by concatenation and holding Python-side counters: not for torch.compile / cuda graphs.
    is_compileable = False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if any(isinstance(layer, DynamicLayer) for layer in self.layers):
            return super().get_seq_length(layer_idx)
        return self.seen_tokens


def cache_layers(block_kinds: list[str], block_fields: list[dict] | None = None) -> list:
    """One fresh transformers cache layer per block (`CACHE_LAYERS`, else a `DummyLayer`); `block_fields`:
    each block's config fields (`NemotronHPuzzleConfig.block_fields`), None for the defaults."""
    fields = block_fields if block_fields is not None else [{}] * len(block_kinds)
    return [
        CACHE_LAYERS[kind](entry) if kind in CACHE_LAYERS else DummyLayer()
        for kind, entry in zip(block_kinds, fields)
    ]


class NemotronHPuzzlePreTrainedModel(PreTrainedModel):
    config_class = NemotronHPuzzleConfig
    base_model_prefix = "backbone"
    _no_split_modules: ClassVar[list[str]] = ["NemotronHPuzzleBlock"]
    _supports_sdpa = True
    # The router decides which experts run: keep its weight and bias in fp32, as transformers' NemotronH.
    # So do an fp8 KV cache's scales: a bf16 copy of a scale would quantize with another one.
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = [
        "e_score_correction_bias",
        "gate.weight",
        "k_scale",
        "v_scale",
    ]
    # MTP weights are not part of this model; older puzzle files kept a removed block's unused norm.
    _keys_to_ignore_on_load_unexpected: ClassVar[list[str]] = [
        r"^mtp\.",
        r"^backbone\.layers\.\d+\.norm\.weight$",
    ]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # linear layers, embeddings, RMSNorms
        loaded = lambda tensor: getattr(tensor, "_is_hf_initialized", False)  # noqa: E731
        with torch.no_grad():
            if isinstance(module, NemotronHPuzzleMamba2Mixer) and not loaded(module.A_log):
                module.A_log.copy_(torch.log(torch.arange(1, module.num_heads + 1, dtype=torch.float32)))
                module.D.fill_(1.0)
                module.dt_bias.fill_(1.0)
            elif isinstance(module, NemotronHPuzzleRouter) and not loaded(module.weight):
                module.weight.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
                module.e_score_correction_bias.zero_()


class NemotronHPuzzleModel(NemotronHPuzzlePreTrainedModel):
    """Embeddings -> blocks -> final norm."""

    def __init__(self, config: NemotronHPuzzleConfig) -> None:
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NemotronHPuzzleBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm_f = NemotronHPuzzleRMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings

    def set_input_embeddings(self, embeddings: nn.Embedding) -> None:
        self.embeddings = embeddings

    @torch.no_grad()
    def _match_decompressed_dtypes(self) -> None:
        """Quantized modules (compressed-tensors' `quantization_scheme`) decompressed into another dtype than
        the model's (nvfp4 decompresses to bf16) get the model's: an fp32 load then runs (bf16 widens exactly)."""
        dtype = self.embeddings.weight.dtype
        if getattr(self, "_decompressed_dtype", None) == dtype:  # once per dtype: a walk over every module
            return
        self._decompressed_dtype = dtype
        for module in self.modules():
            weight = getattr(module, "weight", None)
            if (
                hasattr(module, "quantization_scheme")
                and isinstance(weight, nn.Parameter)
                and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
                and weight.dtype != dtype
            ):
                weight.data = weight.data.to(dtype)

    def forward(
        self,
        input_ids=None,
        inputs_embeds=None,
        output_hidden_states: bool = False,
        cache: Cache | None = None,
    ):
        """-> (final-normed hidden states [b, t, H], (embeddings, block 0 output, ...) or None).

        With a `cache` (`NemotronHPuzzleCache`), the tokens continue the sequence it holds, and it is updated.
        """
        x = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        self._match_decompressed_dtypes()
        hidden = [x] if output_hidden_states else None
        for block in self.layers:
            x = block(x, cache)
            if hidden is not None:
                hidden.append(x)
        if cache is not None and hasattr(cache, "seen_tokens"):
            cache.seen_tokens += x.shape[1]
        return self.norm_f(x), tuple(hidden) if hidden is not None else None


class NemotronHPuzzleForCausalLM(NemotronHPuzzlePreTrainedModel, GenerationMixin):
    """The model plus lm_head; logits in fp32. Generation cache: `NemotronHPuzzleCache` (module docstring)."""

    def __init__(self, config: NemotronHPuzzleConfig) -> None:
        super().__init__(config)
        self.backbone = NemotronHPuzzleModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.backbone.embeddings

    def set_input_embeddings(self, embeddings: nn.Embedding) -> None:
        self.backbone.embeddings = embeddings

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        labels=None,
        output_hidden_states=None,
        logits_to_keep: int = 0,
        return_dict=None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits (fp32) of the tokens; with `use_cache`, `cache` (or a new one) holds the sequence so far.

        `use_cache` None means config.use_cache outside training; `past_key_values` is read as `cache`.
        """
        mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
        if mask is not None and mask.dim() == 2 and not bool(mask.all()):
            raise NotImplementedError(
                "NemotronHPuzzle remote code does not support padding (zeros in attention_mask)"
            )
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", False)) and not self.training
        if use_cache or cache is not None:
            cache = self._cache_for(cache)
        hidden, all_hidden = self.backbone(input_ids, inputs_embeds, bool(output_hidden_states), cache)
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=all_hidden, cache=cache)

    def new_cache(self) -> NemotronHPuzzleCache:
        """An empty cache for this model's blocks (what `generate` and `use_cache=True` start from)."""
        return NemotronHPuzzleCache(self.config.block_kinds(), self._block_fields())

    def _block_fields(self) -> list[dict]:
        return [self.config.block_fields(i) for i in range(self.config.num_hidden_layers)]

    def _cache_for(self, cache: Cache | None) -> Cache:
        """`cache`, or a new one when None; an empty transformers `DynamicCache()` gets this model's layers."""
        kinds = self.config.block_kinds()
        if cache is None:
            return self.new_cache()
        if not cache.layers and cache.layer_class_to_replicate is not None:
            cache.layers, cache.layer_class_to_replicate = cache_layers(kinds, self._block_fields()), None
        expected = [type(layer) for layer in cache_layers(kinds, self._block_fields())]
        found = [type(layer) for layer in cache.layers]
        if len(found) != len(expected) or not all(map(issubclass, found, expected)):
            raise ValueError(
                f"the cache passed to NemotronHPuzzle has layers {[t.__name__ for t in found]}, expected one per "
                f"block {[t.__name__ for t in expected]}: use model.new_cache() or an empty DynamicCache()"
            )
        return cache

    # generate() gets the cache from the first forward's output (use_cache=True), not DynamicCache(config):
    # transformers' config-driven layer types do not know puzzle's per-block kinds.
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def prepare_inputs_for_generation(self, input_ids, inputs_embeds=None, **kwargs):
        """transformers' default (with a cache, only the tokens it has not seen; `inputs_embeds` for the
        prompt), keeping one position's logits."""
        kwargs["logits_to_keep"] = 1
        return super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds, **kwargs)
