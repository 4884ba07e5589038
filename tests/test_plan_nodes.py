"""`puzzle plan --nodes N --gpus-per-node G` (issue 34 §3): N x G ranks, HSDP stages planned sharded inside a
node (memory per rank of G ranks, time of N x G), and global batches that do not divide by the ranks: the
plan says how they are shared, or which values work when they cannot be."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from puzzle.cli import main
from puzzle.config import load_config
from puzzle.plan import parent_bytes, plan_config
from puzzle.presets import nemotron3_super

ROOT = Path(__file__).resolve().parent.parent
SUPER = ROOT / "examples" / "nemotron3_super" / "config.yaml"
SHARDED = ("importance", "bld", "scoring", "gkd")  # the sections with a `shard` setting


def _with(config, **sections):
    """`config` with each named section's fields replaced: _with(c, gkd={"batch_size": 8})."""
    changes = {
        name: dataclasses.replace(getattr(config, name), **fields) for name, fields in sections.items()
    }
    return dataclasses.replace(config, **changes)


def _hsdp(config):
    return _with(config, **{name: {"shard": "hsdp"} for name in SHARDED})


def _stages(plan) -> dict:
    return {s.name: s for s in plan.stages}


def test_nodes_times_gpus_per_node_is_the_plan_of_that_many_gpus(capsys):
    """Under FSDP (every rank one shard) the node count changes nothing but the header."""
    assert main(["plan", str(SUPER), "--gpus", "16", "--hardware", "b200", "--json"]) == 0
    flat = json.loads(capsys.readouterr().out)
    assert (
        main(["plan", str(SUPER), "--nodes", "2", "--gpus-per-node", "8", "--hardware", "b200", "--json"])
        == 0
    )
    nodes = json.loads(capsys.readouterr().out)
    assert (flat.pop("nodes"), flat.pop("gpus_per_node")) == (1, 16)
    assert (nodes.pop("nodes"), nodes.pop("gpus_per_node")) == (2, 8)
    assert nodes == flat
    assert main(["plan", str(SUPER), "--nodes", "2", "--gpus-per-node", "8", "--hardware", "b200"]) == 0
    assert "hardware: 16 x b200 (2 nodes of 8) (167.6 GiB each" in capsys.readouterr().out


def test_hsdp_over_nodes_holds_a_nodes_shard_per_rank_at_the_speed_of_every_gpu():
    """shard: hsdp on 2 nodes of 8: each unit sharded over the 8 ranks of a node (the shards of an 8-GPU
    plan), replicated across the 2 nodes; the time is that of 16 GPUs."""
    config = _hsdp(load_config(SUPER))
    spec = nemotron3_super()
    hsdp = _stages(plan_config(config, 16, "b200", gpus_per_node=8))
    one_node = _stages(plan_config(config, 8, "b200"))
    fsdp16 = _stages(plan_config(load_config(SUPER), 16, "b200"))
    node_shard = parent_bytes(spec, 2, 8).sharded  # bf16 parent over the 8 ranks of a node
    assert node_shard > 1.9 * parent_bytes(spec, 2, 16).sharded
    for stage, part in (
        ("importance", "parent shard"),
        ("scores", "parent shard"),
        ("assemble", "parent shard"),
        ("export", "parent shard"),
        ("distill", "teacher shard"),
    ):
        assert hsdp[stage].memory[part] == pytest.approx(node_shard), stage
        assert hsdp[stage].memory[part] == one_node[stage].memory[part], stage
        assert fsdp16[stage].memory[part] < hsdp[stage].memory[part], stage
    # The student's states are a node's shards too; its micro-batches are those of 16 ranks.
    for part in ("student shard", "AdamW m and v"):
        assert hsdp["distill"].memory[part] == one_node["distill"].memory[part]
    assert hsdp["distill"].memory["saved block inputs"] == fsdp16["distill"].memory["saved block inputs"]
    # Time: all 16 GPUs compute (the same FLOPs as FSDP over 16; scoring's automatic waves are smaller,
    # since a rank holds more of the parent, so it takes more parent passes).
    for stage in ("importance", "distill"):
        assert hsdp[stage].seconds == pytest.approx(fsdp16[stage].seconds), stage
    for stage in ("importance", "library", "scores", "distill"):
        assert any("shard hsdp: each unit sharded over the 8 ranks of a node" in n for n in hsdp[stage].notes)
    # One node: HSDP is FSDP over the node.
    assert (
        _stages(plan_config(config, 8, "b200", gpus_per_node=8))["distill"].memory
        == one_node["distill"].memory
    )


def test_nodes_and_gpus_per_node_errors_name_the_flags(capsys):
    for argv, message in (
        (["--nodes", "2"], "--nodes and --gpus-per-node go together"),
        (["--gpus-per-node", "8"], "--nodes and --gpus-per-node go together"),
        (
            ["--nodes", "2", "--gpus-per-node", "8", "--gpus", "8"],
            "--gpus 8 but --nodes 2 x --gpus-per-node 8 is 16: give one or the other",
        ),
    ):
        assert main(["plan", str(SUPER), "--hardware", "b200", *argv]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"12 GPUs are not a whole number of nodes of 8"):
        plan_config(load_config(SUPER), 12, "b200", gpus_per_node=8)


def test_a_gkd_batch_that_does_not_divide_by_the_ranks_is_planned_with_its_accumulation(capsys):
    """64 sequences on 48 ranks in micro-batches of 1: 16 ranks hold 2 rows, 32 hold 1 and run one
    zero-weight micro-batch so that every rank runs 2; the plan says so and fits (exit 0)."""
    config = load_config(SUPER)
    assert (config.gkd.batch_size, config.gkd.micro_batch_size) == (64, 1)
    distill = _stages(plan_config(config, 48, "b200"))["distill"]
    assert (
        "(1-2 sequences per rank (64 over 48 ranks) in 2 micro-batch(es) of up to 1, 1 of them zero-weight on "
        "the ranks holding 1)" in distill.units
    )
    assert main(["plan", str(SUPER), "--nodes", "6", "--gpus-per-node", "8", "--hardware", "b200"]) == 0
    capsys.readouterr()
    # Micro-batches of a rank's whole share: one forward each, no padding.
    whole = _stages(plan_config(_with(config, gkd={"micro_batch_size": None}), 48, "b200"))["distill"]
    assert "(1-2 sequences per rank (64 over 48 ranks) in 1 micro-batch(es) of up to 2)" in whole.units
    assert whole.memory["saved block inputs"] == 2 * distill.memory["saved block inputs"]


def test_a_batch_smaller_than_the_world_is_refused_naming_the_values_that_work(capsys):
    """The issue's case: GKD's batch of 64 on 128 ranks cannot give every rank a row."""
    assert main(["plan", str(SUPER), "--nodes", "16", "--gpus-per-node", "8", "--hardware", "b200"]) == 2
    err = capsys.readouterr().err
    assert (
        "puzzle plan: does not fit: stage distill: GKDSettings.batch_size (64) must be at least the number of "
        "ranks (128): every rank trains on its own rows of each step's batch. On 128 ranks batch_size 128 or "
        "more works (128, 256, 384, ... split evenly); batch_size 64 works on 1 to 64 ranks (evenly on 1, 2, "
        "4, 8, 16, 32, 64)"
    ) in err
    # BLD's batch (data.batch_size, 64 here) likewise.
    assert "stage library: data.batch_size (64) must be at least the number of ranks (128)" in err


def test_an_uneven_bld_batch_is_planned_at_the_larger_share():
    config = _with(load_config(SUPER), data={"batch_size": 24})
    sixteen = _stages(plan_config(config, 16, "b200"))["library"]
    assert "data.batch_size 24 over 16 ranks: 1-2 rows per rank (round-robin), planned at 2" in sixteen.notes
    eight = _stages(plan_config(config, 8, "b200"))["library"]  # 3 rows on every rank
    assert not any("rows per rank" in n for n in eight.notes)
