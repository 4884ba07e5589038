"""Number formats of served weights: fp8 (E4M3, per output channel) and NVIDIA's NVFP4, in torch on the CPU.

One job: turn a 2-D matmul weight [out_features, in_features] into the stored values and scales of a
serving format, back again, and the two composed (`fake_quantize`, the reference that scoring, QAT and
assembly use). Which tensors of a block get a format lives in `puzzle.quant_blocks`; how a quantized
checkpoint is written and read back, in `puzzle.nemotron_h.quantized`.

Formats, exactly as vLLM's compressed-tensors kernels read them:

- **fp8**: E4M3 (`torch.float8_e4m3fn`, max 448, no infinities) values, one fp32 scale per output
  channel (per row of the [out, in] weight), symmetric: ``scale[r] = amax(|w[r, :]|) / 448`` and
  ``q = e4m3(w / scale)`` (round to nearest even, saturating at +-448). Per-channel is the "channel"
  strategy of compressed-tensors (`weight_scale` of shape [out, 1]), what its FP8_DYNAMIC preset and
  llm-compressor write and what vLLM's `CompressedTensorsW8A8Fp8` loads per output channel; a per-tensor
  scale would let one outlier row crush every other row's precision, and per-channel costs only 4 bytes
  a row. An all-zero row gets scale 1 (any scale dequantizes it to 0; 1 keeps the division finite).
- **nvfp4**: E2M1 values {0, 0.5, 1, 1.5, 2, 3, 4, 6} (+-), one E4M3 scale per 16 consecutive values of
  a row (along the input dimension), one fp32 global scale per tensor. With ``amax`` the tensor's largest
  magnitude, the (decode) global scale is ``g = amax / (6 * 448)``; block b's scale is
  ``s_b = e4m3((amax_b / 6) / g)`` and ``q = e2m1(w / (s_b * g))``; dequantization is ``q * s_b * g``.
  Two refinements make quantization repeat itself exactly (quantizing the dequantized weights gives the
  same bytes, so fake quantization is idempotent, a baked child's forward uses what it stores, and a
  loaded export saves to the same file): g is the fp32 value nearest amax / 2688 that a round trip leaves
  unchanged (`nvfp4_global_scale`, 0 to a few ulps away), and a block whose scale is an E4M3 subnormal
  (amax_b below 3.5e-5 of amax) is written in one canonical (scale, codes) pair of the same values
  (`_canonical_small_blocks`). The values are those of the rule above (or, for a block some subnormal
  scale represents exactly, the block itself); only such a block's bytes may differ from the rule's.
  E2M1 rounding is round-to-nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4),
  as compressed-tensors' `cast_to_fp4` and NVIDIA's cvt.rn do. Packing: two values per uint8, the
  element at the even column in the low nibble, the odd one in the high nibble; a nibble is
  ``sign << 3 | code`` with code 0..7 the index into the magnitudes above (compressed-tensors'
  `pack_fp4_to_uint8`, ModelOpt's layout). Stored scales: compressed-tensors keeps the *encode* scale
  ``weight_global_scale = 1 / g = 6 * 448 / amax`` (its dequantization divides by it), NVIDIA ModelOpt
  keeps ``weight_scale_2 = g``; both store the same E4M3 block scales ``weight_scale``. An all-zero
  tensor gets ``g = 1`` and an all-zero block ``s_b = 0`` (its values are 0 whatever the scale).
  ``in_features`` must be a multiple of 16: vLLM allocates ``in_features // 16`` block scales, so a
  partial block could not be loaded; it is refused, not padded.

Non-finite weights (NaN, inf) are refused with an error naming the tensor: they would silently poison
a scale, and through it every value of the row or tensor.
"""

from __future__ import annotations

import torch

from puzzle.formats import NVFP4_BLOCK, WEIGHT_FORMATS

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest E2M1 magnitude
# The 8 E2M1 magnitudes, indexed by their 3-bit code (exponent 2 bits, mantissa 1 bit).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class QuantError(ValueError):
    """A weight that cannot be quantized to the asked format (shape, non-finite values, unknown format)."""


def _check_weight(w: torch.Tensor, name: str) -> None:
    if w.dim() != 2:
        raise QuantError(
            f"{name}: expected a 2-D matmul weight [out_features, in_features], got shape {tuple(w.shape)}"
        )
    if not w.is_floating_point():
        raise QuantError(f"{name}: expected a floating-point weight, got dtype {w.dtype}")
    if not bool(torch.isfinite(w).all()):
        bad = int((~torch.isfinite(w)).sum())
        raise QuantError(
            f"{name}: {bad} non-finite value(s) (NaN or inf) in a weight of shape {tuple(w.shape)}"
        )


# ---------------------------------------------------------------------------------------------- fp8


def quantize_fp8(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [out, in] -> (E4M3 values [out, in] float8_e4m3fn, fp32 scales [out, 1]); see the module docstring."""
    _check_weight(w, name)
    w32 = w.detach().float()
    amax = w32.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # Clamp before the cast: w / scale can exceed 448 by an ulp, and the cast must saturate, not overflow.
    values = (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale


def dequantize_fp8(
    values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """E4M3 values [out, in] times their per-row fp32 scales [out, 1], computed in fp32, returned as `dtype`."""
    return (values.float() * scale.float()).to(dtype)


# -------------------------------------------------------------------------------------------- nvfp4


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit E2M1 codes (uint8, sign in bit 3) of fp32 `x` rounded to nearest, ties to even, saturating at 6.

    A tie sits exactly at a midpoint between two magnitudes; the even code is the one with mantissa bit 0,
    so ">=" at midpoints whose upper neighbour is even and ">" where the lower one is.
    """
    a = x.abs()
    code = (
        (a > 0.25).to(torch.uint8)  # 0 | 0.5: tie -> 0 (code 0)
        + (a >= 0.75).to(torch.uint8)  # 0.5 | 1: tie -> 1 (code 2)
        + (a > 1.25).to(torch.uint8)  # 1 | 1.5: tie -> 1 (code 2)
        + (a >= 1.75).to(torch.uint8)  # 1.5 | 2: tie -> 2 (code 4)
        + (a > 2.5).to(torch.uint8)  # 2 | 3: tie -> 2 (code 4)
        + (a >= 3.5).to(torch.uint8)  # 3 | 4: tie -> 4 (code 6)
        + (a > 5.0).to(torch.uint8)  # 4 | 6: tie -> 4 (code 6)
    )
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit E2M1 codes (uint8, sign in bit 3)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] 4-bit codes -> [out, in // 2] uint8: even column in the low nibble, odd column in the high one."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[out, in // 2] uint8 -> [out, in] 4-bit codes (inverse of `pack_e2m1`)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def _nvfp4_amax_of(g: torch.Tensor) -> torch.Tensor:
    """The largest magnitude a tensor quantized with decode global scale `g` dequantizes to, in fp32: code 6 of
    a block with scale 448, computed as `dequantize_nvfp4` computes it (the step 448 * g first)."""
    return (torch.tensor(FP8_MAX, dtype=torch.float32) * g) * FP4_MAX


def _stable(g: torch.Tensor) -> bool:
    """Whether `g` survives a round trip: read back from the stored encode scale 1 / g it is `g` again, and the
    dequantized tensor's amax (`_nvfp4_amax_of`) gives `g` again as its own global scale."""
    return bool(1.0 / (1.0 / g) == g) and bool(_nvfp4_amax_of(g) / (FP4_MAX * FP8_MAX) == g)


# How many fp32 ulps either side of amax / 2688 `nvfp4_global_scale` looks for a stable scale: about 70% of
# fp32 values are stable, and one was at most 6 ulps away for 20,000 amaxes spread over 1e-13 to 1e13.
_STABLE_SEARCH_ULPS = 16


def nvfp4_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """The decode global scale g ~ amax / (6 * 448) over `weights`, an fp32 scalar tensor (1 when all are zero).

    g is the fp32 value nearest to amax / 2688 (itself, in about 70% of cases) that is *stable*: stored as
    compressed-tensors' encode scale 1 / g and read back as 1 / (1 / g) it is g again, and the dequantized
    tensor, whose amax is 6 * (448 * g) in fp32, gives g again. Without it, quantizing the dequantized weights
    (a loaded export saved again, a baked child's forward) would move g by an ulp and with it every value.
    Within 2^-19 of amax / 2688 (16 ulps; in practice 0 to 2), so the largest block's scale may saturate at
    448 a hair early, which costs its largest value nothing (it still maps to code 6).

    Several weights: one scale shared by tensors a server fuses into one matmul (vLLM's qkv_proj of q/k/v
    takes a single global scale for the fused layer, the largest; shards quantized with their own would
    dequantize wrongly there), so pass them all and hand the result to `quantize_nvfp4(..., global_scale=)`.
    """
    if not weights:
        raise QuantError("nvfp4_global_scale needs at least one weight")
    amax = torch.stack([w.detach().float().abs().amax() for w in weights]).amax()
    if not bool(amax > 0):
        return torch.ones((), dtype=torch.float32, device=amax.device)
    g = amax / (FP4_MAX * FP8_MAX)
    up, down = g, g
    for _ in range(_STABLE_SEARCH_ULPS + 1):  # nearest first: g, then one ulp up and down, two, ...
        for candidate in (up, down):
            if _stable(candidate):
                return candidate
        up = torch.nextafter(up, torch.tensor(float("inf"), device=g.device))
        down = torch.nextafter(down, torch.tensor(0.0, device=g.device))
    # Only for amax near fp32's limits (g subnormal or 1 / g overflowing): no stable g, keep the nearest.
    return g


def quantize_nvfp4(
    w: torch.Tensor, name: str = "weight", global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`w` [out, in] -> (packed uint8 [out, in/2], E4M3 block scales [out, in/16], fp32 decode global scale []).

    See the module docstring for the exact arithmetic; the global scale returned is NVIDIA's decode scale
    g ~ amax / 2688 (`nvfp4_global_scale`; compressed-tensors stores 1 / g, ModelOpt stores g). `global_scale`:
    a g shared with other tensors (`nvfp4_global_scale(*weights)`), which must cover this one's amax; default:
    `w`'s own. Quantizing the dequantized result again gives the same three tensors bit for bit, with a g
    from `nvfp4_global_scale` (one from elsewhere quantizes as given, but may not survive 1 / (1 / g)).
    """
    _check_weight(w, name)
    out_features, in_features = w.shape
    if in_features % NVFP4_BLOCK:
        raise QuantError(
            f"{name}: nvfp4 needs in_features to be a multiple of {NVFP4_BLOCK} (one E4M3 scale per block of "
            f"{NVFP4_BLOCK} along the input dimension; vLLM allocates in_features // {NVFP4_BLOCK} scales), "
            f"got shape {tuple(w.shape)}"
        )
    w32 = w.detach().float()
    if global_scale is None:
        g = nvfp4_global_scale(w32)
    else:
        g = global_scale.detach().to(torch.float32).reshape(())
        # g is amax / 2688 moved by up to 16 ulps to a stable one: g * 2688 may fall that short of the amax
        if not bool(g > 0) or bool(w32.abs().amax() > g * (FP4_MAX * FP8_MAX) * (1 + 2**-18)):
            raise QuantError(
                f"{name}: shared nvfp4 global scale {g.item():.6g} does not cover the weight's largest magnitude "
                f"{w32.abs().amax().item():.6g} (it must be at least amax / {FP4_MAX * FP8_MAX:g})"
            )
    blocks = w32.reshape(out_features, in_features // NVFP4_BLOCK, NVFP4_BLOCK)
    block_scale = _block_scales(blocks, g)
    codes = _block_codes(blocks, block_scale, g)
    # A block whose scale is an E4M3 subnormal (its amax below 2^-6 * 6 * g, 3.5e-5 of the tensor's amax) can
    # dequantize to values that the rule above quantizes again with another scale: such blocks are written in
    # one canonical (scale, codes) pair, so that quantizing the dequantized tensor gives the same bytes.
    small = block_scale.float() < E4M3_MIN_NORMAL
    if bool(small.any()):
        scale, codes[small] = _canonical_small_blocks(
            blocks[small], block_scale[small], codes[small], g, w.dtype
        )
        block_scale.view(torch.uint8)[small] = scale.view(torch.uint8)  # no masked writes into float8 on CPU
    return pack_e2m1(codes.reshape(out_features, in_features)), block_scale, g


def _block_scales(blocks: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """E4M3 scales [..., n] of fp32 `blocks` [..., n, 16]: e4m3((amax_b / 6) / g), saturating at 448."""
    block_amax = blocks.abs().amax(dim=-1)
    return ((block_amax / FP4_MAX) / g).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)


def _block_codes(blocks: torch.Tensor, block_scale: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., n, 16] of `blocks` at the decode steps block_scale * g; 0 in a block of step 0 (its
    values are 0 whatever the codes, and +0 is the one code the zeros it dequantizes to quantize back to)."""
    step = (block_scale.float() * g).unsqueeze(-1)
    codes = _e2m1_codes(blocks / torch.where(step > 0, step, torch.ones_like(step)))
    return torch.where(step > 0, codes, torch.zeros_like(codes))


def _block_values(codes: torch.Tensor, block_scale: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 `codes` [..., n, 16] with E4M3 `block_scale` [..., n], as `dequantize_nvfp4` computes them."""
    return _e2m1_decode(codes) * (block_scale.float() * g).unsqueeze(-1)


# E4M3's smallest normal (2^-6) and its 7 subnormals k * 2^-9: below 2^-6, the scales a block can take.
E4M3_MIN_NORMAL = 2.0**-6
_E4M3_SUBNORMALS: tuple[float, ...] = tuple(k * 2.0**-9 for k in range(1, 8))


def _canonical_small_blocks(
    blocks: torch.Tensor,
    block_scale: torch.Tensor,
    codes: torch.Tensor,
    g: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales [n], codes [n, 16]) for `blocks` [n, 16] whose rounded scale `block_scale` is below 2^-6, such
    that quantizing their dequantized values gives these bytes again.

    Why: E4M3 subnormals are 2^-9 apart, so rounding amax_b / (6 g) to one can leave the block's largest
    value at code 3 or 4 instead of 6 (scale 1 * 2^-9 for amax_b / (6 g) = 0.55 * 2^-9, 2 * 2^-9 for 1.6 *
    2^-9), and the dequantized block, whose amax is then 3 or 4 steps, rounds to a smaller scale (0.5 -> 0,
    1.33 -> 1 in units of 2^-9), on which its values are 25% off or lost. Normal scales cannot: rounding is within 2^-4, the largest value
    lands on code 6, and the dequantized amax gives back the same scale.

    The rule, for each block: its target values are the block itself when some subnormal scale represents it
    exactly (the dequantized block, requantized), else the block quantized as usual (scale `block_scale`:
    these are the values written, as compressed-tensors' own quantizer writes them). The target is stored
    with the usual rounded scale of its own amax if that represents it exactly, else with the largest
    subnormal scale that does (one always does: the scale it was quantized with); an all-zero target with
    scale 0. The rule reads only the target, and the target of a dequantized block is itself: idempotent.

    `dtype`: the weight's. Values are compared as that dtype holds them (the target rounded to it, each
    candidate's values too): a bf16 weight's fake-quantized values are the dequantized ones rounded to bf16,
    and those must find the same target, scale and codes again. For fp32 the rounding is the identity.
    """
    count = len(_E4M3_SUBNORMALS)
    candidates = torch.tensor(_E4M3_SUBNORMALS, dtype=torch.float32, device=blocks.device).to(
        torch.float8_e4m3fn
    )

    def held(values: torch.Tensor) -> torch.Tensor:
        return values.to(dtype).float()

    def on_candidates(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes of `values` [m, 16] at each candidate scale [m, 7, 16], and whether they give them back [m, 7]."""
        each = candidates.expand(values.shape[0], -1)
        at = _block_codes(values.unsqueeze(1).expand(-1, count, -1), each, g)
        return at, (held(_block_values(at, each, g)) == values.unsqueeze(1)).all(dim=-1)

    # A block on a candidate's grid has for amax one of the 7 x 7 values code * step (as `dtype` holds them):
    # only those get the full check (7 quantizations each, some 20x the cost of the rule; most blocks of a
    # tensor with a large outlier are small ones, and almost none of a weight's lie on a grid).
    magnitudes = torch.tensor(E2M1_VALUES[1:], dtype=torch.float32, device=blocks.device)
    reachable = held(magnitudes.unsqueeze(1) * (candidates.float() * g).unsqueeze(0)).reshape(-1)
    amax = blocks.abs().amax(dim=-1)
    maybe = (amax.unsqueeze(-1) == reachable).any(dim=-1)
    on_grid = torch.zeros_like(maybe)
    if bool(maybe.any()):
        on_grid[maybe] = on_candidates(blocks[maybe])[1].any(dim=-1)
    target = held(torch.where(on_grid.unsqueeze(-1), blocks, _block_values(codes, block_scale, g)))
    # The usual rounded scale of the target's own amax, if it represents the target (an all-zero one included:
    # scale 0, codes 0); else the largest candidate that does.
    scale = _block_scales(target, g)
    out_codes = _block_codes(target, scale, g)
    other = (held(_block_values(out_codes, scale, g)) != target).any(dim=-1)
    if bool(other.any()):
        at, exact = on_candidates(target[other])
        if not bool(exact.any(dim=-1).all()):  # the target was quantized with one of them: cannot happen
            raise AssertionError("nvfp4: a small block's target lies on no subnormal scale's grid")
        largest = (torch.arange(1, count + 1, device=blocks.device) * exact).argmax(dim=-1)  # the last True
        scale.view(torch.uint8)[other] = candidates.view(torch.uint8)[largest]
        out_codes[other] = at[torch.arange(len(largest), device=blocks.device), largest]
    return scale, out_codes


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Packed E2M1 [out, in/2] times E4M3 block scales [out, in/16] times the decode global scale, in fp32, as `dtype`."""
    values = _e2m1_decode(unpack_e2m1(packed))
    out_features, in_features = values.shape
    step = block_scale.float() * global_scale.float()
    blocks = values.reshape(out_features, in_features // NVFP4_BLOCK, NVFP4_BLOCK) * step.unsqueeze(-1)
    return blocks.reshape(out_features, in_features).to(dtype)


# ---------------------------------------------------------------------------------- fake quantization


def quantize_dequantize(
    w: torch.Tensor, fmt: str, name: str = "weight", global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """`w` through format `fmt` and back, in `w`'s dtype, without gradient (the values a server multiplies by).

    `global_scale`: nvfp4 only, a decode global scale shared with the tensors fused with `w` (see
    `nvfp4_global_scale`); ignored by the other formats, whose scales are per row.
    """
    if fmt == "bf16":
        return w.detach().to(torch.bfloat16).to(w.dtype)
    if fmt == "fp8":
        return dequantize_fp8(*quantize_fp8(w, name), dtype=w.dtype)
    if fmt == "nvfp4":
        return dequantize_nvfp4(*quantize_nvfp4(w, name, global_scale), dtype=w.dtype)
    raise QuantError(f"{name}: unknown weight format {fmt!r}; choose one of {list(WEIGHT_FORMATS)}")


class _StraightThrough(torch.autograd.Function):
    """Forward: the fake-quantized weight; backward: the incoming gradient unchanged (straight-through)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, fmt: str, name: str, global_scale: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        return quantize_dequantize(w, fmt, name, global_scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return grad, None, None, None


def fake_quantize(
    w: torch.Tensor, fmt: str, name: str = "weight", global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize then dequantize `w` [out, in] in format `fmt` ("bf16", "fp8", "nvfp4"), in `w`'s dtype.

    Differentiable with a straight-through gradient (forward quantized, backward identity), so QAT can
    call it on a trainable weight in the forward pass. "bf16" rounds to bf16 (identity on a bf16 weight).
    `global_scale`: nvfp4's shared decode global scale for tensors served fused (q/k/v: see
    `puzzle.quant_blocks`); None: the tensor's own.
    """
    if fmt not in WEIGHT_FORMATS:
        raise QuantError(f"{name}: unknown weight format {fmt!r}; choose one of {list(WEIGHT_FORMATS)}")
    return _StraightThrough.apply(w, fmt, name, global_scale)
