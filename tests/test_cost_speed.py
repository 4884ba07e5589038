"""Throughput at a fixed per-user decode speed: multi-GPU profiles, the batch search, `puzzle costs --user-speed`,
the `throughput_at_speed` budget against brute force, and the seed's published Puzzle-75B / Super gains."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from puzzle.cli import main
from puzzle.cost import Scenario, get_hardware, max_batch_at_speed, max_concurrent_requests, model_performance
from puzzle.cost.hardware import hardware_key, multi_gpu
from puzzle.cost.limits import BudgetError, Relative
from puzzle.cost.roofline import BlockWork, all_reduce_seconds, decode_work
from puzzle.cost.serving import parse_scenario
from puzzle.presets import nemotron3_super, puzzle_75b_a9b_like, tiny_hybrid
from puzzle.search import search
from puzzle.search.budget import Budget, CostModel, choices_to_spec, deployment_problem
from puzzle.search.types import Rules, SearchError
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, MoESpec, NoOpSpec, SpecError

TINY = tiny_hybrid(hidden_size=64)
# A workload the tiny parent serves at ~12,000 tokens/s per user up to a batch of about 270 on an H100.
TINY_SCENARIO = Scenario(1, 2048, 512, name="speedy", user_speed=12000.0)


# ------------------------------------------------------------------------------------- multi-GPU profiles


def test_n_gpus_add_up_flops_bandwidth_and_memory():
    one, eight = get_hardware("b200"), get_hardware("8 x B200")
    assert hardware_key("8 x B200") == "8xb200" and hardware_key("1xb200") == "b200"
    assert eight.gpus == 8 and eight.name == "8xb200"
    assert eight.memory_bytes == 8 * one.memory_bytes == 1440 * 10**9  # DGX B200: 1,440 GB
    assert eight.memory_bandwidth == 8 * one.memory_bandwidth
    assert eight.flops_per_s("nvfp4") == 8 * one.flops_per_s("nvfp4")
    with pytest.raises(SpecError, match="GPU profile"):
        get_hardware("8xthis-machine")
    with pytest.raises(SpecError, match="only a single-GPU profile"):
        multi_gpu(eight, 2)


def test_each_block_pays_a_ring_all_reduce_of_its_output_on_several_gpus():
    """2 (g-1)/g x batch x hidden x 2 bytes over NVLink, plus one kernel; nothing on one GPU or for a removed block."""
    mamba = TINY.blocks[0]
    scenario = Scenario(64, 128, 16)
    eight = get_hardware("8xb200")
    work = decode_work(mamba, 64, scenario)
    expected = 2 * 7 / 8 * 64 * 64 * 2 / 900e9 + 1e-6
    assert all_reduce_seconds(work, eight) == pytest.approx(expected)
    assert all_reduce_seconds(work, get_hardware("b200")) == 0.0
    assert all_reduce_seconds(BlockWork(0.0, 0.0, 0.0, 0.0, exchanged_bytes=1e6), eight) == 0.0


# ---------------------------------------------------------------------------------------- the batch search


@pytest.mark.parametrize("hardware", ["h100", "2xh100"])
def test_the_batch_search_returns_the_largest_batch_meeting_the_speed(hardware):
    """Oracle: the per-user speed of every batch from 1 up, from `model_performance` itself."""

    def speed(batch: int) -> float:
        return model_performance(
            TINY, dataclasses.replace(TINY_SCENARIO, batch_size=batch), hardware
        ).per_user_tokens_per_s

    speeds = [speed(b) for b in range(1, 1500)]
    assert all(a >= b for a, b in itertools.pairwise(speeds)), (
        "the per-user speed must not rise with the batch"
    )
    for user_speed in (15000.0, 12000.0, 9000.0):
        point = max_batch_at_speed(TINY, TINY_SCENARIO, hardware, user_speed)
        assert point.limited_by == "speed" and 1 < point.batch < 1499
        assert speed(point.batch) >= user_speed > speed(point.batch + 1)
        assert point.batch == max(b for b in range(1, 1500) if speeds[b - 1] >= user_speed)
        assert (
            point.throughput
            == model_performance(
                TINY,
                dataclasses.replace(TINY_SCENARIO, batch_size=point.batch, user_speed=user_speed),
                hardware,
            ).output_tokens_per_s
        )


def test_memory_caps_the_batch_and_an_unreachable_speed_gives_zero():
    long = Scenario(1, 4_000_000, 1000, user_speed=10.0)  # few 4M-token requests fit beside the weights
    fits = max_concurrent_requests(TINY, "h100", 4_001_000)
    point = max_batch_at_speed(TINY, long, "h100")
    assert (point.batch, point.limited_by, point.max_concurrent) == (fits, "memory", fits)
    slow = max_batch_at_speed(TINY, TINY_SCENARIO, "h100", user_speed=1e9)
    assert (slow.batch, slow.limited_by, slow.performance, slow.throughput) == (0, "speed", None, 0.0)
    with pytest.raises(SpecError, match="needs a user speed"):
        max_batch_at_speed(TINY, Scenario(1, 16, 16), "h100")


# ---------------------------------------------------------------------------------------- puzzle costs


def test_costs_prints_the_batch_and_throughput_at_the_user_speed(capsys):
    argv = ["costs", "tiny-hybrid", "--hardware", "2xh100", "--user-speed", "12000"]
    assert main([*argv, "--scenario", "speedy:prompt=2048,generated=512", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["at_user_speed"]
    point = max_batch_at_speed(TINY, TINY_SCENARIO, "2xh100")
    assert (row["scenario"], row["batch"], row["limited_by"]) == ("speedy", point.batch, "speed")
    assert row["output_tokens_per_s"] == point.throughput and row["per_user_tokens_per_s"] >= 12000
    assert main(argv) == 0  # the default scenarios: the seed's 8k/64k and 50k/2k workloads
    out = capsys.readouterr().out
    assert "at >= 12000 tokens/s per user" in out and "| 8k-64k | 8,192 / 65,536 |" in out


# ------------------------------------------------------------------------- the budget against brute force


def _variants(parent):
    """Three candidates per block of the tiny hybrid `M*EM-E`, parent first."""
    variants = []
    for block in parent.blocks:
        if isinstance(block, MambaSpec):
            options = [block, dataclasses.replace(block, state_size=8), NoOpSpec()]
        elif isinstance(block, MoESpec):
            options = [block, dataclasses.replace(block, top_k=1), NoOpSpec()]
        elif isinstance(block, MLPSpec):
            options = [block, MLPSpec(width=block.width // 2), NoOpSpec()]
        else:
            assert isinstance(block, AttentionSpec)
            options = [block, dataclasses.replace(block, num_kv_heads=1), LinearSpec()]
        variants.append(options)
    return variants


def _prefill_heavy() -> Scenario:
    """16k in / 16 out at the parent's per-user speed at batch 256: the prefill dominates the time, so a
    child can meet the throughput while decoding too slowly, and the speed condition binds."""
    speed = model_performance(TINY, Scenario(256, 16384, 16), "2xh100").per_user_tokens_per_s
    return Scenario(1, 16384, 16, name="prefill-heavy", user_speed=speed)


# A low speed with 0.03% of the memory usable: memory, not the speed, caps the parent's batch (at 24).
MEMORY_BOUND = Scenario(1, 8192, 8192, name="memory-bound", user_speed=100.0)


@pytest.mark.parametrize(
    ("workload", "factor"),
    [
        ("speedy", 1.0),
        ("speedy", 1.25),
        ("speedy", 1.6),
        ("prefill-heavy", 1.25),
        ("prefill-heavy", 1.6),
        ("memory-bound", 1.25),
        ("memory-bound", 1.6),
    ],
)
def test_throughput_at_speed_budget_equals_brute_force_over_its_linearisation(workload, factor):
    """The MIP's best child equals enumeration of every child under the three conditions the key stands for
    at the fixed batch b = ceil(factor x the parent's batch at the speed), each checked with whole-model
    functions; and the child it picks really serves >= factor x the parent's throughput at the speed."""
    hardware = "2xh100"
    scenario = {"speedy": TINY_SCENARIO, "memory-bound": MEMORY_BOUND}.get(workload) or _prefill_heavy()
    fraction = 3e-4 if workload == "memory-bound" else 0.9
    variants = _variants(TINY)
    rng = np.random.default_rng(1)
    scores = [[0.0, *rng.uniform(0.1, 1.0, len(options) - 1)] for options in variants]
    budget = Budget.of(
        cost_model=CostModel(hardware, memory_fraction=fraction, scenarios={scenario.name: scenario}),
        rules=Rules(shared_state_size=False),
        throughput_at_speed={scenario.name: Relative(factor)},
    )
    problem = deployment_problem(TINY, variants, scores, budget)
    solution = search(problem.table, problem.limits, problem.rules)

    parent = max_batch_at_speed(TINY, scenario, hardware, memory_fraction=fraction)
    assert parent.limited_by == ("memory" if workload == "memory-bound" else "speed")
    wanted = factor * parent.throughput
    batch = math.ceil(wanted / parent.throughput * parent.batch - 1e-9)
    at_batch = dataclasses.replace(scenario, batch_size=batch)
    context = scenario.prompt_tokens + scenario.generated_tokens
    best, best_choices = np.inf, None
    for choices in itertools.product(*[range(len(options)) for options in variants]):
        child = choices_to_spec(TINY, variants, choices)
        try:
            if max_concurrent_requests(child, hardware, context, memory_fraction=fraction) < batch:
                continue
        except SpecError:
            pass  # no per-request state: memory does not bound the batch
        performance = model_performance(child, at_batch, hardware)
        if performance.per_user_tokens_per_s < scenario.user_speed:
            continue
        if performance.output_tokens_per_s < wanted * (1 - 1e-9):
            continue
        score = sum(scores[i][c] for i, c in enumerate(choices))
        if score < best:
            best, best_choices = score, choices
    assert best_choices is not None
    assert solution.objective == pytest.approx(best, abs=1e-12)
    at_batch_named = dataclasses.replace(at_batch, name=f"{workload}@b{batch}")
    child = choices_to_spec(TINY, variants, solution.choices)
    performance = model_performance(child, at_batch_named, hardware)
    assert solution.totals[f"decode_seconds[{workload}@b{batch}]"] == pytest.approx(performance.decode_step_s)
    assert solution.totals[f"seconds[{workload}@b{batch}]"] == pytest.approx(performance.total_s)
    chosen = max_batch_at_speed(
        choices_to_spec(TINY, variants, solution.choices), scenario, hardware, memory_fraction=fraction
    )
    assert chosen.batch >= batch and chosen.throughput >= wanted * (1 - 1e-9)
    if factor == 1.0:
        assert best == 0.0  # the parent itself meets 1x
    else:
        assert best > 0.0


def test_a_scenario_takes_its_speed_and_the_key_needs_one():
    scenario = parse_scenario("fast:batch=1,prompt=8k,generated=1k,speed=250")
    assert (scenario.user_speed, scenario.prompt_tokens) == (250.0, 8000)
    for bad in ("speed=0", "speed=2x", "speed=fast"):
        with pytest.raises(BudgetError, match=r"speed|cannot read"):
            parse_scenario(f"fast:batch=1,prompt=8,generated=8,{bad}")
    budget = Budget.of(
        cost_model=CostModel("h100", scenarios={"plain": Scenario(1, 64, 64)}),
        throughput_at_speed={"plain": Relative(1.2)},
    )
    variants = _variants(TINY)
    scores = [[0.0] * len(options) for options in variants]
    with pytest.raises(SearchError, match="'plain' has no user speed: define it with speed="):
        deployment_problem(TINY, variants, scores, budget)
    fast = dataclasses.replace(TINY_SCENARIO, user_speed=1e9)
    too_fast = Budget.of(
        cost_model=CostModel("h100", scenarios={fast.name: fast}), throughput_at_speed={fast.name: 2.0}
    )
    with pytest.raises(SearchError, match=r"cannot serve one request at 1e\+09 tokens/s per user"):
        deployment_problem(TINY, variants, scores, too_fast)


# ------------------------------------------------------------------- the seed's published gains on 8xB200

# Published: Puzzle-75B-A9B serves 2.03-2.14x Super's throughput at 8K in / 64K out and 1.60x at 50K in / 2K
# out, on 8xB200 at a fixed per-user speed that the reference does not give.
PUBLISHED = {"8k-64k": (2.03, 2.14), "50k-2k": (1.60, 1.60)}
WORKLOADS = {"8k-64k": (8192, 65536), "50k-2k": (51200, 2048)}
SPEED = 500.0  # tokens/s per user: where our 8k/64k gain enters the published range (see below)


def _gain(workload: str, user_speed: float, hardware: str = "8xb200") -> tuple[float, int, int]:
    """(child's throughput over the parent's, parent's batch, child's batch) at `user_speed`, nvfp4 weights
    and GEMMs, bf16 KV cache, fp32 SSM state, tensor/expert parallel over 8 B200s."""
    prompt, generated = WORKLOADS[workload]
    scenario = Scenario(1, prompt, generated, recipe="nvfp4", compute_dtype="nvfp4", user_speed=user_speed)
    parent = max_batch_at_speed(nemotron3_super(), scenario, hardware)
    child = max_batch_at_speed(puzzle_75b_a9b_like(), scenario, hardware)
    return child.throughput / parent.throughput, parent.batch, child.batch


def test_published_gains_at_a_fixed_user_speed_within_15_percent():
    """Our figures at 500 tokens/s per user: 8k/64k 2.036x (batches 26 -> 53), 50k/2k 1.486x (24 -> 48).

    The speed is not published and the gain depends on it (next test): 500 tokens/s is where our 8k/64k gain
    reaches the published 2.03-2.14, so that figure is matched by the choice of speed; the 50k/2k gain at
    the same speed is the check (-7% of the published 1.60). It falls short because that workload's prefill
    (50k tokens per request) is dominated in our model by the all-reduce of every block's activations over
    NVLink, which compression does not shrink (same hidden size, same 88 blocks); without that term the
    gain is 1.79x (+12%).
    """
    figures = {workload: _gain(workload, SPEED) for workload in WORKLOADS}
    assert figures["8k-64k"] == (pytest.approx(2.036, abs=0.005), 26, 53)
    assert figures["50k-2k"] == (pytest.approx(1.486, abs=0.005), 24, 48)
    for workload, (low, high) in PUBLISHED.items():
        gain = figures[workload][0]
        assert 0.85 * low <= gain <= 1.15 * high, f"{workload}: {gain:.3f}x vs published {low}-{high}x"


def test_the_gain_grows_with_the_user_speed():
    """Small batches (high per-user speed) read mostly weights, where the child saves 37% of the bytes and
    touches fewer experts (top-k 4-18 instead of 22); large batches read mostly KV cache, which compression
    left unchanged (same 8 attention blocks): at 200 tokens/s per user the gain is only ~1.2-1.3x."""
    for workload in WORKLOADS:
        gains = [_gain(workload, speed)[0] for speed in (200.0, 350.0, 500.0)]
        assert gains == sorted(gains) and gains[0] < 1.35, f"{workload}: {gains}"
