"""Two CPU processes on gloo for the multi-rank tests: a free port, each rank's process group, the spawn."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.multiprocessing as mp

from puzzle import dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the ranks' rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def gloo_rank(rank: int, world: int, port: int) -> Iterator[None]:
    """The body runs as `rank` of a `world`-rank gloo group, joined as torchrun would (its environment
    variables, `puzzle.dist.init_from_env`), on one torch thread; the group is destroyed after the body, also
    when it fails."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    assert dist.init_from_env() is True
    try:
        yield
        # Both ranks leave together: a rank that tears gloo down while its peer still has messages in flight
        # can abort the peer ("terminate called without an active exception"). A failed body skips it (the
        # spawn then stops the other rank).
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def _run_then_exit(rank: int, worker: Callable[..., None], *args: object) -> None:
    """`worker(rank, *args)`, then the process ends at once with status 0: no interpreter teardown, where
    gloo's and FSDP's C++ objects were seen to abort a rank that had finished its work (an exception still
    reaches `mp.spawn` as a failure)."""
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(worker: Callable[..., None], *args: object, world: int = 2) -> None:
    """`worker(rank, world, port, *args)` in `world` fresh processes, waited for; a rank that fails fails the
    caller. `worker` must be importable by name (a module-level function of a test module or helper)."""
    mp.spawn(_run_then_exit, args=(worker, world, free_port(), *args), nprocs=world, join=True)
