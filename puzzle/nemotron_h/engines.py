"""Which of our children serving engines can load, block by block, from what their NemotronH code reads.

What each engine reads (their code, read in 2026; `config_from_spec` writes the fields they read):

- vLLM (`model_executor/models/nemotron_h.py`, `NemotronHPuzzleConfig`): block kinds mamba, attention,
  moe, mlp only; every Mamba layer and the Mamba state cache are built from the global fields, so all
  Mamba blocks have one shape; MoE and MLP layers take their block's fields (per-block widths, top-k,
  expert counts, shared and latent sizes); attention layers do too, but we ask for one attention shape
  (its hybrid KV cache is laid out per attention shape and we could not check several); attention has
  no bias; MLP and experts are relu^2; one fused-MoE width per block; no upper dt clamp.
- llama.cpp (`convert_hf_to_gguf.py` NemotronHPuzzleModel, `src/models/nemotron-h.cpp`): the block
  pattern from block_configs, width and top-k from each MoE entry; everything else from the globals:
  one Mamba shape, one attention shape, one expert count, shared expert (always present), latent size,
  routing settings for all MoE blocks; a dense MLP block in a model with MoE blocks would be taken for an
  attention layer by the converter; MTP tensors are dropped.
- transformers without remote code (`NemotronHForCausalLM`): plain nemotron_h only, one shape per kind
  (`transformers_incompatibilities`). Our trust_remote_code file and `puzzle.load` read every child.

A width per expert inside one block, linear blocks and no-op blocks are ours alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from puzzle.nemotron_h.config import transformers_incompatibilities
from puzzle.spec import (
    AttentionSpec,
    BlockSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
    kind_entry,
)

ENGINES = ("vllm", "llama.cpp", "transformers")
SERVING_ENGINES = ("vllm", "llama.cpp")  # what `export(format="engine")` checks by default

_OURS_ALONE = {"linear": "a linear block (ours alone)", "noop": "a no-op (removed) block (ours alone)"}
# MoE fields llama.cpp reads from the globals only (width and top-k come from each entry).
_LLAMA_CPP_SHARED_MOE = (
    "num_experts",
    "shared_width",
    "latent_size",
    "routed_scaling_factor",
    "norm_topk_prob",
    "n_group",
    "topk_group",
)


@dataclass(frozen=True)
class EngineProblem:
    """Why `engine` cannot load a child: the block (None: the model as a whole) and the reason."""

    engine: str
    block: int | None
    kind: str | None
    reason: str

    def __str__(self) -> str:
        where = "the model" if self.block is None else f"block {self.block} ({self.kind})"
        return f"{self.engine}: {where}: {self.reason}"


def _most_common(blocks: list[BlockSpec]) -> BlockSpec | None:
    return Counter(blocks).most_common(1)[0][0] if blocks else None


def _differs(block: BlockSpec, reference: BlockSpec, fields: Iterable[str]) -> list[str]:
    return [
        f"{name} {getattr(block, name)!r} (others: {getattr(reference, name)!r})"
        for name in fields
        if getattr(block, name) != getattr(reference, name)
    ]


@dataclass(frozen=True)
class _Model:
    """What a block's engine rule may compare it with: the most common block of each spec type."""

    reference: dict[type, BlockSpec]

    @classmethod
    def of(cls, spec: ModelSpec) -> _Model:
        by_type: dict[type, list[BlockSpec]] = {}
        for block in spec.blocks:
            by_type.setdefault(type(block), []).append(block)
        return cls({spec_type: _most_common(blocks) for spec_type, blocks in by_type.items()})


# (block, the model it is in) -> why the engine cannot load it, in the order reported ([] = it can).
EngineRule = Callable[[Any, _Model], list[str]]


def _ours_alone(block: BlockSpec, model: _Model) -> list[str]:
    return [_OURS_ALONE[block.kind]]


def _vllm_mamba(block: MambaSpec, model: _Model) -> list[str]:
    reasons, mamba = [], model.reference[MambaSpec]
    if block != mamba:
        reasons.append(
            f"a Mamba shape {block.short_name()} unlike the other Mamba blocks' {mamba.short_name()} "
            "(vLLM builds every Mamba layer and its state cache from the global fields)"
        )
    if block.dt_clamp_max is not None:
        reasons.append("an upper dt clamp (mamba_dt_clamp_max is ours alone)")
    return reasons


def _vllm_attention(block: AttentionSpec, model: _Model) -> list[str]:
    reasons, attention = [], model.reference[AttentionSpec]
    if block.bias:
        reasons.append("attention biases (vLLM's NemotronH attention has none)")
    if block != attention:  # conservative: the hybrid KV-cache manager pages one attention shape
        reasons.append(
            f"an attention shape {block.short_name()} unlike the other attention blocks' "
            f"{attention.short_name()} (vLLM's hybrid KV cache is laid out for one attention shape)"
        )
    return reasons


def _vllm_moe(block: MoESpec, model: _Model) -> list[str]:
    return (
        [] if block.is_uniform else ["a width per expert inside one block (a fused MoE layer has one width)"]
    )


def _vllm_mlp(block: MLPSpec, model: _Model) -> list[str]:
    if block.activation != "relu2":
        return [f"MLP activation {block.activation!r} (vLLM's NemotronH MLP is relu^2)"]
    return []


VLLM_RULES: dict[type, EngineRule] = {
    MambaSpec: _vllm_mamba,
    AttentionSpec: _vllm_attention,
    MoESpec: _vllm_moe,
    MLPSpec: _vllm_mlp,
    LinearSpec: _ours_alone,
    NoOpSpec: _ours_alone,
}


def _llama_cpp_global_shape(block: MambaSpec | AttentionSpec, model: _Model, extra: str | None) -> list[str]:
    """Mamba and attention shapes come from the globals only; `extra`, if any, only when the shape matches."""
    reference = model.reference[type(block)]
    if block != reference:
        return [
            f"a {block.kind} shape {block.short_name()} unlike the other {block.kind} blocks' "
            f"{reference.short_name()} (llama.cpp reads {block.kind} shapes from the globals only)"
        ]
    return [] if extra is None else [extra]


def _llama_cpp_mamba(block: MambaSpec, model: _Model) -> list[str]:
    clamp = "an upper dt clamp (mamba_dt_clamp_max is ours alone)" if block.dt_clamp_max is not None else None
    return _llama_cpp_global_shape(block, model, clamp)


def _llama_cpp_attention(block: AttentionSpec, model: _Model) -> list[str]:
    return _llama_cpp_global_shape(block, model, "attention biases" if block.bias else None)


def _llama_cpp_moe(block: MoESpec, model: _Model) -> list[str]:
    reasons = []
    if not block.is_uniform:
        reasons.append("a width per expert inside one block (one expert width per MoE layer)")
    if block.shared_width == 0:
        reasons.append("no shared expert (llama.cpp's NemotronH MoE layer always has one)")
    differs = _differs(block, model.reference[MoESpec], _LLAMA_CPP_SHARED_MOE)
    if differs:
        reasons.append(
            "MoE fields other than width and top-k differ between blocks, and llama.cpp reads them "
            "from the globals only: " + ", ".join(differs)
        )
    return reasons


def _llama_cpp_mlp(block: MLPSpec, model: _Model) -> list[str]:
    if MoESpec in model.reference:
        return [
            "a dense MLP block in a model with MoE blocks (llama.cpp's converter marks only MoE "
            "blocks as feed-forward layers and would take it for attention)"
        ]
    if block.activation != "relu2" or block.bias:
        return ["an MLP that is not a bias-free relu^2 MLP"]
    return []


LLAMA_CPP_RULES: dict[type, EngineRule] = {
    MambaSpec: _llama_cpp_mamba,
    AttentionSpec: _llama_cpp_attention,
    MoESpec: _llama_cpp_moe,
    MLPSpec: _llama_cpp_mlp,
    LinearSpec: _ours_alone,
    NoOpSpec: _ours_alone,
}


def _by_rules(engine: str, rules: dict[type, EngineRule], spec: ModelSpec) -> list[EngineProblem]:
    model = _Model.of(spec)
    return [
        EngineProblem(engine, index, block.kind, reason)
        for index, block in enumerate(spec.blocks)
        for reason in kind_entry(rules, block, f"no {engine} rules for block spec type")(block, model)
    ]


def _vllm(spec: ModelSpec) -> list[EngineProblem]:
    return _by_rules("vllm", VLLM_RULES, spec)


def _llama_cpp(spec: ModelSpec) -> list[EngineProblem]:
    return _by_rules("llama.cpp", LLAMA_CPP_RULES, spec)


def _transformers(spec: ModelSpec) -> list[EngineProblem]:
    return [
        EngineProblem(
            "transformers",
            None,
            None,
            f"{reason} (NemotronHForCausalLM has one shape per kind; use trust_remote_code=True)",
        )
        for reason in transformers_incompatibilities(spec)
    ]


_CHECKS = {"vllm": _vllm, "llama.cpp": _llama_cpp, "transformers": _transformers}


def engine_problems(spec: ModelSpec, engines: Iterable[str] = SERVING_ENGINES) -> list[EngineProblem]:
    """Every reason why one of `engines` (names in ENGINES) cannot load a checkpoint of `spec`; [] if all can."""
    problems = []
    for engine in engines:
        if engine not in _CHECKS:
            raise ValueError(f"unknown engine {engine!r}; known: {list(ENGINES)}")
        problems.extend(_CHECKS[engine](spec))
    return problems


def engine_support(spec: ModelSpec) -> dict[str, list[str]]:
    """{engine: [reasons it cannot load `spec`]} for every engine in ENGINES (empty list: it can)."""
    return {engine: [str(problem) for problem in _CHECKS[engine](spec)] for engine in ENGINES}
