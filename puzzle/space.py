"""The search space: which smaller variants of each parent block the library holds.

A `SearchSpace` (from YAML or a dict) lists, per block kind, candidate values per axis; `variants`
turns it into `puzzle.spec.Variant`s of one parent block, `all_variants` into {block: [Variant, ...]}
for the whole model. Schema (every key optional; an unknown key is an error listing the valid ones):

```yaml
rounding: 128                 # sizes made from fractions are multiples of this; absolute sizes must be
kinds:
  mamba:     {state_size: [128, 96, 64], num_heads: [...], head_dim: [...]}
  moe:
    top_k: {min: 4, max: 22, step: 2}       # a list, one integer, or an inclusive range
    expert_width: [2048, 1536]              # absolute...
    expert_width_fraction: [0.75, 0.5]      # ...or a fraction of the parent's (also shared_width, latent_size)
    num_experts: [...]
    shared_width: [...]                     # 0 = drop the shared expert
    latent_size: [...]
    width_profiles:                         # a width per expert: experts ranked by importance,
      - [{experts: 0.25, width_fraction: 1.0}, {experts: 0.75, width_fraction: 0.5}]  # top 25% full width
    weight_format: [bf16, nvfp4]            # formats of the matmul weights (default: the parent's, bf16)
    mode: coupled                           # or decoupled
    noop: false                             # also offer a removed block
    linear: false                           # also offer a hidden x hidden linear replacement
    rounding: 64                            # this kind's own multiple (default: the top-level one)
  attention: {num_kv_heads: [1], window: [4096]}   # window: sliding-window attention (the parent's: full)
  mlp:       {width: [...], width_fraction: [...]}
overrides:
  - {blocks: [0, 87], freeze: true}         # only the parent's shape
  - {blocks: [12], moe: {top_k: [16, 8]}}   # this block's kind space, replacing the one above
```

Semantics. The parent's value is always a candidate on every axis, and the parent's shape is always
the first variant. `coupled` takes the product of the axes (combinations a block cannot take, such as
top_k above num_experts, are left out); `decoupled` varies one axis at a time, the others at the
parent's value (the Puzzle paper's two modes). Values are ordered largest first, duplicates (after
rounding) removed, then the linear and no-op replacements. A kind absent from `kinds` keeps the parent's
shape only. `weight_format` multiplies the shapes (linear replacement included): each shape in the parent's
format (bf16) then in each other format listed, so a variant is a shape plus a format (`moe:e8:k2:w16:nvfp4`);
which tensors a format covers is `puzzle.formats.QUANTIZED_ROLES`. A shape whose covered weights
have an input dimension that is not a multiple of 16 has no nvfp4 variant (NVFP4's block of 16). An override replaces the kind space of its blocks (axes it does not list stay at the
parent's value); a block may appear in one override only.

Width profiles. `init_child` reads a tuple `MoESpec.expert_width` as one width per child expert, in
expert-index order, so a profile becomes a concrete spec only once experts are ranked: `variants`
takes the parent's importance (`puzzle.prune`: the `expert` score, the same ranking `init_child` uses
to choose the kept experts) and assigns the tier widths by rank over the kept experts. Such a
variant's id carries a digest of its widths (`moe:e512:k22:w2016avg.1a2b...`): stable for one parent
and one importance measurement. Asking for a profile variant without importance is an error.
Tier sizes: the boundaries are the cumulative fractions times the number of experts, rounded half up.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from puzzle.axes import PRUNING_AXES, Axis
from puzzle.spec import (
    BLOCK_SPEC_TYPES,
    WEIGHT_FORMATS,
    AttentionSpec,
    BlockSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
    SpecError,
    Variant,
    kind_entry,
    takes_weight_format,
    weight_format_of,
)


class SpaceError(SpecError):
    """A search space that is malformed, or that asks a parent block for a shape it cannot take. `key`: the
    path of the offending key when the message does not start with it (an unknown key's own path), so that
    a config error can name that key's line."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# Derived from `puzzle.axes.PRUNING_AXES` (the one axis table): per kind name, the axes the space offers,
# in the order variants are enumerated; `SIZE_AXES` also take `<axis>_fraction` and obey the rounding
# multiple. Linear and no-op blocks have no axis, so no kind space (they are options of the others).
KIND_AXES: dict[str, tuple[str, ...]] = {
    spec_type.kind: tuple(axis.name for axis in axes if axis.searched)
    for spec_type, axes in PRUNING_AXES.items()
    if any(axis.searched for axis in axes)
}
_AXES: dict[str, dict[str, Axis]] = {
    spec_type.kind: {axis.name: axis for axis in axes} for spec_type, axes in PRUNING_AXES.items()
}
SIZE_AXES: frozenset[str] = frozenset(a.name for axes in PRUNING_AXES.values() for a in axes if a.size)
# Axes where 0 is a real choice (no shared expert).
_ZERO_ALLOWED = frozenset(a.name for axes in PRUNING_AXES.values() for a in axes if a.zero_allowed)
MODES = ("coupled", "decoupled")
_KIND_OPTIONS = ("weight_format", "mode", "noop", "linear", "rounding")
_TIER_KEYS = ("experts", "width", "width_fraction")


def _keys_of(kind: str) -> list[str]:
    """The valid keys of a kind space, in schema order."""
    keys: list[str] = []
    for axis in KIND_AXES[kind]:
        keys.append(axis)
        if axis in SIZE_AXES:
            keys.append(f"{axis}_fraction")
    if SPACE_RULES[BLOCK_SPEC_TYPES[kind]].profiles:
        keys.append("width_profiles")
    return keys + list(_KIND_OPTIONS)


def _check_keys(where: str, data: Any, allowed: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise SpaceError(f"{where} must be a mapping with keys {list(allowed)}, found {type(data).__name__}")
    unknown = [key for key in data if key not in allowed]
    if unknown:
        raise SpaceError(
            f"{where}: unknown key(s) {unknown}; valid keys here: {list(allowed)}", f"{where}.{unknown[0]}"
        )
    return data


def _int(where: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum > 0 else f"an integer >= {minimum}"
        raise SpaceError(f"{where} must be {what}, found {value!r}")
    return value


def _fraction(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) <= 1:
        raise SpaceError(f"{where} must be a fraction in (0, 1], found {value!r}")
    return float(value)


def _int_values(where: str, data: Any, minimum: int) -> tuple[int, ...]:
    """A list of integers, one integer, or an inclusive range {min, max, step}; sorted largest first."""
    if isinstance(data, Mapping):
        spec = _check_keys(where, data, ("min", "max", "step"))
        if "min" not in spec or "max" not in spec:
            raise SpaceError(f"{where}: a range needs 'min' and 'max' (and optionally 'step')")
        low, high = _int(f"{where}.min", spec["min"], minimum), _int(f"{where}.max", spec["max"], minimum)
        step = _int(f"{where}.step", spec.get("step", 1), 1)
        if high < low:
            raise SpaceError(f"{where}: max ({high}) is below min ({low})")
        values = list(range(low, high + 1, step))
    elif isinstance(data, (list, tuple)):
        values = [_int(f"{where}[{i}]", value, minimum) for i, value in enumerate(data)]
    else:
        values = [_int(where, data, minimum)]
    return tuple(sorted(set(values), reverse=True))


def _fraction_values(where: str, data: Any) -> tuple[float, ...]:
    items = data if isinstance(data, (list, tuple)) else [data]
    return tuple(sorted({_fraction(f"{where}[{i}]", v) for i, v in enumerate(items)}, reverse=True))


def _weight_formats(where: str, data: Any) -> tuple[str, ...]:
    """A format name or a list of them (`puzzle.spec.WEIGHT_FORMATS`), in that table's order."""
    items = data if isinstance(data, (list, tuple)) else [data]
    for i, item in enumerate(items):
        if not isinstance(item, str) or item not in WEIGHT_FORMATS:
            raise SpaceError(f"{where}[{i}] must be one of {list(WEIGHT_FORMATS)}, found {item!r}")
    return tuple(fmt for fmt in WEIGHT_FORMATS if fmt in items)


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SpaceError(f"{where} must be true or false, found {value!r}")
    return value


@dataclass(frozen=True)
class Tier:
    """One tier of a width profile: a fraction of the experts (by rank) and their width.

    Exactly one of `width` (channels) or `width_fraction` (of the parent's expert width) is set.
    """

    experts: float
    width: int | None = None
    width_fraction: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"experts": self.experts}
        if self.width is not None:
            out["width"] = self.width
        else:
            out["width_fraction"] = self.width_fraction
        return out


@dataclass(frozen=True)
class WidthProfile:
    """Per-expert widths by importance: tiers from the most important experts down; fractions sum to 1."""

    tiers: tuple[Tier, ...]

    @classmethod
    def from_data(cls, where: str, data: Any) -> WidthProfile:
        if not isinstance(data, (list, tuple)) or not data:
            raise SpaceError(f"{where} must be a non-empty list of tiers {{experts, width | width_fraction}}")
        tiers = []
        for i, item in enumerate(data):
            at = f"{where}[{i}]"
            tier = _check_keys(at, item, _TIER_KEYS)
            if "experts" not in tier or ("width" in tier) == ("width_fraction" in tier):
                raise SpaceError(f"{at} needs 'experts' and exactly one of 'width' or 'width_fraction'")
            tiers.append(
                Tier(
                    experts=_fraction(f"{at}.experts", tier["experts"]),
                    width=_int(f"{at}.width", tier["width"], 1) if "width" in tier else None,
                    width_fraction=(
                        _fraction(f"{at}.width_fraction", tier["width_fraction"])
                        if "width_fraction" in tier
                        else None
                    ),
                )
            )
        total = sum(tier.experts for tier in tiers)
        if not math.isclose(total, 1.0, abs_tol=1e-9):
            raise SpaceError(f"{where}: the tiers' expert fractions must sum to 1, found {total:g}")
        return cls(tuple(tiers))

    def to_dict(self) -> list[dict[str, Any]]:
        return [tier.to_dict() for tier in self.tiers]

    def counts(self, num_experts: int) -> list[int]:
        """Experts per tier: cumulative fractions x num_experts, rounded half up (sums to num_experts)."""
        bounds, cumulative = [0], 0.0
        for tier in self.tiers:
            cumulative += tier.experts
            bounds.append(math.floor(cumulative * num_experts + 0.5))
        bounds[-1] = num_experts
        return [b - a for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class KindSpace:
    """Candidate values per axis for one block kind (see the module docstring for the schema).

    `values[axis]`: absolute values, `fractions[axis]`: fractions of the parent's value (size axes),
    both sorted largest first; `rounding` None means the space's own multiple.
    """

    kind: str
    values: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    fractions: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    profiles: tuple[WidthProfile, ...] = ()
    weight_formats: tuple[str, ...] = ()
    mode: str = "coupled"
    noop: bool = False
    linear: bool = False
    rounding: int | None = None

    @classmethod
    def from_dict(cls, kind: str, data: Any, where: str) -> KindSpace:
        data = _check_keys(where, data, _keys_of(kind))
        values, fractions = {}, {}
        for axis in KIND_AXES[kind]:
            minimum = 0 if axis in _ZERO_ALLOWED else 1
            if axis in data and data[axis] != []:
                values[axis] = _int_values(f"{where}.{axis}", data[axis], minimum)
            key = f"{axis}_fraction"
            if key in data and data[key] != []:
                fractions[axis] = _fraction_values(f"{where}.{key}", data[key])
        raw_profiles = data.get("width_profiles", [])
        if not isinstance(raw_profiles, (list, tuple)):
            raise SpaceError(f"{where}.width_profiles must be a list of profiles (each a list of tiers)")
        profiles = []
        for i, item in enumerate(raw_profiles):
            profile = WidthProfile.from_data(f"{where}.width_profiles[{i}]", item)
            if profile not in profiles:
                profiles.append(profile)
        mode = data.get("mode", "coupled")
        if mode not in MODES:
            raise SpaceError(f"{where}.mode must be one of {list(MODES)}, found {mode!r}")
        rounding = data.get("rounding")
        return cls(
            kind=kind,
            values=values,
            fractions=fractions,
            profiles=tuple(profiles),
            weight_formats=_weight_formats(f"{where}.weight_format", data.get("weight_format", [])),
            mode=mode,
            noop=_bool(f"{where}.noop", data.get("noop", False)),
            linear=_bool(f"{where}.linear", data.get("linear", False)),
            rounding=None if rounding is None else _int(f"{where}.rounding", rounding, 1),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for axis in KIND_AXES[self.kind]:
            if axis in self.values:
                out[axis] = list(self.values[axis])
            if axis in self.fractions:
                out[f"{axis}_fraction"] = list(self.fractions[axis])
        if self.profiles:
            out["width_profiles"] = [profile.to_dict() for profile in self.profiles]
        if self.weight_formats:  # absent when unused, so a shape-only space keeps its fingerprint
            out["weight_format"] = list(self.weight_formats)
        out.update(mode=self.mode, noop=self.noop, linear=self.linear, rounding=self.rounding)
        return out


@dataclass(frozen=True)
class Override:
    """Blocks whose space differs: `freeze` (the parent's shape only) or their own `space` for one kind."""

    blocks: tuple[int, ...]
    freeze: bool = False
    space: KindSpace | None = None

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Override:
        data = _check_keys(where, data, ("blocks", "freeze", *KIND_AXES))
        if "blocks" not in data:
            raise SpaceError(f"{where} needs 'blocks' (a block index or a list of them)")
        blocks = _int_values(f"{where}.blocks", data["blocks"], 0)
        freeze = _bool(f"{where}.freeze", data.get("freeze", False))
        kinds = [kind for kind in KIND_AXES if kind in data]
        if freeze == bool(kinds) or len(kinds) > 1:
            raise SpaceError(
                f"{where} needs either 'freeze: true' or exactly one kind space ({list(KIND_AXES)}), "
                f"found {['freeze'] * freeze + kinds}"
            )
        space = KindSpace.from_dict(kinds[0], data[kinds[0]], f"{where}.{kinds[0]}") if kinds else None
        return cls(tuple(sorted(blocks)), freeze, space)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"blocks": list(self.blocks)}
        if self.freeze:
            out["freeze"] = True
        else:
            assert self.space is not None
            out[self.space.kind] = self.space.to_dict()
        return out


@dataclass(frozen=True)
class SearchSpace:
    """Candidate values per block kind and axis, per-block overrides, a rounding multiple for sizes."""

    kinds: Mapping[str, KindSpace] = field(default_factory=dict)
    overrides: tuple[Override, ...] = ()
    rounding: int = 1

    # -- loading and recording ------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any, where: str = "space") -> SearchSpace:
        """Validate and load; every error names the key path (`space.kinds.moe.top_k[2]`)."""
        data = _check_keys(where, data, ("rounding", "kinds", "overrides"))
        rounding = _int(f"{where}.rounding", data.get("rounding", 1), 1)
        raw_kinds = _check_keys(f"{where}.kinds", data.get("kinds", {}), list(KIND_AXES))
        kinds = {
            kind: KindSpace.from_dict(kind, raw_kinds[kind], f"{where}.kinds.{kind}")
            for kind in KIND_AXES
            if kind in raw_kinds
        }
        raw_overrides = data.get("overrides", [])
        if not isinstance(raw_overrides, (list, tuple)):
            raise SpaceError(f"{where}.overrides must be a list, found {type(raw_overrides).__name__}")
        overrides = tuple(
            Override.from_dict(item, f"{where}.overrides[{i}]") for i, item in enumerate(raw_overrides)
        )
        seen: dict[int, int] = {}
        for i, override in enumerate(overrides):
            for block in override.blocks:
                if block in seen:
                    raise SpaceError(
                        f"{where}.overrides: block {block} is in overrides[{seen[block]}] and overrides[{i}]; "
                        f"give each block one override"
                    )
                seen[block] = i
        return cls(kinds, overrides, rounding)

    @classmethod
    def from_yaml(cls, source: str | Path) -> SearchSpace:
        """Load a YAML file (a path); errors name the file."""
        import yaml

        path = Path(source)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as error:
            raise SpaceError(f"{path}: cannot read the search space: {error}") from error
        except yaml.YAMLError as error:
            raise SpaceError(f"{path}: not valid YAML: {error}") from error
        try:
            return cls.from_dict({} if data is None else data)
        except SpaceError as error:
            raise SpaceError(f"{path}: {error}") from error

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (ranges expanded, values sorted): `from_dict(to_dict())` equals self."""
        return {
            "rounding": self.rounding,
            "kinds": {kind: space.to_dict() for kind, space in self.kinds.items()},
            "overrides": [override.to_dict() for override in self.overrides],
        }

    # -- variants ---------------------------------------------------------------------------------------

    def space_of(self, block_index: int) -> KindSpace | None:
        """The override's kind space or the kind's for this block (None: frozen, or no override)."""
        for override in self.overrides:
            if block_index in override.blocks:
                return override.space
        return None

    def variants(self, parent: ModelSpec, block_index: int, importance: Any = None) -> list[Variant]:
        """The deduplicated variants of `parent.blocks[block_index]`, the parent's own shape first.

        `importance`: the parent's `BlockImportance` of this block or its `ModelImportance`; needed
        only by width profiles. Raises SpaceError naming the block, axis and value for a value the block
        cannot take.
        """
        if isinstance(block_index, bool) or not isinstance(block_index, int):
            raise SpaceError(f"block index must be an integer, found {block_index!r}")
        if not 0 <= block_index < parent.num_blocks:
            raise SpaceError(f"block {block_index} does not exist: the parent has {parent.num_blocks} blocks")
        self._check_overrides(parent)
        block = parent.blocks[block_index]
        frozen = any(block_index in o.blocks and o.freeze for o in self.overrides)
        space = self.space_of(block_index) or self.kinds.get(block.kind)
        if frozen or space is None:
            return [Variant(block_index, block)]
        if space.kind != block.kind:  # only an override can name another kind
            raise SpaceError(
                f"block {block_index} ({block.kind}) has an override for {space.kind} blocks; "
                f"give it a {block.kind} space or freeze it"
            )
        if hasattr(importance, "blocks"):  # a ModelImportance
            importance = importance.blocks.get(block_index)
        rounding = space.rounding if space.rounding is not None else self.rounding
        specs = _enumerate(_Block(block_index, block, rounding, importance), space)
        if space.linear:
            specs.append(LinearSpec())
        if space.noop:
            specs.append(NoOpSpec())
        shapes = list(dict.fromkeys([block, *specs]))
        unique = _with_formats(shapes, weight_format_of(block), space, parent.hidden_size)
        return [Variant(block_index, spec) for spec in unique]

    def all_variants(self, parent: ModelSpec, importance: Any = None) -> dict[int, list[Variant]]:
        """{block index: its variants} for every block of `parent` (see `variants`)."""
        return {index: self.variants(parent, index, importance) for index in range(parent.num_blocks)}

    variants_by_block = all_variants

    def _check_overrides(self, parent: ModelSpec) -> None:
        for i, override in enumerate(self.overrides):
            beyond = [b for b in override.blocks if b >= parent.num_blocks]
            if beyond:
                raise SpaceError(
                    f"space.overrides[{i}] names block(s) {beyond}; the parent has {parent.num_blocks} "
                    f"blocks (0..{parent.num_blocks - 1})"
                )


# ----------------------------------------------------------------------------------------------------------
# Enumeration: candidate values per axis (checked against the parent block), then combinations.


@dataclass(frozen=True)
class _Block:
    index: int
    spec: BlockSpec
    rounding: int
    importance: Any

    def error(self, axis: str, value: Any, why: str) -> SpaceError:
        return SpaceError(f"block {self.index} ({self.spec.kind}), axis {axis}, value {value!r}: {why}")


def _format_fits(spec: BlockSpec, fmt: str, hidden_size: int) -> bool:
    """nvfp4 needs every covered weight's input dimension to be a multiple of its 16-value block (vLLM
    allocates in_features // 16 scales, `puzzle.quant` refuses a partial block); fp8 and bf16 fit any."""
    if fmt != "nvfp4":
        return True
    from puzzle.cost.kinds import mixer_tensors
    from puzzle.formats import NVFP4_BLOCK

    covered = [t for t in mixer_tensors(spec, hidden_size) if t.covered]
    return all(t.shape[-1] % NVFP4_BLOCK == 0 for t in covered)


def _with_formats(
    specs: list[BlockSpec], parent_format: str, space: KindSpace, hidden_size: int
) -> list[BlockSpec]:
    """Each shape in the parent's format, then in the space's other formats (shape by shape, so the parent's
    own block stays first); a no-op has no weights and no format. A shape a format cannot store (nvfp4
    with an input dimension that is not a multiple of 16) is left out in that format, as coupled mode
    leaves out combinations a block cannot take."""
    formats = [parent_format, *(f for f in space.weight_formats if f != parent_format)]
    if len(formats) == 1:
        return specs
    out: list[BlockSpec] = []
    for spec in specs:
        if not takes_weight_format(spec):
            out.append(spec)
            continue
        out += [
            dataclasses.replace(spec, weight_format=fmt)
            for fmt in formats
            if fmt == parent_format or _format_fits(spec, fmt, hidden_size)
        ]
    return list(dict.fromkeys(out))


def _round_size(value: float, multiple: int, parent_value: int) -> int:
    """The nearest multiple of `multiple` (half up), at least one multiple, at most the parent's value."""
    rounded = max(multiple, multiple * math.floor(value / multiple + 0.5))
    return min(rounded, parent_value)


def _check_value(block: _Block, axis: str, value: int) -> None:
    """A value this block can take on this axis, alone (cross-axis rules are checked per combination)."""
    spec = block.spec
    parent_value = getattr(spec, axis)
    if axis == "latent_size" and parent_value is None:
        raise block.error(axis, value, "the parent has no latent projection to shrink")
    if axis == "expert_width" and not spec.is_uniform:
        raise block.error(axis, value, "the parent has per-expert widths; width axes need one width")
    if _AXES[spec.kind][axis].above(value, parent_value):
        raise block.error(axis, value, f"above the parent's {parent_value}")
    if value == parent_value:
        return
    if axis in SIZE_AXES and value % block.rounding and value != 0:
        raise block.error(axis, value, f"not a multiple of the rounding multiple {block.rounding}")
    rule = _AXES[spec.kind][axis].parent_rule
    why = rule(spec, value) if rule is not None else None
    if why is not None:
        raise block.error(axis, value, why)


def _axis_values(block: _Block, space: KindSpace, axis: str) -> list[Any]:
    """The parent's value first, then the space's values for this axis (checked), largest first."""
    parent_value = getattr(block.spec, axis)
    candidates = list(space.values.get(axis, ()))
    if space.fractions.get(axis):
        if parent_value is None:
            raise block.error(f"{axis}_fraction", space.fractions[axis][0], "the parent has no such axis")
        if axis == "expert_width" and not block.spec.is_uniform:
            raise block.error(
                f"{axis}_fraction", space.fractions[axis][0], "the parent has per-expert widths"
            )
        candidates += [
            _round_size(f * parent_value, block.rounding, parent_value) for f in space.fractions[axis]
        ]
    for value in candidates:
        _check_value(block, axis, value)
    rest = sorted(set(candidates) - {parent_value}, reverse=True)
    values: list[Any] = [parent_value, *rest]
    if axis == "expert_width" and space.profiles:
        if not block.spec.is_uniform:
            raise block.error(
                "width_profiles", space.profiles[0].to_dict(), "the parent has per-expert widths"
            )
        for profile in space.profiles:
            _profile_tier_widths(block, profile)  # checks its widths now, whatever the combinations
        values += list(space.profiles)
    return values


def _profile_tier_widths(block: _Block, profile: WidthProfile) -> list[int]:
    parent_width = block.spec.expert_width
    widths = []
    for tier in profile.tiers:
        if tier.width is not None:
            _check_value(block, "expert_width", tier.width)
            widths.append(tier.width)
        else:
            widths.append(_round_size(tier.width_fraction * parent_width, block.rounding, parent_width))
    return widths


def _expert_ranking(block: _Block, profile: WidthProfile, num_experts: int) -> list[int]:
    """Child expert positions (0..num_experts-1) from the most important down, as `init_child` keeps them."""
    importance = block.importance
    if importance is not None and getattr(importance, "kind", "moe") != "moe":
        raise block.error(
            "width_profiles", profile.to_dict(), f"the importance is of a {importance.kind} block"
        )
    if importance is None or "expert" not in importance:
        raise block.error(
            "width_profiles",
            profile.to_dict(),
            "a width profile assigns widths by expert importance; pass the parent's importance "
            "(puzzle.prune: a BlockImportance or ModelImportance with the 'expert' score)",
        )
    if getattr(importance, "kind", "moe") != "moe":
        raise block.error(
            "width_profiles", profile.to_dict(), f"the importance is of a {importance.kind} block"
        )
    scores = [float(s) for s in importance["expert"].float().tolist()]
    if len(scores) != block.spec.num_experts:
        raise block.error(
            "width_profiles",
            profile.to_dict(),
            f"the importance scores {len(scores)} experts, the block has {block.spec.num_experts}",
        )

    def ranked(indices: list[int]) -> list[int]:  # highest score first, ties: lower index first
        return sorted(indices, key=lambda j: (-scores[j], j))

    kept = sorted(ranked(list(range(len(scores))))[:num_experts])  # init_child's top_indices
    position = {j: i for i, j in enumerate(kept)}
    return [position[j] for j in ranked(kept)]


def _profile_widths(block: _Block, profile: WidthProfile, num_experts: int) -> int | tuple[int, ...]:
    """The child's `expert_width`: tier widths by rank, in child expert order (one int when uniform)."""
    tier_widths = _profile_tier_widths(block, profile)
    by_rank = [w for w, count in zip(tier_widths, profile.counts(num_experts)) for _ in range(count)]
    if len(set(by_rank)) == 1:
        return by_rank[0]  # a uniform profile is the plain width (one spec, one id)
    widths = [0] * num_experts
    for rank, position in enumerate(_expert_ranking(block, profile, num_experts)):
        widths[position] = by_rank[rank]
    return tuple(widths)


def _moe_changes(block: _Block, changes: dict[str, Any], coupled: bool) -> dict[str, Any] | None:
    """top_k above num_experts is left out (coupled) or an error; a width profile becomes concrete widths."""
    spec = block.spec
    num_experts = changes.get("num_experts", spec.num_experts)
    top_k = changes.get("top_k", spec.top_k)
    if top_k > num_experts:
        if coupled:
            return None
        raise block.error("num_experts", num_experts, f"fewer experts than the parent's top_k {top_k}")
    width = changes.get("expert_width", spec.expert_width)
    if isinstance(width, WidthProfile):
        changes["expert_width"] = _profile_widths(block, width, num_experts)
    return changes


@dataclass(frozen=True)
class SpaceRules:
    """What the search space does for one block kind beyond its axes (`puzzle.axes.PRUNING_AXES`).

    `profiles`: the kind space takes `width_profiles` (per-expert widths by importance);
    `resolve`: (block, changes, coupled) -> the changes to apply, None to leave the combination out
    (coupled mode only), for rules that span several axes.
    """

    profiles: bool = False
    resolve: Callable[[_Block, dict[str, Any], bool], dict[str, Any] | None] | None = None


SPACE_RULES: dict[type, SpaceRules] = {
    MambaSpec: SpaceRules(),
    MoESpec: SpaceRules(profiles=True, resolve=_moe_changes),
    AttentionSpec: SpaceRules(),
    MLPSpec: SpaceRules(),
    LinearSpec: SpaceRules(),
    NoOpSpec: SpaceRules(),
}


def _build(block: _Block, changes: dict[str, Any], coupled: bool) -> BlockSpec | None:
    """The parent spec with `changes`; None for a combination the block cannot take (coupled mode only)."""
    spec = block.spec
    changes = dict(changes)
    resolve = kind_entry(SPACE_RULES, spec, "no search space rules for block spec type").resolve
    if resolve is not None:
        changes = resolve(block, changes, coupled)
        if changes is None:
            return None
    try:
        return dataclasses.replace(spec, **changes)
    except SpecError as error:
        axis, value = next(iter(changes.items()))
        raise block.error(axis, value, str(error)) from error


def _enumerate(block: _Block, space: KindSpace) -> list[BlockSpec]:
    axes = KIND_AXES[space.kind]
    values = {axis: _axis_values(block, space, axis) for axis in axes}
    specs: list[BlockSpec] = []
    if space.mode == "coupled":
        for combination in itertools.product(*(values[axis] for axis in axes)):
            changes = {a: v for a, v in zip(axes, combination) if v != getattr(block.spec, a)}
            spec = _build(block, changes, coupled=True)
            if spec is not None:
                specs.append(spec)
    else:
        for axis in axes:
            for value in values[axis][1:]:
                specs.append(_build(block, {axis: value}, coupled=False))
    return specs
