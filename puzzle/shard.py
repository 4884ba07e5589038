"""FSDP2 sharding of a frozen parent and of variant mixers, shared by BLD and scoring (no-ops in one process).

A stage asks `active(mode)` whether to shard ("fsdp" under torch.distributed with more than one rank;
"none" keeps everything replicated). Sharded units all-gather their weights in their own forward, a
collective: every rank must run the same number of forwards of every unit, in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from puzzle import dist
from puzzle.blocks import build_block
from puzzle.model import HybridLM


def active(mode: str) -> bool:
    """Whether `mode` shards in this process: "fsdp" and more than one rank."""
    return mode == "fsdp" and dist.world_size() > 1


def has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def shard_parent(parent: HybridLM) -> None:
    """Shard the frozen parent in place: embeddings, lm_head and each block's mixer are one FSDP unit each.

    The pre-norms stay replicated: BLD calls `block.norm` and `block.mixer` apart, and FSDP all-gathers a
    unit only when that unit's own forward runs. Already sharded units are left as they are.
    """
    units = [parent.embeddings] + [b.mixer for b in parent.layers if b.norm is not None]
    tied = parent.lm_head.weight is parent.embeddings.weight
    if not tied:
        units.append(parent.lm_head)
    for unit in units:
        if has_params(unit) and not isinstance(unit, FSDPModule):
            # Explicit True: each unit is its own FSDP root, which by default stays gathered after forward.
            fully_shard(unit, reshard_after_forward=True)
    if (
        tied
    ):  # fully_shard replaced embeddings.weight by a sharded parameter: keep the tie (and free the copy)
        parent.lm_head.weight = parent.embeddings.weight


def shard_variant(mixer: nn.Module) -> None:
    """Make `mixer` one FSDP unit whose gradients are summed over ranks (not averaged); a no-op for a mixer
    without parameters or one already sharded.

    BLD's loss on each rank is already divided by the global normaliser, so the sum is the one-process
    gradient. Sum-only collectives: gloo has no pre-multiplied sum. Resharded after every forward (a root
    unit otherwise stays gathered after a forward, and every variant of the wave with it).
    """
    if not has_params(mixer) or isinstance(mixer, FSDPModule):
        return
    fully_shard(mixer, reshard_after_forward=True)
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
    state = {k: full(v) for k, v in sharded.state_dict().items()}
    device = parent.embeddings.weight.device
    with torch.device("meta"):
        plain = build_block(sharded.spec, parent.spec.hidden_size, parent.spec.norm_eps)
    plain = plain.to_empty(device=device)  # meta, then loaded: no draw from the seeded RNG
    plain.load_state_dict(state)  # strict: every parameter and (persistent) buffer is set
    plain.requires_grad_(False)
    block.mixer = plain
    try:
        yield
    finally:
        block.mixer = sharded


def replicated(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor where it lives (a collective for a DTensor: every rank must call it, in order)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (a collective for a DTensor: every rank must call it, in the same order)."""
    return replicated(tensor).detach().cpu().contiguous()


def like(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """`value` (a full tensor) laid out as `reference`: this rank's shard when `reference` is a DTensor."""
    if isinstance(reference, DTensor):
        value = value.to(device=reference.device, dtype=reference.dtype)
        return distribute_tensor(value, reference.device_mesh, reference.placements)
    return value


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
