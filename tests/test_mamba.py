"""The Mamba-2 mixer and its SSD scan against transformers' NemotronHMamba2Mixer and the plain recurrence."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from transformers import NemotronHConfig
from transformers.cache_utils import DynamicCache
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
from transformers.utils import logging as hf_logging

from puzzle.blocks import mamba as mamba_module
from puzzle.blocks import ssd
from puzzle.blocks.mamba import MambaCache, MambaMixer
from puzzle.spec import MambaSpec

# transformers' "falling back to the PyTorch implementation" notices are expected on the CPU.
hf_logging.set_verbosity_error()

HIDDEN = 48
TOL = dict(atol=1e-5, rtol=1e-5)


def make_pair(
    n_groups: int = 2,
    num_heads: int = 4,
    head_dim: int = 8,
    state_size: int = 16,
    chunk_size: int = 16,
    clamp_active: bool = True,
    conv_bias: bool = True,
    proj_bias: bool = False,
    seed: int = 0,
) -> tuple[NemotronHMamba2Mixer, MambaMixer]:
    """transformers' mixer and ours with the same random weights (none at its init value).

    With `clamp_active`, time_step_min is 0.01 and two heads get a dt_bias so negative that the clamp decides
    their dt. transformers' decode path does not clamp (its chunked path does), so tests comparing its decode
    use False: time_step_min 1e-9, never reached.
    """
    config = NemotronHConfig(
        hidden_size=HIDDEN,
        layers_block_type=["mamba"],
        mamba_num_heads=num_heads,
        mamba_head_dim=head_dim,
        ssm_state_size=state_size,
        n_groups=n_groups,
        chunk_size=chunk_size,
        time_step_min=0.01 if clamp_active else 1e-9,
        layer_norm_epsilon=1e-5,
        use_conv_bias=conv_bias,
        use_bias=proj_bias,
    )
    theirs = NemotronHMamba2Mixer(config, layer_idx=0).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name == "A_log":
                param.copy_(noise * 0.5)
            elif name == "dt_bias":
                param.copy_(noise - 1.0)
                if clamp_active:
                    param[:2] = -12.0
            elif name in ("D", "norm.weight"):
                param.copy_(1.0 + 0.3 * noise)
            else:  # in_proj, conv1d, out_proj
                param.copy_(noise * 0.2)
    spec = MambaSpec(
        num_heads=num_heads,
        head_dim=head_dim,
        state_size=state_size,
        n_groups=n_groups,
        chunk_size=chunk_size,
        dt_clamp_min=config.time_step_min,
        conv_bias=conv_bias,
        proj_bias=proj_bias,
    )
    ours = MambaMixer(spec, HIDDEN, norm_eps=config.layer_norm_epsilon)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def inputs(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, length, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n_groups", [1, 2])
@pytest.mark.parametrize("length", [1, 5, 16, 37, 50])
def test_forward_matches_transformers(n_groups: int, length: int) -> None:
    theirs, ours = make_pair(n_groups=n_groups)
    x = inputs(2, length)
    with torch.no_grad():
        expected = theirs(x)
        got = ours(x)
    assert expected.abs().max() > 0.1  # a real signal, not a vanishing one
    torch.testing.assert_close(got, expected, **TOL)


def test_forward_matches_transformers_other_shapes() -> None:
    """More heads per group (r = 4), a state size that is not a power of two, chunk 8, biases flipped."""
    theirs, ours = make_pair(
        n_groups=2, num_heads=8, head_dim=4, state_size=12, chunk_size=8, conv_bias=False, proj_bias=True
    )
    assert ours.conv1d.bias is None and ours.in_proj.bias is not None and ours.out_proj.bias is not None
    x = inputs(3, 29)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), **TOL)


def test_prefill_and_decode_match_transformers_with_cache() -> None:
    theirs, ours = make_pair(n_groups=2, clamp_active=False)
    x = inputs(2, 30)
    hf_cache = DynamicCache(config=theirs.config)
    cache = ours.init_cache(2)
    with torch.no_grad():
        torch.testing.assert_close(ours(x[:, :21], cache=cache), theirs(x[:, :21], cache=hf_cache), **TOL)
        for i in range(21, 30):
            torch.testing.assert_close(
                ours.step(x[:, i : i + 1], cache), theirs(x[:, i : i + 1], cache=hf_cache), **TOL
            )
    layer = hf_cache.layers[0]
    # transformers keeps k conv inputs, we keep the k-1 that the next step needs.
    torch.testing.assert_close(cache.conv_state, layer.conv_states[0][..., 1:], **TOL)
    torch.testing.assert_close(cache.ssm_state, layer.recurrent_states[0], **TOL)


@pytest.mark.parametrize("prefill", [1, 3, 15, 16, 17, 33])
def test_prefill_then_steps_equals_full_forward(prefill: int) -> None:
    """Holds with the dt clamp active too (our step clamps like the chunked path)."""
    _, ours = make_pair(n_groups=2, clamp_active=True)
    x = inputs(2, 40)
    with torch.no_grad():
        full = ours(x)
        cache = ours.init_cache(2)
        pieces = [ours(x[:, :prefill], cache=cache)]
        pieces += [ours.step(x[:, i : i + 1], cache) for i in range(prefill, 40)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **TOL)


@pytest.mark.parametrize("cuts", [(16,), (5, 6), (37,), (1, 2, 3)])
def test_forward_in_pieces_with_cache_equals_one_forward(cuts: tuple[int, ...]) -> None:
    _, ours = make_pair(n_groups=1)
    x = inputs(2, 50)
    bounds = [0, *cuts, 50]
    with torch.no_grad():
        full = ours(x)
        cache = ours.init_cache(2)
        pieces = [ours(x[:, lo:hi], cache=cache) for lo, hi in itertools.pairwise(bounds)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **TOL)


def test_batch_rows_are_independent() -> None:
    _, ours = make_pair()
    x = inputs(3, 23)
    with torch.no_grad():
        batched = ours(x)
        single = torch.cat([ours(x[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(batched, single, **TOL)


@pytest.mark.parametrize("length,chunk", [(37, 16), (5, 16), (32, 8), (9, 1)])
def test_chunk_scan_equals_the_recurrence(length: int, chunk: int) -> None:
    """The chunked scan against the one-step update applied token by token, from a random initial state."""
    generator = torch.Generator().manual_seed(3)
    b, h, p, g, n = 2, 6, 4, 3, 5
    x = torch.randn(b, length, h, p, generator=generator)
    dt = F.softplus(torch.randn(b, length, h, generator=generator))
    A = -torch.rand(h, generator=generator) * 3
    B = torch.randn(b, length, g, n, generator=generator)
    C = torch.randn(b, length, g, n, generator=generator)
    initial = torch.randn(b, h, p, n, generator=generator)
    y, final = ssd.ssd_chunk_scan(x, dt, A, B, C, chunk, initial_state=initial, return_final_state=True)
    state = initial.clone()
    expected = torch.stack(
        [ssd.ssd_state_update(state, x[:, i], dt[:, i], A, B[:, i], C[:, i]) for i in range(length)], dim=1
    )
    torch.testing.assert_close(y, expected, **TOL)
    torch.testing.assert_close(final, state, **TOL)
    assert final.dtype == torch.float32


def test_chunk_scan_accepts_strided_inputs() -> None:
    """Views with any strides (as sliced out of the projection, or transposed) give the contiguous result."""
    generator = torch.Generator().manual_seed(5)
    b, t, h, p, g, n = 2, 21, 4, 3, 2, 5
    x = torch.randn(b, h, t, p, generator=generator).transpose(1, 2)
    dt = F.softplus(torch.randn(b, h, t, generator=generator)).transpose(1, 2)
    A = -torch.rand(h, generator=generator)
    B = torch.randn(b, g, t, n, generator=generator).transpose(1, 2)
    C = torch.randn(b, t, 3 * g * n, generator=generator)[..., g * n : 2 * g * n].unflatten(-1, (g, n))
    initial = torch.randn(b, h, n, p, generator=generator).transpose(-1, -2)
    assert not any(v.is_contiguous() for v in (x, dt, B, C, initial))
    got = ssd.ssd_chunk_scan(x, dt, A, B, C, 8, initial_state=initial, return_final_state=True)
    want = ssd.ssd_chunk_scan(
        *(v.contiguous() for v in (x, dt, A, B, C)),
        8,
        initial_state=initial.contiguous(),
        return_final_state=True,
    )
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("block_size", [3, 64])
def test_causal_conv_matches_conv1d_and_continues_from_its_state(block_size: int) -> None:
    generator = torch.Generator().manual_seed(4)
    b, t, ch, k = 2, 11, 6, 4
    x = torch.randn(b, t, ch, generator=generator)
    weight = torch.randn(ch, k, generator=generator)
    bias = torch.randn(ch, generator=generator)
    y, final = ssd.causal_conv1d(x, weight, bias, block_size=block_size)
    reference = F.conv1d(x.transpose(1, 2), weight[:, None], bias, padding=k - 1, groups=ch)[..., :t]
    torch.testing.assert_close(y, reference.transpose(1, 2), **TOL)
    torch.testing.assert_close(final, x[:, -(k - 1) :].transpose(1, 2))
    # Written over its input, with SiLU: same numbers, and the final state is still the inputs'.
    overwritten = x.clone()
    y_silu, final_silu = ssd.causal_conv1d(
        overwritten, weight, bias, silu=True, overwrite_input=True, block_size=block_size
    )
    assert y_silu.data_ptr() == overwritten.data_ptr()
    torch.testing.assert_close(y_silu, F.silu(y), **TOL)
    torch.testing.assert_close(final_silu, final)
    # Two pieces (one shorter than the state), then one-token updates, equal the whole sequence.
    y1, state = ssd.causal_conv1d(x[:, :2], weight, bias, block_size=block_size)
    y2, state = ssd.causal_conv1d(x[:, 2:7], weight, bias, initial_state=state, block_size=block_size)
    state = state.clone()
    y3 = [ssd.causal_conv1d_update(x[:, i], state, weight, bias) for i in range(7, t)]
    torch.testing.assert_close(torch.cat([y1, y2, torch.stack(y3, dim=1)], dim=1), y, **TOL)


def test_gradients_match_transformers() -> None:
    """The torch path is trainable (blockwise distillation) and its gradients are transformers' gradients."""
    theirs, ours = make_pair(n_groups=2)
    x = inputs(2, 37)
    theirs(x).square().sum().backward()
    ours(x).square().sum().backward()
    reference = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, reference[name].grad, atol=1e-4, rtol=1e-4, msg=name)


def test_parameters_and_cache_layout() -> None:
    theirs, ours = make_pair(n_groups=2)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in theirs.state_dict().items()
    }
    spec = ours.spec
    cache = ours.init_cache(3)
    assert isinstance(cache, MambaCache)
    assert cache.conv_state.shape == (3, spec.conv_dim, spec.conv_kernel - 1)
    assert cache.ssm_state.shape == (3, spec.num_heads, spec.head_dim, spec.state_size)
    assert cache.ssm_state.dtype == torch.float32
    assert not cache.conv_state.any() and not cache.ssm_state.any()


def test_a_cache_of_the_wrong_shape_is_refused_by_name() -> None:
    _, ours = make_pair()
    x = inputs(2, 3)
    with torch.no_grad(), pytest.raises(ValueError, match=r"MambaCache.conv_state has shape \[3, "):
        ours(x, cache=ours.init_cache(3))
    with torch.no_grad(), pytest.raises(ValueError, match="one token"):
        ours.step(x, ours.init_cache(2))


def test_bf16_model_keeps_an_fp32_state_and_tracks_fp32() -> None:
    _, ours = make_pair(n_groups=2, clamp_active=False)
    x = inputs(2, 20)
    with torch.no_grad():
        reference = ours(x)
        half = ours.to(torch.bfloat16)
        cache = half.init_cache(2)
        assert cache.conv_state.dtype == torch.bfloat16 and cache.ssm_state.dtype == torch.float32
        out = torch.cat(
            [half(x[:, :12].bfloat16(), cache=cache)]
            + [half.step(x[:, i : i + 1].bfloat16(), cache) for i in range(12, 20)],
            dim=1,
        )
    assert out.dtype == torch.bfloat16 and cache.ssm_state.dtype == torch.float32
    assert (out.float() - reference).abs().max() < 0.05 * reference.abs().max()


def test_builds_on_meta_at_nemotron_scale() -> None:
    spec = MambaSpec(num_heads=128, head_dim=64, state_size=128, n_groups=8)
    with torch.device("meta"):
        mixer = MambaMixer(spec, 4096)
    state = mixer.state_dict()
    assert all(t.is_meta for t in state.values())
    assert state["in_proj.weight"].shape == (spec.in_proj_dim, 4096)
    assert state["conv1d.weight"].shape == (spec.conv_dim, 1, 4)
    # The published per-block count (109,640,064) includes the block's pre-norm (4096 weights).
    assert sum(t.numel() for t in state.values()) + 4096 == 109_640_064
    cache = mixer.init_cache(2)
    assert cache.ssm_state.is_meta and cache.ssm_state.dtype == torch.float32


def test_cpu_tensors_never_take_the_kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even where mamba_ssm imports, CPU data runs the torch path: dispatch follows the tensor's device."""

    def kernels_must_not_run(*args, **kwargs):
        raise AssertionError("a CUDA kernel was called for CPU tensors")

    fake = type(
        "Kernels",
        (),
        {
            name: staticmethod(kernels_must_not_run)
            for name in ("conv1d_fn", "conv1d_update", "chunk_scan", "state_update")
        },
    )()
    monkeypatch.setattr(mamba_module, "_cuda_kernels", lambda: fake)
    _, ours = make_pair()
    x = inputs(1, 9)
    with torch.no_grad():
        cache = ours.init_cache(1)
        ours(x, cache=cache)
        ours.step(x[:, :1], cache)


class _KernelStandIns:
    """Torch stand-ins for the mamba_ssm / causal_conv1d kernels (unavailable on this CPU machine).

    Each computes what its kernel computes and enforces the input layout the real kernel checks, so the
    glue of MambaMixer's CUDA path (layouts, cache slicing, D skip, final states) is exercised here.
    """

    @staticmethod
    def conv1d_fn(x, weight, bias=None, activation=None):
        dim = x.shape[1]
        assert x.stride(2) == 1 or x.stride(1) == 1
        if x.stride(1) == 1 and x.stride(2) > 1:  # causal_conv1d's channel-last constraints
            assert dim % 8 == 0 and x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, "channel-last strides"
        k = weight.shape[-1]
        y = F.conv1d(x, weight[:, None], bias, padding=k - 1, groups=dim)[..., : x.shape[-1]]
        return F.silu(y) if activation == "silu" else y

    @staticmethod
    def conv1d_update(x, conv_state, weight, bias=None, activation=None):
        y = ssd.causal_conv1d_update(x, conv_state, weight, bias)
        return F.silu(y) if activation == "silu" else y

    @staticmethod
    def chunk_scan(x, dt, A, B, C, chunk_size, D=None, initial_states=None, return_final_states=False):
        y, state = ssd.ssd_chunk_scan(x, dt, A, B, C, chunk_size, initial_states, return_final_state=True)
        y = y + x.float() * D[:, None]
        return (y.to(x.dtype), state.to(C.dtype)) if return_final_states else y.to(x.dtype)

    @staticmethod
    def state_update(state, x, dt, A, B, C, D=None, dt_softplus=False):
        assert not dt_softplus
        y = ssd.ssd_state_update(state, x, dt[..., 0], A[:, 0, 0], B, C)
        return (y + x.float() * D).to(x.dtype)


def test_kernel_path_glue_equals_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA-path code with kernel stand-ins: same outputs and caches as the torch path, for a shape whose
    in_proj width (132) is not a multiple of 8, as a pruned child's often is not."""
    _, ours = make_pair(n_groups=2)
    assert ours.spec.in_proj_dim % 8 != 0
    x = inputs(2, 21)
    with torch.no_grad():
        expected_full = ours(x)
        expected_cache = ours.init_cache(2)
        expected = [ours(x[:, :13], cache=expected_cache), ours.step(x[:, 13:14], expected_cache)]
        monkeypatch.setattr(mamba_module, "_kernels_for", lambda tensor: _KernelStandIns())
        torch.testing.assert_close(ours(x), expected_full, **TOL)
        cache = ours.init_cache(2)
        got = [ours(x[:, :13], cache=cache), ours.step(x[:, 13:14], cache)]
    for mine, reference in zip(got, expected):
        torch.testing.assert_close(mine, reference, **TOL)
    torch.testing.assert_close(cache.conv_state, expected_cache.conv_state, **TOL)
    torch.testing.assert_close(cache.ssm_state, expected_cache.ssm_state, **TOL)
