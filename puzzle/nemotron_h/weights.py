"""NemotronH weights on disk: safetensors files in and out, hub tensor names, shards, lazy tensors.

Reading accepts weights under `backbone.` or `model.`, per-expert or fused 3-D expert tensors,
`embeddings` or `embedding`, one file, an index with shards, or a folder of safetensors files.
Tensors are described from the file headers (`map_checkpoint`) and read one at a time from the
memory-mapped files. Writing produces the hub layout: `backbone.` prefix, per-expert keys,
`lm_head.weight`, shards of at most `max_shard_bytes` with an index. A block's routed experts are one
`ExpertBank` in the model and one tensor pair per expert on disk: that layout lives with the bank
(`puzzle.blocks.moe.module_hub_state`, `allocate_banks`, over `ExpertBank`'s own layout).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from puzzle.blocks.moe import module_hub_state

# The checkpoint's files, named here for the reader's callers (puzzle.checkpoint_files is their home).
from puzzle.checkpoint_files import (  # noqa: F401
    INDEX_FILE,
    MAX_HEADER_BYTES,
    SINGLE_FILE,
    CheckpointError,
    weight_files,
)

if TYPE_CHECKING:
    from puzzle.model import HybridLM

SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# The safetensors dtypes a model weight may be stored in; anything else is not a weight we can read.
WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64")


# --------------------------------------------------------------------------------------- reading files


def check_safetensors_file(file: Path) -> None:
    """CheckpointError naming `file` and what is wrong unless it is a complete safetensors file.

    Reads the header only (8 bytes of length, then the JSON table of tensors), never the tensor data, so
    it costs the same for a 5 GB shard as for a tiny file: the header must parse, each tensor's byte range
    must match its shape and dtype, and the ranges must end exactly at the end of the file (a truncated
    copy, an empty file or trailing garbage fail here rather than halfway through a run).
    """
    try:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 8:
                state = "empty" if size == 0 else "truncated"
                raise CheckpointError(f"safetensors file {file} is {state} ({size} bytes)")
            length = int.from_bytes(handle.read(8), "little")
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"safetensors file {file} is corrupt or truncated: its header length {length} does not "
                    f"fit in the file's {size} bytes"
                )
            header = handle.read(length)
    except OSError as error:
        raise CheckpointError(f"cannot read safetensors file {file}: {error.strerror or error}") from None
    try:
        table = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"safetensors file {file} is corrupt: its header is not JSON ({error})"
        ) from None
    if not isinstance(table, dict):
        raise CheckpointError(f"safetensors file {file} is corrupt: its header is not a table of tensors")
    end = max(
        (_tensor_range(file, name, entry)[1] for name, entry in table.items() if name != "__metadata__"),
        default=0,
    )
    data_bytes = size - 8 - length
    if end != data_bytes:
        what = "truncated" if end > data_bytes else "corrupt"
        raise CheckpointError(
            f"safetensors file {file} is {what}: its header describes {end} bytes of tensor data, the file "
            f"holds {data_bytes}"
        )


def _tensor_range(file: Path, name: str, entry: Any) -> tuple[int, int]:
    """The byte range of tensor `name` in `file`'s header, checked against its shape and dtype."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        valid = all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end)) and begin <= end
    except (TypeError, KeyError, ValueError):
        valid = False
    if not valid:
        raise CheckpointError(
            f"safetensors file {file} is corrupt: tensor {name!r} has no valid dtype, shape and data_offsets"
        )
    if dtype in SAFETENSORS_DTYPES and end - begin != math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize:
        raise CheckpointError(
            f"safetensors file {file} is corrupt: tensor {name!r} ({dtype}, shape {list(shape)}) takes "
            f"{end - begin} bytes"
        )
    return begin, end


@contextlib.contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """A safe_open handle on `file`; a truncated or corrupt file is a CheckpointError naming it
    (`check_safetensors_file`)."""
    check_safetensors_file(file)
    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as error:  # safetensors raises its own error types for truncated or corrupt files
        raise CheckpointError(f"cannot read safetensors file {file}: {error}") from error
    with handle as opened:
        yield opened


def read_tensor(handle: Any, file: Path, key: str, expert: int | None = None) -> torch.Tensor:
    """Tensor `key` of an open file, or its slice `expert` along the first axis (fused experts)."""
    try:
        if expert is None:
            return handle.get_tensor(key)
        return handle.get_slice(key)[expert]
    except Exception as error:
        raise CheckpointError(f"cannot read tensor {key!r} from {file}: {error}") from error


@dataclass(frozen=True)
class LazyTensor:
    """A tensor left in a safetensors file until needed (e.g. MTP weights carried through a load/save)."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name, e.g. "BF16"

    def load(self) -> torch.Tensor:
        with open_safetensors(self.file) as handle:
            return read_tensor(handle, self.file, self.key)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * SAFETENSORS_DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class TensorSource:
    """Where one model tensor lives on disk: file, key, expert index into a fused tensor; its shape and dtype."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name
    expert: int | None = None

    @property
    def name(self) -> str:
        return self.key if self.expert is None else f"{self.key}[{self.expert}]"

    def check_is_weight(self) -> None:
        """CheckpointError unless the tensor is stored as a float dtype a weight can have (not int8, fp8...)."""
        if self.dtype in WEIGHT_DTYPES:
            return
        hint = " (fp8 weights need their scales: use the BF16 release)" if self.dtype.startswith("F8") else ""
        raise CheckpointError(
            f"{self.file.name}: tensor {self.name!r} is stored as {self.dtype} "
            f"({SAFETENSORS_DTYPES.get(self.dtype, 'unknown')}); expected a floating-point weight, one "
            f"of {', '.join(WEIGHT_DTYPES)}{hint}"
        )


# ------------------------------------------------------------------------------ hub names <-> model keys


def model_key(disk_key: str) -> tuple[str | None, str]:
    """(HybridLM state-dict key or None for a tensor outside the model, checkpoint prefix)."""
    if disk_key == "lm_head.weight":
        return disk_key, ""
    for prefix in ("backbone.", "model."):
        if disk_key.startswith(prefix):
            rest = disk_key[len(prefix) :]
            return ("embeddings.weight" if rest == "embedding.weight" else rest), prefix
    return None, ""


def disk_name(key: str, prefix: str = "backbone.") -> str:
    """The hub name of HybridLM state-dict key `key` under backbone prefix `prefix`."""
    return key if key == "lm_head.weight" else prefix + key


_FUSED_EXPERTS = re.compile(r"layers\.(\d+)\.mixer\.experts\.(up_proj|down_proj)$")


def expert_tensors(key: str, source: TensorSource) -> list[tuple[str, TensorSource]]:
    """The model tensors one checkpoint tensor (model key `key`) gives: the one place expert names map.

    Reading: a per-expert hub tensor `layers.{i}.mixer.experts.{e}.{up,down}_proj.weight` is the model
    tensor of the same name; a fused 3-D tensor `layers.{i}.mixer.experts.{up,down}_proj` [experts,
    out, in] (transformers 5.3-5.6) gives one model tensor per expert. Writing: `hub_state` names each
    expert of a bank the same way (`module_hub_state`).
    """
    fused = _FUSED_EXPERTS.fullmatch(key)
    if fused is None:
        return [(key, source)]
    if len(source.shape) != 3:
        raise CheckpointError(
            f"{source.file.name}: fused expert tensor {source.key!r} should be 3-D [experts, out, in], "
            f"found shape {list(source.shape)}"
        )
    layer, proj = fused.groups()
    return [
        (
            f"layers.{layer}.mixer.experts.{expert}.{proj}.weight",
            TensorSource(source.file, source.key, source.shape[1:], source.dtype, expert),
        )
        for expert in range(source.shape[0])
    ]


def map_checkpoint(
    handles: Mapping[Path, Any],
) -> tuple[dict[str, TensorSource], dict[str, LazyTensor], str]:
    """Model key -> source, the extra (non-model) tensors by name, and the backbone prefix the checkpoint uses."""
    sources: dict[str, TensorSource] = {}
    extras: dict[str, LazyTensor] = {}
    prefix_seen = "backbone."
    for file, handle in handles.items():
        for key_on_disk in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            tensor_slice = handle.get_slice(key_on_disk)
            shape, dtype = tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()
            key, prefix = model_key(key_on_disk)
            if key is None:
                extras[key_on_disk] = LazyTensor(file, key_on_disk, shape, dtype)
                continue
            prefix_seen = prefix or prefix_seen
            for key_in_model, source in expert_tensors(key, TensorSource(file, key_on_disk, shape, dtype)):
                if key_in_model in sources:
                    earlier = sources[key_in_model]
                    raise CheckpointError(
                        f"{file.name}: tensor {key_on_disk!r} gives model tensor {key_in_model!r}, already "
                        f"given by {earlier.key!r} in {earlier.file.name}"
                    )
                sources[key_in_model] = source
    return sources, extras, prefix_seen


# --------------------------------------------------------------------------------------- writing files


def hub_state(model: HybridLM) -> dict[str, torch.Tensor | LazyTensor]:
    """Tensors to write, by hub name: `backbone.` prefix, per-expert keys, lm_head, then extra tensors."""
    out: dict[str, torch.Tensor | LazyTensor] = {}
    for key, tensor in module_hub_state(model).items():
        if key == "lm_head.weight" and model.spec.tie_embeddings:
            # NemotronHForCausalLM never ties, so it needs its own copy; safetensors refuses shared storage.
            tensor = tensor.clone()
        out[disk_name(key)] = tensor
    for key, tensor in model.extra_tensors.items():
        if key in out:
            raise CheckpointError(f"extra tensor {key!r} collides with a model tensor")
        out[key] = tensor
    return out


def tensor_nbytes(tensor: torch.Tensor | LazyTensor) -> int:
    """Bytes `tensor` takes in a safetensors file."""
    if isinstance(tensor, LazyTensor):
        return tensor.nbytes
    return tensor.numel() * tensor.element_size()


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped in order into shards of at most `max_shard_bytes` (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards
