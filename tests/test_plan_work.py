"""`puzzle plan` prices what the run does: the block calls its stages' `StageWork` counts (`puzzle.plan_time`,
which times them on this CPU) are the calls a real tiny `puzzle run` makes, stage by stage.

Every mixer call of the run (the parent's blocks, BLD's variants, the children's) is counted by a global
forward hook, by the stage it runs in and the sequences it runs at once; the plan's count is each stage's
`StageWork.blocks` summed the same way. They must be equal, but where a child runs (the measured KL, GKD):
the child is not known before the search and is planned as the parent, so the run's calls there lie
between the parent's and the parent's plus the child's as planned. Times are not compared
(benchmarks/plan_vs_measured.py does that on this CPU).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from run_helpers import SPEC, make_inputs, write_config
from torch.utils._python_dispatch import TorchDispatchMode

from puzzle.blocks import build_block
from puzzle.config import load_config
from puzzle.cost.hardware import get_hardware
from puzzle.cost.kinds import block_cost
from puzzle.layout import STAGES
from puzzle.model import Block, HybridLM
from puzzle.plan import HEAD_PASS_BUFFERS, plan_run
from puzzle.plan_time import ADAMW_FRESH, DEFAULT_THRESHOLD, StageWork, importance_hook_work
from puzzle.prune.importance import collect_importance
from puzzle.run import Run
from puzzle.spec import MLPSpec, ModelSpec, MoESpec

PLANNED = ("importance", "library", "scores", "assemble", "distill")


def _mixer_types(config) -> tuple[type, ...]:
    variants = config.search_space().all_variants(SPEC)
    specs = [*SPEC.blocks, *(v.spec for listed in variants.values() for v in listed)]
    with torch.device("meta"):
        return tuple({type(build_block(s, SPEC.hidden_size)) for s in specs if block_cost(s).runs})


def test_the_plan_counts_the_block_calls_each_stage_makes(tmp_path):
    data = make_inputs(tmp_path)
    # Without checkpointing a student block runs once per micro-batch (with it, again in the backward).
    data["gkd"]["activation_checkpointing"] = False
    config = load_config(write_config(tmp_path / "config.yaml", data))
    mixers = _mixer_types(config)
    calls: dict[str, Counter] = {stage: Counter() for stage in STAGES}
    current = [None]

    def count(module, args, output):
        if current[0] is not None and isinstance(module, mixers):
            calls[current[0]][args[0].shape[0]] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        run = Run(tmp_path / "run", config)
        for stage in STAGES:
            current[0] = stage
            run.record(stage)
    finally:
        handle.remove()
    plan = plan_run(config, SPEC, 1, get_hardware("h100"))
    for stage in plan.stages:
        if stage.name not in PLANNED:
            continue
        known: Counter = Counter()  # the parent's blocks and the variants: known before the run
        child: Counter = Counter()  # a child's: planned as the parent's blocks (an upper bound)
        for block, rows, number, _, whose in stage.work.blocks:
            if block_cost(block).runs:
                (child if whose == "child" else known)[rows] += number
        made = calls[stage.name]
        for rows in set(known) | set(child) | set(made):
            assert known[rows] <= made[rows] <= known[rows] + child[rows], (
                f"stage {stage.name}: the plan counts {known[rows]:g} mixer calls over {rows} sequences "
                f"(+ up to {child[rows]:g} of a child), the run made {made[rows]}"
            )
        if not child:
            assert made == known, stage.name


# The eager plan's new counts, checked op by op on the code they count (`puzzle.plan_time`): transcendental
# elementwise functions, and the matmul FLOPs and elementwise work importance's collectors add.
TRANSCENDENTAL = {"silu", "softplus", "sigmoid", "gelu", "exp"}
MATMULS = {"mm", "bmm", "addmm"}


class _Count(TorchDispatchMode):
    """Elements through transcendental ops and FLOPs of matmuls, by aten op name."""

    def __init__(self) -> None:
        super().__init__()
        self.transcendental: Counter = Counter()
        self.flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__.rstrip("_")
        if name in TRANSCENDENTAL:
            self.transcendental[name] += args[0].numel()
        elif name in MATMULS:
            a, b = args[-2], args[-1]
            self.flops += 2.0 * a.numel() * b.shape[-1]
        return out


LATENT = ModelSpec(
    vocab_size=40,
    hidden_size=16,
    blocks=(
        *SPEC.blocks,
        MoESpec(num_experts=4, top_k=2, expert_width=8, latent_size=8),
        MLPSpec(width=12, activation="silu"),
    ),
)


def test_transcendental_elements_are_those_each_block_computes():
    torch.manual_seed(0)
    rows, seq = 3, 20
    for block in LATENT.blocks:
        module = Block(block, LATENT.hidden_size, LATENT.norm_eps)
        x = torch.randn(rows, seq, LATENT.hidden_size)
        counter = _Count()
        with torch.no_grad(), counter:
            module(x)
        # Mamba's exp of A_log (one per head and call, not per token) and its scan's decays are its mixing's.
        made = sum(n for name, n in counter.transcendental.items() if name != "exp")
        expected = rows * seq * block_cost(block).transcendental_elements_per_token(block)
        assert made == expected, (
            f"{block}: the plan counts {expected} transcendental elements, the block {made}"
        )


def test_importance_hook_work_is_what_the_collectors_add():
    torch.manual_seed(0)
    model = HybridLM(LATENT).eval().requires_grad_(False)
    rows, seq, batches, every = 4, 32, 3, 8
    inputs = [torch.randint(0, LATENT.vocab_size, (rows, seq)) for _ in range(batches)]
    plain, hooked = _Count(), _Count()
    with torch.no_grad(), plain:
        for ids in inputs:
            model.backbone(ids, len(model.layers))
    with hooked:
        collect_importance(model, inputs, linear_fit=True, linear_fit_every=every, parent_fp="test")
    planned = [importance_hook_work(block, LATENT.hidden_size, rows, seq, every) for block in LATENT.blocks]
    flops = batches * sum(p[0] for p in planned)
    transcendental = batches * sum(p[2] for p in planned)
    # Scoring at the end (finalize: column norms, a few [P, P] products per block) adds a little: 3%.
    made = hooked.flops - plain.flops
    assert flops <= made <= 1.03 * flops, f"importance hooks: planned {flops:g} matmul FLOPs, made {made:g}"
    made = sum(hooked.transcendental.values()) - sum(plain.transcendental.values())
    assert transcendental <= made <= 1.03 * transcendental, (
        f"importance hooks: planned {transcendental:g} transcendental elements, made {made:g}"
    )


def test_the_gkd_head_counts_the_products_and_exps_head_pass_makes(tmp_path):
    from puzzle.logits import head_pass

    config = load_config(write_config(tmp_path / "config.yaml", make_inputs(tmp_path)))
    plan = {stage.name: stage for stage in plan_run(config, SPEC, 1, get_hardware("h100")).stages}
    train, evaluation = plan["distill"].work.heads  # (vocab, tokens, calls, passes, buffers, matmuls, exps)
    torch.manual_seed(0)
    n, hidden, vocab, chunk = 24, SPEC.hidden_size, 50, 16  # chunks of 16, 16, 16 and 2 rows
    args = (
        torch.randn(n, hidden),
        torch.randn(vocab, hidden),
        torch.randn(n, hidden),
        torch.randn(vocab, hidden),
    )
    targets = torch.randint(0, vocab, (n,))
    for gradients, planned in ((True, train), (False, evaluation)):
        counter = _Count()
        with counter:
            head_pass(*args, targets, chunk, kl_scale=1.0, nll_scale=0.5, gradients=gradients)
        products = counter.flops / (2.0 * n * hidden * vocab)
        # Beyond the [N, V] passes: the online logsumexp's rescale, one exp of [N] a chunk.
        exps = (counter.transcendental["exp"] - 2 * n * 4) / (n * vocab)
        assert products == planned[5] and exps == planned[6], (
            f"head_pass (gradients={gradients}): {products:g} logit products and {exps:g} exps over [N, V], "
            f"the plan counts {planned[5]:g} and {planned[6]:g}"
        )


def test_the_fresh_tensors_priced_are_those_head_pass_and_a_training_step_make():
    """`puzzle.plan_time` charges page faults for tensors of at least the mmap threshold made fresh: per
    head_pass call its `HEAD_PASS_BUFFERS` chunk buffers (however many chunks) and, with gradients, the
    lm_head's [V, H] gradient, which the plan counts with every parameter's: one per backward, and AdamW's
    `ADAMW_FRESH` temporaries per step. Counted here on the real code at sizes past the threshold."""
    from fresh_helpers import FreshTensors

    from puzzle.logits import head_pass

    torch.manual_seed(0)
    n, hidden, chunk = 64, 32, 4096
    buffer = n * chunk * 4
    assert buffer >= DEFAULT_THRESHOLD
    for vocab in (2 * chunk + 2, 4 * chunk):  # 3 and 4 chunks: the buffers are made once a call
        assert vocab * hidden * 4 >= DEFAULT_THRESHOLD
        weight = torch.randn(vocab, hidden)
        args = (torch.randn(n, hidden), weight, torch.randn(n, hidden), torch.randn(vocab, hidden))
        targets = torch.randint(0, vocab, (n,))
        for gradients in (True, False):
            with FreshTensors(DEFAULT_THRESHOLD) as fresh:
                head_pass(*args, targets, chunk, kl_scale=1.0, gradients=gradients)
            made = sorted(shape for _, shape in fresh.found)
            expected = [(n * chunk,)] * HEAD_PASS_BUFFERS + ([(vocab, hidden)] if gradients else [])
            assert made == sorted(expected), (vocab, gradients, fresh.found)

    layer = torch.nn.Linear(1024, 320)  # a 1.25 MiB weight, a 1.25 KiB bias
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3, weight_decay=0.1)  # as puzzle.gkd makes it
    x = torch.randn(8, 1024)
    micros = 2
    for step in range(3):  # the first step also makes AdamW's moments
        with FreshTensors(DEFAULT_THRESHOLD) as fresh:
            for _ in range(micros):
                layer(x).square().sum().backward()
            torch.nn.utils.clip_grad_norm_(list(layer.parameters()), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        made = micros + ADAMW_FRESH + (2 if step == 0 else 0)
        assert fresh.shapes((320, 1024)) == made, fresh.found
    # What the plan charges for it: the weight's 4 fresh tensors a step, nothing for the bias.
    work = StageWork(hidden_size=1024, seq_len=8)
    work.gradients([320 * 1024, 320], steps=5, micros=micros)
    assert work.fresh == [((micros + ADAMW_FRESH) * 320 * 1024 * 4, 5)]
    priced = dataclasses.replace(get_hardware("h100"), eager=True, fresh_page_s=1e-9)
    assert work.seconds(priced) == pytest.approx(5 * (micros + ADAMW_FRESH) * 320 * 1024 * 4 * 1e-9)
