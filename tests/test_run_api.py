"""The typed stage API of `puzzle.Run` on the tiny trained parent of tests/run_helpers.py: the notebook's
sequence returns typed objects, a second call of each stage reuses the recorded work (the stage functions
are not called again), and the outputs are those of `puzzle run` on the same config."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from run_helpers import config_dict, make_inputs, write_config

import puzzle
import puzzle.run
from puzzle.bld import Library
from puzzle.cli import main as puzzle_main
from puzzle.layout import STAGES
from puzzle.model import HybridLM
from puzzle.prune.importance import ModelImportance
from puzzle.run import Run, RunError
from puzzle.scores import Scores
from puzzle.search.types import Solution

BUDGET = "active_params<=0.8x"
# The stage functions each stage module of puzzle.run calls, by the module that calls them.
COUNTED = {
    "importance_for": ("importance",),
    "build_library": ("library",),
    "score_variants": ("scores",),
    "search_k": ("solutions",),
    "measured_kl": ("solutions", "assemble"),
    "distill_child": ("distill",),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_api")
    make_inputs(root)
    return root


def _pieces(root: Path, run_dir: Path) -> Run:
    """The run of run_helpers' config, built from its pieces by keyword as a notebook would."""
    data = config_dict(root, run_dir=str(run_dir))
    sections = {k: v for k, v in data.items() if k not in ("run_dir", "parent", "data", "space", "search")}
    return Run(
        run_dir,
        parent=data["parent"]["path"],
        data=data["data"],
        space=puzzle.SearchSpace.from_dict(data["space"]),
        budgets=[BUDGET],
        **sections,
    )


@pytest.fixture
def calls(monkeypatch):
    """How often each stage function is called by puzzle.run's stage modules (the real functions, counted)."""
    counts = dict.fromkeys(COUNTED, 0)
    for name, stages in COUNTED.items():
        for stage in stages:
            module = importlib.import_module(f"puzzle.run.{stage}")
            original = getattr(module, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                counts[_name] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)
    return counts


def _check_card(card: Path, run: Run, name: str, distilled: bool) -> None:
    """The export's model card states the run's budgets, the search's predicted and the measured KL, GKD's
    KL before and after when distilled, and the run config's fingerprint."""
    from puzzle.artifacts import fingerprint_json

    text = card.read_text()
    manifest = run.manifest()["stages"]
    solutions = next(
        r["outputs"] for n, r in manifest.items() if n.split("/")[0] == "solutions" and name in r["outputs"]
    )
    for budget in solutions[name]["budgets"]:
        assert f"- `{budget}`" in text
    solution = json.loads((run.layout.root / solutions[name]["file"]).read_text())
    assert f"| KL (objective, summed replace-one-block scores) | {solution['objective']:.6g} | - |" in text
    measured = next(
        r["outputs"][name]
        for n, r in manifest.items()
        if n.split("/")[0] == "assemble" and name in r["outputs"]
    )["measured"]
    assert f"| {measured['predicted_kl']:.6g} | {measured['kl']:.6g} |" in text
    assert f"run config fingerprint: `{fingerprint_json(run.config.to_dict())}`" in text
    if distilled:
        gkd = next(
            r["outputs"][name]
            for n, r in manifest.items()
            if n.split("/")[0] == "distill" and name in r["outputs"]
        )
        assert f"| before GKD (assembled) | {measured['kl']:.6g} |" in text
        assert f"| {gkd['kept_eval']['kl']:.6g} |" in text and "are the distilled (GKD) ones" in text
    else:
        assert "not distilled" in text


def _notebook(run: Run, export_to: Path | None = None) -> dict:
    importance = run.importance()
    library = run.library()
    scores = run.scores()
    solutions = run.search(BUDGET)
    child = run.assemble(solutions[0])
    distilled = run.distill(child)
    path = run.export(distilled, export_to)
    return locals()


@pytest.fixture(scope="module")
def cli_run(root, tmp_path_factory):
    """`puzzle run` on run_helpers' config: the oracle of the typed calls' outputs."""
    folder = tmp_path_factory.mktemp("cli")
    config = write_config(folder / "run.yaml", config_dict(root, run_dir=str(folder / "run")))
    assert puzzle_main(["run", str(config), "--quiet"]) == 0
    return folder / "run"


def test_the_notebook_sequence_returns_types_reuses_and_equals_puzzle_run(root, tmp_path, calls, cli_run):
    run_dir = tmp_path / "run"
    first = _notebook(_pieces(root, run_dir))
    assert isinstance(first["importance"], ModelImportance)
    assert isinstance(first["library"], Library) and isinstance(first["scores"], Scores)
    assert all(isinstance(s, Solution) for s in first["solutions"]) and len(first["solutions"]) == 1
    assert isinstance(first["child"], HybridLM) and isinstance(first["distilled"], HybridLM)
    assert first["path"] == run_dir / "exports" / "active_params-le-0.8x"
    assert calls == dict.fromkeys(COUNTED, 1)  # each stage computed once, the search's check aside
    _check_card(first["path"] / "README.md", first["run"], "active_params-le-0.8x", distilled=True)
    # The config's budget: the records are `puzzle run`'s own, and `puzzle run` reuses every one of them.
    manifest = json.loads((run_dir / "run.json").read_text())
    assert [n for n in manifest["stages"] if n != "frontier"] == list(puzzle.layout.STAGES)

    again = _notebook(_pieces(root, run_dir))  # a new Run: nothing remembered in memory
    assert calls == dict.fromkeys(COUNTED, 1), calls
    manifest = json.loads((run_dir / "run.json").read_text())
    assert {r["status"] for r in manifest["stages"].values()} == {"reused"}
    assert again["solutions"][0] == first["solutions"][0]  # loaded back as the same Solution
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            again["distilled"](ids).logits, first["distilled"](ids).logits, rtol=0, atol=0
        )

    # The same outputs as `puzzle run` of the same config.
    name = "active_params-le-0.8x"
    for file in (f"solutions/{name}.json", "scores/scores.json"):
        mine, theirs = json.loads((run_dir / file).read_text()), json.loads((cli_run / file).read_text())
        if file.startswith("solutions"):
            mine.pop("seconds"), theirs.pop("seconds")
        else:
            mine.pop("created", None), theirs.pop("created", None)
        assert mine == theirs, file
    cli_manifest = json.loads((cli_run / "run.json").read_text())["stages"]
    assert manifest["stages"]["assemble"]["outputs"] == cli_manifest["assemble"]["outputs"]
    with torch.no_grad():
        exported = puzzle.load(first["path"])(ids).logits
        torch.testing.assert_close(
            exported, puzzle.load(cli_run / "exports" / name)(ids).logits, rtol=0, atol=0
        )


def test_budgets_given_to_search_get_records_of_their_own(root, tmp_path, calls):
    run = _pieces(root, tmp_path / "run")
    (best,) = run.search("active_params<=0.9x")
    assert run.solution_name(best) == "active_params-le-0.9x"
    child = run.assemble(best)
    assert run.measured(child)["kl"] > 0
    out = run.export(child, tmp_path / "undistilled")  # an assembled child, to a path of the caller's
    assert out == tmp_path / "undistilled" and (out / "config.json").is_file()
    _check_card(out / "README.md", run, "active_params-le-0.9x", distilled=False)
    stages = json.loads((tmp_path / "run" / "run.json").read_text())["stages"]
    assert {"solutions/active_params-le-0.9x", "assemble/active_params-le-0.9x"} <= set(stages)
    assert "export/active_params-le-0.9x" in stages and "distill" not in stages
    counted = dict(calls)
    assert Run(tmp_path / "run", run.config).search("active_params<=0.9x") == [best]
    assert calls == counted  # reused: no search (the config's either)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(puzzle.load(out)(ids).logits, child(ids).logits, rtol=0, atol=0)
    with pytest.raises(RunError, match="not returned by this Run"):
        run.distill(HybridLM(child.spec))


def test_a_run_is_built_from_a_config_or_its_pieces_not_both(root, tmp_path):
    run = _pieces(root, tmp_path / "run")
    assert run.config.search.budgets == (BUDGET,)
    assert run.config.bld.token_budget == config_dict(root)["bld"]["token_budget"]
    with pytest.raises(TypeError, match="not both"):
        Run(tmp_path / "run", run.config, budgets=[BUDGET])


def test_the_log_names_gathered_elements_only_where_there_are_some(cli_run):
    """One unsharded process gathers nothing: its log has each stage's peak resident memory, and no line
    "peak gathered parameter elements 0" after every stage (sharded runs log it: tests/test_shard_memory.py)."""
    log = (cli_run / "logs" / "rank0.log").read_text()
    assert log.count(": peak resident memory ") >= 7
    assert "peak gathered parameter elements" not in log


def test_every_stage_has_its_module_in_order():
    """`Run.RECORDERS` names each stage's module of puzzle.run, in the order `puzzle run` runs them."""
    assert tuple(Run.RECORDERS) == STAGES
    assert [recorder.__module__ for recorder in Run.RECORDERS.values()] == [f"puzzle.run.{s}" for s in STAGES]
