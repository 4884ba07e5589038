"""FSDP2 sharding of a frozen parent and of variant mixers, shared by BLD and scoring (no-ops in one process).

A stage asks `active(mode)` whether to shard ("fsdp" or "hsdp" under torch.distributed with more than one
rank; "none" keeps everything replicated). "fsdp" shards every unit over all ranks; "hsdp" shards it inside
a node (LOCAL_WORLD_SIZE ranks) and replicates it across nodes, through FSDP2's 2-D device mesh
(`mesh`): on one node it is "fsdp". Sharded units all-gather their weights in their own forward, a
collective: every rank must run the same number of forwards of every unit, in the same order.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from puzzle import dist
from puzzle.blocks import build_block
from puzzle.gathers import track
from puzzle.model import HybridLM

SHARDING_MODES = ("fsdp", "hsdp")  # the `shard` settings that shard ("none" replicates)

# The HSDP mesh of this process group, made once (building a mesh creates process groups: a collective).
_meshes: dict[tuple[int, int, int], DeviceMesh] = {}


def active(mode: str) -> bool:
    """Whether `mode` shards in this process: "fsdp" or "hsdp", and more than one rank."""
    return mode in SHARDING_MODES and dist.world_size() > 1


def node_size() -> int:
    """Ranks per node: torchrun's LOCAL_WORLD_SIZE (the whole world when it is not set)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return dist.world_size() if value is None else int(value)


def mesh(mode: str) -> DeviceMesh | None:
    """The device mesh `mode` shards over: None (FSDP2's default, every rank in one dimension) for "fsdp"
    and for "hsdp" on one node; for "hsdp" over several nodes a 2-D mesh ("replicate", "shard") of
    (nodes, LOCAL_WORLD_SIZE): each unit is sharded over the ranks of a node and replicated across nodes.
    A collective the first time (it creates the mesh's process groups), cached after."""
    if mode != "hsdp":
        return None
    world, node = dist.world_size(), node_size()
    if node >= world:
        return None
    if node < 1 or world % node:
        raise ValueError(
            f"shard 'hsdp': the world of {world} ranks is not a whole number of nodes of LOCAL_WORLD_SIZE={node} "
            "ranks; launch the same --nproc-per-node on every node"
        )
    key = (id(torch.distributed.group.WORLD), world, node)
    if key not in _meshes:
        _meshes[key] = init_device_mesh(
            dist.device().type, (world // node, node), mesh_dim_names=("replicate", "shard")
        )
    return _meshes[key]


def forget_meshes() -> None:
    """Drop the cached meshes (before the process group they were made over is destroyed)."""
    _meshes.clear()


def ways(mode: str) -> int:
    """How many pieces `mode` cuts each unit into in this process: the world for "fsdp", the ranks of a
    node for "hsdp" over several nodes, 1 when it does not shard."""
    if not active(mode):
        return 1
    found = mesh(mode)
    return dist.world_size() if found is None else found.size(1)


def mode_of(model: nn.Module) -> str | None:
    """How `model` is sharded: "hsdp" (a 2-D mesh), "fsdp", or None when no unit of it is an FSDP unit."""
    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            return "hsdp" if parameter.device_mesh.ndim == 2 else "fsdp"
    return None


def plain_unit(unit: nn.Module, build: Callable[[], nn.Module]) -> nn.Module:
    """`unit` as a plain module with its whole weights, in their dtypes, when it is an FSDP unit (a
    collective: every rank, in the same order); `unit` itself otherwise. `build` makes an empty module of
    its structure (called on the meta device)."""
    if not isinstance(unit, FSDPModule):
        return unit
    wanted = {name: parameter.requires_grad for name, parameter in unit.named_parameters()}
    # A gathered tensor is new memory already (counted by `puzzle.gathers` until the caller shards the plain
    # unit again or drops it); the replicated buffers are copied, so that the plain unit shares nothing.
    state = {
        name: replicated(value.detach()) if isinstance(value, DTensor) else value.detach().clone()
        for name, value in unit.state_dict().items()
    }
    with torch.device("meta"):
        plain = build()
    plain.load_state_dict(state, assign=True)  # strict: every parameter and (persistent) buffer is set
    for name, parameter in plain.named_parameters():
        parameter.requires_grad_(wanted[name])
    return plain


def plain_mixer(model: HybridLM, index: int) -> None:
    """Block `index` of `model` holds a plain, whole copy of its mixer if it was an FSDP unit (a collective),
    so that a trainer can shard the block its own way (FSDP2 does not nest a unit that has already run)."""
    block = model.layers[index]
    spec = model.spec
    block.mixer = plain_unit(
        block.mixer, lambda: build_block(block.mixer.spec, spec.hidden_size, spec.norm_eps)
    )


def plain_root_units(model: HybridLM) -> None:
    """Replace a sharded model's embeddings and lm_head units by plain, whole copies (a collective), in place,
    keeping a tied lm_head tied: for a trainer that makes them part of its own root unit (GKD's student,
    whose loss reads the lm_head's weight outside any forward of it)."""
    tied = model.lm_head.weight is model.embeddings.weight
    vocab, hidden = model.spec.vocab_size, model.spec.hidden_size
    model.embeddings = plain_unit(model.embeddings, lambda: nn.Embedding(vocab, hidden))
    if tied:
        model.lm_head.weight = model.embeddings.weight
    else:
        model.lm_head = plain_unit(model.lm_head, lambda: nn.Linear(hidden, vocab, bias=False))


def has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def shard_parent(parent: HybridLM, mode: str = "fsdp") -> None:
    """Shard the frozen parent in place: embeddings, lm_head and each block's mixer are one FSDP unit each,
    over the ranks of `mode`'s mesh (`mesh`).

    The pre-norms stay replicated: BLD calls `block.norm` and `block.mixer` apart, and FSDP all-gathers a
    unit only when that unit's own forward runs. Already sharded units are left as they are.
    """
    units = [parent.embeddings] + [b.mixer for b in parent.layers if b.norm is not None]
    tied = parent.lm_head.weight is parent.embeddings.weight
    if not tied:
        units.append(parent.lm_head)
    for unit in units:
        shard_unit(unit, mode)
    if (
        tied
    ):  # fully_shard replaced embeddings.weight by a sharded parameter: keep the tie (and free the copy)
        parent.lm_head.weight = parent.embeddings.weight


def shard_unit(unit: nn.Module, mode: str = "fsdp") -> None:
    """Make `unit` one FSDP unit over `mode`'s mesh, resharded after each forward; a no-op for a module
    without parameters or one already sharded. Submodules of another dtype are units of their own first
    (`_shard_other_dtypes`)."""
    if has_params(unit) and not isinstance(unit, FSDPModule):
        _shard_other_dtypes(unit, mode)
        # Explicit True: each unit is its own FSDP root, which by default stays gathered after forward.
        fully_shard(unit, mesh=mesh(mode), reshard_after_forward=True)


def main_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype of most of `module`'s floating-point parameter elements (None without any): the dtype it
    computes in, not its first parameter's (a bf16 MoE block keeps its router in fp32, `puzzle.blocks.moe`)."""
    counts: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def _shard_other_dtypes(unit: nn.Module, mode: str) -> None:
    """FSDP2 wants one dtype over a unit's trainable parameters, and a bf16 MoE block keeps its router in
    fp32 (`puzzle.blocks.moe`): each submodule whose own parameters are not in the dtype of most of the
    unit's elements becomes its own unit, nested in `unit` (gathered in its own forward, as `unit` is)."""
    main = main_dtype(unit)
    if main is None or all(p.dtype == main for p in unit.parameters()):
        return
    for module in list(unit.modules())[1:]:
        own = list(module.parameters(recurse=False))
        if own and any(p.dtype != main for p in own) and not isinstance(module, FSDPModule):
            fully_shard(module, mesh=mesh(mode), reshard_after_forward=True)


def shard_variant(mixer: nn.Module, mode: str = "fsdp") -> None:
    """Make `mixer` one FSDP unit whose gradients are summed over ranks (not averaged); a no-op for a mixer
    without parameters or one already sharded.

    BLD's loss on each rank is already divided by the global normaliser, so the sum is the one-process
    gradient. Sum-only collectives: gloo has no pre-multiplied sum. Resharded after every forward (a root
    unit otherwise stays gathered after a forward, and every variant of the wave with it).
    """
    if not has_params(mixer) or isinstance(mixer, FSDPModule):
        return
    _shard_other_dtypes(mixer, mode)
    fully_shard(mixer, mesh=mesh(mode), reshard_after_forward=True)
    for module in mixer.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


@contextmanager
def gathered_mixer(parent: HybridLM, index: int) -> Iterator[None]:
    """Block `index` of the parent holds a plain, full copy of its mixer for the body (a collective).

    Variants are initialised from the parent's full weights (`init_child` slices and copies them); an
    FSDP unit's own parameters stay sharded even when unsharded, and a deep copy would carry its FSDP
    state, so the body sees a fresh module loaded with the gathered weights, freed afterwards.
    """
    block = parent.layers[index]
    sharded = block.mixer
    if not isinstance(sharded, FSDPModule):
        yield
        return
    spec = parent.spec  # gathered straight into the new module's parameters: one whole copy, no staging
    plain = plain_unit(sharded, lambda: build_block(sharded.spec, spec.hidden_size, spec.norm_eps))
    plain.requires_grad_(False)
    block.mixer = plain
    try:
        yield
    finally:
        block.mixer = sharded


def free_dropped_units() -> None:
    """Free the FSDP units nothing refers to any more (a whole stage's variants, a child measured and
    dropped, the units GKD re-shards): an FSDP2 module and its state refer to each other, so dropping the
    last reference does not free its shards; only Python's cycle collector does, and it may not run for
    a long time (on 2 gloo ranks a dropped assembled child stayed resident into GKD, half the parent per
    rank). Cheap next to the stages it runs between; call it on every rank."""
    gc.collect()


def replicated(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor where it lives (a collective for a DTensor: every rank must call it, in order),
    counted by `puzzle.gathers` while it lives when it was gathered."""
    return track(tensor.full_tensor()) if isinstance(tensor, DTensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (a collective for a DTensor: every rank must call it, in the same order)."""
    value = replicated(tensor).detach().cpu().contiguous()
    return track(value) if isinstance(tensor, DTensor) else value  # the CPU copy of a GPU gather counts too


def like(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """`value` (a full tensor) laid out as `reference`: this rank's shard when `reference` is a DTensor."""
    if isinstance(reference, DTensor):
        value = value.to(device=reference.device, dtype=reference.dtype)
        return distribute_tensor(value, reference.device_mesh, reference.placements)
    return value


def local_like(local: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """This rank's part `local` of a tensor laid out as `reference`: a DTensor of `reference`'s mesh,
    placements, shape, dtype and device when `reference` is one (no collective: `local` must be this rank's
    shard), `local` itself otherwise."""
    if not isinstance(reference, DTensor):
        return local
    return DTensor.from_local(
        local.to(device=reference.device, dtype=reference.dtype),
        reference.device_mesh,
        reference.placements,
        run_check=False,
        shape=reference.shape,
        stride=reference.stride(),
    )


def local_numel(module: nn.Module) -> int:
    """Parameter elements this rank holds (its shard of each DTensor), for memory checks."""
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())


def shard_numel(shape: Iterable[int], world: int) -> int:
    """Elements rank 0 (the largest shard) holds of a parameter `fully_shard` splits over `world` ranks:
    ceil(rows / world) rows of its first dimension."""
    dims = tuple(shape)
    if not dims:
        return 1
    rows = min(dims[0], math.ceil(dims[0] / world))
    return rows * math.prod(dims[1:])
