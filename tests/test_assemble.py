"""Assembly of a search solution from a small trained parent and its BLD library: parameter counts equal the
cost model and the solution's totals, unchanged blocks are bitwise the parent's, changed blocks the library's,
the measured KL matches a naive full-vocabulary KL, MTP tensors are carried, and bad solutions are clear
errors."""

from __future__ import annotations

import dataclasses
import json
import shutil

import kl_worker
import pytest
import torch
from assemble_helpers import build_small_library, held_out, library_scores, save_parent, solve
from bld_helpers import trained_parent, variants
from gloo_helpers import spawn_ranks
from kl_helpers import naive_kl
from safetensors.torch import load_file, save_file

import puzzle
from puzzle.assemble import AssemblyError, assemble, measured_kl, solution_variants
from puzzle.compare import compare_models
from puzzle.cost import model_params
from puzzle.library import variant_file
from puzzle.search.types import Solution
from puzzle.spec import LinearSpec, MLPSpec, NoOpSpec, Variant


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("assemble")
    parent_dir = save_parent(trained_parent(), root / "parent")
    parent = puzzle.load(parent_dir)
    library = build_small_library(parent, root / "library")
    return parent_dir, library, root


@pytest.fixture()
def parent(setup):
    return puzzle.load(setup[0])


def _table() -> dict[int, list[Variant]]:
    return variants()


def test_changed_blocks_are_the_librarys_and_the_rest_bitwise_the_parents(setup, parent):
    _, library, _ = setup
    table = _table()
    chosen = {0: table[0][0], 1: Variant(1, LinearSpec()), 2: table[2][1]}  # block 3.. keep the parent's
    child = assemble(chosen, library, parent)
    assert [b.source for b in child.assembly.blocks] == ["library"] * 3 + ["parent"] * 3
    assert child.spec.blocks[3:] == parent.spec.blocks[3:]
    counted = sum(p.numel() for p in child.parameters())
    assert counted == model_params(child.spec) == child.assembly.predicted["params"]
    assert counted < sum(p.numel() for p in parent.parameters())
    child_state, parent_state = child.state_dict(), parent.state_dict()
    for key in ("embeddings.weight", "lm_head.weight", "norm_f.weight"):
        assert torch.equal(child_state[key], parent_state[key])
    for index in range(6):
        prefix = f"layers.{index}."
        if index >= 3:  # unchanged: every tensor of the block bitwise the parent's
            mine = {k: v for k, v in child_state.items() if k.startswith(prefix)}
            assert mine.keys() == {k for k in parent_state if k.startswith(prefix)}
            assert all(torch.equal(v, parent_state[k]) for k, v in mine.items())
        else:  # changed: the library file's mixer, the parent's pre-norm
            stored = load_file(library.directory / variant_file(chosen[index]))
            mixer = child.layers[index].mixer.state_dict()
            assert stored.keys() == mixer.keys()
            assert all(torch.equal(stored[k], mixer[k]) for k in stored)
            assert torch.equal(child_state[prefix + "norm.weight"], parent_state[prefix + "norm.weight"])
    # A copy, not a view: training the child never moves the parent (the GKD teacher).
    parent_ptrs = {t.data_ptr() for t in parent_state.values()}
    assert not parent_ptrs & {t.data_ptr() for t in child_state.values()}


def test_search_solution_assembles_to_its_predicted_totals_and_kl_is_measured(setup, parent):
    _, library, root = setup
    scores = library_scores(parent, library, root / "scores")
    solution = solve(parent, library, scores, params_fraction=0.8)
    assert solution.totals["params"] <= 0.8 * model_params(parent.spec)
    child = assemble(solution, library, parent, scores=scores)
    assert child.assembly.predicted["params"] == round(solution.totals["params"])
    per_block = [block.predicted_kl for block in child.assembly.blocks]
    assert sum(per_block) == pytest.approx(solution.objective, rel=1e-9, abs=1e-12)
    assert sum(p.numel() for p in child.parameters()) == round(solution.totals["params"])
    assert child.assembly.predicted_kl == solution.objective
    changed = [b.variant.block_index for b in child.assembly.blocks if b.source != "parent"]
    assert changed and child.spec != parent.spec
    result = measured_kl(child, parent, held_out(), vocab_chunk=7)
    assert result["predicted_kl"] == solution.objective and result["kl"] > 0
    assert result["kl"] == pytest.approx(naive_kl(parent, child, held_out()), rel=1e-5, abs=1e-7)
    assert result["tokens"] == sum(b.shape[0] * (b.shape[1] - 1) for b in held_out())
    assert child.assembly.measured["kl"] == result["kl"]


def test_the_parents_own_solution_is_the_parent(setup, parent):
    _, library, _ = setup
    child = assemble({}, library, parent)
    ids = held_out()[0]
    with torch.no_grad():
        assert torch.equal(child(ids).logits, parent(ids).logits)
    assert measured_kl(child, parent, held_out())["kl"] == 0.0


def test_mtp_tensors_are_carried_and_recorded(setup, parent):
    _, library, _ = setup
    tensor = torch.randn(16, 32)
    parent.extra_tensors = {"mtp.layers.0.eh_proj.weight": tensor}
    parent.source_config = {**parent.source_config, "num_nextn_predict_layers": 1}
    child = assemble({3: Variant(3, MLPSpec(width=6))}, library, parent)
    assert child.extra_tensors["mtp.layers.0.eh_proj.weight"] is tensor
    mtp = child.assembly.mtp
    assert mtp["tensors"] == 1 and mtp["handling"].startswith("carried unchanged")
    assert [block["kind"] for block in mtp["blocks"]] == ["attention", "moe"]


def test_a_solutions_ids_are_looked_up_in_the_library(setup, parent):
    _, library, _ = setup
    names = {f"block_{i}": block.short_name() for i, block in enumerate(parent.spec.blocks)}
    names["block_1"] = "noop"
    names["block_3"] = MLPSpec(width=6).short_name()
    solution = Solution((0,) * 6, names, 0.5, {}, "optimal", 0.0, "highs", 0.0)
    chosen = solution_variants(solution, library, parent.spec)
    assert chosen[1] == Variant(1, NoOpSpec()) and chosen[3] == Variant(3, MLPSpec(width=6))
    child = assemble(solution, library, parent)
    assert child.layers[1].norm is None and child.assembly.blocks[1].source == "noop"
    assert child.spec.pattern == "MNE-LN"


def test_bad_solutions_are_clear_errors(setup, parent, tmp_path):
    parent_dir, library, _ = setup
    names = {f"block_{i}": block.short_name() for i, block in enumerate(parent.spec.blocks)}
    with pytest.raises(AssemblyError, match=r"block 3: variant 'mlp:w7' is neither .* variants of block 3"):
        assemble(
            Solution((0,) * 6, {**names, "block_3": "mlp:w7"}, 0, {}, "optimal", 0, "highs", 0),
            library,
            parent,
        )
    with pytest.raises(AssemblyError, match="chooses 5 blocks, the parent has 6"):
        assemble(
            Solution((0,) * 5, dict(list(names.items())[:5]), 0, {}, "optimal", 0, "highs", 0),
            library,
            parent,
        )
    with pytest.raises(AssemblyError, match="predicted 1"):
        totals = {"params": 1.0}
        assemble(Solution((0,) * 6, names, 0, totals, "optimal", 0, "highs", 0), library, parent)
    with pytest.raises(AssemblyError, match="not in the library"):
        assemble({3: MLPSpec(width=7)}, library, parent)
    # A variant that failed in BLD, and one whose file is gone.
    variant = _table()[3][0]
    failed = dataclasses.replace(library, results={**library.results})
    failed.results[variant] = dataclasses.replace(
        library.results[variant], status="failed", reason="nan loss"
    )
    with pytest.raises(AssemblyError, match=r"block 3: variant mlp:w6 failed in BLD \(step None: nan loss\)"):
        assemble({3: variant}, failed, parent)
    copy_dir = tmp_path / "library"
    shutil.copytree(library.directory, copy_dir)
    (copy_dir / variant_file(variant)).unlink()
    with pytest.raises(AssemblyError, match=r"block 3: variant mlp:w6: its library file .* cannot be read"):
        assemble({3: variant}, copy_dir, parent)
    # A library of another parent.
    other = puzzle.load(parent_dir)
    with torch.no_grad():
        other.norm_f.weight.add_(1.0)
    with pytest.raises(AssemblyError, match="built from another parent"):
        assemble({}, library, other)


@pytest.mark.slow
def test_two_gloo_ranks_measure_the_single_process_kl(setup, parent, tmp_path):
    parent_dir, library, _ = setup
    child = assemble({0: _table()[0][0], 3: _table()[3][1]}, library, parent)
    child_dir = child.save_pretrained(tmp_path / "child")
    batches_file = tmp_path / "held_out.safetensors"
    save_file({str(index): batch for index, batch in enumerate(held_out())}, batches_file)
    spawn_ranks(kl_worker.worker, str(parent_dir), str(child_dir), str(batches_file))
    one = compare_models(parent, child, held_out(), vocab_chunk=16)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["tokens"] == one.tokens and ranks[0]["top1"] == one.top1
    for name in ("kl", "lm_loss_delta"):
        assert ranks[0][name] == pytest.approx(getattr(one, name), rel=1e-9, abs=1e-12)


def test_a_bf16_parent_gets_a_bf16_child_with_an_fp32_router(setup):
    parent_dir, library, _ = setup
    parent = puzzle.load(parent_dir, dtype=torch.bfloat16)
    with pytest.raises(AssemblyError, match="in the same dtype"):
        assemble({}, library, parent)
    child = assemble({2: _table()[2][0], 3: _table()[3][0]}, library, parent, check_parent=False)
    dtypes = {name: t.dtype for name, t in child.state_dict().items()}
    fp32 = {name for name, dtype in dtypes.items() if dtype == torch.float32}
    assert fp32 == {"layers.2.mixer.gate.weight", "layers.2.mixer.gate.e_score_correction_bias"}
    assert set(dtypes.values()) == {torch.bfloat16, torch.float32}
    assert torch.isfinite(child(held_out()[0]).logits).all()
