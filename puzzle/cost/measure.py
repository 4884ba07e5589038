"""Measured latency of a block variant on the current device, with the roofline's interface (a LatencyFn).

A block here is what the model runs per layer, `puzzle.model.Block` (x + mixer(norm(x))), with random
weights (latency does not depend on their values, except MoE routing, which random router weights
spread roughly uniformly, as the roofline assumes).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from puzzle.cost.roofline import BlockLatency, Scenario
from puzzle.cost.timing import median_seconds
from puzzle.spec import BlockSpec

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@torch.inference_mode()
def measure_block_latency(
    spec: BlockSpec,
    hidden_size: int,
    scenario: Scenario,
    device: str | torch.device = "cpu",
    dtype: str = "fp32",
    warmup: int = 1,
    repeats: int = 5,
    seed: int = 0,
) -> BlockLatency:
    """Median seconds of the batch's prefill and of one decode step at the scenario's mean decode context.

    Prefill: forward of [batch, prompt_tokens, H] into a fresh cache. Decode: the cache is first
    filled with round(decode_context) - 1 tokens, then single-token steps are timed (each appends
    one token; the drift over warmup + repeats steps is negligible for realistic contexts).
    `dtype` is the weights' and activations' dtype ("fp32", "bf16", "fp16").
    """
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} for measurement; choose one of {sorted(_TORCH_DTYPES)}")
    device = torch.device(device)
    torch_dtype = _TORCH_DTYPES[dtype]
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    from puzzle.model import Block  # imported late: the rest of the cost model needs no modules

    block = Block(spec, hidden_size, norm_eps=1e-5).to(device=device, dtype=torch_dtype).eval()
    B, T = scenario.batch_size, scenario.prompt_tokens

    def random(tokens: int) -> torch.Tensor:
        return torch.randn(B, tokens, hidden_size, generator=generator).to(device=device, dtype=torch_dtype)

    prompt = random(T)
    prefill_s = median_seconds(
        lambda: block(prompt, cache=block.mixer.init_cache(B)), repeats, warmup, device
    )

    cache = block.mixer.init_cache(B)
    history = max(1, round(scenario.decode_context) - 1)
    if cache is not None:
        block(random(history), cache=cache)
    token = random(1)
    decode_s = median_seconds(lambda: block.step(token, cache), repeats, warmup, device)
    return BlockLatency(prefill_s=prefill_s, decode_step_s=decode_s)


class MeasuredLatency:
    """Block latency source `(spec, hidden_size, scenario) -> BlockLatency` measured here (results cached)."""

    def __init__(
        self, device: str | torch.device = "cpu", dtype: str = "fp32", warmup: int = 1, repeats: int = 5
    ) -> None:
        self.device, self.dtype, self.warmup, self.repeats = device, dtype, warmup, repeats
        self._cache: dict[tuple[BlockSpec, int, Scenario], BlockLatency] = {}

    def __call__(self, spec: BlockSpec, hidden_size: int, scenario: Scenario) -> BlockLatency:
        key = (spec, hidden_size, scenario)
        if key not in self._cache:
            self._cache[key] = measure_block_latency(
                spec, hidden_size, scenario, self.device, self.dtype, self.warmup, self.repeats
            )
        return self._cache[key]


@torch.inference_mode()
def decode_seconds(model: Any, prompt: torch.Tensor, steps: int) -> float:
    """Seconds for `steps` greedy single-token decode steps of a whole `HybridLM` after an untimed prefill
    of `prompt` ([batch, tokens]) into a fresh cache: what a served model spends per generated token."""
    cache = model.init_cache(prompt.shape[0])
    token = model(prompt, cache=cache, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
    _synchronize(prompt.device)
    started = time.perf_counter()
    for _ in range(steps):
        token = model(token, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
    _synchronize(prompt.device)
    return time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
