"""Exact parameter counts, weight bytes, per-request state and FLOPs of a block or model, from its spec alone.

Everything here derives from one enumeration, `block_tensors`: the tensors a block stores, with the
names, shapes and roles they have in `HybridLM`'s state_dict (`layers.{i}.<name>`), the mixer's part
listed by its mixer (`hub_tensors`, through the kind's entry in `puzzle.cost.kinds`). Parameter counts
follow `nn.Module.parameters()`: the MoE router's `e_score_correction_bias` is a buffer and is not a
parameter (NVIDIA's published totals leave it out too), but it is stored, so it counts in weight bytes.
Per-kind rules (active parameters, state, FLOPs) live in `puzzle.cost.kinds`, one entry per kind.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from functools import lru_cache

from puzzle.blocks.tensors import ROLES, TensorInfo
from puzzle.cost.formats import (
    DTYPE_BYTES,
    FORMATS,
    NVFP4_BLOCK,
    RECIPES,
    TENSOR_SCALE_BYTES,
    QuantRecipe,
    block_recipe,
    dtype_bytes,
    get_recipe,
    tensor_bytes,
)
from puzzle.cost.kinds import block_cost, expected_distinct_experts, mixer_tensors
from puzzle.cost.kinds import routed_expert_bytes as _routed_expert_bytes
from puzzle.spec import BlockSpec, ModelSpec, MoESpec, SpecError

__all__ = [
    "DTYPE_BYTES",
    "FORMATS",
    "NVFP4_BLOCK",
    "RECIPES",
    "ROLES",
    "TENSOR_SCALE_BYTES",
    "QuantRecipe",
    "TensorInfo",
    "block_active_params",
    "block_params",
    "block_tensors",
    "block_weight_bytes",
    "decode_flops_per_token",
    "dtype_bytes",
    "expected_distinct_experts",
    "get_recipe",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "lm_head_flops_per_token",
    "model_active_params",
    "model_decode_flops_per_token",
    "model_params",
    "model_prefill_flops_per_token",
    "model_tensors",
    "model_weight_bytes",
    "outside_block_tensors",
    "prefill_flops_per_token",
    "routed_expert_bytes",
    "state_bytes_per_request",
    "state_bytes_per_sequence",
    "tensor_bytes",
]

# ---------------------------------------------------------------------------------------------------
# Tensors of a block


def _stored_tensors(spec: BlockSpec, hidden_size: int) -> Iterator[TensorInfo]:
    """The block's pre-norm (none for a no-op), then its mixer's tensors (names relative to the mixer)."""
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
        raise SpecError(f"hidden_size must be a positive integer, found {hidden_size!r}")
    mixer = mixer_tensors(spec, hidden_size)
    if not block_cost(spec).runs:  # a no-op block has neither a mixer nor a pre-norm
        return iter(mixer)
    return itertools.chain((TensorInfo("norm.weight", (hidden_size,), "norm"),), mixer)


@lru_cache(maxsize=4096)
def block_tensors(spec: BlockSpec, hidden_size: int) -> tuple[TensorInfo, ...]:
    """Every tensor one block stores: its pre-norm `norm.weight` [H] and `mixer.*` (cached per spec).

    A no-op block stores nothing: it has no mixer tensors and no pre-norm.
    """
    stored = _stored_tensors(spec, hidden_size)  # validates hidden_size for every kind
    if not block_cost(spec).runs:
        return ()
    norm, *mixer = stored
    return (norm, *(t.prefixed("mixer.") for t in mixer))


def outside_block_tensors(model_spec: ModelSpec) -> list[TensorInfo]:
    """The tensors outside every block: embeddings, norm_f and (when untied) lm_head."""
    V, H = model_spec.vocab_size, model_spec.hidden_size
    tensors = [
        TensorInfo("embeddings.weight", (V, H), "embedding"),
        TensorInfo("norm_f.weight", (H,), "norm"),
    ]
    if not model_spec.tie_embeddings:
        tensors.append(TensorInfo("lm_head.weight", (V, H), "lm_head"))
    return tensors


def model_tensors(model_spec: ModelSpec) -> list[TensorInfo]:
    """Every tensor of a HybridLM, with full hub names (embeddings, layers.{i}.*, norm_f, lm_head)."""
    H = model_spec.hidden_size
    tensors = outside_block_tensors(model_spec)
    for index, block in enumerate(model_spec.blocks):
        tensors += [t.prefixed(f"layers.{index}.") for t in block_tensors(block, H)]
    return tensors


# ---------------------------------------------------------------------------------------------------
# Parameters


@lru_cache(maxsize=4096)
def block_params(spec: BlockSpec, hidden_size: int) -> int:
    """Trainable parameters of one block, including its pre-norm (buffers excluded)."""
    return sum(t.numel for t in _stored_tensors(spec, hidden_size) if t.is_parameter)


@lru_cache(maxsize=4096)
def block_active_params(spec: BlockSpec, hidden_size: int) -> int:
    """Parameters one token uses in this block (the kind's rule in `puzzle.cost.kinds`).

    MoE: everything but the routed experts (router, latent projections, shared expert, norm) plus
    top_k experts. With heterogeneous widths the routed part is top_k times the mean expert size
    (its expectation under uniform routing), rounded to an integer; with one width it is exact.
    """
    return block_cost(spec).active_params(spec, hidden_size, block_params(spec, hidden_size))


def _embedding_params(model_spec: ModelSpec) -> int:
    # Embeddings, lm_head and norm_f: everything outside the blocks.
    return sum(t.numel for t in outside_block_tensors(model_spec))


def model_params(model_spec: ModelSpec) -> int:
    """Total trainable parameters: embeddings, every block, norm_f and lm_head (if untied)."""
    H = model_spec.hidden_size
    return _embedding_params(model_spec) + sum(block_params(b, H) for b in model_spec.blocks)


def model_active_params(model_spec: ModelSpec) -> int:
    """Parameters one token uses, counting embeddings and lm_head in full (as NVIDIA does)."""
    H = model_spec.hidden_size
    return _embedding_params(model_spec) + sum(block_active_params(b, H) for b in model_spec.blocks)


@lru_cache(maxsize=4096)
def _block_weight_bytes(spec: BlockSpec, hidden_size: int, recipe: QuantRecipe) -> float:
    recipe = block_recipe(spec, recipe)  # the block's weight format, if quantized
    return sum(tensor_bytes(t.shape, recipe.format_of(t.role)) for t in _stored_tensors(spec, hidden_size))


def block_weight_bytes(spec: BlockSpec, hidden_size: int, recipe: str | QuantRecipe = "bf16") -> float:
    """Bytes of every tensor the block stores (buffers included) under `recipe`, its matmul weights in the
    spec's `weight_format` when that is fp8 or nvfp4 (`puzzle.cost.formats.block_recipe`)."""
    return _block_weight_bytes(spec, hidden_size, get_recipe(recipe))


def routed_expert_bytes(spec: MoESpec, hidden_size: int, recipe: str | QuantRecipe = "bf16") -> list[float]:
    """Bytes of each routed expert (up + down) of an MoE block under `recipe`, in expert order."""
    return list(_routed_expert_bytes(spec, hidden_size, get_recipe(recipe)))


def model_weight_bytes(model_spec: ModelSpec, recipe: str | QuantRecipe = "bf16") -> float:
    """Bytes of the whole model's stored tensors under `recipe`."""
    recipe = get_recipe(recipe)
    H = model_spec.hidden_size
    outside = sum(tensor_bytes(t.shape, recipe.format_of(t.role)) for t in outside_block_tensors(model_spec))
    return outside + sum(_block_weight_bytes(b, H, recipe) for b in model_spec.blocks)


# ---------------------------------------------------------------------------------------------------
# Per-request state


def kv_bytes_per_token(spec: BlockSpec | ModelSpec, kv_dtype: str = "bf16") -> int:
    """Attention KV cache bytes per token of context: 2 (K and V) x kv heads x head_dim x dtype bytes.

    For a ModelSpec, summed over its attention blocks; other block kinds have none.
    """
    if isinstance(spec, ModelSpec):
        return sum(kv_bytes_per_token(b, kv_dtype) for b in spec.blocks)
    return block_cost(spec).kv_bytes_per_token(spec, kv_dtype)


def state_bytes_per_sequence(
    spec: BlockSpec | ModelSpec, ssm_dtype: str = "fp32", conv_dtype: str = "bf16"
) -> int:
    """Fixed-size recurrent state of one sequence, bytes: Mamba SSM state [nh, P, N] + conv state [conv_dim, K-1].

    The SSM state is fp32 by default, as serving engines keep it; the conv state holds the last K-1
    inputs of the conv (vLLM's layout). For a ModelSpec, summed over its Mamba blocks.
    """
    if isinstance(spec, ModelSpec):
        return sum(state_bytes_per_sequence(b, ssm_dtype, conv_dtype) for b in spec.blocks)
    return block_cost(spec).state_bytes_per_sequence(spec, ssm_dtype, conv_dtype)


def state_bytes_per_request(
    spec: BlockSpec | ModelSpec,
    context_len: int,
    kv_dtype: str = "bf16",
    ssm_dtype: str = "fp32",
    conv_dtype: str = "bf16",
) -> int:
    """Memory one request of `context_len` tokens holds: KV cache for the tokens each block keeps (every
    token, or a sliding window's last `window`) plus recurrent state."""
    return kv_cache_bytes(spec, context_len, kv_dtype) + state_bytes_per_sequence(spec, ssm_dtype, conv_dtype)


def kv_cache_bytes(spec: BlockSpec | ModelSpec, context_len: int, kv_dtype: str = "bf16") -> int:
    """KV cache bytes of one request of `context_len` tokens: per block, bytes per token x the tokens it keeps
    (min(context, window) for sliding-window attention). For a ModelSpec, summed over its blocks."""
    if isinstance(spec, ModelSpec):
        return sum(kv_cache_bytes(b, context_len, kv_dtype) for b in spec.blocks)
    cost = block_cost(spec)
    return cost.kv_bytes_per_token(spec, kv_dtype) * cost.kv_tokens(spec, context_len)


# ---------------------------------------------------------------------------------------------------
# FLOPs (one multiply-add = 2 FLOPs; matmuls, attention scores and the SSM scan; elementwise work ignored)


def prefill_flops_per_token(spec: BlockSpec, hidden_size: int, prompt_tokens: int) -> float:
    """Mean FLOPs per token when the block processes a prompt of `prompt_tokens` tokens.

    The matmuls plus the kind's sequence mixing (causal attention scores over (T+1)/2 keys on average,
    Mamba's chunked SSD scan and conv; see `puzzle.cost.kinds`).
    """
    cost = block_cost(spec)
    flops = cost.linear_flops_per_token(spec, hidden_size)
    flops += cost.prefill_mixing_flops_per_token(spec, prompt_tokens)
    return flops


def decode_flops_per_token(spec: BlockSpec, hidden_size: int, context_len: int) -> float:
    """FLOPs of one decode step for one sequence whose context (including the new token) is `context_len`.

    The matmuls plus the kind's sequence mixing (attention over `context_len` keys, Mamba's state
    update and conv; see `puzzle.cost.kinds`).
    """
    cost = block_cost(spec)
    flops = cost.linear_flops_per_token(spec, hidden_size)
    flops += cost.decode_mixing_flops_per_token(spec, context_len)
    return flops


def lm_head_flops_per_token(model_spec: ModelSpec) -> float:
    """FLOPs of the logits of one token: 2 x H x V."""
    return 2.0 * model_spec.hidden_size * model_spec.vocab_size


def model_prefill_flops_per_token(model_spec: ModelSpec, prompt_tokens: int) -> float:
    """Mean FLOPs per prompt token through every block (logits only for the last token, as servers do)."""
    H = model_spec.hidden_size
    blocks = sum(prefill_flops_per_token(b, H, prompt_tokens) for b in model_spec.blocks)
    return blocks + lm_head_flops_per_token(model_spec) / prompt_tokens


def model_decode_flops_per_token(model_spec: ModelSpec, context_len: int) -> float:
    """FLOPs of one decode step of one sequence at `context_len`, logits included."""
    H = model_spec.hidden_size
    blocks = sum(decode_flops_per_token(b, H, context_len) for b in model_spec.blocks)
    return blocks + lm_head_flops_per_token(model_spec)
