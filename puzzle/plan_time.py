"""The planned time of a stage on an eager profile (this CPU): its passes priced by the calibrated cost model.

On a GPU profile `puzzle.plan` prices a stage as its FLOPs at an assumed share of the peak (training at scale
is compute-bound). On "this-machine" (`HardwareProfile.eager`: puzzle.blocks' plain-torch path, op by op)
small models are not: per-op dispatch, elementwise traffic and Python's cycle collector between stages cost
as much as the matmuls. So there a stage is priced as what the run does, counted pass by pass
(`StageWork`), each block call by the roofline cost model the search uses (`puzzle.cost.roofline`, eager:
matmuls at the calibrated rate, counted ops x the calibrated dispatch overhead, activation traffic at the
calibrated streaming bandwidth, `HardwareProfile.stream_bandwidth`), with no assumed efficiency, except that
a block's sequence mixing (attention's scores and values, Mamba's chunked scan: `prefill_mixing_flops_per_token`)
runs at its kind's calibrated rate (`HardwareProfile.mixing_flops`: torch's SDPA and `ssd_chunk_scan` timed on
this CPU, 20-40% of the matmul rate at these sizes; the scan's scratch traffic is part of that timing), and
its elementwise transcendental functions (SiLU, softplus, sigmoid: `transcendental_elements_per_token`) cost
the calibrated `HardwareProfile.transcendental_s` per element beyond their traffic:

- a forward of blocks over a batch: each block's `prefill_work` at that batch's tokens; a training pass is
  forward + backward, 3 forwards' worth (the backward runs two matmuls per forward matmul and about twice
  its elementwise ops), 4 with activation checkpointing (the forward runs again);
- an lm_head pass: 2 H V FLOPs per token and product plus `buffers` fp32 [tokens, V] tensors written and
  read back, and the softmax's exp over the logits (the chunked softmax / KL of `puzzle.logits`: GKD's
  `head_pass` makes both models' logits twice, 4 products, and with gradients 2 more, g W and g^T h; its exps
  are 2 for the log-normalisers, p's, and with gradients q's);
- an AdamW step: `ADAMW_OPS` ops per parameter tensor and `ADAMW_PASSES` passes over its elements
  (torch's single-tensor AdamW with weight decay, the one it runs on the CPU, and gradient clipping);
- importance's statistics (`importance_hook_work`: the collectors' hooks of `puzzle.prune.importance`, their
  products, elementwise passes and ops, counted from that code) on top of its forwards;
- a cycle collection (`puzzle.shard.free_dropped_units`: before and after every stage record, after every
  BLD wave) at the calibrated `HardwareProfile.collect_s`;
- fresh tensors of at least `puzzle.hostmem`'s mmap threshold (a run maps each on its own and unmaps it
  when freed, so each is page-faulted again when first written), at the calibrated
  `HardwareProfile.fresh_page_s` per byte beyond their traffic: each such parameter's gradient per
  backward and AdamW's two temporaries of it per step (`gradients`), a head pass's chunk buffers
  (`head(..., fresh=)`). A block's activations that reach the threshold are not counted (on the
  bench_scale parent, Mamba's in_proj output: 15% of a GKD step's fresh bytes).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from puzzle.cost.hardware import HardwareProfile
from puzzle.cost.kinds import block_cost
from puzzle.cost.roofline import Scenario, prefill_work, roofline_seconds
from puzzle.hostmem import DEFAULT_THRESHOLD
from puzzle.spec import AttentionSpec, BlockSpec, MambaSpec, MLPSpec, MoESpec

# torch.optim.AdamW's single-tensor step with weight decay: param.mul_, exp_avg.lerp_, exp_avg_sq.mul_ and
# addcmul_, the step count's add_, sqrt, div, add_ (denominator), param.addcdiv_ (9 ops), plus clip_grad_norm_'s
# norm and scale and zero_grad: 12 ops per tensor. Their elementwise passes read or write about 22 tensors of
# the parameter's size.
ADAMW_OPS = 12
ADAMW_PASSES = 22
# Fresh tensors of a parameter's size per AdamW step: the out-of-place sqrt and div of its denominator.
ADAMW_FRESH = 2
COMPUTE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# puzzle.prune.importance samples one token in _COV_EVERY for a latent MoE's covariances.
IMPORTANCE_COV_EVERY = 4


def importance_hook_work(
    block: BlockSpec, hidden_size: int, rows: int, seq_len: int, fit_every: int
) -> tuple[float, float, float, float]:
    """What `puzzle.prune.importance`'s collector of `block` adds to one forward of `rows` sequences of
    `seq_len` tokens: (matmul FLOPs, fp32 elements written or read, transcendental elements, ops).

    Counted from the collectors' hooks: every kind, with a linear fit every `fit_every`-th token (0: none),
    x^T x and x^T y (4 H^2 FLOPs a sampled token); Mamba re-runs the causal conv + SiLU and softplus(dt) on
    the in_proj output and sums per-head second moments of the out_proj input (2 nh P^2 FLOPs a token) and
    the state's write / read / decay terms; attention, per-group second moments of the o_proj input
    (2 nkv (q / nkv)^2); MoE, the routing-weighted squares of every expert's activation and output
    (the bank runs its per-expert loop while observed) and, latent, the fc1 / fc2 covariances on one
    token in IMPORTANCE_COV_EVERY; MLP, the down_proj input's squares. Sums are kept in fp64 but formed
    in fp32 (the hooks' products), so the matmul rate applies.
    """
    tokens = rows * seq_len
    if not block_cost(block).runs:
        return 0.0, 0.0, 0.0, 0.0
    H = hidden_size
    flops = elements = transcendental = 0.0
    ops = 2.0  # the token count and the generator-free bookkeeping of each hook call
    if fit_every:
        sampled = tokens / fit_every
        flops += 4.0 * H * H * sampled
        elements += 6.0 * H * sampled  # the sampled rows of x and y gathered, their sums
        ops += 16.0
    if isinstance(block, MambaSpec):
        d, conv, nh = block.d_inner, block.conv_dim, block.num_heads
        gn = block.n_groups * block.state_size
        chunks = -(-seq_len // 64)  # causal_conv1d's blocks of 64 rows
        # The conv's contiguous copy, its K taps + bias + SiLU per block; squares of x, B, C, u; dt terms.
        elements += tokens * ((block.conv_kernel + 5) * conv + 4 * d + 4 * gn + 8 * nh)
        transcendental += tokens * (conv + 2 * nh)  # SiLU, softplus(dt), exp(2 dt A)
        flops += tokens * (2.0 * nh * block.head_dim**2 + 2.0 * nh * block.state_size)
        ops += 40.0 + (block.conv_kernel + 3) * chunks
    elif isinstance(block, AttentionSpec):
        q = block.num_heads * block.head_dim
        flops += tokens * 2.0 * q * q / block.num_kv_heads
        ops += 6.0
    elif isinstance(block, MoESpec):
        E, k = block.num_experts, block.top_k
        L = block.expert_input_size(H)
        width = sum(block.widths) / E
        elements += tokens * k * (3 * width + 2 * L)  # (w a)^2 and the output's squares, per pair
        touched = min(E, tokens * k)
        ops += 4.0 + 10.0 * touched
        if block.shared_width:
            elements += tokens * 2 * block.shared_width
            ops += 4.0
        if block.latent_size is not None:
            elements += tokens * 4 * L
            flops += tokens / IMPORTANCE_COV_EVERY * 4.0 * L * L
            ops += 14.0
    elif isinstance(block, MLPSpec):
        elements += tokens * 2 * block.width
        ops += 4.0
    return flops, elements, transcendental, ops


@dataclass
class StageWork:
    """What a stage runs, pass by pass, for `seconds` on an eager profile (`seq_len` tokens a sequence,
    `dtype` the compute dtype's torch name)."""

    hidden_size: int
    seq_len: int
    dtype: str = "float32"
    # (block, sequences per call, calls, forward-equivalents per call, whose: "parent", "variant" or "child")
    blocks: list[tuple[BlockSpec, int, float, float, str]] = field(default_factory=list)
    # (vocabulary, tokens per call, calls, passes, fp32 [tokens, V] buffers per pass, [tokens, H] x [H, V]
    # products per call, [tokens, V] exp passes per call)
    heads: list[tuple[int, int, float, float, int, float, float]] = field(default_factory=list)
    # (parameter elements, parameter tensors, steps)
    steps: list[tuple[float, float, float]] = field(default_factory=list)
    # (block, sequences per call, calls, linear fit's token stride): importance's collectors on its forwards
    hooks: list[tuple[BlockSpec, int, float, int]] = field(default_factory=list)
    collects: float = 0.0
    # (bytes, calls): a tensor of at least the mmap threshold made fresh `calls` times
    fresh: list[tuple[float, float]] = field(default_factory=list)

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

    def importance_hooks(self, blocks: Iterable[BlockSpec], rows: int, calls: float, fit_every: int) -> None:
        """Importance's collectors on `calls` forwards of `blocks` over `rows` sequences (`fit_every`: the
        linear fit's token stride, 0 without one)."""
        self.hooks += [(block, rows, calls, fit_every) for block in blocks]

    def head(
        self,
        vocab: int,
        rows: int,
        calls: float,
        passes: float = 1.0,
        buffers: int = 4,
        matmuls: float | None = None,
        exps: float = 1.0,
        chunk: int = 0,
        fresh: int = 0,
    ) -> None:
        """`calls` lm_head calls over `rows` sequences, each `passes` passes with `buffers` fp32 [tokens, V]
        tensors, `matmuls` logit-sized products (default: one a pass) and `exps` exp passes over the
        [tokens, V] logits (the softmax's, a transcendental function each). `fresh`: the fp32
        [tokens, chunk] buffers each call makes (`puzzle.logits.ChunkBuffers`, reused chunk after chunk;
        `chunk`: the vocabulary chunk)."""
        matmuls = passes if matmuls is None else matmuls
        tokens = rows * self.seq_len
        self.heads.append((vocab, tokens, calls, passes, buffers, matmuls, exps))
        self.fresh_tensors([tokens * min(chunk, vocab) * 4] * fresh, calls)

    def optimizer(self, params: float, tensors: float, steps: float) -> None:
        """`steps` AdamW steps of `params` elements in `tensors` tensors."""
        self.steps.append((params, tensors, steps))

    def fresh_tensors(self, sizes: Iterable[float], calls: float) -> None:
        """`calls` times, one fresh tensor of each of `sizes` bytes; those below the mmap threshold come from
        the heap, already mapped, and cost nothing here."""
        self.fresh += [(size, calls) for size in sizes if size >= DEFAULT_THRESHOLD]

    def gradients(
        self, elements: Iterable[int], steps: float, micros: float = 1.0, share: float = 1.0
    ) -> None:
        """`steps` training steps of `micros` micro-batches each, of parameter tensors of `elements` elements
        in the work's dtype: each backward makes each one's gradient fresh (the first becomes `.grad`, which
        zero_grad(set_to_none=True) frees after the step; later ones are added into it), each step AdamW's
        `ADAMW_FRESH` temporaries. `share`: the fraction of them a child keeps (its tensors unknown before
        the search: the parent's, scaled)."""
        size = self.element_bytes
        large = [count * size for count in elements if count * size >= DEFAULT_THRESHOLD]
        self.fresh += [((micros + ADAMW_FRESH) * share * nbytes, steps) for nbytes in large]

    @property
    def element_bytes(self) -> int:
        """Bytes of one element in the work's compute dtype."""
        return 2 if COMPUTE.get(self.dtype, "fp32") in ("bf16", "fp16") else 4

    def seconds(self, hardware: HardwareProfile) -> float:
        """The work's time on `hardware` (an eager profile's calibration)."""
        compute = COMPUTE.get(self.dtype, "fp32")
        size = self.element_bytes
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
            cost = block_cost(block)
            mixing = 0.0
            if block.kind in dict(hardware.mixing_flops):
                # The mixing at its kind's measured rate, apart from the matmuls; its timing includes the
                # scratch tensors it writes and reads back (`prefill_scratch_bytes_per_token`).
                tokens = rows * self.seq_len
                flops = tokens * cost.prefill_mixing_flops_per_token(block, self.seq_len)
                scratch = tokens * cost.prefill_scratch_bytes_per_token(block, self.seq_len)
                mixing = flops / hardware.mixing_flops_per_s(block.kind, compute)
                work = replace(
                    work, flops=work.flops - flops, activation_bytes=work.activation_bytes - scratch
                )
            # roofline_seconds, with the activations at the streaming bandwidth: a stage's passes hold far
            # more than the caches (the saved activations of a whole step, a wave's kept inputs).
            seconds = roofline_seconds(work, hardware, compute) + mixing
            # Elementwise transcendental functions: compute beyond the traffic the activations price.
            elementwise = cost.transcendental_elements_per_token(block)
            seconds += rows * self.seq_len * elementwise * hardware.transcendental_s
            seconds += work.activation_bytes * (1 / stream - 1 / hardware.memory_bandwidth)
            total += calls * passes * seconds
        for block, rows, calls, fit_every in self.hooks:
            flops, elements, transcendental, ops = importance_hook_work(
                block, self.hidden_size, rows, self.seq_len, fit_every
            )
            rate = hardware.matmul_flops_per_s(compute, rows * self.seq_len)
            seconds = flops / rate + elements * 4 / stream + transcendental * hardware.transcendental_s
            total += calls * (seconds + ops * hardware.op_overhead_s)
        for vocab, tokens, calls, passes, buffers, matmuls, exps in self.heads:
            matmul = 2.0 * tokens * self.hidden_size * vocab / hardware.matmul_flops_per_s(compute, tokens)
            traffic = 2.0 * buffers * tokens * vocab * 4 / stream  # written, read back
            softmax = exps * tokens * vocab * hardware.transcendental_s
            total += calls * (matmuls * matmul + softmax)
            total += calls * passes * (traffic + 3 * buffers * hardware.op_overhead_s)
        for params, tensors, steps in self.steps:
            traffic = ADAMW_PASSES * params * size / stream
            total += steps * (traffic + ADAMW_OPS * tensors * hardware.op_overhead_s)
        total += sum(size * calls for size, calls in self.fresh) * hardware.fresh_page_s
        return total
