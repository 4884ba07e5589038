"""Presets reproduce NVIDIA's published parameter totals to the parameter."""

from __future__ import annotations

import pytest

from puzzle.cost.analytic import model_active_params, model_params
from puzzle.presets import (
    PRESETS,
    get_preset,
    nemotron3_nano,
    nemotron3_super,
    nemotron_h_8b,
    nemotron_nano_9b_v2,
    puzzle_75b_a9b_like,
    tiny_hybrid,
)
from puzzle.spec import MambaSpec, MoESpec, SpecError


@pytest.mark.parametrize(
    ("build", "total", "active"),
    [
        (nemotron3_super, 120_668_687_360, 12_770_216_960),
        (nemotron3_nano, 31_577_937_344, 3_580_073_408),
        (nemotron_h_8b, 8_100_852_736, 8_100_852_736),
        (nemotron_nano_9b_v2, 8_888_227_328, 8_888_227_328),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_published_totals_exactly(build, total, active):
    spec = build()
    assert model_params(spec) == total
    assert model_active_params(spec) == active


def test_patterns_and_shapes():
    assert nemotron3_super().pattern.count("M") == 40 and nemotron3_super().pattern.count("*") == 8
    assert nemotron3_super().num_blocks == 88 and nemotron3_nano().num_blocks == 52
    assert nemotron_h_8b().num_blocks == 52 and nemotron_nano_9b_v2().num_blocks == 56
    moe = nemotron3_super().blocks[1]
    assert isinstance(moe, MoESpec) and (moe.num_experts, moe.top_k, moe.latent_size) == (512, 22, 1024)


def test_puzzle_75b_like_has_the_published_summary_statistics():
    spec = puzzle_75b_a9b_like()
    parent = nemotron3_super()
    assert spec.pattern == parent.pattern
    mambas = [b for b in spec.blocks if isinstance(b, MambaSpec)]
    assert {b.state_size for b in mambas} == {96}
    moes = [b for b in spec.blocks if isinstance(b, MoESpec)]
    widths = [b.expert_width for b in moes]
    top_ks = [b.top_k for b in moes]
    assert len(set(widths)) == 5 and min(widths) == 1280 and max(widths) == 2688
    assert len(set(top_ks)) == 7 and min(top_ks) == 4 and max(top_ks) == 18
    assert sum(widths) / len(widths) == pytest.approx(0.599 * 2688, rel=0.005)
    assert sum(w * k for w, k in zip(widths, top_ks)) == pytest.approx(712_000, rel=0.005)
    assert {(b.num_experts, b.latent_size, b.shared_width) for b in moes} == {(512, 1024, 5376)}


def test_get_preset_accepts_spellings_and_rejects_unknown_names():
    assert get_preset("Nemotron3_Super") == nemotron3_super()
    assert set(PRESETS) >= {"nemotron3-super", "nemotron3-nano", "nemotron-h-8b", "nemotron-nano-9b-v2"}
    with pytest.raises(SpecError, match=r"unknown preset 'nemotron9'.*nemotron3-super"):
        get_preset("nemotron9")


def test_tiny_hybrid_sizes():
    assert tiny_hybrid(96).blocks[0] == MambaSpec(6, 32, 16, n_groups=2, conv_kernel=4, chunk_size=32)
    for bad in (48, 0, 100):
        with pytest.raises(SpecError, match=f"hidden_size must be a positive multiple of 32, found {bad}"):
            tiny_hybrid(bad)
