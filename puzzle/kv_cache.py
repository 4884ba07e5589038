"""An fp8 KV cache with static per-layer scales: calibrated on tokens, applied in the attention forward.

What vLLM does with `--kv-cache-dtype fp8` and a checkpoint that carries k/v scales: each attention layer
has one fp32 scale for its keys and one for its values (per tensor: every head, position and channel);
a key is written to the cache as ``e4m3(k / k_scale)`` (saturating at +-448) and read back as
``value * k_scale`` inside the attention kernel, and the same for values. vLLM 190900b9
`vllm/model_executor/layers/quantization/kv_cache.py` (`BaseKVCacheMethod.process_weights_after_loading`:
the loaded `k_scale` / `v_scale` become the layer's `_k_scale` / `_v_scale`; without them 1.0), and the
cache writes (`reshape_and_cache_flash`, a saturating fp8 conversion of ``x / scale``).

Calibration: the scale of a layer's keys is ``amax / 448`` with ``amax`` the largest |k| over the
calibration tokens (keys as the cache stores them: after RoPE when the block has it), which maps the
largest key seen to the largest finite E4M3 value; values alike. A layer whose keys were all zero gets 1.0
(a scale must be positive for vLLM to take it).

In the model: `set_kv_scales` gives each attention mixer its two scales (`AttentionMixer.kv_scales`), and
its forward then fake-quantizes keys and values (`quantize_kv_fp8`) before they reach the cache or the
attention, so scoring, KL, GKD and `generate` see the error the served cache adds. The scales are not
parameters: they travel with the model (`kv_scales`), and an export writes them as compressed-tensors'
attention `k_scale` / `v_scale` (`puzzle.nemotron_h.kv_export`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

FP8_MAX = 448.0  # largest finite float8_e4m3fn


class KVCacheError(ValueError):
    """KV scales that do not fit the model (a block that is not attention, a scale that is not positive)."""


def quantize_kv_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` (keys or values, any shape) stored in fp8 E4M3 with the per-tensor `scale` and read back, in `x`'s
    dtype: ``e4m3(clamp(x / scale, +-448)) * scale``, computed in fp32. Not differentiable in `scale`; the
    gradient to `x` is straight-through (QAT of a KV-fp8 child sees the quantized forward)."""
    x32 = x.float()
    scale32 = scale.to(device=x.device, dtype=torch.float32)
    stored = (x32 / scale32).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    quantized = (stored.float() * scale32).to(x.dtype)
    if torch.is_grad_enabled() and x.requires_grad:
        return x + (quantized - x).detach()
    return quantized


def _attention_mixers(model: nn.Module) -> dict[int, nn.Module]:
    """{block index: its AttentionMixer} of a HybridLM (blocks whose mixer has `kv_scales`)."""
    return {
        index: block.mixer for index, block in enumerate(model.layers) if hasattr(block.mixer, "kv_scales")
    }


def kv_scales(model: nn.Module) -> dict[int, tuple[float, float]]:
    """{attention block index: (k_scale, v_scale)} the model's KV cache is quantized with; {} for none."""
    out = {}
    for index, mixer in _attention_mixers(model).items():
        if mixer.kv_scales is not None:
            k, v = mixer.kv_scales.tolist()
            out[index] = (k, v)
    return out


def set_kv_scales(model: nn.Module, scales: Mapping[int, tuple[float, float]] | None) -> nn.Module:
    """Give each attention block of `model` its (k_scale, v_scale) (None or {}: an unquantized KV cache).

    Every attention block needs its scales (a served fp8 cache quantizes every layer): KVCacheError for a
    missing one, an index that is no attention block, or a scale that is not positive and finite."""
    mixers = _attention_mixers(model)
    scales = dict(scales or {})
    if scales:
        strays = sorted(set(scales) - set(mixers))
        if strays:
            raise KVCacheError(f"KV scales for block(s) {strays}, which are not attention blocks")
        missing = sorted(set(mixers) - set(scales))
        if missing:
            raise KVCacheError(
                f"no KV scales for attention block(s) {missing}: an fp8 cache quantizes every one"
            )
    for index, mixer in mixers.items():
        if index not in scales:
            mixer.kv_scales = None
            continue
        pair = torch.tensor([float(s) for s in scales[index]], dtype=torch.float32)
        if pair.shape != (2,) or not bool(torch.isfinite(pair).all() and (pair > 0).all()):
            raise KVCacheError(
                f"block {index}: expected (k_scale, v_scale), two positive finite numbers, got {scales[index]}"
            )
        mixer.kv_scales = pair
    return model


class _AmaxObserver:
    """Keeps the largest |k| and |v| an attention mixer's forward shows it."""

    def __init__(self) -> None:
        self.amax = torch.zeros(2, dtype=torch.float64)

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        seen = torch.stack([k.detach().abs().amax().float(), v.detach().abs().amax().float()]).cpu()
        self.amax = torch.maximum(self.amax, seen.double())


def _scales_from_amax(amax_k: float, amax_v: float) -> tuple[float, float]:
    """(k_scale, v_scale) = amax / 448, with 1.0 for an amax of 0 (all-zero keys or values)."""
    return tuple(a / FP8_MAX if a > 0 else 1.0 for a in (amax_k, amax_v))  # type: ignore[return-value]


@torch.no_grad()
def calibrate_kv_scales(model: nn.Module, batches: Iterable[torch.Tensor]) -> dict[int, tuple[float, float]]:
    """{attention block index: (k_scale, v_scale)} from a forward of `model` over `batches` (token ids
    [b, t]): ``amax / 448`` of each layer's keys and values (1.0 where it is 0). The model runs with its
    KV cache unquantized during calibration (any scales it had are restored afterwards)."""
    mixers = _attention_mixers(model)
    observers = {index: _AmaxObserver() for index in mixers}
    saved = {index: mixer.kv_scales for index, mixer in mixers.items()}
    try:
        for index, mixer in mixers.items():
            mixer.kv_scales, mixer.kv_observer = None, observers[index]
        seen = 0
        for batch in batches:
            model(batch)
            seen += 1
        if not seen:
            raise KVCacheError("KV scale calibration needs at least one batch of tokens")
    finally:
        for index, mixer in mixers.items():
            mixer.kv_scales, mixer.kv_observer = saved[index], None
    return {index: _scales_from_amax(*observer.amax.tolist()) for index, observer in observers.items()}


def calibrated(model: nn.Module, batches: Iterable[torch.Tensor]) -> nn.Module:
    """`model` with its KV cache quantized to fp8 with scales calibrated on `batches` (in place)."""
    return set_kv_scales(model, calibrate_kv_scales(model, batches))


__all__ = [
    "FP8_MAX",
    "KVCacheError",
    "calibrate_kv_scales",
    "calibrated",
    "kv_scales",
    "quantize_kv_fp8",
    "set_kv_scales",
]
