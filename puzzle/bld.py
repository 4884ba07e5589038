"""Blockwise local distillation (BLD): every variant of block i learns to map the parent's input of block i
to the parent's output of block i, all variants of a block fed by one parent forward.

The loss of a variant of block i is the normalised squared error of its residual contribution,
``||child(h) - parent(h)||^2 / ||parent(h)||^2`` with ``h = norm_i(x_i)`` the parent's normed input of
block i and ``parent(h)`` the parent mixer's output (a block is ``x + mixer(norm(x))``, so the
contribution is what the mixer adds to the residual stream). A variant is a mixer: it keeps the parent's
pre-norm (frozen, as `HybridLM.replace_mixer` does), so the normed input is computed once per block and
shared by every variant of that block. One training step runs the parent block by block over one batch
of token ids and, at each block, does the forward and backward of every variant of that block on the
detached input; no prefix is ever recomputed per block or per variant.

Variants start from `puzzle.prune.init_child` (activation importance of the parent) and train with AdamW
(one optimiser per variant: a diverging variant cannot disturb the others), linear warm-up then cosine
decay over a token budget, gradient clipping per variant, bf16 autocast on CUDA. A variant equal to the
parent block ("parent") or a no-op ("noop") is not trained; its held-out error is measured all the same.
MoE routers are not trained by default (`BLDSettings.router_lr_scale`): which experts a router picks has no
gradient, and AdamW's lr-sized steps on its weights change those picks. A variant whose loss or gradient
norm becomes NaN / inf stops training with the step and reason recorded, and the others go on.

The guard: every trained variant keeps whichever of its initial and trained weights has the lower held-out
normalised MSE (the initial weights are saved under the checkpoints when its wave starts, so a resumed wave
has them too); library.json says which (`kept`) and records both errors. A variant whose training diverged
keeps its initial weights; it is "failed" only when those are not finite either.

Memory: the variants train in waves whose estimated training bytes per rank (`variant_training_bytes`:
sharded weights and AdamW state under FSDP, this rank's rows of activations) fit what
`BLDSettings.variants_per_wave` / `memory_limit_bytes` allow (`puzzle.plan.bld_wave_limit`: by default, what
the device's usable memory leaves after the stage's other parts, as `puzzle plan` computes it); each wave is
one pass of the parent over the training data. The plan is logged with its reason before training starts and
returned. The waves change neither the library nor its reuse key: each variant trains on the same batches
from the same initial weights in whichever wave it falls.

Distributed: under torch.distributed every rank passes the same global batches; each rank runs its rows
(round-robin) and the loss is normalised by the global ``||parent(h)||^2`` (one scalar all-reduce per block
and step), so a world of N computes the same library as one process up to float summation order. With
`BLDSettings.shard = "fsdp"` (the default) and more than one rank, the parent and the variants are sharded
with FSDP2 (`torch.distributed.fsdp.fully_shard`): the parent's embeddings, lm_head and every block's mixer
are one unit each (frozen, all-gathered for their forward and freed after it; the small pre-norms stay
replicated because BLD calls them apart from their block), and each variant mixer is one unit, so its
weights, gradients and AdamW moments are split over the ranks and FSDP's reduce-scatter sums its gradients
(divide factor 1: the loss already carries the global normaliser); clipping uses the global norm of the
sharded gradients. The parent is sharded in place (its parameters become DTensors): load a fresh one for
later stages. With "none" the parent and the variants are replicated and the gradients all-reduced (plain
data parallelism). One process runs the same code without sharding. Checkpoints and library files hold full
(gathered) tensors, written by rank 0.

Resume: every `checkpoint_every` steps the wave's variant weights, AdamW states and position (step,
tokens) are written atomically under `<directory>/bld-checkpoints/`; a finished wave writes its variants'
final weights there. A killed run restarted with the same inputs continues from there and ends with the
same weights as an uninterrupted run (the schedule is a function of the tokens seen, the data stream is
replayed and skipped up to the saved position). The library is then written through `puzzle.artifacts`
in the format of `puzzle.library` (which also reads it back, `read_library`):
``block{i}/{id, ':' as '_'}.safetensors`` per trained variant (its kept weights: the mixer's `state_dict()`,
i.e. module keys relative to the mixer, as `HybridLM.layers[i].mixer` loads them; routed MoE experts in the
expert-bank layout) and ``library.json``; the checkpoints are then removed.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from puzzle import dist, shard
from puzzle.artifacts import (
    Artifact,
    ArtifactError,
    DamagedOutputError,
    fingerprint_json,
    fingerprint_model,
    fingerprint_tensors,
    json_writer,
)
from puzzle.blocks.moe import TopKRouter
from puzzle.cost.hardware import DEFAULT_MEMORY_FRACTION
from puzzle.files import atomic_write
from puzzle.library import (
    ARTIFACT_NAME,
    FORMAT_VERSION,
    LIBRARY_FILE,
    STATUSES,
    Library,
    VariantResult,
    library_json,
    read_library,
    variant_file,
    variant_key,
)
from puzzle.model import HybridLM
from puzzle.plan import (
    WaveLimit,
    bld_wave_limit,
    device_memory_bytes,
    library_other_parts,
    variant_training_bytes,
)
from puzzle.progress import progress_bar
from puzzle.prune.importance import ModelImportance
from puzzle.prune.init import init_child
from puzzle.resume import (
    announce_resume,
    load_optimizer_tensors,
    optimizer_tensors,
    read_checkpoint,
    write_checkpoint,
)
from puzzle.settings import BLDSettings, learning_rate, split_batch
from puzzle.spec import NoOpSpec, SpecError, Variant

CHECKPOINT_DIR = "bld-checkpoints"
_log = logging.getLogger(__name__)

Batches = Callable[[], Iterable[torch.Tensor]] | Sequence[torch.Tensor]


def _order(variant: Variant) -> tuple[int, str]:
    return variant.block_index, variant.id


# ----------------------------------------------------------------------------------------------------------
# The parent pass shared by training and evaluation.


def _parent_blocks(
    parent: HybridLM, ids: torch.Tensor, last: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(block index, normed input h, mixer output p) of every non-no-op block up to `last`, without grad.

    The residual stream advances as in `Block.forward` (x + mixer(norm(x))), one block at a time.
    """
    with torch.no_grad():
        x = parent.embeddings(ids.to(parent.embeddings.weight.device))
    for index, block in enumerate(parent.layers[: last + 1]):
        if block.norm is None:
            continue
        with torch.no_grad():
            h = block.norm(x.to(block.norm.weight.dtype))
            p = block.mixer(h)
        yield index, h, p
        with torch.no_grad():
            x = x + p


def _autocast(settings: BLDSettings, device: torch.device) -> Any:
    enabled = settings.autocast and device.type == "cuda"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def _held_out_nmse(
    parent: HybridLM,
    mixers: Mapping[Variant, nn.Module],
    held_out: Sequence[torch.Tensor],
    settings: BLDSettings,
) -> dict[Variant, float | None]:
    """Held-out normalised MSE of every mixer: sum of squared errors / sum of the parent's squares, over
    every held-out token (batches sharded over ranks, sums all-reduced)."""
    by_block = _by_block(mixers)
    if not by_block:
        return {}
    order = sorted(mixers, key=_order)
    sums = torch.zeros(len(order) + 1, len(parent.layers), dtype=torch.float64)  # last row: parent squares
    position = {v: n for n, v in enumerate(order)}
    device = parent.embeddings.weight.device
    # Sharded units all-gather in their forward, so every rank must run every batch (its rows of it).
    batches = (
        [dist.local_rows(b) for b in held_out] if shard.active(settings.shard) else list(dist.shard(held_out))
    )
    for batch in batches:
        for index, h, p in _parent_blocks(parent, batch, max(by_block)):
            if index not in by_block:
                continue
            target = p.float()
            sums[-1, index] += target.pow(2).sum().double().cpu()
            for variant, mixer in by_block[index]:
                with _autocast(settings, device):
                    out = mixer(h.to(shard.main_dtype(mixer) or h.dtype))
                sums[position[variant], index] += (out.float() - target).pow(2).sum().double().cpu()
    dist.all_reduce_sum_([sums])
    result: dict[Variant, float | None] = {}
    for variant in order:
        value = float(sums[position[variant], variant.block_index] / sums[-1, variant.block_index])
        result[variant] = value if math.isfinite(value) else None
    return result


def _by_block(mixers: Mapping[Variant, nn.Module]) -> dict[int, list[tuple[Variant, nn.Module]]]:
    grouped: dict[int, list[tuple[Variant, nn.Module]]] = {}
    for variant in sorted(mixers, key=_order):
        grouped.setdefault(variant.block_index, []).append((variant, mixers[variant]))
    return grouped


# ----------------------------------------------------------------------------------------------------------
# One wave: training state, step, checkpoints.


@dataclass
class _Wave:
    """The training state of one wave: live mixers and optimisers, results, position in the data."""

    number: int
    mixers: dict[Variant, nn.Module]
    optimizers: dict[Variant, torch.optim.AdamW]
    results: dict[Variant, VariantResult]
    step: int = 0
    tokens: int = 0

    def active(self) -> dict[Variant, nn.Module]:
        return {v: m for v, m in self.mixers.items() if self.results[v].status == "trained"}


def _param_groups(mixer: nn.Module, settings: BLDSettings) -> list[dict[str, Any]]:
    """AdamW groups of a variant mixer, each with its `lr_scale` (the step's lr times it): the routers'
    parameters at `settings.router_lr_scale` (frozen, and in no group, at 0), every other parameter at 1.

    Sets `requires_grad` accordingly; empty groups are left out (the order is fixed: resume restores the
    AdamW state by parameter index)."""
    routers = {id(p) for m in mixer.modules() if isinstance(m, TopKRouter) for p in m.parameters()}
    scales = {"router": settings.router_lr_scale, "rest": 1.0}
    members: dict[str, list[nn.Parameter]] = {"rest": [], "router": []}
    for parameter in mixer.parameters():
        name = "router" if id(parameter) in routers else "rest"
        parameter.requires_grad_(scales[name] > 0)
        if scales[name] > 0:
            members[name].append(parameter)
    return [{"params": ps, "lr_scale": scales[name]} for name, ps in members.items() if ps]


def _train_step(
    parent: HybridLM, wave: _Wave, batch: torch.Tensor, settings: BLDSettings
) -> dict[Variant, float]:
    """One step of every active variant of `wave` on one global batch; returns the global loss per variant.

    Variants whose loss or gradient norm is not finite are marked failed and not updated.
    """
    active = wave.active()
    by_block = _by_block(active)
    device = parent.embeddings.weight.device
    losses: dict[Variant, torch.Tensor] = {}
    for index, h, p in _parent_blocks(parent, dist.local_rows(batch), max(by_block)):
        if index not in by_block:
            continue
        target = p.float()
        scale = target.pow(2).sum()
        dist.all_reduce_sum_([scale])  # the global normaliser: N ranks = 1 process
        for variant, mixer in by_block[index]:
            with _autocast(settings, device):
                out = mixer(h.detach().to(shard.main_dtype(mixer) or h.dtype))
            loss = (out.float() - target).pow(2).sum() / scale
            loss.backward()
            losses[variant] = loss.detach()
    order = sorted(active, key=_order)
    params = {v: [p for p in active[v].parameters() if p.requires_grad] for v in order}
    if not shard.active(settings.shard):  # FSDP's reduce-scatter has summed the sharded variants' gradients
        dist.all_reduce_sum_([p.grad for v in order for p in params[v] if p.grad is not None])
    values = torch.stack([losses[v] for v in order]).double()
    dist.all_reduce_sum_([values])
    clip = settings.clip if settings.clip > 0 else math.inf
    # With DTensor gradients clip_grad_norm_ reduces the norm over the shards: the global norm.
    norms = torch.stack(
        [shard.replicated(torch.nn.utils.clip_grad_norm_(params[v], clip)).double() for v in order]
    )
    lr = learning_rate(settings, wave.tokens)
    result = {}
    # One host sync for all variants' losses and gradient norms (not one per variant on a GPU).
    for variant, value, norm in zip(order, values.tolist(), norms.tolist()):
        mixer, record = active[variant], wave.results[variant]
        reason = None
        if not math.isfinite(value):
            reason = f"loss is {value}"
        elif not math.isfinite(norm):
            reason = f"gradient norm is {norm}"
        if reason is not None:
            record.status, record.failed_step, record.reason = "failed", wave.step, reason
            _log.warning(
                "BLD: variant %s of block %d failed at step %d: %s",
                variant.id,
                variant.block_index,
                wave.step,
                reason,
            )
            wave.optimizers.pop(variant, None)
            mixer.zero_grad(set_to_none=True)
            continue
        optimizer = wave.optimizers[variant]
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record.tokens += batch.numel()
        result[variant] = value
    return result


def _checkpoint_dir(directory: Path) -> Path:
    return directory / CHECKPOINT_DIR


def _save_checkpoint(directory: Path, wave: _Wave, inputs: Mapping[str, str]) -> None:
    """The wave's weights, AdamW states and position (`puzzle.resume.write_checkpoint`). Sharded tensors are
    gathered there one at a time (collectives, in the same order everywhere)."""
    tensors: dict[str, torch.Tensor] = {}
    for variant in sorted(wave.mixers, key=_order):
        if wave.results[variant].status != "trained":
            continue
        for name, value in wave.mixers[variant].state_dict().items():
            tensors[f"{variant_key(variant)}/param/{name}"] = value.detach()  # gathered as written
        tensors.update(optimizer_tensors(wave.optimizers[variant], f"{variant_key(variant)}/adam/"))
    record = {
        "inputs": dict(inputs),
        "wave": wave.number,
        "step": wave.step,
        "tokens": wave.tokens,
        "results": [wave.results[v].to_dict() for v in sorted(wave.results, key=_order)],
    }
    name = f"wave{wave.number}-step{wave.step}.safetensors"
    write_checkpoint(_checkpoint_dir(directory), f"wave{wave.number}.json", name, tensors, record)


def _load_checkpoint(directory: Path, wave: _Wave, inputs: Mapping[str, str]) -> bool:
    """Restore `wave` from its checkpoint if one exists for these inputs; True when restored."""
    found = read_checkpoint(_checkpoint_dir(directory), f"wave{wave.number}.json", inputs)
    if found is None:
        return False
    record, tensors, _ = found
    wave.step, wave.tokens = int(record["step"]), int(record["tokens"])
    for data in record["results"]:
        result = VariantResult.from_dict(data)
        wave.results[result.variant] = result
    with tensors:  # read lazily: each rank only the rows of its shards of each mixer and its AdamW moments
        for variant, mixer in wave.mixers.items():
            if wave.results[variant].status != "trained":
                wave.optimizers.pop(variant, None)
                continue
            prefix = f"{variant_key(variant)}/param/"
            current = mixer.state_dict()
            names = [key[len(prefix) :] for key in tensors if key.startswith(prefix)]
            state = {
                k: tensors.like(prefix + k, current[k]) if k in current else tensors[prefix + k]
                for k in names
            }
            mixer.load_state_dict(state)  # strict: a name missing or unexpected is an error naming it
            load_optimizer_tensors(wave.optimizers[variant], tensors, f"{variant_key(variant)}/adam/")
    return True


def _save_weights(folder: Path, mixers: Mapping[Variant, nn.Module], dtype: torch.dtype) -> None:
    """Rank 0 writes each mixer's full state dict in `dtype` to `folder/variant_file(variant)` (every rank
    gathers); floating-point tensors only are cast (an index or a count keeps its dtype)."""
    for variant in sorted(mixers, key=_order):
        state = {k: _stored(shard.full(v), dtype) for k, v in mixers[variant].state_dict().items()}
        if dist.is_main():
            atomic_write(folder / variant_file(variant), lambda path, s=state: save_file(s, path))
    dist.barrier()


def _stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def storage_dtype(settings: BLDSettings, parent: HybridLM) -> torch.dtype:
    """The dtype the library stores kept weights in: `settings.save_dtype`, "parent" being the parent's
    (assembly builds the child in it, so a bf16 parent's variants lose nothing by being stored in bf16)."""
    if settings.save_dtype == "parent":
        return parent.embeddings.weight.dtype
    return getattr(torch, settings.save_dtype)


def _save_finished_wave(directory: Path, wave: _Wave, inputs: Mapping[str, str], dtype: torch.dtype) -> None:
    """Rank 0 writes each trained variant's kept weights (the trained ones, or a copy of the initial ones
    saved at the wave's start), then the wave's results (last: the marker)."""
    folder = _checkpoint_dir(directory) / "done"
    kept = {v: wave.results[v].kept for v in wave.mixers if wave.results[v].status == "trained"}
    _save_weights(folder, {v: wave.mixers[v] for v, which in kept.items() if which == "trained"}, dtype)
    for variant in sorted((v for v, which in kept.items() if which == "init"), key=_order):
        source = _checkpoint_dir(directory) / "init" / variant_file(variant)
        if not source.is_file():
            raise ArtifactError(
                f"{source}: the initial weights of variant {variant.id} of block {variant.block_index} are "
                "missing (written when its wave started); remove the checkpoints to retrain the wave"
            )
        if dist.is_main():
            atomic_write(folder / variant_file(variant), lambda path, src=source: shutil.copyfile(src, path))
    if dist.is_main():
        record = {
            "inputs": dict(inputs),
            "results": [wave.results[v].to_dict() for v in sorted(wave.results, key=_order)],
        }
        atomic_write(folder / f"wave{wave.number}.json", json_writer(record))
        for stale in _checkpoint_dir(directory).glob(f"wave{wave.number}[.-]*"):
            stale.unlink(missing_ok=True)
    dist.barrier()


def _finished_wave(directory: Path, number: int, inputs: Mapping[str, str]) -> list[VariantResult] | None:
    path = _checkpoint_dir(directory) / "done" / f"wave{number}.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("inputs") != dict(inputs):
        return None
    return [VariantResult.from_dict(data) for data in record["results"]]


# ----------------------------------------------------------------------------------------------------------
# The stage.


def _stream(batches: Batches) -> Iterable[torch.Tensor]:
    if callable(batches):
        return batches()
    if isinstance(batches, Sequence):
        return batches
    raise TypeError(
        "train_batches must be a zero-argument callable returning token batches or a sequence of batches "
        f"(each wave and each resume replays the data), found a {type(batches).__name__}"
    )


def default_init(parent: HybridLM, importance: ModelImportance | None) -> Callable[[Variant], nn.Module]:
    """`init_child` of each variant from the parent's block, with the parent's importance of that block."""

    def init(variant: Variant) -> nn.Module:
        block = parent.layers[variant.block_index]
        scores = None
        if importance is not None and variant.block_index in importance.blocks:
            scores = importance[variant.block_index]
        return init_child(
            block.mixer,
            block.spec,
            variant.spec,
            scores,
            hidden_size=parent.spec.hidden_size,
            norm_eps=parent.spec.norm_eps,
        )

    return init


def _classify(parent: HybridLM, variant: Variant) -> str:
    """'parent', 'noop' or 'trained' (to train); an unusable variant is an error naming it."""
    if not 0 <= variant.block_index < len(parent.layers):
        raise SpecError(
            f"variant {variant.id}: block {variant.block_index} is not in the parent ({len(parent.layers)} blocks)"
        )
    parent_spec = parent.layers[variant.block_index].spec
    if variant.spec == parent_spec:
        return "parent"
    if isinstance(variant.spec, NoOpSpec):
        return "noop"
    if isinstance(parent_spec, NoOpSpec):
        raise SpecError(
            f"variant {variant.id} of block {variant.block_index}: the parent block is a no-op, nothing to distil"
        )
    return "trained"


def build_library(
    parent: HybridLM,
    variants: Mapping[int, Sequence[Variant]],
    train_batches: Batches,
    held_out: Sequence[torch.Tensor],
    importance: ModelImportance | None,
    settings: BLDSettings,
    directory: str | Path,
    *,
    data_fingerprint: str | None = None,
    init: Callable[[Variant], nn.Module] | None = None,
    max_steps: int | None = None,
    parent_fp: str | None = None,
    memory_bytes: float | None = None,
) -> Library:
    """Train every variant by BLD and write the library to `directory`; returns it.

    `variants`: {block index: [Variant, ...]}; `train_batches`: global token batches [B, T] (int64), a
    sequence or a zero-argument callable returning a fresh iterable (replayed once per wave and on resume);
    `held_out`: batches for the normalised MSE at init and at the end; `importance`: the parent's, for
    `init_child`; `data_fingerprint`: identifies the training data for the reuse / resume checks (default:
    a fingerprint of the first batch); `init`: Variant -> initial mixer (default `default_init`);
    `max_steps`: stop every wave after this many steps (a test hook; the token budget is the normal stop).
    `parent_fp`: the parent's fingerprint, recorded in the library and keying its reuse (`puzzle.Run`
    passes one from the parent's files); default `fingerprint_model(parent)`. `memory_bytes`: the usable
    memory per rank that `variants_per_wave: auto` sizes the waves against (`puzzle.Run` passes its plan's);
    default `DEFAULT_MEMORY_FRACTION` x this process's device memory (`puzzle.plan.device_memory_bytes`).

    A library already in `directory` made from the same inputs is returned without work; checkpoints of
    the same inputs are resumed. Collective under torch.distributed (every rank passes the same arguments).
    """
    directory = Path(directory)
    all_variants = [v for block in sorted(variants) for v in variants[block]]
    for block, listed in variants.items():
        for variant in listed:
            if variant.block_index != block:
                raise SpecError(
                    f"variant {variant.id} is listed under block {block} but is for block {variant.block_index}"
                )
    if len(set(all_variants)) != len(all_variants):
        raise SpecError("the same variant is listed twice")
    statuses = {v: _classify(parent, v) for v in all_variants}
    first = _first(train_batches)
    # Each rank trains on its round-robin rows of every batch: a batch smaller than the world leaves a rank
    # none (an error naming the values that work); one that does not divide by it is shared unevenly.
    split_batch(first.shape[0], dist.world_size(), None, "the BLD training batch (data.batch_size)")
    if data_fingerprint is None:
        data_fingerprint = fingerprint_tensors([first])
    parent_fp = parent_fp or fingerprint_model(parent)
    inputs = {
        "parent": parent_fp,
        "variants": fingerprint_json([v.to_dict() for v in sorted(all_variants, key=_order)]),
        "train_data": data_fingerprint,
        "held_out": fingerprint_tensors(list(held_out)),
        "settings": fingerprint_json(
            {**settings.library_dict(), "max_steps": max_steps, "world": dist.world_size()}
        ),
    }
    artifact = Artifact(directory, ARTIFACT_NAME, FORMAT_VERSION)
    if artifact.load_if_current(inputs) is not None:
        return read_library(directory)
    # A finished library of these inputs with damaged files: only the variants whose files are damaged
    # are trained again; the others' results and files are kept as they are.
    kept = _intact_results(artifact, inputs)
    wave_inputs = inputs
    if kept is not None:
        statuses = {v: "kept" if v in kept.results else s for v, s in statuses.items()}
        redo = sorted((v for v, s in statuses.items() if s == "trained"), key=_order)
        _log.info(
            "BLD: %d damaged variant file(s) in %s; training only %s again",
            len(redo),
            directory,
            ", ".join(f"{v.id} of block {v.block_index}" for v in redo),
        )
        # Checkpoints of this repair are its own: its waves are not the full plan's.
        wave_inputs = {**inputs, "repair": fingerprint_json([variant_key(v) for v in redo])}

    init = default_init(parent, importance) if init is None else init
    parent.requires_grad_(False)
    if shard.active(settings.shard):
        shard.shard_parent(parent, settings.shard)
        init = _init_unsharded(parent, init)
    device = parent.embeddings.weight.device
    tokens_per_step = math.ceil(first.shape[0] / dist.world_size()) * first.shape[1]
    # What one rank holds: a sharded variant keeps 1/world of its weights and AdamW state.
    world = shard.ways(settings.shard)
    to_train = [v for v in all_variants if statuses[v] == "trained"]
    sizes = {
        v: variant_training_bytes(v, parent.spec.hidden_size, tokens_per_step, settings.torch_dtype, world)
        for v in to_train
    }
    others = library_other_parts(
        parent.spec,
        to_train,
        tokens=tokens_per_step,
        dtype_bytes=parent.embeddings.weight.element_size(),
        train_bytes=torch.empty((), dtype=settings.torch_dtype).element_size(),
        world=world,
    )
    if memory_bytes is None and settings.variants_per_wave == "auto" and settings.memory_limit_bytes is None:
        memory_bytes = DEFAULT_MEMORY_FRACTION * device_memory_bytes()[0]
    limit = bld_wave_limit(settings, others, memory_bytes)
    plan = limit.waves(sizes)
    _log_plan(plan, sizes, limit)
    # A wave's checkpoints are of its members: another grouping (another device's auto waves) restarts them.
    wave_inputs = {
        **wave_inputs,
        "waves": fingerprint_json([[variant_key(v) for v in wave] for wave in plan]),
    }
    if dist.is_main():
        _clear_foreign_checkpoints(directory, wave_inputs)
    dist.barrier()

    results: dict[Variant, VariantResult] = {} if kept is None else dict(kept.results)
    fixed = [v for v in all_variants if statuses[v] not in ("trained", "kept")]
    if fixed:  # measured, not trained: the parent copy (~0) and the no-op (1)
        torch.manual_seed(settings.seed)
        mixers = {v: init(v) for v in fixed}
        errors = _held_out_nmse(parent, mixers, held_out, settings)
        for v in fixed:
            results[v] = VariantResult(v, statuses[v], init_nmse=errors[v], final_nmse=errors[v])
        del mixers

    resumed: dict[int, int] = {}
    for number, members in enumerate(plan):
        done = _finished_wave(directory, number, wave_inputs)
        if done is None:
            done, resumed[number] = _run_wave(
                parent,
                number,
                members,
                len(plan),
                train_batches,
                held_out,
                settings,
                directory,
                wave_inputs,
                init,
                device,
                max_steps,
            )
            shard.free_dropped_units()  # this wave's sharded variants
        results.update({r.variant: r for r in done})

    ordered = {v: results[v] for v in sorted(results, key=_order)}
    resumed = {number: step for number, step in resumed.items() if step is not None}
    # A repaired library keeps the plan that trained it first (the repair's waves are recorded in the log).
    library = Library(directory, parent_fp, ordered, plan if kept is None else kept.plan, resumed)
    finished = _checkpoint_dir(directory) / "done"
    kept_files = [] if kept is None else [r.file for r in kept.results.values() if r.file is not None]
    outputs = {
        r.file: (lambda path, src=finished / r.file: shutil.copyfile(src, path))
        for r in ordered.values()
        if r.file is not None and r.file not in kept_files
    }
    outputs[LIBRARY_FILE] = json_writer(library_json(library, settings.to_dict()))
    summary = {s: sum(r.status == s for r in ordered.values()) for s in STATUSES}
    artifact.write(inputs, outputs, {"variants": len(ordered), **summary}, keep=kept_files)
    if dist.is_main():
        shutil.rmtree(_checkpoint_dir(directory), ignore_errors=True)
    dist.barrier()
    return library


def _intact_results(artifact: Artifact, inputs: Mapping[str, str]) -> Library | None:
    """The finished library of `inputs` in the artifact's directory, less the trained variants whose files
    are damaged (their results dropped: they are to be trained again); None when there is no such library
    or nothing in it is damaged. A damaged library.json cannot be repaired in part (the variants' results
    are in it): DamagedOutputError naming it. Collective: every rank gets rank 0's answer."""
    damaged = artifact.damaged_if_current(inputs)
    if not damaged:
        return None
    if LIBRARY_FILE in damaged:
        raise DamagedOutputError(
            f"{damaged[LIBRARY_FILE]}: the library's record of its variants is damaged, so its variant files "
            "cannot be told apart from one another; the library must be trained again",
            artifact.path(LIBRARY_FILE),
        )
    library = dist.broadcast_object(read_library(artifact.directory) if dist.is_main() else None)
    library.results = {v: r for v, r in library.results.items() if r.file not in damaged}
    return library


def _init_unsharded(parent: HybridLM, init: Callable[[Variant], nn.Module]) -> Callable[[Variant], nn.Module]:
    """`init` with the variant's parent block all-gathered (init_child slices the parent's full weights)."""

    def wrapped(variant: Variant) -> nn.Module:
        with shard.gathered_mixer(parent, variant.block_index):
            return init(variant)

    return wrapped


def _first(batches: Batches) -> torch.Tensor:
    for batch in _stream(batches):
        return batch
    raise ValueError("train_batches yielded no batch")


def _log_plan(plan: list[list[Variant]], sizes: Mapping[Variant, int], limit: WaveLimit) -> None:
    if not dist.is_main():
        return
    _log.info("BLD plan: %d variants in %d wave(s); %s", sum(map(len, plan)), len(plan), limit.reason)
    for number, wave in enumerate(plan):
        total = sum(sizes[v] for v in wave)
        names = ", ".join(f"{v.block_index}:{v.id}" for v in wave)
        _log.info("  wave %d: %d variants, ~%.1f MiB: %s", number, len(wave), total / 2**20, names)


def _clear_foreign_checkpoints(directory: Path, inputs: Mapping[str, str]) -> None:
    """Checkpoints of a run with other inputs are useless to this one: remove them (logged)."""
    folder = _checkpoint_dir(directory)
    for path in list(folder.glob("wave*.json")) + list((folder / "done").glob("wave*.json")):
        try:
            same = json.loads(path.read_text()).get("inputs") == dict(inputs)
        except (OSError, ValueError):
            same = False
        if not same:
            _log.info("BLD: removing checkpoints of another run in %s", folder)
            shutil.rmtree(folder, ignore_errors=True)
            return


def _run_wave(
    parent: HybridLM,
    number: int,
    members: list[Variant],
    waves: int,
    train_batches: Batches,
    held_out: Sequence[torch.Tensor],
    settings: BLDSettings,
    directory: Path,
    inputs: Mapping[str, str],
    init: Callable[[Variant], nn.Module],
    device: torch.device,
    max_steps: int | None,
) -> tuple[list[VariantResult], int | None]:
    """Train one wave to the token budget (resuming from its checkpoint), save it; returns its results and
    the step it resumed from (None when it started afresh)."""
    torch.manual_seed(settings.seed + number)
    mixers: dict[Variant, nn.Module] = {}
    optimizers: dict[Variant, torch.optim.AdamW] = {}
    for variant in members:
        mixer = init(variant).to(device=device, dtype=settings.torch_dtype)
        groups = _param_groups(mixer, settings)  # frozen parameters: requires_grad False before sharding
        if shard.active(settings.shard):
            shard.shard_variant(mixer, settings.shard)
            groups = _param_groups(mixer, settings)  # the sharded parameters
        mixers[variant] = mixer
        optimizers[variant] = torch.optim.AdamW(
            groups, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay
        )
    wave = _Wave(number, mixers, optimizers, {v: VariantResult(v, "trained") for v in members})
    resumed_from = None
    if _load_checkpoint(directory, wave, inputs):
        resumed_from = announce_resume(f"BLD wave {number + 1}/{waves}", wave.step, wave.tokens)
    else:
        for variant, value in _held_out_nmse(parent, mixers, held_out, settings).items():
            wave.results[variant].init_nmse = value
        # What the guard falls back to, already in the library's dtype (it is copied there as it is).
        _save_weights(directory / CHECKPOINT_DIR / "init", mixers, storage_dtype(settings, parent))

    resumed_note = f" (resumed at step {resumed_from})" if resumed_from is not None else ""
    bar = progress_bar(
        f"BLD wave {number + 1}/{waves}{resumed_note}", total=settings.token_budget, unit="tok"
    )
    bar.update(wave.tokens)
    started, start_tokens = time.perf_counter(), wave.tokens
    for index, batch in enumerate(_stream(train_batches)):
        if wave.tokens >= settings.token_budget or (max_steps is not None and wave.step >= max_steps):
            break
        if not wave.active():
            break
        if index < wave.step:  # replayed data up to the checkpoint's position
            continue
        losses = _train_step(parent, wave, batch, settings)
        wave.step += 1
        wave.tokens += batch.numel()
        bar.update(batch.numel())
        rate = (wave.tokens - start_tokens) / max(time.perf_counter() - started, 1e-9)
        mean = sum(losses.values()) / len(losses) if losses else float("nan")
        bar.set_postfix(tok_s=f"{rate:.0f}", loss=f"{mean:.4f}", active=len(losses))
        if settings.checkpoint_every and wave.step % settings.checkpoint_every == 0:
            _save_checkpoint(directory, wave, inputs)
    bar.close()
    trained = {v: m for v, m in mixers.items() if wave.results[v].status == "trained"}
    measured = _held_out_nmse(parent, trained, held_out, settings)
    for variant in members:
        _keep_the_better(wave.results[variant], measured.get(variant))
    _save_finished_wave(directory, wave, inputs, storage_dtype(settings, parent))
    return [wave.results[v] for v in members], resumed_from


def _keep_the_better(result: VariantResult, trained_nmse: float | None) -> None:
    """The guard: record the trained weights' held-out error and keep whichever of init and trained is lower.

    Ties keep the trained weights, and so does a variant whose init could not be measured. A variant whose
    training failed (non-finite loss or gradient) keeps a finite init, becoming usable again ("trained",
    kept "init", its failed step and reason still recorded); with a non-finite init it stays "failed".
    """
    diverged = result.status == "failed"
    init = result.init_nmse
    if init is None and diverged:
        return
    result.trained_nmse = None if diverged else trained_nmse
    after = result.trained_nmse
    worse = init is not None and (after is None or after > init)  # a diverged variant's `after` is None
    result.status = "trained"
    result.kept = "init" if worse else "trained"
    result.final_nmse = init if result.kept == "init" else result.trained_nmse
    if result.kept == "init":
        why = result.reason if diverged else f"held-out nMSE {after} after training"
        _log.warning(
            "BLD: variant %s of block %d keeps its initial weights (held-out nMSE %.4g): %s",
            result.variant.id,
            result.variant.block_index,
            init,
            why,
        )
