"""puzzle.artifacts: fingerprints, atomic manifests, exact-match reuse, rank-0 writes on 2 gloo ranks; importance reuse."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from gloo_helpers import gloo_rank, spawn_ranks
from safetensors.torch import load_file

from puzzle import __version__
from puzzle.artifacts import (
    MANIFEST_SUFFIX,
    Artifact,
    ArtifactError,
    _file_key,
    damaged_files,
    fingerprint_file,
    fingerprint_json,
    fingerprint_model,
    fingerprint_spec,
    fingerprint_tensors,
    json_writer,
    safetensors_writer,
)
from puzzle.model import HybridLM
from puzzle.prune.importance import MANIFEST_FILE, importance_for, load_importance, parent_fingerprint
from puzzle.spec import MLPSpec


@pytest.fixture(scope="module")
def spec():
    # Imported here, not at the top: the spawned gloo ranks import this module, and nemotron_helpers loads
    # transformers (seconds per process on a busy machine).
    from nemotron_helpers import EVERY_KIND_SPEC

    return EVERY_KIND_SPEC


INPUTS = {"parent": "p" * 64, "calibration": "c" * 64, "settings": "s" * 64}
TENSORS = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}


def _write(artifact: Artifact, inputs=INPUTS, tensors=TENSORS, info=None):
    outputs = {"scores.safetensors": safetensors_writer(tensors), "sub/summary.json": json_writer({"n": 1})}
    return artifact.write(inputs, outputs, info or {"tokens": 12})


# ----------------------------------------------------------------------------------------------------------
# Fingerprints


def test_tensor_fingerprint_sees_values_dtype_shape_order_and_batching():
    ids = [torch.arange(12).reshape(2, 6), torch.arange(4).reshape(1, 4)]
    same = fingerprint_tensors([t.clone() for t in ids])
    assert fingerprint_tensors(ids) == same and len(same) == 64
    changed = [ids[0].clone(), ids[1].clone()]
    changed[1][0, 3] = 99
    assert fingerprint_tensors(changed) != same  # one token differs
    assert fingerprint_tensors([ids[0].int(), ids[1].int()]) != same  # same values, other dtype
    assert fingerprint_tensors([ids[0].reshape(3, 4), ids[1]]) != same  # same bytes, other shape
    assert fingerprint_tensors(ids[::-1]) != same  # other order
    assert fingerprint_tensors([torch.cat([ids[0].reshape(-1), ids[1].reshape(-1)])]) != same  # other split
    assert fingerprint_tensors([ids[0].T.contiguous().T, ids[1]]) == same  # memory layout does not count
    bf16 = torch.randn(3, 5).bfloat16()
    assert fingerprint_tensors([bf16]) == fingerprint_tensors([bf16.clone()])  # numpy has no bfloat16
    assert fingerprint_tensors({"x": ids[0], "y": ids[1]}) == fingerprint_tensors({"y": ids[1], "x": ids[0]})
    with pytest.raises(TypeError, match="item 1 is a list"):
        fingerprint_tensors([ids[0], [1, 2]])


def test_json_spec_file_and_model_fingerprints(spec, tmp_path):
    assert fingerprint_json({"a": 1, "b": [1, 2]}) == fingerprint_json({"b": [1, 2], "a": 1})
    assert fingerprint_json({"a": 1}) != fingerprint_json({"a": 1.5})
    assert fingerprint_spec(spec) == fingerprint_spec(HybridLM(spec).spec)
    assert fingerprint_spec(MLPSpec(8)) != fingerprint_spec(MLPSpec(9))
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"\x00" * (3 << 20) + b"x")  # more than one read chunk
    before = fingerprint_file(path)
    path.write_bytes(b"\x00" * (3 << 20) + b"y")
    assert fingerprint_file(path) != before
    with pytest.raises(FileNotFoundError, match=r"missing\.bin"):
        fingerprint_file(tmp_path / "missing.bin")
    torch.manual_seed(0)
    model = HybridLM(spec)
    assert fingerprint_model(model) == parent_fingerprint(model)
    with torch.no_grad():
        model.layers[3].mixer.up_proj.weight[0, 0] += 1.0  # inside the sampled first 64 values
    assert fingerprint_model(model) != parent_fingerprint(HybridLM(spec))


# ----------------------------------------------------------------------------------------------------------
# Write, read, reuse


def test_write_is_atomic_and_the_manifest_lists_what_was_written(tmp_path):
    artifact = Artifact(tmp_path, "stage", 3)
    manifest = _write(artifact)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "scores.safetensors",
        f"stage{MANIFEST_SUFFIX}",
        "sub/summary.json",
    ]  # no temporaries left
    on_disk = json.loads(artifact.manifest_path.read_text())
    assert on_disk["manifest"] == 1 and on_disk["stage"] == "stage" and on_disk["format"] == 3
    assert on_disk["producer"] == {"puzzle": __version__, "stage": "stage"}
    assert on_disk["inputs"] == INPUTS and on_disk["info"] == {"tokens": 12}
    assert on_disk["outputs"] == {
        "scores.safetensors": (tmp_path / "scores.safetensors").stat().st_size,
        "sub/summary.json": (tmp_path / "sub/summary.json").stat().st_size,
    }
    assert on_disk["created"].endswith("+00:00")
    assert artifact.read_manifest() == manifest
    loaded = artifact.load_tensors("scores.safetensors")
    assert loaded.keys() == TENSORS.keys() and all(torch.equal(loaded[k], v) for k, v in TENSORS.items())
    assert artifact.load_json("sub/summary.json") == {"n": 1}
    for bad in ("../escape.json", "/abs.json", f"other{MANIFEST_SUFFIX}", ""):
        with pytest.raises(ValueError, match="relative path inside"):
            artifact.write(INPUTS, {bad: json_writer(1)})
    with pytest.raises(TypeError):  # info must be JSON; nothing is written
        artifact.write(INPUTS, {"x.json": json_writer(1)}, {"t": torch.ones(1)})
    assert not (tmp_path / "x.json").exists() and artifact.read_manifest() == manifest


def test_reuse_only_on_an_exact_match(tmp_path):
    artifact = Artifact(tmp_path, "stage", 3)
    assert artifact.load_if_current(INPUTS) is None
    assert artifact.why_not_current(INPUTS) == f"no manifest {artifact.manifest_path}"
    manifest = _write(artifact)
    assert artifact.load_if_current(dict(reversed(INPUTS.items()))) == manifest  # key order does not count
    for key in INPUTS:
        changed = {**INPUTS, key: "0" * 64}
        assert artifact.load_if_current(changed) is None
        assert artifact.why_not_current(changed).endswith(f"other inputs: {key} differ")
    fewer = {k: v for k, v in INPUTS.items() if k != "settings"}
    assert artifact.load_if_current(fewer) is None and "settings differ" in artifact.why_not_current(fewer)
    assert artifact.load_if_current({**INPUTS, "seed": "1"}) is None
    # Another format version or another stage name reads the same files as foreign.
    assert Artifact(tmp_path, "stage", 4).load_if_current(INPUTS) is None
    assert "stage format 3, expected 4" in Artifact(tmp_path, "stage", 4).why_not_current(INPUTS)
    assert artifact.load_if_current(INPUTS) == manifest  # none of that touched the files


def test_damaged_outputs_or_manifest_mean_recompute_and_explicit_reads_raise(tmp_path):
    artifact = Artifact(tmp_path, "stage", 3)
    _write(artifact)
    scores = tmp_path / "scores.safetensors"
    good = scores.read_bytes()
    scores.write_bytes(good[:-3])  # truncated
    assert artifact.load_if_current(INPUTS) is None
    assert "scores.safetensors has" in artifact.why_not_current(INPUTS)
    with pytest.raises(ArtifactError, match=r"cannot read stage tensors .*scores\.safetensors"):
        artifact.load_tensors("scores.safetensors")
    scores.unlink()
    assert "scores.safetensors listed in" in artifact.why_not_current(INPUTS)
    scores.write_bytes(good)
    assert artifact.load_if_current(INPUTS) is not None
    text = artifact.manifest_path.read_text()
    for damaged, message in (
        (text[: len(text) // 2], "is not valid JSON"),
        ("[1, 2]", "a manifest is a JSON object, found list"),
        (json.dumps({**json.loads(text), "manifest": 7}), "manifest layout 7, expected 1"),
        (json.dumps({**json.loads(text), "inputs": ["a"]}), "key 'inputs' should be a dict, found list"),
        (json.dumps({**json.loads(text), "format": True}), "key 'format' should be a int, found bool"),
        (json.dumps({**json.loads(text), "stage": "other"}), "written by stage 'other', expected 'stage'"),
    ):
        artifact.manifest_path.write_text(damaged)
        assert artifact.load_if_current(INPUTS) is None
        assert message in artifact.why_not_current(INPUTS)
        with pytest.raises(ArtifactError, match=message):
            artifact.read_manifest()
    assert _write(artifact).inputs == INPUTS  # a recompute overwrites the damaged manifest
    assert artifact.load_if_current(INPUTS) is not None


def test_a_failed_write_leaves_no_manifest_for_half_replaced_files(tmp_path):
    artifact = Artifact(tmp_path, "stage", 3)
    _write(artifact)

    def crash(path: str) -> None:
        raise OSError("disk full")

    new_inputs = {**INPUTS, "parent": "q" * 64}
    with pytest.raises(OSError, match="disk full"):
        artifact.write(
            new_inputs, {"scores.safetensors": safetensors_writer({"a": torch.zeros(1)}), "x": crash}
        )
    # scores.safetensors already holds the new parent's tensors: no manifest may vouch for it any more.
    assert load_file(str(tmp_path / "scores.safetensors"))["a"].shape == (1,)
    assert not artifact.manifest_path.exists()
    assert artifact.load_if_current(INPUTS) is None and artifact.load_if_current(new_inputs) is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temporary was removed


# ----------------------------------------------------------------------------------------------------------
# Importance keyed on parent, calibration tokens and settings


def _model(spec) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(spec).eval()


def _no_data():
    raise AssertionError("reused scores must not read calibration data")


def test_importance_is_recomputed_when_any_input_changes(spec, tmp_path):
    model = _model(spec)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 40, (2, 10), generator=generator) for _ in range(2)]
    measured, reused = importance_for(model, batches, tmp_path)
    assert not reused and (tmp_path / MANIFEST_FILE).is_file()
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert manifest["inputs"]["calibration"] == fingerprint_tensors(batches)
    assert manifest["inputs"]["parent"] == parent_fingerprint(model)

    # The same tokens in fresh tensors (a generator here) are the same calibration data: reused.
    again, reused = importance_for(model, lambda: (b.clone() for b in batches), tmp_path)
    assert reused and torch.equal(again[3]["channel"], measured[3]["channel"])
    # A known fingerprint avoids reading the data at all.
    _, reused = importance_for(model, _no_data, tmp_path, calibration=fingerprint_tensors(batches))
    assert reused

    # Other tokens, same shapes and token count: measured again (a token count alone would have matched).
    other = [b.flip(-1) for b in batches]
    fresh, reused = importance_for(model, other, tmp_path)
    assert not reused and fresh.tokens == measured.tokens
    assert not torch.equal(fresh[3]["channel"], measured[3]["channel"])
    assert load_importance(tmp_path)[3]["channel"].equal(fresh[3]["channel"])
    assert importance_for(model, other, tmp_path)[1]

    # Other settings: measured again.
    no_fit, reused = importance_for(model, other, tmp_path, linear_fit=False)
    assert not reused and not no_fit.linear_fit and not no_fit[3].has_linear_fit
    _, reused = importance_for(model, other, tmp_path, linear_fit=False)
    assert reused
    _, reused = importance_for(model, other, tmp_path, linear_fit_every=2)
    assert not reused

    # Another parent (one weight changed): measured again.
    with torch.no_grad():
        model.layers[0].mixer.in_proj.weight[0, 0] += 1.0
    _, reused = importance_for(model, other, tmp_path, linear_fit_every=2)
    assert not reused and load_importance(tmp_path).parent == parent_fingerprint(model)


def test_importance_with_a_damaged_manifest_is_recomputed(spec, tmp_path):
    model = _model(spec)
    batches = [torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(2))]
    importance_for(model, batches, tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("{trunc")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        load_importance(tmp_path)
    _, reused = importance_for(model, batches, tmp_path)
    assert not reused and importance_for(model, batches, tmp_path)[1]


# ----------------------------------------------------------------------------------------------------------
# Two gloo ranks: rank 0 writes, the other waits and reads the same thing.


def _worker(rank: int, world: int, port: int, directory: str) -> None:
    root = Path(directory)
    with gloo_rank(rank, world, port):
        artifact = Artifact(root / "run", "stage", 3)
        assert artifact.load_if_current(INPUTS) is None

        def logged(path: str) -> None:
            with open(root / "writes.log", "a") as log:
                log.write(f"{rank}\n")
            json_writer({"written_by": rank})(path)

        outputs = {"scores.safetensors": safetensors_writer(TENSORS), "who.json": logged}
        manifest = artifact.write(INPUTS, outputs, {"tokens": 12})
        assert artifact.load_if_current(INPUTS) == manifest
        tensors = artifact.load_tensors("scores.safetensors")
        assert all(torch.equal(tensors[k], v) for k, v in TENSORS.items())
        (root / f"rank{rank}.json").write_text(json.dumps(manifest.to_dict()))
        (root / f"rank{rank}.who").write_text(json.dumps(artifact.load_json("who.json")))
        # Ranks that disagree on an input fail together, before anything is read or written.
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] in \['calibration'\]"):
            artifact.load_if_current({**INPUTS, "calibration": str(rank)})


@pytest.mark.slow
def test_two_gloo_ranks_rank_zero_writes_and_the_other_reads_it(tmp_path):
    spawn_ranks(_worker, str(tmp_path))
    assert (tmp_path / "writes.log").read_text() == "0\n"  # only rank 0 ran the writers
    manifests = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert manifests[0] == manifests[1] and manifests[0]["inputs"] == INPUTS
    assert [json.loads((tmp_path / f"rank{r}.who").read_text()) for r in (0, 1)] == [{"written_by": 0}] * 2
    assert Artifact(tmp_path / "run", "stage", 3).load_if_current(INPUTS) is not None


def test_outputs_replaced_with_other_bytes_of_the_same_size_are_damaged(tmp_path):
    artifact = Artifact(tmp_path, "stage", 3)
    manifest = _write(artifact)
    scores = tmp_path / "scores.safetensors"
    assert set(manifest.digests) == {"scores.safetensors", "sub/summary.json"}
    assert manifest.digests["scores.safetensors"]["sha256"] == fingerprint_file(scores)
    good = scores.read_bytes()
    stat = scores.stat()
    scores.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # same size, one bit flipped
    os.utime(scores, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with its mtime put back
    assert artifact.damaged_outputs() == {
        "scores.safetensors": f"{scores} has other bytes than were written (same size, another sha256)"
    }
    assert artifact.load_if_current(INPUTS) is None and artifact.damaged_if_current(INPUTS) == {
        "scores.safetensors": artifact.damaged_outputs()["scores.safetensors"]
    }
    assert artifact.damaged_if_current({**INPUTS, "seed": "1"}) is None  # another run's: not a repair
    scores.write_bytes(good)  # the same bytes again (a new stat key): hashed, found intact
    assert artifact.load_if_current(INPUTS) == manifest and artifact.damaged_if_current(INPUTS) == {}
    # A cache of re-hashed files ({resolved path: key, sha256}) is filled, then trusted for that key only.
    cache: dict = {}
    assert damaged_files(tmp_path, manifest.outputs, manifest.digests, cache) == {}
    assert cache == {str(scores.resolve()): {"key": _file_key(scores), "sha256": fingerprint_file(scores)}}
    cache[str(scores.resolve())]["sha256"] = "0" * 64  # a stale entry is not believed: hashed again
    assert damaged_files(tmp_path, manifest.outputs, manifest.digests, cache) == {}
    assert cache[str(scores.resolve())]["sha256"] == fingerprint_file(scores)


def test_a_partial_rewrite_keeps_the_intact_outputs_untouched(tmp_path):
    artifact = Artifact(tmp_path, "stage", 3)
    first = _write(artifact)
    kept = tmp_path / "scores.safetensors"
    before = kept.stat()
    again = artifact.write(INPUTS, {"sub/summary.json": json_writer({"n": 2})}, keep=["scores.safetensors"])
    after = kept.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_ctime_ns,
    )
    assert again.digests["scores.safetensors"] == first.digests["scores.safetensors"]
    assert again.outputs["scores.safetensors"] == first.outputs["scores.safetensors"]
    assert artifact.load_json("sub/summary.json") == {"n": 2} and artifact.load_if_current(INPUTS) == again


def test_a_manifest_without_digests_is_checked_by_size_and_still_reused(tmp_path):
    artifact = Artifact(tmp_path, "stage", 3)
    _write(artifact)
    data = json.loads(artifact.manifest_path.read_text())
    del data["digests"]  # as written before digests were recorded
    artifact.manifest_path.write_text(json.dumps(data))
    assert artifact.load_if_current(INPUTS) is not None and artifact.read_manifest().digests == {}
    scores = tmp_path / "scores.safetensors"
    scores.write_bytes(scores.read_bytes()[:-3])
    assert "scores.safetensors has" in artifact.why_not_current(INPUTS)
