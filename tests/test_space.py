"""The search space: loading, enumeration per kind and mode, overrides, rounding, width profiles, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from puzzle.artifacts import fingerprint_json
from puzzle.blocks.moe import module_hub_state
from puzzle.model import HybridLM
from puzzle.presets import get_space_preset, nemotron3_nano, nemotron3_super, puzzle_75b_a9b_like, tiny_hybrid
from puzzle.prune import collect_importance, init_child
from puzzle.space import KIND_AXES, SearchSpace, SpaceError
from puzzle.spec import (
    AttentionSpec,
    LinearSpec,
    MambaSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
    SpecError,
    block_from_dict,
    block_to_dict,
)

YAML = """
rounding: 64
kinds:
  mamba:
    state_size: [64, 128, 96]
    num_heads: 48
  moe:
    top_k: {min: 2, max: 6, step: 2}
    expert_width_fraction: [0.5]
    mode: decoupled
    noop: true
  attention: {num_kv_heads: [1]}
overrides:
  - {blocks: [0, 51], freeze: true}
  - blocks: 10
    moe: {top_k: [4]}
"""

AS_DICT = {
    "rounding": 64,
    "kinds": {
        "mamba": {"state_size": [128, 96, 64], "num_heads": [48]},
        "moe": {"top_k": [6, 4, 2], "expert_width_fraction": 0.5, "mode": "decoupled", "noop": True},
        "attention": {"num_kv_heads": 1},
    },
    "overrides": [{"blocks": [51, 0], "freeze": True}, {"blocks": [10], "moe": {"top_k": 4}}],
}


def ids_of(variants):
    return [variant.id for variant in variants]


def test_yaml_and_dict_load_equal_and_round_trip(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(YAML)
    space = SearchSpace.from_yaml(path)
    assert space == SearchSpace.from_dict(AS_DICT)
    assert SearchSpace.from_dict(space.to_dict()) == space
    # to_dict is plain JSON: it fingerprints, and a different space has another fingerprint.
    other = SearchSpace.from_dict({**AS_DICT, "rounding": 32})
    assert fingerprint_json(space.to_dict()) == fingerprint_json(SearchSpace.from_dict(AS_DICT).to_dict())
    assert fingerprint_json(space.to_dict()) != fingerprint_json(other.to_dict())
    # Ranges are expanded and values sorted largest first in the record.
    assert space.to_dict()["kinds"]["moe"]["top_k"] == [6, 4, 2]
    # The same space gives the same variants in the same order however its lists were written.
    nano = nemotron3_nano()
    shuffled = SearchSpace.from_dict(
        {**AS_DICT, "kinds": {**AS_DICT["kinds"], "mamba": {"state_size": [64, 96, 128], "num_heads": [48]}}}
    )
    assert ids_of(space.variants(nano, 2)) == ids_of(shuffled.variants(nano, 2))


def test_nano_variants_follow_modes_overrides_and_rounding():
    nano = nemotron3_nano()  # MEMEM*EMEME...: 0 M, 1 E, 2 M, 5 *, 10 E, 51 E
    space = SearchSpace.from_dict(AS_DICT)
    assert ids_of(space.variants(nano, 0)) == [nano.blocks[0].short_name()]  # frozen
    assert ids_of(space.variants(nano, 51)) == [nano.blocks[51].short_name()]
    # Mamba, coupled: state {128, 96, 64} x heads {64 (the parent's), 48}, state the outer loop.
    assert [(v.spec.state_size, v.spec.num_heads) for v in space.variants(nano, 2)] == [
        (128, 64), (128, 48), (96, 64), (96, 48), (64, 64), (64, 48)
    ]  # fmt: skip
    # MoE decoupled: parent, top_k 4 and 2, width 1856 * 0.5 = 928 -> 960 (nearest multiple of 64), noop.
    moe = space.variants(nano, 1)
    assert ids_of(moe) == [
        "moe:e128:k6:w1856:s3712:scale2.5",
        "moe:e128:k4:w1856:s3712:scale2.5",
        "moe:e128:k2:w1856:s3712:scale2.5",
        "moe:e128:k6:w960:s3712:scale2.5",
        "noop",
    ]
    # Block 10 may only change top_k, and its override drops the kind's noop.
    assert ids_of(space.variants(nano, 10)) == [
        "moe:e128:k6:w1856:s3712:scale2.5",
        "moe:e128:k4:w1856:s3712:scale2.5",
    ]
    # Attention: KV heads 2 -> 1.
    assert ids_of(space.variants(nano, 5)) == ["attn:q32:kv2:d128", "attn:q32:kv1:d128"]


def test_coupled_is_the_product_and_decoupled_one_axis_at_a_time():
    nano = nemotron3_nano()
    axes = {"top_k": [4, 2], "expert_width": [1024, 512], "shared_width": [0]}
    coupled = SearchSpace.from_dict({"kinds": {"moe": axes}}).variants(nano, 1)
    decoupled = SearchSpace.from_dict({"kinds": {"moe": {**axes, "mode": "decoupled"}}}).variants(nano, 1)
    # Each axis offers the parent's value too: top_k 3 x width 3 x shared 2 = 18; decoupled 1 + 2 + 2 + 1 = 6.
    assert len(coupled) == 18 and len(set(ids_of(coupled))) == 18
    assert len(decoupled) == 6
    assert set(ids_of(decoupled)) <= set(ids_of(coupled))
    parent = nano.blocks[1]
    for variant in decoupled[1:]:
        changed = [
            f.name
            for f in dataclasses.fields(parent)
            if getattr(variant.spec, f.name) != getattr(parent, f.name)
        ]
        assert len(changed) == 1
    # Combinations a block cannot take are left out of a product: top_k 6 with 4 experts.
    small = SearchSpace.from_dict({"kinds": {"moe": {"num_experts": [4], "top_k": [4, 2]}}}).variants(nano, 1)
    assert [(v.spec.num_experts, v.spec.top_k) for v in small] == [
        (128, 6),
        (128, 4),
        (128, 2),
        (4, 4),
        (4, 2),
    ]
    # ...but in decoupled mode the lone value is an error naming block, axis and value.
    with pytest.raises(SpaceError, match=r"block 1 \(moe\), axis num_experts, value 4: fewer experts"):
        SearchSpace.from_dict({"kinds": {"moe": {"num_experts": [4], "mode": "decoupled"}}}).variants(nano, 1)


def test_rounding_multiple():
    nano = nemotron3_nano()
    # 1856 x {0.5, 0.49, 0.3} = 928, 909.4, 556.8 -> multiples of 128: 896, 896, 512 (deduplicated).
    space = SearchSpace.from_dict(
        {
            "rounding": 128,
            "kinds": {"moe": {"expert_width_fraction": [0.5, 0.49, 0.3], "expert_width": [1024]}},
        }
    )
    widths = [v.spec.expert_width for v in space.variants(nano, 1)]
    assert widths == [1856, 1024, 896, 512]  # the parent's 1856 is no multiple of 128 and still first
    # A kind's own multiple wins over the space's.
    own = SearchSpace.from_dict(
        {"rounding": 128, "kinds": {"moe": {"expert_width_fraction": [0.5], "rounding": 32}}}
    )
    assert [v.spec.expert_width for v in own.variants(nano, 1)] == [1856, 928]
    # An absolute size off the multiple is an error, never silently moved.
    bad = SearchSpace.from_dict({"rounding": 128, "kinds": {"moe": {"expert_width": [1000]}}})
    with pytest.raises(
        SpaceError, match=r"block 1 \(moe\), axis expert_width, value 1000: not a multiple of .* 128"
    ):
        bad.variants(nano, 1)
    # A fraction never rounds to zero or above the parent.
    tiny = SearchSpace.from_dict({"rounding": 4096, "kinds": {"moe": {"expert_width_fraction": [0.01]}}})
    assert [v.spec.expert_width for v in tiny.variants(nano, 1)] == [1856]


def test_linear_and_noop_come_last_and_unknown_kinds_keep_the_parent():
    spec = tiny_hybrid(hidden_size=32)  # M * E M - E
    space = SearchSpace.from_dict({"kinds": {"mlp": {"width_fraction": [0.5], "linear": True, "noop": True}}})
    assert ids_of(space.variants(spec, 4)) == ["mlp:w128", "mlp:w64", "linear", "noop"]
    assert ids_of(space.variants(spec, 0)) == [spec.blocks[0].short_name()]
    odd = ModelSpec(vocab_size=8, hidden_size=32, blocks=(LinearSpec(), NoOpSpec()))
    assert ids_of(space.variants(odd, 0)) == ["linear"] and ids_of(space.variants(odd, 1)) == ["noop"]


# Nemotron-3-Super, the seed's space (puzzle/presets/nemotron.py), counted by hand:
# - Mamba (40 blocks): state size {128, 96, 64}, nothing else varies -> 3 variants each, 120 in all.
# - MoE (40 blocks), coupled: width 1280..2688 step 128 = 12 values (1280 + 128 k, k = 0..11, 2688 the
#   parent's) x top_k 4..22 step 2 = 10 values (22 the parent's) = 120 variants each, 4,800 in all.
# - attention (8 blocks): untouched, 1 variant each.
# Total 120 + 4800 + 8 = 4,928.
SUPER_COUNTS = {"mamba": 3, "moe": 120, "attention": 1}


def test_super_preset_counts_validity_and_the_seed_child():
    parent, space = nemotron3_super(), get_space_preset("nemotron3-super")
    by_block = space.all_variants(parent)
    assert sorted(by_block) == list(range(88))
    assert sum(len(v) for v in by_block.values()) == 4928
    child = puzzle_75b_a9b_like()
    for index, variants in by_block.items():
        block = parent.blocks[index]
        assert len(variants) == SUPER_COUNTS[block.kind], index
        assert variants[0].spec == block and all(v.block_index == index for v in variants)
        assert len({v.id for v in variants}) == len(variants)
        for variant in variants:
            spec = variant.spec
            assert block_from_dict(block_to_dict(spec)) == spec  # validates and round-trips
            assert type(spec) is type(block)
            for axis in KIND_AXES[block.kind]:
                value, parent_value = getattr(spec, axis), getattr(block, axis)
                assert value is None or value <= parent_value, (variant, axis)
        # The seed's compressed model is one point of this space.
        assert child.blocks[index] in [v.spec for v in variants]
    # Every state size and every (width, top_k) pair is there once.
    assert {v.spec.state_size for v in by_block[0]} == {128, 96, 64}
    pairs = {(v.spec.expert_width, v.spec.top_k) for v in by_block[1]}
    assert pairs == {(w, k) for w in range(1280, 2689, 128) for k in range(4, 23, 2)}
    assert space.variants_by_block(parent) == by_block


# ----------------------------------------------------------------------------------------------------------
# Width profiles: per-expert widths by importance, accepted by init_child.

PROFILE = [{"experts": 0.25, "width_fraction": 1.0}, {"experts": 0.75, "width_fraction": 0.5}]


@pytest.fixture(scope="module")
def tiny_parent():
    torch.manual_seed(0)
    spec = tiny_hybrid(hidden_size=32)  # MoE blocks 2 and 5: 8 experts of width 32, top-2, latent 16
    model = HybridLM(spec).eval()
    ids = torch.randint(0, spec.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    return model, ids, collect_importance(model, [ids], linear_fit=False)


def test_width_profiles_assign_widths_by_importance_and_init_child_accepts_them(tiny_parent):
    model, ids, importance = tiny_parent
    spec = model.spec
    space = SearchSpace.from_dict({"kinds": {"moe": {"num_experts": [6], "width_profiles": [PROFILE]}}})
    by_block = space.all_variants(spec, importance)
    mixers = [None] * spec.num_blocks
    for index in (2, 5):
        variants = by_block[index]
        # num_experts {8, 6} x width {32, profile}: 4 variants, the profile ones with per-expert widths.
        assert len(variants) == 4
        profiled = [v for v in variants if not v.spec.is_uniform]
        assert [v.spec.num_experts for v in profiled] == [8, 6]
        scores = importance[index]["expert"].tolist()
        for variant in profiled:
            n = variant.spec.num_experts
            # Reference written from the profile: the n best experts kept in index order; the top 25%
            # of them (2 of 8, floor(1.5 + 0.5) = 2 of 6) at width 32, the rest at 16.
            kept = sorted(sorted(range(8), key=lambda j: (-scores[j], j))[:n])
            wide = sorted(kept, key=lambda j: (-scores[j], j))[:2]
            assert variant.spec.widths == tuple(32 if j in wide else 16 for j in kept)
            mean = round(sum(variant.spec.widths) / n)  # 20 of 8, 21 of 6
            assert variant.id.startswith(f"moe:e{n}:k2:w{mean}avg.")
            parent_block = model.layers[index].mixer
            child = init_child(parent_block, spec.blocks[index], variant.spec, importance[index])
            state = module_hub_state(child)
            for i, width in enumerate(variant.spec.widths):
                assert state[f"experts.{i}.up_proj.weight"].shape[0] == width
            mixers[index] = child
    child_model = HybridLM(
        ModelSpec(
            spec.vocab_size, spec.hidden_size, tuple(m.spec if m else b for m, b in zip(mixers, spec.blocks))
        ),
        mixers,
    ).eval()
    with torch.no_grad():
        logits = child_model(ids).logits
    assert logits.shape == (4, 32, spec.vocab_size) and torch.isfinite(logits).all()


def test_a_profile_needs_importance_and_a_uniform_profile_is_the_plain_width(tiny_parent):
    model, _, importance = tiny_parent
    space = SearchSpace.from_dict({"kinds": {"moe": {"width_profiles": [PROFILE]}}})
    with pytest.raises(
        SpaceError, match=r"block 2 \(moe\), axis width_profiles.*pass the parent's importance"
    ):
        space.variants(model.spec, 2)
    with pytest.raises(SpaceError, match="importance is of a mamba block"):
        space.variants(model.spec, 2, importance[0])
    uniform = SearchSpace.from_dict(
        {"kinds": {"moe": {"expert_width": [16], "width_profiles": [[{"experts": 1.0, "width": 16}]]}}}
    )
    variants = uniform.variants(model.spec, 2)  # no ranking needed, and one spec for width 16
    assert [v.spec.expert_width for v in variants] == [32, 16]


# ----------------------------------------------------------------------------------------------------------
# Errors: malformed spaces at load time, impossible values at enumeration time.


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"kind": {}},
            r"space: unknown key\(s\) \['kind'\]; valid keys here: \['rounding', 'kinds', 'overrides'\]",
        ),
        (
            {"kinds": {"ssm": {}}},
            r"space.kinds: unknown key\(s\) \['ssm'\]; valid keys here: \['mamba', 'moe'",
        ),
        (
            {"kinds": {"moe": {"topk": [4]}}},
            r"space.kinds.moe: unknown key\(s\) \['topk'\]; valid keys here: \['num_experts'",
        ),
        (
            {"kinds": {"mamba": {"state_size_fraction": [0.5]}}},
            r"kinds.mamba: unknown key\(s\) \['state_size_fraction'\]",
        ),
        (
            {"kinds": {"moe": {"top_k": [4, "8"]}}},
            r"space.kinds.moe.top_k\[1\] must be a positive integer, found '8'",
        ),
        ({"kinds": {"moe": {"top_k": {"min": 4}}}}, r"top_k: a range needs 'min' and 'max'"),
        (
            {"kinds": {"moe": {"expert_width_fraction": [1.5]}}},
            r"expert_width_fraction\[0\] must be a fraction in \(0, 1\]",
        ),
        ({"kinds": {"moe": {"mode": "joint"}}}, r"kinds.moe.mode must be one of \['coupled', 'decoupled'\]"),
        ({"kinds": {"mlp": {"noop": "yes"}}}, r"kinds.mlp.noop must be true or false"),
        (
            {
                "kinds": {
                    "moe": {"width_profiles": [[{"experts": 0.5, "width": 8}, {"experts": 0.25, "width": 4}]]}
                }
            },
            r"width_profiles\[0\]: the tiers' expert fractions must sum to 1, found 0.75",
        ),
        (
            {"kinds": {"moe": {"width_profiles": [[{"experts": 1.0, "width": 8, "width_fraction": 0.5}]]}}},
            r"width_profiles\[0\]\[0\] needs 'experts' and exactly one of 'width' or 'width_fraction'",
        ),
        (
            {"overrides": [{"blocks": [1]}]},
            r"overrides\[0\] needs either 'freeze: true' or exactly one kind space",
        ),
        (
            {"overrides": [{"blocks": [1], "freeze": True, "moe": {}}]},
            r"needs either 'freeze: true' or exactly one",
        ),
        (
            {"overrides": [{"blocks": [1], "moe": {"heads": 2}}]},
            r"overrides\[0\].moe: unknown key\(s\) \['heads'\]",
        ),
        (
            {"overrides": [{"blocks": [1, 2], "freeze": True}, {"blocks": 2, "freeze": True}]},
            r"block 2 is in overrides\[0\] and overrides\[1\]",
        ),
    ],
)
def test_malformed_spaces_are_errors_naming_the_key(data, message):
    with pytest.raises(SpaceError, match=message):
        SearchSpace.from_dict(data)


def test_yaml_errors_name_the_file(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("kinds:\n  moe: {top_k: [4, 2]\n")
    with pytest.raises(SpaceError, match=rf"{path}: not valid YAML"):
        SearchSpace.from_yaml(path)
    path.write_text("kinds: {moe: {top_kk: [4]}}\n")
    with pytest.raises(SpaceError, match=rf"{path}: space.kinds.moe: unknown key"):
        SearchSpace.from_yaml(path)


HYBRID = ModelSpec(
    vocab_size=16,
    hidden_size=64,
    blocks=(
        MambaSpec(num_heads=8, head_dim=16, state_size=32, n_groups=4),
        AttentionSpec(num_heads=8, num_kv_heads=4, head_dim=16),
        MoESpec(num_experts=8, top_k=2, expert_width=64),
        MoESpec(num_experts=8, top_k=2, expert_width=64, n_group=2, topk_group=1),
    ),
)


@pytest.mark.parametrize(
    ("kinds", "block", "message"),
    [
        (
            {"mamba": {"num_heads": [6]}},
            0,
            r"block 0 \(mamba\), axis num_heads, value 6: heads must be whole heads per group: not a multiple of n_groups 4",
        ),
        (
            {"mamba": {"state_size": [64]}},
            0,
            r"block 0 \(mamba\), axis state_size, value 64: above the parent's 32",
        ),
        (
            {"attention": {"num_kv_heads": [3]}},
            1,
            r"block 1 \(attention\), axis num_kv_heads, value 3: .* must divide the parent's 4",
        ),
        (
            {"moe": {"latent_size": [16]}},
            2,
            r"block 2 \(moe\), axis latent_size, value 16: the parent has no latent",
        ),
        (
            {"moe": {"latent_size_fraction": [0.5]}},
            2,
            r"block 2 \(moe\), axis latent_size_fraction, value 0.5: the parent has no such axis",
        ),
        ({"moe": {"top_k": [3]}}, 2, r"block 2 \(moe\), axis top_k, value 3: above the parent's 2"),
        (
            {"moe": {"num_experts": [4]}},
            3,
            r"block 3 \(moe\), axis num_experts, value 4: removing experts from a group-limited",
        ),
        (
            {"moe": {"expert_width": [80]}},
            2,
            r"block 2 \(moe\), axis expert_width, value 80: above the parent's 64",
        ),
    ],
)
def test_values_a_block_cannot_take_are_errors_naming_block_axis_and_value(kinds, block, message):
    with pytest.raises(SpaceError, match=message):
        SearchSpace.from_dict({"kinds": kinds}).variants(HYBRID, block)


def test_block_and_override_errors():
    space = SearchSpace.from_dict({"overrides": [{"blocks": [2], "mamba": {"state_size": [16]}}]})
    with pytest.raises(SpaceError, match=r"block 2 \(moe\) has an override for mamba blocks"):
        space.variants(HYBRID, 2)
    with pytest.raises(SpaceError, match=r"block 4 does not exist: the parent has 4 blocks"):
        space.variants(HYBRID, 4)
    beyond = SearchSpace.from_dict({"overrides": [{"blocks": [9], "freeze": True}]})
    with pytest.raises(SpaceError, match=r"overrides\[0\] names block\(s\) \[9\]; the parent has 4 blocks"):
        beyond.all_variants(HYBRID)
    assert issubclass(SpaceError, SpecError) and issubclass(SpaceError, ValueError)
