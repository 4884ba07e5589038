"""What a run will cost before it runs: units of work, tokens, time, peak memory per rank and disk, per stage.

`plan_run(config, spec, gpus, hardware)` reads nothing but the run config and the parent's ModelSpec (from its
config.json: no weight is read; mixers are built on the meta device only to learn their parameter shapes).
Every memory figure is what ONE rank holds under FSDP2 over `gpus` ranks (`puzzle.shard`): each sharded unit
(the embeddings, each block's mixer, the lm_head) keeps ceil(rows / N) of the first dimension of every
parameter on a rank, exactly as `fully_shard` splits it; the pre-norms, norm_f and buffers stay replicated.
A stage whose `shard` setting is "none", or a world of one, holds everything whole. With `gpus_per_node`
(`puzzle plan --nodes N --gpus-per-node G`) a stage whose `shard` is "hsdp" is planned as `puzzle.shard` runs
it: each unit sharded over the G ranks of a node and replicated across the N nodes, so its memory per rank is
that of G ranks, its time that of N x G.

The estimates, and why (docs/SCALE.md shows them on Nemotron-3 Nano and Super):
- FLOPs: forward = the cost model's prefill FLOPs per token (`puzzle.cost.analytic`: 2 x the matmul weights a
  token runs through, plus attention scores and the Mamba scan at the configured sequence length), plus
  2 x H x V for the logits where a stage computes them; backward = 2 x forward. Time = FLOPs / (N x the
  hardware's dense bf16 peak x `efficiency`): an assumed model-FLOPs utilisation, printed with the plan. On an
  eager profile (this CPU) the time is instead each stage's `StageWork` (its block calls, heads, AdamW steps
  and cycle collections, as the run makes them) timed by the calibrated cost model (`puzzle.plan_time`).
- Memory per rank = sharded parent parameters (parent dtype) + the largest unit all-gathered for its forward
  + what the stage trains (parameters, gradients and both AdamW moments, all in the training dtype as
  torch's AdamW keeps them, sharded) + activations of the sequences a rank runs at once (its rows of each
  batch in BLD, its micro-batch in GKD, whole batches, shared out round-robin, in the forward-only stages)
  (`puzzle.cost.kinds` activation elements per token, saved for the backward where a stage trains) + the
  logits chunk (`puzzle.logits`: fp32 `[tokens, vocab_chunk]` tensors, never `[tokens, V]`).
- A child is not known before the search: assembly, GKD and export are planned with a child of the loosest
  `params` budget's share of the parent (the parent itself without one), an upper bound for its weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from puzzle.cost.analytic import model_active_params, model_params, prefill_flops_per_token
from puzzle.cost.hardware import HardwareProfile
from puzzle.cost.kinds import block_cost
from puzzle.plan_time import StageWork
from puzzle.settings import split_batch
from puzzle.shard import shard_numel
from puzzle.spec import BlockSpec, ModelSpec, NoOpSpec, Variant

GIB = 1024**3
# Assumed share of the dense bf16 peak a training or scoring step reaches (model FLOPs utilisation). 0.35 is
# typical of FSDP training of mid-sized models on H100-class GPUs; MoE routing, small per-expert matmuls and
# the all-gathers usually keep it below that, so treat the times as optimistic by up to 2x.
DEFAULT_EFFICIENCY = 0.35
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
FP32 = 4
# fp32 [tokens, vocab_chunk] tensors alive at once in the chunked head passes: scoring's docstring counts 4
# (parent logits and probabilities, the variant's chunk logits, a scratch buffer); the differentiable
# distillation head (puzzle.logits.distillation_head_loss) keeps the same plus the chunk's gradient.
SCORE_LOGIT_BUFFERS = 4
GKD_LOGIT_BUFFERS = 5
# The [tokens, vocab_chunk] buffers `puzzle.logits.head_pass` makes a call (`ChunkBuffers`).
HEAD_PASS_BUFFERS = 3
STAGES = ("importance", "library", "scores", "solutions", "assemble", "distill", "export")
# Saved activations per token of a BLD variant's training step, in units of (input widths of its matrices x
# dtype bytes); the backward keeps each matrix's input plus a few elementwise temporaries.
ACTIVATION_FACTOR = 2


# ---------------------------------------------------------------------------------------------- shapes


@lru_cache(maxsize=256)
def _mixer_shapes(spec: BlockSpec, hidden_size: int) -> tuple[tuple[tuple[int, ...], ...], int]:
    """(parameter shapes, buffer bytes) of the mixer of `spec`, as `puzzle.blocks` builds it (on meta)."""
    import torch

    from puzzle.blocks import build_block

    if not block_cost(spec).runs:
        return (), 0
    with torch.device("meta"):
        mixer = build_block(spec, hidden_size)
    shapes = tuple(tuple(p.shape) for p in mixer.parameters())
    buffers = sum(b.numel() * FP32 for b in mixer.buffers())  # the router's fp32 correction bias
    return shapes, buffers


# ------------------------------------------------------------------------------ BLD's waves (BLD asks here)


def variant_training_bytes(
    variant: Variant, hidden_size: int, tokens_per_step: int, dtype: Any, world: int = 1
) -> int:
    """Estimated bytes one rank holds to train `variant` in BLD: params + grads + 2 AdamW moments (4 x params
    in `dtype`, a torch dtype, the largest FSDP shard of each parameter when sharded over `world` ranks, see
    `puzzle.shard.shard_numel`) plus saved activations, `ACTIVATION_FACTOR` x the input width of every matrix
    (and the block's input) per token.

    `tokens_per_step`: tokens one process runs per step (its rows of the batch x sequence length). `world`:
    the ranks the variant is sharded over (1 = unsharded, every rank holds it whole).
    """
    import torch

    shapes, _ = _mixer_shapes(variant.spec, hidden_size)
    widths = sum(shape[-1] for shape in shapes if len(shape) >= 2) + hidden_size
    size = torch.empty((), dtype=dtype).element_size()
    params = sum(shard_numel(shape, world) for shape in shapes)
    return 4 * params * size + ACTIVATION_FACTOR * tokens_per_step * widths * size


def plan_waves(
    sizes: Mapping[Variant, int],
    limit: float | None,
    *,
    max_variants: int | None = None,
    oversized: Literal["raise", "alone"] = "raise",
) -> list[list[Variant]]:
    """Group variants into waves whose summed bytes fit `limit` and that hold at most `max_variants` each
    (first fit, largest first); None = no such bound (both None: one wave).

    Within a wave the variants are in (block, id) order; waves are ordered by their first block. A variant
    larger than the limit alone is an error naming it (`oversized="raise"`, for a limit the user gave), or
    trains in a wave of its own (`"alone"`, for auto's limit: the plan's peak check names what does not fit).
    """
    if not sizes:
        return []
    if limit is None and max_variants is None:
        return [sorted(sizes, key=_block_order)]
    room_of_new = math.inf if limit is None else limit
    waves: list[list[Variant]] = []
    free: list[float] = []
    for variant in sorted(sizes, key=lambda v: (-sizes[v], _block_order(v))):
        need = sizes[variant]
        if need > room_of_new and oversized == "raise":
            raise ValueError(
                f"variant {variant.id} of block {variant.block_index} needs about {need} bytes to train, more "
                f"than memory_limit_bytes={limit}: raise the limit or use smaller batches"
            )
        slot = next(
            (
                w
                for w, room in enumerate(free)
                if room >= need and (max_variants is None or len(waves[w]) < max_variants)
            ),
            None,
        )
        if slot is None:
            waves.append([])
            free.append(room_of_new)
            slot = len(waves) - 1
        waves[slot].append(variant)
        free[slot] -= need
    waves = [sorted(wave, key=_block_order) for wave in waves]
    return sorted(waves, key=lambda wave: _block_order(wave[0]))


@dataclass(frozen=True)
class WaveLimit:
    """BLD's wave grouping: `bytes` a wave's variants may use per rank (None: unbounded), `max_variants` per
    wave (None: unbounded), whether a variant over `bytes` trains alone (`oversized`), and why (`reason`)."""

    bytes: float | None
    max_variants: int | None
    oversized: Literal["raise", "alone"]
    reason: str

    def waves(self, sizes: Mapping[Variant, int]) -> list[list[Variant]]:
        return plan_waves(sizes, self.bytes, max_variants=self.max_variants, oversized=self.oversized)


def library_other_parts(
    spec: ModelSpec,
    trained: Sequence[Variant],
    *,
    tokens: int,
    dtype_bytes: int,
    train_bytes: int,
    world: int,
) -> dict[str, float]:
    """What one BLD rank holds per rank beside its wave's variants (`_library`'s memory but the wave): the
    parent's shard over `world` ranks, the gathered unit (the largest parent unit, or a whole variant mixer
    gathered for its forward), one block's input and target and the parent's block activations at `tokens`
    per step (this rank's rows x seq_len), the parent in `dtype_bytes`, the variants in `train_bytes`."""
    H = spec.hidden_size
    parent = parent_bytes(spec, dtype_bytes, world)
    largest_whole = max((mixer_params(v.spec, H) * train_bytes for v in trained), default=0)
    return {
        "parent shard": parent.sharded,
        "gathered unit": max(parent.largest_unit, largest_whole if world > 1 else 0),
        "block input/target": 2 * tokens * H * dtype_bytes,
        "parent block activations": max(
            block_activation_bytes(b, H, tokens, dtype_bytes) for b in spec.blocks
        ),
    }


def bld_wave_limit(settings: Any, others: Mapping[str, float], usable: float | None) -> WaveLimit:
    """How BLDSettings `settings` groups the variants into waves on ranks with `usable` bytes each (None:
    unknown), when the stage's other parts per rank are `others` (`library_other_parts`): auto's byte budget
    is what `usable` leaves after them; `memory_limit_bytes`, when given, replaces it."""
    count = settings.variants_per_wave if isinstance(settings.variants_per_wave, int) else None
    if settings.memory_limit_bytes is not None:
        return WaveLimit(
            settings.memory_limit_bytes,
            count,
            "raise",
            f"bld.memory_limit_bytes {_gib(settings.memory_limit_bytes)}",
        )
    if settings.variants_per_wave != "auto":
        what = "all variants in one wave" if count is None else f"at most {count} variants a wave"
        return WaveLimit(None, count, "raise", f"bld.variants_per_wave {count}: {what}")
    if usable is None:
        return WaveLimit(None, None, "alone", "bld.variants_per_wave auto: no device memory given, one wave")
    rest = float(sum(others.values()))
    budget = max(0.0, usable - rest)
    parts = " - ".join(f"{name} {_gib(value)}" for name, value in others.items() if value)
    reason = f"{_gib(budget)} per rank for a wave's variants = usable {_gib(usable)} - {parts}"
    if budget == 0:
        reason = (
            f"nothing is left per rank for a wave's variants: usable {_gib(usable)} < {parts.replace(' - ', ' + ')}"
            " (one variant per wave; the stage does not fit)"
        )
    return WaveLimit(budget, None, "alone", f"bld.variants_per_wave auto: {reason}")


def _block_order(variant: Variant) -> tuple[int, str]:
    return variant.block_index, variant.id


def mixer_params(spec: BlockSpec, hidden_size: int) -> int:
    """Parameters of the mixer of `spec` (the block's pre-norm excluded)."""
    return sum(math.prod(s) for s in _mixer_shapes(spec, hidden_size)[0])


def mixer_shard_params(spec: BlockSpec, hidden_size: int, world: int) -> int:
    """Parameters of the mixer of `spec` that the largest rank holds when it is one FSDP unit over `world`."""
    return sum(shard_numel(s, world) for s in _mixer_shapes(spec, hidden_size)[0])


@dataclass(frozen=True)
class ParentBytes:
    """Bytes of the parent on one rank: `sharded` (every unit's shard plus replicated norms and buffers),
    `whole` (the parent unsharded) and `largest_unit` (the biggest unit gathered whole for its forward)."""

    sharded: int
    whole: int
    largest_unit: int


def parent_bytes(spec: ModelSpec, dtype_bytes: int, world: int) -> ParentBytes:
    """The parent's parameter bytes per rank under `shard_parent` over `world` ranks (world 1: unsharded).

    Matches the local parameters of a `HybridLM` sharded by `puzzle.shard.shard_parent` exactly (tests),
    the MoE routers counted at the parent dtype (the loader keeps them fp32: a few MB on Super).
    """
    H, V = spec.hidden_size, spec.vocab_size
    table = [(V, H)] + ([] if spec.tie_embeddings else [(V, H)])
    units: list[tuple[int, int]] = [(V * H, shard_numel((V, H), world)) for _ in table]
    replicated = H  # norm_f
    buffers = 0
    for block in spec.blocks:
        shapes, buffer_bytes = _mixer_shapes(block, H)
        if shapes:
            units.append((sum(math.prod(s) for s in shapes), sum(shard_numel(s, world) for s in shapes)))
        if block_cost(block).runs:
            replicated += H  # the block's pre-norm
        buffers += buffer_bytes
    whole = (sum(u[0] for u in units) + replicated) * dtype_bytes + buffers
    if world == 1:
        return ParentBytes(whole, whole, 0)
    sharded = (sum(u[1] for u in units) + replicated) * dtype_bytes + buffers
    return ParentBytes(sharded, whole, max(u[0] for u in units) * dtype_bytes)


# ------------------------------------------------------------------------------------------------ plans


@dataclass
class StagePlan:
    """One stage: `units` (what it does, in words), `tokens` processed, `flops`, `memory` (name -> bytes per
    rank on its device; the peak is their sum), `disk` (bytes it writes), `notes` (what the estimate
    assumes), `host` (name -> bytes per rank the stage keeps in host memory beside that: not counted
    against the GPU, but on a CPU run, where host memory is the device memory, `resident` adds them)."""

    name: str
    units: str
    tokens: int | None
    flops: float
    memory: dict[str, float]
    disk: float = 0.0
    notes: list[str] = field(default_factory=list)
    seconds: float | None = None  # set by plan_run from flops (or given, for the search)
    host: dict[str, float] = field(default_factory=dict)
    work: StageWork | None = None  # its passes, which price it on an eager profile (`puzzle.plan_time`)

    @property
    def peak(self) -> float:
        return float(sum(self.memory.values()))

    @property
    def resident(self) -> float:
        """What a rank holds when its device is the host (CPU ranks, gloo): the peak plus the host copies."""
        return self.peak + float(sum(self.host.values()))


@dataclass
class Plan:
    """Every stage's plan on `gpus` ranks of `hardware`; `limit` is the usable memory per rank."""

    spec: ModelSpec
    hardware: HardwareProfile
    gpus: int
    efficiency: float
    memory_fraction: float
    stages: list[StagePlan]
    problems: list[str] = field(default_factory=list)
    gpus_per_node: int | None = None  # None: one node of `gpus`

    @property
    def nodes(self) -> int:
        """Nodes of `gpus_per_node` ranks (1 without it)."""
        return 1 if self.gpus_per_node is None else self.gpus // self.gpus_per_node

    @property
    def limit(self) -> float:
        return self.hardware.memory_bytes * self.memory_fraction

    def misfits(self) -> list[str]:
        """One line per stage whose peak per rank exceeds the limit, naming the stage and the figures, then
        any problem found while planning (a BLD variant larger than memory_limit_bytes)."""
        lines = []
        for stage in self.stages:
            if stage.peak > self.limit:
                biggest = max(stage.memory, key=lambda k: stage.memory[k])
                lines.append(
                    f"stage {stage.name}: peak memory per rank {_gib(stage.peak)} > {_gib(self.limit)} "
                    f"({self.memory_fraction:g} x {_gib(self.hardware.memory_bytes)} of {self.hardware.name}); "
                    f"the largest part is {biggest} ({_gib(stage.memory[biggest])})"
                )
        return lines + self.problems

    @property
    def disk(self) -> float:
        """The bytes every stage writes together (the library's wave checkpoints included)."""
        return float(sum(s.disk for s in self.stages))

    def disk_misfits(self, free: float, where: str, written: float = 0.0) -> list[str]:
        """One line when the run's disk, less the `written` bytes already there, exceeds `free` bytes (at
        `where`): it names the stage that writes the most and, for the library, the kind and axes that
        cost the most bytes; empty when it fits."""
        need = self.disk - written
        if need <= free:
            return []
        stage = max(self.stages, key=lambda s: s.disk)
        line = (
            f"disk: the run writes about {_gib(self.disk)}"
            + (f" ({_gib(written)} of it already written)" if written else "")
            + f", more than the {_gib(free)} free {where}; the most is stage {stage.name} ({_gib(stage.disk)})"
        )
        by_axis = [n for n in stage.notes if n.startswith("library bytes by kind: ")]
        if by_axis:
            line += f"; the library's {by_axis[0][len('library ') :]}: fewer values on an axis shrink it"
        return [line]

    def gpu_hours(self, stage: StagePlan) -> float | None:
        """GPU-hours of `stage`: its time on every rank (None where its time is not known). The search runs
        on rank 0's CPU while the other ranks wait, so it holds every GPU too."""
        return None if stage.seconds is None else stage.seconds * self.gpus / 3600

    def to_dict(self) -> dict[str, Any]:
        return {
            "hardware": self.hardware.name,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node or self.gpus,
            "efficiency": self.efficiency,
            "memory_limit_bytes": self.limit,
            "stages": [
                {
                    "stage": s.name,
                    "units": s.units,
                    "tokens": s.tokens,
                    "flops": s.flops,
                    "seconds": s.seconds,
                    "gpu_hours": self.gpu_hours(s),
                    "memory": dict(s.memory),
                    "peak_bytes": s.peak,
                    "host_memory": dict(s.host),
                    "disk_bytes": s.disk,
                    "notes": list(s.notes),
                }
                for s in self.stages
            ],
            "problems": list(self.problems),
            "disk_bytes": self.disk,
        }

    def render(self) -> str:
        """The plan as text, one paragraph per stage."""
        spec = self.spec
        lines = [
            f"parent: {spec.num_blocks} blocks, {model_params(spec) / 1e9:.2f}B parameters, "
            f"{model_active_params(spec) / 1e9:.2f}B active",
            f"hardware: {self.gpus} x {self.hardware.name}"
            + (f" ({self.nodes} nodes of {self.gpus_per_node})" if self.nodes > 1 else "")
            + f" ({_gib(self.hardware.memory_bytes)} each, "
            f"usable {_gib(self.limit)} = memory_fraction {self.memory_fraction:g}); "
            + (
                "time from its calibrated eager cost model, pass by pass (puzzle.plan_time)"
                if self.hardware.eager
                else f"time at {self.efficiency:.0%} of the dense bf16 peak "
                f"({self.hardware.flops_per_s('bf16') / 1e12:.0f} TFLOP/s per GPU)"
            ),
            "",
        ]
        total = 0.0
        for stage in self.stages:
            fits = "fits" if stage.peak <= self.limit else "DOES NOT FIT"
            tokens = "-" if stage.tokens is None else _count(stage.tokens)
            time = "-" if stage.seconds is None else _duration(stage.seconds)
            total += stage.seconds or 0.0
            lines.append(f"{stage.name}: {stage.units}")
            lines.append(
                f"  tokens {tokens}, {stage.flops:.3g} FLOPs, time {time}, "
                f"peak per rank {_gib(stage.peak)} ({fits}), disk {_gib(stage.disk)}"
            )
            parts = ", ".join(f"{k} {_gib(v)}" for k, v in stage.memory.items() if v) or "none on the GPU"
            lines.append(f"  memory per rank: {parts}")
            if any(stage.host.values()):
                host = ", ".join(f"{k} {_gib(v)}" for k, v in stage.host.items() if v)
                lines.append(f"  host memory per rank (beside the GPU): {host}")
            lines += [f"  note: {n}" for n in stage.notes]
        lines.append("")
        lines.append(f"total time {_duration(total)}; disk {_gib(self.disk)}")
        hours = [(stage.name, self.gpu_hours(stage)) for stage in self.stages]
        lines.append(
            f"GPU-hours on {self.gpus} x {self.hardware.name}: "
            + ", ".join(f"{name} {_hours(h)}" for name, h in hours if h is not None)
            + f"; total {_hours(sum(h for _, h in hours if h is not None))}"
        )
        lines += [f"does not fit: {m}" for m in self.misfits()]
        return "\n".join(lines)


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _count(value: float) -> str:
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:g}"


def _hours(gpu_hours: float) -> str:
    """GPU-hours as the plan prints them: 3 significant figures, at least one decimal below 100."""
    return f"{gpu_hours:,.0f}" if gpu_hours >= 100 else f"{gpu_hours:.3g}"


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


# ------------------------------------------------------------------------------------------ the model


def forward_flops_per_token(spec: ModelSpec, seq_len: int, logits: bool = True) -> float:
    """Forward FLOPs per token of `spec` over sequences of `seq_len` (the cost model's prefill figure, whose
    attention and scan terms depend on the length), plus 2 x H x V when the logits are computed."""
    H = spec.hidden_size
    flops = sum(prefill_flops_per_token(b, H, seq_len) for b in spec.blocks)
    return flops + (2.0 * H * spec.vocab_size if logits else 0.0)


def block_forward_flops(block: BlockSpec, hidden_size: int, seq_len: int) -> float:
    return prefill_flops_per_token(block, hidden_size, seq_len) if block_cost(block).runs else 0.0


def block_activation_bytes(block: BlockSpec, hidden_size: int, tokens: int, dtype_bytes: int) -> float:
    """Activations one block writes for `tokens` tokens (`puzzle.cost.kinds`' unfused count): what its
    forward holds transiently, and what its backward keeps when it trains."""
    return block_cost(block).activation_elements_per_token(block, hidden_size) * tokens * dtype_bytes


def _dtype_bytes(name: str) -> int:
    return DTYPE_BYTES.get(name.removeprefix("torch."), 2)


def parent_dtype_bytes(config_dtype: str, checkpoint: dict[str, Any] | None) -> int:
    """Bytes per parameter of the parent as the run loads it: parent.dtype, or for "auto" the checkpoint's
    torch_dtype / dtype (bf16 when it names none)."""
    if config_dtype != "auto":
        return _dtype_bytes(config_dtype)
    checkpoint = checkpoint or {}
    named = checkpoint.get("torch_dtype") or checkpoint.get("dtype") or "bfloat16"
    return _dtype_bytes(str(named))


def rows_per_rank(batch: int, world: int) -> int:
    """Sequences of a global batch of `batch` one rank runs (its round-robin rows)."""
    return math.ceil(batch / world)


# -------------------------------------------------------------------------------------------- the stages


@dataclass(frozen=True)
class _Context:
    """What every stage planner reads: the config, the parent, the world and the parent's bytes per rank."""

    config: Any  # puzzle.config.RunConfig
    spec: ModelSpec
    world: int
    dtype_bytes: int
    variants: dict[int, list[Variant]] | None
    usable: float | None = None  # memory per rank the stages may use (BLD's auto waves are sized from it)
    node: int | None = None  # ranks per node (LOCAL_WORLD_SIZE); None: one node of `world`
    collects: int = 2  # cycle collections around every stage record (`puzzle.ledger.Ledger.run`)

    @property
    def child_fraction(self) -> float:
        """An upper bound on the child's parameters as a share of the parent's: the loosest solve's tightest
        `params` budget (1 when a solve has none: the child may then be as large as the parent)."""
        total = model_params(self.spec)
        loosest = 0.0
        for round_index in range(self.config.rounds.count):
            for solve in self.config.round_limits(round_index):
                bounds = [limit.absolute(total) for limit in solve if limit.key == "params"]
                loosest = max(loosest, min(bounds, default=total) / total)
        return min(1.0, loosest or 1.0)

    @property
    def seq_len(self) -> int:
        return self.config.data.seq_len

    def world_of(self, mode: str) -> int:
        """The ranks a stage with shard mode `mode` shards over (1: every rank holds everything whole): every
        rank for "fsdp", the ranks of a node for "hsdp" (`puzzle.shard.ways`)."""
        if mode == "fsdp":
            return self.world
        if mode == "hsdp":
            return min(self.node or self.world, self.world)
        return 1

    @property
    def shared_mode(self) -> str:
        """How the stages without a `shard` setting of their own (assembly, export) find the shared parent:
        sharded inside a node when any stage shards it so ("hsdp"), else over every rank."""
        stages = (self.config.importance, self.config.bld, self.config.scoring, self.config.gkd)
        return "hsdp" if any(s.shard == "hsdp" for s in stages) else "fsdp"

    def parent(self, mode: str | None = None) -> ParentBytes:
        """The parent's bytes per rank under shard mode `mode` (None: `shared_mode`)."""
        return parent_bytes(self.spec, self.dtype_bytes, self.world_of(mode or self.shared_mode))

    def largest_block_activations(self, tokens: int, dtype_bytes: int | None = None) -> float:
        H, size = self.spec.hidden_size, dtype_bytes or self.dtype_bytes
        return max(block_activation_bytes(b, H, tokens, size) for b in self.spec.blocks)

    def held_out_tokens(self) -> int | None:
        return self.config.data.held_out_tokens

    def held_out_batches(self) -> int | None:
        """Held-out batches of data.eval_batch_size the stages measure on (`RunContext.held_out_batches`),
        None when data.held_out_tokens is null."""
        tokens = self.held_out_tokens()
        return (
            None if tokens is None else math.ceil(tokens / (self.config.data.eval_batch_size * self.seq_len))
        )

    def work(self, dtype: str | None = None) -> StageWork:
        """An empty `StageWork` of this parent and sequence length (the parent's dtype unless `dtype`)."""
        name = dtype or {4: "float32", 8: "float64"}.get(self.dtype_bytes, "bfloat16")
        return StageWork(self.spec.hidden_size, self.seq_len, name, collects=self.collects)


def _importance(ctx: _Context) -> StagePlan:
    settings, H = ctx.config.importance, ctx.spec.hidden_size
    batches = max(1, math.ceil(settings.tokens / (settings.batch_size * ctx.seq_len)))
    tokens = batches * settings.batch_size * ctx.seq_len
    # Data-parallel by whole batches (`puzzle.prune.importance`: a round-robin share per rank), sharded or not.
    local = settings.batch_size * ctx.seq_len
    parent = ctx.parent(settings.shard)
    memory = {
        "parent shard": parent.sharded,
        "gathered unit": parent.largest_unit,
        "residual stream": 2 * local * H * ctx.dtype_bytes,
        "block activations": ctx.largest_block_activations(local),
    }
    work = ctx.work()
    work.forward(ctx.spec.blocks, settings.batch_size, math.ceil(batches / ctx.world))
    fit_every = settings.linear_fit_every if settings.linear_fit else 0
    work.importance_hooks(ctx.spec.blocks, settings.batch_size, math.ceil(batches / ctx.world), fit_every)
    return StagePlan(
        "importance",
        f"{batches} calibration batches of {settings.batch_size} x {ctx.seq_len} (forward only)",
        tokens,
        tokens * forward_flops_per_token(ctx.spec, ctx.seq_len, logits=False),
        memory,
        notes=["each rank runs whole calibration batches, its round-robin share of them"],
        work=work,
    )


def _trained(ctx: _Context) -> list[Variant]:
    return [
        v
        for listed in (ctx.variants or {}).values()
        for v in listed
        if v.spec != ctx.spec.blocks[v.block_index] and not isinstance(v.spec, NoOpSpec)
    ]


def library_grouping(ctx: _Context) -> tuple[dict[Variant, int], dict[str, float], WaveLimit]:
    """Each trained variant's BLD bytes per rank, the stage's other parts per rank (`library_other_parts`)
    and the limit that groups the variants into waves, as the run will (`puzzle.bld.build_library` asks
    `bld_wave_limit` the same way); `WaveLimit.waves` gives the waves."""
    import torch

    settings = ctx.config.bld
    world = ctx.world_of(settings.shard)
    local = rows_per_rank(ctx.config.data.batch_size, ctx.world) * ctx.seq_len
    trained = _trained(ctx)
    dtype = getattr(torch, settings.dtype)
    sizes = {v: variant_training_bytes(v, ctx.spec.hidden_size, local, dtype, world) for v in trained}
    others = library_other_parts(
        ctx.spec,
        trained,
        tokens=local,
        dtype_bytes=ctx.dtype_bytes,
        train_bytes=_dtype_bytes(settings.dtype),
        world=world,
    )
    return sizes, others, bld_wave_limit(settings, others, ctx.usable)


def _library(ctx: _Context, problems: list[str]) -> StagePlan:
    settings, H = ctx.config.bld, ctx.spec.hidden_size
    train_bytes = _dtype_bytes(settings.dtype)
    trained = _trained(ctx)
    rows = None
    try:  # BLD runs each rank's round-robin rows of every batch in one forward: no accumulation
        rows = split_batch(ctx.config.data.batch_size, ctx.world, None, "data.batch_size")
    except ValueError as error:
        problems.append(f"stage library: {error}")
    sizes, others, limit = library_grouping(ctx)
    try:
        waves = limit.waves(sizes)
    except ValueError as error:
        problems.append(f"stage library: {error}")
        waves = [[v] for v in trained]
    wave_bytes = max((sum(sizes[v] for v in wave) for wave in waves), default=0)
    # The plan lists the wave beside the parent's shard and gathered unit, before the activations.
    parts = list(others.items())
    memory = {**dict(parts[:2]), "wave (params, grads, AdamW, activations)": wave_bytes, **dict(parts[2:])}
    budget = settings.token_budget
    parent_flops = len(waves) * budget * forward_flops_per_token(ctx.spec, ctx.seq_len, logits=False)
    variant_flops = sum(3 * budget * block_forward_flops(v.spec, H, ctx.seq_len) for v in trained)
    store_bytes = ctx.dtype_bytes if settings.save_dtype == "parent" else _dtype_bytes(settings.save_dtype)
    library_disk = sum(mixer_params(v.spec, H) * store_bytes for v in trained)
    wave_disk = max((sum(3 * mixer_params(v.spec, H) * train_bytes for v in w) for w in waves), default=0)
    kinds: dict[str, int] = {}
    for v in trained:
        kinds[v.spec.kind] = kinds.get(v.spec.kind, 0) + 1
    by_kind = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    notes = [
        "tokens: one parent pass over bld.token_budget per wave; every variant of a wave trains on it",
        f"disk: library {_gib(library_disk)} + the largest wave's checkpoint {_gib(wave_disk)} "
        "(weights and AdamW moments, removed when the library is done)",
    ]
    notes.append(f"waves: {limit.reason}")
    if rows is not None and rows.largest != rows.smallest:
        notes.append(
            f"data.batch_size {rows.batch} over {rows.world} ranks: {rows.smallest}-{rows.largest} rows per rank "
            f"(round-robin), planned at {rows.largest}"
        )
    if trained:
        notes.append(f"library bytes by kind: {library_bytes_by_axis(trained, H, store_bytes)}")
    work = _library_work(ctx, trained, waves, rows.largest if rows is not None else 1)
    return StagePlan(
        "library",
        f"{len(trained)} variants to train ({by_kind or 'none'}) in {len(waves)} waves "
        f"({_wave_words(limit)}), {_count(budget)} tokens each",
        len(waves) * budget,
        parent_flops + variant_flops,
        memory,
        disk=library_disk + wave_disk,
        notes=notes,
        work=work,
    )


def _library_work(ctx: _Context, trained: list[Variant], waves: list[list[Variant]], rows: int) -> StageWork:
    """BLD's passes (`puzzle.bld.build_library`): per wave and step the parent's blocks up to the wave's last
    and every variant's forward and backward on its rows, then an AdamW step per variant; the held-out nMSE
    of the variants at init and at the end (the parent's blocks again), of the untrained ones once; a cycle
    collection after each wave."""
    settings, H = ctx.config.bld, ctx.spec.hidden_size
    work = ctx.work(settings.dtype)
    steps = settings.token_budget / (ctx.config.data.batch_size * ctx.seq_len)
    held = ctx.held_out_batches() or 0
    held_calls = math.ceil(held / ctx.world) if ctx.world_of(settings.shard) == 1 else held
    eval_rows = ctx.config.data.eval_batch_size
    for wave in waves:
        last = max(v.block_index for v in wave)
        work.forward(ctx.spec.blocks[: last + 1], rows, steps)
        work.forward(ctx.spec.blocks[: last + 1], eval_rows, 2 * held_calls)
        for variant in wave:
            shapes, _ = _mixer_shapes(variant.spec, H)
            work.forward([variant.spec], rows, steps, passes=3, whose="variant")
            work.forward([variant.spec], eval_rows, 2 * held_calls, whose="variant")
            work.optimizer(sum(math.prod(shape) for shape in shapes), len(shapes), steps)
            work.gradients([math.prod(shape) for shape in shapes], steps)
    untrained = [v for listed in (ctx.variants or {}).values() for v in listed if v not in set(trained)]
    if untrained:
        work.forward(ctx.spec.blocks, eval_rows, held_calls)
        work.forward([v.spec for v in untrained], eval_rows, held_calls, whose="variant")
    work.collects += len(waves)
    return work


def library_bytes_by_axis(trained: Sequence[Variant], hidden_size: int, store_bytes: int) -> str:
    """Where a library's bytes go, costliest kind first: each kind's stored bytes and variant count, and the
    space axes (spec fields whose value varies among its variants) with how many values each takes; the
    variant count is their product, so the axis with the most values is the one to thin first."""
    import dataclasses

    by_kind: dict[str, list[Variant]] = {}
    for variant in trained:
        by_kind.setdefault(variant.spec.kind, []).append(variant)
    parts = []
    for kind, listed in by_kind.items():
        size = sum(mixer_params(v.spec, hidden_size) * store_bytes for v in listed)
        values: dict[str, set[Any]] = {}
        for variant in listed:
            for item in dataclasses.fields(variant.spec):
                values.setdefault(item.name, set()).add(repr(getattr(variant.spec, item.name)))
        axes = sorted(((len(v), name) for name, v in values.items() if len(v) > 1), reverse=True)
        over = " x ".join(f"{name} ({count} values)" for count, name in axes)
        parts.append((size, f"{kind} {_gib(size)} ({len(listed)} variants{' over ' + over if over else ''})"))
    return ", ".join(text for _, text in sorted(parts, key=lambda p: -p[0]))


def _wave_words(limit: WaveLimit) -> str:
    """How the plan's library line says what sized its waves."""
    if limit.bytes is None:
        return f"bld.variants_per_wave {'none' if limit.max_variants is None else limit.max_variants}"
    source = "bld.memory_limit_bytes" if limit.oversized == "raise" else "bld.variants_per_wave auto"
    return f"{source} {_gib(limit.bytes)} per rank"


def _scores(ctx: _Context) -> StagePlan:
    settings, spec, H = ctx.config.scoring, ctx.spec, ctx.spec.hidden_size
    world = ctx.world_of(settings.shard)
    variants = sorted(
        (v for listed in (ctx.variants or {}).values() for v in listed), key=lambda v: (v.block_index, v.id)
    )
    size = settings.variants_per_wave or max(1, len(variants))
    waves = [variants[i : i + size] for i in range(0, len(variants), size)]
    batch = ctx.config.data.eval_batch_size
    # Whole batches per rank, a round-robin share of them, sharded or not (`puzzle.score`).
    local = batch * ctx.seq_len
    parent = ctx.parent(settings.shard)
    p = ctx.dtype_bytes

    def wave_bytes(wave: list[Variant]) -> float:
        running = [v for v in wave if v.spec != spec.blocks[v.block_index]]
        held = sum(mixer_shard_params(v.spec, H, world) * p for v in running)
        blocks = len({v.block_index for v in wave})
        return held + (blocks + len(running)) * local * H * p

    largest_variant = max((mixer_params(v.spec, H) * p for v in variants), default=0)
    memory = {
        "parent shard": parent.sharded,
        "gathered unit": max(parent.largest_unit, largest_variant) if world > 1 else 0,
        "whole lm_head": spec.vocab_size * H * p if world > 1 else 0,
        "wave (variants, kept inputs, final hidden states)": max(map(wave_bytes, waves), default=0),
        "logits chunks": SCORE_LOGIT_BUFFERS * FP32 * local * settings.vocab_chunk + local * H * p,
        "block activations": ctx.largest_block_activations(local),
    }
    tokens = ctx.held_out_tokens()
    flops, notes = 0.0, []
    if tokens is None:
        notes.append(
            "data.held_out_tokens is null: the whole held-out split, whose size the plan cannot know"
        )
    else:
        head = 2.0 * H * spec.vocab_size
        per_wave = forward_flops_per_token(spec, ctx.seq_len) + head
        suffix = [
            sum(block_forward_flops(b, H, ctx.seq_len) for b in spec.blocks[i + 1 :])
            for i in range(len(spec.blocks))
        ]
        per_variant = sum(
            block_forward_flops(v.spec, H, ctx.seq_len) + suffix[v.block_index] + head
            for v in variants
            if v.spec != spec.blocks[v.block_index]
        )
        flops = tokens * (len(waves) * per_wave + per_variant)
    work = ctx.work()
    held = ctx.held_out_batches() or 0
    calls = held if world > 1 else math.ceil(held / ctx.world)
    # `puzzle.score`'s chunk buffers: 2 for the parent's pass (`_Parent.of`), 4 for a variant's KL.
    parent_buffers = {"chunk": settings.vocab_chunk, "fresh": 2}
    variant_buffers = {"chunk": settings.vocab_chunk, "fresh": SCORE_LOGIT_BUFFERS}
    for wave in waves:  # the parent's pass over the held-out batches, its logits the reference
        work.forward(spec.blocks, batch, calls)
        # Its logits twice (`puzzle.score`: the log-normaliser, then each chunk's p beside the children's).
        work.head(
            spec.vocab_size, batch, calls, buffers=SCORE_LOGIT_BUFFERS, matmuls=2, exps=2, **parent_buffers
        )
        own = [v for v in wave if v.spec == spec.blocks[v.block_index]]
        if own and calls:  # the wave's check: its first parent variant through the suffix, on the first batch
            first = min(own, key=lambda v: (v.block_index, v.id))
            work.forward(spec.blocks[first.block_index :], batch, 1)
            work.head(spec.vocab_size, batch, 1, buffers=SCORE_LOGIT_BUFFERS, **variant_buffers)
    for v in variants:
        if v.spec != spec.blocks[v.block_index]:
            work.forward([v.spec], batch, calls, whose="variant")
            work.forward(spec.blocks[v.block_index + 1 :], batch, calls)
            work.head(spec.vocab_size, batch, calls, buffers=SCORE_LOGIT_BUFFERS, **variant_buffers)
    return StagePlan(
        "scores",
        f"{len(variants)} variants in {len(waves)} waves of up to {size} (scoring.variants_per_wave), "
        f"held-out batches of {batch} x {ctx.seq_len}",
        tokens,
        flops,
        memory,
        disk=1024.0 * len(variants),
        notes=[*notes, "a variant costs its block, the parent's blocks after it and one lm_head pass"],
        work=work,
    )


def _solves(ctx: _Context) -> int:
    config = ctx.config
    return sum(len(config.round_limits(r)) for r in range(config.rounds.count)) * config.search.solutions


def _rerank_candidates(ctx: _Context) -> tuple[int, int] | None:
    """(candidates per search at most, tokens of each one's short GKD) of `search.rerank: {by: short_gkd}`,
    or None without it: the MIP's k best, one child per context round, greedy's and uniform pruning's."""
    from puzzle.rerank import gkd_tokens, short_gkd_settings

    reranking = ctx.config.search.reranking()
    if reranking is None or reranking.by != "short_gkd":
        return None
    short = short_gkd_settings(ctx.config.gkd, reranking.tokens, ctx.seq_len)
    tokens = gkd_tokens(short, ctx.seq_len)
    per_search = reranking.candidates + ctx.config.search.context_rounds + 2
    return per_search, 0 if tokens is None else tokens


def _solutions(ctx: _Context) -> StagePlan:
    config = ctx.config
    searches = sum(len(config.round_limits(r)) for r in range(config.rounds.count))
    solves = _solves(ctx)
    limit = config.search.solver.time_limit_s
    seconds = None if limit is None else float(limit) * searches
    reranked = _rerank_candidates(ctx)
    if reranked is None:
        return StagePlan(
            "solutions",
            f"{solves} architecture(s) from the MIP search (on the CPU of rank 0)",
            None,
            0.0,
            {},
            disk=0.0,
            notes=["no GPU memory; time bounded by search.solver.time_limit_s per solve"],
            seconds=seconds,
        )
    per_search, tokens = reranked
    children = searches * per_search
    gkd = _gkd_cost(ctx, [], children, tokens)  # a problem of GKD's settings is the distill stage's to report
    return StagePlan(
        "solutions",
        f"{solves} architecture(s) from the MIP search (on the CPU of rank 0), then a short GKD of each of "
        f"up to {per_search} candidates per search ({_count(tokens)} tokens each, {children} in all)",
        gkd.tokens,
        gkd.flops,
        gkd.memory,
        # One candidate at a time: its checkpoint (GKD's disk per child) and its student file, which goes
        # once the candidate's figures are written (`puzzle.run.rerank`).
        disk=gkd.disk / children * 4 / 3,
        host=gkd.host,
        notes=[
            "search.rerank by short_gkd: candidates = the MIP's k best + one per context round + refilled "
            "greedy's + uniform pruning's (an upper bound: identical children are distilled once); each short "
            "GKD costs what a GKD of the distill stage costs per token, with its memory",
            *gkd.notes,
            "plus the search: time bounded by search.solver.time_limit_s per solve",
        ],
    )


def _assemble(ctx: _Context) -> StagePlan:
    spec, H = ctx.spec, ctx.spec.hidden_size
    solutions = _solves(ctx)
    # The measured KL runs whole held-out batches: every batch on every rank when sharded
    # (`puzzle.compare.compare_models`), a round-robin share of them otherwise.
    local = ctx.config.data.eval_batch_size * ctx.seq_len
    parent, child = ctx.parent(), ctx.child_fraction
    memory = {
        "parent shard": parent.sharded,
        "child shard": child * parent.sharded,
        "gathered unit": parent.largest_unit,
        "logits chunks": SCORE_LOGIT_BUFFERS * FP32 * local * ctx.config.scoring.vocab_chunk,
        "hidden states": 2 * local * H * ctx.dtype_bytes,
        "block activations": ctx.largest_block_activations(local),
    }
    tokens = ctx.held_out_tokens()
    flops = 0.0 if tokens is None else solutions * tokens * 2 * forward_flops_per_token(spec, ctx.seq_len)
    # Each child's measured KL: the parent's and the child's passes over the held-out batches (the child
    # priced as the parent scaled by its share), a KL head on both.
    work = ctx.work()
    held = ctx.held_out_batches() or 0
    calls, rows = solutions * math.ceil(held / ctx.world), ctx.config.data.eval_batch_size
    work.forward(spec.blocks, rows, calls)
    work.forward(spec.blocks, rows, calls * child, whose="child")
    # compare_models makes 4 chunk buffers a batch: 2 for each of its 2 head passes.
    work.head(
        spec.vocab_size,
        rows,
        2 * calls,
        buffers=SCORE_LOGIT_BUFFERS,
        chunk=ctx.config.scoring.vocab_chunk,
        fresh=2,
    )
    return StagePlan(
        "assemble",
        f"{solutions} child(ren) built from the library, measured KL on the held-out tokens",
        None if tokens is None else solutions * tokens,
        flops,
        memory,
        notes=[_child_note(child)],
        work=work,
    )


def _distill(ctx: _Context, problems: list[str]) -> StagePlan:
    settings = ctx.config.gkd
    tokens = settings.token_budget
    if settings.steps is not None:
        step_tokens = settings.batch_size * ctx.seq_len
        tokens = settings.steps * step_tokens if tokens is None else min(tokens, settings.steps * step_tokens)
    return _gkd_cost(ctx, problems, _solves(ctx), tokens)


def _gkd_cost(ctx: _Context, problems: list[str], solutions: int, tokens: int) -> StagePlan:
    """The distill stage's plan: GKD of `solutions` children for `tokens` each (the short GKDs of
    `search.rerank` cost the same per token and hold the same memory)."""
    settings, spec, H = ctx.config.gkd, ctx.spec, ctx.spec.hidden_size
    world = ctx.world_of(settings.shard)
    train_bytes = _dtype_bytes(settings.dtype)
    try:
        split = settings.micro_batches(ctx.world)
        words = split.describe()
        micro = split.micro
    except ValueError as error:
        problems.append(f"stage distill: {error}")
        micro = rows_per_rank(settings.batch_size, ctx.world)
        words = f"{settings.batch_size} sequences cannot be shared by {ctx.world} ranks"
    local = micro * ctx.seq_len
    child = ctx.child_fraction
    student = parent_bytes(spec, train_bytes, world)
    student = ParentBytes(int(child * student.sharded), int(child * student.whole), student.largest_unit)
    teacher = ctx.parent(settings.shard)
    saved = sum(block_activation_bytes(b, H, local, train_bytes) for b in spec.blocks)
    # Per-block checkpointing keeps each student block's input (training dtype) and the teacher's residual
    # stream after the block (parent dtype, for the cosine term, which is recomputed with the block); one
    # block's activations are recomputed at a time in the backward.
    kept_inputs = len(spec.blocks) * local * H * (train_bytes + ctx.dtype_bytes)
    recomputed = ctx.largest_block_activations(local, train_bytes)
    if settings.activation_checkpointing:
        activations = {"saved block inputs": kept_inputs, "recomputed block activations": recomputed}
    else:
        activations = {"saved activations": saved}
    table = spec.vocab_size * H  # elements of the embeddings, and of the lm_head
    memory = {
        "teacher shard": teacher.sharded,
        "student shard": student.sharded,
        "student grads": student.sharded,
        "AdamW m and v": 2 * student.sharded,
        "gathered unit": max(teacher.largest_unit, student.largest_unit),
        **_gkd_head(spec, table, world, train_bytes, ctx.dtype_bytes),
        **activations,
        "logits chunks": GKD_LOGIT_BUFFERS * FP32 * local * settings.vocab_chunk
        + 2 * local * H * train_bytes,
    }
    step_tokens = settings.batch_size * ctx.seq_len
    student_passes = 4 if settings.activation_checkpointing else 3  # checkpointing runs each block again
    flops = solutions * tokens * (student_passes * child + 1) * forward_flops_per_token(spec, ctx.seq_len)
    checkpoint = 3 * child * model_params(spec) * train_bytes
    work = _gkd_work(ctx, solutions, tokens, micro, student_passes)
    return StagePlan(
        "distill",
        f"{solutions} child(ren) x {_count(tokens)} tokens, {math.ceil(tokens / step_tokens)} steps of "
        f"{settings.batch_size} x {ctx.seq_len} ({words})",
        solutions * tokens,
        flops,
        memory,
        disk=solutions * checkpoint,
        # keep_best: a host copy of this rank's shards of the best evaluation's weights (puzzle.gkd._snapshot).
        host={"best weights (host copy)": student.sharded if settings.keep_best else 0},
        work=work,
        notes=[
            _child_note(child),
            f"AdamW keeps m and v in the training dtype ({settings.dtype}); activations are the parent's "
            "(an upper bound); "
            + (
                "gkd.activation_checkpointing keeps each block's input (and the teacher's stream after it) "
                f"and recomputes one block's activations at a time: without it they would be {_gib(saved)}, "
                "all saved for the backward"
                if settings.activation_checkpointing
                else f"all saved for the backward (gkd.activation_checkpointing would make them about "
                f"{_gib(kept_inputs + recomputed)}: each block's input, one block's activations at a time)"
            ),
            f"FLOPs: student forward + backward ({student_passes}x with "
            f"activation_checkpointing={settings.activation_checkpointing}, scaled by the child's share) and "
            "teacher forward (1x) per token; evaluations excluded",
        ],
    )


def _gkd_work(ctx: _Context, solutions: int, tokens: int, micro: int, student_passes: int) -> StageWork:
    """GKD's passes per child (`puzzle.gkd.distill`): per step and micro-batch the teacher's forward and the
    student's forward and backward (`student_passes` forwards' worth, the child priced as the parent scaled
    by its share), the KL head forward and backward, an AdamW step of the student; its held-out evaluations
    (before the first step, every gkd.eval_every steps and after the last), a teacher and a student pass
    with their heads."""
    settings, spec = ctx.config.gkd, ctx.spec
    work = ctx.work(settings.dtype)
    steps = math.floor(tokens / (settings.batch_size * ctx.seq_len))
    micros = steps * math.ceil(rows_per_rank(settings.batch_size, ctx.world) / micro)
    child = ctx.child_fraction
    work.forward(spec.blocks, micro, solutions * micros)  # the teacher
    work.forward(spec.blocks, micro, solutions * micros * child, passes=student_passes, whose="child")
    # puzzle.logits.head_pass with gradients: both models' logits twice, g W and g^T h; 4 exps.
    # Its chunk buffers, made once a call (the lm_head's gradient it makes is counted with the parameters').
    buffers = {"chunk": settings.vocab_chunk, "fresh": HEAD_PASS_BUFFERS}
    work.head(
        spec.vocab_size,
        micro,
        solutions * micros,
        passes=3,
        buffers=GKD_LOGIT_BUFFERS,
        matmuls=6,
        exps=4,
        **buffers,
    )
    elements = _parameter_elements(spec)
    work.optimizer(model_params(spec) * child, len(elements) * child, solutions * steps)
    work.gradients(elements, solutions * steps, micros / max(steps, 1), share=child)
    evaluations = 1 + (steps // settings.eval_every if settings.eval_every else 0)
    if not settings.eval_every or steps % settings.eval_every:
        evaluations += 1  # the last step's
    held = ctx.held_out_batches() or 0
    eval_rows = min(micro, ctx.config.data.eval_batch_size)
    calls = solutions * evaluations * held * math.ceil(ctx.config.data.eval_batch_size / eval_rows)
    calls = calls if ctx.world_of(settings.shard) > 1 else math.ceil(calls / ctx.world)
    work.forward(spec.blocks, eval_rows, calls)
    work.forward(spec.blocks, eval_rows, calls * child, whose="child")
    # head_pass without gradients: both models' logits twice; the log-normalisers' exps and p's.
    work.head(
        spec.vocab_size, eval_rows, calls, passes=2, buffers=GKD_LOGIT_BUFFERS, matmuls=4, exps=3, **buffers
    )
    return work


def _parameter_elements(spec: ModelSpec) -> list[int]:
    """The element count of each parameter tensor of a model of `spec`: every mixer's, its norm, the
    embeddings, the final norm and the lm_head (unless tied)."""
    H, table = spec.hidden_size, spec.vocab_size * spec.hidden_size
    elements = [table, H] + ([] if spec.tie_embeddings else [table])
    for block in spec.blocks:
        elements += [math.prod(shape) for shape in _mixer_shapes(block, H)[0]] + [H]
    return elements


def _gkd_head(
    spec: ModelSpec, table: int, world: int, train_bytes: int, parent_bytes: int
) -> dict[str, float]:
    """What GKD's head holds whole on a rank beyond the shards (`puzzle.gkd._Distiller`, `puzzle.logits`).

    Sharded, the student's root unit (embeddings and lm_head, one table when tied) is gathered for the whole
    forward and backward, the teacher's lm_head around the loss, and the lm_head's gradient [V, H] is made
    whole (`head_pass`, scaled in place in the backward) before its reduce-scatter."""
    if world == 1:
        return {}
    root = (1 if spec.tie_embeddings else 2) * table * train_bytes
    return {
        "whole root unit (embeddings, lm_head)": root,
        "whole teacher lm_head": table * parent_bytes,
        "whole head gradient": table * train_bytes,
    }


def _export(ctx: _Context) -> StagePlan:
    solutions, child = _solves(ctx), ctx.child_fraction
    parent = ctx.parent()
    return StagePlan(
        "export",
        f"{solutions} checkpoint(s) written tensor by tensor",
        None,
        0.0,
        {
            "parent shard": parent.sharded,
            "child shard": child * parent.sharded,
            "gathered unit": parent.largest_unit,
        },
        disk=solutions * child * parent.whole,
        notes=[
            _child_note(child),
            "the child is assembled again from the parent and the library, its distilled weights loaded into "
            "its shards, then streamed out one tensor at a time: every rank gathers each tensor in turn and "
            "rank 0 writes it (no rank holds the whole child)",
        ],
    )


def _eval(ctx: _Context) -> StagePlan | None:
    """lm-eval on the parent and each child, assembled and distilled (`eval.tasks`): each task's requests
    counted and tokenised as lm-eval builds them (`puzzle.eval.request_tokens`), one forward each; a child
    priced at the child's share of the parent's forward. None without eval tasks."""
    settings = ctx.config.eval
    if not settings.tasks:
        return None
    solutions = _solves(ctx)
    models = 1 + 2 * solutions * ctx.child_fraction  # in parent forwards
    notes = [
        f"the parent and {solutions} child(ren) twice (assembled, distilled): {models:.2f} parent forwards per "
        "request; one process's work: every rank runs every request (lm-eval sees one process)"
    ]
    try:
        from puzzle.data import load_tokenizer
        from puzzle.eval import request_tokens

        counts = request_tokens(
            list(settings.tasks),
            load_tokenizer(ctx.config.tokenizer_dir),
            limit=settings.limit,
            include_path=settings.include_path,
        )
    except Exception as error:  # no lm-eval, no tokenizer files: the rest of the plan still stands
        return StagePlan(
            "eval",
            f"tasks {', '.join(settings.tasks)}: not priced ({' '.join(str(error).split())[:200]})",
            None,
            0.0,
            {},
            notes=notes,
        )
    flops, tokens, parts = 0.0, 0, []
    for task, lengths in counts.items():
        if isinstance(lengths, str):
            parts.append(f"{task}: not priced ({lengths})")
            continue
        task_flops = models * sum(n * forward_flops_per_token(ctx.spec, max(n, 1)) for n in lengths)
        flops += task_flops
        tokens += sum(lengths)
        parts.append(f"{task}: {len(lengths)} requests, {sum(lengths):,} tokens, {task_flops:.3g} FLOPs")
    notes.insert(0, "; ".join(parts))
    longest = max((max(v) for v in counts.values() if not isinstance(v, str) and v), default=0)
    memory = {
        "parent (whole, unsharded)": ctx.parent().whole,
        "logits": FP32 * settings.batch_size * longest * ctx.spec.vocab_size,
    }
    if ctx.config.gkd.select_task is not None:
        notes.append(
            f"gkd.select_by {ctx.config.gkd.select_by}: GKD also runs that task on the student at each of its "
            "evaluations (not counted here)"
        )
    return StagePlan(
        "eval",
        f"tasks {', '.join(settings.tasks)} on {1 + 2 * solutions} models (limit {settings.limit})",
        int(models * tokens),
        flops,
        memory,
        notes=notes,
    )


def _child_note(fraction: float) -> str:
    if fraction < 1:
        return (
            f"the child is planned at {fraction:.0%} of the parent's bytes, the `params` budget (its "
            "architecture is known after the search)"
        )
    return "the child is planned as the parent (an upper bound: its architecture is known after the search)"


def plan_run(
    config: Any,
    spec: ModelSpec,
    gpus: int,
    hardware: HardwareProfile,
    *,
    memory_fraction: float | None = None,
    efficiency: float = DEFAULT_EFFICIENCY,
    checkpoint: dict[str, Any] | None = None,
    gpus_per_node: int | None = None,
) -> Plan:
    """The plan of `config` (a RunConfig) for the parent `spec` on `gpus` ranks of `hardware`.

    `memory_fraction`: the usable share of each GPU (default: the config's hardware.memory_fraction).
    `checkpoint`: the parent's config.json, for the dtype of `parent.dtype: auto`. `gpus_per_node`: the
    ranks of one node (None: one node of `gpus`), which a stage with `shard: hsdp` shards each unit over.
    """
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, found {gpus}")
    if gpus_per_node is not None and (gpus_per_node < 1 or gpus % gpus_per_node):
        raise ValueError(
            f"{gpus} GPUs are not a whole number of nodes of {gpus_per_node}: give the same GPUs on every node"
        )
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], found {efficiency}")
    fraction = config.hardware.memory_fraction if memory_fraction is None else memory_fraction
    problems: list[str] = []
    unknown = None
    try:
        variants = config.search_space().all_variants(spec)
    except ValueError as error:  # widths from importance profiles: known only after importance
        variants, unknown = (
            None,
            f"the variants cannot be listed before importance runs ({error}): not planned",
        )
    usable = hardware.memory_bytes * fraction
    dtype_bytes = parent_dtype_bytes(config.parent.dtype, checkpoint)
    ctx = _Context(config, spec, gpus, dtype_bytes, variants, usable, gpus_per_node)
    ctx, wave_note = _resolve_auto_wave(ctx, usable)
    stages = [
        _importance(ctx),
        _library(ctx, problems),
        _scores(ctx),
        _solutions(ctx),
        _assemble(ctx),
        _distill(ctx, problems),
        _export(ctx),
    ]
    evaluation = _eval(ctx)
    if evaluation is not None:
        stages.append(evaluation)
    if wave_note is not None:
        stages[2].notes.append(wave_note)
    if unknown is not None:
        stages[1].notes.append(unknown)
        stages[2].notes.append(unknown)
    rate = gpus * hardware.flops_per_s("bf16") * efficiency
    for stage in stages:
        if stage.seconds is None and hardware.eager and stage.work is not None:
            stage.seconds = stage.work.seconds(hardware)  # this CPU: the calibrated cost model, pass by pass
        elif stage.seconds is None and stage.flops:
            stage.seconds = stage.flops / rate
    if config.rounds.count > 1:
        stages[0].notes.append(
            f"rounds.count {config.rounds.count}: every stage but the search runs once per round"
        )
    if gpus_per_node is not None and gpus_per_node < gpus:
        nodes = gpus // gpus_per_node
        for stage, settings in zip(stages, (config.importance, config.bld, config.scoring)):
            if settings.shard == "hsdp":
                stage.notes.append(_hsdp_note(nodes, gpus_per_node))
        if config.gkd.shard == "hsdp":
            stages[5].notes.append(_hsdp_note(nodes, gpus_per_node))
    return Plan(spec, hardware, gpus, efficiency, fraction, stages, problems, gpus_per_node)


def _hsdp_note(nodes: int, gpus_per_node: int) -> str:
    return (
        f"shard hsdp: each unit sharded over the {gpus_per_node} ranks of a node and replicated across the "
        f"{nodes} nodes (memory per rank as on {gpus_per_node} ranks; all-gathers stay inside a node)"
    )


def plan_config(
    config: Any, gpus: int, hardware: str | HardwareProfile | None = None, **options: Any
) -> Plan:
    """`plan_run` for a loaded RunConfig, reading only the parent's config.json (no weight). `hardware`
    (default: the config's hardware.profile) is each rank's GPU: of an `NxNAME` name, NAME (`plan_hardware`)."""
    from puzzle import nemotron_h

    path = config.parent.path
    checkpoint = nemotron_h.read_config(path)
    spec = nemotron_h.spec_from_config(checkpoint, str(path / nemotron_h.CONFIG_NAME))
    _, profile = plan_hardware(hardware if hardware is not None else config.hardware.profile, gpus)
    return plan_run(config, spec, gpus, profile, checkpoint=checkpoint, **options)


def plan_hardware(name: str | HardwareProfile, gpus: int | None = None) -> tuple[int, HardwareProfile]:
    """(ranks, one rank's GPU) of hardware `name` for a plan: `NxNAME` (8xb200, as `puzzle costs` writes a
    server) is N ranks of one NAME each, not one rank with N GPUs' memory; `gpus`, when given, is the
    number of ranks (default: N, else 1). A profile passes through as one rank's."""
    from puzzle.cost.hardware import get_hardware, split_gpus

    if isinstance(name, HardwareProfile):
        return gpus or 1, name
    count, single = split_gpus(name)
    return gpus or count, get_hardware(single)


def node_from_env() -> int | None:
    """The ranks per node torchrun gives this process (LOCAL_WORLD_SIZE), None when it is not set."""
    import os

    try:
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        return None


def world_from_env() -> int:
    """The world size torchrun gives this process (WORLD_SIZE), before the process group exists; 1 alone."""
    import os

    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def run_hardware(config: Any) -> HardwareProfile:
    """The device `puzzle run` checks its plan against. With CUDA present: this process's GPU, its own memory
    (the configured profile's speeds; the serving profile in `hardware` need not be the GPUs the run trains
    on). Without CUDA: the configured profile stands in for the GPUs (a CPU run is planned as if there);
    "this-machine" is then the default profile, so that nothing is calibrated before the run starts."""
    import dataclasses

    import torch

    from puzzle.cost.hardware import DEFAULT_HARDWARE, hardware_key

    name = config.hardware.profile
    if not isinstance(name, HardwareProfile) and hardware_key(name) == "this-machine":
        name = DEFAULT_HARDWARE
    _, profile = plan_hardware(name)  # one rank's GPU: b200 of a serving profile 8xb200
    if torch.cuda.is_available():
        device = torch.cuda.get_device_properties(torch.cuda.current_device())
        profile = dataclasses.replace(profile, name=device.name, memory_bytes=int(device.total_memory))
    return profile


def run_misfits(config: Any, world: int | None = None) -> list[str]:
    """What `puzzle run` refuses before any work: each stage of the plan of `config` on `world` ranks (default:
    WORLD_SIZE, in nodes of LOCAL_WORLD_SIZE) of `run_hardware` that does not fit, one line each (empty:
    everything fits)."""
    world = world_from_env() if world is None else world
    node = node_from_env()
    node = node if node is not None and node < world and world % node == 0 else None
    plan = plan_config(config, world, run_hardware(config), gpus_per_node=node)
    free, written, where = disk_room(Path(config.run_dir))
    return plan.misfits() + plan.disk_misfits(free, where, written)


def disk_room(run_dir: Path) -> tuple[int, int, str]:
    """(free bytes on the file system that holds `run_dir`, bytes already under `run_dir`, where): a resumed
    run has already written part of what its plan counts, so only the rest must be free."""
    import shutil

    from puzzle.files import existing_ancestor, tree_bytes

    existing = existing_ancestor(run_dir.absolute())
    return shutil.disk_usage(existing).free, tree_bytes(run_dir), f"at {existing} (run_dir {run_dir})"


# ------------------------------------------------------------------------- scoring's wave size ("auto")


@dataclass(frozen=True)
class WaveSize:
    """Scoring's `variants_per_wave` chosen from the plan: `size` variants per wave, and why (`reason`)."""

    size: int
    reason: str


class _WithScoring:
    """A run config as `_scores` reads it, with another `scoring` section (the rest read through)."""

    def __init__(self, config: Any, scoring: Any) -> None:
        self._config, self.scoring = config, scoring

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _scores_peak(ctx: _Context, size: int) -> float:
    """Scoring's planned peak per rank (`_scores`) with waves of `size` variants."""
    import dataclasses

    scoring = dataclasses.replace(ctx.config.scoring, variants_per_wave=size)
    return _scores(dataclasses.replace(ctx, config=_WithScoring(ctx.config, scoring))).peak


def auto_wave_size(ctx: _Context, limit: float) -> WaveSize:
    """The most variants per wave whose planned scoring peak per rank (`_scores`: the parent's shard, the
    gathered unit and lm_head, the wave's variants and kept hidden states, the logits chunks, ...) fits in
    `limit` bytes; 1 when not even one fits (the plan check reports that stage). Fewer, larger waves run the
    parent fewer times; the scores are the same whatever the wave size."""
    variants = [v for listed in (ctx.variants or {}).values() for v in listed]
    if not variants:
        return WaveSize(1, "no variants to score")
    # Bisection, about log2(variants) plans (each plan walks every variant: trying every size took most of a
    # minute for Super's 751). The peak is not strictly monotone in the size (how the sorted variants fall
    # into waves moves the largest wave), so the size found fits and one more does not, but a larger size
    # further on might: a wave a little smaller than the most that fits, never one that does not fit.
    low, high = 1, len(variants)
    if _scores_peak(ctx, high) <= limit:
        low = high
    else:
        high -= 1
    while low < high:
        middle = (low + high + 1) // 2
        if _scores_peak(ctx, middle) <= limit:
            low = middle
        else:
            high = middle - 1
    peak = _scores_peak(ctx, low)
    fits = "fits" if peak <= limit else "does not fit even one variant per wave in"
    reason = (
        f"{low} of {len(variants)} variants per wave: the planned peak per rank {_gib(peak)} {fits} "
        f"{_gib(limit)}"
    )
    if low < len(variants):
        reason += f"; {low + 1} per wave would need {_gib(_scores_peak(ctx, low + 1))}"
    return WaveSize(low, reason)


def scoring_wave_size(
    config: Any,
    spec: ModelSpec,
    world: int,
    memory_bytes: float,
    *,
    variants: dict[int, list[Variant]] | None = None,
    checkpoint: dict[str, Any] | None = None,
) -> WaveSize:
    """`auto_wave_size` for a run config (a RunConfig) on `world` ranks of `memory_bytes` each (the usable
    share `config.hardware.memory_fraction` of it is the limit). `variants`: those to score (the library's);
    default: every variant of the config's space."""
    if variants is None:
        variants = config.search_space().all_variants(spec)
    dtype_bytes = parent_dtype_bytes(config.parent.dtype, checkpoint)
    ctx = _Context(config, spec, world, dtype_bytes, variants, node=node_from_env())
    limit = memory_bytes * config.hardware.memory_fraction
    found = auto_wave_size(ctx, limit)
    where = f"{config.hardware.memory_fraction:g} x {_gib(memory_bytes)} per rank, {world} rank(s)"
    return WaveSize(found.size, f"{found.reason} ({where})")


def bld_waves(
    config: Any,
    spec: ModelSpec,
    world: int,
    memory_bytes: float,
    *,
    checkpoint: dict[str, Any] | None = None,
) -> tuple[list[list[Variant]], WaveLimit]:
    """The waves `puzzle plan` gives BLD for a run config on `world` ranks of `memory_bytes` each (the usable
    share `config.hardware.memory_fraction` of it sizes auto's waves), and the limit that made them: what
    `puzzle.bld.build_library` trains when the run's device has that memory."""
    variants = config.search_space().all_variants(spec)
    usable = memory_bytes * config.hardware.memory_fraction
    dtype_bytes = parent_dtype_bytes(config.parent.dtype, checkpoint)
    sizes, _, limit = library_grouping(
        _Context(config, spec, world, dtype_bytes, variants, usable, node_from_env())
    )
    return limit.waves(sizes), limit


def scoring_wave_size_for(
    spec: ModelSpec,
    variants: list[Variant],
    scoring: Any,
    *,
    batch: int,
    seq_len: int,
    dtype_bytes: int,
    world: int,
    memory_bytes: float,
) -> WaveSize:
    """`auto_wave_size` without a run config (`puzzle.score.score_variants` called directly): scoring
    `variants` with ScoreSettings `scoring` on held-out batches of `batch` x `seq_len`, a parent of
    `dtype_bytes` per parameter, over `world` ranks with `memory_bytes` usable each."""
    from types import SimpleNamespace

    config = SimpleNamespace(
        scoring=scoring, data=SimpleNamespace(eval_batch_size=batch, seq_len=seq_len, held_out_tokens=None)
    )
    by_block: dict[int, list[Variant]] = {}
    for variant in variants:
        by_block.setdefault(variant.block_index, []).append(variant)
    return auto_wave_size(_Context(config, spec, world, dtype_bytes, by_block), memory_bytes)


def device_memory_bytes() -> tuple[int, str]:
    """(bytes, what) of the memory one rank computes in: this process's CUDA device, else its share of the
    host's RAM (the node's ranks, `shard.node_size`, share it on a CPU run)."""
    import os

    import torch

    from puzzle.shard import node_size

    if torch.cuda.is_available():
        device = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(device.total_memory), f"{device.name} memory"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks = max(1, node_size())
    return host // ranks, "host memory" if ranks == 1 else f"host memory / {ranks} ranks"


def run_memory(config: Any) -> tuple[int, str]:
    """(bytes, what) that a run's automatic waves (BLD's and scoring's) are sized against, per rank: with CUDA, the GPU's
    (`run_hardware`); on the CPU, this machine's memory (`device_memory_bytes`), not the configured profile's
    GPU, which `puzzle run`'s plan check stands in for the GPUs a CPU run is planned for."""
    import torch

    if torch.cuda.is_available():
        profile = run_hardware(config)
        return profile.memory_bytes, profile.name
    return device_memory_bytes()


def _resolve_auto_wave(ctx: _Context, limit: float) -> tuple[_Context, str | None]:
    """`ctx` with scoring's `variants_per_wave: auto` replaced by `auto_wave_size` against `limit` (all the
    variants in one wave when they are not known yet), and a note saying what was chosen; as it is else."""
    import dataclasses

    scoring = ctx.config.scoring
    if scoring.variants_per_wave != "auto":
        return ctx, None
    if ctx.variants is None:
        size, note = (
            None,
            "scoring.variants_per_wave auto: chosen when the variants are known (after importance)",
        )
    else:
        found = auto_wave_size(ctx, limit)
        size, note = found.size, f"scoring.variants_per_wave auto: {found.reason}"
    scoring = dataclasses.replace(scoring, variants_per_wave=size)
    return dataclasses.replace(ctx, config=_WithScoring(ctx.config, scoring)), note
