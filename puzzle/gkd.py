"""Global knowledge distillation (GKD): the assembled child (the student) learns to match its parent (the
teacher) on whole sequences, healing the errors its replaced blocks add up to.

Loss per global batch, with P = positions that have a next token and L = blocks:
``kl_weight * mean_P KL(teacher || student) + cosine_weight * mean_{L, all positions} (1 - cos(s_l, t_l))
+ lm_weight * mean_P NLL(student)``, where s_l, t_l are the residual streams after block l (the hidden
size is the parent's whatever the block shapes). The LM term is off by default (Puzzle's ablation found it
hurts). The teacher is frozen (eval mode, no gradients) and runs block by block beside the student, so only
one teacher hidden state is held at a time. The head never makes logits over the whole vocabulary:
`puzzle.logits.distillation_head_loss` streams `vocab_chunk` lm_head rows at a time and makes the
student's head gradients in the same passes. Peak memory of the loss beyond the two models' own forward
activations, per micro-batch of N positions: about 6 fp32 [N, vocab_chunk] tensors (24 N vocab_chunk
bytes: 400 MB for N = 4,096 and the default chunk 4,096, whatever the vocabulary), the student head's
gradient [V, H] (which the backward produces anyway) and [N, H] fp32 hidden-state gradients; a
full-vocabulary fp32 log-probability table would be 4 N V bytes per model (2 GB each at N = 4,096,
V = 131,072).

Training: AdamW, linear warm-up then cosine decay to `min_lr_ratio * lr` over the run's tokens (BLD's
schedule, `puzzle.settings.learning_rate`), gradient accumulation over micro-batches, global-norm clipping, bf16
autocast on CUDA (fp32 master weights by default). A held-out evaluation (KL to the parent, the student's
and the parent's LM loss, top-1 agreement, cosine term) runs before the first step, every `eval_every`
steps and at the end. The history of train steps and evaluations is returned and saved. The output is
the evaluated weights with the lowest held-out KL (`keep_best`; the assembled child's own evaluation, before
any step, included), so GKD never hands back a child worse on the held-out set than it was given; a host
copy of each rank's student shard holds the best weights between evaluations. `early_stop_patience`
evaluations without a lower KL end the run early. The kept step is in history.json (`kept_step`) and the
manifest's info. With `select_by: TASK/METRIC` "best" is a task metric instead (`Selector`: lm-eval's score
of the student at each evaluation, recorded in the evaluation as `select`), and so is early stopping's.

Activation checkpointing (`activation_checkpointing`, on by default): each student block's forward in
training saves only its input; the backward runs the block again (non-reentrant `torch.utils.checkpoint`;
under FSDP2 the block's unit all-gathers its weights again for that forward). It costs one more student
forward per step and gives the same losses and weights; what it saves is every tensor a block keeps for
its backward (at scale the plan's largest GKD term: `puzzle plan`).

Distributed: each optimiser step takes one global batch of `batch_size` sequences; each rank runs its
round-robin rows in micro-batches and the loss is normalised by the global counts, so gradients summed over
ranks and micro-batches are the one-process gradients (2 ranks equal 1 process up to float summation order).
The batch need not divide by the ranks: the shares then differ by one row and every rank runs the same
number of micro-batches (`puzzle.settings.split_batch` chooses the accumulation), a rank short of rows
running a zero-weight one.
With `shard="fsdp"` and more than one rank, the teacher is sharded as BLD shards its parent
(`puzzle.shard.shard_parent`: embeddings, lm_head, each block's mixer; the lm_head is all-gathered with
`FSDPModule.unshard` around the loss, which reads its weight chunk by chunk) and the student with FSDP2 per
block plus one root unit (embeddings, final norm, lm_head) whose forward computes the loss, because FSDP
gathers a unit's weights only for that unit's own forward; gradients are summed (divide factor 1). Both
are sharded in place: load fresh copies for later stages (the distilled weights are in the output file).
With "none" the models are replicated and the gradients all-reduced.

Resume: every `checkpoint_every` steps the student's weights, AdamW state, step, tokens, data position,
RNG state, history and best evaluation (with its weights, where they are not the current ones) are written
atomically under `<directory>/gkd-checkpoints/` (full tensors, rank 0; read back lazily on resume, each rank
only the rows of its shards, `puzzle.resume.CheckpointTensors`);
a killed run restarted with the same inputs continues from the last one and produces the same losses and
final weights as an uninterrupted run. The output goes through `puzzle.artifacts` (stage "gkd"):
``student.safetensors`` (the student's `state_dict()`, full tensors; a tied lm_head is stored once, as
the embeddings; written one tensor at a time, each gathered on every rank and written by rank 0, so no rank
holds the whole student) and ``history.json``; the checkpoints are then removed. A finished output made
from the same inputs is reused without work. `load_distilled` into a sharded model reads from the file
only the rows each rank holds.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
from safetensors import safe_open
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from puzzle import dist, gathers, shard
from puzzle.artifacts import (
    Artifact,
    ArtifactError,
    fingerprint_json,
    fingerprint_model,
    fingerprint_tensors,
    json_writer,
)
from puzzle.data import BatchStream, DataError, TokenSplit
from puzzle.kv_cache import kv_scales
from puzzle.logits import (
    KL_SUM,
    NLL_SUM,
    NUM_HEAD_SUMS,
    POSITIONS,
    TEACHER_NLL_SUM,
    TOP1_SUM,
    distillation_head_loss,
    head_pass,
)
from puzzle.model import HybridLM
from puzzle.nemotron_h.config import CheckpointError
from puzzle.nemotron_h.sharded import fill_from_file
from puzzle.nemotron_h.stream import stream_state
from puzzle.nemotron_h.weights import SINGLE_FILE
from puzzle.progress import progress_bar
from puzzle.resume import (
    CheckpointTensors,
    announce_resume,
    load_optimizer_tensors,
    optimizer_tensors,
    read_checkpoint,
    write_checkpoint,
)
from puzzle.settings import BatchSplit, BLDSettings, GKDSettings, learning_rate, split_batch

FORMAT_VERSION = 1
ARTIFACT_NAME = "gkd"
WEIGHTS_FILE = "student.safetensors"
HISTORY_FILE = "history.json"
CHECKPOINT_DIR = "gkd-checkpoints"
STAGING_DIR = "gkd-staging"  # the weights file as it streams out, before the artifact moves it into place

_log = logging.getLogger(__name__)

# Rows of a step's fp64 sums: the head's (puzzle.logits: KL_SUM .. POSITIONS), then the cosine term's sum
# and the tokens it is over.
_COSINE_SUM, _TOKENS = NUM_HEAD_SUMS, NUM_HEAD_SUMS + 1
_NUM_SUMS = NUM_HEAD_SUMS + 2

TrainData = TokenSplit | Sequence[torch.Tensor] | Callable[[], Iterable[torch.Tensor]]


@dataclass(frozen=True)
class Selector:
    """GKD's measure of "best" when `GKDSettings.select_by` is a task metric: `score(student)` -> (value,
    higher_is_better) at each evaluation; `name` is the select_by it serves, `fingerprint` what the score
    depends on beyond the weights (tasks, data, limit), for reuse and resume. `puzzle.eval.task_selector`
    makes one from lm-eval; the student is in eval mode and without gradients while it is scored."""

    name: str
    score: Callable[[HybridLM], tuple[float, bool]]
    fingerprint: str


@dataclass
class GKDResult:
    """What GKD did: where the output is, the steps and tokens trained, and the history
    ({"train": one record per step, "eval": one record per evaluation, "kept_step": the step whose weights
    are the output, and "stopped_early_at" where early stopping ended the run}, as in history.json)."""

    directory: Path
    steps: int
    tokens: int
    history: dict[str, Any]
    resumed_from: int | None = None  # the checkpoint's step when this call resumed an interrupted run

    @property
    def kept_step(self) -> int:
        """The step whose weights are the output: the best held-out KL's (`keep_best`), else the last."""
        return int(self.history.get("kept_step", self.steps))

    @property
    def kept_eval(self) -> dict[str, Any]:
        """The evaluation of the output's weights."""
        return next(e for e in self.history["eval"] if e["step"] == self.kept_step)

    @property
    def weights_path(self) -> Path:
        return self.directory / WEIGHTS_FILE

    @property
    def first_eval(self) -> dict[str, Any]:
        return self.history["eval"][0]

    @property
    def last_eval(self) -> dict[str, Any]:
        return self.history["eval"][-1]


def load_distilled(directory: str | Path, model: HybridLM) -> HybridLM:
    """Load the distilled weights of a finished GKD output in `directory` into `model` (a plain, unsharded
    `HybridLM` of the student's spec) and return it; errors name the file and the tensors."""
    artifact = Artifact(Path(directory), ARTIFACT_NAME, FORMAT_VERSION)
    artifact.read_manifest()
    _load_file(model, artifact.path(WEIGHTS_FILE))
    return model


def _check_not_shared(student: HybridLM, teacher: HybridLM) -> None:
    """Training must not move the teacher: a student tensor that is a teacher tensor (e.g. a child built from
    the parent's own block modules instead of copies) is an error naming it."""

    def storage(tensor: torch.Tensor) -> int | None:
        if isinstance(tensor, DTensor):  # e.g. a teacher still sharded by BLD
            tensor = tensor.to_local()
        if tensor.device.type == "meta" or tensor.numel() == 0:  # no storage (every empty one is at 0)
            return None
        return tensor.untyped_storage().data_ptr()

    teacher_storages = {storage(t) for t in teacher.state_dict().values()} - {None}
    for name, tensor in student.state_dict().items():
        if storage(tensor) in teacher_storages:
            raise ValueError(
                f"GKD: the student's {name} shares its storage with a teacher tensor; training would change the "
                "teacher: give the student its own copy (e.g. copy.deepcopy of the parent's modules)"
            )


def _tied(model: HybridLM) -> bool:
    return model.lm_head.weight is model.embeddings.weight


def _state_to_save(model: HybridLM) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state_dict, a tied lm_head once. Sharded tensors stay sharded (DTensors):
    `puzzle.resume.write_checkpoint` gathers them one at a time, so no rank holds the whole student."""
    state = dict(model.state_dict())
    if _tied(model):
        state.pop("lm_head.weight", None)
    return state


def _load_state(model: HybridLM, tensors: CheckpointTensors, prefix: str) -> None:
    """Load the checkpoint's `prefix` tensors into `model`: where it is sharded, each rank reads only the rows
    of its shards (`CheckpointTensors.local`), one tensor at a time; names and shapes are checked first."""
    current = model.state_dict()
    expected = set(current) - ({"lm_head.weight"} if _tied(model) else set())
    names = {key[len(prefix) :] for key in tensors if key.startswith(prefix)}
    if names != expected:
        missing, extra = sorted(expected - names), sorted(names - expected)
        raise ArtifactError(
            f"{tensors.path}: tensors do not match the student (missing {missing}, unexpected {extra})"
        )
    for name in sorted(names):
        shape = tensors.shape(prefix + name)
        if shape != tuple(current[name].shape):
            raise ArtifactError(
                f"{tensors.path}: tensor {name!r} has shape {list(shape)}, the student's is {list(current[name].shape)}"
            )
    with torch.no_grad():  # one tensor at a time, copied into this rank's part of the student's
        for name in sorted(names):
            target = _local(current[name])
            target.copy_(tensors.local(prefix + name, current[name]).to(target.dtype))


def _load_file(model: HybridLM, path: Path) -> None:
    """Load GKD's weights file `path` into `model`: each rank reads only the rows of its shards where the
    model is sharded (`puzzle.nemotron_h.sharded.fill_from_file`), never the whole file; names and shapes
    are checked against the file's header first (errors name the file and the tensors)."""
    if not path.is_file():
        raise FileNotFoundError(f"{ARTIFACT_NAME} output {path} does not exist")
    current = model.state_dict()
    expected = set(current) - ({"lm_head.weight"} if _tied(model) else set())
    try:
        with safe_open(str(path), framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
    except Exception as error:  # safetensors raises its own types for truncated or corrupt files
        raise ArtifactError(f"cannot read {ARTIFACT_NAME} tensors {path}: {error}") from error
    if set(shapes) != expected:
        missing, extra = sorted(expected - set(shapes)), sorted(set(shapes) - expected)
        raise ArtifactError(
            f"{path}: tensors do not match the student (missing {missing}, unexpected {extra})"
        )
    for name, shape in shapes.items():
        if shape != tuple(current[name].shape):
            raise ArtifactError(
                f"{path}: tensor {name!r} has shape {list(shape)}, the student's is {list(current[name].shape)}"
            )
    try:
        fill_from_file(model, path, sorted(shapes))
    except CheckpointError as error:
        raise ArtifactError(str(error)) from error


# ----------------------------------------------------------------------------------------------------------
# The loss: the student's forward beside the teacher's, inside one module so FSDP gathers its root weights.


def _autocast(settings: GKDSettings, device: torch.device) -> Any:
    return torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=settings.autocast and device.type == "cuda"
    )


@contextmanager
def _teacher_head(teacher: HybridLM) -> Iterator[torch.Tensor]:
    """The teacher's full lm_head weight for the body (all-gathered and freed after it when sharded)."""
    unit = teacher.embeddings if _tied(teacher) else teacher.lm_head
    if not isinstance(unit, FSDPModule):
        yield unit.weight
        return
    unit.unshard()
    try:
        with gathers.COUNTER.holding(unit.weight.numel()):  # whole on every rank for the body
            yield unit.weight
    finally:
        unit.reshard()


def _block_and_cosine(
    block: nn.Module, s: torch.Tensor, t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The student block's output for input `s`, and the sum over positions of (1 - cos) between it and the
    teacher's residual stream `t` after the same block."""
    s = block(s)
    return s, (1 - nn.functional.cosine_similarity(s.float(), t.float(), dim=-1)).sum()


class _Distiller(nn.Module):
    """The student with the whole distillation loss in its forward (the FSDP root unit under sharding).

    With `checkpointing`, a training forward keeps only each student block's input and the teacher's
    residual stream after the block (for the cosine term) for the backward, which runs the block again (non-reentrant `torch.utils.checkpoint`: under FSDP2 the block's own unit gathers
    its weights again for that forward); evaluations run without gradients and never checkpoint."""

    def __init__(self, student: HybridLM, checkpointing: bool = False) -> None:
        super().__init__()
        self.student = student
        self.checkpointing = checkpointing

    def forward(
        self,
        ids: torch.Tensor,
        teacher: HybridLM,
        scales: tuple[float, float, float],
        chunk: int,
        train: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [b, t] -> (loss: fp32 scalar, with grad when `train`; sums [_NUM_SUMS] fp64).

        `scales`: (KL, NLL, cosine) multipliers of the sums, the weights over the global counts.
        """
        student = self.student
        kl_scale, nll_scale, cosine_scale = scales
        with torch.no_grad():
            t = teacher.embeddings(ids)
        s = student.embeddings(ids)
        cosine = torch.zeros((), dtype=torch.float32, device=ids.device)
        for teacher_block, student_block in zip(teacher.layers, student.layers):
            with torch.no_grad():
                t = teacher_block(t)
            if train and self.checkpointing and torch.is_grad_enabled():
                # The cosine inside the checkpoint too: its fp32 copies of s and t are not kept either.
                s, block_cosine = torch.utils.checkpoint.checkpoint(
                    _block_and_cosine, student_block, s, t, use_reentrant=False
                )
            else:
                s, block_cosine = _block_and_cosine(student_block, s, t)
            cosine = cosine + block_cosine
        n = ids.shape[0] * (ids.shape[1] - 1)
        hidden = student.norm_f(s)[:, :-1].reshape(n, s.shape[-1])
        with torch.no_grad():
            teacher_hidden = teacher.norm_f(t)[:, :-1].reshape(n, t.shape[-1])
        targets = ids[:, 1:].reshape(n)
        with _teacher_head(teacher) as teacher_weight:
            if train:
                loss, head = distillation_head_loss(
                    hidden,
                    student.lm_head.weight,
                    teacher_hidden,
                    teacher_weight,
                    targets,
                    chunk,
                    kl_scale,
                    nll_scale,
                )
            else:
                head, _, _ = head_pass(
                    hidden, student.lm_head.weight, teacher_hidden, teacher_weight, targets, chunk
                )
                loss = torch.zeros((), device=ids.device)
        sums = torch.zeros(_NUM_SUMS, dtype=torch.float64, device=ids.device)
        sums[: head.numel()] = head
        sums[_COSINE_SUM] = cosine.detach().double()
        sums[_TOKENS] = ids.numel()
        return loss + cosine_scale * cosine, sums


def _shard_student(distiller: _Distiller, mode: str) -> None:
    """FSDP2: each block with weights one unit, the distiller (embeddings, final norm, lm_head) the root;
    gradients summed over ranks (the loss carries the global normaliser). A student assembled sharded
    (its mixers, embeddings and lm_head FSDP units already) is made whole one unit at a time first."""
    for index, block in enumerate(distiller.student.layers):
        shard.plain_mixer(distiller.student, index)
        if any(True for _ in block.parameters()):
            shard.shard_variant(block, mode)
    shard.plain_root_units(distiller.student)
    shard.shard_variant(distiller, mode)


# ----------------------------------------------------------------------------------------------------------
# Data.


class _Stream:
    """This rank's rows of each global batch (round-robin, `puzzle.dist.local_rows`: the shares may differ by a
    row), and the position to resume from after each of them."""

    def __init__(self, data: TrainData, settings: GKDSettings) -> None:
        self.data, self.settings = data, settings
        if isinstance(data, TokenSplit):
            self.seq_len = data.seq_len
            self._global(data, None)  # fails now, naming the split, if it holds too few sequences
        else:
            first = next(iter(_iterable(data)), None)
            if first is None:
                raise DataError("GKD: the training data yielded no batch")
            self._check(first, 0)
            self.seq_len = first.shape[1]
        if self.seq_len < 2:
            raise DataError(f"GKD: sequences of {self.seq_len} token(s) have no next token to predict")

    def fingerprint(self) -> str:
        if isinstance(self.data, TokenSplit):
            return fingerprint_json({"split": self.data.fingerprint(), "seed": self.settings.seed})
        return fingerprint_tensors([next(iter(_iterable(self.data)))])

    def _check(self, batch: torch.Tensor, index: int) -> None:
        expected = (self.settings.batch_size, batch.shape[-1])
        if batch.ndim != 2 or tuple(batch.shape) != expected or batch.dtype != torch.long:
            raise DataError(
                f"GKD: training batch {index} must be int64 [batch_size={self.settings.batch_size}, tokens], "
                f"found {batch.dtype} {list(batch.shape)}"
            )
        if index and batch.shape[1] != self.seq_len:
            raise DataError(
                f"GKD: training batch {index} has {batch.shape[1]} tokens per row, batch 0 {self.seq_len}"
            )

    def iterate(self, position: Mapping[str, Any] | None) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """(this rank's rows [share, T], position after them), from `position` (None: the start)."""
        if isinstance(self.data, TokenSplit):
            stream = self._global(self.data, position)
            for batch in stream:
                yield dist.local_rows(batch), stream.state_dict()
            return
        skip = 0 if position is None else int(position["batches"])
        for index, batch in enumerate(_iterable(self.data)):
            if index < skip:  # replayed up to the checkpoint's position
                continue
            self._check(batch, index)
            yield dist.local_rows(batch), {"batches": index + 1}

    def _global(self, split: TokenSplit, position: Mapping[str, Any] | None) -> BatchStream:
        """`split`'s global batches of `batch_size` (every rank draws the same ones and keeps its rows): the
        sequences of a step are those of `batch_size` x 1 rank whatever the world, so resuming on other ranks
        continues on the same data."""
        return split.batches(self.settings.batch_size, self.settings.seed, rank=0, world=1, start=position)


def _iterable(data: Sequence[torch.Tensor] | Callable[[], Iterable[torch.Tensor]]) -> Iterable[torch.Tensor]:
    if callable(data):
        return data()
    if isinstance(data, Sequence):
        return data
    raise TypeError(
        "GKD training data must be a puzzle.data.TokenSplit, a sequence of token batches or a zero-argument "
        f"callable returning them (a resume replays the data), found a {type(data).__name__}"
    )


def _held_out_batches(held_out: TokenSplit | Sequence[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    if isinstance(held_out, TokenSplit):
        sequences = held_out.sequences
        batches = [
            sequences[i : i + batch_size].long()
            for i in range(0, len(sequences) - batch_size + 1, batch_size)
        ]
    else:
        batches = list(held_out)
    if not batches:
        raise DataError(f"GKD: the held-out data holds no batch of {batch_size} sequences")
    for index, batch in enumerate(batches):
        if batch.ndim != 2 or batch.dtype != torch.long or batch.shape[1] < 2:
            raise DataError(
                f"GKD: held-out batch {index} must be int64 [batch, tokens >= 2], found {batch.dtype} {list(batch.shape)}"
            )
    return batches


def _micro(rows: torch.Tensor, split: BatchSplit) -> list[torch.Tensor | None]:
    """This rank's `rows` cut into `split.steps` micro-batches (`BatchSplit.chunks`); None stands for a
    zero-weight one, where this rank holds fewer rows than the others run micro-batches."""
    cut: list[torch.Tensor | None] = []
    start = 0
    for size in split.chunks(rows.shape[0]):
        cut.append(rows[start : start + size] if size else None)
        start += size
    return cut


# ----------------------------------------------------------------------------------------------------------
# Steps, evaluation, checkpoints.


@dataclass
class _State:
    step: int = 0
    tokens: int = 0
    position: dict[str, Any] | None = None
    history: dict[str, list[dict[str, Any]]] = dataclasses.field(
        default_factory=lambda: {"train": [], "eval": []}
    )
    # The best evaluation so far (`keep_best`; the lowest `_rank_key`: KL, or the selector's metric) and
    # this rank's part of its weights, copied to the host.
    best_step: int | None = None
    best_key: float = math.inf
    best_weights: dict[str, torch.Tensor] | None = None

    def evaluations_since_best(self) -> int:
        return sum(
            1 for e in self.history["eval"] if self.best_step is not None and e["step"] > self.best_step
        )


def _record(sums: torch.Tensor, settings: GKDSettings, blocks: int) -> dict[str, float]:
    """Means over the global batch from all-reduced sums: the loss and each of its terms."""
    positions, tokens = float(sums[POSITIONS]), float(sums[_TOKENS])
    kl = float(sums[KL_SUM]) / positions
    lm = float(sums[NLL_SUM]) / positions
    cosine = float(sums[_COSINE_SUM]) / (tokens * max(blocks, 1))
    return {
        "loss": settings.kl_weight * kl + settings.cosine_weight * cosine + settings.lm_weight * lm,
        "kl": kl,
        "cosine": cosine,
        "lm_loss": lm,
        "parent_lm_loss": float(sums[TEACHER_NLL_SUM]) / positions,
        "top1": float(sums[TOP1_SUM]) / positions,
    }


def _scales(settings: GKDSettings, sequences: int, seq_len: int, blocks: int) -> tuple[float, float, float]:
    positions = sequences * (seq_len - 1)
    return (
        settings.kl_weight / positions,
        settings.lm_weight / positions,
        settings.cosine_weight / (sequences * seq_len * max(blocks, 1)),
    )


def _train_step(
    distiller: _Distiller,
    teacher: HybridLM,
    optimizer: torch.optim.Optimizer,
    rows: torch.Tensor,
    lr: float,
    settings: GKDSettings,
    split: BatchSplit,
) -> dict[str, float]:
    """One optimiser step on this rank's `rows` [share, T] of a global batch; returns the global record.

    Every rank runs `split.steps` micro-batches: where this rank has none left and the models are sharded
    (every unit's forward and backward are collectives), it runs its first row again at zero weight, whose
    gradients are zeros and whose sums are not counted."""
    device = distiller.student.embeddings.weight.device
    blocks = len(distiller.student.layers)
    scales = _scales(settings, settings.batch_size, rows.shape[1], blocks)
    sums = torch.zeros(_NUM_SUMS, dtype=torch.float64, device=device)
    rows = rows.to(device)
    for ids in _micro(rows, split):
        if ids is None and not shard.active(settings.shard):
            continue  # replicated: no collective before the gradients' all-reduce
        with _autocast(settings, device):
            loss, batch_sums = distiller(
                rows[:1] if ids is None else ids,
                teacher,
                (0.0, 0.0, 0.0) if ids is None else scales,
                settings.vocab_chunk,
                True,
            )
        loss.backward()
        if ids is not None:
            sums += batch_sums
    params = [p for p in distiller.parameters() if p.requires_grad]
    if not shard.active(settings.shard):  # FSDP's reduce-scatter has summed the sharded gradients
        dist.all_reduce_sum_([p.grad for p in params if p.grad is not None])
    dist.all_reduce_sum_([sums])
    clip = settings.clip if settings.clip > 0 else math.inf
    # With DTensor gradients clip_grad_norm_ reduces the norm over the shards: the global norm.
    norm = float(shard.replicated(torch.nn.utils.clip_grad_norm_(params, clip)))
    record = _record(sums.cpu(), settings, blocks)
    if not (math.isfinite(record["loss"]) and math.isfinite(norm)):
        raise FloatingPointError(
            f"GKD: the loss is {record['loss']} and the gradient norm {norm}: training diverged"
        )
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {**record, "lr": lr, "grad_norm": norm}


@torch.no_grad()
def _evaluate(
    distiller: _Distiller,
    teacher: HybridLM,
    held_out: Sequence[torch.Tensor],
    settings: GKDSettings,
    micro: int,
) -> dict[str, float]:
    """KL to the teacher, LM losses, top-1 agreement and the cosine term on every held-out position, in
    micro-batches of at most `micro` rows (under sharding as many on every rank: `_micro`)."""
    device = distiller.student.embeddings.weight.device
    blocks = len(distiller.student.layers)
    was_training = distiller.training
    distiller.eval()
    sums = torch.zeros(_NUM_SUMS, dtype=torch.float64, device=device)
    # Sharded units all-gather in their forward, so every rank must run every batch (its rows of it).
    sharded = shard.active(settings.shard)
    world = dist.world_size() if sharded else 1
    batches = (
        [(b, dist.local_rows(b)) for b in held_out] if sharded else [(b, b) for b in dist.shard(held_out)]
    )
    for whole, batch in batches:
        batch = batch.to(device)
        for ids in _micro(batch, split_batch(whole.shape[0], world, micro, "a held-out batch")):
            if ids is None and not sharded:
                continue
            with _autocast(settings, device):
                _, batch_sums = distiller(
                    batch[:1] if ids is None else ids, teacher, (0.0, 0.0, 0.0), settings.vocab_chunk, False
                )
            if ids is not None:  # a zero-weight micro-batch only keeps step with the other ranks
                sums += batch_sums
    dist.all_reduce_sum_([sums])
    distiller.train(was_training)
    return _record(sums.cpu(), settings, blocks)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _snapshot(student: HybridLM) -> dict[str, torch.Tensor]:
    """This rank's part of each student tensor (its shard under FSDP), copied to the host; a tied lm_head once.
    Local: no collective, and the host holds 1/world of the student per rank."""
    state = student.state_dict()
    if _tied(student):
        state.pop("lm_head.weight", None)
    return {k: _local(v).detach().to("cpu", copy=True) for k, v in state.items()}


@torch.no_grad()
def _restore(student: HybridLM, snapshot: Mapping[str, torch.Tensor]) -> None:
    """Copy a `_snapshot` back into the student's tensors (this rank's shards), in place."""
    state = student.state_dict()
    for name, value in snapshot.items():
        _local(state[name]).copy_(value)


def _snapshot_as_student(student: HybridLM, snapshot: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `_snapshot`'s tensors laid out as the student's: DTensors over this rank's shards where the student is
    sharded (no collective here: `puzzle.resume.write_checkpoint` gathers them one at a time)."""
    state = student.state_dict()
    return {name: shard.local_like(value, state[name]) for name, value in snapshot.items()}


def _rank_key(evaluation: Mapping[str, Any]) -> float:
    """Lower is better: the held-out KL, or the selector's metric (`select`) signed by higher_is_better."""
    select = evaluation.get("select")
    if select is None:
        return float(evaluation["kl"])
    return -float(select["value"]) if select["higher_is_better"] else float(select["value"])


@torch.no_grad()
def _append_evaluation(
    state: _State,
    distiller: _Distiller,
    teacher: HybridLM,
    held: Sequence[torch.Tensor],
    settings: GKDSettings,
    micro: int,
    selector: Selector | None,
) -> None:
    """Evaluate the student now (held-out KL and the rest; the selector's score when there is one), append
    it to the history, and keep it as the best when it ranks first so far (strictly: ties keep the
    earlier): its step, key and (with `keep_best`) a host copy of the weights."""
    evaluation: dict[str, Any] = {
        "step": state.step,
        "tokens": state.tokens,
        **_evaluate(distiller, teacher, held, settings, micro),
    }
    if selector is not None:
        was_training = distiller.training
        distiller.eval()
        value, higher_is_better = selector.score(distiller.student)
        distiller.train(was_training)
        evaluation["select"] = {"by": selector.name, "value": value, "higher_is_better": higher_is_better}
    state.history["eval"].append(evaluation)
    key = _rank_key(evaluation)
    if state.best_step is None or key < state.best_key:
        state.best_step, state.best_key = state.step, key
        state.best_weights = _snapshot(distiller.student) if settings.keep_best else None


def _checkpoint_dir(directory: Path) -> Path:
    return directory / CHECKPOINT_DIR


def _save_checkpoint(
    directory: Path,
    state: _State,
    student: HybridLM,
    optimizer: torch.optim.Optimizer,
    inputs: Mapping[str, str],
) -> None:
    """The student, AdamW, RNG states and position (`puzzle.resume.write_checkpoint`, which gathers sharded
    tensors one at a time as it writes them)."""
    tensors = {f"param/{k}": v for k, v in _state_to_save(student).items()}
    tensors.update(optimizer_tensors(optimizer, "adam/"))
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    if state.best_weights is not None and state.best_step != state.step:  # else the params are the best
        tensors.update({f"best/{k}": v for k, v in _snapshot_as_student(student, state.best_weights).items()})
    record = {
        "inputs": dict(inputs),
        "step": state.step,
        "tokens": state.tokens,
        "position": state.position,
        "history": state.history,
        "best": {"step": state.best_step, "key": state.best_key},
    }
    name = f"step{state.step}.safetensors"
    write_checkpoint(_checkpoint_dir(directory), "checkpoint.json", name, tensors, record)


def _load_checkpoint(
    directory: Path,
    student: HybridLM,
    optimizer: torch.optim.Optimizer,
    inputs: Mapping[str, str],
    settings: GKDSettings,
) -> _State | None:
    """The state of the last checkpoint of a run with these inputs (weights, AdamW and the best evaluation's
    weights restored), else None."""
    found = read_checkpoint(_checkpoint_dir(directory), "checkpoint.json", inputs)
    if found is None:
        return None
    record, tensors, _ = found
    with tensors:  # read lazily: each rank only the rows of its shards
        _load_state(student, tensors, "param/")
        load_optimizer_tensors(optimizer, tensors, "adam/")
        torch.set_rng_state(tensors["rng/cpu"])
        if "rng/cuda" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["rng/cuda"])
        state = _State(int(record["step"]), int(record["tokens"]), record["position"], record["history"])
        state.best_step, state.best_key = (
            int(record["best"]["step"]),
            float(record["best"].get("key", record["best"].get("kl"))),
        )
        if settings.keep_best:
            state.best_weights = _best_weights(student, tensors)
    return state


def _best_weights(student: HybridLM, tensors: CheckpointTensors) -> dict[str, torch.Tensor]:
    """The checkpoint's best evaluation's weights as a `_snapshot` (this rank's shards, on the host, each rank
    reading only its rows), or the student's own when the checkpoint was written at the best step."""
    best = {key[len("best/") :] for key in tensors if key.startswith("best/")}
    if not best:  # the checkpoint was written at the best evaluation's step
        return _snapshot(student)
    params = {key[len("param/") :] for key in tensors if key.startswith("param/")}
    _check_names(best, params, str(tensors.path))
    current = student.state_dict()
    return {
        k: tensors.local(f"best/{k}", current[k], "the student").to("cpu", current[k].dtype, copy=True)
        for k in sorted(best)
    }


def _check_names(best: Collection[str], params: Collection[str], source: str) -> None:
    if set(best) != set(params):
        raise ArtifactError(
            f"{source}: the best checkpoint's tensors are not the student's "
            f"(missing {sorted(set(params) - set(best))}, unexpected {sorted(set(best) - set(params))})"
        )


# ----------------------------------------------------------------------------------------------------------
# The stage.


def distill(
    student: HybridLM,
    teacher: HybridLM,
    train: TrainData,
    held_out: TokenSplit | Sequence[torch.Tensor],
    settings: GKDSettings,
    directory: str | Path,
    *,
    data_fingerprint: str | None = None,
    callback: Callable[[int, dict[str, Any]], None] | None = None,
    teacher_fp: str | None = None,
    selector: Selector | None = None,
) -> GKDResult:
    """Distil `teacher` into `student` (trained in place) and write the output to `directory`; returns it.

    `student`: the child (same number of blocks, hidden size and vocabulary as the teacher), on the
    teacher's device; it is cast to `settings.dtype`. `teacher`: the parent, frozen here (eval mode, no
    gradients). `train`: a `puzzle.data.TokenSplit` (batches drawn in a `settings.seed` order, epochs
    repeating) or global token batches int64 `[batch_size, T]`, a sequence or a zero-argument callable
    returning a fresh iterable (replayed on resume); `held_out`: global batches `[b, T]` or a TokenSplit
    (cut into batches of `batch_size`). `data_fingerprint` names the training data for the reuse and resume
    checks (default: the split's fingerprint, or a fingerprint of the first batch). `callback(step, record)`
    is called on every rank after each optimiser step (and its evaluation and checkpoint, if any).
    `teacher_fp` names the teacher for those checks (`puzzle.Run` passes its parent's fingerprint, from
    its files); default `fingerprint_model(teacher)`, which gathers a sharded teacher's every tensor.
    `selector`: required when `settings.select_by` names a task metric (and then its `name`), else None.

    At the end the student holds the distilled weights, the evaluated ones with the lowest held-out KL with
    `settings.keep_best` (`GKDResult.kept_step`; DTensor shards under FSDP: use `load_distilled` for a
    plain copy). A finished output of the same inputs is loaded into the student and returned without
    work; a checkpoint of the same inputs is resumed. Collective under torch.distributed (every rank passes
    the same arguments).
    """
    directory = Path(directory)
    if (selector.name if selector is not None else "kl") != settings.select_by:
        raise ValueError(
            f"GKD: settings.select_by is {settings.select_by!r} but the selector given is "
            f"{selector.name if selector is not None else None!r}: a task metric needs its Selector, kl none"
        )
    world = dist.world_size()
    split = settings.micro_batches(world)
    if (student.spec.num_blocks, student.spec.hidden_size, student.spec.vocab_size) != (
        teacher.spec.num_blocks,
        teacher.spec.hidden_size,
        teacher.spec.vocab_size,
    ):
        raise ValueError(
            "GKD: the student and the teacher must have the same number of blocks, hidden size and vocabulary, "
            f"found {student.spec.num_blocks}, {student.spec.hidden_size}, {student.spec.vocab_size} and "
            f"{teacher.spec.num_blocks}, {teacher.spec.hidden_size}, {teacher.spec.vocab_size}"
        )
    _check_not_shared(student, teacher)
    stream = _Stream(train, settings)
    held = _held_out_batches(held_out, settings.batch_size)
    inputs = {
        "student": fingerprint_model(student),
        "teacher": teacher_fp or fingerprint_model(teacher),
        "train_data": data_fingerprint or stream.fingerprint(),
        "held_out": fingerprint_tensors(held),
        "settings": fingerprint_json(settings.to_dict()),
    }
    if selector is not None:
        inputs["selector"] = selector.fingerprint
    if kv_scales(student):  # a student with an fp8 KV cache trains another forward (`puzzle.kv_cache`)
        inputs["student_kv_scales"] = fingerprint_json({str(i): p for i, p in kv_scales(student).items()})
    artifact = Artifact(directory, ARTIFACT_NAME, FORMAT_VERSION)
    if artifact.load_if_current(inputs) is not None:
        _load_file(student, artifact.path(WEIGHTS_FILE))
        manifest_info = artifact.read_manifest().info
        return GKDResult(
            directory, manifest_info["steps"], manifest_info["tokens"], artifact.load_json(HISTORY_FILE)
        )

    torch.manual_seed(settings.seed)
    teacher.eval().requires_grad_(False)
    device = teacher.embeddings.weight.device
    student.to(device=device, dtype=settings.torch_dtype).train().requires_grad_(True)
    distiller = _Distiller(student, settings.activation_checkpointing)
    if shard.active(settings.shard):
        shard.shard_parent(teacher, settings.shard)
        _shard_student(distiller, settings.shard)
        shard.free_dropped_units()  # the student's units as it was sharded before (an assembled child)
    optimizer = torch.optim.AdamW(
        [p for p in distiller.parameters() if p.requires_grad],
        lr=settings.lr,
        betas=settings.betas,
        weight_decay=settings.weight_decay,
    )
    tokens_per_step = settings.batch_size * stream.seq_len
    total = settings.token_budget or math.inf
    if settings.steps is not None:
        total = min(total, settings.steps * tokens_per_step)
    schedule = BLDSettings(
        lr=settings.lr,
        warmup_tokens=settings.warmup_tokens,
        token_budget=int(total),
        min_lr_ratio=settings.min_lr_ratio,
    )

    state = _load_checkpoint(directory, student, optimizer, inputs, settings)
    resumed_from = None
    if state is not None:
        resumed_from = announce_resume(f"GKD in {directory}", state.step, state.tokens)
    else:
        state = _State()
        if dist.is_main():
            shutil.rmtree(_checkpoint_dir(directory), ignore_errors=True)  # another run's, if any
        dist.barrier()
        _append_evaluation(state, distiller, teacher, held, settings, split.micro, selector)

    resumed_note = f" (resumed at step {resumed_from})" if resumed_from is not None else ""
    bar = progress_bar(f"GKD{resumed_note}", total=int(total), unit="tok")
    bar.update(state.tokens)
    started, start_tokens = time.perf_counter(), state.tokens
    stopped_early = _patience_spent(state, settings)
    for rows, position in stream.iterate(state.position):
        if stopped_early or state.tokens + tokens_per_step > total:
            break
        lr = learning_rate(schedule, state.tokens)
        record = _train_step(distiller, teacher, optimizer, rows, lr, settings, split)
        state.step += 1
        state.tokens += tokens_per_step
        state.position = position
        state.history["train"].append({"step": state.step, "tokens": state.tokens, **record})
        bar.update(tokens_per_step)
        rate = (state.tokens - start_tokens) / max(time.perf_counter() - started, 1e-9)
        bar.set_postfix(tok_s=f"{rate:.0f}", loss=f"{record['loss']:.4f}", kl=f"{record['kl']:.4f}")
        if settings.eval_every and state.step % settings.eval_every == 0:
            _append_evaluation(state, distiller, teacher, held, settings, split.micro, selector)
            stopped_early = _patience_spent(state, settings)
        if settings.checkpoint_every and state.step % settings.checkpoint_every == 0:
            _save_checkpoint(directory, state, student, optimizer, inputs)
        if callback is not None:
            callback(state.step, record)
    bar.close()
    if state.history["eval"][-1]["step"] != state.step:
        _append_evaluation(state, distiller, teacher, held, settings, split.micro, selector)

    kept = state.step
    if settings.keep_best and state.best_weights is not None:
        kept = int(state.best_step)
        if kept != state.step:
            _restore(student, state.best_weights)
    history = {**state.history, "kept_step": kept}
    if stopped_early:
        history["stopped_early_at"] = state.step
        _log.info(
            "GKD in %s: stopped at step %d, %d evaluations after the best (step %d)",
            directory,
            state.step,
            settings.early_stop_patience,
            state.best_step,
        )
    staged = _stream_student(student, directory)
    outputs = {WEIGHTS_FILE: lambda path: os.replace(staged, path), HISTORY_FILE: json_writer(history)}
    info = {
        "steps": state.step,
        "tokens": state.tokens,
        "final_eval": state.history["eval"][-1],
        "kept_step": kept,
        "kept_eval": next(e for e in state.history["eval"] if e["step"] == kept),
        "stopped_early": stopped_early,
    }
    artifact.write(inputs, outputs, info)
    if dist.is_main():
        shutil.rmtree(_checkpoint_dir(directory), ignore_errors=True)
        shutil.rmtree(staged.parent, ignore_errors=True)
    dist.barrier()
    return GKDResult(directory, state.step, state.tokens, history, resumed_from)


def _stream_student(student: HybridLM, directory: Path) -> Path:
    """The student's weights (its `state_dict()`, a tied lm_head once) written to a staging file under
    `directory` by rank 0, gathered one tensor at a time on every rank (`stream_state`, a collective under
    FSDP): no rank holds the whole student. Returns the file, which the artifact then moves into place."""
    staging = directory / STAGING_DIR
    if dist.is_main():
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    state = student.state_dict()
    if _tied(student):
        state.pop("lm_head.weight", None)
    stream_state(state, staging if dist.is_main() else None)
    dist.barrier()
    return staging / SINGLE_FILE


def _patience_spent(state: _State, settings: GKDSettings) -> bool:
    """Early stopping: `early_stop_patience` evaluations since the best one (never when it is 0)."""
    return bool(settings.early_stop_patience) and (
        state.evaluations_since_best() >= settings.early_stop_patience
    )
