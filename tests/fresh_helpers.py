"""Which tensors a piece of code makes in new memory: a dispatch mode that records every op output of at least
a given size that is not a view of one of the op's inputs (what `puzzle.plan_time` prices as fresh pages)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class FreshTensors(TorchDispatchMode):
    """Records (op name, shape) of each op output of at least `min_bytes` bytes in storage of its own."""

    def __init__(self, min_bytes: int) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.found: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        inputs = {a.untyped_storage().data_ptr() for a in leaves if torch.is_tensor(a)}
        for tensor in torch.utils._pytree.tree_leaves(out):
            if (
                torch.is_tensor(tensor)
                and tensor.untyped_storage().nbytes() >= self.min_bytes
                and tensor.untyped_storage().data_ptr() not in inputs
            ):
                self.found.append((func._overloadpacket.__name__, tuple(tensor.shape)))
        return out

    def shapes(self, shape: tuple[int, ...]) -> int:
        """How many of the recorded tensors have `shape`."""
        return sum(found == tuple(shape) for _, found in self.found)
