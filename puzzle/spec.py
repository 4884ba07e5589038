"""The architecture as data: one frozen, hashable, JSON-round-trippable spec per block kind.

A block's spec is the whole truth about its shape. Modules are built from it (`puzzle.blocks`),
costs are computed from it (`puzzle.cost`), checkpoints record it (`puzzle.nemotron_h`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from puzzle.formats import DEFAULT_WEIGHT_FORMAT, WEIGHT_FORMATS


class SpecError(ValueError):
    """An architecture description that cannot describe a real block or model."""


def _require_positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"{owner}.{name} must be a positive integer, found {value!r}")


def _require_bools(spec: Any) -> None:
    # JSON "false" (a string) would otherwise count as True.
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.type in ("bool", bool) and not isinstance(value, bool):
            raise SpecError(f"{type(spec).__name__}.{f.name} must be true or false, found {value!r}")


def _require_number(
    spec: Any, name: str, *, minimum: float, above: bool = False, maximum: float | None = None
) -> None:
    """Field `name` of `spec` is a finite real (an int is fine, a bool or a string is not) in range; stored as float.

    Range: > minimum when `above`, else >= minimum; <= maximum when given. None passes for the
    optional fields (those whose default is None).
    """
    owner, value = type(spec).__name__, getattr(spec, name)
    optional = next(f for f in dataclasses.fields(spec) if f.name == name).default is None
    if value is None and optional:
        return
    what = "a number or None" if optional else "a number"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SpecError(f"{owner}.{name} must be {what}, found {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise SpecError(f"{owner}.{name} must be finite, found {value!r}")
    low_ok = value > minimum if above else value >= minimum
    if not low_ok or (maximum is not None and value > maximum):
        bounds = "positive" if above and minimum == 0 else f"{'>' if above else '>='} {_number(minimum)}"
        bounds += f" and <= {_number(maximum)}" if maximum is not None else ""
        raise SpecError(f"{owner}.{name} must be {bounds}, found {value!r}")
    object.__setattr__(spec, name, value)  # 1 and 1.0 are one spec; JSON and ids see a float


def _require_divisible(owner: str, name: str, value: int, divisor_name: str, divisor: int) -> None:
    if value % divisor != 0:
        raise SpecError(f"{owner}.{name} ({value}) must be divisible by {divisor_name} ({divisor})")


# The storage formats of a block's matmul weights (the weight_format axis) live with the other format facts.


def _require_weight_format(spec: Any) -> None:
    value = spec.weight_format
    if not isinstance(value, str) or value not in WEIGHT_FORMATS:
        raise SpecError(
            f"{type(spec).__name__}.weight_format must be one of {list(WEIGHT_FORMATS)}, found {value!r}"
        )


def takes_weight_format(spec: Any) -> bool:
    """Whether a block spec's kind stores matmul weights in a format (`weight_format` is one of its fields;
    a no-op has none): the one place this is decided."""
    return _kind_takes_weight_format(type(spec))


@functools.cache
def _kind_takes_weight_format(kind: type) -> bool:
    # Per class, once: the costs ask this for every block of every variant (a fields() walk is ~2.5 us).
    return dataclasses.is_dataclass(kind) and any(f.name == "weight_format" for f in dataclasses.fields(kind))


def weight_format_of(spec: Any) -> str:
    """The storage format of a block's matmul weights (`weight_format`; "bf16" for a kind without one)."""
    return spec.weight_format if takes_weight_format(spec) else DEFAULT_WEIGHT_FORMAT


# ---------------------------------------------------------------------------------------------------
# Variant ids: `kind:token:token...`, readable, filesystem-safe, one per spec (they name library files).


def _number(value: float) -> str:
    """The shortest text that reads back as `value` (repr), without a trailing `.0`: 2.5, 1e-05, 10000."""
    text = repr(value)
    return text[:-2] if text.endswith(".0") else text


def _flag(token: str) -> Callable[[Any], str]:
    # A boolean token is present only when the field differs from its default, so its name says it all.
    return lambda value: token


def _prefixed(prefix: str) -> Callable[[Any], str]:
    return lambda value: f"{prefix}{_number(value)}"


def _spec_id(spec: Any, core: Iterable[str]) -> str:
    """`core` tokens, then one token for each field in the class's `ID_TOKENS` that differs from its default.

    Fields in `ID_CORE` are spelt by `core`; every other field has a token (checked at import, below),
    so two specs that differ in any field get different ids, and the id of a spec that uses only
    defaults beyond its core never changes when a field with a default is added.
    """
    parts = list(core)
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.name in spec.ID_TOKENS and value != f.default:
            parts.append(spec.ID_TOKENS[f.name](value))
    return ":".join(parts)


@dataclass(frozen=True)
class MambaSpec:
    """A Mamba-2 mixer: `num_heads` heads of `head_dim` channels, SSM state `state_size` per group.

    d_inner = num_heads * head_dim; B and C have `n_groups * state_size` channels each.
    dt is clamped to [dt_clamp_min, dt_clamp_max] after softplus (None = no upper clamp), as
    transformers does with `(config.time_step_min, inf)`.
    """

    kind: ClassVar[str] = "mamba"
    pattern_char: ClassVar[str] = "M"

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 128
    conv_bias: bool = True
    proj_bias: bool = False
    dt_clamp_min: float = 0.0
    dt_clamp_max: float | None = None
    weight_format: str = DEFAULT_WEIGHT_FORMAT

    def __post_init__(self) -> None:
        owner = "MambaSpec"
        _require_bools(self)
        _require_weight_format(self)
        for name in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size"):
            _require_positive_int(owner, name, getattr(self, name))
        _require_divisible(owner, "num_heads", self.num_heads, "n_groups", self.n_groups)
        if isinstance(self.dt_clamp_max, float) and self.dt_clamp_max == math.inf:
            object.__setattr__(self, "dt_clamp_max", None)  # one spelling of "no upper clamp" (JSON null)
        _require_number(self, "dt_clamp_min", minimum=0.0)
        _require_number(self, "dt_clamp_max", minimum=0.0, above=True)
        if self.dt_clamp_max is not None and self.dt_clamp_max < self.dt_clamp_min:
            raise SpecError(
                f"{owner}.dt_clamp_max ({self.dt_clamp_max}) is below dt_clamp_min ({self.dt_clamp_min})"
            )

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels the causal conv runs over: x | B | C."""
        return self.d_inner + 2 * self.n_groups * self.state_size

    @property
    def in_proj_dim(self) -> int:
        """Rows of in_proj, in the order z | x | B | C | dt."""
        return self.d_inner + self.conv_dim + self.num_heads

    def in_proj_sections(self) -> dict[str, slice]:
        """Where each part lives in in_proj's rows (and x | B | C in the conv's channels, offset by d_inner).

        Order: z | x | B | C | dt, the packed layout of Mamba-2 checkpoints; the conv runs over x | B | C.
        """
        d, gn = self.d_inner, self.n_groups * self.state_size
        sizes = {"z": d, "x": d, "B": gn, "C": gn, "dt": self.num_heads}
        sections, start = {}, 0
        for name, size in sizes.items():
            sections[name] = slice(start, start + size)
            start += size
        return sections

    ID_CORE: ClassVar[tuple[str, ...]] = ("num_heads", "head_dim", "state_size", "n_groups")
    ID_TOKENS: ClassVar[dict[str, Callable[[Any], str]]] = {
        "conv_kernel": _prefixed("conv"),
        "chunk_size": _prefixed("chunk"),
        "conv_bias": _flag("noconvbias"),
        "proj_bias": _flag("projbias"),
        "dt_clamp_min": _prefixed("dtmin"),
        "dt_clamp_max": _prefixed("dtmax"),
        "weight_format": str,
    }

    def short_name(self) -> str:
        """The variant id, e.g. `mamba:h64:p64:n128:g8`, plus `:chunk64` etc. for non-default fields."""
        core = (
            "mamba",
            f"h{self.num_heads}",
            f"p{self.head_dim}",
            f"n{self.state_size}",
            f"g{self.n_groups}",
        )
        return _spec_id(self, core)


@dataclass(frozen=True)
class AttentionSpec:
    """Grouped-query attention. No positional encoding unless `rope_theta` is set (Nemotron is NoPE).

    `window`: sliding-window attention over the last `window` tokens, the query's own included: a
    query at position t attends keys at positions t - window + 1 .. t (the `sliding_window` of
    transformers, vLLM and gpt-oss). None: full causal attention. A windowed block's KV cache holds
    at most `window` tokens, whatever the context.
    """

    kind: ClassVar[str] = "attention"
    pattern_char: ClassVar[str] = "*"

    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False
    rope_theta: float | None = None
    rotary_fraction: float = 1.0
    window: int | None = None
    weight_format: str = DEFAULT_WEIGHT_FORMAT

    def __post_init__(self) -> None:
        owner = "AttentionSpec"
        if self.window is not None:
            _require_positive_int(owner, "window", self.window)
        _require_bools(self)
        _require_weight_format(self)
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            _require_positive_int(owner, name, getattr(self, name))
        _require_divisible(owner, "num_heads", self.num_heads, "num_kv_heads", self.num_kv_heads)
        _require_number(self, "rope_theta", minimum=0.0, above=True)
        _require_number(self, "rotary_fraction", minimum=0.0, above=True, maximum=1.0)

    ID_CORE: ClassVar[tuple[str, ...]] = ("num_heads", "num_kv_heads", "head_dim")
    ID_TOKENS: ClassVar[dict[str, Callable[[Any], str]]] = {
        "bias": _flag("bias"),
        "rope_theta": _prefixed("rope"),
        "rotary_fraction": _prefixed("rotary"),
        "window": _prefixed("w"),
        "weight_format": str,
    }

    def short_name(self) -> str:
        """The variant id, e.g. `attn:q32:kv2:d128`, plus `:bias`, `:w4096` (a window) etc. for non-default fields."""
        return _spec_id(self, ("attn", f"q{self.num_heads}", f"kv{self.num_kv_heads}", f"d{self.head_dim}"))


@dataclass(frozen=True)
class MoESpec:
    """Mixture of relu^2 experts with a sigmoid router (DeepSeek-V3 / Nemotron-3 style).

    `expert_width` is one width for every routed expert, or a tuple with one width per expert
    (heterogeneous widths inside one block; a tuple of equal widths is stored as that one width).
    `shared_width` 0 means no shared expert.
    `latent_size` None means the routed experts work on the hidden size directly.
    """

    kind: ClassVar[str] = "moe"
    pattern_char: ClassVar[str] = "E"

    num_experts: int
    top_k: int
    expert_width: int | tuple[int, ...]
    shared_width: int = 0
    latent_size: int | None = None
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    weight_format: str = DEFAULT_WEIGHT_FORMAT

    def __post_init__(self) -> None:
        owner = "MoESpec"
        _require_bools(self)
        _require_weight_format(self)
        _require_number(self, "routed_scaling_factor", minimum=0.0, above=True)
        for name in ("num_experts", "top_k", "n_group", "topk_group"):
            _require_positive_int(owner, name, getattr(self, name))
        if isinstance(self.expert_width, (list, tuple)):
            widths = tuple(self.expert_width)
            if len(widths) != self.num_experts:
                raise SpecError(
                    f"{owner}.expert_width has {len(widths)} entries, expected one per expert "
                    f"(num_experts={self.num_experts})"
                )
            for index, width in enumerate(widths):
                _require_positive_int(owner, f"expert_width[{index}]", width)
            # Equal widths are one width: (8, 8) and 8 are the same block, so they compare (and name) equal.
            object.__setattr__(self, "expert_width", widths[0] if len(set(widths)) == 1 else widths)
        elif isinstance(self.expert_width, bool) or not isinstance(self.expert_width, int):
            raise SpecError(
                f"{owner}.expert_width must be a positive integer or a list with one per expert, "
                f"found {self.expert_width!r} ({type(self.expert_width).__name__})"
            )
        else:
            _require_positive_int(owner, "expert_width", self.expert_width)
        if isinstance(self.shared_width, bool) or not isinstance(self.shared_width, int):
            raise SpecError(f"{owner}.shared_width must be an integer >= 0, found {self.shared_width!r}")
        if self.shared_width < 0:
            raise SpecError(f"{owner}.shared_width must be >= 0 (0 = none), found {self.shared_width}")
        if self.latent_size is not None:
            _require_positive_int(owner, "latent_size", self.latent_size)
        if self.top_k > self.num_experts:
            raise SpecError(f"{owner}.top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        _require_divisible(owner, "num_experts", self.num_experts, "n_group", self.n_group)
        if self.topk_group > self.n_group:
            raise SpecError(f"{owner}.topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        reachable = self.topk_group * (self.num_experts // self.n_group)
        if self.top_k > reachable:
            raise SpecError(
                f"{owner}.top_k ({self.top_k}) exceeds the experts reachable through "
                f"topk_group={self.topk_group} of n_group={self.n_group} groups ({reachable})"
            )

    @property
    def widths(self) -> tuple[int, ...]:
        """One width per routed expert."""
        if isinstance(self.expert_width, tuple):
            return self.expert_width
        return (self.expert_width,) * self.num_experts

    @property
    def is_uniform(self) -> bool:
        return len(set(self.widths)) == 1

    def expert_input_size(self, hidden_size: int) -> int:
        """Input (and output) size of the routed experts: the latent size, else the hidden size."""
        return self.latent_size if self.latent_size is not None else hidden_size

    ID_CORE: ClassVar[tuple[str, ...]] = ("num_experts", "top_k", "expert_width")
    ID_TOKENS: ClassVar[dict[str, Callable[[Any], str]]] = {
        "shared_width": _prefixed("s"),
        "latent_size": _prefixed("l"),
        "routed_scaling_factor": _prefixed("scale"),
        "norm_topk_prob": _flag("nonormtopk"),
        "n_group": _prefixed("groups"),
        "topk_group": _prefixed("topkgroups"),
        "weight_format": str,
    }

    def short_name(self) -> str:
        """The variant id, e.g. `moe:e128:k6:w1856:s3712`, plus `:scale2.5` etc. for non-default fields.

        Heterogeneous widths show their mean and a 48-bit digest of the list: `w12avg.1a2b3c4d5e6f`.
        """
        widths = self.widths
        if self.is_uniform:
            width = str(widths[0])
        else:  # the mean is readable; the digest keeps two different width lists apart
            digest = hashlib.sha256(",".join(map(str, widths)).encode()).hexdigest()[:12]
            width = f"{round(sum(widths) / len(widths))}avg.{digest}"
        return _spec_id(self, ("moe", f"e{self.num_experts}", f"k{self.top_k}", f"w{width}"))


@dataclass(frozen=True)
class MLPSpec:
    """A dense, non-gated MLP: down(act(up(x)))."""

    kind: ClassVar[str] = "mlp"
    pattern_char: ClassVar[str] = "-"
    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("relu2", "silu", "gelu", "relu")

    width: int
    activation: str = "relu2"
    bias: bool = False
    weight_format: str = DEFAULT_WEIGHT_FORMAT

    def __post_init__(self) -> None:
        _require_bools(self)
        _require_weight_format(self)
        _require_positive_int("MLPSpec", "width", self.width)
        if not isinstance(self.activation, str) or self.activation not in self.ACTIVATIONS:
            raise SpecError(
                f"MLPSpec.activation {self.activation!r} is not supported; "
                f"choose one of {list(self.ACTIVATIONS)}"
            )

    ID_CORE: ClassVar[tuple[str, ...]] = ("width",)
    ID_TOKENS: ClassVar[dict[str, Callable[[Any], str]]] = {
        "activation": str,  # the name itself: `mlp:w64:silu`
        "bias": _flag("bias"),
        "weight_format": str,  # `mlp:w64:nvfp4`
    }

    def short_name(self) -> str:
        """The variant id, e.g. `mlp:w4096`, plus `:silu`, `:bias` for non-default fields."""
        return _spec_id(self, ("mlp", f"w{self.width}"))


@dataclass(frozen=True)
class LinearSpec:
    """One hidden x hidden matrix replacing a block's mixer."""

    kind: ClassVar[str] = "linear"
    pattern_char: ClassVar[str] = "L"

    bias: bool = False
    weight_format: str = DEFAULT_WEIGHT_FORMAT

    def __post_init__(self) -> None:
        _require_bools(self)
        _require_weight_format(self)

    ID_CORE: ClassVar[tuple[str, ...]] = ()
    ID_TOKENS: ClassVar[dict[str, Callable[[Any], str]]] = {"bias": _flag("bias"), "weight_format": str}

    def short_name(self) -> str:
        """The variant id: `linear`, or `linear:bias`."""
        return _spec_id(self, ("linear",))


@dataclass(frozen=True)
class NoOpSpec:
    """A removed block: its mixer contributes zero to the residual stream."""

    kind: ClassVar[str] = "noop"
    pattern_char: ClassVar[str] = "N"

    ID_CORE: ClassVar[tuple[str, ...]] = ()
    ID_TOKENS: ClassVar[dict[str, Callable[[Any], str]]] = {}

    def short_name(self) -> str:
        """The variant id: `noop`."""
        return _spec_id(self, ("noop",))


BlockSpec = MambaSpec | AttentionSpec | MoESpec | MLPSpec | LinearSpec | NoOpSpec
BLOCK_SPEC_TYPES: dict[str, type] = {
    cls.kind: cls for cls in (MambaSpec, AttentionSpec, MoESpec, MLPSpec, LinearSpec, NoOpSpec)
}


def _check_ids_spell_every_field() -> None:
    # A field that shows nowhere in the id would let two variants share one library file.
    for cls in BLOCK_SPEC_TYPES.values():
        spelt = set(cls.ID_CORE) | set(cls.ID_TOKENS)
        fields = {f.name for f in dataclasses.fields(cls)}
        if spelt != fields:
            raise TypeError(
                f"{cls.__name__}: id tokens {sorted(spelt)} do not match its fields {sorted(fields)}"
            )


_check_ids_spell_every_field()


def _finite_or_none(value: Any) -> Any:
    # JSON has no infinity; an unbounded clamp is written as null.
    if isinstance(value, float) and math.isinf(value):
        return None
    return value


# Fields added after runs were saved: left out of a block's JSON at their default (bf16, full attention).
_OMITTED_AT_DEFAULT = ("weight_format", "window")


def block_to_dict(spec: BlockSpec) -> dict[str, Any]:
    """A JSON-ready dict: {"kind": ..., every field}. Tuples become lists; `weight_format` only when not bf16, `window` only when set."""
    out: dict[str, Any] = {"kind": spec.kind}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.name in _OMITTED_AT_DEFAULT and value == f.default:
            continue  # blocks keep the JSON (and so every fingerprint) they had before the field existed
        out[f.name] = list(value) if isinstance(value, tuple) else _finite_or_none(value)
    return out


def block_from_dict(data: Mapping[str, Any]) -> BlockSpec:
    """Inverse of `block_to_dict`. Unknown kinds and unknown keys are errors."""
    if not isinstance(data, Mapping):
        raise SpecError(f"a block spec must be a JSON object, found {type(data).__name__}")
    if "kind" not in data:
        raise SpecError(f"block spec {dict(data)!r} has no 'kind'; choose one of {sorted(BLOCK_SPEC_TYPES)}")
    kind = data["kind"]
    if kind not in BLOCK_SPEC_TYPES:
        raise SpecError(f"unknown block kind {kind!r}; choose one of {sorted(BLOCK_SPEC_TYPES)}")
    cls = BLOCK_SPEC_TYPES[kind]
    allowed = [f.name for f in dataclasses.fields(cls)]
    fields = {key: value for key, value in data.items() if key != "kind"}
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        raise SpecError(f"unknown key(s) {unknown} for a {kind!r} block; allowed keys: {allowed}")
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in fields
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise SpecError(f"a {kind!r} block spec is missing required key(s) {missing}")
    if isinstance(fields.get("expert_width"), list):
        fields["expert_width"] = tuple(fields["expert_width"])
    try:
        return cls(**fields)
    except TypeError as error:  # a safety net: the checks in __post_init__ should say it first
        raise SpecError(f"invalid {kind!r} block spec {dict(data)!r}: {error}") from error


@dataclass(frozen=True)
class ModelSpec:
    """A whole hybrid language model: embeddings, the blocks in order, final norm, lm_head."""

    vocab_size: int
    hidden_size: int
    blocks: tuple[BlockSpec, ...] = field(default_factory=tuple)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        _require_bools(self)
        _require_positive_int("ModelSpec", "vocab_size", self.vocab_size)
        _require_positive_int("ModelSpec", "hidden_size", self.hidden_size)
        if isinstance(self.blocks, (str, bytes, Mapping)) or not isinstance(self.blocks, Iterable):
            raise SpecError(
                f"ModelSpec.blocks must be a sequence of block specs, found {type(self.blocks).__name__}"
            )
        blocks = tuple(self.blocks)
        for index, block in enumerate(blocks):
            if not isinstance(block, tuple(BLOCK_SPEC_TYPES.values())):
                raise SpecError(
                    f"ModelSpec.blocks[{index}] is a {type(block).__name__}, expected a block spec "
                    f"({', '.join(cls.__name__ for cls in BLOCK_SPEC_TYPES.values())})"
                )
        _require_number(self, "norm_eps", minimum=0.0, above=True)
        object.__setattr__(self, "blocks", blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def pattern(self) -> str:
        """One character per block, NVIDIA's `hybrid_override_pattern` alphabet (+ L linear, N no-op)."""
        return "".join(block.pattern_char for block in self.blocks)

    def replace_block(self, index: int, block: BlockSpec) -> ModelSpec:
        """A copy with block `index` replaced."""
        blocks = list(self.blocks)
        blocks[index] = block
        return dataclasses.replace(self, blocks=tuple(blocks))

    def to_dict(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "norm_eps": self.norm_eps,
            "tie_embeddings": self.tie_embeddings,
            "blocks": [block_to_dict(block) for block in self.blocks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        if not isinstance(data, Mapping):
            raise SpecError(f"a model spec must be a JSON object, found {type(data).__name__}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise SpecError(f"unknown key(s) {unknown} in a model spec; allowed keys: {allowed}")
        for required in ("vocab_size", "hidden_size", "blocks"):
            if required not in data:
                raise SpecError(f"a model spec is missing required key {required!r}")
        blocks = data["blocks"]
        if not isinstance(blocks, list):
            raise SpecError(f"ModelSpec 'blocks' must be a list, found {type(blocks).__name__}")
        fields = dict(data)
        fields["blocks"] = tuple(block_from_dict(block) for block in blocks)
        return cls(**fields)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class Variant:
    """A candidate for one block of the parent: (block index, spec), with a readable id.

    What the stages pass around (library, scores, costs, search): frozen and hashable, so a dict
    key; `to_dict` / `from_dict` for JSON. `Variant(3, MoESpec(...))` builds one.
    """

    block_index: int
    spec: BlockSpec

    def __post_init__(self) -> None:
        index = self.block_index
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise SpecError(f"Variant.block_index must be an integer >= 0, found {index!r}")
        if not isinstance(self.spec, tuple(BLOCK_SPEC_TYPES.values())):
            raise SpecError(f"Variant.spec must be a block spec, found {type(self.spec).__name__}")

    @property
    def id(self) -> str:
        """The spec's id (`moe:e128:k6:w1856`): unique per spec, readable, usable as a file name."""
        return self.spec.short_name()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: {"block_index", "id" (for people and as a check), "spec" (as `block_to_dict`)}."""
        return {"block_index": self.block_index, "id": self.id, "spec": block_to_dict(self.spec)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Variant:
        """Inverse of `to_dict`. An "id" that is not the spec's own id is an error (a stale or edited file)."""
        if not isinstance(data, Mapping):
            raise SpecError(f"a variant must be a JSON object, found {type(data).__name__}")
        allowed = ["block_index", "id", "spec"]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise SpecError(f"unknown key(s) {unknown} in a variant; allowed keys: {allowed}")
        for required in ("block_index", "spec"):
            if required not in data:
                raise SpecError(f"a variant is missing required key {required!r}")
        variant = cls(data["block_index"], block_from_dict(data["spec"]))
        if "id" in data and data["id"] != variant.id:
            raise SpecError(
                f"variant of block {variant.block_index}: id {data['id']!r} does not match its spec, "
                f"whose id is {variant.id!r}"
            )
        return variant

    def __str__(self) -> str:
        return f"block {self.block_index}: {self.id}"


def weight_formats(spec: ModelSpec) -> dict[int, str]:
    """{block index: weight format} of the blocks whose matmul weights are quantized (not bf16)."""
    return {
        index: weight_format_of(block)
        for index, block in enumerate(spec.blocks)
        if weight_format_of(block) != DEFAULT_WEIGHT_FORMAT
    }


def without_weight_format(block: BlockSpec) -> BlockSpec:
    """`block` in bf16: its shape alone."""
    return (
        dataclasses.replace(block, weight_format=DEFAULT_WEIGHT_FORMAT)
        if takes_weight_format(block)
        else block
    )


def without_weight_formats(spec: ModelSpec) -> ModelSpec:
    """`spec` with every block in bf16: its architecture alone (what a config.json's block fields describe)."""
    return dataclasses.replace(spec, blocks=tuple(without_weight_format(block) for block in spec.blocks))


def with_weight_formats(spec: ModelSpec, formats: Mapping[int, str]) -> ModelSpec:
    """`spec` with each block in the format `formats` ({block index: format}) gives it, the others in bf16:
    the blocks as a save stores them (what engines read), whatever formats the spec itself carried."""
    blocks = tuple(
        dataclasses.replace(block, weight_format=formats.get(index, DEFAULT_WEIGHT_FORMAT))
        if takes_weight_format(block)
        else block
        for index, block in enumerate(spec.blocks)
    )
    return dataclasses.replace(spec, blocks=blocks)


def blocks_of_kind(spec: ModelSpec, kinds: str | Iterable[str]) -> list[int]:
    """Indices of the blocks whose kind is one of `kinds`."""
    wanted = {kinds} if isinstance(kinds, str) else set(kinds)
    return [index for index, block in enumerate(spec.blocks) if block.kind in wanted]


_Entry = TypeVar("_Entry")


def kind_entry(table: Mapping[type, _Entry], spec: object, missing: str) -> _Entry:
    """The entry of `spec`'s type in a per-kind registry (mixers, costs, child init...).

    A type without one is a SpecError: `missing` followed by the type's name and the known spec types.
    """
    entry = table.get(type(spec))
    if entry is None:
        known = ", ".join(cls.__name__ for cls in table)
        raise SpecError(f"{missing} {type(spec).__name__}; known spec types: {known}")
    return entry
