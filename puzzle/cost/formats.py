"""Storage formats and quantisation recipes: bytes per element, bytes of a tensor, and which format each tensor role gets."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from puzzle.formats import KEEP_DTYPE_ROLES, NVFP4_BLOCK, QUANTIZED_ROLES, ROLES
from puzzle.spec import DEFAULT_WEIGHT_FORMAT, SpecError, weight_format_of

# Bytes per element of plain formats.
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
FORMATS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8", "nvfp4")
TENSOR_SCALE_BYTES = 4  # one fp32 scale: per output channel (row) of an fp8 tensor, per nvfp4 tensor


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a plain dtype name ("fp32", "bf16", "fp16", "fp8")."""
    if dtype not in DTYPE_BYTES:
        raise SpecError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def tensor_bytes(shape: tuple[int, ...], fmt: str) -> float:
    """Bytes a tensor of `shape` takes in format `fmt`, scales included.

    fp8: 1 byte per value + one fp32 scale per output channel (row; rows = all but the last dim), the
    granularity `puzzle.quant` and the exported checkpoint use. nvfp4: 4-bit values, one fp8 scale per 16
    consecutive values of a row (rows = all but the last dim; a partial block still has a scale),
    plus one fp32 per-tensor scale. 1-D tensors are never block-quantised: they stay bf16.
    """
    numel = math.prod(shape)
    if fmt in ("fp8", "nvfp4") and len(shape) < 2:
        return 2.0 * numel
    if fmt == "fp8":
        return float(numel + TENSOR_SCALE_BYTES * (numel // shape[-1]))
    if fmt in DTYPE_BYTES:
        return float(DTYPE_BYTES[fmt] * numel)
    if fmt == "nvfp4":
        cols = shape[-1]
        rows = numel // cols
        return numel / 2 + rows * math.ceil(cols / NVFP4_BLOCK) + TENSOR_SCALE_BYTES
    raise SpecError(f"unknown storage format {fmt!r}; choose one of {list(FORMATS)}")


@dataclass(frozen=True)
class QuantRecipe:
    """Which storage format each tensor role gets. `formats` is a tuple of (role, format) pairs covering ROLES."""

    name: str
    formats: tuple[tuple[str, str], ...]
    description: str = ""

    def __post_init__(self) -> None:
        given = dict(self.formats)
        missing = [role for role in ROLES if role not in given]
        unknown = sorted(set(given) - set(ROLES))
        if missing or unknown:
            raise SpecError(f"QuantRecipe {self.name!r}: missing roles {missing}, unknown roles {unknown}")
        for role, fmt in given.items():
            if fmt not in FORMATS:
                raise SpecError(
                    f"QuantRecipe {self.name!r}: role {role!r} has unknown format {fmt!r}; "
                    f"choose one of {list(FORMATS)}"
                )

    @functools.cached_property
    def _by_role(self) -> dict[str, str]:
        return dict(self.formats)

    def format_of(self, role: str) -> str:
        """The storage format of tensors with this role (see ROLES)."""
        return self._by_role[role]

    @classmethod
    def build(cls, name: str, default: str, description: str = "", **overrides: str) -> QuantRecipe:
        """A recipe with `default` for every role except the given overrides; the router bias stays fp32."""
        formats = dict.fromkeys(ROLES, default)
        formats["router_bias"] = "fp32"
        formats.update(overrides)
        return cls(name, tuple(formats.items()), description)


# What the quantized recipes keep in bf16: every role a weight format does not cover (puzzle.formats), but the
# router bias, an fp32 buffer in every recipe.
_KEEP_HIGH = tuple(role for role in KEEP_DTYPE_ROLES if role != "router_bias")

RECIPES: dict[str, QuantRecipe] = {
    recipe.name: recipe
    for recipe in (
        QuantRecipe.build("fp32", "fp32", "every tensor fp32 (the CPU reference path)"),
        QuantRecipe.build(
            "bf16",
            "bf16",
            "every tensor bf16 except the router's weight and bias, fp32 (as puzzle and transformers >= 5.25 hold them)",
            router="fp32",
        ),
        QuantRecipe.build(
            "fp8",
            "fp8",
            "every linear layer fp8 with a scale per output channel; embeddings, lm_head, norms, router, "
            "conv and SSM parameters bf16",
            **dict.fromkeys(_KEEP_HIGH, "bf16"),
        ),
        QuantRecipe.build(
            "nvfp4",
            "nvfp4",
            "every linear layer nvfp4 (experts, shared expert, latent, Mamba, attention projections); "
            "embeddings, lm_head, norms, router, conv and SSM parameters bf16",
            **dict.fromkeys(_KEEP_HIGH, "bf16"),
        ),
        QuantRecipe.build(
            "nvfp4-experts",
            "fp8",
            "routed experts nvfp4, every other linear layer fp8; embeddings, lm_head, norms, router, "
            "conv and SSM parameters bf16",
            routed_expert="nvfp4",
            **dict.fromkeys(_KEEP_HIGH, "bf16"),
        ),
    )
}


def get_recipe(recipe: str | QuantRecipe) -> QuantRecipe:
    """A named recipe ("fp32", "bf16", "fp8", "nvfp4", "nvfp4-experts"); a QuantRecipe passes through."""
    if isinstance(recipe, QuantRecipe):
        return recipe
    if recipe not in RECIPES:
        raise SpecError(f"unknown quantisation recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[recipe]


@functools.lru_cache(maxsize=256)
def with_weight_format(recipe: QuantRecipe, weight_format: str) -> QuantRecipe:
    """`recipe` with the roles a block's weight format covers (QUANTIZED_ROLES) in `weight_format`.

    "bf16" (the default format) leaves the recipe as it is: a block without a quantized format is
    priced as the recipe says, so costs of shape-only searches do not change.
    """
    if weight_format == DEFAULT_WEIGHT_FORMAT:
        return recipe
    if weight_format not in FORMATS:
        raise SpecError(f"unknown weight format {weight_format!r}; choose one of {list(FORMATS)}")
    formats = tuple((role, weight_format if role in QUANTIZED_ROLES else fmt) for role, fmt in recipe.formats)
    if formats == recipe.formats:
        return recipe
    return QuantRecipe(f"{recipe.name}+{weight_format}", formats, recipe.description)


def block_recipe(spec: object, recipe: str | QuantRecipe) -> QuantRecipe:
    """The recipe one block's tensors are priced in: `recipe`, its matmul weights in the block's
    `weight_format` when that is not bf16 (`puzzle.spec.weight_format_of`)."""
    return with_weight_format(get_recipe(recipe), weight_format_of(spec))
