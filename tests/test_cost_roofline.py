"""Roofline latency, throughput, concurrency and hardware profiles: hand-computed numbers and invariants."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from puzzle.cost.analytic import (
    block_weight_bytes,
    expected_distinct_experts,
    model_weight_bytes,
    state_bytes_per_request,
)
from puzzle.cost.hardware import (
    PROFILES,
    HardwareProfile,
    calibrate_this_machine,
    get_hardware,
    profile_from_json,
    profile_to_json,
)
from puzzle.cost.roofline import (
    BlockLatency,
    Scenario,
    block_latency,
    decode_work,
    eager_op_count,
    max_concurrent_requests,
    model_performance,
    prefill_work,
)
from puzzle.presets import nemotron3_nano, nemotron3_super, puzzle_75b_a9b_like, tiny_hybrid
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, NoOpSpec, SpecError

H100 = get_hardware("h100-80gb")


def test_expected_distinct_experts_matches_simulated_uniform_routing():
    rng = random.Random(0)
    E, k = 64, 6
    for tokens in (1, 4, 16, 64):
        trials = [len({e for _ in range(tokens) for e in rng.sample(range(E), k)}) for _ in range(400)]
        assert expected_distinct_experts(E, k, tokens) == pytest.approx(sum(trials) / len(trials), rel=0.03)
    assert expected_distinct_experts(E, k, 1) == pytest.approx(k)
    assert expected_distinct_experts(E, k, 10_000) == pytest.approx(E)


def test_mlp_decode_latency_by_hand():
    spec = MLPSpec(width=4096)
    H = 1024
    scenario = Scenario(batch_size=1, prompt_tokens=100, generated_tokens=10)
    weights = 2 * (2 * 4096 * H) + 2 * H  # bf16 up, down, norm
    activations = 2 * (11 * H + 2 * H + 4 * 4096)
    flops = 4 * 4096 * H
    kernels = 3 + 2
    expected = max(flops / 989.4e12, (weights + activations) / 3.35e12) + kernels * 1e-6
    assert block_latency(spec, H, scenario, "h100").decode_step_s == pytest.approx(expected)


def test_moe_decode_reads_the_experts_the_batch_touches():
    spec = nemotron3_super().blocks[1]
    assert isinstance(spec, MoESpec)
    single = decode_work(spec, 4096, Scenario(1, 1000, 100, recipe="nvfp4"))
    batch = decode_work(spec, 4096, Scenario(64, 1000, 100, recipe="nvfp4"))
    total = block_weight_bytes(spec, 4096, "nvfp4")
    # One token reads 22 of 512 experts; 64 tokens touch ~481 of them: most of the block.
    assert single.bytes < 0.1 * total
    assert 0.9 * total < batch.bytes < 1.01 * total + 64 * 1e6


def test_latency_invariants():
    H = 4096
    attention, mamba = AttentionSpec(32, 2, 128), MambaSpec(128, 64, 128, n_groups=8)
    short, long = Scenario(8, 1000, 100), Scenario(8, 100_000, 100)
    # Attention decode slows with context; Mamba decode does not.
    assert (
        block_latency(attention, H, long, H100).decode_step_s
        > block_latency(attention, H, short, H100).decode_step_s
    )
    assert (
        block_latency(mamba, H, long, H100).decode_step_s
        == block_latency(mamba, H, short, H100).decode_step_s
    )
    # Prefill grows superlinearly for attention, linearly for Mamba (beyond the chunk).
    ratio_attention = prefill_work(attention, H, long).flops / prefill_work(attention, H, short).flops
    ratio_mamba = prefill_work(mamba, H, long).flops / prefill_work(mamba, H, short).flops
    assert ratio_attention > 150 and ratio_mamba == pytest.approx(100)
    # A removed block costs nothing.
    assert block_latency(NoOpSpec(), H, short, H100) == BlockLatency(0.0, 0.0)
    # A smaller variant is never slower.
    assert (
        block_latency(MLPSpec(1024), H, short, H100).decode_step_s
        < block_latency(MLPSpec(4096), H, short, H100).decode_step_s
    )


def test_model_performance_is_consistent():
    scenario = Scenario(16, 2000, 500, recipe="fp8", kv_dtype="fp8", compute_dtype="fp8")
    perf = model_performance(nemotron3_nano(), scenario, "h200")
    assert perf.total_s == pytest.approx(perf.prefill_s + 500 * perf.decode_step_s)
    assert perf.output_tokens_per_s == pytest.approx(16 * 500 / perf.total_s)
    # Faster hardware, faster model; a compressed child is faster than its parent.
    assert model_performance(nemotron3_nano(), scenario, "b200").total_s < perf.total_s
    super_perf = model_performance(nemotron3_super(), scenario, "b200")
    child_perf = model_performance(puzzle_75b_a9b_like(), scenario, "b200")
    assert child_perf.decode_step_s < super_perf.decode_step_s


def test_latency_fn_is_pluggable():
    calls = []

    def fixed(spec, hidden_size, scenario):
        calls.append(spec)
        return BlockLatency(prefill_s=1.0, decode_step_s=0.5)

    model = tiny_hybrid()
    perf = model_performance(model, Scenario(1, 10, 4), "h100", latency_fn=fixed)
    assert len(calls) == len(set(model.blocks))  # one call per distinct block spec
    assert perf.decode_step_s == pytest.approx(0.5 * model.num_blocks, rel=1e-3)


def test_max_concurrent_requests_by_brute_force():
    spec = nemotron3_nano()
    context, fraction = 256_000, 0.9
    per_request = state_bytes_per_request(spec, context, "fp8")
    usable = fraction * H100.memory_bytes - model_weight_bytes(spec, "fp8")
    n = 0
    while (n + 1) * per_request <= usable:
        n += 1
    assert max_concurrent_requests(spec, "h100", context, "fp8", "fp8", fraction) == n > 0
    # Weights that do not fit leave room for nothing.
    assert max_concurrent_requests(nemotron3_super(), "h100", context, "bf16", "bf16") == 0
    # Reserving memory can only lower the count.
    assert max_concurrent_requests(spec, "h100", context, "fp8", "fp8", fraction, reserved_bytes=10e9) < n


def test_max_concurrent_requests_rejects_bad_input():
    spec = nemotron3_nano()
    with pytest.raises(SpecError, match="memory_fraction"):
        max_concurrent_requests(spec, "h100", 1000, memory_fraction=1.5)
    with pytest.raises(SpecError, match="context_len"):
        max_concurrent_requests(spec, "h100", 0)
    with pytest.raises(SpecError, match="no per-request state"):
        max_concurrent_requests(ModelSpec(64, 32, (MLPSpec(8),)), "h100", 1000)


def test_scenario_validation():
    with pytest.raises(SpecError, match="batch_size"):
        Scenario(0, 10, 10)
    with pytest.raises(SpecError, match="unknown quantisation recipe"):
        Scenario(1, 10, 10, recipe="int3")
    with pytest.raises(SpecError, match="unknown dtype"):
        Scenario(1, 10, 10, kv_dtype="fp4")
    with pytest.raises(SpecError, match="compute_dtype 'int4'"):
        Scenario(1, 10, 10, compute_dtype="int4")
    assert Scenario(1, 100, 9).decode_context == 105


def test_hardware_profiles():
    assert get_hardware("H100") is PROFILES["h100-80gb"]
    assert get_hardware("a100").flops_per_s("fp8") == get_hardware("a100").flops_per_s("bf16")  # no fp8 units
    assert get_hardware("b200").flops_per_s("nvfp4") == 2 * get_hardware("b200").flops_per_s("fp8")
    assert get_hardware("h100").flops_per_s("nvfp4") == get_hardware("h100").flops_per_s("fp8")
    for profile in PROFILES.values():
        assert profile.memory_bandwidth > 1e12 and profile.memory_bytes > 75e9 and profile.source
    with pytest.raises(SpecError, match=r"unknown hardware 'tpu'.*h100-80gb"):
        get_hardware("tpu")


def test_this_machine_is_calibrated_once_per_process():
    profile = get_hardware("this-machine")
    assert profile is calibrate_this_machine() is get_hardware("cpu")
    assert isinstance(profile, HardwareProfile) and profile.eager
    assert profile.flops_per_s("bf16") > 1e8 and profile.few_rows_flops > 1e7
    assert profile.memory_bandwidth > 1e8 and 0 < profile.op_overhead_s < 1e-3
    # The kinds' sequence mixing runs below the square-matmul rate on a CPU thread; SiLU costs beyond a copy.
    rates = dict(profile.mixing_flops)
    assert sorted(rates) == ["attention", "mamba"] and all(
        0 < r < 10 * profile.flops_per_s() for r in rates.values()
    )
    assert 0 < profile.transcendental_s < 1e-7
    # A fresh mapping's page faults cost beyond a write to memory already mapped (ns per byte, not ms).
    assert 0 < profile.fresh_page_s < 1e-7
    assert (
        profile_from_json(profile_to_json(profile), "here") == profile
    )  # the new fields survive hardware.json
    assert get_hardware("h100").mixing_flops == () and get_hardware("h100").transcendental_s == 0.0
    assert get_hardware("h100").fresh_page_s == 0.0


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "spec",
    [
        MambaSpec(num_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=8),
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
        MoESpec(num_experts=4, top_k=4, expert_width=16, shared_width=16, latent_size=8),  # grouped
        MoESpec(num_experts=16, top_k=2, expert_width=16, latent_size=8),  # a step's 4 pairs one by one
        MoESpec(num_experts=16, top_k=2, expert_width=(8,) * 15 + (4,)),  # mixed widths: the loop
        MLPSpec(width=64),
        LinearSpec(),
    ],
    ids=lambda s: s.short_name(),
)
def test_eager_op_counts_track_the_implementation(spec):
    from puzzle.model import Block

    block = Block(spec, 32, 1e-5)
    batch, tokens = 2, 24
    with torch.inference_mode():
        cache = block.mixer.init_cache(batch)
        with _CountOps() as prefill:
            block(torch.randn(batch, tokens, 32), cache=cache)
        with _CountOps() as step:
            block.step(torch.randn(batch, 1, 32), cache)
    assert eager_op_count(spec, batch, tokens, decode=False) == pytest.approx(prefill.count, rel=0.15)
    assert eager_op_count(spec, batch, 1, decode=True) == pytest.approx(step.count, rel=0.15)


def test_fused_profiles_count_few_kernels_per_block():
    spec = nemotron3_super().blocks[1]
    work = decode_work(spec, 4096, Scenario(64, 1000, 10))
    assert work.ops <= 12  # grouped GEMMs: no per-expert dispatch on a GPU profile
    eager = decode_work(spec, 4096, Scenario(64, 1000, 10), eager=True)
    # the CPU runs the expert bank's chunked loop (faster there than grouped_mm): two matmuls per expert hit
    assert 2 * 400 < eager.ops < 4 * 512
    assert math.isclose(dataclasses.replace(eager, ops=work.ops).bytes, work.bytes)
    # One token's 22 (token, slot) pairs run one by one, 8 ops each.
    assert decode_work(spec, 4096, Scenario(1, 1000, 10), eager=True).ops > 4 * 22
