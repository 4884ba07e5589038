"""Assembly: a search solution (one variant per block) and the BLD library become a real child model.

Each block of the child takes the library's trained mixer where the solution changed it and a copy of
the parent's mixer elsewhere; pre-norms, embeddings, final norm and lm_head are copies of the parent's.
The child is built once from those mixers (`HybridLM(spec, mixers=...)`), its parameters counted and
checked against the cost model and the solution's predicted totals.

Weight formats: a block whose variant has a quantized `weight_format` (fp8, nvfp4) carries its covered
matmul weights fake-quantized (`puzzle.blocks.formats.bake`, in the child's dtype) and keeps that format
in its spec (`child.spec.blocks[i].weight_format`, `puzzle.spec.weight_formats(child.spec)`), which
`Assembly.to_dict` also states per block (`weight_format`, only where not bf16): what an export needs to write
each block in its format.

MTP: the search never changes the parent's multi-token-prediction module (it is not one of the searched
blocks, and the child keeps the parent's hidden size and vocabulary, the only shapes it shares with the
backbone), so its tensors are carried unchanged (`HybridLM.extra_tensors`) and its blocks are written
as `mtp_block_configs` on export; `Assembly.mtp` records it for `puzzle.json`. A child whose hidden size
or vocabulary differed from the parent's could not carry them: assemble refuses it rather than drop them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from puzzle import shard
from puzzle.artifacts import ArtifactError, fingerprint_checkpoint, fingerprint_model, loaded_fingerprint
from puzzle.blocks import build_block, formats
from puzzle.compare import ModelComparison, compare_models
from puzzle.cost import model_active_params, model_params
from puzzle.library import Library, read_library
from puzzle.model import HybridLM
from puzzle.nemotron_h.config import mtp_block_specs
from puzzle.scores import Scores
from puzzle.search.types import Solution
from puzzle.spec import (
    DEFAULT_WEIGHT_FORMAT,
    BlockSpec,
    ModelSpec,
    SpecError,
    Variant,
    block_to_dict,
    weight_format_of,
)

# Tensors the router keeps in fp32 whatever the model's dtype (as `puzzle.load` and transformers do).
_FP32_TENSORS = ("gate.weight", "gate.e_score_correction_bias")

SolutionLike = Solution | Mapping[int, Variant | BlockSpec | str] | Sequence[Variant]


class AssemblyError(ValueError):
    """A solution that cannot be assembled from this library and parent (unknown or failed variant...)."""


@dataclass(frozen=True)
class AssembledBlock:
    """Block `variant.block_index` of the child: its variant and where its weights came from
    ("parent": a copy of the parent's mixer, "library": BLD's trained weights, "noop": no weights)."""

    variant: Variant
    source: str
    predicted_kl: float | None = None  # its replace-one-block score, when scores were given

    def to_dict(self) -> dict[str, Any]:
        out = {
            "block": self.variant.block_index,
            "variant": self.variant.id,
            "source": self.source,
            "predicted_kl": self.predicted_kl,
            "spec": block_to_dict(self.variant.spec),
        }
        fmt = weight_format_of(self.variant.spec)
        if fmt != DEFAULT_WEIGHT_FORMAT:  # a bf16 child's puzzle.json stays as it was
            out["weight_format"] = fmt
        return out


@dataclass
class Assembly:
    """What `assemble` built, for `puzzle.json`: the blocks, the parent, the predictions and the MTP handling.

    `predicted`: "params" and "active_params" (cost model of the child's spec, equal to the counted
    tensors), and when the solution is a search `Solution`: "kl" (its objective, the summed
    replace-one-block score), "totals" (every cost the search summed), "status", "gap", "solver".
    """

    blocks: list[AssembledBlock]
    parent_path: str | None
    parent_fingerprint: str
    predicted: dict[str, Any]
    mtp: dict[str, Any]
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def predicted_kl(self) -> float | None:
        return self.predicted.get("kl")

    def to_dict(self) -> dict[str, Any]:
        return {
            "parent": {"path": self.parent_path, "fingerprint": self.parent_fingerprint},
            "solution": [block.to_dict() for block in self.blocks],
            "changed_blocks": [b.variant.block_index for b in self.blocks if b.source != "parent"],
            "predicted": dict(self.predicted),
            "measured": dict(self.measured),
            "mtp": dict(self.mtp),
        }


# ------------------------------------------------------------------------------------------ the solution


def _block_index(name: str) -> int:
    """`block_12` (the block names of `puzzle.search.budget.deployment_problem`) -> 12."""
    prefix, _, number = name.partition("_")
    if prefix != "block" or not number.isdigit():
        raise AssemblyError(
            f"solution block name {name!r} is not one of ours ('block_<index>'); a solution over a library "
            "file measured elsewhere names no variant of this library"
        )
    return int(number)


def _variant_by_id(index: int, variant_id: str, library: Library, parent_spec: ModelSpec) -> Variant:
    own = parent_spec.blocks[index]
    if variant_id == own.short_name():
        return Variant(index, own)
    for variant in library.results:
        if variant.block_index == index and variant.id == variant_id:
            return variant
    known = sorted({own.short_name()} | {v.id for v in library.results if v.block_index == index})
    raise AssemblyError(
        f"block {index}: variant {variant_id!r} is neither the parent's block nor in the library at "
        f"{library.directory}; variants of block {index}: {known}"
    )


def solution_variants(solution: SolutionLike, library: Library, parent_spec: ModelSpec) -> list[Variant]:
    """One Variant per block of the parent from a solution.

    `solution`: a search `Solution` (variant ids per block name `block_<i>`), a mapping {block index:
    Variant, BlockSpec or variant id}, or a sequence of Variants; blocks a mapping or sequence leaves
    out keep the parent's block. Ids are looked up among the parent's block and the library's variants.
    """
    chosen: dict[int, Variant] = {}
    if isinstance(solution, Solution):
        if len(solution.names) != parent_spec.num_blocks:
            raise AssemblyError(
                f"the solution chooses {len(solution.names)} blocks, the parent has {parent_spec.num_blocks}"
            )
        entries: Iterable[tuple[int, Any]] = ((_block_index(k), v) for k, v in solution.names.items())
    elif isinstance(solution, Mapping):
        entries = solution.items()
    elif isinstance(solution, Sequence) and not isinstance(solution, (str, bytes)):
        entries = []
        for variant in solution:
            if not isinstance(variant, Variant):
                raise AssemblyError(f"a solution sequence holds Variants, found {type(variant).__name__}")
            entries.append((variant.block_index, variant))
    else:
        raise AssemblyError(
            f"a solution is a puzzle.search.Solution, a {{block: variant}} mapping or a list of Variants, "
            f"found {type(solution).__name__}"
        )
    for index, value in entries:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < parent_spec.num_blocks:
            raise AssemblyError(
                f"block {index!r} is not a block of the parent ({parent_spec.num_blocks} blocks)"
            )
        if index in chosen:
            raise AssemblyError(f"block {index} is chosen twice")
        if isinstance(value, str):
            if "#" in value:
                raise AssemblyError(
                    f"block {index}: variant name {value!r} marks two variants with one spec; "
                    "give the Variant itself"
                )
            variant = _variant_by_id(index, value, library, parent_spec)
        elif isinstance(value, Variant):
            variant = value
        else:
            try:
                variant = Variant(index, value)
            except SpecError as error:
                raise AssemblyError(f"block {index}: {error}") from error
        if variant.block_index != index:
            raise AssemblyError(f"block {index}: the variant given is for block {variant.block_index}")
        chosen[index] = variant
    return [chosen.get(i, Variant(i, parent_spec.blocks[i])) for i in range(parent_spec.num_blocks)]


# -------------------------------------------------------------------------------------------- the mixers


def _match_parent(
    mixer: nn.Module, parent_mixer: nn.Module, dtype: torch.dtype, device: torch.device
) -> None:
    """Cast a library mixer to the parent's dtype per tensor name (the router stays fp32 where the parent's
    is) and move it to the parent's device, in place."""
    reference = dict(parent_mixer.state_dict())
    for name, tensor in [*mixer.named_parameters(), *mixer.named_buffers()]:
        own = reference.get(name)
        target = own.dtype if own is not None and name.endswith(_FP32_TENSORS) else dtype
        tensor.data = tensor.data.to(device=device, dtype=target)


def _library_mixer(library: Library, variant: Variant, parent: HybridLM) -> tuple[nn.Module, str]:
    """The mixer of a changed block and its source ("library" or "noop"), or a clear AssemblyError."""
    result = library.results.get(variant)
    where = f"block {variant.block_index}: variant {variant.id}"
    if result is None:
        raise AssemblyError(f"{where} is not in the library at {library.directory}")
    if result.status == "failed":
        raise AssemblyError(
            f"{where} failed in BLD (step {result.failed_step}: {result.reason}); it has no weights to assemble"
        )
    if result.status == "noop":
        return build_block(variant.spec, parent.spec.hidden_size, parent.spec.norm_eps), "noop"
    if result.status == "parent":  # listed in the library, equal to the parent's block
        return _parent_mixer(parent, variant.block_index), "parent"
    try:
        mixer = library.load_mixer(variant, parent.spec.hidden_size, parent.spec.norm_eps)
    except (ArtifactError, OSError, RuntimeError, ValueError) as error:
        raise AssemblyError(f"{where}: its library file {result.file} cannot be read: {error}") from error
    parent_mixer = parent.layers[variant.block_index].mixer
    _match_parent(mixer, parent_mixer, parent.embeddings.weight.dtype, parent.embeddings.weight.device)
    # A quantized variant: the child carries its covered weights fake-quantized, in the child's dtype (the
    # values an export stores; the mixer's forward fake-quantizes them again, which leaves them as they are).
    formats.bake(mixer)
    return mixer, "library"


def _copy_parameter(tensor: torch.Tensor) -> nn.Parameter:
    """A plain copy of a parent tensor (all-gathered first when the parent is sharded: a collective)."""
    return nn.Parameter(shard.replicated(tensor.detach()).clone())


def _parent_mixer(parent: HybridLM, index: int) -> nn.Module:
    """A plain copy of the parent's mixer of block `index`, sharing nothing with it (gathered first when the
    parent is sharded, a collective: a deep copy of an FSDP unit would carry its shards and FSDP state)."""
    mixer = parent.layers[index].mixer
    if shard.mode_of(mixer) is None:
        return copy.deepcopy(mixer)
    spec = parent.spec  # gathered straight into a new module: one whole copy, not a gathered one and its copy
    return shard.plain_unit(mixer, lambda: build_block(mixer.spec, spec.hidden_size, spec.norm_eps))


def _parent_fingerprint(library: Library, parent: HybridLM) -> str:
    """`parent`'s fingerprint as the library records it when it is this parent's: `fingerprint_model`, or,
    for a library `puzzle.Run` built (keyed by the parent's files), `loaded_fingerprint` of the checkpoint
    the parent was loaded from in its dtype (those files are read to hash them). Else `fingerprint_model`."""
    found = fingerprint_model(parent)
    if library.parent != found and parent.source_path is not None and Path(parent.source_path).is_dir():
        files = loaded_fingerprint(fingerprint_checkpoint(parent.source_path), parent.embeddings.weight.dtype)
        if library.parent == files:
            return files
    return found


def _mtp_record(parent: HybridLM) -> dict[str, Any]:
    names = sorted(parent.extra_tensors)
    config = parent.source_config or {}
    blocks = mtp_block_specs(config) if config else []
    mtp_names = [name for name in names if name.startswith("mtp.")]
    if mtp_names:
        handling = "carried unchanged from the parent (the search does not change the MTP module)"
    elif blocks:
        handling = "declared by the parent's config, no mtp.* tensors in its checkpoint: none to carry"
    else:
        handling = "none: the parent has no MTP module"
    return {
        "handling": handling,
        "num_nextn_predict_layers": config.get("num_nextn_predict_layers", 0),
        "tensors": len(mtp_names),
        "blocks": [block_to_dict(block) for block in blocks],
        "other_extra_tensors": [name for name in names if not name.startswith("mtp.")],
    }


# ---------------------------------------------------------------------------------------------- assemble


def assemble(
    solution: SolutionLike,
    library: Library | str | Path,
    parent: HybridLM,
    *,
    scores: Mapping[Variant, Any] | Scores | None = None,
    check_parent: bool = True,
    parent_fp: str | None = None,
    shard_child: bool | None = None,
) -> HybridLM:
    """The child of `solution`: library weights where it changes a block, the parent's elsewhere.

    `solution`: see `solution_variants`. `library`: a `Library` or its directory. `scores`: optional
    replace-one-block scores (`puzzle.scores.Scores`, or {Variant: KL}) recorded per block, the parent's
    own blocks at 0; their sum is the predicted KL when the solution is not a search `Solution`. `parent`: the model
    the library was built from (a fresh load: BLD shards the parent it trains on); with `check_parent`
    its fingerprint must be the library's: `parent_fp` when given (`puzzle.Run` passes the one it built the
    library with), else `fingerprint_model(parent)` or, for a library a Run built, the fingerprint of the
    checkpoint the parent was loaded from (`_parent_fingerprint`). A sharded (FSDP2) parent is gathered a unit at
    a time for what the child copies (a collective: every rank assembles). `shard_child` (default: whether
    the parent is sharded) builds the child sharded as the parent is (`puzzle.shard.shard_parent`, on the
    parent's mesh): each mixer is sharded as soon as it is built or loaded, the embeddings and lm_head as
    soon as they are copied, so a rank never holds more than its shards plus one whole unit. Returns a new HybridLM in eval mode on the parent's device,
    sharing no tensor with the parent, with `child.assembly` (an `Assembly`), the parent's extra (MTP)
    tensors, source config and path (so a save never writes into the parent's directory and copies its
    tokenizer files).

    Raises AssemblyError for an unknown variant id, a variant that failed in BLD or has no file, a
    library of another parent, or parameter counts that differ from the cost model or the solution's
    predicted totals.
    """
    if not isinstance(library, Library):
        library = read_library(library)
    if any(t.is_meta for t in parent.state_dict().values()):
        raise AssemblyError("the parent is on the meta device: assembly needs its weights")
    if parent_fp is not None:
        parent_fingerprint = parent_fp
    else:
        parent_fingerprint = (
            _parent_fingerprint(library, parent) if check_parent else fingerprint_model(parent)
        )
    if check_parent and library.parent != parent_fingerprint:
        raise AssemblyError(
            f"the library at {library.directory} was built from another parent (fingerprint "
            f"{library.parent[:12]}..., this parent {parent_fingerprint[:12]}...); load the parent it was "
            "built from, in the same dtype"
        )
    variants = solution_variants(solution, library, parent.spec)
    mode = shard.mode_of(parent)
    if shard_child is None:
        shard_child = mode is not None
    mode = (mode or "fsdp") if shard_child and shard.active("fsdp") else None
    mixers: list[nn.Module] = []
    blocks: list[AssembledBlock] = []
    for variant in variants:
        if variant.spec == parent.spec.blocks[variant.block_index]:
            mixer, source = _parent_mixer(parent, variant.block_index), "parent"
        else:
            mixer, source = _library_mixer(library, variant, parent)
        if mode is not None:  # sharded now: one whole mixer at a time on this rank
            shard.shard_unit(mixer, mode)
        mixers.append(mixer)
        blocks.append(AssembledBlock(variant, source, _score_of(scores, variant, parent.spec)))
    spec = ModelSpec(
        vocab_size=parent.spec.vocab_size,
        hidden_size=parent.spec.hidden_size,
        blocks=tuple(variant.spec for variant in variants),
        norm_eps=parent.spec.norm_eps,
        tie_embeddings=parent.spec.tie_embeddings,
    )
    with torch.device("meta"):  # only the small parts outside the mixers; they are the parent's below
        child = HybridLM(spec, mixers=mixers)
    child.embeddings.weight = _copy_parameter(parent.embeddings.weight)
    if mode is not None:
        shard.shard_unit(child.embeddings, mode)
    child.norm_f.weight = _copy_parameter(parent.norm_f.weight)
    if spec.tie_embeddings:
        child.lm_head.weight = child.embeddings.weight
    else:
        child.lm_head.weight = _copy_parameter(parent.lm_head.weight)
        if mode is not None:
            shard.shard_unit(child.lm_head, mode)
    for index, block in enumerate(child.layers):
        if block.norm is None:
            continue
        parent_norm = parent.layers[index].norm
        if parent_norm is None:  # BLD never trains a variant for a removed block
            raise AssemblyError(f"block {index}: the parent's block is a no-op, it has no pre-norm to keep")
        block.norm.weight = _copy_parameter(parent_norm.weight)
    left = [name for name, t in [*child.named_parameters(), *child.named_buffers()] if t.is_meta]
    if left:
        raise AssemblyError(f"assembly left tensors without weights: {left[:5]}")
    predicted = _check_parameter_counts(child, solution)
    if "kl" not in predicted and scores is not None:
        predicted["kl"] = sum(block.predicted_kl for block in blocks)
    child.extra_tensors = dict(parent.extra_tensors)
    child.source_config = None if parent.source_config is None else dict(parent.source_config)
    child.source_path = parent.source_path
    path = None if parent.source_path is None else str(parent.source_path)
    child.assembly = Assembly(blocks, path, parent_fingerprint, predicted, _mtp_record(parent))
    return child.requires_grad_(True).eval()


def _score_of(
    scores: Mapping[Variant, Any] | Scores | None, variant: Variant, parent_spec: ModelSpec
) -> float | None:
    """The variant's replace-one-block KL from `scores` (0 for the parent's own block); None without scores."""
    if scores is None:
        return None
    if variant.spec == parent_spec.blocks[variant.block_index]:
        return 0.0
    table = scores.variants if isinstance(scores, Scores) else scores
    if variant not in table:
        raise AssemblyError(
            f"block {variant.block_index}: variant {variant.id} has no score in the scores given"
        )
    value = table[variant]
    value = getattr(value, "kl", value)
    if value is None:
        raise AssemblyError(
            f"block {variant.block_index}: variant {variant.id} has no KL (its scoring failed)"
        )
    return float(value)


def _check_parameter_counts(child: HybridLM, solution: SolutionLike) -> dict[str, Any]:
    """Counted parameters == the cost model's for the child's spec == the solution's totals (when it has them)."""
    spec = child.spec
    counted = sum(p.numel() for p in child.parameters())  # a tied lm_head is one parameter
    params, active = model_params(spec), model_active_params(spec)
    if counted != params:
        raise AssemblyError(
            f"the assembled child has {counted} parameters, the cost model counts {params} for its spec"
        )
    predicted: dict[str, Any] = {"params": params, "active_params": active}
    if isinstance(solution, Solution):
        for key, value in (("params", params), ("active_params", active)):
            if key in solution.totals and round(solution.totals[key]) != value:
                raise AssemblyError(
                    f"the assembled child has {key} {value}, the solution predicted {solution.totals[key]:.0f}"
                )
        predicted.update(
            kl=solution.objective,
            totals=dict(solution.totals),
            status=solution.status,
            gap=solution.gap,
            solver=solution.solver,
        )
    return predicted


def measured_kl(
    child: HybridLM,
    parent: HybridLM,
    batches: Sequence[torch.Tensor] | Callable[[], Iterable[torch.Tensor]],
    vocab_chunk: int = 4096,
) -> dict[str, Any]:
    """The child's mean KL(parent || child) on held-out batches (`puzzle.compare.compare_models`) next to the
    solution's predicted (summed replace-one-block) KL; also stored in `child.assembly.measured`.

    Returns {"kl", "lm_loss_delta", "top1", "tokens", "predicted_kl"} (nats/token; predicted_kl None
    when the child was not assembled from a search Solution).
    """
    comparison: ModelComparison = compare_models(parent, child, batches, vocab_chunk)
    assembly = getattr(child, "assembly", None)
    out = {**comparison.to_dict(), "predicted_kl": None if assembly is None else assembly.predicted_kl}
    if assembly is not None:
        assembly.measured = dict(out)
    return out
