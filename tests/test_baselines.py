"""The baselines (`puzzle.baselines`) on a real run directory, against brute force over every architecture of
its table: each meets the budget exactly as the whole-model cost model counts it, none beats the search, the
refilled greedy and the random walks end where no single upgrade fits, and `puzzle search RUN_DIR
--baselines` prints and returns what the library call finds."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import pytest
from bld_helpers import SPEC
from rundir_helpers import make_run

from puzzle import cli
from puzzle.baselines import NAMES, RANDOM_BAND, Baselines, restrict, same_state
from puzzle.cost.analytic import model_active_params
from puzzle.problem import RunCandidates, run_problem
from puzzle.spec import ModelSpec

LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9)
PARENT_ACTIVE = model_active_params(SPEC)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    os.environ.setdefault("PUZZLE_PROGRESS", "0")
    return make_run(tmp_path_factory.mktemp("baselines") / "run", failures=False).root


def _problem(run, level):
    return run_problem(run, [f"active_params<={level}x"])


def _active(arch) -> float:
    """The oracle: the child's active parameters as a share of the parent's, from the whole-model count."""
    return model_active_params(ModelSpec(SPEC.vocab_size, SPEC.hidden_size, tuple(arch))) / PARENT_ACTIVE


def _fits(arch, level) -> bool:
    return _active(arch) <= level * (1 + 1e-9)


def _every_arch(problem):
    """(architecture, its summed score) for every architecture of the table: brute force."""
    candidates = problem.candidates
    for combo in itertools.product(*(range(len(specs)) for specs in candidates.variants)):
        arch = tuple(candidates.variants[b][j] for b, j in enumerate(combo))
        yield arch, sum(candidates.scores[b][j] for b, j in enumerate(combo))


def _score(problem, arch) -> float:
    candidates = problem.candidates
    return sum(candidates.scores[b][candidates.variants[b].index(spec)] for b, spec in enumerate(arch))


def _upgrades(problem, arch):
    """Every architecture one block away from `arch` with more active parameters."""
    for b, specs in enumerate(problem.candidates.variants):
        for spec in specs:
            other = (*arch[:b], spec, *arch[b + 1 :])
            if _active(other) > _active(arch):
                yield other


def test_every_baseline_meets_the_budget_and_none_beats_the_search(run):
    found_any = set()
    for level in LEVELS:
        problem = _problem(run, level)
        best = min(score for arch, score in _every_arch(problem) if _fits(arch, level))
        baselines = Baselines(problem)
        assert baselines.level == pytest.approx(level)
        assert _score(problem, baselines.mip()) == pytest.approx(best, abs=1e-12)
        for name, arch in baselines.all(seed=0).items():
            if arch is None:
                continue
            found_any.add(name)
            assert _fits(arch, level), (name, level, _active(arch))
            assert _score(problem, arch) >= best - 1e-12, (name, level)
    assert found_any == set(NAMES)


def test_the_refilled_greedy_leaves_no_upgrade_that_lowers_the_damage_and_fits(run):
    for level in LEVELS:
        problem = _problem(run, level)
        baselines = Baselines(problem)
        refilled, plain = baselines.greedy(), baselines.greedy(refill=False)
        assert (refilled is None) == (plain is None)
        if refilled is None:
            continue
        assert _score(problem, refilled) <= _score(problem, plain) + 1e-12
        assert _active(refilled) >= _active(plain)
        better = [o for o in _upgrades(problem, refilled) if _score(problem, o) < _score(problem, refilled)]
        assert not any(_fits(other, level) for other in better), level


def test_random_walks_end_at_the_budget_reproducibly(run):
    level = 0.7
    problem = _problem(run, level)
    baselines = Baselines(problem)
    walks = [baselines.random_walk(seed) for seed in range(6)]
    for arch in walks:
        assert _fits(arch, level)
        assert not any(_fits(other, level) for other in _upgrades(problem, arch))
    assert walks[0] == Baselines(problem).random_walk(0)


def test_a_random_draw_is_at_the_budget_not_far_below_it(run):
    level = 0.8
    problem = _problem(run, level)
    for seed in range(4):
        arch = Baselines(problem).random(seed)
        assert _fits(arch, level) and _active(arch) >= level - RANDOM_BAND - 1e-9


def _one_shape_per_kind(parent, arch, removes: bool) -> bool:
    """Whether `arch` gives every block of a kind the same shape (and, without `removes`, removes none)."""
    shapes: dict[str, set] = {}
    for block, spec in zip(parent.blocks, arch):
        if not removes and spec.kind == "noop" and block.kind != "noop":
            return False
        shapes.setdefault(block.kind, set()).add(spec)
    return all(len(s) == 1 for s in shapes.values())


def test_uniform_pruning_is_the_best_architecture_with_one_shape_per_kind(run):
    widths_found = 0
    for level in LEVELS:
        problem = _problem(run, level)
        parent = problem.candidates.parent

        for removes in (True, False):
            brute = [
                s
                for a, s in _every_arch(problem)
                if _fits(a, level) and _one_shape_per_kind(parent, a, removes)
            ]
            arch, count = Baselines(problem).uniform(noop=removes)
            assert count == len(brute), (level, removes)
            assert (arch is None) == (not brute)
            if arch is not None:
                assert _score(problem, arch) == pytest.approx(min(brute), abs=1e-12)
                widths_found += not removes
    assert widths_found  # width pruning alone meets the loosest budgets


def test_restrict_takes_an_axis_out_of_the_candidates(run):
    candidates = _problem(run, 0.7).candidates
    parent_mamba = candidates.parent.blocks[0]
    other_state = dataclasses.replace(parent_mamba, state_size=parent_mamba.state_size + 2)
    variants = [list(specs) for specs in candidates.variants]
    scores = [list(values) for values in candidates.scores]
    variants[0].append(other_state)
    scores[0].append(0.5)
    widened = RunCandidates(candidates.parent, variants, scores, [])
    kept = restrict(widened, same_state)
    assert kept.variants[0] == candidates.variants[0]  # the other state size is dropped, the rest kept
    assert kept.variants[1:] == candidates.variants[1:] and kept.scores[0] == candidates.scores[0]


def test_search_baselines_prints_and_returns_what_the_library_finds(run, capsys):
    budget = "active_params<=0.7x"
    expected = Baselines(_problem(run, 0.7)).all(seed=0)
    assert cli.main(["search", str(run), "--budget", budget, "--baselines", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert set(answer) == {"search", "baselines"} and "choices" in answer["search"]
    problem = _problem(run, 0.7)
    for name in NAMES:
        entry = answer["baselines"][name]
        if expected[name] is None:
            assert entry is None
            continue
        assert entry["objective"] == pytest.approx(_score(problem, expected[name]))
        assert entry["totals"]["active_params"] == model_active_params(
            ModelSpec(SPEC.vocab_size, SPEC.hidden_size, expected[name])
        )
    assert cli.main(["search", str(run), "--budget", budget, "--baselines"]) == 0
    text = capsys.readouterr().out
    assert "baselines at the same budgets" in text
    assert all(f"  {name} " in text for name in NAMES)


def test_baselines_need_a_run_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["search", "--library", str(tmp_path / "x.json"), "--budget", "params<=1", "--baselines"])
    assert stop.value.code == 2
    assert "--baselines does not apply with --library" in capsys.readouterr().err
