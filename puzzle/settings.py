"""The stages' settings (BLD, scoring, GKD): plain dataclasses that validate themselves without torch, so
`puzzle.config` checks a run config without importing it. The stages (`puzzle.bld`, `puzzle.score`,
`puzzle.gkd`) take them as arguments and re-export them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

# How a stage spreads its models over torch.distributed ranks (`puzzle.shard`): FSDP2 over every rank, HSDP
# (sharded inside a node, replicated across nodes), or replicated.
SHARD_MODES = ("fsdp", "hsdp", "none")


def check_shard_mode(owner: str, mode: str) -> None:
    """ValueError naming `owner` (e.g. "BLDSettings.shard") unless `mode` is one of SHARD_MODES."""
    if mode not in SHARD_MODES:
        raise ValueError(f"{owner} must be 'fsdp', 'hsdp' or 'none', found {mode!r}")


def is_int(value: Any) -> bool:
    """An int that is not a bool (YAML's `true` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


# BLDSettings fields that decide how the variants are grouped into waves, not what they learn.
WAVE_FIELDS = ("memory_limit_bytes", "variants_per_wave")


@dataclass(frozen=True)
class BLDSettings:
    """How BLD trains. Token counts are global (all ranks together); bytes are per process.

    `lr`: AdamW peak learning rate; `warmup_tokens`: linear warm-up from 0, then cosine decay to
    `min_lr_ratio * lr` at `token_budget` tokens (each variant trains on `token_budget` tokens, fewer if
    the data ends first); `clip`: max gradient norm per variant (0 = none); `checkpoint_every`: steps
    between checkpoints (0 = never); `variants_per_wave`: how the variants are grouped into waves, one
    parent pass each: "auto" (the default) gives a wave's variants what the device's usable memory leaves
    per rank after the stage's other parts (the parent's shard, the gathered unit, the block's input and
    target, the parent's activations: `puzzle.plan.bld_wave_limit`, the figure `puzzle plan` prints), an
    integer N at most N variants a wave, None all of them in one (the library is the same whatever the
    waves: each variant sees the same batches from the same initial weights); `memory_limit_bytes`: what
    one wave's variants may use per rank, in place of auto's figure (None = auto's); `dtype`: the
    variants' training dtype ("float32" or "bfloat16"); `save_dtype`: the dtype the library stores the
    kept weights in: "parent" (the default: bf16 for a bf16 parent, the dtype assembly builds the child in),
    "float32" or "bfloat16"; `autocast`: bf16 autocast on CUDA; `seed`: seeds torch before each wave's
    variants are built; `shard`: "fsdp" shards the parent and the variants over the ranks with FSDP2,
    "hsdp" inside each node (replicated across nodes), "none" replicates them (no effect in a single process);
    `router_lr_scale`: the MoE routers' learning rate as a fraction of lr (0 = they keep their initial weights:
    the loss reaches a router only through the weights of the experts it chose, never through the choice).
    """

    lr: float = 1e-4
    warmup_tokens: int = 0
    token_budget: int = 1_000_000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    checkpoint_every: int = 100
    memory_limit_bytes: int | None = None
    variants_per_wave: int | Literal["auto"] | None = "auto"
    dtype: str = "float32"
    save_dtype: str = "parent"
    autocast: bool = True
    seed: int = 0
    shard: str = "fsdp"
    # Why 0: top-k has no gradient, so the router's gradient ignores the expert choices a step changes, while
    # AdamW moves every router weight by about lr a step whatever its gradient. Each step then flips experts
    # for many tokens: trained routers made the quick demo's top-2 half-width variants 1.6-2.6x worse than
    # their init (frozen: 0.4-0.5x). With top-1 and normalised weights the gradient is rounding noise.
    router_lr_scale: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"BLDSettings.lr must be a positive number, found {self.lr!r}")
        for name in ("warmup_tokens", "checkpoint_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"BLDSettings.{name} must be an integer >= 0, found {getattr(self, name)!r}")
        if not isinstance(self.token_budget, int) or self.token_budget < 1:
            raise ValueError(f"BLDSettings.token_budget must be an integer >= 1, found {self.token_budget!r}")
        if not (self.router_lr_scale >= 0 and math.isfinite(self.router_lr_scale)):
            raise ValueError(
                f"BLDSettings.router_lr_scale must be a number >= 0, found {self.router_lr_scale!r}"
            )
        if self.clip < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"BLDSettings: clip >= 0 and 0 <= min_lr_ratio <= 1, found {self.clip}, {self.min_lr_ratio}"
            )
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 1:
            raise ValueError(
                f"BLDSettings.memory_limit_bytes must be positive or None, found {self.memory_limit_bytes}"
            )
        wave = self.variants_per_wave
        if (
            wave != "auto"
            and wave is not None
            and (isinstance(wave, bool) or not isinstance(wave, int) or wave < 1)
        ):
            raise ValueError(
                f"BLDSettings.variants_per_wave must be 'auto', an integer >= 1 or None, found {wave!r}"
            )
        check_shard_mode("BLDSettings.shard", self.shard)
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"BLDSettings.dtype must be 'float32' or 'bfloat16', found {self.dtype!r}")
        if self.save_dtype not in ("parent", "float32", "bfloat16"):
            raise ValueError(
                f"BLDSettings.save_dtype must be 'parent', 'float32' or 'bfloat16', found {self.save_dtype!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # late: validating a config never needs torch

        return getattr(torch, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "betas": list(self.betas)}

    def library_dict(self) -> dict[str, Any]:
        """`to_dict` without the fields that only group the variants into waves (`WAVE_FIELDS`): what keys the
        library's reuse, which the waves do not change (auto waves differ from one device to another)."""
        return {k: v for k, v in self.to_dict().items() if k not in WAVE_FIELDS}


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


@dataclass(frozen=True)
class BatchSplit:
    """How a global batch of `batch` sequences runs on `world` ranks: round-robin rows (`puzzle.dist.local_rows`:
    ranks below `batch % world` hold one more), each rank in `steps` micro-batches of at most `micro` rows
    (the gradient accumulation), the same number on every rank, because a sharded unit all-gathers its
    weights in each forward and every rank must run as many. The global batch is kept exactly whatever the
    world: the loss is normalised by the global counts, so the summed gradients are one process's.

    A rank with fewer rows than `steps` (only where the shares differ and micro-batches are small) runs
    zero-weight micro-batches to keep step with the others (`padding`)."""

    batch: int
    world: int
    micro: int
    steps: int

    @property
    def largest(self) -> int:
        """Rows of the ranks that hold the most (ceil(batch / world))."""
        return -(-self.batch // self.world)

    @property
    def smallest(self) -> int:
        """Rows of the ranks that hold the fewest (floor(batch / world))."""
        return self.batch // self.world

    @property
    def padding(self) -> int:
        """Zero-weight micro-batches the ranks with the fewest rows run per step (0: none)."""
        return max(0, self.steps - self.smallest)

    def rows(self, rank: int) -> int:
        """Rows rank `rank` holds of the global batch (round-robin)."""
        return len(range(rank, self.batch, self.world))

    def chunks(self, rows: int) -> list[int]:
        """The sizes of the `steps` micro-batches of a rank holding `rows` rows, as even as they go, the
        larger first; 0 is a zero-weight micro-batch (fewer rows than steps)."""
        base, extra = divmod(rows, self.steps)
        return [base + (i < extra) for i in range(self.steps)]

    def describe(self) -> str:
        """The split in words, for the plan: rows per rank, micro-batches and any padding."""
        if self.largest == self.smallest and self.largest % self.steps == 0:
            return f"{self.largest} sequences per rank in micro-batches of {self.micro}"
        words = (
            f"{self.smallest}-{self.largest} sequences per rank ({self.batch} over {self.world} ranks) "
            if self.largest != self.smallest
            else f"{self.largest} sequences per rank "
        )
        words += f"in {self.steps} micro-batch(es) of up to {self.micro}"
        if self.padding:
            words += f", {self.padding} of them zero-weight on the ranks holding {self.smallest}"
        return words


def split_batch(batch: int, world: int, micro_batch_size: int | None, owner: str) -> BatchSplit:
    """`BatchSplit` of a global batch of `batch` sequences on `world` ranks, in micro-batches of at most
    `micro_batch_size` rows (None: each rank's whole share at once). The accumulation is chosen here: as few
    micro-batches as `micro_batch_size` allows, the same on every rank, so the global batch need not divide
    by the ranks. ValueError naming `owner` (the setting) and the values that work when some rank would hold
    no row at all (`batch` < `world`)."""
    if batch < world:
        even = ", ".join(str(d) for d in _divisors(batch))
        raise ValueError(
            f"{owner} ({batch}) must be at least the number of ranks ({world}): every rank trains on its own "
            f"rows of each step's batch. On {world} ranks batch_size {world} or more works ({world}, "
            f"{2 * world}, {3 * world}, ... split evenly); batch_size {batch} works on 1 to {batch} ranks "
            f"(evenly on {even})"
        )
    largest = -(-batch // world)
    micro = min(micro_batch_size or largest, largest)
    steps = -(-largest // micro)
    return BatchSplit(batch, world, -(-largest // steps), steps)


def learning_rate(settings: BLDSettings, tokens_seen: int) -> float:
    """BLD's (and GKD's) learning rate of a step that starts after `tokens_seen` tokens: linear warm-up, then cosine."""
    if tokens_seen < settings.warmup_tokens:
        return settings.lr * (tokens_seen + 1) / settings.warmup_tokens
    span = max(1, settings.token_budget - settings.warmup_tokens)
    progress = min(1.0, (tokens_seen - settings.warmup_tokens) / span)
    floor = settings.min_lr_ratio
    return settings.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class ScoreSettings:
    """How to score. `vocab_chunk`: lm_head rows per chunk (peak memory, see `puzzle.score.score_variants`).
    `variants_per_wave`: variants whose mixers (and, per batch, final hidden states) are held at once;
    "auto" (default): the most whose planned peak memory per rank fits the device (`puzzle.plan.auto_wave_size`:
    the CUDA device's memory, else the hardware profile in a run and the host's memory called directly),
    logged with why; an integer: that many; None: all; the parent runs once per batch per wave. `parent_kl_tolerance`: the largest KL (nats/token) the parent's own mixer may score
    before the run is stopped as not reproducible (0 on the CPU; GPU kernels may add rounding noise).
    `shard`: "fsdp" shards the parent and the variants with FSDP2 under torch.distributed with more than one
    rank (`puzzle.shard`, as BLD), "hsdp" inside each node (replicated across nodes); "none" keeps them
    replicated on every rank. `checkpoint_every`: batches
    (per rank) between saves of the running sums of the wave in flight (None: only finished waves are
    saved)."""

    vocab_chunk: int = 4096
    variants_per_wave: int | Literal["auto"] | None = "auto"
    parent_kl_tolerance: float = 1e-6
    shard: str = "fsdp"
    checkpoint_every: int | None = 20

    def __post_init__(self) -> None:
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(
                f"ScoreSettings.checkpoint_every must be >= 1 or None, found {self.checkpoint_every}"
            )
        check_shard_mode("ScoreSettings.shard", self.shard)
        if self.vocab_chunk < 1:
            raise ValueError(f"ScoreSettings.vocab_chunk must be >= 1, found {self.vocab_chunk}")
        wave = self.variants_per_wave
        if (
            wave is not None
            and wave != "auto"
            and (not isinstance(wave, int) or isinstance(wave, bool) or wave < 1)
        ):
            raise ValueError(
                f"ScoreSettings.variants_per_wave must be 'auto', an integer >= 1 or None, found {wave!r}"
            )


@dataclass(frozen=True)
class GKDSettings:
    """How GKD trains. Token counts and `batch_size` are global (all ranks together).

    `lr`: AdamW peak learning rate; `warmup_tokens`: linear warm-up from 0, then cosine decay to
    `min_lr_ratio * lr` at the end of the run; the run ends after `token_budget` tokens or `steps`
    optimiser steps, whichever comes first (None: no limit of that kind; at least one is needed), or when
    finite training data ends. `batch_size`: sequences per optimiser step; `micro_batch_size`: at most this many
    sequences per forward/backward on one rank (None: the rank's whole share at once); the ranks share
    `batch_size` round-robin, which need not divide by them (a rank holds ceil or floor of batch_size / world
    rows), and the gradients accumulate over as few micro-batches as that allows, the same count on every
    rank (`split_batch`: the choice `puzzle plan` prints); `clip`: max global gradient norm (0 = none); `kl_weight`, `cosine_weight`,
    `lm_weight`: the loss terms (`puzzle.gkd`); `vocab_chunk`: lm_head rows per chunk (memory);
    `eval_every`: steps between held-out evaluations (0 = only before and after training);
    `checkpoint_every`: steps between checkpoints (0 = never); `seed`: seeds torch and the order of a
    `TokenSplit`'s batches; `dtype`: the student's training dtype ("float32" or "bfloat16"); `autocast`:
    bf16 autocast on CUDA; `shard`: "fsdp" shards student and teacher over the ranks with FSDP2, "hsdp"
    inside each node (replicated across nodes), "none" replicates them (no effect in a single process);
    `keep_best`: the output is the evaluated checkpoint with the lowest held-out KL, the child before any
    step included (so GKD never returns a child worse on the held-out set than it was given), not the last
    one; it costs a host copy of each rank's student shard; `early_stop_patience`: stop after this many
    evaluations without a lower held-out KL (0 = never); `activation_checkpointing`: keep only each student
    block's input for the backward and recompute the block's activations there (one more student forward
    per step; the same result); `select_by`: what "best" means for `keep_best` and `early_stop_patience`:
    "kl" (the lowest held-out KL) or "TASK/METRIC", an lm-eval task metric of the student at each
    evaluation (its best by lm-eval's higher_is_better; `puzzle.gkd.Selector` scores it, the run builds
    one from its `eval` section, which must list TASK).
    """

    lr: float = 1e-5
    min_lr_ratio: float = 0.1
    warmup_tokens: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    token_budget: int | None = 100_000_000
    steps: int | None = None
    batch_size: int = 8
    micro_batch_size: int | None = None
    clip: float = 1.0
    kl_weight: float = 1.0
    cosine_weight: float = 1.0
    lm_weight: float = 0.0
    vocab_chunk: int = 4096
    eval_every: int = 100
    checkpoint_every: int = 100
    seed: int = 0
    dtype: str = "float32"
    autocast: bool = True
    shard: str = "fsdp"
    keep_best: bool = True
    early_stop_patience: int = 0
    activation_checkpointing: bool = True
    select_by: str = "kl"

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.select_by != "kl" and not _task_metric(self.select_by):
            raise ValueError(
                f"GKDSettings.select_by must be 'kl' or 'TASK/METRIC' (an lm-eval task and one of its metrics, "
                f"e.g. puzzle_next_line/acc_norm), found {self.select_by!r}"
            )
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"GKDSettings.lr must be a positive number, found {self.lr!r}")
        for name in ("min_lr_ratio", "kl_weight", "cosine_weight", "lm_weight", "weight_decay", "clip"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"GKDSettings.{name} must be a finite number >= 0, found {value!r}")
        if self.min_lr_ratio > 1:
            raise ValueError(f"GKDSettings.min_lr_ratio must be in [0, 1], found {self.min_lr_ratio}")
        if self.kl_weight + self.cosine_weight + self.lm_weight == 0:
            raise ValueError(
                "GKDSettings: kl_weight, cosine_weight and lm_weight are all 0: nothing to train"
            )
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"GKDSettings.betas must be two numbers in [0, 1), found {self.betas!r}")
        for name in ("warmup_tokens", "eval_every", "checkpoint_every", "seed", "early_stop_patience"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"GKDSettings.{name} must be an integer >= 0, found {value!r}")
        for name in ("token_budget", "steps", "micro_batch_size"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"GKDSettings.{name} must be an integer >= 1 or None, found {value!r}")
        if self.token_budget is None and self.steps is None:
            raise ValueError("GKDSettings: token_budget and steps are both None: set at least one")
        if self.early_stop_patience and not self.eval_every:
            raise ValueError(
                f"GKDSettings.early_stop_patience ({self.early_stop_patience}) counts evaluations: it needs "
                "eval_every > 0, found 0"
            )
        for name in ("batch_size", "vocab_chunk"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"GKDSettings.{name} must be an integer >= 1, found {value!r}")
        if self.micro_batch_size is not None and self.micro_batch_size > self.batch_size:
            raise ValueError(
                f"GKDSettings.micro_batch_size must be at most batch_size ({self.batch_size}), "
                f"found {self.micro_batch_size}"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"GKDSettings.dtype must be 'float32' or 'bfloat16', found {self.dtype!r}")
        check_shard_mode("GKDSettings.shard", self.shard)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # late: validating a config never needs torch

        return getattr(torch, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        data = {**dataclasses.asdict(self), "betas": list(self.betas)}
        if self.select_by == "kl":  # the default left out: records made before the field existed stay current
            del data["select_by"]
        return data

    @property
    def select_task(self) -> tuple[str, str] | None:
        """(task, metric) of a `select_by` of "TASK/METRIC"; None for "kl"."""
        return _task_metric(self.select_by)

    def micro_batches(self, world: int) -> BatchSplit:
        """How each step's global batch runs on `world` ranks (`split_batch`); errors name the fields."""
        return split_batch(self.batch_size, world, self.micro_batch_size, "GKDSettings.batch_size")


def _task_metric(text: Any) -> tuple[str, str] | None:
    """("task", "metric") of a "task/metric" string (both parts non-empty, no space), else None."""
    if not isinstance(text, str) or text.count("/") != 1 or any(c.isspace() for c in text):
        return None
    task, metric = text.split("/")
    return (task, metric) if task and metric else None
