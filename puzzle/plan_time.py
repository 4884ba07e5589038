"""The planned time of a stage on an eager profile (this CPU): its passes priced by the calibrated cost model.

On a GPU profile `puzzle.plan` prices a stage as its FLOPs at an assumed share of the peak (training at scale
is compute-bound). On "this-machine" (`HardwareProfile.eager`: puzzle.blocks' plain-torch path, op by op)
small models are not: per-op dispatch, elementwise traffic and Python's cycle collector between stages cost
as much as the matmuls. So there a stage is priced as what the run does, counted pass by pass
(`StageWork`), each block call by the roofline cost model the search uses (`puzzle.cost.roofline`, eager:
matmuls at the calibrated rate, counted ops x the calibrated dispatch overhead, activation traffic at the
calibrated streaming bandwidth, `HardwareProfile.stream_bandwidth`), with no assumed efficiency:

- a forward of blocks over a batch: each block's `prefill_work` at that batch's tokens; a training pass is
  forward + backward, 3 forwards' worth (the backward runs two matmuls per forward matmul and about twice
  its elementwise ops), 4 with activation checkpointing (the forward runs again);
- an lm_head pass: 2 H V FLOPs per token plus `buffers` fp32 [tokens, V] tensors written and read back
  (the chunked softmax / KL of `puzzle.logits`);
- an AdamW step: `ADAMW_OPS` ops per parameter tensor and `ADAMW_PASSES` passes over its elements
  (torch's single-tensor AdamW with weight decay, the one it runs on the CPU, and gradient clipping);
- a cycle collection (`puzzle.shard.free_dropped_units`: before and after every stage record, after every
  BLD wave) at the calibrated `HardwareProfile.collect_s`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from puzzle.cost.hardware import HardwareProfile
from puzzle.cost.roofline import Scenario, prefill_work, roofline_seconds
from puzzle.spec import BlockSpec

# torch.optim.AdamW's single-tensor step with weight decay: param.mul_, exp_avg.lerp_, exp_avg_sq.mul_ and
# addcmul_, the step count's add_, sqrt, div, add_ (denominator), param.addcdiv_ (9 ops), plus clip_grad_norm_'s
# norm and scale and zero_grad: 12 ops per tensor. Their elementwise passes read or write about 22 tensors of
# the parameter's size.
ADAMW_OPS = 12
ADAMW_PASSES = 22
COMPUTE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class StageWork:
    """What a stage runs, pass by pass, for `seconds` on an eager profile (`seq_len` tokens a sequence,
    `dtype` the compute dtype's torch name)."""

    hidden_size: int
    seq_len: int
    dtype: str = "float32"
    # (block, sequences per call, calls, forward-equivalents per call, whose: "parent", "variant" or "child")
    blocks: list[tuple[BlockSpec, int, float, float, str]] = field(default_factory=list)
    # (vocabulary, tokens per call, calls, forward-equivalents, fp32 [tokens, V] buffers per pass)
    heads: list[tuple[int, int, float, float, int]] = field(default_factory=list)
    # (parameter elements, parameter tensors, steps)
    steps: list[tuple[float, float, float]] = field(default_factory=list)
    collects: float = 0.0

    def forward(
        self,
        blocks: Iterable[BlockSpec],
        rows: int,
        calls: float,
        passes: float = 1.0,
        whose: str = "parent",
    ) -> None:
        """`calls` calls of each of `blocks` over `rows` sequences, each `passes` forwards' worth; `whose`
        blocks they are ("child": a child's, unknown before the search, planned as the parent's blocks x
        its share, an upper bound)."""
        self.blocks += [(block, rows, calls, passes, whose) for block in blocks]

    def head(self, vocab: int, rows: int, calls: float, passes: float = 1.0, buffers: int = 4) -> None:
        """`calls` lm_head passes over `rows` sequences with `buffers` fp32 [tokens, V] tensors each."""
        self.heads.append((vocab, rows * self.seq_len, calls, passes, buffers))

    def optimizer(self, params: float, tensors: float, steps: float) -> None:
        """`steps` AdamW steps of `params` elements in `tensors` tensors."""
        self.steps.append((params, tensors, steps))

    def seconds(self, hardware: HardwareProfile) -> float:
        """The work's time on `hardware` (an eager profile's calibration)."""
        compute = COMPUTE.get(self.dtype, "fp32")
        size = 2 if compute in ("bf16", "fp16") else 4
        total = self.collects * hardware.collect_s
        stream = hardware.stream_bandwidth or hardware.memory_bandwidth
        for block, rows, calls, passes, _ in self.blocks:
            scenario = Scenario(
                batch_size=rows,
                prompt_tokens=self.seq_len,
                generated_tokens=1,
                recipe=compute,
                kv_dtype=compute,
                ssm_dtype="fp32",
                conv_dtype=compute,
                activation_dtype=compute,
                compute_dtype=compute,
            )
            work = prefill_work(block, self.hidden_size, scenario, eager=hardware.eager)
            # roofline_seconds, with the activations at the streaming bandwidth: a stage's passes hold far
            # more than the caches (the saved activations of a whole step, a wave's kept inputs).
            seconds = roofline_seconds(work, hardware, compute)
            seconds += work.activation_bytes * (1 / stream - 1 / hardware.memory_bandwidth)
            total += calls * passes * seconds
        for vocab, tokens, calls, passes, buffers in self.heads:
            matmul = 2.0 * tokens * self.hidden_size * vocab / hardware.matmul_flops_per_s(compute, tokens)
            traffic = 2.0 * buffers * tokens * vocab * 4 / stream  # written, read back
            total += calls * passes * (matmul + traffic + 3 * buffers * hardware.op_overhead_s)
        for params, tensors, steps in self.steps:
            traffic = ADAMW_PASSES * params * size / stream
            total += steps * (traffic + ADAMW_OPS * tensors * hardware.op_overhead_s)
        return total
