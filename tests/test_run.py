"""The pipeline (`puzzle run`, puzzle/run/) on a tiny config: end to end, reuse, invalidation by a new budget,
resume after SIGKILL in BLD and in scoring, 2 gloo processes, config errors (exit 2, nothing written)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from run_helpers import config_dict, make_inputs, torchrun_puzzle, write_config
from safetensors.torch import load_file

import puzzle
from puzzle.assemble import measured_kl
from puzzle.cli import main
from puzzle.config import ConfigError, load_config
from puzzle.gkd import load_distilled
from puzzle.layout import STAGES
from puzzle.nemotron_h.checkpoint import load
from puzzle.report import _format, write_report
from puzzle.run import Run, RunError
from puzzle.search.types import Solution

HELPER = Path(__file__).parent / "run_helpers.py"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    return root, make_inputs(root)


def _files(root: Path) -> dict[str, int]:
    """{relative path: mtime_ns} of every file but the manifest and the logs."""
    return {
        str(p.relative_to(root)): p.stat().st_mtime_ns
        for p in root.rglob("*")
        if p.is_file() and p.name != "run.json" and "logs" not in p.parts
    }


def _statuses(run_dir: Path) -> dict[str, str]:
    """The status of each stage's record (the frontier's record follows the solutions stage's: see
    `_frontier_status`)."""
    stages = json.loads((run_dir / "run.json").read_text())["stages"]
    return {name: stages[name]["status"] for name in stages if name != "frontier"}


def _frontier_status(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["stages"]["frontier"]["status"]


def _run(config: Path, *extra: str) -> int:
    torch.set_num_threads(1)
    return main(["run", str(config), "--quiet", *extra])


@pytest.fixture(scope="module")
def finished(inputs):
    """The uninterrupted run (the oracle of the other tests)."""
    root, data = inputs
    config = write_config(root / "run.yaml", data)
    started = time.perf_counter()
    assert _run(config) == 0
    print(f"\ntiny pipeline run: {time.perf_counter() - started:.1f} s")
    return root / "run", config


def test_end_to_end_exports_the_distilled_child(finished):
    run_dir, config = finished
    assert _statuses(run_dir) == {stage: "done" for stage in STAGES}
    assert _frontier_status(run_dir) == "done"
    # The solutions stage swept the frontier the report draws: the solution's own point is on it.
    frontier = json.loads((run_dir / "frontier.json").read_text())
    assert frontier["keys"] and all(entry["points"] for entry in frontier["keys"].values())
    (name,) = [p.stem for p in (run_dir / "solutions").glob("*.json")]
    saved = json.loads((run_dir / "solutions" / f"{name}.json").read_text())
    exported = puzzle.load(run_dir / "exports" / name)
    run = Run.from_config(config)
    child = load_distilled(run_dir / "children" / name, run.child(name))
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, child(ids).logits, rtol=0, atol=0)
        assert not torch.equal(child(ids).logits, run.child(name)(ids).logits)  # GKD changed it
    record = json.loads((run_dir / "exports" / name / "puzzle.json").read_text())
    assert record["measured"]["kl"] > 0 and record["search"]["choices"] == saved["choices"]
    manifest = json.loads((run_dir / "run.json").read_text())
    assert (
        manifest["stages"]["distill"]["outputs"][name]["kept_eval"]["kl"]
        < manifest["stages"]["assemble"]["outputs"][name]["measured"]["kl"]
    )
    assert (run_dir / "logs" / "rank0.log").is_file() and (run_dir / "run.resolved.yaml").is_file()
    # `puzzle search RUN_DIR` works on the run, the config's scenarios known without --scenario.
    assert main(["search", str(run_dir), "--budget", "throughput[chat]>=1.01x", "--json"]) == 0


def test_a_rerun_does_nothing(finished):
    run_dir, config = finished
    before = _files(run_dir)
    assert _run(config) == 0
    assert _files(run_dir) == before
    assert _statuses(run_dir) == {stage: "reused" for stage in STAGES}
    assert _frontier_status(run_dir) == "reused"


def test_a_finished_run_reruns_without_loading_the_parent(finished):
    run_dir, config = finished
    pipeline = Run.from_config(config)

    def refuse() -> None:
        raise AssertionError("the parent was loaded")

    pipeline.load_parent = refuse  # its recorded fingerprint stands while the parent's files are unchanged
    pipeline.all()
    assert _statuses(run_dir) == {stage: "reused" for stage in STAGES}


def test_a_new_budget_resolves_without_retraining(finished, tmp_path):
    run_dir, _ = finished
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)  # copy2: mtimes kept
    data = config_dict(run_dir.parent, run_dir=str(copied))
    data["search"]["budgets"] = ["active_params<=0.7x"]
    before = _files(copied)
    assert _run(write_config(tmp_path / "run.yaml", data)) == 0
    after = _files(copied)
    for stage in ("importance", "library", "scores"):
        kept = {k: v for k, v in before.items() if k.startswith(stage + "/")}
        assert kept and all(after[k] == v for k, v in kept.items())
    statuses = _statuses(copied)
    assert [statuses[s] for s in STAGES] == ["reused"] * 3 + ["done"] * 4
    assert sorted(p.stem for p in (copied / "solutions").glob("*.json")) == sorted(
        ["active_params-le-0.8x", "active_params-le-0.7x"]
    )
    # The earlier budget's outputs stay on disk (a return to it reuses them) but the report shows the current.
    from puzzle.report import write_report

    report = write_report(copied).read_text()
    assert "active_params-le-0.7x" in report and "active_params-le-0.8x" not in report


def test_an_fp8_kv_cache_measures_and_exports_calibrated_children(finished, tmp_path):
    """kv_cache.dtype fp8: the library and scores stand; each child is measured, distilled and exported with
    its KV cache fake-quantized under scales calibrated on its own keys and values (the distilled child's
    for the export, which carries them for vLLM)."""
    from puzzle.kv_cache import calibrate_kv_scales, kv_scales, set_kv_scales

    run_dir, _ = finished
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    data = config_dict(run_dir.parent, run_dir=str(copied))
    data["search"]["budgets"] = ["active_params<=0.97x"]  # a child that keeps its attention block
    config = write_config(tmp_path / "bf16.yaml", data)
    assert _run(config) == 0
    (name,) = [p.stem for p in (copied / "solutions").glob("*.json") if "0.97x" in p.stem]
    bf16 = json.loads((copied / "run.json").read_text())["stages"]["assemble"]["outputs"][name]["measured"][
        "kl"
    ]
    data["kv_cache"] = {"dtype": "fp8", "tokens": 256}
    with pytest.raises(ConfigError, match="prices the KV cache in bf16"):  # the search must price it
        load_config(write_config(tmp_path / "mismatch.yaml", data))
    data["hardware"]["scenarios"]["chat"]["kv_dtype"] = "fp8"
    config = write_config(tmp_path / "run.yaml", data)
    assert _run(config) == 0
    statuses = _statuses(copied)
    # The scenario's KV in fp8 changes its costs: the search solves again, on the same library and scores.
    assert [statuses[s] for s in STAGES] == ["reused"] * 3 + ["done"] * 4
    run = Run.from_config(config)
    child = run.child(name)
    manifest = json.loads((copied / "run.json").read_text())["stages"]
    measured = manifest["assemble"]["outputs"][name]["measured"]["kl"]
    plain = copy.deepcopy(child)
    set_kv_scales(plain, None)
    assert kv_scales(child) and measured != bf16
    print(
        f"\nmeasured KL of {name}: bf16 KV cache {bf16:.6g}, fp8 KV cache {measured:.6g}; scales {kv_scales(child)}"
    )
    assert measured == pytest.approx(
        measured_kl(child, run.parent(), run.held_out_batches(), 16)["kl"], rel=1e-6
    )
    distilled = load_distilled(copied / "children" / name, plain)
    want = calibrate_kv_scales(distilled, run.calibration_batches(256, data["importance"]["batch_size"]))
    exported = puzzle.load(copied / "exports" / name)
    assert kv_scales(exported) == {i: tuple(torch.tensor(p).tolist()) for i, p in want.items()}


def _exported_files(export: Path) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """config.json and {tensor name: shape} of the weight files, as an engine reads them off disk."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(export.glob("*.safetensors")):
        with safe_open(str(path), "pt") as weights:
            shapes.update({name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()})  # noqa: SIM118
    return json.loads((export / "config.json").read_text()), shapes


def test_a_run_held_to_an_engine_exports_what_its_replay_loads(finished, tmp_path):
    """search.engines [vllm]: the search leaves out the no-op blocks the run's own space offers, the child
    is exported with format "engine", and vLLM's loader, replayed on the written config.json and tensor
    shapes, builds it as it is; the run's child without the engine has a no-op block the replay refuses."""
    from puzzle.nemotron_h import vllm_replay

    run_dir, _ = finished
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    data = config_dict(run_dir.parent, run_dir=str(copied))
    data["search"] = {"budgets": ["active_params<=0.9x"], "engines": ["vllm"]}
    assert _run(write_config(tmp_path / "run.yaml", data)) == 0
    (name,) = [p.stem for p in (copied / "solutions").glob("*.json") if "0.9x" in p.stem]
    export = copied / "exports" / name
    record = json.loads((export / "puzzle.json").read_text())
    assert record["checked_engines"] == ["vllm"] and record["engines"]["vllm"] == []
    config, shapes = _exported_files(export)
    assert vllm_replay.mismatches(config, shapes, puzzle.load(export).spec) == []
    # The oracle can fail: the run's own child without the engine (0.8x: within what vLLM serves, 0.9x is
    # the least) has a no-op block, and the replay refuses its export.
    (free,) = [p.stem for p in (run_dir / "solutions").glob("*.json")]
    assert "noop" in json.loads((run_dir / "solutions" / f"{free}.json").read_text())["choices"].values()
    config, shapes = _exported_files(run_dir / "exports" / free)
    assert vllm_replay.mismatches(config, shapes, puzzle.load(run_dir / "exports" / free).spec)


def test_a_run_held_to_an_engine_stops_at_a_child_the_engine_refuses(finished, tmp_path, caplog):
    """search.engines [transformers] with an fp8 KV cache: the search serves every block, but plain
    transformers ignores the cache's scales, so the export stage refuses the child (exit 1, the reason
    logged) and writes no checkpoint."""
    run_dir, _ = finished
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    data = config_dict(run_dir.parent, run_dir=str(copied))
    data["search"] = {"budgets": ["active_params<=0.97x"], "engines": ["transformers"]}
    data["kv_cache"] = {"dtype": "fp8", "tokens": 256}
    data["hardware"]["scenarios"]["chat"]["kv_dtype"] = "fp8"
    assert _run(write_config(tmp_path / "run.yaml", data)) == 1
    statuses = _statuses(copied)
    assert statuses["distill"] == "done" and statuses["export"] != "done"
    (name,) = [p.stem for p in (copied / "solutions").glob("*.json") if "0.97x" in p.stem]
    assert not (copied / "exports" / name).exists()
    logged = (copied / "logs" / "rank0.log").read_text()
    assert f"child {name!r} of a run with search.engines ['transformers']" in logged
    assert "refusing an engine export" in logged and "an fp8 KV cache" in logged


def _counts(directory: Path, pid: int) -> dict[str, int]:
    return json.loads((directory / f"counts-{pid}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "call"), [("library", 5), ("library", 13), ("scores", 6)])
def test_a_killed_stage_resumes_where_it_stopped(finished, tmp_path, stage, call):
    run_dir, _ = finished
    data = config_dict(run_dir.parent, run_dir=str(tmp_path / "run"))
    config = write_config(tmp_path / "run.yaml", data)
    env = {**os.environ, "PUZZLE_PROGRESS": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, str(HELPER), str(config), stage, str(call)], env=env)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "stalled").exists():
            assert process.poll() is None, "the run ended before reaching the stall"
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert _statuses(tmp_path / "run")[stage] == "running"
    killed = _counts(tmp_path, process.pid)
    resumed = subprocess.run([sys.executable, str(HELPER), str(config), "none", "0"], env=env, check=True)
    assert resumed.returncode == 0
    (counts,) = [
        json.loads(p.read_text()) for p in tmp_path.glob("counts-*.json") if p.stem != f"counts-{process.pid}"
    ]
    # No finished unit recomputed: the resumed run did exactly what was left after the last saved unit.
    total = _total_units(run_dir, stage)
    assert _saved_units(stage, killed[stage]) > 0 and counts[stage] == total - _saved_units(
        stage, killed[stage]
    )
    assert _statuses(tmp_path / "run") == {s: "done" for s in STAGES} | {
        s: "reused" for s in STAGES[: STAGES.index(stage)]
    }
    _same_outcome(run_dir, tmp_path / "run")
    if stage == "library":
        _assert_resume_announced(run_dir, tmp_path / "run", killed[stage])


def _assert_resume_announced(finished: Path, resumed: Path, reached: int) -> None:
    """The log of a BLD stage killed at its `reached`-th step says which wave resumed from which step (the
    last checkpoint: every 3 steps, 10 steps per wave), on the trainer's line and on the stage's done line;
    a wave killed before its first checkpoint starts over, and the log claims no resume."""
    waves = len(json.loads((finished / "library" / "library.json").read_text())["plan"])
    wave, inside = divmod(reached - 1, 10)
    step = (inside // 3) * 3
    log = (resumed / "logs" / "rank0.log").read_text()
    if step == 0:
        assert "resuming from step" not in log and "resumed from a checkpoint" not in log
        return
    assert f"BLD wave {wave + 1}/{waves}: resuming from step {step} ({step * 64} tokens trained before" in log
    assert f"library: done (resumed from a checkpoint: wave {wave + 1} from step {step})" in log


def _total_units(run_dir: Path, stage: str) -> int:
    """BLD steps / scored batches of the uninterrupted run: per BLD wave, token_budget 640 / (4 x 16) tokens
    per step = 10 steps; scoring: one wave per variant (variants_per_wave 1) x 4 held-out batches."""
    if stage == "library":
        plan = json.loads((run_dir / "library" / "library.json").read_text())["plan"]
        return len(plan) * 10
    scored = json.loads((run_dir / "scores" / "scores.json").read_text())["variants"]
    return len(scored) * 4  # 8 variants: parent copies and no-ops are scored too


def _saved_units(stage: str, reached: int) -> int:
    """Units saved before the kill at the `reached`-th call: BLD checkpoints every 3 steps within a wave
    (10 steps per wave); scoring saves after each wave of 4 batches."""
    done = reached - 1
    if stage == "library":
        waves, inside = divmod(done, 10)
        return waves * 10 + (inside // 3) * 3
    return (done // 4) * 4


def _same_outcome(expected: Path, actual: Path) -> None:
    for path in (expected / "solutions").glob("*.json"):
        assert (
            json.loads(path.read_text())["choices"]
            == json.loads((actual / "solutions" / path.name).read_text())["choices"]
        )
    for path in (expected / "exports").glob("*/model.safetensors"):
        want, got = load_file(str(path)), load_file(str(actual / path.relative_to(expected)))
        assert want.keys() == got.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


def _error_run(tmp_path: Path, data: dict, capsys) -> str:
    config = write_config(tmp_path / "bad.yaml", data)
    assert _run(config) == 2
    assert not Path(data["run_dir"]).exists()
    return capsys.readouterr().err


def test_config_errors_exit_2_before_anything_is_written(inputs, tmp_path, capsys):
    root, base = inputs
    base = copy.deepcopy(base) | {"run_dir": str(tmp_path / "run")}
    unknown = copy.deepcopy(base) | {"sed": 1}
    assert "sed: unknown key" in _error_run(tmp_path, unknown, capsys)
    wrong = copy.deepcopy(base)
    wrong["bld"]["lr"] = "fast"
    assert "bld.lr: expected a number" in _error_run(tmp_path, wrong, capsys)
    missing = copy.deepcopy(base)
    missing["parent"]["path"] = str(tmp_path / "nowhere")
    assert "parent.path" in _error_run(tmp_path, missing, capsys)
    empty = tmp_path / "no-weights"
    empty.mkdir()
    shutil.copy(root / "parent" / "config.json", empty / "config.json")
    no_weights = copy.deepcopy(base)
    no_weights["parent"]["path"] = str(empty)
    assert "parent.path" in _error_run(tmp_path, no_weights, capsys)
    infeasible = copy.deepcopy(base)
    infeasible["search"]["budgets"] = ["params<=100"]
    message = _error_run(tmp_path, infeasible, capsys)
    assert "puzzle run: infeasible:" in message and "params" in message
    assert not (tmp_path / "run").exists()


def test_a_config_kept_in_its_own_run_dir_is_never_rewritten(inputs, tmp_path):
    root, base = inputs
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    data = copy.deepcopy(base) | {"run_dir": "."}  # relative to the config file's folder
    text = "# my experiment: keep this comment\n" + yaml.safe_dump(data, sort_keys=False)
    (run_dir / "config.yaml").write_text(text)
    assert _run(run_dir / "config.yaml", "--until", "importance") == 0
    assert (run_dir / "config.yaml").read_text() == text  # comments and formatting kept, byte for byte
    saved = load_config(run_dir / "run.resolved.yaml", check_paths=False)
    assert saved.run_dir == run_dir and saved.parent.path == root / "parent"
    assert _statuses(run_dir) == {"importance": "done"}
    assert _run(run_dir / "config.yaml", "--until", "importance") == 0  # an earlier run's folder: fine
    assert (run_dir / "config.yaml").read_text() == text


def test_a_run_dir_holding_the_users_files_is_refused_untouched(inputs, tmp_path, capsys):
    _, base = inputs
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "config.yaml").write_text("# the user's own, not this run's\n")
    (folder / "notes.txt").write_text("results so far\n")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    config = write_config(tmp_path / "run.yaml", copy.deepcopy(base) | {"run_dir": str(folder)})
    assert _run(config) == 2
    err = capsys.readouterr().err
    assert "holds files that are not a puzzle run's (notes.txt)" in err and str(folder) in err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # no logs/, nothing written
    with pytest.raises(RunError, match=r"notes\.txt"):  # the Python API refuses it too
        Run(folder, load_config(config, check_paths=True)).importance()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_run_dir_of_another_parent_is_an_error(finished, tmp_path, capsys):
    run_dir, _ = finished
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    other = load(run_dir.parent / "parent")  # another parent: one weight changed, saved elsewhere
    with torch.no_grad():
        next(other.parameters()).add_(0.1)
    other.save_pretrained(tmp_path / "parent")
    before = _files(copied)
    data = config_dict(run_dir.parent, run_dir=str(copied))
    data["parent"]["path"] = str(tmp_path / "parent")
    assert _run(write_config(tmp_path / "run.yaml", data)) == 2
    assert "made from another parent" in capsys.readouterr().err
    assert _files(copied) == before


@pytest.mark.slow
def test_two_gloo_processes_under_torchrun_match_one(finished, tmp_path):
    """`torchrun --nproc-per-node 2 -m puzzle run` (gloo on the CPU), the command a user runs."""
    run_dir, _ = finished
    data = config_dict(run_dir.parent, run_dir=str(tmp_path / "run"))
    config = write_config(tmp_path / "run.yaml", data)
    torchrun_puzzle(2, "run", str(config), "--quiet")
    other = tmp_path / "run"
    assert sorted(p.name for p in (other / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert _statuses(other) == {stage: "done" for stage in STAGES}
    files = sorted((run_dir / "library").glob("block*/*.safetensors"))
    assert files
    # Data parallel: equal up to float summation order (measured: at most 2e-7 after 10 AdamW steps). Adam
    # moves an element by about lr per step whatever its gradient's size, so one step taken differently
    # anywhere (a wrong shard, a missing all-reduce, a gradient of rounding noise: the top-1 router's once
    # made this 4e-3) shows as a difference near lr; lr / 100 passes only summation order.
    atol = data["bld"]["lr"] / 100
    for path in files:
        want, got = load_file(str(path)), load_file(str(other / path.relative_to(run_dir)))
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=atol, msg=key)
    for path in (run_dir / "solutions").glob("*.json"):
        assert (
            json.loads(path.read_text())["choices"]
            == json.loads((other / "solutions" / path.name).read_text())["choices"]
        )
    # The measured KL: every rank's shared parent was sharded in place by BLD (FSDP), so assembly gathered
    # its units and compare_models ran every batch on every rank; the figure is the one of one process.
    want, got = (
        json.loads((d / "run.json").read_text())["stages"]["assemble"]["outputs"] for d in (run_dir, other)
    )
    assert want.keys() == got.keys()
    for name in want:
        assert got[name]["measured"]["kl"] == pytest.approx(want[name]["measured"]["kl"], rel=1e-3)


def _tensors_under(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{relative path: tensors} of every safetensors file a run wrote (its importance, library, children,
    exports), not its logs."""
    return {
        str(p.relative_to(root)): load_file(str(p))
        for p in sorted(root.rglob("*.safetensors"))
        if "logs" not in p.parts
    }


@pytest.mark.slow
def test_hsdp_on_two_nodes_of_two_gloo_ranks_matches_one_process(finished, tmp_path):
    """Issue 34 §3: `shard: hsdp` in every stage on a 2 x 2 mesh (two torchrun "nodes" of 2 ranks on this
    machine, started with the command `puzzle.launch.torchrun_args` renders for docs/SCALE.md and the Slurm
    example: each unit sharded over a node's 2 ranks, replicated across the 2 nodes) writes what one process
    writes, in every stage.

    Tolerances: float summation order only. Trained weights (library, distilled child, export) within
    atol = lr / 100 (as the 2-rank test: AdamW moves an element by about lr a step whatever its gradient, so
    one step taken wrongly shows near lr); everything else (importance sums, scores, the measured KL)
    rtol 1e-4 (fp32 sums of a few hundred terms added in another order)."""
    from puzzle.launch import torchrun_args

    run_dir, _ = finished
    data = config_dict(run_dir.parent, run_dir=str(tmp_path / "run"))
    for section in ("importance", "bld", "scoring", "gkd"):
        data[section]["shard"] = "hsdp"
    config = write_config(tmp_path / "run.yaml", data)
    env = {
        **os.environ,
        "PUZZLE_PROGRESS": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    from gloo_helpers import free_port

    argv = torchrun_args(2, 2, str(config), endpoint=f"127.0.0.1:{free_port()}", job_id=f"hsdp-{os.getpid()}")
    assert argv[0] == "torchrun"
    command = [sys.executable, "-m", "torch.distributed.run", *argv[1:], "--quiet"]
    started = time.perf_counter()
    nodes = [subprocess.Popen(command, env=env) for _ in range(2)]  # the same command on each "node"
    try:
        assert [node.wait(timeout=900) for node in nodes] == [0, 0]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    print(f"\nhsdp 2 x 2 pipeline run: {time.perf_counter() - started:.1f} s")
    other = tmp_path / "run"
    assert sorted(p.name for p in (other / "logs").iterdir()) == [f"rank{r}.log" for r in range(4)]
    assert _statuses(other) == {stage: "done" for stage in STAGES}
    log = (other / "logs" / "rank0.log").read_text()
    assert "parent loaded sharded (hsdp) over 2 of the 4 ranks" in log  # a node's shard per rank
    want, got = _tensors_under(run_dir), _tensors_under(other)
    assert sorted(got) == sorted(want)
    assert any(k.startswith("library") for k in want) and any(k.startswith("exports") for k in want)
    trained_atol = max(data["bld"]["lr"], data["gkd"]["lr"]) / 100
    worst: dict[str, float] = {}
    for path, tensors in want.items():
        assert sorted(got[path]) == sorted(tensors), path
        stage = path.split("/")[0]
        for key, value in tensors.items():
            other_value = got[path][key]
            if value.is_floating_point():
                if stage == "importance":
                    torch.testing.assert_close(other_value, value, rtol=1e-4, atol=1e-7, msg=f"{path} {key}")
                else:
                    torch.testing.assert_close(
                        other_value, value, rtol=0, atol=trained_atol, msg=f"{path} {key}"
                    )
                diff = float((other_value.double() - value.double()).abs().max()) if value.numel() else 0.0
                worst[stage] = max(worst.get(stage, 0.0), diff)
            else:
                assert torch.equal(other_value, value), f"{path} {key}"
    print("hsdp 2 x 2 vs one process, largest difference per stage:", worst)
    for path in (run_dir / "solutions").glob("*.json"):
        assert (
            json.loads(path.read_text())["choices"]
            == json.loads((other / "solutions" / path.name).read_text())["choices"]
        )
    stages = [json.loads((d / "run.json").read_text())["stages"] for d in (run_dir, other)]
    for name, record in stages[0]["assemble"]["outputs"].items():
        measured = stages[1]["assemble"]["outputs"][name]["measured"]["kl"]
        assert measured == pytest.approx(record["measured"]["kl"], rel=1e-4)


def test_two_rounds_the_second_compresses_the_first_child(finished, tmp_path):
    run_dir, _ = finished
    data = config_dict(run_dir.parent, run_dir=str(tmp_path / "run"))
    del data["search"]
    data["rounds"] = {"count": 2, "budgets": [["active_params<=0.9x"], ["active_params<=0.9x"]]}
    assert _run(write_config(tmp_path / "run.yaml", data)) == 0
    first, second = tmp_path / "run", tmp_path / "run" / "round-2"
    (name,) = [p.name for p in (first / "exports").iterdir()]
    manifest = json.loads((second / "run.json").read_text())
    assert manifest["round"] == 2 and manifest["parent"]["path"] == str(first / "exports" / name)
    child = puzzle.load(first / "exports" / name)
    assert (second / "parent.json").read_text() == child.spec.to_json() + "\n"
    assert _statuses(second) == {stage: "done" for stage in STAGES}
    (final,) = [p for p in (second / "exports").iterdir()]
    grandchild = puzzle.load(final)
    assert grandchild.spec != child.spec and sum(p.numel() for p in grandchild.parameters()) < sum(
        p.numel() for p in child.parameters()
    )


def test_a_failing_stage_exits_1_and_logs_its_traceback(finished, tmp_path, capsys):
    run_dir, _ = finished
    data = config_dict(run_dir.parent, run_dir=str(tmp_path / "run"))
    data["data"]["batch_size"] = 10_000  # more sequences than the data has: BLD cannot draw one batch
    # The plan would refuse these batches up front (a BLD variant no longer fits): let the stage fail.
    assert _run(write_config(tmp_path / "run.yaml", data), "--no-plan-check") == 1
    assert "puzzle run: error: the train split" in capsys.readouterr().err
    assert _statuses(tmp_path / "run") == {"importance": "done", "library": "failed"}
    assert "Traceback" in (tmp_path / "run" / "logs" / "rank0.log").read_text()


def test_until_stops_after_the_stage_and_a_later_run_goes_on(finished, tmp_path):
    run_dir, _ = finished
    config = write_config(tmp_path / "run.yaml", config_dict(run_dir.parent, run_dir=str(tmp_path / "run")))
    assert _run(config, "--until", "library") == 0
    assert _statuses(tmp_path / "run") == {"importance": "done", "library": "done"}
    assert _run(config) == 0
    assert _statuses(tmp_path / "run") == {
        s: "reused" if s in ("importance", "library") else "done" for s in STAGES
    }
    _same_outcome(run_dir, tmp_path / "run")


def test_several_solutions_per_budget_are_named_apart(finished, tmp_path):
    run_dir, _ = finished
    data = config_dict(run_dir.parent, run_dir=str(tmp_path / "run"))
    data["search"].update(solutions=2, min_diff=1)
    assert _run(write_config(tmp_path / "run.yaml", data), "--until", "solutions") == 0
    first, second = (
        json.loads((tmp_path / "run" / "solutions" / f"active_params-le-0.8x{suffix}.json").read_text())
        for suffix in ("", "-2")
    )
    assert first["choices"] != second["choices"] and first["objective"] <= second["objective"]
    expected = json.loads((run_dir / "solutions" / "active_params-le-0.8x.json").read_text())
    assert first["choices"] == expected["choices"]


class CountingRun(Run):
    """A Run that counts its loads of the parent (`load_parent`, the body `Run.parent` caches)."""

    def load_parent(self, mode: str = "none"):
        self.loads = getattr(self, "loads", 0) + 1
        return super().load_parent(mode)


def test_every_stage_shares_one_parent_and_leaves_it_unchanged(finished, tmp_path):
    run_dir, _ = finished
    config = write_config(tmp_path / "run.yaml", config_dict(run_dir.parent, run_dir=str(tmp_path / "run")))
    torch.set_num_threads(1)
    pipeline = CountingRun.from_config(config)
    pipeline.all()
    assert _statuses(tmp_path / "run") == {stage: "done" for stage in STAGES}
    assert pipeline.loads == 1
    # No stage changed the shared parent's weights, and the outcome is the one of `puzzle run`.
    fresh = pipeline.load_parent().state_dict()
    shared = pipeline.parent().state_dict()
    assert shared.keys() == fresh.keys()
    for key, value in fresh.items():
        torch.testing.assert_close(shared[key], value, rtol=0, atol=0, msg=key)
    _same_outcome(run_dir, tmp_path / "run")
    # The parent's fingerprint came from its files: their content hashes are cached in the run directory.
    parent = json.loads((tmp_path / "run" / "run.json").read_text())["parent"]
    assert parent["scheme"] == "checkpoint-files-1"
    assert (tmp_path / "run" / "parent_hash.json").is_file()


def test_a_run_dir_of_the_earlier_fingerprint_scheme_is_still_this_parents(finished, tmp_path):
    """run.json of an earlier version holds `fingerprint_model` of the loaded parent (no `scheme`): kept while
    the parent's files are unchanged (not loaded), else checked against a load; not "another parent"."""
    from puzzle.artifacts import fingerprint_model

    run_dir, _ = finished
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    config = write_config(tmp_path / "run.yaml", config_dict(run_dir.parent, run_dir=str(copied)))
    pipeline = Run.from_config(config)
    legacy = fingerprint_model(pipeline.load_parent())
    manifest = json.loads((copied / "run.json").read_text())
    manifest["parent"] = {"path": manifest["parent"]["path"], "fingerprint": legacy}
    for files in (pipeline._parent_files(), "files of another time"):
        manifest["parent"]["files"] = files
        (copied / "run.json").write_text(json.dumps(manifest))
        assert CountingRun.from_config(config).parent_fingerprint() == legacy
    pipeline = CountingRun.from_config(config)
    assert pipeline.run("importance")  # its record was keyed by the new fingerprint: recomputed
    assert _statuses(copied)["importance"] == "done" and pipeline.loads == 1


def test_rerank_keeps_the_candidate_of_least_measured_kl(finished, tmp_path):
    """search.rerank: 3 measures the MIP's 3 best and keeps the least measured KL, recording every one;
    rerank: 1 is today's search, file for file."""
    run_dir, _ = finished
    data = config_dict(run_dir.parent, run_dir=str(tmp_path / "run"))
    data["search"].update(rerank=3)
    config = write_config(tmp_path / "run.yaml", data)
    assert _run(config, "--until", "assemble") == 0
    name = "active_params-le-0.8x"
    record = json.loads((tmp_path / "run" / "run.json").read_text())["stages"]
    reranked = record["solutions"]["outputs"][name]["rerank"]
    candidates = reranked["candidates"]
    assert [c["candidate"] for c in candidates] == [1, 2, 3]
    # The candidates are the MIP's 3 best in order: the first is the plain search's solution.
    expected = json.loads((run_dir / "solutions" / f"{name}.json").read_text())
    assert candidates[0]["choices"] == expected["choices"]
    objectives = [c["objective"] for c in candidates]
    assert objectives == sorted(objectives) and len({str(c["choices"]) for c in candidates}) == 3
    least = min(candidates, key=lambda c: c["measured_kl"])
    assert reranked["chosen"] == least["candidate"]
    saved = json.loads((tmp_path / "run" / "solutions" / f"{name}.json").read_text())
    assert saved["choices"] == least["choices"] and saved["objective"] == least["objective"]
    assert sorted(p.stem for p in (tmp_path / "run" / "solutions").glob("*.json")) == [name]
    # The assemble stage measures the chosen child again, independently: the same KL as the candidate's.
    measured = record["assemble"]["outputs"][name]["measured"]
    assert measured["kl"] == pytest.approx(least["measured_kl"], rel=1e-6)
    assert measured["predicted_kl"] == pytest.approx(least["predicted_kl"], rel=1e-9)

    data = config_dict(run_dir.parent, run_dir=str(tmp_path / "one"))
    data["search"].update(rerank=1)
    assert _run(write_config(tmp_path / "one.yaml", data), "--until", "solutions") == 0
    path = Path("solutions") / f"{name}.json"
    one, today = (json.loads((root / path).read_text()) for root in (tmp_path / "one", run_dir))
    assert {**one, "seconds": 0} == {**today, "seconds": 0}  # all but the solver's time
    outputs = json.loads((tmp_path / "one" / "run.json").read_text())["stages"]["solutions"]["outputs"]
    assert "rerank" not in outputs[name]


def test_rerank_and_context_rounds_together_record_both(finished, tmp_path):
    """Scores in context refine the MIP's best, then re-ranking measures it against the other candidates: the
    saved solution is the least measured of them, and the stage records both."""
    run_dir, _ = finished
    data = config_dict(run_dir.parent, run_dir=str(tmp_path / "run"))
    data["search"].update(rerank=2, context_rounds=1)
    assert _run(write_config(tmp_path / "run.yaml", data), "--until", "solutions") == 0
    name = "active_params-le-0.8x"
    entry = json.loads((tmp_path / "run" / "run.json").read_text())["stages"]["solutions"]["outputs"][name]
    rounds, candidates = entry["context"]["rounds"], entry["rerank"]["candidates"]
    # The first candidate re-ranked is the architecture the context rounds kept.
    assert candidates[0]["choices"] == rounds[entry["context"]["kept"]]["choices"]
    least = min(candidates, key=lambda c: c["measured_kl"])
    saved = json.loads((tmp_path / "run" / "solutions" / f"{name}.json").read_text())
    assert saved["choices"] == least["choices"]


def test_rerank_under_two_gloo_processes_matches_one(finished, tmp_path):
    """search.rerank under `torchrun --nproc-per-node 2`: rank 0 solves, both ranks measure the candidates
    (a collective: a rank left out would hang), and the choice and figures are those of one process."""
    run_dir, _ = finished
    records = {}
    for ranks in (1, 2):
        data = config_dict(run_dir.parent, run_dir=str(tmp_path / f"run{ranks}"))
        data["search"].update(rerank=3)
        config = write_config(tmp_path / f"run{ranks}.yaml", data)
        if ranks == 1:
            assert _run(config, "--until", "solutions") == 0
        else:
            torchrun_puzzle(2, "run", str(config), "--quiet", "--until", "solutions")
        stages = json.loads((tmp_path / f"run{ranks}" / "run.json").read_text())["stages"]
        records[ranks] = stages["solutions"]["outputs"]["active_params-le-0.8x"]["rerank"]
    one, two = records[1], records[2]
    assert two["chosen"] == one["chosen"] and len(two["candidates"]) == len(one["candidates"]) == 3
    for want, got in zip(one["candidates"], two["candidates"]):
        assert got["choices"] == want["choices"]
        # The library was trained data-parallel on two ranks: equal up to summation order.
        assert got["measured_kl"] == pytest.approx(want["measured_kl"], rel=1e-3)


def test_scores_in_context_rescore_the_child_and_keep_the_best_measured(finished, tmp_path):
    """search.context_rounds: the first round is the plain search's (R=0) solution; each later round scores
    every candidate in the previous child, where the child's own choices score exactly 0, a child one block
    away is predicted exactly (D(child) + its score = its measured KL), and the kept round measured lowest."""
    from puzzle.assemble import assemble, measured_kl
    from puzzle.context import child_variants, context_candidates
    from puzzle.library import read_library
    from puzzle.score import load_scores

    run_dir, _ = finished
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    data = config_dict(run_dir.parent, run_dir=str(copied))
    data["search"]["context_rounds"] = 2
    config = write_config(tmp_path / "run.yaml", data)
    assert _run(config, "--until", "assemble") == 0
    name = "active_params-le-0.8x"
    stages = json.loads((copied / "run.json").read_text())["stages"]
    plain = json.loads((run_dir / "run.json").read_text())["stages"]["solutions"]
    assert "context" not in plain["outputs"][name] and "context_rounds" not in plain["inputs"]["search"]
    assert "context_guard" not in plain["inputs"]["search"]  # off with the rounds: runs before it are reused
    record = stages["solutions"]["outputs"][name]["context"]
    rounds = record["rounds"]
    expected = json.loads((run_dir / "solutions" / f"{name}.json").read_text())
    assert rounds[0]["choices"] == expected["choices"]  # R=0's solution, exactly
    assert 2 <= len(rounds) <= 3 and all("measured" in entry for entry in rounds)
    assert record["kept"] == min(range(len(rounds)), key=lambda r: (rounds[r]["measured"], r))
    # The prediction in context is closer to the measured KL than the parent-context one (here exact: the
    # tiny run's second round re-chooses the first child, whose KL its constant is).
    error = [abs(entry["predicted"] - entry["measured"]) for entry in rounds]
    assert error[1] < error[0]
    saved = json.loads((copied / "solutions" / f"{name}.json").read_text())
    assert saved["choices"] == rounds[record["kept"]]["choices"]
    # The assembled child's measured KL (another code path: compare_models) is the kept round's.
    measured = stages["assemble"]["outputs"][name]["measured"]
    assert measured["kl"] == pytest.approx(rounds[record["kept"]]["measured"], rel=1e-5, abs=1e-7)
    assert measured["predicted_kl"] == pytest.approx(rounds[record["kept"]]["predicted"])

    pipeline = Run.from_config(config)
    problem = pipeline.problem(["active_params<=0.8x"])
    first = Solution.from_json({**expected}, problem.table)
    own = child_variants(first, problem.candidates)
    scores = load_scores(copied / "solutions" / "context" / name / "round-1")
    rescored, base = context_candidates(problem.candidates, scores.variants, own, "kl")
    assert base == pytest.approx(rounds[0]["measured"]) and base > 0
    for block, variant in enumerate(own):  # the child's own choices score exactly 0
        assert rescored.scores[block][rescored.variants[block].index(variant.spec)] == 0.0
    assert any(v != 0.0 for values in rescored.scores for v in values)
    # Predicted = measured exactly (to float noise) for a child one block away from the first one.
    block, index = next(
        (b, i) for b, values in enumerate(rescored.scores) for i, v in enumerate(values) if v != 0.0
    )
    neighbour = {v.block_index: v for v in own}
    neighbour[block] = type(own[0])(block, rescored.variants[block][index])
    parent = pipeline.parent()
    child = assemble(
        neighbour, read_library(copied / "library"), parent, parent_fp=pipeline.parent_fingerprint()
    )
    got = measured_kl(child, parent, pipeline.held_out_batches(), 16)["kl"]
    assert base + rescored.scores[block][index] == pytest.approx(got, rel=1e-5, abs=1e-7)
    print("\ncontext rounds:", json.dumps(rounds, indent=1))


def test_a_trust_region_changes_at_most_k_blocks_and_predicts_one_change_exactly(finished, tmp_path):
    """search.context_changes: 1 bounds each round to one block changed from the previous child, where the
    scores in context are exact: the round's prediction is the measured KL of its child."""
    run_dir, _ = finished
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    data = config_dict(run_dir.parent, run_dir=str(copied))
    data["search"].update(context_rounds=1, context_changes=1)
    config = write_config(tmp_path / "run.yaml", data)
    assert _run(config, "--until", "solutions") == 0
    name = "active_params-le-0.8x"
    rounds = json.loads((copied / "run.json").read_text())["stages"]["solutions"]["outputs"][name]["context"][
        "rounds"
    ]
    first, second = rounds[0]["choices"], rounds[1]["choices"]
    changed = [block for block in first if first[block] != second[block]]
    assert len(changed) <= 1
    if changed:  # one block away from the child it was scored in: exact, to float noise
        assert rounds[1]["predicted"] == pytest.approx(rounds[1]["measured"], rel=1e-5, abs=1e-7)

    # The bounded search is the best architecture within the budget and k changes: brute force over all.
    import itertools

    import numpy as np

    from puzzle.context import child_variants, limit_changes
    from puzzle.search import search
    from puzzle.search.mip import feasible_choices, resolve_limits

    pipeline = Run.from_config(config)
    expected = json.loads((run_dir / "solutions" / f"{name}.json").read_text())
    plain = pipeline.problem(["active_params<=0.8x"])
    own = child_variants(Solution.from_json(expected, plain.table), plain.candidates)
    for most in (1, 2):
        problem = limit_changes(pipeline.problem(["active_params<=0.9x"]), own, most)
        table, limits, rules = problem.table, problem.problem.limits, problem.problem.rules
        found = search(table, limits, rules)
        sizes = np.diff(table.offsets)
        every = np.array(list(itertools.product(*(range(n) for n in sizes))))
        ok = feasible_choices(table, every, resolve_limits(table, limits), rules)
        scores = table.score[table.offsets[:-1][None, :] + every].sum(axis=1)
        assert found.objective == pytest.approx(scores[ok].min(), rel=1e-9, abs=1e-12)
        own_rows = [problem.candidates.variants[v.block_index].index(v.spec) for v in own]
        assert sum(a != b for a, b in zip(found.choices, own_rows)) <= most


def test_a_context_round_beyond_the_guard_keeps_the_measured_child_end_to_end(finished, tmp_path, capsys):
    """search.context_guard through `puzzle run` on real scores in context: with the top-1 disagreement as
    the objective at 0.8x, round 1 changes the child and predicts below the disagreement its child measured.
    A factor below that ratio refuses the round: the saved solution is round 0's, the refused child is never
    measured, run.json records why, and the log and stderr (a warning, so under --quiet too) say it."""
    run_dir, _ = finished
    name = "active_params-le-0.8x"
    records = {}
    for label, guard in (("off", 0), ("on", None)):
        copied = tmp_path / label
        shutil.copytree(run_dir, copied)
        data = config_dict(run_dir.parent, run_dir=str(copied))
        data["search"].update(context_rounds=2, objective="top1")
        if guard is None:  # just below the ratio the unguarded round 1 moved by, whatever it is exactly
            rounds = records["off"]["rounds"]
            ratio = rounds[0]["measured"] / rounds[1]["predicted"]
            guard = 1 + (ratio - 1) / 2
        data["search"]["context_guard"] = guard
        capsys.readouterr()
        assert _run(write_config(tmp_path / f"{label}.yaml", data), "--until", "solutions") == 0
        outputs = json.loads((copied / "run.json").read_text())["stages"]["solutions"]["outputs"]
        records[label] = outputs[name]["context"]
    off, on = records["off"], records["on"]
    # The unguarded round 1 changes the child and predicts a lower disagreement than it measured.
    assert off["rounds"][1]["choices"] != off["rounds"][0]["choices"] and "stopped" not in off
    assert off["rounds"][0]["measured"] / off["rounds"][1]["predicted"] > 1
    rounds = on["rounds"]
    assert on["stopped"] == 1 and on["kept"] == 0 and len(rounds) == 2 and "measured" not in rounds[1]
    assert rounds[0] == off["rounds"][0] and rounds[1]["predicted"] == off["rounds"][1]["predicted"]
    assert "x below the last measured child's" in rounds[1]["rejected"]
    assert f"guard factor {guard:g}" in rounds[1]["rejected"]
    saved = json.loads((tmp_path / "on" / "solutions" / f"{name}.json").read_text())
    assert saved["choices"] == rounds[0]["choices"] and saved["objective"] == rounds[0]["predicted"]
    assert not list((tmp_path / "on" / "solutions" / "context" / name).glob("measured-*"))
    log = (tmp_path / "on" / "logs" / "rank0.log").read_text()
    line = f"search {name}, context round 1 not taken: {rounds[1]['rejected']}"
    assert line in log and line in capsys.readouterr().err
    # The report tables the rounds from run.json: round 0 kept, round 1 not taken, with the reason.
    report = write_report(tmp_path / "on").read_text()
    assert "## Scores in context" in report
    assert (
        f"| {name} | 1 | {_format(rounds[1]['predicted'])} | - | not taken: {rounds[1]['rejected']} |"
        in report
    )
    assert (
        f"| {name} | 0 | {_format(rounds[0]['predicted'])} | {_format(rounds[0]['measured'])} | kept |"
        in report
    )


def test_predictions_around_a_child_are_exact_for_it_and_one_block_away(finished, tmp_path):
    """Run.scores_in_context scores every candidate in a searched child (cached in the run directory) and
    puzzle.context.predict_in_context predicts from them: the child itself and a child one block away exactly
    (their measured KL, another code path), two blocks away the sum of both changes."""
    from puzzle.assemble import assemble, measured_kl
    from puzzle.context import child_variants, predict_in_context
    from puzzle.library import read_library
    from puzzle.search import SearchError
    from puzzle.spec import Variant

    run_dir, _ = finished
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied)
    config = write_config(tmp_path / "run.yaml", config_dict(run_dir.parent, run_dir=str(copied)))
    pipeline = Run.from_config(config)
    name = "active_params-le-0.8x"
    problem = pipeline.problem(["active_params<=0.8x"])
    expected = json.loads((run_dir / "solutions" / f"{name}.json").read_text())
    own = child_variants(Solution.from_json(expected, problem.table), problem.candidates)
    wanted = [Variant(b, spec) for b, specs in enumerate(problem.candidates.variants) for spec in specs]
    scores = pipeline.scores_in_context(name, own, wanted).variants
    assert len(list((copied / "solutions" / "context" / name).glob("predict-*"))) == 1
    parent, library = pipeline.parent(), read_library(copied / "library")

    def measured(variants: list[Variant]) -> float:
        child = assemble(
            {v.block_index: v for v in variants}, library, parent, parent_fp=pipeline.parent_fingerprint()
        )
        return measured_kl(child, parent, pipeline.held_out_batches(), 16)["kl"]

    base = predict_in_context(scores, own, own, "kl")
    assert base == pytest.approx(measured(own), rel=1e-5, abs=1e-7)
    changes = [
        Variant(b, spec)
        for b, specs in enumerate(problem.candidates.variants)
        for spec in specs
        if Variant(b, spec) not in own
    ]
    first = changes[0]
    second = next(v for v in changes if v.block_index != first.block_index)
    one = [first if v.block_index == first.block_index else v for v in own]
    assert predict_in_context(scores, own, one, "kl") == pytest.approx(measured(one), rel=1e-5, abs=1e-7)
    two = [second if v.block_index == second.block_index else v for v in one]
    each = [
        predict_in_context(scores, own, [c if v.block_index == c.block_index else v for v in own], "kl")
        for c in (first, second)
    ]
    assert predict_in_context(scores, own, two, "kl") == pytest.approx(each[0] + each[1] - base)
    with pytest.raises(SearchError, match="blocks"):
        predict_in_context(scores, own, two[:-1], "kl")
    # Cached: scoring again in the same child reads the records back and writes nothing.
    folder = next((copied / "solutions" / "context" / name).glob("predict-*"))
    written = {path: path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()}
    again = pipeline.scores_in_context(name, own, wanted).variants
    assert all(again[v].kl == scores[v].kl for v in wanted)
    assert {path: path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()} == written


@pytest.mark.slow
def test_scores_in_context_under_two_gloo_processes_match_one(finished, tmp_path):
    """search.context_rounds under `torchrun --nproc-per-node 2` (scoring sharded with FSDP, the child too):
    every rank scores, rank 0 solves; the rounds are those of one process."""
    run_dir, _ = finished
    records = {}
    for ranks in (1, 2):
        copied = tmp_path / f"run{ranks}"
        shutil.copytree(run_dir, copied)
        data = config_dict(run_dir.parent, run_dir=str(copied))
        data["search"]["context_rounds"] = 2
        config = write_config(tmp_path / f"run{ranks}.yaml", data)
        torchrun_puzzle(ranks, "run", str(config), "--quiet", "--until", "solutions")
        stages = json.loads((copied / "run.json").read_text())["stages"]
        records[ranks] = stages["solutions"]["outputs"]["active_params-le-0.8x"]["context"]
    one, two = records[1], records[2]
    assert [r["choices"] for r in two["rounds"]] == [r["choices"] for r in one["rounds"]]
    assert two["kept"] == one["kept"]
    for want, got in zip(one["rounds"], two["rounds"]):
        assert got["measured"] == pytest.approx(want["measured"], rel=1e-5)


def test_each_stage_records_what_it_cost_and_the_report_sets_it_beside_the_plan(finished, tmp_path):
    """run.json's record of each stage that ran holds its wall time, ranks and peak memory per rank; the
    report's stage table gives each beside `puzzle plan`'s time for the run's config (a finite ratio)."""
    from puzzle.report import write_report

    run_dir, _ = finished
    stages = json.loads((run_dir / "run.json").read_text())["stages"]
    ran = {name: record for name, record in stages.items() if "measured" in record}
    assert {"importance", "library", "scores", "assemble", "distill"} <= {n.split("/")[0] for n in ran}
    for record in ran.values():
        measured = record["measured"]
        assert measured["seconds"] >= 0 and measured["ranks"] == 1
        assert measured["cpu_seconds"] >= 0  # rank 0's CPU time in the stage
        assert len(measured["peak_rss_mib"]) == 1 and measured["peak_rss_mib"][0] > 0
    text = write_report(run_dir, tmp_path / "report").read_text()
    section = text.split("## Stages, planned and measured")[1].split("\n## ")[0]
    assert "_No plan" not in section
    library = next(line for line in section.splitlines() if line.startswith("| library "))
    ratio = library.split(" | ")[4]  # stage, measured s, CPU s, planned s, measured / planned
    assert ratio not in ("-", "") and float(ratio.replace(",", "")) > 0
