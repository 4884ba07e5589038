"""The architecture as data: round trips, hashing, and every validation error with its message."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from puzzle.spec import (
    WEIGHT_FORMATS,
    AttentionSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
    SpecError,
    Variant,
    block_from_dict,
    block_to_dict,
    blocks_of_kind,
)

ALL_KINDS = (
    MambaSpec(num_heads=4, head_dim=8, state_size=16, n_groups=2, chunk_size=16),
    AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
    MoESpec(num_experts=4, top_k=2, expert_width=(8, 16, 8, 4), shared_width=12, latent_size=8),
    MoESpec(num_experts=8, top_k=3, expert_width=32, routed_scaling_factor=2.5, n_group=2, topk_group=2),
    MLPSpec(width=64),
    LinearSpec(),
    NoOpSpec(),
)


def test_every_kind_round_trips_through_json_and_hashes() -> None:
    spec = ModelSpec(vocab_size=100, hidden_size=32, blocks=ALL_KINDS)
    again = ModelSpec.from_json(spec.to_json())
    assert again == spec
    assert hash(again) == hash(spec)
    assert spec.pattern == "M*EE-LN"
    assert len({spec, again}) == 1


def test_unbounded_dt_clamp_is_written_as_null() -> None:
    mamba = MambaSpec(num_heads=2, head_dim=4, state_size=8, dt_clamp_min=1e-3)
    data = block_to_dict(mamba)
    assert data["dt_clamp_max"] is None
    json.dumps(data, allow_nan=False)  # strict JSON: no Infinity
    assert block_from_dict(data) == mamba


def test_expert_widths_uniform_and_heterogeneous() -> None:
    uniform = MoESpec(num_experts=3, top_k=1, expert_width=5)
    assert uniform.widths == (5, 5, 5) and uniform.is_uniform
    mixed = MoESpec(num_experts=3, top_k=1, expert_width=[5, 6, 7])
    assert mixed.expert_width == (5, 6, 7) and not mixed.is_uniform
    assert hash(mixed) == hash(MoESpec(num_experts=3, top_k=1, expert_width=(5, 6, 7)))


def test_derived_mamba_sizes_follow_the_checkpoint_layout() -> None:
    # Nemotron-3-Super: in_proj [d + (d + 2GN) + nh, H] with d = 128 * 64, G = 8, N = 128.
    mamba = MambaSpec(num_heads=128, head_dim=64, state_size=128, n_groups=8)
    assert mamba.d_inner == 8192
    assert mamba.conv_dim == 8192 + 2 * 8 * 128
    assert mamba.in_proj_dim == 8192 + 8192 + 2 * 8 * 128 + 128


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MambaSpec(num_heads=6, head_dim=8, state_size=16, n_groups=4), "divisible by n_groups"),
        (lambda: MambaSpec(num_heads=4, head_dim=0, state_size=16), "head_dim must be a positive integer"),
        (
            lambda: MambaSpec(num_heads=4, head_dim=8, state_size=16, dt_clamp_min=1.0, dt_clamp_max=0.5),
            "below dt_clamp_min",
        ),
        (lambda: AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=8), "divisible by num_kv_heads"),
        (lambda: MoESpec(num_experts=4, top_k=5, expert_width=8), r"top_k \(5\) exceeds num_experts \(4\)"),
        (lambda: MoESpec(num_experts=4, top_k=2, expert_width=0), "expert_width must be a positive integer"),
        (
            lambda: MoESpec(num_experts=4, top_k=2, expert_width=(8, 8)),
            "has 2 entries, expected one per expert",
        ),
        (lambda: MoESpec(num_experts=4, top_k=2, expert_width=(8, 8, -1, 8)), r"expert_width\[2\]"),
        (
            lambda: MoESpec(num_experts=4, top_k=2, expert_width=8, shared_width=-1),
            "shared_width must be >= 0",
        ),
        (lambda: MoESpec(num_experts=6, top_k=2, expert_width=8, n_group=4), "divisible by n_group"),
        (
            lambda: MoESpec(num_experts=8, top_k=5, expert_width=8, n_group=4, topk_group=2),
            "reachable through topk_group",
        ),
        (lambda: MLPSpec(width=-3), "width must be a positive integer"),
        (lambda: MLPSpec(width=8, bias="false"), r"MLPSpec\.bias must be true or false, found 'false'"),
        (lambda: MambaSpec(4, 8, 16, conv_bias=1), r"MambaSpec\.conv_bias must be true or false"),
        (lambda: MoESpec(4, 2, 8, norm_topk_prob="yes"), r"MoESpec\.norm_topk_prob must be true or false"),
        (lambda: MoESpec(4, 2, 8, routed_scaling_factor=0), "routed_scaling_factor must be positive"),
        (lambda: LinearSpec(bias=None), r"LinearSpec\.bias must be true or false"),
        (
            lambda: ModelSpec(10, 8, (), tie_embeddings="no"),
            r"ModelSpec\.tie_embeddings must be true or false",
        ),
        (lambda: MLPSpec(width=8, activation="swish9"), "activation 'swish9' is not supported"),
        (lambda: ModelSpec(vocab_size=10, hidden_size=8, blocks=("M",)), r"blocks\[0\] is a str"),
    ],
)
def test_validation_errors_name_the_problem(build, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        build()


def test_unknown_json_keys_and_kinds_are_errors() -> None:
    with pytest.raises(
        SpecError, match=r"unknown key\(s\) \['heads'\] for a 'mamba' block; allowed keys: \["
    ):
        block_from_dict({"kind": "mamba", "heads": 4, "head_dim": 8, "state_size": 16})
    with pytest.raises(SpecError, match="unknown block kind 'ssm'; choose one of"):
        block_from_dict({"kind": "ssm"})
    with pytest.raises(SpecError, match="has no 'kind'"):
        block_from_dict({"width": 4})
    with pytest.raises(SpecError, match=r"missing required key\(s\) \['width'\]"):
        block_from_dict({"kind": "mlp"})
    with pytest.raises(SpecError, match=r"unknown key\(s\) \['layers'\] in a model spec"):
        ModelSpec.from_dict({"vocab_size": 10, "hidden_size": 8, "blocks": [], "layers": 3})
    with pytest.raises(SpecError, match="'blocks' must be a list"):
        ModelSpec.from_dict({"vocab_size": 10, "hidden_size": 8, "blocks": "M*"})


def test_replace_block_and_variant_ids() -> None:
    spec = ModelSpec(vocab_size=100, hidden_size=32, blocks=ALL_KINDS)
    smaller = MoESpec(num_experts=4, top_k=1, expert_width=8, shared_width=12, latent_size=8)
    child = spec.replace_block(2, smaller)
    assert child.blocks[2] == smaller and spec.blocks[2] == ALL_KINDS[2]
    assert Variant(2, smaller).id == "moe:e4:k1:w8:s12:l8"
    assert Variant(0, ALL_KINDS[0]).id == "mamba:h4:p8:n16:g2:chunk16"
    assert (
        Variant(0, MambaSpec(num_heads=4, head_dim=8, state_size=16, n_groups=2)).id == "mamba:h4:p8:n16:g2"
    )
    assert ALL_KINDS[3].short_name() == "moe:e8:k3:w32:scale2.5:groups2:topkgroups2"
    # Heterogeneous widths with the same mean still get different ids.
    first = MoESpec(num_experts=2, top_k=1, expert_width=(8, 16))
    second = MoESpec(num_experts=2, top_k=1, expert_width=(16, 8))
    assert first.short_name().startswith("moe:e2:k1:w12avg.")
    assert first.short_name() != second.short_name()
    assert blocks_of_kind(spec, "moe") == [2, 3]
    assert blocks_of_kind(spec, ("linear", "noop")) == [5, 6]


# ---------------------------------------------------------------------------------------------------
# Variant ids name library files: distinct specs must get distinct ids, over every field of every kind.


def _floats(*near: float, low: float, high: float) -> st.SearchStrategy[float]:
    """Arbitrary floats in [low, high], and the given values with their next neighbours (ids must tell them apart)."""
    close = [value for x in near for value in (x, math.nextafter(x, math.inf)) if low <= value <= high]
    return st.one_of(st.sampled_from(close), st.floats(low, high, allow_nan=False, allow_infinity=False))


_SMALL = st.integers(1, 4)
_FORMATS = st.sampled_from(WEIGHT_FORMATS)
# Per kind, one strategy per field (a function of the fields drawn before it where one depends on another).
FIELD_VALUES = {
    MambaSpec: {
        "num_heads": st.sampled_from([1, 2, 4, 6]),
        "head_dim": _SMALL,
        "state_size": _SMALL,
        "n_groups": st.sampled_from([1, 2]),
        "conv_kernel": _SMALL,
        "chunk_size": st.sampled_from([16, 64, 128]),
        "conv_bias": st.booleans(),
        "proj_bias": st.booleans(),
        "dt_clamp_min": _floats(0.0, 1e-3, low=0.0, high=0.1),
        "dt_clamp_max": st.one_of(st.none(), _floats(0.1, 1.0, low=0.1, high=100.0)),
        "weight_format": _FORMATS,
    },
    AttentionSpec: {
        "num_heads": st.sampled_from([1, 2, 4]),
        "num_kv_heads": st.sampled_from([1, 2]),
        "head_dim": _SMALL,
        "bias": st.booleans(),
        "rope_theta": st.one_of(st.none(), _floats(10000.0, 1e6, low=1.0, high=1e7)),
        "rotary_fraction": _floats(1.0, 0.5, low=0.01, high=1.0),
        "window": st.one_of(st.none(), st.integers(1, 5)),
        "weight_format": _FORMATS,
    },
    MoESpec: {
        "num_experts": st.sampled_from([1, 2, 4]),
        "top_k": _SMALL,
        "expert_width": lambda drawn: st.one_of(
            _SMALL,
            st.lists(_SMALL, min_size=drawn["num_experts"], max_size=drawn["num_experts"]).map(tuple),
        ),
        "shared_width": st.integers(0, 3),
        "latent_size": st.one_of(st.none(), _SMALL),
        "routed_scaling_factor": _floats(1.0, 2.5, low=0.01, high=10.0),
        "norm_topk_prob": st.booleans(),
        "n_group": st.sampled_from([1, 2]),
        "topk_group": st.sampled_from([1, 2]),
        "weight_format": _FORMATS,
    },
    MLPSpec: {
        "width": _SMALL,
        "activation": st.sampled_from(MLPSpec.ACTIVATIONS),
        "bias": st.booleans(),
        "weight_format": _FORMATS,
    },
    LinearSpec: {"bias": st.booleans(), "weight_format": _FORMATS},
    NoOpSpec: {},
}


def _value(draw, cls: type, name: str, drawn: dict):
    strategy = FIELD_VALUES[cls][name]
    return draw(
        strategy(drawn) if callable(strategy) and not isinstance(strategy, st.SearchStrategy) else strategy
    )


@st.composite
def block_specs(draw, cls: type | None = None):
    """A valid spec of kind `cls` (any kind when None), every field drawn."""
    cls = cls or draw(st.sampled_from(list(FIELD_VALUES)))
    drawn: dict = {}
    for name in FIELD_VALUES[cls]:
        drawn[name] = _value(draw, cls, name, drawn)
    try:
        return cls(**drawn)
    except SpecError:
        reject()


@st.composite
def neighbours(draw):
    """Two valid specs of one kind that differ in at most one field (the hardest case for an id)."""
    first = draw(block_specs())
    if not FIELD_VALUES[type(first)]:
        return first, first
    name = draw(st.sampled_from(list(FIELD_VALUES[type(first)])))
    drawn = {f.name: getattr(first, f.name) for f in dataclasses.fields(first)}
    try:
        return first, dataclasses.replace(first, **{name: _value(draw, type(first), name, drawn)})
    except SpecError:
        reject()


def test_the_strategies_draw_every_field_of_every_kind() -> None:
    from puzzle.spec import BLOCK_SPEC_TYPES

    assert set(FIELD_VALUES) == set(BLOCK_SPEC_TYPES.values())
    for cls, values in FIELD_VALUES.items():
        assert list(values) == [f.name for f in dataclasses.fields(cls)], cls.__name__


# What a file name may hold on any POSIX file system, readable: `kind:token:token`, no '/', no space.
SAFE_ID = re.compile(r"[a-z]+(:[A-Za-z0-9._+-]+)*")


@settings(max_examples=400, deadline=None)
@given(neighbours())
def test_specs_that_differ_in_one_field_get_different_ids(pair) -> None:
    first, second = pair
    assert (first.short_name() == second.short_name()) == (first == second), (first, second)


@settings(max_examples=200, deadline=None)
@given(st.lists(block_specs(), min_size=2, max_size=12))
def test_distinct_specs_get_distinct_filesystem_safe_ids(specs) -> None:
    ids = {spec: spec.short_name() for spec in specs}
    assert len(set(ids.values())) == len(ids)
    for spec, name in ids.items():
        assert SAFE_ID.fullmatch(name) and len(name) <= 200, name
        again = block_from_dict(json.loads(json.dumps(block_to_dict(spec))))
        assert again == spec and again.short_name() == name  # stable through JSON


def test_every_non_default_field_shows_in_the_id() -> None:
    """Fields a child may change without changing the core (chunk size, router groups, scaling) are spelt out."""
    mamba = MambaSpec(num_heads=4, head_dim=8, state_size=16)
    assert dataclasses.replace(mamba, chunk_size=64).short_name() == "mamba:h4:p8:n16:g1:chunk64"
    assert (
        dataclasses.replace(
            mamba, conv_kernel=3, conv_bias=False, proj_bias=True, dt_clamp_max=0.5
        ).short_name()
        == "mamba:h4:p8:n16:g1:conv3:noconvbias:projbias:dtmax0.5"
    )
    moe = MoESpec(num_experts=8, top_k=2, expert_width=16)
    assert (
        dataclasses.replace(moe, norm_topk_prob=False, n_group=4).short_name()
        == "moe:e8:k2:w16:nonormtopk:groups4"
    )
    assert AttentionSpec(4, 2, 8, bias=True, rope_theta=1e4).short_name() == "attn:q4:kv2:d8:bias:rope10000"
    assert MLPSpec(width=8, activation="silu").short_name() == "mlp:w8:silu"
    assert LinearSpec(bias=True).short_name() == "linear:bias"


# ---------------------------------------------------------------------------------------------------
# Numbers and containers of the wrong type are SpecErrors naming the field, not TypeErrors later.

VALID = {
    MambaSpec: {"num_heads": 4, "head_dim": 8, "state_size": 16},
    AttentionSpec: {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8},
    MoESpec: {"num_experts": 4, "top_k": 2, "expert_width": 8},
    MLPSpec: {"width": 8},
    LinearSpec: {},
    NoOpSpec: {},
    ModelSpec: {"vocab_size": 10, "hidden_size": 8},
}
FLOAT_FIELDS = [(cls, f.name) for cls in VALID for f in dataclasses.fields(cls) if "float" in str(f.type)]


def test_the_float_fields_are_all_checked_below() -> None:
    assert {f"{cls.__name__}.{name}" for cls, name in FLOAT_FIELDS} == {
        "MambaSpec.dt_clamp_min",
        "MambaSpec.dt_clamp_max",
        "AttentionSpec.rope_theta",
        "AttentionSpec.rotary_fraction",
        "MoESpec.routed_scaling_factor",
        "ModelSpec.norm_eps",
    }


@pytest.mark.parametrize(("cls", "name"), FLOAT_FIELDS, ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("1e-5", r"must be a number(?: or None)?, found '1e-5' \(str\)"),
        (True, r"must be a number(?: or None)?, found True \(bool\)"),
        ([0.5], r"must be a number(?: or None)?, found \[0.5\] \(list\)"),
        (math.nan, "must be finite, found nan"),
        (-math.inf, "must be finite, found -inf"),
        (-1.0, "must be (positive|>= 0)"),
    ],
)
def test_every_float_field_refuses_what_is_not_a_number(cls, name: str, bad, message: str) -> None:
    with pytest.raises(SpecError, match=rf"{cls.__name__}\.{name} {message}"):
        cls(**VALID[cls], **{name: bad})
    # And through JSON, where strings and booleans come from.
    if cls is not ModelSpec:
        with pytest.raises(SpecError, match=rf"{cls.__name__}\.{name} {message}"):
            block_from_dict({"kind": cls.kind, **VALID[cls], name: bad})


def test_numbers_are_stored_as_floats_and_infinity_means_no_clamp() -> None:
    assert ModelSpec(10, 8, [], norm_eps=1) == ModelSpec(10, 8, [], norm_eps=1.0)
    assert isinstance(ModelSpec(10, 8, [], norm_eps=1).norm_eps, float)
    assert isinstance(AttentionSpec(4, 2, 8, rope_theta=10000).rope_theta, float)
    unbounded = MambaSpec(4, 8, 16, dt_clamp_max=math.inf)
    assert unbounded == MambaSpec(4, 8, 16) and unbounded.dt_clamp_max is None
    # Ranges that are numbers but no block: an empty clamp window, a rotary fraction above one.
    with pytest.raises(SpecError, match=r"MambaSpec\.dt_clamp_max must be positive, found 0.0"):
        MambaSpec(4, 8, 16, dt_clamp_max=0)
    with pytest.raises(
        SpecError, match=r"AttentionSpec\.rotary_fraction must be positive and <= 1, found 1.5"
    ):
        AttentionSpec(4, 2, 8, rotary_fraction=1.5)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: ModelSpec(10, 8, blocks=None),
            r"ModelSpec\.blocks must be a sequence of block specs, found NoneType",
        ),
        (
            lambda: ModelSpec(10, 8, blocks="M*"),
            r"ModelSpec\.blocks must be a sequence of block specs, found str",
        ),
        (lambda: ModelSpec(10, 8, blocks={"kind": "mlp"}), r"ModelSpec\.blocks .* found dict"),
        (lambda: ModelSpec(10, 8, blocks=5), r"ModelSpec\.blocks .* found int"),
        (lambda: ModelSpec(True, 8), r"ModelSpec\.vocab_size must be a positive integer, found True"),
        (lambda: ModelSpec(10, 8.0), r"ModelSpec\.hidden_size must be a positive integer, found 8\.0"),
        (lambda: MambaSpec(4, 8, True), r"MambaSpec\.state_size must be a positive integer, found True"),
        (
            lambda: MoESpec(4, 2, "8"),
            r"MoESpec\.expert_width must be a positive integer or a list .* \(str\)",
        ),
        (
            lambda: MoESpec(4, 2, {8}),
            r"MoESpec\.expert_width must be a positive integer or a list .* \(set\)",
        ),
        (lambda: MoESpec(4, 2, 8, shared_width=False), r"MoESpec\.shared_width must be an integer >= 0"),
        (lambda: MLPSpec(8, activation=["relu2"]), r"MLPSpec\.activation \['relu2'\] is not supported"),
    ],
)
def test_wrong_types_are_spec_errors_naming_the_field(build, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        build()


# ---------------------------------------------------------------------------------------------------
# Variant: what the stages pass around.


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 200), block_specs())
def test_variants_round_trip_through_json_and_are_dict_keys(block_index: int, spec) -> None:
    variant = Variant(block_index, spec)
    again = Variant.from_dict(json.loads(json.dumps(variant.to_dict(), allow_nan=False)))
    assert again == variant and hash(again) == hash(variant) and again.id == variant.id == spec.short_name()
    assert {variant: 1}[again] == 1
    assert Variant(block_index + 1, spec) != variant


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Variant(-1, NoOpSpec()), r"Variant\.block_index must be an integer >= 0, found -1"),
        (lambda: Variant(True, NoOpSpec()), r"Variant\.block_index must be an integer >= 0, found True"),
        (lambda: Variant("3", NoOpSpec()), r"Variant\.block_index must be an integer >= 0, found '3'"),
        (lambda: Variant(3, {"kind": "noop"}), r"Variant\.spec must be a block spec, found dict"),
        (lambda: Variant.from_dict([3]), "a variant must be a JSON object, found list"),
        (lambda: Variant.from_dict({"block_index": 3}), "a variant is missing required key 'spec'"),
        (
            lambda: Variant.from_dict({"block_index": 3, "spec": {"kind": "noop"}, "score": 1.0}),
            r"unknown key\(s\) \['score'\] in a variant",
        ),
        (
            lambda: Variant.from_dict(
                {"block_index": 3, "id": "mlp:w8", "spec": {"kind": "mlp", "width": 16}}
            ),
            "variant of block 3: id 'mlp:w8' does not match its spec, whose id is 'mlp:w16'",
        ),
    ],
)
def test_variant_errors_name_the_problem(build, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        build()
