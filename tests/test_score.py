"""puzzle.score: replace-one-block scores against one full forward per variant, chunking, resume, 2 gloo ranks
(FSDP2 and replicated)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gloo_helpers import gloo_rank, spawn_ranks
from kl_helpers import naive_kl
from nemotron_helpers import EVERY_KIND_SPEC as SPEC

from puzzle.blocks import build_block
from puzzle.model import HybridLM
from puzzle.prune import collect_importance, init_child
from puzzle.score import (
    PARTIAL_FILE,
    SCORES_FILE,
    WAVE_FILE,
    ScoreSettings,
    _check_parent,
    _Sum,
    load_scores,
    score_variants,
)
from puzzle.shard import local_numel
from puzzle.spec import LinearSpec, MambaSpec, MLPSpec, MoESpec, NoOpSpec, Variant

BATCH_SHAPES = ((2, 12), (3, 8), (1, 20))


def _parent() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(SPEC).eval()


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, SPEC.vocab_size, shape, generator=generator) for shape in BATCH_SHAPES]


def _library(parent: HybridLM) -> dict[Variant, torch.nn.Module | None]:
    """Variants of every block: the parent's own (None: its mixer), pruned ones from init_child, new kinds."""
    importance = collect_importance(parent, _batches())
    blocks = parent.spec.blocks
    pruned = {
        0: [MambaSpec(num_heads=2, head_dim=4, state_size=6, n_groups=2, chunk_size=8)],
        1: [NoOpSpec(), LinearSpec()],
        2: [MoESpec(num_experts=3, top_k=1, expert_width=(8, 6, 8), shared_width=8, latent_size=12)],
        3: [MLPSpec(width=6), NoOpSpec()],
        4: [NoOpSpec()],
    }
    library: dict[Variant, torch.nn.Module | None] = {Variant(i, spec): None for i, spec in enumerate(blocks)}
    for index, specs in pruned.items():
        block = parent.layers[index].mixer
        for spec in specs:
            library[Variant(index, spec)] = init_child(block, blocks[index], spec, importance[index])
    torch.manual_seed(2)
    library[Variant(5, MLPSpec(width=8))] = build_block(
        MLPSpec(width=8), SPEC.hidden_size
    )  # into a no-op block
    return library


@torch.no_grad()
def _naive(parent: HybridLM, variant: Variant, mixer, batches) -> dict[str, float]:
    """One full forward of a copy of the parent with the block replaced; every metric from whole-vocab fp64."""
    child = copy.deepcopy(parent)
    if mixer is not None:
        child.replace_mixer(variant.block_index, copy.deepcopy(mixer))
    totals = dict.fromkeys(
        ["kl", "child_nll", "parent_nll", "top1", "top5", "sq_err", "sq_ref", "tokens"], 0.0
    )
    for ids in batches:
        targets = ids[:, 1:].reshape(-1)
        logp = F.log_softmax(parent(ids).logits[:, :-1].reshape(targets.numel(), -1).double(), -1)
        logq = F.log_softmax(child(ids).logits[:, :-1].reshape(targets.numel(), -1).double(), -1)
        hp = parent.norm_f(parent.backbone(ids))[:, :-1].double()
        hq = child.norm_f(child.backbone(ids))[:, :-1].double()
        top = logp.argmax(-1)
        totals["kl"] += float((logp.exp() * (logp - logq)).sum())
        totals["child_nll"] += float(-logq.gather(-1, targets[:, None]).sum())
        totals["parent_nll"] += float(-logp.gather(-1, targets[:, None]).sum())
        totals["top1"] += float((logq.argmax(-1) == top).sum())
        totals["top5"] += float((logq.topk(5, -1).indices == top[:, None]).any(-1).sum())
        totals["sq_err"] += float((hq - hp).pow(2).sum())
        totals["sq_ref"] += float(hp.pow(2).sum())
        totals["tokens"] += targets.numel()
    n = totals["tokens"]
    return {
        "kl": totals["kl"] / n,
        "lm_loss_delta": (totals["child_nll"] - totals["parent_nll"]) / n,
        "top1": totals["top1"] / n,
        "top5": totals["top5"] / n,
        "hidden_nmse": totals["sq_err"] / totals["sq_ref"],
        "tokens": n,
    }


@pytest.mark.parametrize("chunk", [7, 16, 40])
def test_suffix_scores_equal_one_full_forward_per_variant(tmp_path, chunk):
    """Suffix-only recomputation with the vocabulary in chunks (7 and 16 do not divide 40) = the naive oracle."""
    parent, batches = _parent(), _batches()
    library = _library(parent)
    scores = score_variants(parent, library, library, batches, tmp_path, ScoreSettings(vocab_chunk=chunk))
    assert scores.tokens == sum(b.shape[0] * (b.shape[1] - 1) for b in batches)
    kls = []
    for variant, mixer in library.items():
        got, expected = scores[variant], _naive(parent, variant, mixer, batches)
        assert got.failed is None and got.tokens == expected["tokens"], variant
        for name in ("kl", "lm_loss_delta", "top1", "top5", "hidden_nmse"):
            assert getattr(got, name) == pytest.approx(expected[name], abs=1e-6, rel=1e-6), (variant, name)
        kls.append(got.kl)
    # The parent's own 6 score exactly 0; the 8 others really differ from the parent.
    assert kls[:6] == [0.0] * 6 and all(kl > 1e-5 for kl in kls[6:]) and len(kls) == 14


def _replaced(parent: HybridLM, base: HybridLM, index: int, mixer) -> HybridLM:
    """A copy of `base` with block `index`'s mixer replaced (None: the parent's own), the parent's norm kept."""
    model = copy.deepcopy(base)
    mixer = copy.deepcopy(parent.layers[index].mixer if mixer is None else mixer)
    norm = parent.layers[index].norm
    keep = None if isinstance(mixer.spec, NoOpSpec) or norm is None else copy.deepcopy(norm)
    model.replace_mixer(index, mixer, keep)
    return model


def test_scores_in_context_replace_one_block_of_the_context(tmp_path):
    """With a context model, each variant replaces its block of the context (KL still to the parent): every
    score equals a full forward of that model, and the context's own choices score the context's KL."""
    parent, batches = _parent(), _batches()
    library = _library(parent)
    context = parent
    for variant in (Variant(1, LinearSpec()), Variant(3, MLPSpec(width=6))):
        context = _replaced(parent, context, variant.block_index, library[variant])
    scores = score_variants(
        parent, library, library, batches, tmp_path, ScoreSettings(vocab_chunk=7), context=context
    )
    context_kl = naive_kl(parent, context, batches)
    assert context_kl > 1e-4
    for variant, mixer in library.items():
        own = variant.spec == context.spec.blocks[variant.block_index]
        expected = (
            context_kl
            if own
            else naive_kl(parent, _replaced(parent, context, variant.block_index, mixer), batches)
        )
        assert scores[variant].kl == pytest.approx(expected, rel=1e-6, abs=1e-7), variant
    # The context's own choices are the context itself: one record, the same sums in every block.
    own_kls = {
        scores[Variant(i, spec)].kl
        for i, spec in enumerate(context.spec.blocks)
        if Variant(i, spec) in library
    }
    assert len(own_kls) == 1
    # The parent's own block 1 back into the context is a variant like any other, not 0.
    assert scores[Variant(1, parent.spec.blocks[1])].kl != 0.0
    with pytest.raises(ValueError, match="lm_head differs"):
        other = copy.deepcopy(context)
        other.lm_head.weight.data += 1.0
        score_variants(parent, library, library, batches, tmp_path / "x", context=other)


def test_parent_scores_zero_and_full_agreement(tmp_path):
    parent, batches = _parent(), _batches()
    own = {Variant(i, spec): None for i, spec in enumerate(parent.spec.blocks)}
    calls = [0] * len(parent.layers)
    for index, block in enumerate(parent.layers):
        block.mixer.register_forward_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    scores = score_variants(parent, own, own, batches, tmp_path, ScoreSettings(vocab_chunk=16))
    # The parent's own variants are the parent: each mixer runs once per batch in the parent pass, plus once
    # in the check (block 0's own mixer and its whole suffix, on the first batch).
    assert calls == [0 if b.norm is None else len(batches) + 1 for b in parent.layers]
    for variant in own:
        score = scores[variant]
        assert (score.kl, score.lm_loss_delta, score.top1, score.top5, score.hidden_nmse) == (0, 0, 1, 1, 0)
    naive_loss = _naive(parent, Variant(0, parent.spec.blocks[0]), None, batches)
    assert scores.parent_loss > 0 and naive_loss["lm_loss_delta"] == 0


def test_a_suffix_that_does_not_reproduce_the_parent_stops_the_run():
    row = torch.zeros(9, dtype=torch.float64)
    row[[_Sum.KL, _Sum.TOKENS]] = torch.tensor([1e-3, 10.0], dtype=torch.float64)
    variant = Variant(3, MLPSpec(width=12))
    with pytest.raises(
        RuntimeError, match=r"block 3: the parent's own mixer scores .*kl=0\.0001.* expected KL <= 1e-06"
    ):
        _check_parent(variant, row, 1e-6)
    row[_Sum.KL] = 0.0
    _check_parent(variant, row, 1e-6)


def test_non_finite_variant_is_failed_and_others_unaffected(tmp_path):
    parent, batches = _parent(), _batches()
    torch.manual_seed(3)
    good, bad = (
        build_block(MLPSpec(width=6), SPEC.hidden_size),
        build_block(MLPSpec(width=4), SPEC.hidden_size),
    )
    with torch.no_grad():
        next(bad.parameters())[0, 0] = float("nan")
    library = {Variant(3, MLPSpec(width=6)): good, Variant(3, MLPSpec(width=4)): bad}
    scores = score_variants(parent, library, library, batches, tmp_path)
    failed = scores[Variant(3, MLPSpec(width=4))]
    assert failed.kl is None and failed.top1 is None and "non-finite" in failed.failed
    ok = scores[Variant(3, MLPSpec(width=6))]
    assert ok.failed is None and ok.kl == pytest.approx(
        _naive(parent, ok.variant, good, batches)["kl"], abs=1e-6
    )
    saved = json.loads((tmp_path / SCORES_FILE).read_text())
    assert [r["failed"] is not None for r in saved["variants"]] == [True, False]  # sorted by id: mlp:w4 first


def test_a_variant_without_a_mixer_is_an_error_before_any_work(tmp_path):
    parent = _parent()
    library = {Variant(3, MLPSpec(width=6)): None}
    with pytest.raises(ValueError, match=r"variant 3:mlp:w6: no mixer given .*parent's own block, mlp:w12"):
        score_variants(parent, library, library, _batches(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def _forward_counter(library):
    calls: dict[Variant, int] = {}
    for variant, mixer in library.items():
        if mixer is not None:
            calls[variant] = 0
            mixer.register_forward_hook(lambda *_, v=variant: calls.__setitem__(v, calls[v] + 1))
    return calls


def _runnable(parent: HybridLM) -> dict[Variant, torch.nn.Module]:
    """The library's variants whose mixer runs (a no-op block never calls its mixer: nothing to count)."""
    return {v: m for v, m in _library(parent).items() if m is not None and not isinstance(v.spec, NoOpSpec)}


def test_resume_scores_only_new_variants(tmp_path):
    parent, batches = _parent(), _batches()
    library = _runnable(parent)
    first, new = list(library)[:-1], list(library)[-1]
    calls = _forward_counter(library)
    before = score_variants(parent, first, library, batches, tmp_path)
    assert all(calls[v] == len(batches) for v in first) and calls[new] == 0
    calls.update(dict.fromkeys(calls, 0))
    after = score_variants(parent, list(library), library, batches, tmp_path)
    assert calls == {**dict.fromkeys(first, 0), new: len(batches)}  # only the new variant ran
    assert all(after[v] == before[v] for v in first)
    assert load_scores(tmp_path).variants == after.variants
    # Nothing to do the third time: no mixer runs and nothing is read but the saved file.
    calls.update(dict.fromkeys(calls, 0))
    assert score_variants(parent, list(library), library, batches, tmp_path).variants == after.variants
    assert set(calls.values()) == {0}
    # A retrained mixer (other weights, same id) is scored again; the others are not.
    with torch.no_grad():
        next(library[new].parameters()).mul_(0.5)
    calls.update(dict.fromkeys(calls, 0))
    changed = score_variants(parent, list(library), library, batches, tmp_path)
    assert calls == {**dict.fromkeys(first, 0), new: len(batches)} and changed[new].kl != after[new].kl
    # Other data: everything is scored again.
    score_variants(parent, first, library, batches[:2], tmp_path)
    assert all(calls[v] == 2 for v in first)


KILLED_RUN = """
import os, signal, sys
from test_score import _batches, _parent, _runnable
from puzzle.score import ScoreSettings, score_variants

parent = _parent()
library = _runnable(parent)
order = sorted(library, key=lambda v: (v.block_index, v.id))

def loader(variant):
    if variant == order[2]:  # killed while the 3rd wave loads its mixer
        os.kill(os.getpid(), signal.SIGKILL)
    return library[variant]

score_variants(parent, order, loader, _batches(), sys.argv[1], ScoreSettings(variants_per_wave=1))
"""


@pytest.mark.slow
def test_sigkilled_run_keeps_finished_waves(tmp_path):
    """A process SIGKILLed in its 3rd wave: the first two waves are kept and never recomputed."""
    root = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root.parent), str(root)])}
    killed = subprocess.run([sys.executable, "-c", KILLED_RUN, str(tmp_path)], env=env, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    parent, batches = _parent(), _batches()
    library = _runnable(parent)
    order = sorted(library, key=lambda v: (v.block_index, v.id))
    partial = json.loads((tmp_path / PARTIAL_FILE).read_text())
    assert [r["variant"]["id"] for r in partial["variants"]] == [v.id for v in order[:2]]
    assert not (tmp_path / SCORES_FILE).exists()
    calls = _forward_counter(library)
    resumed = score_variants(
        parent, order, library.__getitem__, batches, tmp_path, ScoreSettings(variants_per_wave=1)
    )
    assert [calls[v] for v in order] == [0, 0] + [len(batches)] * (len(order) - 2)
    assert not (tmp_path / PARTIAL_FILE).exists()
    uninterrupted = score_variants(parent, order, library, batches, tmp_path / "whole")
    for v in order:
        assert resumed[v].kl == pytest.approx(uninterrupted[v].kl, rel=1e-12, abs=1e-15)
        assert resumed[v].top5 == uninterrupted[v].top5


KILLED_MID_WAVE = """
import os, signal, sys
from test_score import _batches, _parent, _runnable
from puzzle.score import ScoreSettings, score_variants

parent = _parent()
library = _runnable(parent)
calls = []

def die_in_the_third_batch(*_):
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)

library[min(library, key=lambda v: (v.block_index, v.id))].register_forward_hook(die_in_the_third_batch)
score_variants(parent, library, library, _batches(), sys.argv[1], ScoreSettings(checkpoint_every=1))
"""


@pytest.mark.slow
def test_sigkilled_run_resumes_inside_its_wave(tmp_path):
    """One wave, killed in its 3rd (last) batch: the resumed run scores only that batch, and gives exactly the
    uninterrupted scores (the saved fp64 sums continue in the same order)."""
    root = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root.parent), str(root)])}
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MID_WAVE, str(tmp_path)], env=env, capture_output=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    saved = json.loads((tmp_path / WAVE_FILE).read_text())
    assert saved["step"] == 2 and not (tmp_path / PARTIAL_FILE).exists()
    parent, batches = _parent(), _batches()
    library = _runnable(parent)
    calls = _forward_counter(library)
    resumed = score_variants(parent, library, library, batches, tmp_path, ScoreSettings(checkpoint_every=1))
    assert set(calls.values()) == {1}  # every variant ran on the last batch only
    assert not (tmp_path / WAVE_FILE).exists() and not (tmp_path / PARTIAL_FILE).exists()
    uninterrupted = score_variants(parent, library, library, batches, tmp_path / "whole")
    assert resumed.variants == uninterrupted.variants and resumed.tokens == uninterrupted.tokens


# ----------------------------------------------------------------------------------------------------------
# Two ranks on gloo.


def _score_records(parent, library, directory: Path, mode: str) -> dict[str, dict]:
    """Each variant's scores (by "block:id") on this rank's share of `_batches()`, sharded as `mode` says."""
    scores = score_variants(
        parent, library, library, _batches(), directory, ScoreSettings(vocab_chunk=16, shard=mode)
    )
    return {f"{v.block_index}:{v.id}": s.to_dict() for v, s in scores.variants.items()}


def _worker(rank: int, world: int, port: int, directory: str) -> None:
    with gloo_rank(rank, world, port):
        for mode in ("fsdp", "none"):
            parent = _parent()
            full = sum(p.numel() for p in parent.parameters())
            library = _library(parent)
            variant = Variant(
                2, MoESpec(num_experts=3, top_k=1, expert_width=(8, 6, 8), shared_width=8, latent_size=12)
            )
            variant_full = sum(p.numel() for p in library[variant].parameters())
            records = _score_records(parent, library, Path(directory, mode), mode)
            held = {
                "parent": [local_numel(parent), full],
                "variant": [local_numel(library[variant]), variant_full],
            }
            Path(directory, f"{mode}-rank{rank}.json").write_text(
                json.dumps({"scores": records, "held": held})
            )


@pytest.mark.slow
def test_two_gloo_ranks_give_the_single_process_scores(tmp_path):
    """FSDP2 (about half the parent and of each variant per rank) and replicated: both equal 1 process."""
    spawn_ranks(_worker, str(tmp_path))
    parent = _parent()
    library = _library(parent)
    one = score_variants(
        parent, library, library, _batches(), tmp_path / "one", ScoreSettings(vocab_chunk=16)
    )
    for mode in ("fsdp", "none"):
        ranks = [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0]["scores"] == ranks[1]["scores"]
        for rank in ranks:
            (parent_held, parent_full), (variant_held, variant_full) = rank["held"].values()
            if mode == "fsdp":
                assert parent_held < 0.6 * parent_full and variant_held < 0.6 * variant_full, rank["held"]
            else:
                assert parent_held == parent_full and variant_held == variant_full
        two = load_scores(tmp_path / mode)
        assert two.tokens == one.tokens and two.parent_loss == pytest.approx(one.parent_loss, rel=1e-12)
        for variant, score in one.variants.items():
            other = two[variant]
            assert other.tokens == score.tokens and other.top1 == score.top1 and other.top5 == score.top5
            # Each rank scores whole batches, as one process does: only the order of the sums differs.
            for name in ("kl", "lm_loss_delta", "hidden_nmse"):
                assert getattr(other, name) == pytest.approx(getattr(score, name), rel=1e-9, abs=1e-12), name


def _bf16_worker(rank: int, world: int, port: int, directory: str) -> None:
    with gloo_rank(rank, world, port):
        for mode in ("fsdp", "none"):
            parent = _parent().to(torch.bfloat16)  # its MoE router stays fp32 (puzzle.blocks.moe)
            # Block 2's variants (a MoE), in bf16 as a bf16 run's library loads them: the router stays fp32.
            library = {
                v: m if m is None else m.to(torch.bfloat16)
                for v, m in _library(parent).items()
                if v.block_index == 2
            }
            records = _score_records(parent, library, Path(directory, mode), mode)
            Path(directory, f"{mode}-rank{rank}.json").write_text(json.dumps(records))


@pytest.mark.slow
def test_two_gloo_ranks_shard_bf16_moe_variants_whose_router_is_fp32(tmp_path):
    """A bf16 MoE variant keeps its router in fp32; FSDP2 wants one dtype over a unit's trainable parameters,
    so scored variants (never trained) are sharded without gradients: FSDP scores equal replicated ones."""
    spawn_ranks(_bf16_worker, str(tmp_path))
    sharded, replicated = (
        json.loads((tmp_path / f"{mode}-rank0.json").read_text()) for mode in ("fsdp", "none")
    )
    assert any(":moe:" in name for name in sharded) and sharded.keys() == replicated.keys()
    for name, record in sharded.items():
        assert record["tokens"] == replicated[name]["tokens"] > 0
        for key in ("kl", "lm_loss_delta", "hidden_nmse", "top1", "top5"):
            assert record[key] == pytest.approx(replicated[name][key], rel=1e-6, abs=1e-9), (name, key)


def test_an_unknown_shard_mode_is_an_error_naming_it():
    with pytest.raises(
        ValueError, match=r"ScoreSettings\.shard must be 'fsdp', 'hsdp' or 'none', found 'ddp'"
    ):
        ScoreSettings(shard="ddp")


# ----------------------------------------------------------------------------------------------------------
# variants_per_wave: "auto" (from the plan), an integer, None: the same scores, the parent run once per wave.


def test_scores_are_the_same_whatever_the_wave_size(tmp_path, caplog):
    parent, batches = _parent(), _batches()
    library = _library(parent)
    parent_forwards = [0]
    parent.embeddings.register_forward_hook(lambda *_: parent_forwards.__setitem__(0, parent_forwards[0] + 1))
    results, forwards = {}, {}
    for wave in (1, 3, None, "auto"):
        parent_forwards[0] = 0
        with caplog.at_level("INFO", logger="puzzle.score"):
            results[wave] = score_variants(
                parent, library, library, batches, tmp_path / str(wave), ScoreSettings(variants_per_wave=wave)
            )
        forwards[wave] = parent_forwards[0]
    count = len(library)
    # The parent runs once per batch per wave: an explicit size is honoured, None is one wave, and "auto"
    # on this host (gigabytes for a model of kilobytes) also takes every variant at once, saying why.
    assert forwards[1] == count * len(batches) and forwards[3] == -(-count // 3) * len(batches)
    assert forwards[None] == forwards["auto"] == len(batches)
    assert f"variants_per_wave auto -> {count}: {count} of {count} variants per wave" in caplog.text
    for wave, scores in results.items():
        assert scores.tokens == results[1].tokens and scores.parent_loss == results[1].parent_loss, wave
        assert scores.variants == results[1].variants, (
            wave
        )  # bit-equal: each variant's sums do not depend on it


def test_an_invalid_variants_per_wave_is_an_error_naming_it():
    for bad in (0, "all", 1.5):
        with pytest.raises(ValueError, match=r"ScoreSettings\.variants_per_wave must be 'auto'"):
            ScoreSettings(variants_per_wave=bad)
