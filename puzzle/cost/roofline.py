"""Roofline latency of blocks and models in a serving scenario, model throughput, TTFT and memory-bound concurrency.

A block's time is max(FLOPs / peak FLOP/s, bytes moved / bandwidth) plus a fixed dispatch overhead
per kernel. Bytes moved count the weights a step reads (for an MoE block only the experts the batch's
tokens touch, expected under uniform routing), the KV cache and recurrent state read and written, and
the activations written and read back between kernels. Two implementations are modelled, chosen by
the hardware profile: a serving engine's fused kernels (GPU profiles: a handful of kernels per block,
activations overlapped) and puzzle.blocks' eager plain-torch path (the calibrated CPU profile: counted
ops, elementwise traffic serial, small-batch matmuls at their own measured rate). Everything is
computed from the spec (`puzzle.cost.analytic`, and each kind's rules in `puzzle.cost.kinds`);
nothing here runs a model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from puzzle.cost.analytic import (
    QuantRecipe,
    block_weight_bytes,
    decode_flops_per_token,
    dtype_bytes,
    get_recipe,
    kv_bytes_per_token,
    kv_cache_bytes,
    lm_head_flops_per_token,
    model_weight_bytes,
    prefill_flops_per_token,
    state_bytes_per_request,
    state_bytes_per_sequence,
    tensor_bytes,
)
from puzzle.cost.hardware import DEFAULT_MEMORY_FRACTION, HardwareProfile, get_hardware
from puzzle.cost.kinds import block_cost
from puzzle.cost.limits import BOUND_RTOL, within_bounds
from puzzle.spec import BlockSpec, ModelSpec, SpecError

COMPUTE_DTYPES = ("fp32", "bf16", "fp16", "fp8", "nvfp4")


@dataclass(frozen=True)
class Scenario:
    """A serving workload: `batch_size` concurrent requests of `prompt_tokens` in and `generated_tokens` out.

    `recipe` is the weights' storage (see analytic.RECIPES); `compute_dtype` the matmul precision
    (e.g. "fp8" for W8A8 GEMMs, "nvfp4" on Blackwell); `activation_dtype` the dtype activations are
    stored in between kernels; `kv_dtype`, `ssm_dtype`, `conv_dtype` the per-request state.
    `user_speed`: decode tokens/s each user must get, for `max_batch_at_speed` and the
    `throughput_at_speed` budget (which then choose the batch; None: not given).
    """

    batch_size: int
    prompt_tokens: int
    generated_tokens: int
    recipe: str = "bf16"
    kv_dtype: str = "bf16"
    ssm_dtype: str = "fp32"
    conv_dtype: str = "bf16"
    activation_dtype: str = "bf16"
    compute_dtype: str = "bf16"
    name: str = ""
    user_speed: float | None = None

    def __post_init__(self) -> None:
        for field_name in ("batch_size", "prompt_tokens", "generated_tokens"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SpecError(f"Scenario.{field_name} must be a positive integer, found {value!r}")
        get_recipe(self.recipe)
        for field_name in ("kv_dtype", "ssm_dtype", "conv_dtype", "activation_dtype"):
            dtype_bytes(getattr(self, field_name))
        speed = self.user_speed
        if speed is not None and (
            isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed < math.inf
        ):
            raise SpecError(f"Scenario.user_speed must be a positive number of tokens/s, found {speed!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise SpecError(
                f"Scenario.compute_dtype {self.compute_dtype!r} is unknown; choose one of {list(COMPUTE_DTYPES)}"
            )

    @property
    def decode_context(self) -> float:
        """Mean context (keys, the new token included) over the decode steps: prompt + (generated + 1) / 2."""
        return self.prompt_tokens + (self.generated_tokens + 1) / 2


@dataclass(frozen=True)
class BlockWork:
    """Hardware-independent work of one phase for the whole batch.

    `bytes`: weights, KV cache and recurrent state moved; `activation_bytes`: activations written
    and read back between ops; `ops`: dispatched ops (or kernels).
    """

    flops: float
    bytes: float
    activation_bytes: float
    ops: float
    rows: int | None = None  # tokens per matmul (batch x tokens); None = large
    exchanged_bytes: float = 0.0  # the output all-reduced across GPUs under tensor parallelism


@dataclass(frozen=True)
class BlockLatency:
    """Seconds for the whole batch: the prefill of every prompt, and one decode step (mean over the generation)."""

    prefill_s: float
    decode_step_s: float


# ---------------------------------------------------------------------------------------------------
# Bytes and ops


def _weight_bytes_touched(spec: BlockSpec, hidden_size: int, recipe: QuantRecipe, tokens: int) -> float:
    """Weight bytes `tokens` tokens read: all of them, except only the expected touched experts of an MoE."""
    total = block_weight_bytes(spec, hidden_size, recipe)
    return block_cost(spec).weight_bytes_touched(spec, hidden_size, recipe, tokens, total)


def eager_op_count(spec: BlockSpec, batch_size: int, tokens: int, decode: bool) -> float:
    """Ops dispatched by one call of `puzzle.model.Block` on the plain-torch path (norm and residual included).

    Counted with a TorchDispatchMode on that implementation (views included): the fp32 RMSNorm and
    the residual add 11; mixers: Mamba 72 + 70 per scan chunk for a prefill (the scan loops over
    chunks), 67 for a step; attention 25 / 28; MoE ~40 with grouped expert matmuls, 24 + 8 per
    (token, slot) pair when there are fewer pairs than experts, 34 + 8 per expert that receives tokens
    with mixed widths (+7 with latent and shared); MLP 4; Linear 1 (each kind's `eager_ops` in `puzzle.cost.kinds`;
    tests/test_cost_roofline.py checks these against the code). A no-op block runs nothing. These
    only matter where dispatch overhead is large (eager on a CPU); a GPU server's CUDA graphs make it
    ~1 us per kernel.
    """
    cost = block_cost(spec)
    if not cost.runs:
        return 0.0
    norm_and_residual = 11.0
    return cost.eager_ops(spec, batch_size, tokens, decode) + norm_and_residual


NO_WORK = BlockWork(0.0, 0.0, 0.0, 0.0)  # a removed block: the model skips it entirely


def fused_kernel_count(spec: BlockSpec) -> float:
    """Kernels per block call in a serving engine (norm, projections, fused conv / scan / attention, grouped GEMMs)."""
    cost = block_cost(spec)
    if not cost.runs:
        return 0.0
    norm_and_residual = 2.0
    return cost.fused_kernels(spec) + norm_and_residual


def _op_count(spec: BlockSpec, batch_size: int, tokens: int, decode: bool, eager: bool) -> float:
    return eager_op_count(spec, batch_size, tokens, decode) if eager else fused_kernel_count(spec)


def prefill_work(spec: BlockSpec, hidden_size: int, scenario: Scenario, eager: bool = False) -> BlockWork:
    """Work of one block prefilling every prompt of the batch (B x prompt_tokens tokens)."""
    cost = block_cost(spec)
    if not cost.runs:
        return NO_WORK
    B, T = scenario.batch_size, scenario.prompt_tokens
    tokens = B * T
    recipe = get_recipe(scenario.recipe)
    flops = tokens * prefill_flops_per_token(spec, hidden_size, T)
    moved = _weight_bytes_touched(spec, hidden_size, recipe, tokens)
    activations = (
        tokens
        * cost.activation_elements_per_token(spec, hidden_size)
        * dtype_bytes(scenario.activation_dtype)
    )
    # KV written once and read once by a flash-style kernel; recurrent state written at the end.
    moved += 2.0 * tokens * kv_bytes_per_token(spec, scenario.kv_dtype)
    moved += B * state_bytes_per_sequence(spec, scenario.ssm_dtype, scenario.conv_dtype)
    activations += tokens * cost.prefill_scratch_bytes_per_token(spec, T)  # e.g. Mamba's chunked scan
    ops = _op_count(spec, B, T, decode=False, eager=eager)
    exchanged = tokens * hidden_size * dtype_bytes(scenario.activation_dtype)
    return BlockWork(flops, moved, activations, ops, rows=tokens, exchanged_bytes=exchanged)


def decode_work(spec: BlockSpec, hidden_size: int, scenario: Scenario, eager: bool = False) -> BlockWork:
    """Work of one decode step of the whole batch at the scenario's mean decode context."""
    cost = block_cost(spec)
    if not cost.runs:
        return NO_WORK
    B = scenario.batch_size
    context = scenario.decode_context
    recipe = get_recipe(scenario.recipe)
    flops = B * decode_flops_per_token(spec, hidden_size, context)
    moved = _weight_bytes_touched(spec, hidden_size, recipe, B)
    activations = (
        B * cost.activation_elements_per_token(spec, hidden_size) * dtype_bytes(scenario.activation_dtype)
    )
    kv = kv_bytes_per_token(spec, scenario.kv_dtype)
    moved += B * (
        kv_cache_bytes(spec, context, scenario.kv_dtype) + kv
    )  # read the cache, append the new token
    moved += 2.0 * B * state_bytes_per_sequence(spec, scenario.ssm_dtype, scenario.conv_dtype)  # read + write
    ops = _op_count(spec, B, 1, decode=True, eager=eager)
    exchanged = B * hidden_size * dtype_bytes(scenario.activation_dtype)
    return BlockWork(flops, moved, activations, ops, rows=B, exchanged_bytes=exchanged)


def roofline_seconds(work: BlockWork, hardware: HardwareProfile, compute_dtype: str = "bf16") -> float:
    """max(FLOPs / peak, bytes / bandwidth) + ops x dispatch overhead.

    Fused kernels (GPU profiles) overlap activation traffic with the rest: it joins `bytes`. Eager
    ops (hardware.eager) run one after another and the elementwise ones are memory-bound, so there
    the activation traffic is added after the max.
    """
    compute = work.flops / hardware.matmul_flops_per_s(compute_dtype, work.rows)
    bandwidth = hardware.memory_bandwidth
    if hardware.eager:
        return (
            max(compute, work.bytes / bandwidth)
            + work.activation_bytes / bandwidth
            + work.ops * hardware.op_overhead_s
        )
    seconds = (
        max(compute, (work.bytes + work.activation_bytes) / bandwidth) + work.ops * hardware.op_overhead_s
    )
    return seconds + all_reduce_seconds(work, hardware)


def all_reduce_seconds(work: BlockWork, hardware: HardwareProfile) -> float:
    """The tensor-parallel all-reduce of a block's output on a multi-GPU profile (0 on one device).

    A ring all-reduce sends and receives 2 (g - 1) / g of the tensor per device; it sits on the critical
    path (the next block needs the sum), and costs one more kernel launch.
    """
    g = hardware.gpus
    if g <= 1 or work.ops == 0:
        return 0.0
    if hardware.interconnect_bandwidth <= 0:
        raise SpecError(f"hardware {hardware.name!r} has {g} GPUs but no interconnect bandwidth")
    return 2.0 * (g - 1) / g * work.exchanged_bytes / hardware.interconnect_bandwidth + hardware.op_overhead_s


def block_latency(
    spec: BlockSpec, hidden_size: int, scenario: Scenario, hardware: str | HardwareProfile
) -> BlockLatency:
    """Predicted prefill and decode-step seconds of one block (pre-norm, mixer, residual) for the whole batch."""
    return _block_latency_cached(spec, hidden_size, scenario, get_hardware(hardware))


@lru_cache(maxsize=65536)
def _block_latency_cached(
    spec: BlockSpec, hidden_size: int, scenario: Scenario, hardware: HardwareProfile
) -> BlockLatency:
    dtype, eager = scenario.compute_dtype, hardware.eager
    return BlockLatency(
        prefill_s=roofline_seconds(prefill_work(spec, hidden_size, scenario, eager), hardware, dtype),
        decode_step_s=roofline_seconds(decode_work(spec, hidden_size, scenario, eager), hardware, dtype),
    )


class RooflineLatency:
    """Block latency source `(spec, hidden_size, scenario) -> BlockLatency` predicted for `hardware`."""

    def __init__(self, hardware: str | HardwareProfile) -> None:
        self.hardware = get_hardware(hardware)

    def __call__(self, spec: BlockSpec, hidden_size: int, scenario: Scenario) -> BlockLatency:
        return block_latency(spec, hidden_size, scenario, self.hardware)


LatencyFn = Callable[[BlockSpec, int, Scenario], BlockLatency]


# ---------------------------------------------------------------------------------------------------
# Whole models


@dataclass(frozen=True)
class ModelPerformance:
    """A whole model in a scenario. Times in seconds for the whole batch; rates in tokens per second."""

    prefill_s: float  # time to first token of every request in the batch
    decode_step_s: float  # one step of the batch, mean over the generation
    total_s: float  # prefill + generated_tokens x decode step
    output_tokens_per_s: float  # batch x generated / total
    total_tokens_per_s: float  # batch x (prompt + generated) / total
    per_user_tokens_per_s: float  # 1 / decode step


def _embedding_and_head_seconds(
    model_spec: ModelSpec, scenario: Scenario, hardware: HardwareProfile
) -> tuple[float, float]:
    """(prefill, decode step) seconds of the embedding lookup, final norm and lm_head (logits of the last token)."""
    H, V, B = model_spec.hidden_size, model_spec.vocab_size, scenario.batch_size
    recipe = get_recipe(scenario.recipe)
    act = dtype_bytes(scenario.activation_dtype)
    head_bytes = tensor_bytes(
        (V, H), recipe.format_of("embedding" if model_spec.tie_embeddings else "lm_head")
    )
    head_flops = lm_head_flops_per_token(model_spec)

    embedding_value_bytes = tensor_bytes((V, H), recipe.format_of("embedding")) / (V * H)
    ops = 12.0 if hardware.eager else 3.0  # lookup, final norm, lm_head (eager: the norm's fp32 passes)

    def phase(tokens: int) -> BlockWork:
        lookup = tokens * H * (embedding_value_bytes + act)  # gathered rows in, activations out
        # Final norm and logits for the last token of each sequence: lm_head weights, B x (H + V) activations.
        moved = lookup + head_bytes + B * (2 * H + V) * act
        # Vocabulary-parallel lm_head over several GPUs: the logits are gathered (counted as an all-reduce).
        return BlockWork(
            B * head_flops, moved, activation_bytes=0.0, ops=ops, rows=B, exchanged_bytes=B * V * act
        )

    dtype = scenario.compute_dtype
    prefill = roofline_seconds(phase(B * scenario.prompt_tokens), hardware, dtype)
    return prefill, roofline_seconds(phase(B), hardware, dtype)


def model_performance(
    model_spec: ModelSpec,
    scenario: Scenario,
    hardware: str | HardwareProfile,
    latency_fn: LatencyFn | None = None,
) -> ModelPerformance:
    """Prefill, decode step, throughput of a model; blocks timed by `latency_fn` (default: the roofline)."""
    hardware = get_hardware(hardware)
    latency_fn = latency_fn or RooflineLatency(hardware)
    H = model_spec.hidden_size
    prefill, step = _embedding_and_head_seconds(model_spec, scenario, hardware)
    cache: dict[BlockSpec, BlockLatency] = {}
    for block in model_spec.blocks:
        if block not in cache:
            cache[block] = latency_fn(block, H, scenario)
        prefill += cache[block].prefill_s
        step += cache[block].decode_step_s
    total = prefill + scenario.generated_tokens * step
    B = scenario.batch_size
    return ModelPerformance(
        prefill_s=prefill,
        decode_step_s=step,
        total_s=total,
        output_tokens_per_s=B * scenario.generated_tokens / total,
        total_tokens_per_s=B * (scenario.prompt_tokens + scenario.generated_tokens) / total,
        per_user_tokens_per_s=1.0 / step,
    )


def model_throughput(
    model_spec: ModelSpec,
    scenario: Scenario,
    hardware: str | HardwareProfile,
    latency_fn: LatencyFn | None = None,
) -> float:
    """Generated tokens per second of the whole batch, prefill included: B x generated / (prefill + generated x step)."""
    return model_performance(model_spec, scenario, hardware, latency_fn).output_tokens_per_s


def time_to_first_token(
    model_spec: ModelSpec,
    scenario: Scenario,
    hardware: str | HardwareProfile,
    latency_fn: LatencyFn | None = None,
) -> float:
    """Seconds until every request of the batch has its first token (the batched prefill)."""
    return model_performance(model_spec, scenario, hardware, latency_fn).prefill_s


def max_concurrent_requests(
    spec: ModelSpec,
    hardware: str | HardwareProfile,
    context_len: int,
    recipe: str | QuantRecipe = "bf16",
    kv_dtype: str = "bf16",
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
    ssm_dtype: str = "fp32",
    conv_dtype: str = "bf16",
    reserved_bytes: float = 0.0,
) -> int:
    """How many requests of `context_len` tokens fit in memory beside the weights (0 if the weights don't fit).

    floor((memory_fraction x capacity - weight bytes - reserved_bytes) / state bytes per request) (the usable
    memory to a relative `BOUND_RTOL`, as the search's budgets are held to it), where a request holds KV for every token and one recurrent state per Mamba block. `memory_fraction` is
    the share of the device an engine may use (vLLM's gpu_memory_utilization, default 0.9);
    `reserved_bytes` covers activations / workspace if known.
    """
    hardware = get_hardware(hardware)
    if not 0 < memory_fraction <= 1:
        raise SpecError(f"memory_fraction must be in (0, 1], found {memory_fraction!r}")
    if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len <= 0:
        raise SpecError(f"context_len must be a positive integer, found {context_len!r}")
    per_request = state_bytes_per_request(spec, context_len, kv_dtype, ssm_dtype, conv_dtype)
    if per_request <= 0:
        raise SpecError(
            "the model keeps no per-request state (no attention or Mamba block): memory does not bound it"
        )
    usable = memory_fraction * hardware.memory_bytes
    # R requests fit when weights + R x state <= usable to the relative BOUND_RTOL the search holds its
    # `concurrent_requests` row to (`within_bounds`), so the count agrees with the search's verdict.
    free = usable * (1.0 + BOUND_RTOL) - model_weight_bytes(spec, recipe) - reserved_bytes
    return max(0, math.floor(free / per_request))


@dataclass(frozen=True)
class SpeedPoint:
    """The largest batch of a scenario whose per-user decode speed stays at or above a given speed.

    `batch`: that batch (0 when even one request is too slow, or does not fit); `limited_by`: "speed"
    (batch + 1 would be slower than asked), "memory" (batch + 1 requests of the scenario's context do not
    fit beside the weights) or "none-fits"; `max_concurrent`: how many requests fit; `performance`: the
    model at that batch (None when the batch is 0).
    """

    user_speed: float
    batch: int
    max_concurrent: int
    limited_by: str
    performance: ModelPerformance | None

    @property
    def throughput(self) -> float:
        """Output tokens/s of the server at that batch (prefill included); 0 when no batch meets the speed."""
        return self.performance.output_tokens_per_s if self.performance else 0.0


def max_batch_at_speed(
    model_spec: ModelSpec,
    scenario: Scenario,
    hardware: str | HardwareProfile,
    user_speed: float | None = None,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
    latency_fn: LatencyFn | None = None,
) -> SpeedPoint:
    """The largest batch of `scenario` (its own batch size ignored) whose per-user decode speed, 1 / decode
    step at the mean decode context, is at least `user_speed` (default: the scenario's), and that fits in
    memory: that many requests of prompt + generated tokens, KV cache and recurrent state in the scenario's
    dtypes, beside the weights in its recipe (`max_concurrent_requests`). "At least" is to the relative
    `BOUND_RTOL` the search holds a budget to (`puzzle.cost.limits.within_bounds`), so a child the search
    returns under `user_speed` or `throughput_at_speed` carries the batch it was priced at.

    The decode step does not shrink as the batch grows (more weights touched, more state read, more
    FLOPs), so the speed is monotone in the batch and a bisection over [1, max concurrent] finds the
    largest batch that meets it.
    """
    hardware = get_hardware(hardware)
    speed = scenario.user_speed if user_speed is None else user_speed
    if speed is None:
        raise SpecError("max_batch_at_speed needs a user speed (tokens/s per user), given or in the scenario")
    scenario = dataclasses.replace(scenario, user_speed=float(speed))
    context = scenario.prompt_tokens + scenario.generated_tokens
    try:
        fits = max_concurrent_requests(
            model_spec,
            hardware,
            context,
            scenario.recipe,
            scenario.kv_dtype,
            memory_fraction,
            scenario.ssm_dtype,
            scenario.conv_dtype,
        )
    except SpecError:  # no per-request state: memory does not bound the batch; the speed will
        fits = 2**40

    def at(batch: int) -> ModelPerformance:
        return model_performance(
            model_spec, dataclasses.replace(scenario, batch_size=batch), hardware, latency_fn
        )

    def meets_speed(performance: ModelPerformance) -> bool:
        """At least the speed, to the relative tolerance the search's `user_speed` row is held to."""
        return within_bounds(performance.per_user_tokens_per_s, float(speed), None)

    if fits < 1:
        return SpeedPoint(float(speed), 0, fits, "none-fits", None)
    if not meets_speed(at(1)):
        return SpeedPoint(float(speed), 0, fits, "speed", None)
    low, high = 1, fits  # at(low) meets the speed; the answer is in [low, high]
    if meets_speed(at(high)):
        return SpeedPoint(float(speed), high, fits, "memory", at(high))
    while high - low > 1:  # at(high) misses the speed
        middle = (low + high) // 2
        if meets_speed(at(middle)):
            low = middle
        else:
            high = middle
    return SpeedPoint(float(speed), low, fits, "speed", at(low))
