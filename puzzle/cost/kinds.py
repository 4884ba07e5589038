"""Every per-kind cost rule of a block, one `BlockCost` entry per block kind, keyed by spec type.

An entry says, for its kind: the parameters one token uses (the tensors it stores are its mixer's own
list, `mixer_tensors`), the per-request state (KV cache, SSM and conv state), the FLOPs of the
matmuls and of the sequence mixing (attention scores, SSD scan), and what the roofline needs to time
it (activation traffic, scratch traffic, eager op and fused kernel counts). `puzzle.cost.analytic`
and `puzzle.cost.roofline` hold the kind-independent parts (the pre-norm, recipes, caching, the
roofline itself) and ask `block_cost(spec)` for the rest: adding a block kind means adding one entry
to `BLOCK_COSTS` here, and `tests/test_cost_analytic.py` checks every spec type has one.

Units: bytes, FLOPs (one multiply-add = 2 FLOPs; elementwise work ignored), elements, ops.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from functools import lru_cache
from typing import ClassVar, Generic, TypeVar

from puzzle.blocks.tensors import TensorInfo
from puzzle.cost.formats import QuantRecipe, block_recipe, dtype_bytes, tensor_bytes
from puzzle.spec import (
    AttentionSpec,
    BlockSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    MoESpec,
    NoOpSpec,
    kind_entry,
)

S = TypeVar("S")


def _norm_and_residual_elements(hidden_size: int) -> float:
    # The block's pre-norm (fp32 RMSNorm: four passes over x) and its residual add.
    return 8.0 * hidden_size + 3.0 * hidden_size


class BlockCost(ABC, Generic[S]):
    """The cost rules of one block kind. The defaults describe a block without per-request state whose
    every weight every token uses; abstract methods have no sensible default and each kind answers them.
    """

    # False: the model skips the block entirely (no work, no kernels), e.g. a removed block.
    runs: ClassVar[bool] = True

    def active_params(self, spec: S, hidden_size: int, params: int) -> int:
        """Parameters one token uses, given the block's total trainable `params` (pre-norm included)."""
        return params

    def weight_bytes_touched(
        self, spec: S, hidden_size: int, recipe: QuantRecipe, tokens: int, weight_bytes: float
    ) -> float:
        """Weight bytes a step over `tokens` tokens reads, given all the block's `weight_bytes`."""
        return weight_bytes

    def kv_bytes_per_token(self, spec: S, kv_dtype: str) -> int:
        """KV cache bytes per token the cache holds."""
        return 0

    def kv_tokens(self, spec: S, context_len: int) -> int:
        """Tokens of a `context_len`-token context the KV cache holds (all of them unless the kind bounds it)."""
        return context_len

    def state_bytes_per_sequence(self, spec: S, ssm_dtype: str, conv_dtype: str) -> int:
        """Fixed-size recurrent state of one sequence, bytes."""
        return 0

    @abstractmethod
    def linear_flops_per_token(self, spec: S, hidden_size: int) -> float:
        """2 x (weights of the matmuls one token runs through)."""

    def prefill_mixing_flops_per_token(self, spec: S, prompt_tokens: int) -> float:
        """Mean FLOPs per token of the sequence mixing (attention scores, scan) over a prompt of `prompt_tokens`."""
        return 0.0

    def decode_mixing_flops_per_token(self, spec: S, context_len: int) -> float:
        """FLOPs of the sequence mixing of one decode step at `context_len` (the new token included)."""
        return 0.0

    @abstractmethod
    def activation_elements_per_token(self, spec: S, hidden_size: int) -> float:
        """Activation elements one token writes and reads back between kernels in the block, pre-norm and
        residual add included.

        An estimate for an unfused implementation (every op's inputs and outputs go through memory);
        fused GPU kernels move less, but there the activations are small next to the weights or the
        time is compute-bound anyway.
        """

    def prefill_scratch_bytes_per_token(self, spec: S, prompt_tokens: int) -> float:
        """Bytes of intermediate (fp32) tensors per token of a prefill beyond the activations."""
        return 0.0

    def transcendental_elements_per_token(self, spec: S) -> float:
        """Elements one token passes through elementwise transcendental functions (SiLU, softplus, sigmoid,
        GELU) outside the sequence mixing, in the eager code: on a CPU thread each costs about a nanosecond of
        compute beyond its memory traffic (`HardwareProfile.transcendental_s`). ReLU, squares and products are
        cheaper than their traffic and are not counted."""
        return 0.0

    @abstractmethod
    def eager_ops(self, spec: S, batch_size: int, tokens: int, decode: bool) -> float:
        """Ops the mixer dispatches in one call on the plain-torch path (norm and residual excluded)."""

    @abstractmethod
    def fused_kernels(self, spec: S) -> float:
        """Kernels the mixer runs per call in a serving engine (norm and residual excluded)."""


# ---------------------------------------------------------------------------------------------------
# Mamba


class MambaCost(BlockCost[MambaSpec]):
    def state_bytes_per_sequence(self, spec: MambaSpec, ssm_dtype: str, conv_dtype: str) -> int:
        # SSM state [nh, P, N] + conv state [conv_dim, K-1] (the last K-1 inputs, vLLM's layout).
        ssm = spec.num_heads * spec.head_dim * spec.state_size * dtype_bytes(ssm_dtype)
        conv = spec.conv_dim * (spec.conv_kernel - 1) * dtype_bytes(conv_dtype)
        return int(ssm + conv)

    def linear_flops_per_token(self, spec: MambaSpec, hidden_size: int) -> float:
        return 2.0 * (spec.in_proj_dim * hidden_size + spec.d_inner * hidden_size)

    @staticmethod
    def _conv_flops(spec: MambaSpec) -> float:
        return 2.0 * spec.conv_kernel * spec.conv_dim

    def prefill_mixing_flops_per_token(self, spec: MambaSpec, prompt_tokens: int) -> float:
        # The chunked SSD scan with chunk Q = min(chunk_size, T), per token: the intra-chunk scores C.B
        # (2 G N Q), their product with x (2 d Q), the chunk state B^T x (2 d N) and the state's output
        # C.h (2 d N), plus the depthwise conv.
        chunk = min(spec.chunk_size, prompt_tokens)
        d, gn = spec.d_inner, spec.n_groups * spec.state_size
        return self._conv_flops(spec) + 2.0 * chunk * (gn + d) + 4.0 * d * spec.state_size

    def decode_mixing_flops_per_token(self, spec: MambaSpec, context_len: int) -> float:
        # The state update h = a h + dt x B^T (3 d N) and the output C.h (2 d N), plus the conv.
        return self._conv_flops(spec) + 5.0 * spec.d_inner * spec.state_size

    def activation_elements_per_token(self, spec: MambaSpec, hidden_size: int) -> float:
        H = hidden_size
        d, conv = spec.d_inner, spec.conv_dim
        elements = _norm_and_residual_elements(H)
        elements += H + spec.in_proj_dim  # in_proj
        elements += (spec.conv_kernel + 2) * conv + 2 * conv  # conv taps, bias, SiLU
        elements += 3 * d + 5 * d  # D skip, gated group norm
        elements += d + H  # out_proj
        return elements

    def prefill_scratch_bytes_per_token(self, spec: MambaSpec, prompt_tokens: int) -> float:
        # fp32 traffic of the chunked scan: decay matrix passes per head, C.B per group, outputs.
        chunk = min(spec.chunk_size, prompt_tokens)
        return 4.0 * (4 * spec.num_heads * chunk + 2 * spec.n_groups * chunk + 6 * spec.d_inner)

    def transcendental_elements_per_token(self, spec: MambaSpec) -> float:
        # SiLU after the conv (x | B | C) and of the gate z, softplus of dt; the scan's exp is its mixing's.
        return spec.conv_dim + spec.d_inner + spec.num_heads

    def eager_ops(self, spec: MambaSpec, batch_size: int, tokens: int, decode: bool) -> float:
        # The prefill scan loops over chunks.
        return 67.0 if decode else 72.0 + 70.0 * math.ceil(tokens / spec.chunk_size)

    def fused_kernels(self, spec: MambaSpec) -> float:
        return 5.0  # in_proj, conv, scan (or state update), gated norm, out_proj


# ---------------------------------------------------------------------------------------------------
# Attention


class AttentionCost(BlockCost[AttentionSpec]):
    def kv_bytes_per_token(self, spec: AttentionSpec, kv_dtype: str) -> int:
        # K and V: 2 x kv heads x head_dim values.
        return int(2 * spec.num_kv_heads * spec.head_dim * dtype_bytes(kv_dtype))

    def kv_tokens(self, spec: AttentionSpec, context_len: int) -> int:
        # A sliding window keeps only the last `window` tokens: the cache stops growing with the context.
        return context_len if spec.window is None else min(context_len, spec.window)

    def linear_flops_per_token(self, spec: AttentionSpec, hidden_size: int) -> float:
        return 2.0 * hidden_size * (2 * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim

    def prefill_mixing_flops_per_token(self, spec: AttentionSpec, prompt_tokens: int) -> float:
        # Causal QK^T and AV, each 2 x heads x head_dim per (query, key) pair. Query t sees min(t + 1, W)
        # keys: (T+1)/2 on average without a window; with one, W(W+1)/2 over the first W queries and W
        # for each later one.
        T, W = prompt_tokens, spec.window
        keys = (T + 1) / 2 if W is None or T <= W else (W * (W + 1) / 2 + (T - W) * W) / T
        return 4.0 * spec.num_heads * spec.head_dim * keys

    def decode_mixing_flops_per_token(self, spec: AttentionSpec, context_len: int) -> float:
        return 4.0 * spec.num_heads * spec.head_dim * self.kv_tokens(spec, context_len)

    def activation_elements_per_token(self, spec: AttentionSpec, hidden_size: int) -> float:
        H = hidden_size
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        elements = _norm_and_residual_elements(H)
        elements += H + q + 2 * kv  # q/k/v projections
        elements += 2 * q  # attention reads q, writes its output
        elements += q + H  # o_proj
        return elements

    def eager_ops(self, spec: AttentionSpec, batch_size: int, tokens: int, decode: bool) -> float:
        return 28.0 if decode else 25.0

    def fused_kernels(self, spec: AttentionSpec) -> float:
        return 4.0  # fused qkv, attention, o_proj, cache write


# ---------------------------------------------------------------------------------------------------
# MoE


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts that `tokens` tokens touch under uniform top-k routing: E(1-(1-k/E)^n)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def routed_experts(spec: BlockSpec, hidden_size: int) -> list[list[TensorInfo]]:
    """The tensors of each routed expert (those with `expert` set), in expert order; [] for a dense block."""
    experts: dict[int, list[TensorInfo]] = {}
    for tensor in mixer_tensors(spec, hidden_size):
        if tensor.expert is not None:
            experts.setdefault(tensor.expert, []).append(tensor)
    return [experts[j] for j in sorted(experts)]


# Cached as numbers (not tensor lists, which the garbage collector would keep walking): the search asks for
# the same blocks under many scenarios, and a block may have hundreds of experts.


@lru_cache(maxsize=4096)
def routed_expert_params(spec: BlockSpec, hidden_size: int) -> tuple[int, ...]:
    """Parameters of each routed expert, in expert order."""
    return tuple(sum(t.numel for t in expert) for expert in routed_experts(spec, hidden_size))


@lru_cache(maxsize=4096)
def routed_expert_bytes(spec: BlockSpec, hidden_size: int, recipe: QuantRecipe) -> tuple[float, ...]:
    """Bytes of each routed expert under `recipe` (in the block's weight format, if quantized), in expert order."""
    recipe = block_recipe(spec, recipe)
    return tuple(
        sum(tensor_bytes(t.shape, recipe.format_of(t.role)) for t in expert)
        for expert in routed_experts(spec, hidden_size)
    )


class MoECost(BlockCost[MoESpec]):
    def active_params(self, spec: MoESpec, hidden_size: int, params: int) -> int:
        # Everything but the routed experts, plus top_k experts: with heterogeneous widths top_k times the
        # mean expert size (its expectation under uniform routing), rounded; with one width it is exact.
        experts = routed_expert_params(spec, hidden_size)
        return params - sum(experts) + round(spec.top_k * sum(experts) / len(experts))

    def weight_bytes_touched(
        self, spec: MoESpec, hidden_size: int, recipe: QuantRecipe, tokens: int, weight_bytes: float
    ) -> float:
        # Only the experts the tokens touch, expected under uniform routing.
        experts = routed_expert_bytes(spec, hidden_size, recipe)
        touched = expected_distinct_experts(spec.num_experts, spec.top_k, tokens)
        return weight_bytes - sum(experts) + touched * sum(experts) / len(experts)

    def linear_flops_per_token(self, spec: MoESpec, hidden_size: int) -> float:
        # Routed experts at their expected width.
        H = hidden_size
        experts = routed_expert_params(spec, H)
        latent = 2 * spec.latent_size * H if spec.latent_size is not None else 0
        routed = spec.top_k * sum(experts) / len(experts)
        return 2.0 * (spec.num_experts * H + latent + routed + 2 * spec.shared_width * H)

    def activation_elements_per_token(self, spec: MoESpec, hidden_size: int) -> float:
        H = hidden_size
        E, k = spec.num_experts, spec.top_k
        L = spec.expert_input_size(H)
        width = sum(spec.widths) / E
        elements = _norm_and_residual_elements(H)
        elements += H + 3 * E  # router logits, sigmoid, top-k
        if spec.latent_size is not None:
            elements += 2 * (H + L)  # fc1, fc2
        elements += 2 * k * L  # gather to experts, weighted scatter back
        elements += k * (L + 4 * width + L)  # up, relu^2, down
        if spec.shared_width:
            elements += 2 * H + 4 * spec.shared_width + H  # shared expert and the sum
        return elements

    def transcendental_elements_per_token(self, spec: MoESpec) -> float:
        return spec.num_experts  # the router's sigmoid (the experts' relu^2 is not transcendental)

    def eager_ops(self, spec: MoESpec, batch_size: int, tokens: int, decode: bool) -> float:
        # The CPU paths of puzzle.blocks.moe.ExpertBank (+2 ops with a latent projection, +5 with a shared
        # expert), counted by tests/test_cost_roofline.py: fewer (token, slot) pairs than experts run one by
        # one, ~20 + 4.5 per pair; else the chunked loop, ~36 + 2 matmuls per expert that receives pairs
        # (+1.75 for the per-expert views of mixed widths, +1 for the read-ahead of an expert with >= 16
        # pairs) + ~16 per chunk of whole experts holding >= 256 pairs.
        pairs = batch_size * tokens * spec.top_k
        extra = (2.0 if spec.latent_size is not None else 0.0) + (5.0 if spec.shared_width else 0.0)
        if pairs < spec.num_experts:
            return 20.0 + 4.5 * pairs + extra
        touched = expected_distinct_experts(spec.num_experts, spec.top_k, batch_size * tokens)
        per_expert = pairs / touched
        experts_per_chunk = math.ceil(256.0 / per_expert)
        chunks = math.ceil(touched / experts_per_chunk)
        per_touched = 2.0 + (0.0 if spec.is_uniform else 1.75) + (1.0 if per_expert >= 16 else 0.0)
        return 36.0 + per_touched * touched + 16.0 * chunks + extra

    def fused_kernels(self, spec: MoESpec) -> float:
        # router, top-k, permute, two grouped GEMMs, un-permute; latent fc1 / fc2; shared up / down
        return 6.0 + (2.0 if spec.latent_size is not None else 0.0) + (2.0 if spec.shared_width else 0.0)


# ---------------------------------------------------------------------------------------------------
# Dense MLP, linear replacement, removed block


class MLPCost(BlockCost[MLPSpec]):
    def linear_flops_per_token(self, spec: MLPSpec, hidden_size: int) -> float:
        return 4.0 * spec.width * hidden_size

    def activation_elements_per_token(self, spec: MLPSpec, hidden_size: int) -> float:
        elements = _norm_and_residual_elements(hidden_size)
        elements += 2 * hidden_size + 4 * spec.width
        return elements

    def transcendental_elements_per_token(self, spec: MLPSpec) -> float:
        return spec.width if spec.activation in ("silu", "gelu") else 0.0

    def eager_ops(self, spec: MLPSpec, batch_size: int, tokens: int, decode: bool) -> float:
        return 4.0

    def fused_kernels(self, spec: MLPSpec) -> float:
        return 3.0


class LinearCost(BlockCost[LinearSpec]):
    def linear_flops_per_token(self, spec: LinearSpec, hidden_size: int) -> float:
        return 2.0 * hidden_size * hidden_size

    def activation_elements_per_token(self, spec: LinearSpec, hidden_size: int) -> float:
        elements = _norm_and_residual_elements(hidden_size)
        elements += 2 * hidden_size
        return elements

    def eager_ops(self, spec: LinearSpec, batch_size: int, tokens: int, decode: bool) -> float:
        return 1.0

    def fused_kernels(self, spec: LinearSpec) -> float:
        return 1.0


class NoOpCost(BlockCost[NoOpSpec]):
    runs = False  # the model skips a removed block: no work, no kernels

    def linear_flops_per_token(self, spec: NoOpSpec, hidden_size: int) -> float:
        return 0.0

    def activation_elements_per_token(self, spec: NoOpSpec, hidden_size: int) -> float:
        return _norm_and_residual_elements(hidden_size)

    def eager_ops(self, spec: NoOpSpec, batch_size: int, tokens: int, decode: bool) -> float:
        return 0.0

    def fused_kernels(self, spec: NoOpSpec) -> float:
        return 0.0


# ---------------------------------------------------------------------------------------------------
# The registry

BLOCK_COSTS: dict[type, BlockCost] = {
    MambaSpec: MambaCost(),
    AttentionSpec: AttentionCost(),
    MoESpec: MoECost(),
    MLPSpec: MLPCost(),
    LinearSpec: LinearCost(),
    NoOpSpec: NoOpCost(),
}


def block_cost(spec: BlockSpec) -> BlockCost:
    """The cost rules of `spec`'s kind; SpecError for a type without an entry in BLOCK_COSTS."""
    return kind_entry(BLOCK_COSTS, spec, "no cost model for block spec type")


def mixer_tensors(spec: BlockSpec, hidden_size: int) -> tuple[TensorInfo, ...]:
    """The mixer's tensors of `spec` (names relative to the mixer, the block's pre-norm excluded): its mixer
    class's own list (`puzzle.blocks.registry.mixer_tensors`), imported on first use so that importing the
    cost model does not import torch."""
    from puzzle.blocks.registry import mixer_tensors as listed

    block_cost(spec)  # a spec of no known kind is refused as the cost model's, naming the kinds it knows
    return listed(spec, hidden_size)
