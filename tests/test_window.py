"""Sliding-window attention (`AttentionSpec.window`) through the tables: the mixer, its cache, costs, the
search, `puzzle costs` and the export, each against an oracle computed here."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from puzzle.blocks import build_block
from puzzle.spec import AttentionSpec, SpecError

H = 16
SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4)


def banded_reference(mixer, x: torch.Tensor, window: int | None) -> torch.Tensor:
    """Attention of x [b, T, H] written out with torch ops: softmax over keys t - W + 1 .. t, masked by hand."""
    spec = mixer.spec
    b, T, _ = x.shape
    q = mixer.q_proj(x).view(b, T, spec.num_heads, spec.head_dim).transpose(1, 2)
    k = mixer.k_proj(x).view(b, T, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    v = mixer.v_proj(x).view(b, T, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    group = spec.num_heads // spec.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(spec.head_dim)
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        first = 0 if window is None else max(0, t - window + 1)
        allowed[t, first : t + 1] = True
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    y = (weights @ v).transpose(1, 2).reshape(b, T, -1)
    return mixer.o_proj(y)


@pytest.mark.parametrize("window", [1, 3, 5, 40])
def test_windowed_mixer_equals_attention_with_a_band_mask(window):
    torch.manual_seed(0)
    mixer = build_block(dataclasses.replace(SPEC, window=window), H).eval()
    x = torch.randn(2, 11, H)
    with torch.no_grad():
        assert torch.allclose(mixer(x), banded_reference(mixer, x, window), atol=1e-5)
        if window < 11:  # the band really cuts: full attention differs
            full = banded_reference(mixer, x, None)
            assert not torch.allclose(mixer(x), full, atol=1e-3)


@pytest.mark.parametrize("window", [1, 3, 4])
@pytest.mark.parametrize("chunks", [[1] * 9, [4, 1, 1, 3], [2, 5, 2]])
def test_incremental_cache_equals_the_full_forward_and_holds_the_window(window, chunks):
    torch.manual_seed(1)
    mixer = build_block(dataclasses.replace(SPEC, window=window, rope_theta=10000.0), H).eval()
    x = torch.randn(2, sum(chunks), H)
    cache = mixer.init_cache(2, max_length=64)
    outputs, start = [], 0
    with torch.no_grad():
        full = mixer(x)
        for size in chunks:
            outputs.append(mixer(x[:, start : start + size], cache))
            start += size
            assert cache.stored <= window - 1 and cache.key.shape[2] <= window - 1  # bounded by the window
    assert cache.length == x.shape[1]
    assert torch.allclose(torch.cat(outputs, dim=1), full, atol=1e-5)


def test_a_window_must_be_a_positive_integer_and_names_itself():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(SpecError, match=r"AttentionSpec\.window"):
            AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4, window=bad)
    assert AttentionSpec(num_heads=32, num_kv_heads=2, head_dim=128, window=4096).short_name() == (
        "attn:q32:kv2:d128:w4096"
    )
    assert SPEC.short_name() == "attn:q4:kv2:d4"  # ids of full attention unchanged
    from puzzle.spec import block_from_dict, block_to_dict

    assert "window" not in block_to_dict(SPEC)  # saved runs' JSON unchanged
    windowed = dataclasses.replace(SPEC, window=7)
    assert block_from_dict(block_to_dict(windowed)) == windowed


def test_child_init_keeps_the_parents_weights_and_refuses_a_wider_window():
    from puzzle.prune.init import init_child

    torch.manual_seed(2)
    parent = build_block(SPEC, H)
    child = init_child(parent, SPEC, dataclasses.replace(SPEC, window=3))
    assert child.spec.window == 3
    for name, tensor in parent.state_dict().items():
        assert torch.equal(child.state_dict()[name], tensor), name
    narrow = dataclasses.replace(SPEC, window=3)
    parent_narrow = build_block(narrow, H)
    for wider in (5, None):
        with pytest.raises(SpecError, match="window"):
            init_child(parent_narrow, narrow, dataclasses.replace(SPEC, window=wider))
