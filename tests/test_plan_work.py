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

from collections import Counter

import torch
from run_helpers import SPEC, make_inputs, write_config

from puzzle.blocks import build_block
from puzzle.config import load_config
from puzzle.cost.hardware import get_hardware
from puzzle.cost.kinds import block_cost
from puzzle.layout import STAGES
from puzzle.plan import plan_run
from puzzle.run import Run

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
