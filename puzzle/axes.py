"""The pruning axes of each block kind: the spec fields a child may shrink, and which of them the space offers.

One table, `PRUNING_AXES`, keyed by spec type, read by both sides of the contract: `puzzle.prune.init`
derives a child that differs from its parent on these fields only, and `puzzle.space` enumerates the
`searched` ones (in the table's order). An axis init_child can follow but the space does not offer
(Mamba `chunk_size`: a kernel setting with no weights; attention `num_heads`: query heads, which the
Puzzle search does not vary) is `searched=False`, so a space or a hand-made child may still use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from puzzle.spec import (
    AttentionSpec,
    BlockSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    MoESpec,
    NoOpSpec,
    kind_entry,
)


def _mamba_heads(spec: MambaSpec, value: int) -> str | None:
    if value % spec.n_groups:
        return f"heads must be whole heads per group: not a multiple of n_groups {spec.n_groups}"
    return None


def _kv_heads(spec: AttentionSpec, value: int) -> str | None:
    if spec.num_kv_heads % value:
        return f"KV heads are merged in equal groups: must divide the parent's {spec.num_kv_heads}"
    return None


def _experts(spec: MoESpec, value: int) -> str | None:
    if spec.n_group > 1:
        return f"removing experts from a group-limited router (n_group={spec.n_group}) is not supported"
    if not spec.is_uniform:
        return "the parent has per-expert widths; removing experts needs one width"
    return None


@dataclass(frozen=True)
class Axis:
    """One spec field a child may make smaller than its parent's.

    `size`: a channel count, so the space also takes `<name>_fraction` and rounds to its multiple;
    `zero_allowed`: 0 is a real choice (no shared expert); `searched`: the search space offers it;
    `parent_rule`: why a parent block cannot take a smaller `value` on this axis (None: it can);
    `unbounded`: None is a value, larger than every integer (an attention window of None attends to
    the whole context), where elsewhere None means the field is absent (no latent projection).
    """

    name: str
    size: bool = False
    zero_allowed: bool = False
    searched: bool = True
    parent_rule: Callable[[BlockSpec, int], str | None] | None = None
    unbounded: bool = False

    def above(self, value: int | None, bound: int | None) -> bool:
        """Whether `value` is larger than `bound` on this axis (None counts as infinite when `unbounded`)."""
        if self.unbounded and (value is None or bound is None):
            return value is None and bound is not None
        return value > bound


# Kinds in the order the search space lists them (error messages, `SearchSpace.to_dict`).
PRUNING_AXES: dict[type, tuple[Axis, ...]] = {
    MambaSpec: (
        Axis("state_size"),
        Axis("num_heads", parent_rule=_mamba_heads),
        Axis("head_dim"),
        Axis("chunk_size", searched=False),
    ),
    MoESpec: (
        Axis("num_experts", parent_rule=_experts),
        Axis("top_k"),
        Axis("expert_width", size=True),
        Axis("shared_width", size=True, zero_allowed=True),
        Axis("latent_size", size=True),
    ),
    AttentionSpec: (
        Axis("num_kv_heads", parent_rule=_kv_heads),
        Axis("num_heads", searched=False),
        Axis("window", unbounded=True),  # sliding-window attention; the parent's weights unchanged
    ),
    MLPSpec: (Axis("width", size=True),),
    LinearSpec: (),
    NoOpSpec: (),
}


def pruning_axes(spec: BlockSpec) -> tuple[Axis, ...]:
    """The axes of `spec`'s kind; SpecError for a type without an entry in PRUNING_AXES."""
    return kind_entry(PRUNING_AXES, spec, "no pruning axes for block spec type")


def pruning_axis(spec: BlockSpec, name: str) -> Axis:
    """The axis `name` of `spec`'s kind (KeyError naming the kind's axes if it has none of that name)."""
    for axis in pruning_axes(spec):
        if axis.name == name:
            return axis
    raise KeyError(
        f"{spec.kind} blocks have no pruning axis {name!r}: {[a.name for a in pruning_axes(spec)]}"
    )


def _check_axes_are_fields() -> None:
    # A renamed spec field would otherwise make an axis silently do nothing.
    for spec_type, axes in PRUNING_AXES.items():
        fields = {f.name for f in dataclasses.fields(spec_type)}
        names = [axis.name for axis in axes]
        if not set(names) <= fields or len(set(names)) != len(names):
            raise TypeError(f"pruning axes {names} of {spec_type.__name__} are not distinct fields of it")


_check_axes_are_fields()
