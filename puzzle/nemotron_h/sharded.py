"""Loading a NemotronH checkpoint sharded from the file: no rank ever holds the whole parent.

`load_sharded` takes the model built on the meta device (`checkpoint.load(..., device="meta")`: the names,
shapes and dtypes are checked as for a real load; `checkpoint.load(..., shard=True)` builds it), shards it with FSDP2 exactly as the stages do
(`puzzle.shard.shard_parent`: embeddings, each block's mixer, the lm_head; norms replicated; a tied lm_head
kept tied), gives every parameter and buffer uninitialised storage for its local part only (`to_empty`),
and fills that part from the memory-mapped safetensors files, reading only the rows it owns
(`safe_open(...).get_slice(name)[start:stop]`). FSDP2 shards dim 0 in `torch.chunk` pieces (the last
rank's may be shorter or empty); the rows come from the DTensor's placement.

The one layout transform of the plain load, the MoE experts (one tensor pair per expert on disk, one
`ExpertBank` [sum of widths, D] pair per block in the model), is applied to the slice: a rank owning bank
rows [s, e) reads, for each expert overlapping them, its `up_proj.weight` rows and its `down_proj.weight`
columns (transposed), also from fused 3-D expert tensors. Replicated tensors (norms, the router's
correction bias, other buffers) are small and read whole. Every other transform (hub prefixes,
`embedding` -> `embeddings`) is a rename; dtypes are cast slice by slice, as the plain load casts whole
tensors, so the values are the same bits.

`read_observer`, when set, is called with (file, key, tensor) for every tensor read from a file: how the
tests count the bytes each rank reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from puzzle import dist, shard
from puzzle.blocks.moe import ExpertBank, expert_banks
from puzzle.model import HybridLM
from puzzle.nemotron_h.config import CheckpointError
from puzzle.nemotron_h.weights import (
    TensorSource,
    map_checkpoint,
    open_safetensors,
    weight_files,
)

# Called with (file, key on disk, tensor read) for every read of the sharded load (the tests count bytes).
read_observer: Callable[[Path, str, torch.Tensor], None] | None = None

Index = tuple[Any, ...]


def require_process_group() -> None:
    """RuntimeError unless torch.distributed is initialised: sharding needs ranks to shard over."""
    if not dist.is_initialized():
        raise RuntimeError(
            "load(..., shard=True) needs an initialised torch.distributed process group (launch with torchrun "
            "and call puzzle.dist.init_from_env() or torch.distributed.init_process_group() first); "
            "use shard=False for a plain load in one process"
        )


def _read(handle: Any, source: TensorSource, index: Index | None) -> torch.Tensor:
    """Part `index` of the source tensor (after its expert index, for a fused expert tensor), or all of it."""
    lead = () if source.expert is None else (source.expert,)
    try:
        if index is None and not lead:
            tensor = handle.get_tensor(source.key)
        else:
            tensor = handle.get_slice(source.key)[(*lead, *(index or ()))]
    except Exception as error:
        raise CheckpointError(f"cannot read tensor {source.name!r} from {source.file}: {error}") from error
    if read_observer is not None:
        read_observer(source.file, source.key, tensor)
    return tensor


def _rows(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The rows [start, stop) of dim 0 this rank holds of a DTensor sharded on dim 0; None when replicated."""
    if not isinstance(tensor, DTensor):
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    local = tensor.to_local().shape
    if tuple(local) != tuple(shape) or tuple(shape[1:]) != tuple(tensor.shape[1:]):
        raise RuntimeError(  # FSDP2 shards dim 0 only; anything else (e.g. a strided TP shard) is not ours
            f"unexpected sharding of a {list(tensor.shape)} tensor: local {list(local)}, {tensor.placements}"
        )
    return offset[0], offset[0] + shape[0]


def _bank_rows(
    handles: Mapping[Path, Any],
    sources: Mapping[str, TensorSource],
    prefix: str,
    bank: ExpertBank,
    which: str,
    start: int,
    stop: int,
) -> torch.Tensor:
    """Rows [start, stop) of a bank's `up` or `down` [sum w_j, D], from the experts' hub tensors on disk:
    rows of each owning expert's `up_proj.weight` [w_j, D], columns of its `down_proj.weight` [D, w_j] (the
    bank keeps them transposed, `ExpertBank.down_weight`)."""
    parts = []
    for j, rows in bank.experts_in_rows(start, stop):
        source = sources[prefix + bank.hub_name(j, which)]
        if which == "up":
            parts.append(_read(handles[source.file], source, (rows,)))
        else:
            parts.append(_read(handles[source.file], source, (slice(None), rows)).T)
    return torch.cat(parts)


def _fill(model: HybridLM, handles: Mapping[Path, Any], sources: Mapping[str, TensorSource]) -> None:
    """Copy into every parameter and buffer of `model` (uninitialised, local parts) its rows from the files."""
    banks = expert_banks(model)
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in seen:  # a tied lm_head is the embeddings' parameter
            continue
        seen.add(id(tensor))
        rows = _rows(tensor)
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        prefix, _, leaf = name.rpartition(".")
        bank = banks.get(prefix + ".")
        if rows is not None and rows[0] >= rows[1]:
            continue  # this rank holds none of it (the last shards of a short tensor)
        if bank is not None:
            start, stop = rows or (0, tensor.shape[0])
            value = _bank_rows(handles, sources, prefix + ".", bank, leaf, start, stop)
        else:
            if name not in sources:
                raise CheckpointError(f"no checkpoint tensor for {name!r}")
            source = sources[name]
            value = _read(handles[source.file], source, None if rows is None else (slice(*rows),))
        with torch.no_grad():
            local.copy_(value.to(local.dtype))


def load_sharded(
    model: HybridLM, path: str | Path, device: str | torch.device, mode: str = "fsdp"
) -> HybridLM:
    """`model`, the checkpoint at `path` built on the meta device (`checkpoint.load(path, device="meta")`:
    names, shapes and dtypes checked as for a real load), sharded with FSDP2 over the process group and
    filled from the files, in eval mode.

    Each rank holds and reads only its shards (see the module docstring); the model is what
    `checkpoint.load` followed by `puzzle.shard.shard_parent` gives, without the whole model ever existing.
    `device`: where this rank's shards live (its GPU, or the CPU under gloo). `mode`: "fsdp" shards over
    every rank, "hsdp" inside a node (replicated across nodes, `puzzle.shard.mesh`).
    """
    from puzzle.shard import shard_parent

    require_process_group()
    path, device = Path(path), torch.device(device)
    if mode not in ("fsdp", "hsdp"):
        raise ValueError(f"load(..., shard={mode!r}): expected True, 'fsdp' or 'hsdp'")
    shard_parent(model, mode)
    mesh_type = model.embeddings.weight.device_mesh.device_type
    if mesh_type != device.type:
        raise RuntimeError(
            f"load(..., shard=True, device={str(device)!r}): the process group shards over {mesh_type!r} "
            f"devices; load onto this rank's {mesh_type} device (puzzle.dist.device())"
        )
    model.to_empty(device=device)
    if model.spec.tie_embeddings:  # `to_empty` gives each module its own new parameter: tie them again
        model.lm_head.weight = model.embeddings.weight
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(open_safetensors(file)) for file in weight_files(path)}
        sources, _, _ = map_checkpoint(handles)
        _fill(model, handles, sources)
    return model.eval()


def read_local(handle: Any, file: Path, key: str, reference: torch.Tensor) -> torch.Tensor:
    """This rank's part of tensor `key` of the open safetensors `file` (`open_safetensors`), for a
    destination laid out as `reference`: the rows it holds of a DTensor sharded on dim 0 (`get_slice`,
    memory-mapped: the other rows are never read), the whole tensor otherwise (a plain or replicated
    `reference`), as stored (no cast). Local: no collective. `read_observer` sees the read."""
    rows = _rows(reference)
    if rows is not None and rows[0] >= rows[1]:  # this rank holds none of it (the last shards of a short one)
        shape = tuple(handle.get_slice(key).get_shape())
        return torch.empty((0, *shape[1:]), dtype=reference.dtype)
    source = TensorSource(file, key, tuple(reference.shape), "")
    return _read(handle, source, None if rows is None else (slice(*rows),))


def read_like(handle: Any, file: Path, key: str, reference: torch.Tensor) -> torch.Tensor:
    """Tensor `key` of the open safetensors `file` laid out as `reference`, reading only what this rank
    holds (`read_local`): a DTensor of `reference`'s mesh, placements, dtype and device made of this rank's
    rows when `reference` is one (no collective), the whole tensor as stored otherwise."""
    return shard.local_like(read_local(handle, file, key, reference), reference)


def fill_from_file(model: torch.nn.Module, file: Path, names: Iterable[str]) -> None:
    """Copy into the state-dict tensors `names` of `model` their values from the safetensors `file`, which
    names its tensors as the state dict does (e.g. GKD's output), in place.

    Each rank reads only its local rows of a sharded (DTensor) tensor (`get_slice`, memory-mapped) and
    whole the replicated ones: a sharded model is filled without any rank reading the whole file. Names
    and shapes are the caller's to check (from `safe_open(...).get_slice(name).get_shape()`); values are
    cast to the model's dtypes. `read_observer` sees every read.
    """
    state = model.state_dict()
    with open_safetensors(file) as handle:
        for name in names:
            tensor = state[name]
            value = read_local(handle, file, name, tensor)  # empty where this rank holds none of it
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            with torch.no_grad():
                local.copy_(value.to(local.dtype))
