"""puzzle.quant: fp8 (E4M3 per output channel) and NVFP4 against element-by-element oracles, error bounds,
edge cases and the straight-through gradient; compressed-tensors' own packing and dequantization as a
second oracle where it is installed (the dev extra installs it)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from puzzle.quant import (
    E2M1_VALUES,
    FP8_MAX,
    NVFP4_BLOCK,
    WEIGHT_FORMATS,
    QuantError,
    dequantize_fp8,
    dequantize_nvfp4,
    fake_quantize,
    nvfp4_global_scale,
    quantize_fp8,
    quantize_nvfp4,
    unpack_e2m1,
)

f32 = np.float32


# ------------------------------------------------------------------------- element-by-element oracles

# Every finite E4M3 value with its code, decoded by the dtype itself (the bit layout is torch's, not ours).
_E4M3 = [
    (code, float(value))
    for code, value in enumerate(
        torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    )
    if math.isfinite(value)
]


def _nearest_even(x: float, table: list[tuple[int, float]]) -> tuple[int, float]:
    """The (code, value) of `table` nearest to x; at a tie the even code (mantissa bit 0) wins."""
    best = min(abs(value - x) for _, value in table)
    ties = [(code, value) for code, value in table if abs(value - x) == best]
    even = [t for t in ties if t[0] % 2 == 0]
    return (even or ties)[0]


def _e4m3_round(x: float) -> float:
    x = max(-FP8_MAX, min(FP8_MAX, x))  # saturate
    return _nearest_even(x, [(c, v) for c, v in _E4M3 if (v < 0) == (x < 0) or v == 0])[1]


def _e2m1_round(x: float) -> tuple[int, float]:
    code, value = _nearest_even(abs(x), list(enumerate(E2M1_VALUES)))
    negative = math.copysign(1.0, x) < 0
    return (code | (8 if negative else 0)), (-value if negative else value)


def _e2m1_value(code: int) -> float:
    return -E2M1_VALUES[code & 7] if code & 8 else E2M1_VALUES[code & 7]


def _oracle_fp8(w: torch.Tensor) -> tuple[list[list[float]], list[float]]:
    rows = w.float().tolist()
    values, scales = [], []
    for row in rows:
        amax = max(abs(f32(v)) for v in row)
        scale = f32(amax) / f32(FP8_MAX) if amax > 0 else f32(1.0)
        scales.append(float(scale))
        values.append([_e4m3_round(float(f32(v) / scale)) for v in row])
    return values, scales


def _stable_g(amax: float) -> float:
    """The decode global scale of a tensor of largest magnitude `amax`: the fp32 value nearest amax / 2688
    (the closer ulp first, up before down at a tie) that 1 / (1 / g) gives back and whose dequantized amax,
    6 * (448 * g), gives back as its own amax / 2688."""
    if amax == 0:
        return 1.0
    g0 = f32(amax) / f32(6 * 448)

    def stable(g):
        return f32(1) / (f32(1) / g) == g and (f32(448) * g) * f32(6) / f32(6 * 448) == g

    up = down = g0
    for _ in range(17):
        for candidate in (up, down):
            if stable(candidate):
                return float(candidate)
        up, down = np.nextafter(up, f32(np.inf)), np.nextafter(down, f32(0))
    raise AssertionError(f"no stable global scale within 16 ulps of {amax} / 2688")


def _oracle_nvfp4(
    w: torch.Tensor, g: float | None = None
) -> tuple[list[list[int]], list[list[float]], float, list[list[float]]]:
    """(codes, block scales, global scale, dequantized values) by the plain rule, element by element: what
    compressed-tensors' quantizer computes. `quantize_nvfp4` writes its values, and its bytes except where a
    block with a subnormal scale is written in its canonical (scale, codes) pair."""
    rows = w.float().tolist()
    amax = max(abs(f32(v)) for row in rows for v in row)
    g = f32(_stable_g(float(amax)) if g is None else g)
    codes, scales, deq = [], [], []
    for row in rows:
        row_codes, row_scales, row_deq = [], [], []
        for start in range(0, len(row), NVFP4_BLOCK):
            block = [f32(v) for v in row[start : start + NVFP4_BLOCK]]
            s = f32(_e4m3_round(float((f32(max(abs(v) for v in block)) / f32(6)) / g)))
            step = f32(s) * g
            row_scales.append(float(s))
            for v in block:
                code, value = _e2m1_round(float(v / step) if step > 0 else 0.0)
                row_codes.append(code)
                row_deq.append(float(f32(value) * step))
        codes.append(row_codes)
        scales.append(row_scales)
        deq.append(row_deq)
    return codes, scales, float(g), deq


def _weight(out_features: int, in_features: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Random weights with rows and blocks of very different magnitudes, exact ties and a few zeros."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    w *= torch.logspace(-3, 1, out_features).unsqueeze(1)  # rows over four decades
    w[:, : in_features // 4] *= 0.01  # small blocks beside large ones
    w[0, :3] = 0.0
    return w.to(dtype)


# ------------------------------------------------------------------------------------------- fp8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_bit_exact_against_elementwise(dtype):
    w = _weight(6, 40, dtype=dtype)
    values, scale = quantize_fp8(w)
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (6, 1)
    ref_values, ref_scales = _oracle_fp8(w)
    assert values.float().tolist() == ref_values
    assert scale.squeeze(1).tolist() == ref_scales
    expected = [[float(f32(v) * f32(s)) for v in row] for row, s in zip(ref_values, ref_scales)]
    assert dequantize_fp8(values, scale).tolist() == expected


def test_fp8_ties_round_to_even():
    # Row amax 448 -> scale 1, so the values are quantized as given: 1.0625 lies midway between 1 and 1.125
    # (E4M3 step 1/8 in [1, 2)); the even code is 1.0. 1.1875 lies between 1.125 and 1.25 -> 1.25.
    w = torch.tensor([[448.0, 1.0625, 1.1875, -1.0625]])
    values, scale = quantize_fp8(w)
    assert scale.item() == 1.0
    assert values.float().tolist() == [[448.0, 1.0, 1.25, -1.0]]


def test_fp8_round_trip_within_bounds():
    w = _weight(32, 64, seed=1)
    values, scale = quantize_fp8(w)
    x = w / scale  # in units of the row scale, |x| <= 448
    err = (dequantize_fp8(values, scale) - w).abs() / scale
    normal = x.abs() >= 2.0**-6  # E4M3's smallest normal
    # 3 mantissa bits: half an ulp is 2^-4 of the value for normals, 2^-10 absolute for subnormals.
    assert bool((err[normal] <= 2.0**-4 * x.abs()[normal] * (1 + 1e-6)).all())
    assert bool((err[~normal] <= 2.0**-10 + 1e-12).all())
    assert (values.float().abs().amax(dim=1) == FP8_MAX).all()  # each row's amax maps to 448 exactly


def test_fp8_zero_row():
    w = _weight(3, 16)
    w[1] = 0.0
    values, scale = quantize_fp8(w)
    assert scale[1].item() == 1.0 and (values[1].float() == 0).all()
    assert (dequantize_fp8(values, scale)[1] == 0).all()


# ----------------------------------------------------------------------------------------- nvfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_bit_exact_against_elementwise(dtype):
    w = _weight(5, 48, dtype=dtype)
    packed, block_scale, g = quantize_nvfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 24)
    assert block_scale.dtype == torch.float8_e4m3fn and block_scale.shape == (5, 3)
    assert g.dtype == torch.float32 and g.dim() == 0
    codes, scales, ref_g, deq = _oracle_nvfp4(w)
    assert g.item() == ref_g
    assert block_scale.float().tolist() == scales
    assert unpack_e2m1(packed).tolist() == codes
    # Packing: element 2k in the low nibble, 2k+1 in the high one (compressed-tensors / ModelOpt order).
    assert packed.tolist() == [[row[2 * k] | (row[2 * k + 1] << 4) for k in range(24)] for row in codes]
    assert dequantize_nvfp4(packed, block_scale, g).tolist() == deq


def test_nvfp4_e2m1_ties_round_to_even():
    # One block, amax 6 * 448 * g... choose w so that g * s_b == 1: amax 6 gives g = 6/2688, s_b = 448.
    w = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 0.3, 4.9, 0, 0, 0, 0]])
    packed, block_scale, g = quantize_nvfp4(w)
    assert block_scale.float().item() == 448.0
    got = dequantize_nvfp4(packed, block_scale, g)[0].tolist()
    assert got[:12] == pytest.approx([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, 0.5, 4.0], rel=1e-6)


def test_nvfp4_round_trip_within_bounds():
    w = _weight(
        16, 128, seed=2
    )  # rows over four decades: some block scales are E4M3 subnormals, some underflow
    packed, block_scale, g = quantize_nvfp4(w)
    step = (block_scale.float() * g).repeat_interleave(NVFP4_BLOCK, dim=1)  # each value's block decode scale
    err = (dequantize_nvfp4(packed, block_scale, g) - w).abs()
    normal = (block_scale.float() >= 2.0**-6).repeat_interleave(
        NVFP4_BLOCK, dim=1
    )  # E4M3-normal block scales
    assert normal.any() and not normal.all()
    # Normal block scale: half the largest E2M1 spacing (4 -> 6) is 1 step; values up to 4 steps see spacing
    # <= 1, so half a step. The block scale rounded down by up to 2^-4 puts amax_b at <= 6.375 steps,
    # saturated to 6: still < 1 step.
    assert bool((err[normal] <= step[normal] * (1 + 1e-6)).all())
    small = normal & ((w.abs() / step) <= 4.0)
    assert bool((err[small] <= 0.5 * step[small] * (1 + 1e-6)).all())
    block_amax = w.abs().reshape(16, -1, NVFP4_BLOCK).amax(-1).repeat_interleave(NVFP4_BLOCK, dim=1)
    assert bool((err[normal] <= block_amax[normal] / 6 * (1 + 2.0**-4) * (1 + 1e-6)).all())
    # Subnormal or underflowed block scale (a block 2^6 to 2^10 times below the tensor's amax / 448): the
    # scale's absolute rounding, 2^-10 of g, adds up to 6 * g * 2^-10 of saturation error.
    assert bool((err <= step + 6 * g * 2.0**-10 * (1 + 1e-6)).all())


def test_nvfp4_zero_block_row_and_tensor():
    w = _weight(3, 32)
    w[1] = 0.0
    w[2, 16:] = 0.0
    packed, block_scale, g = quantize_nvfp4(w)
    assert block_scale[1].float().tolist() == [0.0, 0.0] and block_scale[2, 1].float().item() == 0.0
    dq = dequantize_nvfp4(packed, block_scale, g)
    assert (dq[1] == 0).all() and (dq[2, 16:] == 0).all()
    zeros = torch.zeros(2, 16)
    packed, block_scale, g = quantize_nvfp4(zeros)
    assert g.item() == 1.0 and (dequantize_nvfp4(packed, block_scale, g) == 0).all()


def test_nvfp4_shared_global_scale():
    """Tensors served fused (q/k/v) share one global scale, the largest amax's: bit-exact with it given."""
    q, k = _weight(4, 32, seed=5), 3.0 * _weight(2, 32, seed=6)
    g = nvfp4_global_scale(q, k)
    assert g.item() == _stable_g(max(q.abs().max().item(), k.abs().max().item()))
    packed, block_scale, got_g = quantize_nvfp4(q, global_scale=g)
    codes, scales, _, deq = _oracle_nvfp4(q, g.item())
    assert got_g.item() == g.item()
    assert unpack_e2m1(packed).tolist() == codes and block_scale.float().tolist() == scales
    assert dequantize_nvfp4(packed, block_scale, g).tolist() == deq
    own = quantize_nvfp4(q)
    assert not torch.equal(own[1].float(), block_scale.float())  # a different scale than q's own
    assert torch.equal(fake_quantize(q, "nvfp4", global_scale=g), dequantize_nvfp4(packed, block_scale, g))
    with pytest.raises(QuantError, match=r"k_proj\.weight: shared nvfp4 global scale .* does not cover"):
        quantize_nvfp4(k, name="k_proj.weight", global_scale=nvfp4_global_scale(q))


def _with_outliers(shape: tuple[int, int], ratio: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """N(0, 0.02) weights with 1 to 3 outliers of `ratio` times the typical value 0.02, either sign: at 1e4
    and above most blocks' scales are E4M3 subnormals (amax_b / amax below 3.5e-5), at 1e6 many underflow."""
    gen = torch.Generator().manual_seed(seed)
    w = 0.02 * torch.randn(shape, generator=gen)
    where = torch.randperm(w.numel(), generator=gen)[: 1 + seed % 3]
    w.view(-1)[where] = 0.02 * ratio * torch.randint(0, 2, (len(where),), generator=gen).float().mul(2).sub(1)
    return w.to(dtype)


def _same_bytes(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    """Whether two `quantize_nvfp4` results are bit for bit the same: packed values, block scales, global scale."""
    return (
        torch.equal(a[0], b[0])
        and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
        and torch.equal(a[2].view(torch.int32), b[2].view(torch.int32))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 16), (16, 64), (48, 128)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_repeats_itself_exactly_with_outliers(seed, shape, dtype):
    """Issue 35 §2: for outliers from 1 to 1e6 times the typical value, quantizing the fake-quantized weight
    gives the same bytes (packed values, block scales, global scale), fake quantization is idempotent, the
    global scale survives compressed-tensors' encode scale 1 / g, and the values are the plain rule's (the
    element-by-element oracle, compressed-tensors' quantizer) as the weight's dtype holds them."""
    for ratio in 10.0 ** np.arange(7):
        w = _with_outliers(shape, float(ratio), seed, dtype)
        first = quantize_nvfp4(w)
        once = fake_quantize(w, "nvfp4")
        assert torch.equal(once, dequantize_nvfp4(*first, dtype=dtype))
        assert _same_bytes(quantize_nvfp4(once), first), ratio
        assert torch.equal(fake_quantize(once, "nvfp4"), once), ratio
        g = first[2]
        assert (1.0 / (1.0 / g)).item() == g.item()  # as stored (1 / g) and read back (1 / stored)
        deq = _oracle_nvfp4(w, g.item())[3]
        assert torch.equal(once, torch.tensor(deq).to(dtype)), ratio


def test_the_plain_nvfp4_rule_does_not_repeat_itself_on_subnormal_block_scales():
    """The check above has teeth: by the plain rule (the oracle), the dequantized weight of issue 35's repro
    (one value 1e5 among N(0, 0.3)) quantizes again to other values, up to 25% off, where ours gives its
    bytes back; every block whose bytes differ from the plain rule's has a subnormal scale."""
    w = 0.3 * torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    w[3, 5] = 1e5
    _, scales, g, deq = _oracle_nvfp4(w)
    again = _oracle_nvfp4(torch.tensor(deq), g)[3]
    moved = [(a, b) for row_a, row_b in zip(deq, again) for a, b in zip(row_a, row_b) if a != b]
    assert len(moved) > 10 and max(abs(b - a) / abs(a) for a, b in moved if a) > 0.249
    first = quantize_nvfp4(w)
    assert _same_bytes(quantize_nvfp4(dequantize_nvfp4(*first)), first)
    assert dequantize_nvfp4(*first).tolist() == deq  # the same values as the plain rule's first pass
    differ = first[1].float() != torch.tensor(scales)
    assert bool((torch.tensor(scales)[differ] < 2.0**-6).all())


def test_nvfp4_a_small_block_on_a_subnormal_grid_is_kept_as_it_is():
    """A block that some subnormal scale represents exactly, but not the scale its amax rounds to, is written on
    the first (values unchanged), where the plain rule loses 25% of its largest value; the all-zero block gets
    scale 0 and codes 0 (as does a block whose scale underflows, whatever its codes would be)."""
    g = nvfp4_global_scale(torch.tensor([[1.0]]))
    step = float(f32(2 * 2.0**-9) * f32(g.item()))  # the decode step of E4M3 subnormal 2 * 2^-9
    on_grid = [
        4.0,
        -0.5,
        1.5,
        0.0,
        3.0,
        -2.0,
        1.0,
        0.5,
    ] * 2  # codes: amax 8 * 2^-9 g rounds to scale 1 * 2^-9
    w = torch.zeros(2, 32)
    w[0, 0] = 1.0  # the tensor's amax: g
    w[1, :16] = torch.tensor([float(f32(c) * f32(step)) for c in on_grid])
    w[0, 16] = 1e-7  # scale (1e-7 / 6) / g underflows to 0
    packed, block_scale, got_g = quantize_nvfp4(w)
    assert got_g.item() == g.item()
    assert torch.equal(dequantize_nvfp4(packed, block_scale, g)[1, :16], w[1, :16])
    assert block_scale[1, 0].float().item() == 2 * 2.0**-9
    assert block_scale[0, 1].float().item() == 0.0 and (unpack_e2m1(packed)[0, 16:] == 0).all()
    assert (unpack_e2m1(packed)[1, 16:] == 0).all() and block_scale[1, 1].float().item() == 0.0
    _, scales, _, plain = _oracle_nvfp4(w, g.item())
    assert scales[1][0] == 2.0**-9 and plain[1][0] == pytest.approx(
        0.75 * w[1, 0].item(), rel=1e-6
    )  # 6 of scale 1
    assert _same_bytes(quantize_nvfp4(dequantize_nvfp4(packed, block_scale, g)), (packed, block_scale, g))


def test_nvfp4_global_scale_is_stable_and_near_amax_over_2688():
    """Over amaxes from 1e-12 to 1e12: the global scale is the oracle's, within 16 ulps of amax / 2688 (0 for
    most), and the weight quantized with it dequantizes to an amax that gives it back."""
    gen = torch.Generator().manual_seed(7)
    amaxes = torch.exp(torch.empty(2000).uniform_(-27.6, 27.6, generator=gen))
    moved = 0
    for amax in amaxes:
        w = torch.tensor([[float(amax)] + [0.0] * 15])
        g = nvfp4_global_scale(w)
        assert g.item() == _stable_g(float(f32(amax.item())))
        ulps = abs(int(g.view(torch.int32)) - int((amax / 2688.0).view(torch.int32)))
        assert ulps <= 16
        moved += ulps > 0
        assert nvfp4_global_scale(dequantize_nvfp4(*quantize_nvfp4(w))).item() == g.item()
    assert 0 < moved < len(amaxes) // 2


def test_nvfp4_shared_global_scale_repeats_itself():
    """q/k/v quantized with their shared global scale: the fake-quantized group gives the same shared scale
    and each member the same bytes, with the outlier in any one of them."""
    for where in range(3):
        group = [_with_outliers((16, 32), 1.0, seed, torch.float32) for seed in range(3)]
        group[where][2, 7] = 1e4
        g = nvfp4_global_scale(*group)
        once = [fake_quantize(w, "nvfp4", global_scale=g) for w in group]
        assert nvfp4_global_scale(*once).item() == g.item()
        for w, q in zip(group, once):
            assert _same_bytes(quantize_nvfp4(q, global_scale=g), quantize_nvfp4(w, global_scale=g))


def test_nvfp4_refuses_partial_block():
    with pytest.raises(
        QuantError, match=r"layers\.3\.mixer\.in_proj\.weight: nvfp4 needs in_features .* multiple of 16"
    ):
        quantize_nvfp4(torch.randn(4, 24), name="layers.3.mixer.in_proj.weight")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_refused_naming_the_tensor(fmt, bad):
    w = torch.randn(4, 32)
    w[2, 5] = bad
    with pytest.raises(QuantError, match=r"experts\.0\.up_proj\.weight: 1 non-finite value"):
        fake_quantize(w, fmt, name="experts.0.up_proj.weight")


def test_unknown_format_and_shape_refused():
    with pytest.raises(QuantError, match="unknown weight format 'int4'"):
        fake_quantize(torch.randn(2, 16), "int4")
    with pytest.raises(QuantError, match=r"norm\.weight: expected a 2-D"):
        fake_quantize(torch.randn(16), "fp8", name="norm.weight")


# ------------------------------------------------------------------------------ fake quantization


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_values_dtype_and_straight_through_gradient(fmt, dtype):
    w = _weight(8, 32, dtype=dtype).requires_grad_(True)
    y = fake_quantize(w, fmt)
    assert y.dtype == dtype and y.shape == w.shape
    if fmt == "bf16":
        assert torch.equal(y.detach(), w.detach().to(torch.bfloat16).to(dtype))
    elif fmt == "fp8":
        assert torch.equal(y.detach(), dequantize_fp8(*quantize_fp8(w), dtype=dtype))
    else:
        assert torch.equal(y.detach(), dequantize_nvfp4(*quantize_nvfp4(w), dtype=dtype))
    if fmt != "bf16" or dtype != torch.bfloat16:
        assert not torch.equal(y.detach(), w.detach())  # it did quantize
    upstream = torch.randn(w.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    (y * upstream).sum().backward()
    assert torch.equal(w.grad, upstream)  # straight-through: backward is the identity


def test_fake_quantize_is_idempotent():
    w = _weight(8, 32)
    for fmt in WEIGHT_FORMATS:
        once = fake_quantize(w, fmt)
        assert torch.equal(fake_quantize(once, fmt), once), fmt


# ------------------------------------------------------------------ compressed-tensors as a second oracle


def test_nvfp4_matches_compressed_tensors_unpack_and_dequantize():
    """Our packed bytes and scales, read by compressed-tensors' own unpack and dequantize (which divides by
    its stored encode scale 1/g), give our dequantized weight."""
    helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    w = _weight(6, 64, seed=4)
    packed, block_scale, g = quantize_nvfp4(w)
    values = helpers.unpack_fp4_from_uint8(packed, 6, 64, dtype=torch.float32)
    codes = _oracle_nvfp4(w)[0]
    assert values.tolist() == [[_e2m1_value(c) for c in row] for row in codes]
    ct_global = 1.0 / g  # compressed-tensors' weight_global_scale
    step = block_scale.float() / ct_global
    ct_dq = (values.reshape(6, 4, 16) * step.unsqueeze(-1)).reshape(6, 64)
    torch.testing.assert_close(ct_dq, dequantize_nvfp4(packed, block_scale, g), rtol=1e-6, atol=0)
    assert torch.equal(helpers.pack_fp4_to_uint8(values), packed)


# ------------------------------------------------------------------------------------ built mixers


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_fake_quantize_mixer_and_bank_quantize_each_served_tensor(fmt):
    """In place on a built MoE mixer: every covered weight (experts in the hub layout, shared experts, latent
    projections) becomes its fake-quantized value, the router and norms are untouched; the differentiable
    bank version gives the same values with an identity gradient."""
    from puzzle.blocks.registry import build_block
    from puzzle.quant_blocks import fake_quantize_bank, fake_quantize_mixer_, quantized_weights
    from puzzle.spec import MoESpec

    spec = MoESpec(num_experts=3, top_k=2, expert_width=(16, 32, 16), shared_width=32, latent_size=16)
    torch.manual_seed(0)
    mixer = build_block(spec, 32)
    before = {k: v.detach().clone() for k, v in mixer.state_dict().items()}
    bank = mixer.experts
    up = bank.up.detach().clone().requires_grad_(True)
    down = bank.down.detach().clone().requires_grad_(True)
    up_q, down_q = fake_quantize_bank(up, down, bank.offsets, fmt)
    fake_quantize_mixer_(mixer, spec, 32, fmt)
    after = mixer.state_dict()
    assert torch.equal(after["experts.up"], up_q.detach()) and torch.equal(
        after["experts.down"], down_q.detach()
    )
    w1 = before["experts.down"][16:48].T  # expert 1's down_proj [D, w_1], as served
    assert torch.equal(after["experts.down"][16:48].T, fake_quantize(w1, fmt))
    assert torch.equal(after["fc1_latent_proj.weight"], fake_quantize(before["fc1_latent_proj.weight"], fmt))
    for key in ("gate.weight", "gate.e_score_correction_bias"):
        assert torch.equal(after[key], before[key]), key
    assert "gate.weight" not in quantized_weights(spec, 32)
    (up_q.sum() + 2 * down_q.sum()).backward()
    assert torch.equal(up.grad, torch.ones_like(up)) and torch.equal(down.grad, torch.full_like(down, 2.0))
