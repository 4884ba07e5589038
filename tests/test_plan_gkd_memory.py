"""`puzzle plan`'s GKD memory per rank counts what GKD really keeps beside the shards: `keep_best`'s host
copy of this rank's shards (host memory, apart from the GPU figure) and, under FSDP, what the head holds
whole (the student's root unit, the teacher's lm_head, the head's gradient), at every world size."""

from __future__ import annotations

import pytest
from run_helpers import config_dict, write_config
from test_plan import tiny_profile

from puzzle.config import load_config
from puzzle.plan import parent_bytes, plan_run
from puzzle.presets import nemotron3_super


def _distill(tmp_path, world: int, keep_best: bool = True):
    data = config_dict(tmp_path)
    data["gkd"].update(shard="fsdp", keep_best=keep_best, dtype="float32")
    data["data"]["batch_size"] = data["gkd"]["batch_size"] = 8
    config = load_config(write_config(tmp_path / f"run-{world}-{keep_best}.yaml", data))
    plan = plan_run(config, nemotron3_super(), world, tiny_profile(10**15))
    return {s.name: s for s in plan.stages}["distill"]


@pytest.mark.parametrize("world", [1, 8])
def test_keep_best_is_host_memory_of_this_ranks_shards(tmp_path, world):
    spec = nemotron3_super()
    kept, none = _distill(tmp_path, world), _distill(tmp_path, world, keep_best=False)
    student = parent_bytes(spec, 4, world).sharded  # fp32 training dtype, the child planned as the parent
    assert kept.host["best weights (host copy)"] == pytest.approx(student, rel=1e-6)
    assert sum(none.host.values()) == 0
    assert kept.peak == none.peak  # not on the GPU
    assert kept.resident == pytest.approx(kept.peak + student, rel=1e-9)


def test_the_head_held_whole_under_fsdp(tmp_path):
    spec = nemotron3_super()
    table = spec.vocab_size * spec.hidden_size
    one, eight = _distill(tmp_path, 1), _distill(tmp_path, 8)
    assert eight.memory["whole root unit (embeddings, lm_head)"] == 2 * table * 4  # untied, fp32
    assert eight.memory["whole teacher lm_head"] == table * 4  # parent.dtype float32
    assert eight.memory["whole head gradient"] == table * 4
    assert not any(key.startswith("whole") for key in one.memory)  # one rank: in the shards already
