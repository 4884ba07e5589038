"""torch.distributed helpers that behave the same with and without a process group (world size 1).

Launch with `torchrun --nproc-per-node N script.py` and call `init_from_env()` once; a plain
`python script.py` runs the same code as rank 0 of a world of 1, where every helper here is a no-op
(no process group is created). Work is split with `shard`, accumulators are summed with
`all_reduce_sum_`, and run-directory outputs follow "rank 0 writes, the others wait"
(`main_process_first`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist

T = TypeVar("T")


def is_initialized() -> bool:
    """Whether a process group is up (False in a plain single-process run)."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    """This process's rank, 0 without a process group."""
    return torch_dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Number of processes, 1 without a process group."""
    return torch_dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    """Whether this is rank 0, the process that writes shared outputs."""
    return rank() == 0


def local_rank() -> int:
    """Rank within this node (torchrun's LOCAL_RANK), 0 when not launched by torchrun."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> torch.device:
    """The device this process should use: cuda:LOCAL_RANK when CUDA is available, else the CPU."""
    return torch.device("cuda", local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def init_from_env(backend: str | None = None) -> bool:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    `backend` None picks nccl when CUDA is available (and makes cuda:LOCAL_RANK the current device),
    gloo otherwise. A no-op returning False when WORLD_SIZE is absent or 1 (plain `python`) or a process
    group is already up; True when this call created one.
    """
    if is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise RuntimeError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {name} is not set; launch with torchrun"
            )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank())  # collectives run on the current device
    torch_dist.init_process_group(backend=backend, init_method="env://")
    return True


def shutdown() -> None:
    """Leave the process group at the end of a run (a no-op without one).

    Drop every model sharded over the group, and `puzzle.shard`'s cached meshes, before calling this: an
    FSDP2 module's device mesh holds the group, and a group that outlives `destroy_process_group` is torn down at interpreter exit, where gloo's
    threads can abort the process ("terminate called without an active exception")."""
    if is_initialized():
        import gc

        gc.collect()  # sharded modules in reference cycles: freed while the group is alive
        torch_dist.destroy_process_group()


def shard(items: Iterable[T], rank: int | None = None, world: int | None = None) -> Iterator[T]:
    """This rank's share of `items`: items rank, rank + world, rank + 2 world, ... (round-robin, lazy).

    Round-robin rather than contiguous blocks because it needs no length (calibration batches are
    usually a generator: each rank walks the same stream and keeps every world-th item), the shares
    differ by at most one item whatever the length, and work whose cost drifts with position (longer
    documents later, deeper layers) is spread evenly. Every rank must pass the same items in the same
    order. Wrap in `list()` for a list; `shard(enumerate(items))` keeps the global indices.
    """
    if rank is None:  # the argument shadows `rank()`
        rank = torch_dist.get_rank() if is_initialized() else 0
    world = world_size() if world is None else world
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard: need 0 <= rank < world, found rank={rank}, world={world}")
    return itertools.islice(items, rank, None, world)


def local_rows(batch: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global token batch [B, T] (round-robin, as `shard`): how BLD and GKD split a
    batch over the ranks that train one sharded model together."""
    if batch.ndim != 2:
        raise ValueError(f"a token batch must be [batch, tokens], found shape {list(batch.shape)}")
    world = world_size()
    if batch.shape[0] < world:
        raise ValueError(f"a batch of {batch.shape[0]} rows cannot be split over {world} ranks")
    return batch[rank() :: world]


def _comm_device(tensor: torch.Tensor) -> torch.device:
    """Where the backend can reduce `tensor`: the CPU for gloo, the current GPU for nccl."""
    backend = str(torch_dist.get_backend())
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device  # a multi-device backend ("cpu:gloo,cuda:nccl") takes tensors where they are


def all_reduce_sum_(tensors: Mapping[Any, torch.Tensor] | Sequence[torch.Tensor]) -> None:
    """Sum every tensor over all ranks, in place (a no-op at world size 1).

    Each tensor is reduced in its own dtype (fp64 running sums stay fp64) and moved only when the
    backend needs it (to the CPU for gloo, to the current GPU for nccl), then copied back. Tensors go
    one at a time, not packed into one buffer: a large parent's linear-fit sums are gigabytes, and a
    packed copy would double them. A mapping is reduced in sorted key order, so ranks that inserted the
    same keys in different orders still pair up; every rank must pass the same keys with the same shapes.
    """
    if not is_initialized():
        return
    ordered = [tensors[key] for key in sorted(tensors)] if isinstance(tensors, Mapping) else list(tensors)
    for tensor in ordered:
        target = _comm_device(tensor)
        if tensor.device == target and tensor.is_contiguous():
            torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)
        else:
            buffer = tensor.to(target).contiguous()
            torch_dist.all_reduce(buffer, op=torch_dist.ReduceOp.SUM)
            tensor.copy_(buffer)


def barrier() -> None:
    """Wait until every rank gets here (a no-op at world size 1)."""
    if is_initialized():
        torch_dist.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank `src`'s `obj` on every rank (pickled; for small things such as a decision or a path)."""
    if not is_initialized():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: T) -> list[T]:
    """Every rank's `obj`, indexed by rank (pickled; for small things such as counts and shapes)."""
    if not is_initialized():
        return [obj]
    gathered: list[Any] = [None] * world_size()
    torch_dist.all_gather_object(gathered, obj)
    return gathered


@contextmanager
def main_process_first() -> Iterator[None]:
    """Run the body on rank 0 first, then on the other ranks: "rank 0 writes, the others wait, then read".

        with dist.main_process_first():
            if dist.is_main():
                save(result, directory)
            else:
                result = load(directory)

    The run directory must be on a filesystem every rank sees (always true on one node). Rank 0 releases
    the others even when its body raises, so they fail on the missing output instead of hanging.
    """
    if not is_main():
        barrier()
    try:
        yield
    finally:
        if is_main():
            barrier()
