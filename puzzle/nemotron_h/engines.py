"""Which of our children serving engines can load, block by block, from what their NemotronH code reads.

What each engine reads:

- vLLM: replayed by `puzzle.nemotron_h.vllm_replay` (its nemotron_h.py and nemotron_h_mtp.py, commit named
  there) on the config.json and tensors the export writes: vLLM takes our trust_remote_code configuration
  class, builds Mamba layers and the Mamba state cache from the global fields, and MLP, attention and MoE
  layers from `get_nemotron_h_config_for_layer(i)`; it raises on linear and no-op layers, and its fused
  MoE has one width per block; it reads an attention layer's `sliding_window` from its per-layer config
  (NemotronHAttention, per_layer_sliding_window). Every mismatch the replay finds is a refusal. What the replay cannot see in
  tensors or config fields is `VLLM_RULES`: vLLM's MLP is relu^2 whatever the config says, it has no upper
  dt clamp, and (conservatively) one attention shape, since its hybrid KV cache pages one shape and we
  could not check several.
- llama.cpp (its NemotronHPuzzleModel converter, PR ggml-org/llama.cpp#25444, and `src/models/nemotron-h.cpp`,
  as read in the llama.cpp vendored by llama-cpp-python 0.3.36): the block pattern from
  block_configs, width and top-k from each MoE entry; everything else from the globals: one Mamba shape,
  one attention shape, one expert count, shared expert (always present), latent size (it writes
  `add_moe_latent_size` unconditionally: a MoE without latent projection crashes it), routing settings
  for all MoE blocks; no sliding window (every attention layer attends to the whole context, src/models/
  nemotron-h.cpp); its loader takes a dense MLP block in a model with MoE blocks for a Mamba layer;
  MTP tensors are dropped.
- SGLang: replayed by `puzzle.nemotron_h.sglang_replay` (its models/nemotron_h.py and configs/nemotron_h.py,
  commits named there): its own NemotronHPuzzleConfig; Mamba and MLP layers from the globals, attention and
  MoE layers from `get_nemotron_h_config_for_layer(i)`; `SGLANG_RULES` adds vLLM's relu^2 MLP, no upper dt
  clamp and (conservatively) one attention shape for its KV pool.
- TensorRT-LLM: replayed by `puzzle.nemotron_h.trtllm_replay` (its _torch/models/modeling_nemotron_h.py,
  commit named there): block_configs only for five MoE fields (width, latent size, expert count, top-k,
  shared-expert width); Mamba, MLP, attention (KV heads included) from the globals. Its quantized
  checkpoints are ModelOpt's (hf_quant_config.json, MIXED_PRECISION): the export writes that layout for it
  (`puzzle.nemotron_h.modelopt`, replayed by `trtllm_quant_replay`); fp8 routed experts are refused (its
  fused MoE has no per-channel fp8).
- transformers without remote code (`NemotronHForCausalLM`): plain nemotron_h only, one shape per kind, no
  quantized MoE block (it misreads nvfp4 routed experts and runs fp8 ones without their activations)
  (`transformers_incompatibilities`). Our trust_remote_code file and `puzzle.load` read every child.

A width per expert inside one block, linear blocks and no-op blocks are ours alone.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from puzzle.formats import DEFAULT_WEIGHT_FORMAT
from puzzle.nemotron_h import modelopt, sglang_replay, trtllm_replay, vllm_replay
from puzzle.nemotron_h.config import config_from_spec, transformers_incompatibilities
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
    without_weight_format,
)

ENGINES = ("vllm", "llama.cpp", "transformers", "sglang", "trtllm")
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
    return ["an upper dt clamp (mamba_dt_clamp_max is ours alone)"] if block.dt_clamp_max is not None else []


def _attention_shape(block: AttentionSpec) -> AttentionSpec:
    # The window is no shape: vLLM's NemotronHAttention passes each layer's `sliding_window` to its
    # Attention (per_layer_sliding_window), whose KV pages have the same size, and the hybrid KV-cache
    # manager groups windowed layers apart from full ones (as for gpt-oss). The replay checks the window read.
    # Nor is the weight format: vLLM reads each module's scheme from quantization_config.
    return dataclasses.replace(without_weight_format(block), window=None)


def _vllm_attention(block: AttentionSpec, model: _Model) -> list[str]:
    attention = model.reference[AttentionSpec]
    if _attention_shape(block) != _attention_shape(attention):
        # conservative: the hybrid KV-cache manager pages one attention shape
        return [
            f"an attention shape {block.short_name()} unlike the other attention blocks' "
            f"{attention.short_name()} (vLLM's hybrid KV cache is laid out for one attention shape)"
        ]
    return []


def _vllm_mlp(block: MLPSpec, model: _Model) -> list[str]:
    if block.activation != "relu2":
        return [
            f"MLP activation {block.activation!r} (vLLM's NemotronH MLP is relu^2 whatever the config says)"
        ]
    return []


def _replayed(block: BlockSpec, model: _Model) -> list[str]:
    """Nothing beyond the replay: vLLM_replay sees everything vLLM reads for this kind."""
    return []


# What vLLM does that the replay of its reads (vllm_replay) cannot see; the replay finds the rest.
VLLM_RULES: dict[type, EngineRule] = {
    MambaSpec: _vllm_mamba,
    AttentionSpec: _vllm_attention,
    MoESpec: _replayed,
    MLPSpec: _vllm_mlp,
    LinearSpec: _replayed,  # vLLM raises on the layer type: the replay reports it
    NoOpSpec: _replayed,
}


def vllm_checkpoint(spec: ModelSpec) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """The config.json and tensor shapes (hub names) an export of `spec` has, without weights (meta device)."""
    import torch

    from puzzle.model import HybridLM
    from puzzle.nemotron_h.weights import hub_state

    with torch.device("meta"):
        model = HybridLM(spec)
    shapes = {name: tuple(tensor.shape) for name, tensor in hub_state(model).items()}
    return config_from_spec(spec), shapes


def _llama_cpp_global_shape(block: MambaSpec | AttentionSpec, model: _Model, extra: str | None) -> list[str]:
    """Mamba and attention shapes come from the globals only; `extra`, if any, only when the shape matches."""
    reference = model.reference[type(block)]
    if block != reference:
        return [
            f"a {block.kind} shape {block.short_name()} unlike the other {block.kind} blocks' "
            f"{reference.short_name()} (llama.cpp reads {block.kind} shapes from the globals only)"
        ]
    return [] if extra is None else [extra]


# The NemotronH converter asserts that the Mamba inner width (heads x head dim) is a multiple of this.
_LLAMA_CPP_MAMBA_INNER_MULTIPLE = 64


def _llama_cpp_mamba(block: MambaSpec, model: _Model) -> list[str]:
    clamp = "an upper dt clamp (mamba_dt_clamp_max is ours alone)" if block.dt_clamp_max is not None else None
    reasons = _llama_cpp_global_shape(block, model, clamp)
    inner = block.num_heads * block.head_dim
    if inner % _LLAMA_CPP_MAMBA_INNER_MULTIPLE:
        reasons.append(
            f"a Mamba inner width mamba_num_heads x mamba_head_dim = {inner}, not a multiple of "
            f"{_LLAMA_CPP_MAMBA_INNER_MULTIPLE} (an assertion of llama.cpp's NemotronH converter)"
        )
    return reasons


def _llama_cpp_attention(block: AttentionSpec, model: _Model) -> list[str]:
    reasons = _llama_cpp_global_shape(block, model, "attention biases" if block.bias else None)
    if block.window is not None:
        # src/models/nemotron-h.cpp builds every attention layer on one full-context KV cache
        # (build_inp_mem_hybrid / inp->get_attn(), no sliding-window variant), so it would attend to everything.
        reasons.append(
            f"sliding-window attention (window {block.window}): llama.cpp's NemotronH attends over the whole "
            "context in every attention layer and reads no per-layer window"
        )
    return reasons


def _llama_cpp_moe(block: MoESpec, model: _Model) -> list[str]:
    reasons = []
    if not block.is_uniform:
        reasons.append("a width per expert inside one block (one expert width per MoE layer)")
    if block.shared_width == 0:
        reasons.append("no shared expert (llama.cpp's NemotronH MoE layer always has one)")
    if block.latent_size is None:
        reasons.append(
            "a MoE without latent projection (moe_latent_size null: llama.cpp's NemotronHPuzzle converter "
            "crashes in add_moe_latent_size(None))"
        )
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
            "a dense MLP block in a model with MoE blocks (llama.cpp's converter marks only MoE blocks as "
            "feed-forward layers, and its loader takes this block for a Mamba layer)"
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


def _trtllm_quantized(block: BlockSpec, model: _Model) -> list[str]:
    """A quantized block is exported for TensorRT-LLM in ModelOpt's layout (`puzzle.nemotron_h.modelopt`,
    read back by `trtllm_quant_replay`); of our formats, only fp8 routed experts have no path in its fused MoE."""
    fmt = getattr(block, "weight_format", DEFAULT_WEIGHT_FORMAT)
    if fmt == "fp8" and isinstance(block, MoESpec):
        return [modelopt.FP8_MOE]
    return []


def _trtllm_mamba(block: MambaSpec, model: _Model) -> list[str]:
    return _vllm_mamba(block, model) + _trtllm_quantized(block, model)


def _trtllm_mlp(block: MLPSpec, model: _Model) -> list[str]:
    return _vllm_mlp(block, model) + _trtllm_quantized(block, model)


# What SGLang does that its replay cannot see: as vLLM (relu^2 MLP, no upper dt clamp, one KV-pool shape).
SGLANG_RULES: dict[type, EngineRule] = dict(VLLM_RULES)
# TensorRT-LLM: the replay sees attention shapes (global) and MoE fields; beyond it, relu^2, no dt clamp, and
# no fp8 routed experts (the ModelOpt layout holds every other quantized block).
TRTLLM_RULES: dict[type, EngineRule] = {
    MambaSpec: _trtllm_mamba,
    AttentionSpec: _trtllm_quantized,
    MoESpec: _trtllm_quantized,
    MLPSpec: _trtllm_mlp,
    LinearSpec: _replayed,
    NoOpSpec: _replayed,
}


def _by_rules(engine: str, rules: dict[type, EngineRule], spec: ModelSpec) -> list[EngineProblem]:
    model = _Model.of(spec)
    return [
        EngineProblem(engine, index, block.kind, reason)
        for index, block in enumerate(spec.blocks)
        for reason in kind_entry(rules, block, f"no {engine} rules for block spec type")(block, model)
    ]


def _vllm(spec: ModelSpec) -> list[EngineProblem]:
    """The replay's mismatches on the checkpoint an export writes (MTP module aside), then VLLM_RULES, by block."""
    config, shapes = vllm_checkpoint(spec)
    replayed = [
        EngineProblem("vllm", index, spec.blocks[index].kind, reason)
        for index, reason in vllm_replay.mismatches(config, shapes, spec)
    ]
    problems = replayed + _by_rules("vllm", VLLM_RULES, spec)
    return sorted(problems, key=lambda problem: -1 if problem.block is None else problem.block)


def _replayed_engine(
    engine: str, module: Any, rules: dict[type, EngineRule], spec: ModelSpec
) -> list[EngineProblem]:
    config, shapes = vllm_checkpoint(spec)
    replayed = [
        EngineProblem(engine, index, spec.blocks[index].kind, reason)
        for index, reason in module.mismatches(config, shapes, spec)
    ]
    problems = replayed + _by_rules(engine, rules, spec)
    return sorted(problems, key=lambda problem: -1 if problem.block is None else problem.block)


def _sglang(spec: ModelSpec) -> list[EngineProblem]:
    return _replayed_engine("sglang", sglang_replay, SGLANG_RULES, spec)


def _trtllm(spec: ModelSpec) -> list[EngineProblem]:
    return _replayed_engine("trtllm", trtllm_replay, TRTLLM_RULES, spec)


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


_CHECKS = {
    "vllm": _vllm,
    "llama.cpp": _llama_cpp,
    "transformers": _transformers,
    "sglang": _sglang,
    "trtllm": _trtllm,
}


def engine_problems(spec: ModelSpec, engines: Iterable[str] = SERVING_ENGINES) -> list[EngineProblem]:
    """Every reason why one of `engines` (names in ENGINES) cannot load a checkpoint of `spec`; [] if all can."""
    problems = []
    for engine in check_engines(engines):
        problems.extend(_CHECKS[engine](spec))
    return problems


# ------------------------------------------------------------------------- a search held to the engines
# What an engine reads from the config's globals, by kind: every block of that kind in a child must agree on
# it. The rules above find a block that disagrees with the most common one; a search holds each to one value.


def _llama_cpp_moe_globals(block: MoESpec) -> tuple[Any, ...]:
    return tuple(getattr(block, name) for name in _LLAMA_CPP_SHARED_MOE)


def _trtllm_moe_globals(block: MoESpec) -> tuple[Any, ...]:
    # NemotronHMOE reads n_shared_experts (shared width 0 or not), n_group, topk_group, routed_scaling_factor
    # from the globals; norm_topk_prob it does not read (DeepseekV3Gate), held here conservatively.
    return (
        block.shared_width > 0,
        block.routed_scaling_factor,
        block.n_group,
        block.topk_group,
        block.norm_topk_prob,
    )


GLOBAL_PARTS: dict[str, dict[type, Callable[[Any], Any]]] = {
    # Mamba layers and their state cache from the globals (the replay); one attention shape (VLLM_RULES)
    "vllm": {MambaSpec: without_weight_format, AttentionSpec: _attention_shape},
    "llama.cpp": {
        MambaSpec: without_weight_format,
        AttentionSpec: without_weight_format,
        MoESpec: _llama_cpp_moe_globals,
    },
    # Mamba and the MLP from the globals (the replay); one attention shape (SGLANG_RULES, as vLLM)
    "sglang": {
        MambaSpec: without_weight_format,
        AttentionSpec: _attention_shape,
        MLPSpec: without_weight_format,
    },
    # Mamba, MLP and attention from the globals (the replay); MoE routing globals (n_shared_experts, routing)
    "trtllm": {
        MambaSpec: without_weight_format,
        AttentionSpec: without_weight_format,
        MLPSpec: without_weight_format,
        MoESpec: _trtllm_moe_globals,
    },
    # one shape per kind (transformers_incompatibilities)
    "transformers": dict.fromkeys((MambaSpec, AttentionSpec, MoESpec, MLPSpec), without_weight_format),
}


def check_engines(engines: Iterable[str]) -> tuple[str, ...]:
    """`engines` as a tuple, each known (ValueError naming the unknown one and the known ones)."""
    engines = tuple(engines)
    for engine in engines:
        if engine not in _CHECKS:
            raise ValueError(f"unknown engine {engine!r}; known: {list(ENGINES)}")
    return engines


def engine_attributes(block: BlockSpec, engines: Iterable[str]) -> dict[str, str]:
    """{attribute: value} of `block` that a search holds to one value over a child's blocks, so that every
    engine of `engines` reads them from its globals (e.g. "vllm mamba globals")."""
    out = {}
    for engine in engines:
        part = GLOBAL_PARTS.get(engine, {}).get(type(block))
        if part is not None:
            out[f"{engine} {block.kind} globals"] = repr(part(block))
    return out


@dataclass
class VariantCheck:
    """Which variants `engines` serve in place of a block of `parent`, whatever the other blocks' choices
    within the one-value rules of `engine_attributes`; results cached by (the parent block's kind, variant)."""

    parent: ModelSpec
    engines: tuple[str, ...]
    _cache: dict[tuple[type, BlockSpec], list[str]] = dataclasses.field(default_factory=dict)
    _parents: set[str] | None = None  # the parent's own problems of the model as a whole

    def _whole(self, spec: ModelSpec) -> set[str]:
        return {str(p) for p in engine_problems(spec, self.engines) if p.block is None}

    def problems(self, index: int, block: BlockSpec) -> list[str]:
        """Why `engines` cannot serve `block` as block `index`: the problems of that block in a child where it
        takes the place of the parent's block and of every parent block of its kind (so only what `block`
        itself breaks remains, not a disagreement the one-value rules rule out)."""
        key = (type(self.parent.blocks[index]), block)
        if key not in self._cache:
            blocks = [
                block if i == index or type(other) is type(block) else other
                for i, other in enumerate(self.parent.blocks)
            ]
            child = dataclasses.replace(self.parent, blocks=tuple(blocks))
            if self._parents is None:
                self._parents = self._whole(self.parent)
            # the block's own problems, and those of the model as a whole that it brings (transformers')
            self._cache[key] = [
                f"{problem.engine}: {problem.reason}"
                for problem in engine_problems(child, self.engines)
                if problem.block == index or (problem.block is None and str(problem) not in self._parents)
            ]
        return self._cache[key]


def engine_support(spec: ModelSpec) -> dict[str, list[str]]:
    """{engine: [reasons it cannot load `spec`]} for every engine in ENGINES (empty list: it can)."""
    return {engine: [str(problem) for problem in _CHECKS[engine](spec)] for engine in ENGINES}
