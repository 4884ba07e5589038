"""Read block libraries measured by other tools into a search `Table`.

Two shapes are understood (see README, "Searching libraries measured elsewhere"):

- NVIDIA's public Puzzle demo (github NVlabs/puzzle, `examples/data/*/block_library.json`), and the
  per-block dump of older Model-Optimizer puzzletron versions, which has the same nesting:
  `{layer_id: {variant_name: {"stats": {...}, "metrics": {...}, ...}}}`. The first variant of each layer
  is taken as the parent's (relative budgets are measured against it).
- Model-Optimizer puzzletron's multi-layer `replacement_metrics_and_stats.json`:
  `{replacement_id: {"parent_layer_indices": [i], "metrics": {...}, "stats": {...}, "is_teacher": bool,
  "block_repr": str, ...}}`. Replacements are grouped by their parent layer; the teacher's is the parent.
  Replacements spanning several parent layers are refused with a clear error.

Objective and budget keys are dotted paths into each variant (`metrics.kl_div`, `stats.memory_mib`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from puzzle.search.types import SearchError, Table

# Sub-trees that describe a variant's structure, not its costs; never flattened into cost columns.
_STRUCTURE_KEYS = ("block_config", "layer_replacement", "block_repr", "parent_layer_indices", "is_teacher")


def get_path(variant: Mapping[str, Any], dotted: str) -> Any:
    """`variant["a"]["b"]` for `dotted == "a.b"`; KeyError naming the first missing part."""
    value: Any = variant
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(part)
        value = value[part]
    return value


def _numeric_leaves(tree: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    leaves: dict[str, float] = {}
    for key, value in tree.items():
        if not prefix and key in _STRUCTURE_KEYS:
            continue
        path = f"{prefix}{key}"
        kind = type(
            value
        )  # exact JSON types first: the Mapping ABC check is slow and most leaves are numbers
        if kind is float or kind is int:
            if math.isfinite(value):
                leaves[path] = float(value)
        elif kind is dict or (kind is not str and isinstance(value, Mapping)):
            leaves.update(_numeric_leaves(value, path + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            leaves[path] = float(value)  # booleans are flags, never costs
    return leaves


def _blocks_from_replacements(
    data: Mapping[str, Any], source: str
) -> dict[str, dict[str, Mapping[str, Any]]]:
    """puzzletron multi-layer replacements -> {block_i: {variant name: variant}}, teacher first."""
    grouped: dict[int, list[tuple[bool, str, Mapping[str, Any]]]] = {}
    for replacement_id, replacement in data.items():
        layers = replacement.get("parent_layer_indices")
        if not isinstance(layers, list) or not layers:
            raise SearchError(f"{source}: replacement {replacement_id!r} has no 'parent_layer_indices' list")
        if len(layers) != 1:
            raise SearchError(
                f"{source}: replacement {replacement_id!r} spans parent layers {layers}; only replacements "
                f"of a single layer are supported"
            )
        name = str(replacement.get("block_repr") or replacement_id).strip()
        grouped.setdefault(int(layers[0]), []).append(
            (bool(replacement.get("is_teacher")), name, replacement)
        )
    blocks: dict[str, dict[str, Mapping[str, Any]]] = {}
    for layer in sorted(grouped):
        entries = sorted(grouped[layer], key=lambda entry: not entry[0])  # the teacher first, order kept
        variants: dict[str, Mapping[str, Any]] = {}
        for _, name, replacement in entries:
            unique = name
            suffix = 2
            while unique in variants:  # two replacements with the same description stay distinct
                unique = f"{name} #{suffix}"
                suffix += 1
            variants[unique] = replacement
        blocks[f"block_{layer}"] = variants
    return blocks


def read_library(path: str | Path) -> dict[str, dict[str, Mapping[str, Any]]]:
    """The library file as {block: {variant name: variant dict}}, in file order, parent first."""
    path = Path(path)
    if path.is_dir():
        raise SearchError(
            f"library {path} is a directory; give the library JSON file inside it "
            f"(block_library.json or replacement_metrics_and_stats.json)"
        )
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SearchError(f"library file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SearchError(f"library file {path} is not valid JSON: {error}") from None
    except OSError as error:
        raise SearchError(f"cannot read library file {path}: {error.strerror or error}") from None
    if not isinstance(data, Mapping) or not data:
        raise SearchError(f"library file {path}: expected a non-empty JSON object of layers or replacements")
    values = list(data.values())
    if all(isinstance(value, Mapping) and "parent_layer_indices" in value for value in values):
        return _blocks_from_replacements(data, str(path))
    blocks: dict[str, dict[str, Mapping[str, Any]]] = {}
    for layer, variants in data.items():
        if not isinstance(variants, Mapping) or not variants:
            raise SearchError(
                f"library file {path}: layer {layer!r} should map variant names to "
                f'{{"stats": ..., "metrics": ...}}, found {type(variants).__name__}'
            )
        for name, variant in variants.items():
            if not isinstance(variant, Mapping):
                raise SearchError(
                    f"library file {path}: layer {layer!r} variant {name!r} should be an object, "
                    f"found {type(variant).__name__}"
                )
        blocks[str(layer)] = dict(variants)
    return blocks


def _has_path(variant: Mapping[str, Any], dotted: str) -> bool:
    try:
        get_path(variant, dotted)
    except KeyError:
        return False
    return True


def _example_keys(flat: list[tuple[str, str, Mapping[str, Any]]]) -> str:
    """A few dotted keys of the first variant, for error messages."""
    leaves = [key for key in _numeric_leaves(flat[0][2])][:4] if flat else []
    return ", ".join(repr(key) for key in leaves) or "'stats.memory_mib'"


def _value(variant: Mapping[str, Any], key: str, where: str) -> float:
    try:
        value = get_path(variant, key)
    except KeyError as error:
        raise SearchError(f"{where} has no {key!r} (missing part {error.args[0]!r})") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        found = json.dumps(value) if isinstance(value, bool) or value is None else repr(value)
        raise SearchError(f"{where}: {key!r} is {found}, expected a finite number")
    return float(value)


def library_table(
    blocks: Mapping[str, Mapping[str, Mapping[str, Any]]],
    objective: str = "metrics.kl_div",
    keys: Iterable[str] = (),
    maximize: bool = False,
    same_attributes: Iterable[str] = (),
    fixed: Mapping[str, float] | None = None,
    source: str = "library",
) -> Table:
    """A search Table: `objective` as the score, `keys` (required in every variant) plus every numeric
    `stats.*` leaf that all variants share as costs, `same_attributes` as rule attributes (missing or
    null = free)."""
    flat = [
        (layer, name, variant) for layer, variants in blocks.items() for name, variant in variants.items()
    ]
    fixed = dict(fixed or {})
    for option, names in (("--fixed", fixed), ("--same", same_attributes)):
        for key in names:
            if not any(_has_path(variant, key) for _, _, variant in flat):
                raise SearchError(
                    f"{source}: {option} key {key!r} is in no variant of the library "
                    f"(keys look like {_example_keys(flat)})"
                )
    # A fixed part is added to its cost's total, so that cost must be a column like a budgeted one.
    required = list(dict.fromkeys([*keys, *fixed]))
    leaves = [_numeric_leaves(variant) for _, _, variant in flat]
    shared: set[str] | None = None
    for numbers in leaves:
        stats = {k for k in numbers if k.startswith("stats.")}
        shared = stats if shared is None else shared & stats
    cost_keys = required + sorted((shared or set()) - set(required))

    def column(key: str) -> np.ndarray:
        # A finite number is among the variant's numeric leaves; anything else gets _value's error.
        return np.array(
            [
                numbers[key]
                if key in numbers
                else _value(variant, key, f"{source}: layer {layer!r} variant {name!r}")
                for numbers, (layer, name, variant) in zip(leaves, flat)
            ]
        )

    score = column(objective)
    costs = {key: column(key) for key in cost_keys}
    attrs: dict[str, list[Any]] = {}
    for attr in same_attributes:
        column = []
        for _, _, variant in flat:
            try:
                value = get_path(variant, attr)
            except KeyError:
                value = None
            column.append(
                value if value is None or isinstance(value, (int, float, str)) else json.dumps(value)
            )
        attrs[attr] = column
    return Table(
        block_names=tuple(blocks),
        variant_names=tuple(tuple(variants) for variants in blocks.values()),
        score=score,
        costs=costs,
        attrs=attrs,
        fixed=fixed,
        maximize=maximize,
        objective_name=objective,
    )


def load_library(
    path: str | Path,
    objective: str = "metrics.kl_div",
    keys: Iterable[str] = (),
    maximize: bool = False,
    same_attributes: Iterable[str] = (),
    fixed: Mapping[str, float] | None = None,
) -> Table:
    """Read a library file (either shape above) into a search Table."""
    return library_table(
        read_library(path), objective, keys, maximize, same_attributes, fixed, source=str(path)
    )
