"""`puzzle search RUN_DIR` on a tiny real run (BLD library + scores) against brute force over every architecture.

The oracle enumerates every combination of the run's usable variants, costs each whole child spec with the
cost model's whole-model functions (`model_active_params`, `model_performance`, `max_concurrent_requests`)
and sums the scores read from scores.json: it shares neither the table construction nor the solver.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from bld_helpers import SPEC
from rundir_helpers import BLD_FAILURE, SCORE_FAILURE, make_run

from puzzle import cli
from puzzle.artifacts import Artifact, json_writer
from puzzle.config import load_config
from puzzle.cost import (
    max_concurrent_requests,
    model_active_params,
    model_params,
    model_performance,
    state_bytes_per_request,
)
from puzzle.cost.analytic import model_weight_bytes
from puzzle.cost.hardware import HardwareProfile, profile_from_json, profile_to_json
from puzzle.library import read_library
from puzzle.presets import tiny_hybrid
from puzzle.problem import CostModel, parse_scenario, run_problem, search_run
from puzzle.run import Run
from puzzle.run.solutions import solve_all
from puzzle.scores import SCORES_FILE, load_scores
from puzzle.spec import ModelSpec

HARDWARE = "h100-80gb"
SCENARIOS = ["chat:batch=8,prompt=512,generated=128", "long:batch=2,prompt=8k,generated=64"]
CHAT, LONG = (parse_scenario(text, {}) for text in SCENARIOS)
LONG_FP8 = parse_scenario("long:batch=2,prompt=8k,generated=64,kv_dtype=fp8", {})
SCENARIO_ARGS = [arg for text in SCENARIOS for arg in ("--scenario", text)]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    os.environ.setdefault("PUZZLE_PROGRESS", "0")
    return make_run(tmp_path_factory.mktemp("run") / "run").root


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _candidates(run: Path, metric: str) -> list[list[tuple[str, object, float]]]:
    """Per block: (variant id, spec, objective) of the parent's block and of every usable library variant."""
    library, scores = read_library(run / "library"), load_scores(run / "scores")
    blocks = [[(block.short_name(), block, 0.0)] for block in SPEC.blocks]
    for variant, result in library.results.items():
        record = scores.variants.get(variant)
        if result.status == "failed" or variant.spec == SPEC.blocks[variant.block_index]:
            continue
        if record.failed is not None:
            continue
        value = getattr(record, metric)
        blocks[variant.block_index].append(
            (variant.id, variant.spec, 1 - value if metric == "top1" else value)
        )
    return blocks


def _brute_force(run: Path, metric: str, feasible) -> tuple[float | None, list[dict[str, str]], int]:
    """(best objective, every optimal architecture as {block: variant id}, how many are feasible)."""
    best, optimal, count = None, [], 0
    for combo in itertools.product(*_candidates(run, metric)):
        child = ModelSpec(SPEC.vocab_size, SPEC.hidden_size, tuple(spec for _, spec, _ in combo))
        if not feasible(child):
            continue
        count += 1
        value = sum(score for _, _, score in combo)
        names = {f"block_{i}": name for i, (name, _, _) in enumerate(combo)}
        if best is None or value < best - 1e-12:
            best, optimal = value, [names]
        elif abs(value - best) <= 1e-12:
            optimal.append(names)
    return best, optimal, count


def _tokens_per_s(spec: ModelSpec, scenario) -> float:
    return model_performance(spec, scenario, HARDWARE).output_tokens_per_s


def _requests(spec: ModelSpec, scenario) -> int:
    context = scenario.prompt_tokens + scenario.generated_tokens
    return max_concurrent_requests(spec, HARDWARE, context, "bf16", "bf16", 0.9, "fp32")


def _memory(spec: ModelSpec, scenario) -> float:
    context = scenario.prompt_tokens + scenario.generated_tokens
    return model_weight_bytes(spec, "bf16") + scenario.batch_size * state_bytes_per_request(
        spec, context, "bf16"
    )


PARENT_REQUESTS = _requests(SPEC, LONG)
EPS = 1e-9
CASES = {
    "active-relative": (
        ["active_params<=0.6x"],
        "kl",
        lambda c: model_active_params(c) <= 0.6 * model_active_params(SPEC),
    ),
    "throughput-relative": (
        ["throughput[chat]>=1.6x"],
        "kl",
        lambda c: _tokens_per_s(c, CHAT) >= 1.6 * _tokens_per_s(SPEC, CHAT) * (1 - EPS),
    ),
    "params-and-two-scenarios": (
        ["params<=4.6k", "throughput[chat,long]>=1.25x"],
        "kl",
        lambda c: (
            model_params(c) <= 4600
            and all(_tokens_per_s(c, s) >= 1.25 * _tokens_per_s(SPEC, s) * (1 - EPS) for s in (CHAT, LONG))
        ),
    ),
    "top1-latency-absolute": (
        ["latency[long]<=0.0012"],
        "top1",
        lambda c: model_performance(c, LONG, HARDWARE).total_s <= 0.0012,
    ),
    "loss-memory-concurrency": (
        ["memory_bytes[chat]<=0.8x", f"concurrent_requests[long]>={int(PARENT_REQUESTS * 1.15)}"],
        "lm_loss_delta",
        lambda c: (
            _memory(c, CHAT) <= 0.8 * _memory(SPEC, CHAT) * (1 + EPS)
            and _requests(c, LONG) >= int(PARENT_REQUESTS * 1.15)
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_run_dir_search_is_the_brute_force_optimum(run, capsys, case):
    budgets, metric, feasible = CASES[case]
    best, optimal, count = _brute_force(run, metric, feasible)
    # The budget binds (the parent itself is over it) and leaves a choice (of the 54 architectures).
    assert not feasible(SPEC) and count > 1
    argv = ["search", str(run), *SCENARIO_ARGS, "--objective", metric, "--json"]
    code, out, err = _cli([*argv, *(arg for b in budgets for arg in ("--budget", b))], capsys)
    assert code == 0, err
    answer = json.loads(out)
    assert answer["status"] == "optimal"
    assert answer["objective"] == pytest.approx(best, abs=1e-9)
    assert answer["choices"] in optimal
    # The totals are the cost model's whole-model figures of the chosen child.
    chosen = {name: spec for block in _candidates(run, metric) for name, spec, _ in block}
    child = ModelSpec(SPEC.vocab_size, SPEC.hidden_size, tuple(chosen[v] for v in answer["choices"].values()))
    assert answer["totals"]["active_params"] == model_active_params(child)
    assert answer["totals"]["params"] == model_params(child)
    if case == "throughput-relative":
        seconds = answer["totals"]["seconds[chat]"]
        assert CHAT.batch_size * CHAT.generated_tokens / seconds == pytest.approx(_tokens_per_s(child, CHAT))


def test_failed_variants_are_left_out_with_a_note(run, capsys):
    code, _, err = _cli(["search", str(run), "--budget", "active_params<=0.7x"], capsys)
    assert code == 0
    for variant, stage in ((BLD_FAILURE, "BLD failed"), (SCORE_FAILURE, "scoring failed")):
        line = f"note: block {variant.block_index} variant {variant.id} left out: {stage}"
        assert line in err
    table = run_problem(run, ["active_params<=0.7x"]).table
    assert [len(names) for names in table.variant_names] == [2, 3, 3, 3, 1, 1]
    assert "linear" not in table.variant_names[1] and "linear" not in table.variant_names[3]


def test_python_api_gives_the_cli_answer(run, capsys):
    cost_model = CostModel(profile=HARDWARE, scenarios={"chat": CHAT})
    notes = []
    solution = search_run(run, ["throughput[chat]>=1.6x"], cost_model=cost_model, note=notes.append)
    code, out, _ = _cli(
        ["search", str(run), *SCENARIO_ARGS, "--budget", "throughput[chat]>=1.6x", "--json"], capsys
    )
    assert code == 0 and json.loads(out)["choices"] == solution.names
    assert len(notes) == 2


def test_infeasible_budget_exits_2_with_the_best_reachable_value(run, capsys):
    smallest = min(
        model_active_params(ModelSpec(SPEC.vocab_size, SPEC.hidden_size, tuple(s for _, s, _ in combo)))
        for combo in itertools.product(*_candidates(run, "kl"))
    )
    code, out, err = _cli(["search", str(run), "--budget", "active_params<=0.3x", "--json"], capsys)
    assert code == 2
    answer = json.loads(out)
    assert answer["status"] == "infeasible" and answer["budget"] == "active_params<=0.3x"
    assert answer["best"] == smallest
    assert (
        "infeasible: budget active_params<=0.3x" in err and f"best this library reaches is {smallest}" in err
    )
    code, _, err = _cli(["search", str(run), *SCENARIO_ARGS, "--budget", "throughput[long]>=5x"], capsys)
    assert code == 2 and "(seconds[long]<=0.2x is --budget 'throughput[long]>=5x')" in err
    assert "did you mean" not in err  # factors both: nothing to suggest
    # The `x` left out: at most 0.3 parameters; the last line says what was likely meant.
    code, _, err = _cli(["search", str(run), "--budget", "active_params<=0.3"], capsys)
    parent = f"{model_active_params(SPEC):,}"
    assert code == 2 and err.splitlines()[-1] == (
        f"puzzle search: budget 'active_params<=0.3' bounds the parameters used per token at 0.3 (the parent's: "
        f"{parent}); did you mean active_params<=0.3x?"
    )


@pytest.mark.parametrize(
    ("remove", "named", "stage"),
    [
        ("scores", "scores", "the scoring stage"),
        ("scores/scores.manifest.json", "scores/scores.manifest.json", "the scoring stage"),
        ("library", "library", "the BLD stage"),
        ("parent.json", "parent.json", "RunLayout.write_parent"),
    ],
)
def test_a_missing_stage_output_is_a_clear_error(run, tmp_path, capsys, remove, named, stage):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    target = copy / remove
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    code, out, err = _cli(["search", str(copy), "--budget", "active_params<=0.7x"], capsys)
    assert code == 1 and out == ""
    assert f"{copy / named} does not exist" in err and stage in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def _listing(*roots: Path) -> dict[str, tuple[int, int]]:
    return {
        str(path): (path.stat().st_size, path.stat().st_mtime_ns)
        for root in roots
        for path in sorted(root.rglob("*"))
    }


def test_out_writes_the_answer_and_nothing_else_is_written(run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["search", str(run), *SCENARIO_ARGS, "--budget", "throughput[chat,long]>=1.2x", "--json"]
    before = _listing(run, tmp_path)
    code, out, _ = _cli(argv, capsys)
    assert code == 0 and _listing(run, tmp_path) == before  # no --out: not a byte written, nothing retrained
    code, again, err = _cli([*argv, "--out", "answers/solution.json"], capsys)
    assert code == 0
    written = tmp_path / "answers" / "solution.json"
    after = _listing(run, tmp_path)
    assert set(after) - set(before) == {str(written.parent), str(written)}
    assert {k: v for k, v in after.items() if k in before} == before
    answer, saved = json.loads(again), json.loads(written.read_text())
    assert saved == answer and answer["choices"] == json.loads(out)["choices"]
    assert f"wrote {Path('answers/solution.json')}" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["search"], "give either RUN_DIR or --library FILE"),
        (["search", "@run", "--library", "x.json"], "give either RUN_DIR or --library FILE, not both"),
        (["search", "--library", "x.json", "--hardware", "b200"], "--hardware does not apply with --library"),
        (["search", "--library", "x.json", "--out", "o.json"], "--out does not apply with --library"),
        (["search", "@run", "--fixed", "stats.x=1"], "--fixed does not apply with RUN_DIR"),
        (["search", "@run", "--maximize"], "--maximize does not apply with RUN_DIR"),
        (["search", "@run", "--sweep", "params=1,2"], "--sweep does not apply with RUN_DIR"),
        (["search", "@run", "--objective", "metrics.kl_div"], "not a recorded metric"),
        (
            ["search", "@run", "--budget", "throughput[chat]>=1.6x"],
            "names scenario 'chat', which is not defined",
        ),
        (["search", "@run", "--budget", "throughput>=1.6x"], "throughput needs scenarios"),
        (
            ["search", "@run", "--budget", "active_params>=0.5x"],
            "active_params takes a bound active_params<=VALUE",
        ),
        (["search", "@run", "--budget", "stats.memory_mib<=9"], "unknown key 'stats.memory_mib'"),
        (["search", "@run", "--scenario", "chat:batch=8"], "scenario 'chat' needs prompt, generated"),
        (["search", "@run", "--scenario", "chat:batch=8,prompt=1,generated=1,kv_dtype=int3"], "int3"),
        (["search", "@run", "--hardware", "tpu"], "unknown hardware 'tpu'"),
        (["search", "@run", "--same", "stats.x"], "a run's variants have state_size, top_k and kind"),
        (["search", "@run", "--budget", "active_params<=0.8x", "--rerank", "3"], "set search.rerank: 3"),
    ],
)
def test_bad_command_lines_exit_2(run, capsys, argv, message):
    argv = [str(run) if arg == "@run" else arg for arg in argv]
    code, _, err = _cli(argv, capsys)
    assert code == 2 and message in err, err
    assert "Traceback" not in err


def test_another_parent_is_an_error_naming_the_block(run, capsys):
    code, out, err = _cli(["search", str(run), "--parent", "tiny-hybrid", "--budget", "params<=1x"], capsys)
    assert code == 1 and out == "" and "Traceback" not in err
    assert f"{run / 'library'} was built from another parent: BLD recorded block 0 variant" in err
    assert f"this parent's block 0 is {tiny_hybrid().blocks[0].short_name()}" in err


def test_two_solutions_are_the_two_best_architectures(run, capsys):
    budgets, metric, feasible = CASES["throughput-relative"]
    values = sorted(
        sum(score for _, _, score in combo)
        for combo in itertools.product(*_candidates(run, metric))
        if feasible(ModelSpec(SPEC.vocab_size, SPEC.hidden_size, tuple(spec for _, spec, _ in combo)))
    )
    argv = ["search", str(run), *SCENARIO_ARGS, "--budget", budgets[0], "--solutions", "2", "--json"]
    code, out, err = _cli(argv, capsys)
    assert code == 0, err
    first, second = json.loads(out)
    assert [first["objective"], second["objective"]] == pytest.approx(values[:2], abs=1e-9)
    assert first["choices"] != second["choices"]


def test_a_library_variant_without_a_score_is_an_error_naming_it(run, tmp_path, capsys):
    """scores.json rewritten (through its artifact, as the scoring stage writes it) without one variant."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    artifact = Artifact(copy / "scores", "scores", 1)
    content = artifact.load_json(SCORES_FILE)
    content["variants"] = [r for r in content["variants"] if r["variant"]["id"] != "attn:q4:kv1:d4"]
    artifact.write(artifact.read_manifest().inputs, {SCORES_FILE: json_writer(content)})
    code, out, err = _cli(["search", str(copy), "--budget", "active_params<=0.7x"], capsys)
    assert code == 1 and out == ""
    assert f"{copy / 'scores' / SCORES_FILE} has no score for block 1 variant attn:q4:kv1:d4" in err


# -- the run's own settings and its stored calibration of this machine ----------------------------------

# A this-machine calibration no measurement produces: figures priced with it come from the stored file.
STORED = HardwareProfile(
    "this-machine",
    (("fp32", 5e10),),
    2e10,
    2**30,
    op_overhead_s=4e-6,
    eager=True,
    few_rows_flops=1e10,
    source="tests: stored by hand",
)
RUN_SETTINGS = {
    # The run prices on this machine (its stored calibration); h100-80gb, the default, chooses otherwise.
    "hardware": (
        {
            "profile": "this-machine",
            "scenarios": {
                "long": {"batch_size": 2, "prompt_tokens": 8000, "generated_tokens": 64, "kv_dtype": "fp8"}
            },
        },
        {"budgets": ["latency[long]<=0.8x"]},
        ["--hardware", "h100-80gb"],
        {"cost_model": CostModel("h100-80gb", scenarios={"long": LONG_FP8})},
    ),
    # The run's objective, state-size rule and memory fraction; --objective kl chooses otherwise.
    "search": (
        {
            "memory_fraction": 0.5,
            "scenarios": {"chat": {"batch_size": 8, "prompt_tokens": 512, "generated_tokens": 128}},
        },
        {"objective": "lm_loss_delta", "shared_state_size": False, "budgets": ["throughput[chat]>=1.3x"]},
        ["--objective", "kl"],
        {
            "cost_model": CostModel(memory_fraction=0.5, scenarios={"chat": CHAT}),
            "shared_state_size": False,
        },
    ),
}


def _saved_run(
    run: Path, root: Path, hardware: dict, search: dict, config_file: str = "run.resolved.yaml"
) -> Path:
    """A copy of `run` with a saved run config (as `puzzle run` saves it) and the calibration STORED."""
    shutil.copytree(run, root)
    (root / config_file).write_text(
        yaml.safe_dump(
            {
                "run_dir": str(root),
                "parent": {"path": str(root / "parent")},
                "data": {"sources": [str(root / "corpus.txt")], "seq_len": 8},
                "space": {"kinds": {"mlp": {"width_fraction": [0.5]}}},
                "search": search,
                "hardware": hardware,
            }
        )
    )
    (root / "hardware.json").write_text(json.dumps(profile_to_json(STORED)))
    return root


def _same_answer(answer: dict, solution: dict) -> None:
    for key in ("choices", "objective", "totals"):
        assert answer[key] == solution[key], key


@pytest.mark.parametrize("config_file", ["run.resolved.yaml", "config.yaml"])  # config.yaml: older runs
@pytest.mark.parametrize("case", list(RUN_SETTINGS))
def test_search_of_a_run_directory_is_the_runs_own_solution(run, tmp_path, capsys, case, config_file):
    hardware, search, flag, override = RUN_SETTINGS[case]
    root = _saved_run(run, tmp_path / "run", hardware, search, config_file)
    config = load_config(root / config_file)
    saved = solve_all(Run(root, config))  # the run's solutions stage
    (name,) = saved
    solution = json.loads((root / saved[name]["file"]).read_text())
    budgets = [arg for text in search["budgets"] for arg in ("--budget", text)]
    code, out, err = _cli(["search", str(root), *budgets, "--json"], capsys)
    assert code == 0, err
    _same_answer(json.loads(out), solution)
    # Without --budget: the run's own budgets, as every other setting (not the parent, unconstrained).
    code, out, err = _cli(["search", str(root), "--json"], capsys)
    assert code == 0 and f"puzzle search: note: the run's budgets: {', '.join(search['budgets'])}\n" in err
    _same_answer(json.loads(out), solution)
    # A flag overrides the one setting it names; the rest is still the run's.
    expected = search_run(root, search["budgets"], note=lambda _: None, **override)
    code, out, err = _cli(["search", str(root), *budgets, *flag, "--json"], capsys)
    assert code == 0, err
    answer = json.loads(out)
    assert answer["choices"] == expected.names and answer["objective"] == pytest.approx(expected.objective)
    assert answer["choices"] != solution["choices"]  # the override made a difference


def test_without_budget_a_sweep_or_no_saved_config_is_an_error(run, tmp_path, capsys):
    """Which of a sweep's budget lists is meant is the user's to say; a run without a saved config has no
    budgets to take. Both exit 2 naming what to give, never an unconstrained search returning the parent."""
    code, out, err = _cli(["search", str(run), "--json"], capsys)
    assert (code, out) == (2, "") and err == (
        f"puzzle search: error: no --budget given, and {run} has no saved run config to take the run's "
        "budgets from; give --budget KEY<=VALUE (e.g. --budget 'active_params<=0.7x')\n"
    )
    root = _saved_run(run, tmp_path / "run", {}, {"sweep": "active_params<=0.7x,0.5x"})
    code, out, err = _cli(["search", str(root), "--json"], capsys)
    assert (code, out) == (2, "") and err == (
        "puzzle search: error: no --budget given, and the run searched 2 budget lists (active_params<=0.7x; "
        "active_params<=0.5x); choose one with --budget, e.g. --budget 'active_params<=0.7x'\n"
    )


def test_this_machine_is_the_runs_stored_calibration(run, tmp_path, capsys):
    hardware, search, _, _ = RUN_SETTINGS["hardware"]
    root = _saved_run(run, tmp_path / "run", hardware, search)
    stored = (root / "hardware.json").read_bytes()
    argv = ["search", str(root), "--budget", "latency[long]<=0.8x", "--json"]
    code, out, err = _cli(argv, capsys)
    assert code == 0, err
    answer = json.loads(out)
    chosen = {name: spec for block in _candidates(root, "kl") for name, spec, _ in block}
    child = ModelSpec(SPEC.vocab_size, SPEC.hidden_size, tuple(chosen[v] for v in answer["choices"].values()))
    assert answer["totals"]["seconds[long]"] == pytest.approx(
        model_performance(child, LONG_FP8, STORED).total_s
    )
    assert (root / "hardware.json").read_bytes() == stored  # read, not measured again
    model = CostModel("this-machine", scenarios={"long": LONG_FP8})  # the Python API prices the same way
    solution = search_run(root, ["latency[long]<=0.8x"], cost_model=model, note=lambda _: None)
    assert solution.totals == answer["totals"]
    # Without a stored calibration: measured once, stored, and every later search prices with it.
    (root / "hardware.json").unlink()
    # Bounded at the parent's own latency: feasible whatever this (possibly loaded) machine measures.
    argv = ["search", str(root), "--budget", "latency[long]<=1x", "--json"]
    code, first, err = _cli([*argv, "--hardware", "this-machine"], capsys)
    assert code == 0, err
    measured = (root / "hardware.json").read_bytes()
    profile = profile_from_json(json.loads(measured), "hardware.json")
    assert profile.name == "this-machine" and profile != STORED
    for _ in range(2):
        code, again, err = _cli(argv, capsys)
        assert code == 0 and (root / "hardware.json").read_bytes() == measured
        assert json.loads(again)["totals"] == json.loads(first)["totals"]


def test_an_unwritable_out_prints_the_answer_and_exits_2(run, tmp_path, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where --out wants a folder\n")
    out = blocker / "solution.json"
    argv = ["search", str(run), "--budget", "active_params<=0.7x", "--json"]
    code, expected, _ = _cli(argv, capsys)
    assert code == 0
    code, printed, err = _cli([*argv, "--out", str(out)], capsys)
    assert code == 2 and json.loads(printed)["choices"] == json.loads(expected)["choices"]
    assert f"cannot write --out {out}" in err and "Traceback" not in err
    code, printed, err = _cli([*argv[:-1], "--out", str(out)], capsys)  # the table, too
    assert code == 2 and "kl = " in printed and f"cannot write --out {out}" in err


def test_out_never_replaces_a_file_of_the_users(run, tmp_path, capsys):
    """--out naming the user's file: refused before solving (exit 2, one line), the file kept; an answer an
    earlier search wrote is replaced; --overwrite replaces the user's file as asked."""
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}\n')
    argv = ["search", str(run), "--budget", "active_params<=0.7x", "--json", "--out", str(mine)]
    code, out, err = _cli(argv, capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert str(mine) in err and "--overwrite" in err
    assert mine.read_text() == '{"mine": true}\n'
    code, out, _ = _cli([*argv, "--overwrite"], capsys)
    assert code == 0 and json.loads(mine.read_text()) == json.loads(out)
    mine.write_text(json.dumps({**json.loads(out), "objective": -1}))  # an earlier answer: replaced
    code, out, _ = _cli(argv, capsys)
    assert code == 0 and json.loads(mine.read_text()) == json.loads(out)
