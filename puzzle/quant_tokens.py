"""Dynamic per-token fp8 activations: what a served fp8 matmul does to its input, fake-quantized.

compressed-tensors' FP8_DYNAMIC scheme (the one fp8 blocks are exported in, `puzzle.nemotron_h.quantized`)
quantizes the input of every fp8 matmul at run time, token by token: vLLM's `CompressedTensorsW8A8Fp8`
and its fp8 MoE method (routed experts: their input and the activated intermediate), and compressed-tensors'
own forward. With ``amax`` the largest magnitude of a token's features, its scale is ``amax / 448`` and
its values ``e4m3(x / scale) * scale`` (round to nearest even, saturating at +-448), the same arithmetic
as an fp8 weight row (`puzzle.quant.quantize_fp8`). An all-zero token stays zero.

A model whose scores, KL and GKD never saw this error would be judged on a forward that no engine runs:
`puzzle.blocks.formats.install` puts it before every matmul of an fp8 block, in fp32 (as vLLM computes the
scale), with a straight-through gradient (QAT sees the quantized forward, the gradient passes unchanged).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_tokens_fp8(x: torch.Tensor) -> torch.Tensor:
    """`x` [..., features] with each token (row of the last dimension) quantized to E4M3 with its own
    scale and dequantized, in `x`'s dtype (computed in fp32). Not differentiable: see `fake_quantize_tokens`."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # Clamp before the cast: x / scale can exceed 448 by an ulp, and the cast must saturate, not overflow.
    values = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (values.float() * scale).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: the per-token fp8 values; backward: the incoming gradient unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return quantize_tokens_fp8(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def fake_quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """`quantize_tokens_fp8(x)` with a straight-through gradient (QAT, BLD and GKD of an fp8 block)."""
    if x.numel() == 0:
        return x
    if torch.is_grad_enabled() and x.requires_grad:
        return _StraightThrough.apply(x)
    return quantize_tokens_fp8(x)


def quantize_input_hook(module: torch.nn.Module, args: tuple) -> tuple:
    """A forward pre-hook for a served fp8 matmul module: its input quantized per token."""
    return (fake_quantize_tokens(args[0]), *args[1:])


__all__ = ["fake_quantize_tokens", "quantize_input_hook", "quantize_tokens_fp8"]
