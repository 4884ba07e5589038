"""Budgets priced on another model's shapes (`CostModel.price_as`): a small parent with a full-size model's
block pattern searched as if it were that model, so that a rehearsal of a full-size run returns a child under
the full-size budgets.

Block i's variant is priced as the same change to the full-size model's block i: the fields in which the
variant differs from its own parent block, set on the full-size block (`moe:k16:w2048` of a tiny MoE block is
Super's block at top-k 16 and width 2048); a removed block or a linear replacement is priced as itself (its
cost depends on the hidden size only, the full-size model's). The change is only the same where the two
parents agree: a variant that changes an axis on which the small parent's block differs from the full-size
one (a number of experts when the small parent has fewer) is refused, as is a full-size model of another
block pattern. The search's choices keep the small parent's variants; only their costs are full-size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from puzzle.cost.serving import CostModel
from puzzle.search.types import SearchError
from puzzle.spec import BlockSpec, LinearSpec, ModelSpec, NoOpSpec, SpecError

# Replacements whose cost depends on the model's hidden size only: priced as they are.
_SHAPELESS = (NoOpSpec, LinearSpec)


def read_price_model(path: Path) -> ModelSpec:
    """The spec of `path`: a checkpoint folder (its config.json, no weight read) or a config.json file."""
    from puzzle import nemotron_h  # late: the config reader, which a search without price_as never needs

    where = f"hardware.price_as {path}"
    try:
        config = nemotron_h.read_config_file(path) if path.is_file() else nemotron_h.read_config(path)
    except ValueError as error:  # CheckpointError: a missing folder, no config.json, another model type
        raise SearchError(f"{where}: {error}") from None
    return nemotron_h.spec_from_config(config, str(path))


def priced_model(parent: ModelSpec, cost_model: CostModel) -> ModelSpec:
    """The model `cost_model` prices budgets on: its `price_as` model's spec, else `parent` itself."""
    return parent if cost_model.price_as is None else read_price_model(cost_model.price_as)


def priced_variants(
    parent: ModelSpec, variants: Sequence[Sequence[BlockSpec]], model: ModelSpec
) -> list[list[BlockSpec]]:
    """`variants[i]` (candidates of `parent`'s block i) as the same changes to `model`'s block i, in the same
    order: the specs the search prices them by. SearchError naming the block and the field otherwise."""
    if model is parent:
        return [list(candidates) for candidates in variants]
    own, full = parent.pattern, model.pattern
    if own != full:
        first = next((i for i, (a, b) in enumerate(zip(own, full)) if a != b), min(len(own), len(full)))
        raise SearchError(
            f"hardware.price_as: the parent's block pattern {own} ({len(own)} blocks) is not the priced "
            f"model's {full} ({len(full)} blocks): they first differ at block {first}"
        )
    return [
        [full_size_block(parent.blocks[i], variant, model.blocks[i], i) for variant in candidates]
        for i, candidates in enumerate(variants)
    ]


def full_size_block(own: BlockSpec, variant: BlockSpec, full: BlockSpec, index: int = 0) -> BlockSpec:
    """`variant` of the parent's block `own` as the same change to `full`, the priced model's block (see the
    module's docstring)."""
    where = f"hardware.price_as: block {index} variant {variant.short_name()}"
    if type(variant) is not type(own):
        if isinstance(variant, _SHAPELESS):
            return variant
        raise SearchError(f"{where}: a {variant.kind} replacing a {own.kind} block has no full-size shape")
    changes = {}
    for item in dataclasses.fields(variant):
        value, parents = getattr(variant, item.name), getattr(own, item.name)
        if value == parents:
            continue
        if getattr(full, item.name) != parents:
            raise SearchError(
                f"{where}: it changes {item.name} from the parent's {parents!r}, but the priced model's "
                f"block has {getattr(full, item.name)!r}: a variant is priced as the same change only on "
                "axes where the two parents agree"
            )
        changes[item.name] = value
    try:
        return dataclasses.replace(full, **changes)
    except SpecError as error:
        raise SearchError(f"{where}: {error}") from None
