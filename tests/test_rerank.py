"""Re-ranking by short GKD (`search.rerank: {by: short_gkd}`, puzzle/rerank.py, puzzle/run/rerank.py) on the
tiny pipeline of tests/run_helpers.py: the candidates are the MIP's k best, the context rounds' children and
the baselines' (greedy, uniform), once each; the choice equals brute-force short GKD of every candidate; a run
killed (SIGKILL) in the middle of a candidate's short GKD resumes to the uninterrupted run's record."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from run_helpers import config_dict, make_inputs, torchrun_puzzle, write_config

import puzzle.gkd
from puzzle.assemble import measured_kl
from puzzle.baselines import Baselines
from puzzle.cli import main
from puzzle.gkd import distill
from puzzle.plan import plan_run
from puzzle.report import readable_number, write_report
from puzzle.rerank import candidate_list, rerank_wins, short_gkd_settings, source_kind
from puzzle.run import Run
from puzzle.search import search_k
from puzzle.settings import GKDSettings

NAME = "active_params-le-0.8x"
# A wider space than run_helpers': at 0.8x refilled greedy's child is none of the MIP's 3 best.
KINDS = {
    "mamba": {"state_size": [4], "noop": True},
    "attention": {"noop": True},
    "mlp": {"width_fraction": [0.5, 0.25], "noop": True},
    "moe": {"top_k": [1], "expert_width_fraction": [0.5]},
}


def _data(root: Path, run_dir: str = "run") -> dict:
    data = config_dict(root, run_dir=run_dir)
    data["space"]["kinds"] = KINDS
    return data


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """A tiny run up to its scores (importance, library, scores): each test copies it and searches."""
    root = tmp_path_factory.mktemp("rerank")
    make_inputs(root)
    torch.set_num_threads(1)
    assert (
        main(["run", str(write_config(root / "run.yaml", config_dict(root))), "--quiet", "--until", "scores"])
        == 0
    )
    return root


def _config(root: Path, tmp_path: Path, label: str, **search) -> Path:
    """A copy of the scored run under tmp_path/label and its config with `search` settings added."""
    shutil.copytree(root / "run", tmp_path / label)  # copy2: the stages up to the scores are reused
    data = _data(root, run_dir=str(tmp_path / label))
    data["search"].update(search)
    data["gkd"]["checkpoint_every"] = 1  # a kill falls after a checkpoint of the candidate it is in
    return write_config(tmp_path / f"{label}.yaml", data)


def _rerank_record(run_dir: Path) -> dict:
    stages = json.loads((run_dir / "run.json").read_text())["stages"]
    return stages["solutions"]["outputs"][NAME]


def test_short_settings_scale_the_gkd_or_count_tokens():
    full = GKDSettings(token_budget=640, steps=8, batch_size=4, lr=1e-3)
    quarter = short_gkd_settings(full, 0.25, seq_len=16)
    assert (quarter.token_budget, quarter.steps, quarter.lr) == (160, 2, 1e-3)
    # At least one optimiser step (4 x 16 tokens); a count > 1 is a token budget of its own.
    assert short_gkd_settings(full, 0.01, 16).token_budget == 64
    assert short_gkd_settings(full, 0.01, 16).steps == 1
    counted = short_gkd_settings(full, 200, 16)
    assert (counted.token_budget, counted.steps) == (200, None)


def test_identical_children_are_one_candidate_with_every_source():
    a, b = {"choices": {"block_0": "x"}, "objective": 1.0}, {"choices": {"block_0": "y"}, "objective": 2.0}
    found = candidate_list(
        [("mip-1", a), ("mip-2", b), ("round-1", dict(a)), ("greedy", None), ("uniform", b)]
    )
    assert [entry["sources"] for entry in found] == [["mip-1", "round-1"], ["mip-2", "uniform"]]
    assert [source_kind(s) for s in ("mip-3", "round-2", "greedy")] == ["mip", "context", "greedy"]
    tally = rerank_wins(
        [{"by": "short_gkd", "won_by": ["mip", "context"]}, {"by": "short_gkd", "won_by": ["greedy"]}, None]
    )
    assert tally == {"searches": 2, "wins": {"mip": 1, "context": 1, "greedy": 1, "uniform": 0}}


def test_the_choice_equals_brute_force_short_gkd_of_every_candidate(scored, tmp_path):
    """Every candidate (the MIP's 2 best, the context round's child, greedy's and uniform pruning's, found
    independently here) distilled shortly by hand with the same settings and seeds: the recorded KLs are
    those, measured on the scoring held-out, and the saved solution is the least of them."""
    rerank = {"by": "short_gkd", "tokens": 0.25, "candidates": 2}
    config = _config(scored, tmp_path, "run", rerank=rerank, context_rounds=1)
    assert main(["run", str(config), "--quiet", "--until", "solutions"]) == 0
    entry = _rerank_record(tmp_path / "run")
    record = entry["rerank"]
    run = Run.from_config(config)
    problem = run.problem(["active_params<=0.8x"])
    # The candidates, independently: the MIP's 2 best, the round's child, the baselines'.
    expected = [s.names for s in search_k(problem.table, problem.problem.limits, problem.problem.rules, k=2)]
    expected += [r["choices"] for r in entry["context"]["rounds"][1:] if "rejected" not in r]
    baselines = Baselines(problem)
    for arch in (baselines.greedy(), baselines.uniform()[0]):
        choices = baselines.choices(arch)
        expected.append(
            {
                b: problem.table.variant_names[i][j]
                for i, (b, j) in enumerate(zip(problem.table.block_names, choices))
            }
        )
    distinct = []
    for choices in expected:
        if choices not in distinct:
            distinct.append(choices)
    assert [c["choices"] for c in record["candidates"]] == distinct
    assert {source_kind(s) for c in record["candidates"] for s in c["sources"]} >= {
        "mip",
        "greedy",
        "uniform",
    }
    settings = short_gkd_settings(run.config.gkd, 0.25, run.config.data.seq_len)
    assert record["tokens"] == settings.token_budget == 160
    brute = []
    for index, candidate in enumerate(record["candidates"]):
        child = run.child_of({"choices": candidate["choices"]})
        result = distill(
            child, run.parent(), run.data.train, run.held_out_batches(), settings, tmp_path / f"brute-{index}"
        )
        after = measured_kl(
            child.eval(), run.parent(), run.held_out_batches(), run.config.scoring.vocab_chunk
        )
        brute.append(after["kl"])
        assert candidate["short_gkd_kl"] == pytest.approx(after["kl"], rel=1e-5)
        assert candidate["kl_before"] == pytest.approx(result.first_eval["kl"], rel=1e-6)
        assert candidate["steps"] == 2 and candidate["kl_before"] >= candidate["short_gkd_kl"]
    best = min(range(len(brute)), key=lambda i: brute[i])
    assert record["chosen"] == best + 1
    saved = json.loads((tmp_path / "run" / "solutions" / f"{NAME}.json").read_text())
    assert saved["choices"] == record["candidates"][best]["choices"]
    assert record["won_by"] == list(
        dict.fromkeys(source_kind(s) for s in record["candidates"][best]["sources"])
    )
    # Each candidate leaves its figures, not a copy of the child's weights.
    left = tmp_path / "run" / "solutions" / "rerank" / NAME
    assert len(list(left.glob("*/short_gkd.json"))) == len(record["candidates"])
    assert not list(left.rglob("*.safetensors"))
    # The report shows each candidate's short-GKD KL beside its prediction, and the wins by source.
    report = write_report(tmp_path / "run").read_text()
    assert "## Re-ranking" in report and "greedy" in report
    for candidate in record["candidates"]:
        assert readable_number(candidate["short_gkd_kl"]) in report
    # A rerun reuses the stage: no GKD step runs.
    assert _gkd_steps_of_solutions_run(config) == 0


KILLER = """
import os, signal, sys
import torch
import yaml
import puzzle.gkd
from puzzle.cli import main
torch.set_num_threads(1)
original, calls = puzzle.gkd._train_step, [0]
def step(*args, **kwargs):
    calls[0] += 1
    if calls[0] == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kwargs)
puzzle.gkd._train_step = step
sys.exit(main(["run", sys.argv[1], "--quiet", "--until", "solutions"]))
"""


def test_a_run_killed_in_a_short_gkd_resumes_to_the_uninterrupted_record(scored, tmp_path):
    """SIGKILL at the 3rd step of the second candidate's short GKD (5 steps each, a checkpoint every step):
    the rerun reuses the first candidate's GKD, resumes the second from its step 2, and records exactly
    what an uninterrupted run records."""
    rerank = {"by": "short_gkd", "tokens": 0.5, "candidates": 2}
    whole = _config(scored, tmp_path, "whole", rerank=rerank)
    assert main(["run", str(whole), "--quiet", "--until", "solutions"]) == 0
    oracle = _rerank_record(tmp_path / "whole")["rerank"]
    assert len(oracle["candidates"]) >= 2 and all(c["steps"] == 5 for c in oracle["candidates"])

    killed = _config(scored, tmp_path, "killed", rerank=rerank)
    env = {
        **os.environ,
        "PUZZLE_PROGRESS": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    process = subprocess.run([sys.executable, "-c", KILLER, str(killed), "8"], env=env, timeout=300)
    assert process.returncode == -9
    kept = 7  # 5 steps of the first candidate's short GKD, 2 of the second's
    assert _gkd_steps_of_solutions_run(killed) == 5 * len(oracle["candidates"]) - kept
    resumed = _rerank_record(tmp_path / "killed")["rerank"]
    # Every figure but the wall time of each short GKD (a resumed one's is its last call's) is the same.
    assert all(c.pop("seconds") > 0 for c in resumed["candidates"] + oracle["candidates"])
    assert resumed == oracle
    log = (tmp_path / "killed" / "logs" / "rank0.log").read_text()
    assert "candidate 2 from step 2" in log


def test_plan_prices_the_short_gkds(scored):
    """`puzzle plan`: the solutions stage costs the candidates' short GKDs (tokens and FLOPs) and GKD's
    memory; without re-ranking it costs none."""
    from puzzle.config import load_config_data
    from puzzle.layout import RunLayout
    from puzzle.plan import plan_hardware

    spec = RunLayout(scored / "run").read_parent()
    _, hardware = plan_hardware("h100", 1)
    stages = {}
    for label, rerank in (("off", 0), ("on", {"by": "short_gkd", "tokens": 0.25, "candidates": 3})):
        data = _data(scored)
        data["search"]["rerank"] = rerank
        plan = plan_run(load_config_data(data), spec, 1, hardware)
        stages[label] = {s.name: s for s in plan.stages}
    off, on = stages["off"]["solutions"], stages["on"]["solutions"]
    assert off.flops == 0 and not off.memory
    distill_stage = stages["on"]["distill"]
    # 3 MIP candidates + greedy + uniform at a quarter of one child's GKD tokens each.
    assert on.tokens == 5 * distill_stage.tokens // 4
    assert on.flops == pytest.approx(5 / 4 * distill_stage.flops)
    assert on.peak == pytest.approx(distill_stage.peak)
    # On disk one candidate at a time: its checkpoint (the distill stage's for one child) and its student.
    assert on.disk == pytest.approx(4 / 3 * distill_stage.disk)


@pytest.mark.slow
def test_two_gloo_processes_choose_as_one(scored, tmp_path):
    """Under `torchrun --nproc-per-node 2` with GKD sharded (gkd.shard: fsdp) every rank distils each
    candidate: the candidates and the choice are one process's, the KLs equal up to summation order."""
    rerank = {"by": "short_gkd", "tokens": 0.25, "candidates": 2}
    records = {}
    for ranks in (1, 2):
        config = _config(scored, tmp_path, f"run{ranks}", rerank=rerank)
        data = yaml.safe_load(config.read_text())
        data["gkd"]["shard"] = "fsdp"
        write_config(config, data)
        torchrun_puzzle(ranks, "run", str(config), "--quiet", "--until", "solutions")
        records[ranks] = _rerank_record(tmp_path / f"run{ranks}")["rerank"]
    one, two = records[1], records[2]
    assert two["chosen"] == one["chosen"]
    assert [c["choices"] for c in two["candidates"]] == [c["choices"] for c in one["candidates"]]
    for want, got in zip(one["candidates"], two["candidates"]):
        assert got["short_gkd_kl"] == pytest.approx(want["short_gkd_kl"], rel=1e-3)


def _gkd_steps_of_solutions_run(config: Path) -> int:
    """`puzzle run CONFIG --until solutions` in this process; the GKD training steps it took (counted at
    puzzle.gkd's step function, which every short GKD calls)."""
    steps = []
    original = puzzle.gkd._train_step
    try:
        puzzle.gkd._train_step = lambda *a, **k: steps.append(1) or original(*a, **k)
        assert main(["run", str(config), "--quiet", "--until", "solutions"]) == 0
    finally:
        puzzle.gkd._train_step = original
    return len(steps)
