"""A search held to serving engines (`search.engines`): every child it returns is one the engines' checks
accept (`puzzle.nemotron_h.engines.engine_problems`, vLLM's by replay of its loader), and it is the best
such child: brute force over every architecture of a small space is the oracle."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from puzzle.nemotron_h.engines import engine_problems
from puzzle.problem import RunCandidates, run_problem
from puzzle.search import search
from puzzle.search.budget import choices_to_spec
from puzzle.search.mip import feasible_choices, resolve_limits
from puzzle.search.types import Rules, SearchError
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, ModelSpec, MoESpec, NoOpSpec


def _mamba(state: int, heads: int = 4) -> MambaSpec:
    return MambaSpec(num_heads=heads, head_dim=16, state_size=state, n_groups=2, chunk_size=8)


def _moe(width: int | tuple[int, ...], top_k: int = 2, shared: int = 32) -> MoESpec:
    return MoESpec(num_experts=4, top_k=top_k, expert_width=width, shared_width=shared, latent_size=16)


ATTENTION = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8)
PARENT = ModelSpec(
    vocab_size=64,
    hidden_size=32,
    blocks=(_mamba(16), _moe(32), ATTENTION, _mamba(16), _moe(32), ATTENTION),
)
# Per block: the parent's block first, then what the engines serve or refuse (no-op, linear, a width per
# expert, fewer KV heads in one attention block only, another Mamba shape in one block only).
VARIANTS = [
    [_mamba(16), _mamba(8), _mamba(16, heads=2), NoOpSpec()],
    [_moe(32), _moe(16), _moe(32, top_k=1), _moe((32, 16, 32, 16)), LinearSpec()],
    [ATTENTION, AttentionSpec(num_heads=4, num_kv_heads=1, head_dim=8), NoOpSpec()],
    [_mamba(16), _mamba(8), LinearSpec()],
    [_moe(32), _moe(16), _moe(16, top_k=1), _moe(16, shared=16), NoOpSpec()],
    [ATTENTION, AttentionSpec(num_heads=4, num_kv_heads=1, head_dim=8), NoOpSpec()],
]
BUDGET = ["params<=0.9x"]


def _candidates(seed: int) -> RunCandidates:
    rng = np.random.default_rng(seed)
    # Refused variants score best, so that a search that ignored the engines would pick them.
    scores = [
        [0.0]
        + [
            float(
                rng.uniform(0.0, 0.2) if isinstance(spec, (NoOpSpec, LinearSpec)) else rng.uniform(0.1, 1.0)
            )
            for spec in block[1:]
        ]
        for block in VARIANTS
    ]
    return RunCandidates(PARENT, [list(block) for block in VARIANTS], scores)


def _brute_force(candidates: RunCandidates, engines: list[str], tmp_path) -> float:
    """The lowest objective over every architecture within the budget that the engines' checks accept."""
    problem = run_problem(tmp_path, BUDGET, candidates=candidates)
    table = problem.table
    resolved = resolve_limits(table, problem.problem.limits)
    choices = np.array(list(itertools.product(*(range(len(block)) for block in candidates.variants))))
    feasible = choices[feasible_choices(table, choices, resolved, Rules(shared_state_size=True))]
    objective = np.array([sum(candidates.scores[i][c] for i, c in enumerate(row)) for row in feasible])
    for row in feasible[np.argsort(objective, kind="stable")]:  # the first the engines accept is the best
        if not engine_problems(choices_to_spec(PARENT, candidates.variants, row), engines):
            return sum(candidates.scores[i][c] for i, c in enumerate(row))
    raise AssertionError("no architecture within the budget is served")


@pytest.mark.parametrize(
    "engines", [["vllm"], ["llama.cpp"], ["vllm", "llama.cpp"], ["transformers"], ["sglang"], ["trtllm"]]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_search_returns_the_best_child_the_engines_serve(tmp_path, engines, seed):
    candidates = _candidates(seed)
    problem = run_problem(tmp_path, BUDGET, candidates=candidates, engines=engines)
    solution = search(problem.table, problem.problem.limits, problem.problem.rules)
    served = problem.candidates.variants
    child = choices_to_spec(PARENT, served, solution.choices)
    assert engine_problems(child, engines) == []
    assert solution.objective == pytest.approx(_brute_force(candidates, engines, tmp_path), abs=1e-9)
    free = run_problem(tmp_path, BUDGET, candidates=candidates)
    unheld = search(free.table, free.problem.limits, free.problem.rules)
    # the check has teeth: without the engines the search picks a child they refuse
    assert engine_problems(choices_to_spec(PARENT, candidates.variants, unheld.choices), engines)
    assert any("left out" in note for note in problem.notes)


def test_a_parent_block_the_engine_refuses_and_an_unknown_engine_are_errors(tmp_path):
    windowed = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, window=8)
    parent = ModelSpec(vocab_size=64, hidden_size=32, blocks=(_mamba(16), windowed))
    candidates = RunCandidates(parent, [[_mamba(16)], [windowed]], [[0.0], [0.0]])
    with pytest.raises(SearchError, match=r"parent's block 1 .*sliding-window"):
        run_problem(tmp_path, [], candidates=candidates, engines=["llama.cpp"])
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        run_problem(tmp_path, [], candidates=candidates, engines=["tgi"])
