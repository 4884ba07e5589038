"""`hardware.price_as`: a tiny parent with Super's 88-block pattern searched under Super's full-size costs. The
oracle is the same space applied to Super itself: every choice of the tiny table costs what the same choice of
Super's table costs, and the search picks the same architecture; the choices keep the tiny parent's names."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from puzzle import nemotron_h
from puzzle.config import ConfigError, load_config
from puzzle.cost.serving import CostModel, Scenario
from puzzle.search import search
from puzzle.search.budget import Budget, deployment_problem
from puzzle.search.types import SearchError
from puzzle.space import SearchSpace
from puzzle.spec import AttentionSpec, MambaSpec, ModelSpec, MoESpec

ROOT = Path(__file__).resolve().parents[1]
SUPER = ROOT / "examples" / "parents" / "nemotron3_super"
SPACE = SearchSpace.from_dict(
    {
        "kinds": {
            "mamba": {"state_size": [128, 64]},
            "moe": {"expert_width": [2688, 1792, 1280], "top_k": [22, 10, 4], "noop": True},
            "attention": {"noop": True},
        }
    }
)
TINY_BLOCKS = {
    "mamba": MambaSpec(num_heads=2, head_dim=4, state_size=128, n_groups=1),
    "attention": AttentionSpec(num_heads=2, num_kv_heads=1, head_dim=4),
    "moe": MoESpec(num_experts=24, top_k=22, expert_width=2688, shared_width=8, latent_size=8),
}


def super_spec() -> ModelSpec:
    return nemotron_h.spec_from_config(nemotron_h.read_config(SUPER))


def tiny_of(spec: ModelSpec) -> ModelSpec:
    """A tiny parent with `spec`'s pattern that agrees with it on the space's axes (state, width, top-k)."""
    return ModelSpec(vocab_size=64, hidden_size=16, blocks=tuple(TINY_BLOCKS[b.kind] for b in spec.blocks))


def candidates(parent: ModelSpec) -> tuple[list[list], list[list[float]]]:
    """The space's variants of every block (the parent's first) and made-up scores that differ per variant."""
    variants = [[block] for block in parent.blocks]
    for index, listed in SPACE.all_variants(parent).items():
        variants[index] += [v.spec for v in listed if v.spec != parent.blocks[index]]
    scores = [
        [0.0] + [0.01 * (1 + (7 * i + j) % 13) for j in range(1, len(v))] for i, v in enumerate(variants)
    ]
    return variants, scores


COST_MODEL = CostModel(
    "8xb200",
    recipe="nvfp4",
    scenarios={
        "out_64k": Scenario(1, 8192, 65536, recipe="nvfp4", compute_dtype="nvfp4", user_speed=500.0),
        "million": Scenario(8, 999_000, 1000, recipe="nvfp4", kv_dtype="fp8"),
    },
)
BUDGETS = ["throughput_at_speed[out_64k]>=1.8x", "memory_bytes[million]<=76968728985", "params<=0.7x"]


def test_a_tiny_parent_priced_as_super_costs_what_super_costs_choice_for_choice():
    full = super_spec()
    tiny = tiny_of(full)
    tiny_variants, scores = candidates(tiny)
    full_variants, full_scores = candidates(full)
    assert [len(v) for v in tiny_variants] == [len(v) for v in full_variants] and full_scores == scores
    priced = dataclasses.replace(COST_MODEL, price_as=SUPER)
    small = deployment_problem(
        tiny, tiny_variants, scores, Budget.parse(BUDGETS, priced), reported=["params"]
    )
    big = deployment_problem(
        full, full_variants, scores, Budget.parse(BUDGETS, COST_MODEL), reported=["params"]
    )
    assert [str(limit) for limit in small.limits] == [str(limit) for limit in big.limits]
    assert small.table.fixed == big.table.fixed and set(small.table.costs) == set(big.table.costs)
    for column, costs in big.table.costs.items():
        assert small.table.costs[column].tolist() == costs.tolist(), column
    # The choices are the tiny parent's variants (what its library holds), the costs Super's.
    assert (
        small.table.variant_names[1][1] == tiny_variants[1][1].short_name() != big.table.variant_names[1][1]
    )
    one = search(small.table, small.limits, small.rules)
    other = search(big.table, big.limits, big.rules)
    assert one.choices == other.choices and one.totals == other.totals
    super_params = big.table.fixed["params"] + big.table.costs["params"][big.table.offsets[:-1]].sum()
    assert super_params == pytest.approx(120.67e9, rel=1e-3) and one.totals["params"] <= 0.7 * super_params
    # Unpriced, the tiny parent's own costs: a tiny model, another problem.
    plain = deployment_problem(
        tiny, tiny_variants, scores, Budget.parse(BUDGETS, COST_MODEL), reported=["params"]
    )
    assert plain.table.fixed["params"] < 1e7 < small.table.fixed["params"]


def test_another_block_pattern_or_an_axis_the_parents_disagree_on_is_refused(tmp_path):
    full = super_spec()
    priced = dataclasses.replace(COST_MODEL, price_as=SUPER)
    short = ModelSpec(64, 16, tiny_of(full).blocks[:10])
    variants, scores = candidates(short)
    with pytest.raises(
        SearchError, match=r"block pattern .* \(10 blocks\) is not the priced model's .* \(88 blocks\)"
    ):
        deployment_problem(short, variants, scores, Budget.parse(["params<=0.7x"], priced))
    tiny = tiny_of(full)
    variants, scores = candidates(tiny)
    fewer = dataclasses.replace(variants[1][0], num_experts=23)  # Super has 512 experts, the tiny parent 24
    variants[1].append(fewer)
    scores[1].append(0.5)
    with pytest.raises(
        SearchError, match=r"block 1 variant .*: it changes num_experts from the parent's 24, "
    ):
        deployment_problem(tiny, variants, scores, Budget.parse(["params<=0.7x"], priced))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    other = dataclasses.replace(COST_MODEL, price_as=tmp_path)
    with pytest.raises(SearchError, match=r"hardware.price_as .*: .*unsupported model_type 'llama'"):
        deployment_problem(tiny, *candidates(tiny), Budget.parse(["params<=0.7x"], other))


def test_the_config_reads_price_as_relative_to_its_folder(tmp_path):
    text = (ROOT / "examples" / "nemotron3_super" / "config.yaml").read_text()
    (tmp_path / "parents").symlink_to(ROOT / "examples" / "parents")
    folder = tmp_path / "configs"
    folder.mkdir()
    config = folder / "run.yaml"
    config.write_text(
        text.replace("  recipe: nvfp4\n", "  recipe: nvfp4\n  price_as: ../parents/nemotron3_super\n", 1)
    )
    assert load_config(config).hardware.price_as == folder / "../parents/nemotron3_super"
    config.write_text(text.replace("  recipe: nvfp4\n", "  recipe: nvfp4\n  price_as: 3\n", 1))
    with pytest.raises(ConfigError, match=r"hardware.price_as: expected a path or null"):
        load_config(config)
