"""Measured block latency: same interface as the roofline, usable wherever a LatencyFn is."""

from __future__ import annotations

import math

import pytest

from puzzle.cost.measure import MeasuredLatency, measure_block_latency
from puzzle.cost.roofline import BlockLatency, Scenario, model_performance
from puzzle.presets import tiny_hybrid

SCENARIO = Scenario(batch_size=2, prompt_tokens=16, generated_tokens=4)


@pytest.mark.parametrize("index", range(6), ids=lambda i: tiny_hybrid(32).blocks[i].kind + str(i))
def test_every_block_kind_is_measurable(index):
    spec = tiny_hybrid(32).blocks[index]
    latency = measure_block_latency(spec, 32, SCENARIO, repeats=2)
    assert isinstance(latency, BlockLatency)
    assert 0 < latency.prefill_s < math.inf and 0 < latency.decode_step_s < math.inf


def test_measured_latency_is_a_cached_latency_fn():
    model = tiny_hybrid(32)
    measured = MeasuredLatency(repeats=2)
    first = measured(model.blocks[0], 32, SCENARIO)
    assert measured(model.blocks[0], 32, SCENARIO) is first
    perf = model_performance(model, SCENARIO, "this-machine", latency_fn=measured)
    assert perf.prefill_s > sum(measured(b, 32, SCENARIO).prefill_s for b in set(model.blocks))
    assert perf.output_tokens_per_s == pytest.approx(2 * 4 / perf.total_s)


def test_bad_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        measure_block_latency(tiny_hybrid(32).blocks[0], 32, SCENARIO, dtype="int8")
