"""Exact parameter counts, weight bytes, per-request state and FLOPs of a block or model, from its spec alone.

Everything here derives from one enumeration, `block_tensors`: the tensors a block stores, with the
names, shapes and roles they have in `HybridLM`'s state_dict (`layers.{i}.<name>`). Parameter counts
follow `nn.Module.parameters()`: the MoE router's `e_score_correction_bias` is a buffer and is not a
parameter (NVIDIA's published totals leave it out too), but it is stored, so it counts in weight bytes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import lru_cache

from puzzle.spec import (
    AttentionSpec,
    BlockSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
    SpecError,
)

# ---------------------------------------------------------------------------------------------------
# Tensors of a block

# Roles decide a tensor's storage format under a quantisation recipe.
ROLES: tuple[str, ...] = (
    "embedding",  # embeddings.weight [V, H]
    "lm_head",  # lm_head.weight [V, H]
    "norm",  # every RMSNorm weight (block pre-norms, Mamba's gated norm, norm_f)
    "bias",  # 1-D biases of linear layers
    "mamba_proj",  # Mamba in_proj / out_proj
    "mamba_conv",  # Mamba depthwise conv1d weight and bias
    "mamba_ssm",  # Mamba dt_bias, A_log, D
    "attention_proj",  # q/k/v/o projections
    "router",  # MoE gate.weight [E, H]
    "router_bias",  # MoE gate.e_score_correction_bias [E], an fp32 buffer
    "routed_expert",  # experts.{j}.up_proj / down_proj
    "shared_expert",  # shared_experts.up_proj / down_proj
    "latent_proj",  # fc1_latent_proj / fc2_latent_proj
    "mlp",  # dense MLP up_proj / down_proj
    "linear",  # the single matrix of a LinearSpec block
)


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: `name` relative to the block (e.g. "mixer.in_proj.weight"), shape [out, in, ...]."""

    name: str
    shape: tuple[int, ...]
    role: str
    is_parameter: bool = True  # False for buffers that are saved but not trained

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _linear(
    name: str, out_features: int, in_features: int, role: str, bias: bool = False
) -> list[TensorInfo]:
    tensors = [TensorInfo(f"{name}.weight", (out_features, in_features), role)]
    if bias:
        tensors.append(TensorInfo(f"{name}.bias", (out_features,), "bias"))
    return tensors


def _mixer_tensors(spec: BlockSpec, hidden_size: int) -> list[TensorInfo]:
    """The mixer's tensors, names relative to the mixer (NemotronH hub names minus the layer prefix)."""
    H = hidden_size
    if isinstance(spec, MambaSpec):
        nh, d, conv_dim, K = spec.num_heads, spec.d_inner, spec.conv_dim, spec.conv_kernel
        tensors = _linear("in_proj", spec.in_proj_dim, H, "mamba_proj", spec.proj_bias)
        tensors.append(TensorInfo("conv1d.weight", (conv_dim, 1, K), "mamba_conv"))
        if spec.conv_bias:
            tensors.append(TensorInfo("conv1d.bias", (conv_dim,), "mamba_conv"))
        tensors += [
            TensorInfo("dt_bias", (nh,), "mamba_ssm"),
            TensorInfo("A_log", (nh,), "mamba_ssm"),
            TensorInfo("D", (nh,), "mamba_ssm"),
            TensorInfo("norm.weight", (d,), "norm"),
        ]
        tensors += _linear("out_proj", H, d, "mamba_proj", spec.proj_bias)
        return tensors
    if isinstance(spec, AttentionSpec):
        q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return (
            _linear("q_proj", q_dim, H, "attention_proj", spec.bias)
            + _linear("k_proj", kv_dim, H, "attention_proj", spec.bias)
            + _linear("v_proj", kv_dim, H, "attention_proj", spec.bias)
            + _linear("o_proj", H, q_dim, "attention_proj", spec.bias)
        )
    if isinstance(spec, MoESpec):
        E = spec.num_experts
        expert_input = spec.expert_input_size(H)
        tensors = [
            TensorInfo("gate.weight", (E, H), "router"),
            TensorInfo("gate.e_score_correction_bias", (E,), "router_bias", is_parameter=False),
        ]
        for j, width in enumerate(spec.widths):
            tensors += _linear(f"experts.{j}.up_proj", width, expert_input, "routed_expert")
            tensors += _linear(f"experts.{j}.down_proj", expert_input, width, "routed_expert")
        if spec.latent_size is not None:
            tensors += _linear("fc1_latent_proj", spec.latent_size, H, "latent_proj")
            tensors += _linear("fc2_latent_proj", H, spec.latent_size, "latent_proj")
        if spec.shared_width > 0:
            tensors += _linear("shared_experts.up_proj", spec.shared_width, H, "shared_expert")
            tensors += _linear("shared_experts.down_proj", H, spec.shared_width, "shared_expert")
        return tensors
    if isinstance(spec, MLPSpec):
        return _linear("up_proj", spec.width, H, "mlp", spec.bias) + _linear(
            "down_proj", H, spec.width, "mlp", spec.bias
        )
    if isinstance(spec, LinearSpec):
        return _linear("linear", H, H, "linear", spec.bias)
    if isinstance(spec, NoOpSpec):
        return []
    raise SpecError(f"no cost model for block spec type {type(spec).__name__}")


@lru_cache(maxsize=4096)
def block_tensors(spec: BlockSpec, hidden_size: int) -> tuple[TensorInfo, ...]:
    """Every tensor one block stores: its pre-norm `norm.weight` [H] and `mixer.*` (cached per spec).

    A no-op block stores nothing: it has no mixer tensors and no pre-norm.
    """
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
        raise SpecError(f"hidden_size must be a positive integer, found {hidden_size!r}")
    if isinstance(spec, NoOpSpec):
        return ()
    mixer = [
        TensorInfo(f"mixer.{t.name}", t.shape, t.role, t.is_parameter)
        for t in _mixer_tensors(spec, hidden_size)
    ]
    return (TensorInfo("norm.weight", (hidden_size,), "norm"), *mixer)


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
    """Every tensor of a HybridLM, with full state_dict names (embeddings, layers.{i}.*, norm_f, lm_head)."""
    H = model_spec.hidden_size
    tensors = outside_block_tensors(model_spec)
    for index, block in enumerate(model_spec.blocks):
        tensors += [
            TensorInfo(f"layers.{index}.{t.name}", t.shape, t.role, t.is_parameter)
            for t in block_tensors(block, H)
        ]
    return tensors


# ---------------------------------------------------------------------------------------------------
# Parameters


@lru_cache(maxsize=4096)
def block_params(spec: BlockSpec, hidden_size: int) -> int:
    """Trainable parameters of one block, including its pre-norm (buffers excluded)."""
    return sum(t.numel for t in block_tensors(spec, hidden_size) if t.is_parameter)


def _expert_params(spec: MoESpec, hidden_size: int) -> list[int]:
    expert_input = spec.expert_input_size(hidden_size)
    return [2 * width * expert_input for width in spec.widths]


@lru_cache(maxsize=4096)
def block_active_params(spec: BlockSpec, hidden_size: int) -> int:
    """Parameters one token uses in this block.

    MoE: everything but the routed experts (router, latent projections, shared expert, norm) plus
    top_k experts. With heterogeneous widths the routed part is top_k times the mean expert size
    (its expectation under uniform routing), rounded to an integer; with one width it is exact.
    """
    total = block_params(spec, hidden_size)
    if not isinstance(spec, MoESpec):
        return total
    experts = _expert_params(spec, hidden_size)
    return total - sum(experts) + round(spec.top_k * sum(experts) / len(experts))


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


# ---------------------------------------------------------------------------------------------------
# Storage formats and quantisation recipes

# Bytes per element of plain formats.
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
FORMATS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8", "nvfp4")
NVFP4_BLOCK = 16  # values sharing one fp8 (E4M3) scale, along the input dimension
TENSOR_SCALE_BYTES = 4  # one fp32 per-tensor scale for fp8 and nvfp4 tensors


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a plain dtype name ("fp32", "bf16", "fp16", "fp8")."""
    if dtype not in DTYPE_BYTES:
        raise SpecError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def tensor_bytes(shape: tuple[int, ...], fmt: str) -> float:
    """Bytes a tensor of `shape` takes in format `fmt`, scales included.

    fp8: 1 byte per value + one fp32 per-tensor scale. nvfp4: 4-bit values, one fp8 scale per 16
    consecutive values of a row (rows = all but the last dim; a partial block still has a scale),
    plus one fp32 per-tensor scale. 1-D tensors are never block-quantised: they stay bf16.
    """
    numel = math.prod(shape)
    if fmt in ("fp8", "nvfp4") and len(shape) < 2:
        return 2.0 * numel
    if fmt == "fp8":
        return float(numel + TENSOR_SCALE_BYTES)
    if fmt in DTYPE_BYTES:
        return float(DTYPE_BYTES[fmt] * numel)
    if fmt == "nvfp4":
        cols = shape[-1]
        rows = numel // cols
        return numel / 2 + rows * math.ceil(cols / NVFP4_BLOCK) + TENSOR_SCALE_BYTES
    raise SpecError(f"unknown storage format {fmt!r}; choose one of {list(FORMATS)}")


@dataclass(frozen=True)
class QuantRecipe:
    """Which storage format each tensor role gets. `formats` is a tuple of (role, format) pairs covering ROLES."""

    name: str
    formats: tuple[tuple[str, str], ...]
    description: str = ""

    def __post_init__(self) -> None:
        given = dict(self.formats)
        missing = [role for role in ROLES if role not in given]
        unknown = sorted(set(given) - set(ROLES))
        if missing or unknown:
            raise SpecError(f"QuantRecipe {self.name!r}: missing roles {missing}, unknown roles {unknown}")
        for role, fmt in given.items():
            if fmt not in FORMATS:
                raise SpecError(
                    f"QuantRecipe {self.name!r}: role {role!r} has unknown format {fmt!r}; "
                    f"choose one of {list(FORMATS)}"
                )

    @functools.cached_property
    def _by_role(self) -> dict[str, str]:
        return dict(self.formats)

    def format_of(self, role: str) -> str:
        """The storage format of tensors with this role (see ROLES)."""
        return self._by_role[role]

    @classmethod
    def build(cls, name: str, default: str, description: str = "", **overrides: str) -> QuantRecipe:
        """A recipe with `default` for every role except the given overrides; the router bias stays fp32."""
        formats = dict.fromkeys(ROLES, default)
        formats["router_bias"] = "fp32"
        formats.update(overrides)
        return cls(name, tuple(formats.items()), description)


_KEEP_HIGH = ("embedding", "lm_head", "norm", "bias", "mamba_conv", "mamba_ssm", "router")
_LINEAR_ROLES = (
    "mamba_proj",
    "attention_proj",
    "routed_expert",
    "shared_expert",
    "latent_proj",
    "mlp",
    "linear",
)

RECIPES: dict[str, QuantRecipe] = {
    recipe.name: recipe
    for recipe in (
        QuantRecipe.build("fp32", "fp32", "every tensor fp32 (the CPU reference path)"),
        QuantRecipe.build(
            "bf16",
            "bf16",
            "every tensor bf16 except the router's weight and bias, fp32 (as puzzle and transformers >= 5.25 hold them)",
            router="fp32",
        ),
        QuantRecipe.build(
            "fp8",
            "fp8",
            "every linear layer fp8 with a per-tensor scale; embeddings, lm_head, norms, router, "
            "conv and SSM parameters bf16",
            **dict.fromkeys(_KEEP_HIGH, "bf16"),
        ),
        QuantRecipe.build(
            "nvfp4",
            "nvfp4",
            "every linear layer nvfp4 (experts, shared expert, latent, Mamba, attention projections); "
            "embeddings, lm_head, norms, router, conv and SSM parameters bf16",
            **dict.fromkeys(_KEEP_HIGH, "bf16"),
        ),
        QuantRecipe.build(
            "nvfp4-experts",
            "fp8",
            "routed experts nvfp4, every other linear layer fp8; embeddings, lm_head, norms, router, "
            "conv and SSM parameters bf16",
            routed_expert="nvfp4",
            **dict.fromkeys(_KEEP_HIGH, "bf16"),
        ),
    )
}


def get_recipe(recipe: str | QuantRecipe) -> QuantRecipe:
    """A named recipe ("fp32", "bf16", "fp8", "nvfp4", "nvfp4-experts"); a QuantRecipe passes through."""
    if isinstance(recipe, QuantRecipe):
        return recipe
    if recipe not in RECIPES:
        raise SpecError(f"unknown quantisation recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[recipe]


@lru_cache(maxsize=4096)
def _block_weight_bytes(spec: BlockSpec, hidden_size: int, recipe: QuantRecipe) -> float:
    return sum(tensor_bytes(t.shape, recipe.format_of(t.role)) for t in block_tensors(spec, hidden_size))


def block_weight_bytes(spec: BlockSpec, hidden_size: int, recipe: str | QuantRecipe = "bf16") -> float:
    """Bytes of every tensor the block stores (buffers included) under `recipe`."""
    return _block_weight_bytes(spec, hidden_size, get_recipe(recipe))


def routed_expert_bytes(spec: MoESpec, hidden_size: int, recipe: str | QuantRecipe = "bf16") -> list[float]:
    """Bytes of each routed expert (up + down) of an MoE block under `recipe`, in expert order."""
    fmt = get_recipe(recipe).format_of("routed_expert")
    expert_input = spec.expert_input_size(hidden_size)
    return [
        tensor_bytes((width, expert_input), fmt) + tensor_bytes((expert_input, width), fmt)
        for width in spec.widths
    ]


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
    if isinstance(spec, AttentionSpec):
        return int(2 * spec.num_kv_heads * spec.head_dim * dtype_bytes(kv_dtype))
    return 0


def state_bytes_per_sequence(
    spec: BlockSpec | ModelSpec, ssm_dtype: str = "fp32", conv_dtype: str = "bf16"
) -> int:
    """Fixed-size recurrent state of one sequence, bytes: Mamba SSM state [nh, P, N] + conv state [conv_dim, K-1].

    The SSM state is fp32 by default, as serving engines keep it; the conv state holds the last K-1
    inputs of the conv (vLLM's layout). For a ModelSpec, summed over its Mamba blocks.
    """
    if isinstance(spec, ModelSpec):
        return sum(state_bytes_per_sequence(b, ssm_dtype, conv_dtype) for b in spec.blocks)
    if isinstance(spec, MambaSpec):
        ssm = spec.num_heads * spec.head_dim * spec.state_size * dtype_bytes(ssm_dtype)
        conv = spec.conv_dim * (spec.conv_kernel - 1) * dtype_bytes(conv_dtype)
        return int(ssm + conv)
    return 0


def state_bytes_per_request(
    spec: BlockSpec | ModelSpec,
    context_len: int,
    kv_dtype: str = "bf16",
    ssm_dtype: str = "fp32",
    conv_dtype: str = "bf16",
) -> int:
    """Memory one request of `context_len` tokens holds: KV cache for every token plus recurrent state."""
    return kv_bytes_per_token(spec, kv_dtype) * context_len + state_bytes_per_sequence(
        spec, ssm_dtype, conv_dtype
    )


# ---------------------------------------------------------------------------------------------------
# FLOPs (one multiply-add = 2 FLOPs; matmuls, attention scores and the SSM scan; elementwise work ignored)


def _linear_flops_per_token(spec: BlockSpec, hidden_size: int) -> float:
    """2 x (weights of the matmuls one token runs through); MoE routed experts at their expected width."""
    H = hidden_size
    if isinstance(spec, MambaSpec):
        return 2.0 * (spec.in_proj_dim * H + spec.d_inner * H)
    if isinstance(spec, AttentionSpec):
        return 2.0 * H * (2 * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    if isinstance(spec, MoESpec):
        experts = _expert_params(spec, H)
        latent = 2 * spec.latent_size * H if spec.latent_size is not None else 0
        routed = spec.top_k * sum(experts) / len(experts)
        return 2.0 * (spec.num_experts * H + latent + routed + 2 * spec.shared_width * H)
    if isinstance(spec, MLPSpec):
        return 4.0 * spec.width * H
    if isinstance(spec, LinearSpec):
        return 2.0 * H * H
    return 0.0


def _mamba_conv_flops(spec: MambaSpec) -> float:
    return 2.0 * spec.conv_kernel * spec.conv_dim


def prefill_flops_per_token(spec: BlockSpec, hidden_size: int, prompt_tokens: int) -> float:
    """Mean FLOPs per token when the block processes a prompt of `prompt_tokens` tokens.

    Attention: causal QK^T and AV, each 2 x heads x head_dim per (query, key) pair, (T+1)/2 keys on
    average. Mamba: the chunked SSD scan with chunk Q = min(chunk_size, T): per token, the
    intra-chunk scores C.B (2 G N Q), their product with x (2 d Q), the chunk state B^T x (2 d N)
    and the state's output C.h (2 d N), plus the depthwise conv.
    """
    flops = _linear_flops_per_token(spec, hidden_size)
    if isinstance(spec, AttentionSpec):
        flops += 4.0 * spec.num_heads * spec.head_dim * (prompt_tokens + 1) / 2
    elif isinstance(spec, MambaSpec):
        chunk = min(spec.chunk_size, prompt_tokens)
        d, gn = spec.d_inner, spec.n_groups * spec.state_size
        flops += _mamba_conv_flops(spec) + 2.0 * chunk * (gn + d) + 4.0 * d * spec.state_size
    return flops


def decode_flops_per_token(spec: BlockSpec, hidden_size: int, context_len: int) -> float:
    """FLOPs of one decode step for one sequence whose context (including the new token) is `context_len`.

    Attention: QK^T and AV over `context_len` keys. Mamba: the state update h = a h + dt x B^T
    (3 d N) and the output C.h (2 d N), plus the conv.
    """
    flops = _linear_flops_per_token(spec, hidden_size)
    if isinstance(spec, AttentionSpec):
        flops += 4.0 * spec.num_heads * spec.head_dim * context_len
    elif isinstance(spec, MambaSpec):
        flops += _mamba_conv_flops(spec) + 5.0 * spec.d_inner * spec.state_size
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


# ---------------------------------------------------------------------------------------------------
# Summaries


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts that `tokens` tokens touch under uniform top-k routing: E(1-(1-k/E)^n)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)
