"""puzzle.resume: the checkpoint record names its tensors, replaces the previous one, and belongs to its inputs;
AdamW state goes out and comes back exactly (BLD's and GKD's resume tests cover the trainers end to end)."""

from __future__ import annotations

import json

import pytest
import torch

from puzzle.resume import load_optimizer_tensors, optimizer_tensors, read_checkpoint, write_checkpoint

INPUTS = {"parent": "p1", "data": "d1"}


def test_a_new_checkpoint_replaces_the_previous_tensors_file_after_its_record(tmp_path):
    first = {"w": torch.arange(3.0)}
    write_checkpoint(tmp_path, "ckpt.json", "step1.safetensors", first, {"inputs": INPUTS, "step": 1})
    second = {"w": torch.arange(3.0) + 1}
    write_checkpoint(tmp_path, "ckpt.json", "step2.safetensors", second, {"inputs": INPUTS, "step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.json", "step2.safetensors"]
    record, tensors, path = read_checkpoint(tmp_path, "ckpt.json", INPUTS)
    assert record["step"] == 2 and record["tensors"] == "step2.safetensors" and path.name == record["tensors"]
    assert torch.equal(tensors["w"], second["w"])


def test_a_checkpoint_of_other_inputs_or_none_at_all_reads_as_none(tmp_path):
    assert read_checkpoint(tmp_path, "ckpt.json", INPUTS) is None
    write_checkpoint(tmp_path, "ckpt.json", "a.safetensors", {"w": torch.ones(1)}, {"inputs": INPUTS})
    assert read_checkpoint(tmp_path, "ckpt.json", {**INPUTS, "data": "d2"}) is None
    assert json.loads((tmp_path / "ckpt.json").read_text())["inputs"] == INPUTS  # left as it was


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_adamw_state_round_trips_and_the_next_step_matches(tmp_path):
    model, optimizer = _trained(0)
    saved = optimizer_tensors(optimizer, "adam/")
    assert {key.split("/")[-1] for key in saved} == {"step", "exp_avg", "exp_avg_sq"}
    write_checkpoint(tmp_path, "ckpt.json", "s.safetensors", saved, {"inputs": INPUTS})
    _, tensors, _ = read_checkpoint(tmp_path, "ckpt.json", INPUTS)

    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fresh.load_state_dict(model.state_dict())
    restored = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_optimizer_tensors(restored, tensors, "adam/")
    batch = torch.randn(5, 4)
    for net, opt in ((model, optimizer), (fresh, restored)):
        net(batch).square().mean().backward()
        opt.step()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_tensors_are_read_when_asked_for_and_whole_for_a_plain_destination(tmp_path):
    """`read_checkpoint` reads no tensor; each is read (through the sharded loader's observer) when asked for,
    whole into a plain destination (one process); a destination of another shape is an error naming the
    file and the tensor."""
    from puzzle.artifacts import ArtifactError
    from puzzle.nemotron_h import sharded

    saved = {"w": torch.arange(6.0).reshape(3, 2), "v": torch.ones(4)}
    write_checkpoint(tmp_path, "ckpt.json", "s.safetensors", saved, {"inputs": INPUTS})
    read = []
    sharded.read_observer = lambda file, key, tensor: read.append((file.name, key, tuple(tensor.shape)))
    try:
        _, tensors, path = read_checkpoint(tmp_path, "ckpt.json", INPUTS)
        with tensors:
            assert sorted(tensors) == ["v", "w"] and tensors.shape("w") == (3, 2) and read == []
            assert torch.equal(tensors.like("w", torch.zeros(3, 2)), saved["w"])
            assert read == [("s.safetensors", "w", (3, 2))]
            with pytest.raises(
                ArtifactError, match=r"s\.safetensors: tensor 'v' has shape \[4\], the x's is \[5\]"
            ):
                tensors.like("v", torch.zeros(5), "the x")
    finally:
        sharded.read_observer = None
    assert str(path).endswith("s.safetensors")
