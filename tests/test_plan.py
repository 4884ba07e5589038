"""`puzzle plan` and puzzle/plan.py: per-rank memory against the real FSDP2-sharded model, scaling with the
number of ranks, the refusal (exit 2 naming the stage) of `puzzle plan` and `puzzle run`, and a plan made
from a parent folder that holds only config.json."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from run_helpers import SPEC as RUN_SPEC
from run_helpers import config_dict, make_inputs, write_config
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from puzzle import nemotron_h, shard
from puzzle.blocks import build_block
from puzzle.cli import main
from puzzle.config import load_config
from puzzle.cost.analytic import model_params
from puzzle.cost.hardware import HardwareProfile
from puzzle.model import HybridLM
from puzzle.plan import (
    parent_bytes,
    plan_config,
    plan_run,
    run_hardware,
    scoring_wave_size,
    variant_training_bytes,
)
from puzzle.presets import nemotron3_super
from puzzle.run import Run
from puzzle.run.scores import scoring_settings
from puzzle.spec import AttentionSpec, MambaSpec, ModelSpec, MoESpec, Variant

ROOT = Path(__file__).resolve().parent.parent
SUPER_PARENT = ROOT / "examples" / "parents" / "nemotron3_super"
# Every kind, odd sizes: first dimensions that do not divide by 3 ranks (FSDP pads the last shard).
SPEC = ModelSpec(
    vocab_size=41,
    hidden_size=16,
    blocks=(
        MambaSpec(num_heads=4, head_dim=4, state_size=6, n_groups=2, chunk_size=8),
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4),
        MoESpec(num_experts=5, top_k=2, expert_width=(8, 6, 8, 8, 4), shared_width=8, latent_size=12),
    ),
)


@contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process as `rank` of a `world`-rank group whose collectives do nothing (torch's fake backend):
    fully_shard then gives each parameter exactly the local shard it would have on that rank."""
    torch_dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        torch_dist.destroy_process_group()


def local_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds (a DTensor's local shard) plus every buffer."""
    params = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in module.parameters()
    )
    return params + sum(b.numel() * b.element_size() for b in module.buffers())


@pytest.mark.parametrize("world", [2, 3])
def test_parent_bytes_per_rank_are_the_sharded_models_local_bytes(world):
    with torch.device("meta"):
        whole = local_bytes(HybridLM(SPEC))
    planned = parent_bytes(SPEC, 4, world)
    assert planned.whole == whole
    held = []
    for rank in range(world):
        with fake_world(rank, world):
            with torch.device("meta"):
                model = HybridLM(SPEC)
            shard.shard_parent(model)
            assert any(isinstance(p, DTensor) for p in model.parameters())
            held.append(local_bytes(model))
    assert planned.sharded == max(held) == held[0]  # rank 0 holds the largest shard: the plan's figure
    assert held[-1] < held[0]  # the odd first dimensions left the last rank less (so the test can fail)
    units = [model.embeddings, model.lm_head, *(layer.mixer for layer in model.layers)]
    assert planned.largest_unit == max(4 * sum(p.numel() for p in unit.parameters()) for unit in units)


def test_parent_bytes_unsharded_in_one_process():
    planned = parent_bytes(SPEC, 4, 1)
    assert planned.sharded == planned.whole and planned.largest_unit == 0


def test_bld_variant_bytes_count_one_ranks_shard():
    variant = Variant(2, MoESpec(num_experts=5, top_k=1, expert_width=4, shared_width=8, latent_size=12))
    with fake_world(0, 3):
        with torch.device("meta"):
            mixer = build_block(variant.spec, SPEC.hidden_size)
        shard.shard_variant(mixer)
        local = sum(p.to_local().numel() for p in mixer.parameters())
    whole, sharded = (variant_training_bytes(variant, SPEC.hidden_size, 0, torch.float32, w) for w in (1, 3))
    assert sharded == 4 * local * 4  # params, grads and two AdamW moments of this rank's shard, fp32
    assert sharded < whole


def test_sharded_memory_scales_as_one_over_the_ranks():
    spec = nemotron3_super()
    whole = parent_bytes(spec, 2, 1).whole
    assert whole == pytest.approx(2 * model_params(spec), rel=1e-4)  # + the routers' fp32 biases
    for world in (2, 4, 8, 16):
        sharded = parent_bytes(spec, 2, world).sharded
        assert whole / world <= sharded <= whole / world * 1.001  # replicated norms and padding only


def tiny_profile(memory_bytes: int) -> HardwareProfile:
    return HardwareProfile("tiny", (("bf16", 1e12),), 1e11, memory_bytes)


def test_plan_names_the_stage_that_does_not_fit(tmp_path):
    config = load_config(write_config(tmp_path / "run.yaml", config_dict(tmp_path)))
    roomy = plan_run(config, RUN_SPEC, 1, tiny_profile(10**12))
    assert roomy.misfits() == []
    assert all(s.seconds is None or s.seconds > 0 for s in roomy.stages)
    peaks = {s.name: s.peak for s in roomy.stages}
    between = sorted(peaks.values())[-1] / 0.9 - 1  # only the largest stage no longer fits
    largest = max(peaks, key=peaks.__getitem__)
    tight = plan_run(config, RUN_SPEC, 1, tiny_profile(int(between)))
    assert [line.split(":")[0] for line in tight.misfits()] == [f"stage {largest}"]


def test_more_ranks_lower_every_stages_peak(tmp_path):
    data = config_dict(tmp_path)
    data["bld"]["shard"] = data["gkd"]["shard"] = "fsdp"
    data["data"]["batch_size"] = data["gkd"]["batch_size"] = 8
    config = load_config(write_config(tmp_path / "run.yaml", data))
    spec = nemotron3_super()
    one, eight = (plan_run(config, spec, n, tiny_profile(10**15)) for n in (1, 8))
    for a, b in zip(one.stages, eight.stages):
        if a.peak:
            assert b.peak < a.peak, a.name
    distill = {s.name: s for s in eight.stages}["distill"]
    assert distill.memory["teacher shard"] == pytest.approx(parent_bytes(spec, 4, 8).sharded)


def write_parent_config(directory: Path, spec: ModelSpec) -> Path:
    """A parent folder holding nothing but config.json."""
    directory.mkdir(parents=True)
    (directory / nemotron_h.CONFIG_NAME).write_text(json.dumps(nemotron_h.config_from_spec(spec)))
    return directory


def test_puzzle_plan_reads_only_config_json(tmp_path, capsys):
    data = config_dict(tmp_path)
    data["parent"]["path"] = str(write_parent_config(tmp_path / "parent", RUN_SPEC))
    path = write_config(tmp_path / "run.yaml", data)
    assert main(["plan", str(path), "--gpus", "2", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    for stage in ("importance", "library", "scores", "solutions", "assemble", "distill", "export"):
        assert f"\n{stage}: " in f"\n{out}"
    assert "2 x h100-80gb" in out and "does not fit" not in out
    assert sorted(p.name for p in (tmp_path / "parent").iterdir()) == ["config.json"]
    assert not (tmp_path / "run").exists()  # nothing written


def test_nxname_hardware_is_n_ranks_of_one_gpu_each(capsys):
    """`--hardware 8xb200` (as `puzzle costs` names a server) plans 8 ranks of one B200 each, as `--gpus 8
    --hardware b200` does, not one rank with the memory of 8; another --gpus is an error naming the form."""
    path = str(ROOT / "examples" / "configs" / "nemotron3_super.yaml")
    assert main(["plan", path, "--gpus", "8", "--hardware", "b200", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    for argv in (["--hardware", "8xb200"], ["--hardware", "8xb200", "--gpus", "8"]):
        assert main(["plan", path, *argv, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == expected
    assert main(["plan", path, "--hardware", "8xb200"]) == 0
    assert "hardware: 8 x b200 (167.6 GiB each" in capsys.readouterr().out
    assert main(["plan", path, "--hardware", "8xb200", "--gpus", "4"]) == 2
    assert capsys.readouterr().err == (
        "puzzle plan: error: --hardware 8xb200 is 8 GPUs (ranks) of b200, but --gpus says 4: give --gpus N "
        "--hardware b200\n"
    )
    # A serving profile NxNAME in the config: each rank of the plan (and of `puzzle run`'s check) is one NAME.
    config = load_config(path)
    serving = dataclasses.replace(config, hardware=dataclasses.replace(config.hardware, profile="8xb200"))
    assert plan_config(serving, 8).to_dict() == plan_config(config, 8, "b200").to_dict()
    assert run_hardware(serving).memory_bytes == run_hardware(config).memory_bytes  # b200 both, on the CPU


def test_puzzle_plan_exits_2_naming_the_stage_for_a_huge_parent(tmp_path, capsys):
    data = config_dict(tmp_path)
    data["parent"] = {"path": str(SUPER_PARENT), "dtype": "bfloat16"}
    path = write_config(tmp_path / "run.yaml", data)
    assert main(["plan", str(path), "--gpus", "1", "--hardware", "h100"]) == 2
    err = capsys.readouterr().err
    assert "puzzle plan: does not fit: stage importance: peak memory per rank" in err
    assert "the largest part is parent shard" in err
    plan = plan_config(load_config(path), 64, "b200")
    assert "importance" not in " ".join(plan.misfits())  # 1/64 of the parent fits


def test_puzzle_run_refuses_before_any_work(tmp_path, capsys):
    data = make_inputs(tmp_path)
    data["hardware"]["memory_fraction"] = 1e-9  # about 80 bytes of an H100
    path = write_config(tmp_path / "run.yaml", data)
    assert main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "puzzle run: does not fit: stage importance" in err
    assert not (tmp_path / "run").exists()


def test_super_example_plans_from_its_config_json_only(capsys):
    config = load_config(ROOT / "examples" / "configs" / "nemotron3_super.yaml")
    assert config.parent.path.resolve() == SUPER_PARENT
    assert [p.name for p in SUPER_PARENT.iterdir()] == ["config.json"]
    plan = plan_config(config, 8, "b200")
    stages = {s.name: s for s in plan.stages}
    # 241 GB of bf16 weights over 8 ranks, every block's mixer and the embeddings one unit each; the largest
    # unit gathered whole is an MoE mixer (2.87B parameters with its norm, the seed's "about 2.8B").
    assert stages["importance"].memory["parent shard"] == pytest.approx(2 * 120.67e9 / 8, rel=1e-3)
    assert stages["importance"].memory["gathered unit"] == pytest.approx(2 * (2_873_102_848 - 4096), rel=1e-6)
    assert math.isfinite(sum(s.seconds or 0 for s in plan.stages))


def test_gkd_activation_checkpointing_lets_super_fit_on_8_b200s():
    """Issue 22 section 3: Super's GKD saved 405 GiB of activations per rank; per-block checkpointing keeps the
    block inputs (bf16) and the teacher's residual streams (bf16), and one block's activations, at one more
    student forward of FLOPs."""
    config = load_config(ROOT / "examples" / "configs" / "nemotron3_super.yaml")
    assert config.gkd.activation_checkpointing and config.gkd.dtype == "bfloat16"
    plain = dataclasses.replace(config, gkd=dataclasses.replace(config.gkd, activation_checkpointing=False))
    whole = {on: plan_config(c, 8, "b200") for on, c in ((True, config), (False, plain))}
    plans = {on: {s.name: s for s in plan.stages}["distill"] for on, plan in whole.items()}
    spec = nemotron3_super()
    tokens = config.data.seq_len * config.gkd.micro_batches(8).micro
    assert plans[True].memory["saved block inputs"] == spec.num_blocks * tokens * spec.hidden_size * (2 + 2)
    assert plans[False].memory["saved activations"] > 10 * plans[True].memory["saved block inputs"]
    assert plans[True].peak < whole[True].limit < plans[False].peak
    assert plans[True].flops > plans[False].flops


def test_the_plan_of_a_moved_parent_folder(tmp_path):
    # --parent: the plan of a config whose parent.path is elsewhere (another machine's path).
    copy = tmp_path / "super"
    shutil.copytree(SUPER_PARENT, copy)
    config = load_config(ROOT / "examples" / "configs" / "nemotron3_super.yaml")
    moved = dataclasses.replace(config, parent=dataclasses.replace(config.parent, path=copy))
    assert plan_config(moved, 8, "b200").to_dict() == plan_config(config, 8, "b200").to_dict()


# ---------------------------------------------------------------------------------------------------------
# scoring.variants_per_wave: "auto" from the plan's scoring peak per rank and the memory; an integer honoured.


def _scores_peak(config, size) -> float:
    """The plan's scoring peak per rank (1 rank) with an explicit wave of `size` variants."""
    scoring = dataclasses.replace(config.scoring, variants_per_wave=size)
    plan = plan_run(dataclasses.replace(config, scoring=scoring), RUN_SPEC, 1, tiny_profile(10**12))
    return {s.name: s for s in plan.stages}["scores"].peak


def test_auto_variants_per_wave_is_smaller_when_the_memory_is_smaller(tmp_path):
    data = config_dict(tmp_path)
    data["scoring"]["variants_per_wave"] = "auto"
    config = load_config(write_config(tmp_path / "run.yaml", data))
    count = sum(map(len, config.search_space().all_variants(RUN_SPEC).values()))
    fraction = config.hardware.memory_fraction
    assert count >= 4
    roomy = scoring_wave_size(config, RUN_SPEC, 1, 10**12)
    assert roomy.size == count and f"{count} of {count} variants per wave" in roomy.reason
    # Memory below the peak of one wave of everything: auto takes a size whose planned peak fits, and one
    # more would not; less memory than one variant needs: 1.
    peaks = {n: _scores_peak(config, n) for n in range(1, count + 1)}
    limit = (min(peaks.values()) + peaks[count]) / 2
    assert limit < peaks[count]
    tight = scoring_wave_size(config, RUN_SPEC, 1, limit / fraction)
    expected = tight.size
    assert 1 < expected < count and peaks[expected] <= limit < peaks[expected + 1], (tight, peaks)
    assert f"{expected + 1} per wave would need" in tight.reason
    assert scoring_wave_size(config, RUN_SPEC, 1, peaks[1] / 2).size == 1
    # `puzzle plan` shows the chosen size and why.
    plan = plan_run(config, RUN_SPEC, 1, tiny_profile(int(limit / fraction)))
    scores = {s.name: s for s in plan.stages}["scores"]
    assert f"waves of up to {expected} " in scores.units
    assert any(f"auto: {expected} of {count}" in note for note in scores.notes), scores.notes


def test_an_explicit_variants_per_wave_is_honoured_by_the_plan_and_the_run(tmp_path):
    data = make_inputs(tmp_path)
    data["scoring"]["variants_per_wave"] = 3
    data["hardware"]["memory_fraction"] = 1e-9  # auto would take 1
    config = load_config(write_config(tmp_path / "run.yaml", data))
    scores = {s.name: s for s in plan_run(config, RUN_SPEC, 1, tiny_profile(10**12)).stages}["scores"]
    assert "waves of up to 3 " in scores.units and not any("auto" in note for note in scores.notes)
    run = Run.from_config(tmp_path / "run.yaml")
    parent = HybridLM(RUN_SPEC)
    variants = [v for listed in config.search_space().all_variants(RUN_SPEC).values() for v in listed]
    assert scoring_settings(run, parent, variants).variants_per_wave == 3
    data["scoring"]["variants_per_wave"] = "auto"
    auto = Run.from_config(write_config(tmp_path / "auto.yaml", data))
    assert scoring_settings(auto, parent, variants).variants_per_wave == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU run's memory")
def test_auto_variants_per_wave_of_a_cpu_run_fits_this_machines_memory(tmp_path, caplog, monkeypatch):
    """On the CPU the automatic wave is sized against this machine's memory (its share per rank of the node),
    not the GPU of the configured profile (an H100 by default), which only stands in for `puzzle run`'s plan
    check."""
    data = make_inputs(tmp_path)
    data["scoring"]["variants_per_wave"] = "auto"
    config = load_config(write_config(tmp_path / "run.yaml", data))
    parent = HybridLM(RUN_SPEC)
    variants = [v for listed in config.search_space().all_variants(RUN_SPEC).values() for v in listed]
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for ranks in (1, 2):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        caplog.clear()
        with caplog.at_level("INFO", logger="puzzle.run"):
            scoring_settings(Run(config.run_dir, config), parent, variants)
        where = "host memory" if ranks == 1 else f"host memory / {ranks} ranks"
        per_rank = f"{config.hardware.memory_fraction:g} x {host // ranks / 2**30:.1f} GiB per rank"
        assert f"({per_rank}, 1 rank(s)) of {where}" in caplog.text, caplog.text


def test_forward_stages_plan_whole_batches_per_rank_and_export_holds_the_parent():
    """Importance and scoring run whole batches per rank (a round-robin share, `puzzle.dist.shard`) and the
    measured KL every held-out batch whole on every sharded rank: their activations do not shrink with the
    ranks. Export assembles the child again from the parent it holds, so it counts the parent's shard too."""
    config = load_config(ROOT / "examples" / "configs" / "nemotron3_super.yaml")
    one, eight = ({s.name: s for s in plan_config(config, n, "b200").stages} for n in (1, 8))
    for stage in ("importance", "scores", "assemble"):
        assert eight[stage].memory["block activations"] == one[stage].memory["block activations"], stage
    assert eight["assemble"].memory["logits chunks"] == one["assemble"].memory["logits chunks"]
    assert eight["export"].memory["parent shard"] == eight["importance"].memory["parent shard"]
    assert "streamed out one tensor at a time" in " ".join(eight["export"].notes)
