"""Blockwise local distillation on a tiny trained parent: training lowers the held-out error, parent copies
stay exact, waves fit the memory limit and do not change the result, a diverging variant fails alone, a
SIGKILLed run resumes to the uninterrupted weights, and 2 gloo ranks (FSDP2: about half the parent each, a
crash and a resume) give the 1-process library."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from bld_helpers import (
    MEMORY_LIMIT,
    SPEC,
    load_setup,
    save_setup,
    settings,
    token_batches,
    variants,
)
from gloo_helpers import gloo_rank, spawn_ranks
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from puzzle.bld import CHECKPOINT_DIR, build_library, default_init
from puzzle.layout import variant_file_stem
from puzzle.library import LIBRARY_FILE, read_library, variant_file
from puzzle.plan import library_other_parts, plan_waves, variant_training_bytes
from puzzle.spec import Variant

HERE = Path(__file__).parent


class _Crash(Exception):
    pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bld_setup")
    save_setup(directory)
    return directory


def _build(setup: Path, output: Path, **kwargs):
    parent, importance = load_setup(setup)
    options = {"data_fingerprint": "train-300", **kwargs.pop("options", {})}
    train = options.pop("train", token_batches(12, seed=300))
    return build_library(
        parent,
        variants(),
        train,
        token_batches(2, seed=400),
        importance,
        settings(**kwargs),
        output,
        **options,
    )


def _weights(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    library = json.loads((directory / LIBRARY_FILE).read_text())
    return {
        entry["file"]: load_file(str(directory / entry["file"]))
        for entry in library["variants"]
        if entry["file"] is not None
    }


@pytest.fixture(scope="module")
def one_wave(setup, tmp_path_factory):
    output = tmp_path_factory.mktemp("bld_one_wave")
    return _build(setup, output), output


def test_training_lowers_the_held_out_error_and_parent_copies_stay_exact(one_wave):
    library, output = one_wave
    trained = [r for r in library.results.values() if r.status == "trained"]
    assert len(trained) == 8
    assert all(r.kept == "trained" and r.final_nmse == r.trained_nmse for r in trained)
    improved = [r for r in trained if r.final_nmse < r.init_nmse]
    assert len(improved) >= 0.9 * len(trained), [(r.variant.id, r.init_nmse, r.final_nmse) for r in trained]
    assert all(r.tokens == 12 * 4 * 16 for r in trained)

    (copy,) = [r for r in library.results.values() if r.status == "parent"]
    assert copy.variant.spec == SPEC.blocks[0] and copy.tokens == 0 and copy.file is None
    assert copy.final_nmse < 1e-12
    (noop,) = [r for r in library.results.values() if r.status == "noop"]
    assert noop.final_nmse == pytest.approx(1.0)  # the child adds nothing: the whole contribution is missed

    # The files: one per trained variant, the mixer's state dict; library.json says the same as the result.
    data = json.loads((output / LIBRARY_FILE).read_text())
    assert {entry["file"] for entry in data["variants"] if entry["status"] == "trained"} == {
        variant_file(r.variant) for r in trained
    }
    assert not (output / CHECKPOINT_DIR).exists()
    reread = read_library(output)
    assert reread.results == library.results and reread.plan == library.plan
    for result in trained:
        mixer = library.load_mixer(result.variant, SPEC.hidden_size, SPEC.norm_eps)
        assert mixer.spec == result.variant.spec


def test_a_finished_library_is_reused(one_wave, setup):
    library, output = one_wave
    manifest = (output / "library.manifest.json").read_text()
    again = _build(setup, output, options={"init": _refuse})  # would raise if any variant were built
    assert again.results == library.results
    assert (output / "library.manifest.json").read_text() == manifest


def _refuse(variant):
    raise AssertionError(f"variant {variant.id} was rebuilt")


def test_library_file_names_are_portable(one_wave):
    """Every path BLD writes is spelt in [A-Za-z0-9._-] (Windows and SMB shares refuse ':', which ids use);
    the ids themselves stay as they are in library.json."""
    library, output = one_wave
    names = [part for path in output.rglob("*") for part in path.relative_to(output).parts]
    assert names and [name for name in names if not re.fullmatch(r"[A-Za-z0-9._-]+", name)] == []
    data = json.loads((output / LIBRARY_FILE).read_text())
    assert {entry["id"] for entry in data["variants"]} == {v.id for v in library.results}
    assert any(":" in entry["id"] and entry["file"] for entry in data["variants"])


def test_variant_file_stems_are_portable_and_distinct():
    ids = [
        "moe:e4:k1:w8:s8",
        "moe:e4:k1:w8:s8:scale2.5",
        "mamba:h4:p8:n4:g2:dtmin1e-05",
        "attn:q4:kv2:d8:rope1e+16",
    ]
    ids += ["attn:q4:kv2:d8:rope1e_16", "linear", "mlp:w12avg.1a2b3c4d5e6f"]
    stems = [variant_file_stem(variant_id) for variant_id in ids]
    assert stems[0] == "moe_e4_k1_w8_s8"  # readable: ':' spelt '_'
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", stem) for stem in stems)
    assert len(set(stems)) == len(ids)


def test_a_library_written_with_the_old_file_names_still_loads(one_wave, setup, tmp_path):
    """A library from before portable names (`block3/moe:e4:k1:w8:s8.safetensors`, named so in library.json and
    its manifest) reads, loads the same weights and is reused by build_library as it is."""
    library, output = one_wave
    old = tmp_path / "old"
    shutil.copytree(output, old)
    data = json.loads((old / LIBRARY_FILE).read_text())
    manifest = json.loads((old / "library.manifest.json").read_text())
    del manifest["digests"]  # written before manifests recorded their outputs' digests
    for entry in data["variants"]:
        if entry["file"] is not None:
            legacy = f"block{entry['block_index']}/{entry['id']}.safetensors"
            (old / entry["file"]).rename(old / legacy)
            manifest["outputs"][legacy] = manifest["outputs"].pop(entry["file"])
            entry["file"] = legacy
    (old / LIBRARY_FILE).write_text(json.dumps(data))
    manifest["outputs"][LIBRARY_FILE] = (old / LIBRARY_FILE).stat().st_size
    (old / "library.manifest.json").write_text(json.dumps(manifest))
    assert any(":" in path.name for path in old.rglob("*.safetensors"))

    reread = read_library(old)
    assert reread.results == library.results
    trained = [r for r in library.results.values() if r.status == "trained"]
    for result in trained:
        variant = result.variant
        assert reread.results[variant].file == f"block{variant.block_index}/{variant.id}.safetensors"
        loaded = reread.load_mixer(result.variant, SPEC.hidden_size, SPEC.norm_eps).state_dict()
        expected = library.load_mixer(result.variant, SPEC.hidden_size, SPEC.norm_eps).state_dict()
        assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in loaded)
    again = _build(setup, old, options={"init": _refuse})  # reused as it is: nothing rebuilt or renamed
    assert {r.file for r in again.results.values()} == {r.file for r in reread.results.values()}


def test_wave_plan_respects_the_memory_limit_and_waves_do_not_change_the_weights(one_wave, setup, tmp_path):
    library, output = one_wave
    listed = [v for block in variants().values() for v in block if library.results[v].status == "trained"]
    sizes = {v: variant_training_bytes(v, SPEC.hidden_size, 64, torch.float32) for v in listed}
    plan = plan_waves(sizes, MEMORY_LIMIT)
    assert len(plan) >= 3
    flat = [v for wave in plan for v in wave]
    assert len(flat) == len(set(flat)) and set(flat) == set(listed)  # each variant exactly once
    assert all(sum(sizes[v] for v in wave) <= MEMORY_LIMIT for wave in plan)
    assert plan_waves(sizes, None) == [sorted(listed, key=lambda v: (v.block_index, v.id))]
    biggest = max(sizes, key=sizes.get)
    with pytest.raises(ValueError, match=f"variant {biggest.id} of block {biggest.block_index}"):
        plan_waves(sizes, sizes[biggest] - 1)

    waved = _build(setup, tmp_path, memory_limit_bytes=MEMORY_LIMIT)
    assert waved.plan == plan
    # Each variant's training is independent of its wave-mates: the same weights, bit for bit.
    expected = _weights(output)
    assert _weights(tmp_path).keys() == expected.keys()
    for name, tensors in _weights(tmp_path).items():
        for key, value in tensors.items():
            assert torch.equal(value, expected[name][key]), (name, key)


@pytest.mark.parametrize("grouping", ["two per wave", "auto on a small device"])
def test_counted_and_auto_waves_train_the_same_library_bit_for_bit(one_wave, setup, tmp_path, grouping):
    """`bld.variants_per_wave` N and "auto" (sized from the memory the run passes) only regroup the variants:
    each trains the same weights as in one wave, and the library's reuse key does not change."""
    library, output = one_wave
    if grouping == "two per wave":
        waved = _build(setup, tmp_path, variants_per_wave=2)
        assert all(len(wave) <= 2 for wave in waved.plan)
    else:
        # A device whose usable memory leaves room for about two of the largest variants beside the rest.
        parent, _ = load_setup(setup)
        sizes = {v: variant_training_bytes(v, SPEC.hidden_size, 64, torch.float32) for v in library.plan[0]}
        others = library_other_parts(
            parent.spec, list(sizes), tokens=64, dtype_bytes=4, train_bytes=4, world=1
        )
        memory = sum(others.values()) + 2.5 * max(sizes.values())
        waved = _build(setup, tmp_path, options={"memory_bytes": memory})
    assert len(waved.plan) >= 2 and {v for w in waved.plan for v in w} == set(library.plan[0])
    expected = _weights(output)
    assert _weights(tmp_path).keys() == expected.keys()
    for name, tensors in _weights(tmp_path).items():
        for key, value in tensors.items():
            assert torch.equal(value, expected[name][key]), (grouping, name, key)
    # The finished library in `output` is reused under the other grouping, without training.
    assert _build(setup, output, variants_per_wave=1, options={"init": _refuse}).results == library.results


def test_a_diverging_variant_is_recorded_as_failed_and_the_others_finish(one_wave, setup, tmp_path):
    _, output = one_wave
    parent, importance = load_setup(setup)
    base = default_init(parent, importance)
    poisoned = variants()[1][0]  # the attention variant

    def init(variant: Variant):
        mixer = base(variant)
        if variant == poisoned:
            with torch.no_grad():
                mixer.q_proj.weight[0, 0] = float("inf")
        return mixer

    result = _build(setup, tmp_path, options={"init": init})
    failed = result.results[poisoned]
    assert (failed.status, failed.failed_step, failed.file) == ("failed", 0, None)
    assert "loss is nan" in failed.reason or "loss is inf" in failed.reason
    data = {
        (e["block_index"], e["id"]): e for e in json.loads((tmp_path / LIBRARY_FILE).read_text())["variants"]
    }
    assert data[(1, poisoned.id)]["status"] == "failed" and data[(1, poisoned.id)]["failed_step"] == 0
    # The others trained exactly as without the failure.
    expected = _weights(output)
    got = _weights(tmp_path)
    assert set(expected) - set(got) == {variant_file(poisoned)}
    for name, tensors in got.items():
        for key, value in tensors.items():
            assert torch.equal(value, expected[name][key]), (name, key)


def test_variants_that_training_made_worse_keep_their_initial_weights_and_say_so(setup, tmp_path):
    # lr=30 makes every variant diverge: some to a finite but larger error, some to NaN / inf gradients. The
    # run dies mid-wave and resumes: the initial weights saved when the wave started outlive the crash.
    train, calls = token_batches(12, seed=300), []

    def crashing():  # call 1 reads the first batch; call 2 (the wave) dies at batch 7, after the step-6 checkpoint
        calls.append(1)
        for index, batch in enumerate(train):
            if len(calls) == 2 and index == 7:
                raise _Crash
            yield batch

    with pytest.raises(_Crash):
        _build(setup, tmp_path, lr=30.0, checkpoint_every=3, options={"train": crashing})
    assert json.loads((tmp_path / CHECKPOINT_DIR / "wave0.json").read_text())["step"] == 6
    library = _build(setup, tmp_path, lr=30.0, checkpoint_every=3)
    parent, importance = load_setup(setup)
    init = default_init(parent, importance)
    data = json.loads((tmp_path / LIBRARY_FILE).read_text())["variants"]
    diverged = [e for e in data if e["reason"] is not None]
    worse = [e for e in data if e["trained_nmse"] is not None and e["trained_nmse"] > e["init_nmse"]]
    assert diverged and worse  # both ways of going wrong are exercised
    for entry in data:
        if entry["status"] in ("parent", "noop"):
            assert entry["kept"] is None and entry["file"] is None
            continue
        assert (entry["status"], entry["kept"]) == ("trained", "init"), entry
        assert entry["final_nmse"] == entry["init_nmse"] is not None
        (result,) = [
            r
            for v, r in library.results.items()
            if (v.block_index, v.id) == (entry["block_index"], entry["id"])
        ]
        assert result.kept == "init" and result.final_nmse == entry["final_nmse"]
        # The library file holds init_child's weights, bit for bit, and the mixer loads them.
        expected = init(result.variant).state_dict()
        saved = load_file(str(tmp_path / entry["file"]))
        assert saved.keys() == expected.keys()
        for key, value in saved.items():
            assert torch.equal(value, expected[key]), (entry["id"], key)
        library.load_mixer(result.variant, SPEC.hidden_size, SPEC.norm_eps)
    for entry in diverged:  # training stopped there; the record says where and why
        assert entry["trained_nmse"] is None and entry["failed_step"] is not None
        assert "nan" in entry["reason"] or "inf" in entry["reason"]


@pytest.mark.slow
def test_a_sigkilled_run_resumes_to_the_uninterrupted_weights(setup, tmp_path):
    script = HERE / "bld_helpers.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "PUZZLE_PROGRESS": "0"}
    killed = tmp_path / "killed" / "library"
    killed.parent.mkdir()
    process = subprocess.Popen(
        [sys.executable, str(script), str(setup), str(killed), "7"], env=env, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 240
        while not (killed.parent / "stalled").exists():
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "the BLD subprocess never reached its stall point"
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    checkpoints = killed / CHECKPOINT_DIR
    assert (checkpoints / "done" / "wave0.json").is_file()  # wave 0 finished
    assert json.loads((checkpoints / "wave1.json").read_text())["step"] == 6  # wave 1 mid-way
    assert not (killed / LIBRARY_FILE).exists()

    subprocess.run([sys.executable, str(script), str(setup), str(killed)], env=env, check=True)
    from bld_helpers import main  # the uninterrupted run, in this process

    uninterrupted = tmp_path / "uninterrupted"
    main(setup, uninterrupted, None)
    expected = _weights(uninterrupted)
    got = _weights(killed)
    assert got.keys() == expected.keys()
    for name, tensors in got.items():
        for key, value in tensors.items():
            assert torch.equal(value, expected[name][key]), (name, key)
    resumed = json.loads((killed / LIBRARY_FILE).read_text())["variants"]
    assert resumed == json.loads((uninterrupted / LIBRARY_FILE).read_text())["variants"]


def _worker(rank: int, world: int, port: int, setup: str, output: str) -> None:
    with gloo_rank(rank, world, port):
        train = token_batches(12, seed=300)
        calls, crashed = [], []

        def crashing():  # call 1 reads the first batch; in call 2 (the wave) both ranks fail at batch 7
            calls.append(1)
            for index, batch in enumerate(train):
                if len(calls) == 2 and index == 7:
                    raise _Crash
                yield batch

        # The first run dies after its step-5 checkpoint; the second resumes from it (sharded state reloaded).
        for stream in (crashing, lambda: train):
            parent, importance = load_setup(Path(setup))
            try:
                build_library(
                    parent,
                    variants(),
                    stream,
                    token_batches(2, seed=400),
                    importance,
                    settings(checkpoint_every=5),
                    Path(output),
                    data_fingerprint="train-300",
                )
            except _Crash:
                assert (Path(output) / CHECKPOINT_DIR / "wave0.json").is_file()
                crashed.append(1)
        assert crashed, "the first run should have died mid-wave"
        local = sum(
            p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in parent.parameters()
        )
        full = sum(p.numel() for p in parent.parameters())
        Path(f"{output}-rank{rank}.json").write_text(json.dumps({"local": local, "full": full}))
        parent, importance = load_setup(Path(setup))  # the replicated path: gradients all-reduced
        build_library(
            parent,
            variants(),
            train,
            token_batches(2, seed=400),
            importance,
            settings(shard="none"),
            Path(f"{output}-none"),
            data_fingerprint="train-300",
        )


@pytest.mark.slow
def test_two_gloo_ranks_give_the_single_process_library(one_wave, setup, tmp_path):
    library, output = one_wave
    spawn_ranks(_worker, str(setup), str(tmp_path))
    for rank in range(2):  # FSDP sharded the parent: each rank holds about half of it
        numels = json.loads(Path(f"{tmp_path}-rank{rank}.json").read_text())
        assert numels["local"] < 0.6 * numels["full"], numels
    _assert_same_library(library, output, tmp_path)  # FSDP2 (default), resumed mid-wave
    _assert_same_library(library, output, Path(f"{tmp_path}-none"))  # shard="none": replicated


def _assert_same_library(library, output: Path, directory: Path) -> None:
    two = read_library(directory)
    assert {v: r.status for v, r in two.results.items()} == {v: r.status for v, r in library.results.items()}
    for variant, result in two.results.items():
        assert result.final_nmse == pytest.approx(library.results[variant].final_nmse, rel=1e-4, abs=1e-9)
    expected = _weights(output)
    got = _weights(directory)
    assert got.keys() == expected.keys()
    for name, tensors in got.items():
        for key, value in tensors.items():
            # Summation order only: a top-1 router's gradient of rounding noise (which AdamW once turned into
            # lr-sized steps) is gone, so every tensor, routers included, agrees to 1e-5.
            torch.testing.assert_close(value, expected[name][key], rtol=1e-4, atol=1e-5, msg=f"{name} {key}")


def test_an_unknown_shard_mode_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"BLDSettings\.shard must be 'fsdp', 'hsdp' or 'none', found 'ddp'"):
        settings(shard="ddp")
