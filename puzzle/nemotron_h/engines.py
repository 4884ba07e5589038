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
from collections.abc import Iterable
from dataclasses import dataclass

from puzzle.nemotron_h.config import transformers_incompatibilities
from puzzle.spec import AttentionSpec, BlockSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec

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


def _vllm(spec: ModelSpec) -> list[EngineProblem]:
    problems = []
    mamba = _most_common([b for b in spec.blocks if isinstance(b, MambaSpec)])
    attention = _most_common([b for b in spec.blocks if isinstance(b, AttentionSpec)])
    for index, block in enumerate(spec.blocks):

        def add(reason: str, index: int = index, block: BlockSpec = block) -> None:
            problems.append(EngineProblem("vllm", index, block.kind, reason))

        if block.kind in _OURS_ALONE:
            add(_OURS_ALONE[block.kind])
        elif isinstance(block, MambaSpec):
            if block != mamba:
                add(
                    f"a Mamba shape {block.short_name()} unlike the other Mamba blocks' {mamba.short_name()} "
                    "(vLLM builds every Mamba layer and its state cache from the global fields)"
                )
            if block.dt_clamp_max is not None:
                add("an upper dt clamp (mamba_dt_clamp_max is ours alone)")
        elif isinstance(block, AttentionSpec):
            if block.bias:
                add("attention biases (vLLM's NemotronH attention has none)")
            if block != attention:  # conservative: the hybrid KV-cache manager pages one attention shape
                add(
                    f"an attention shape {block.short_name()} unlike the other attention blocks' "
                    f"{attention.short_name()} (vLLM's hybrid KV cache is laid out for one attention shape)"
                )
        elif isinstance(block, MoESpec):
            if not block.is_uniform:
                add("a width per expert inside one block (a fused MoE layer has one width)")
        elif isinstance(block, MLPSpec) and block.activation != "relu2":
            add(f"MLP activation {block.activation!r} (vLLM's NemotronH MLP is relu^2)")
    return problems


def _llama_cpp(spec: ModelSpec) -> list[EngineProblem]:
    problems = []
    by_kind = {kind: [b for b in spec.blocks if b.kind == kind] for kind in ("mamba", "attention", "moe")}
    reference = {kind: _most_common(blocks) for kind, blocks in by_kind.items()}
    has_moe = bool(by_kind["moe"])
    for index, block in enumerate(spec.blocks):

        def add(reason: str, index: int = index, block: BlockSpec = block) -> None:
            problems.append(EngineProblem("llama.cpp", index, block.kind, reason))

        if block.kind in _OURS_ALONE:
            add(_OURS_ALONE[block.kind])
        elif isinstance(block, (MambaSpec, AttentionSpec)) and block != reference[block.kind]:
            add(
                f"a {block.kind} shape {block.short_name()} unlike the other {block.kind} blocks' "
                f"{reference[block.kind].short_name()} (llama.cpp reads {block.kind} shapes from the globals only)"
            )
        elif isinstance(block, MambaSpec) and block.dt_clamp_max is not None:
            add("an upper dt clamp (mamba_dt_clamp_max is ours alone)")
        elif isinstance(block, AttentionSpec) and block.bias:
            add("attention biases")
        elif isinstance(block, MoESpec):
            if not block.is_uniform:
                add("a width per expert inside one block (one expert width per MoE layer)")
            if block.shared_width == 0:
                add("no shared expert (llama.cpp's NemotronH MoE layer always has one)")
            differs = _differs(block, reference["moe"], _LLAMA_CPP_SHARED_MOE)
            if differs:
                add(
                    "MoE fields other than width and top-k differ between blocks, and llama.cpp reads them "
                    "from the globals only: " + ", ".join(differs)
                )
        elif isinstance(block, MLPSpec):
            if has_moe:
                add(
                    "a dense MLP block in a model with MoE blocks (llama.cpp's converter marks only MoE "
                    "blocks as feed-forward layers and would take it for attention)"
                )
            elif block.activation != "relu2" or block.bias:
                add("an MLP that is not a bias-free relu^2 MLP")
    return problems


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
