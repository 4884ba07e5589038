"""SGLang and TensorRT-LLM read our exports as their NemotronH source does: replays of their loaders.

SGLang: `python/sglang/srt/models/nemotron_h.py` at 02c60328e56db1c91b639859469b61c103ca2e7f and
`python/sglang/srt/configs/nemotron_h.py` at 01144484d28d8adb6a4714a23ad6f4bf68fb188d (per-layer config for
attention and MoE, global for Mamba and MLP). TensorRT-LLM: `tensorrt_llm/_torch/models/modeling_nemotron_h.py`
at 00620eb025e7c24895986e1042380bd1be4426d9 (block_configs for five MoE fields, the rest global).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from puzzle.nemotron_h import sglang_replay, trtllm_replay
from puzzle.nemotron_h.engines import ENGINES, engine_problems, engine_support, vllm_checkpoint
from puzzle.spec import AttentionSpec, LinearSpec, MLPSpec, MoESpec, NoOpSpec
from tests.test_vllm_replay import ATTENTION, MAMBA, SERVED, _spec, puzzle_75b_shaped

REPLAYS = {"sglang": sglang_replay, "trtllm": trtllm_replay}


def _blocks(spec, engine):
    return {problem.block for problem in engine_problems(spec, [engine])}


# TensorRT-LLM reads n_shared_experts from the globals: every MoE block has a shared expert, or none does.
TRTLLM_MOE = _spec(
    MoESpec(num_experts=6, top_k=2, expert_width=8, shared_width=8),
    MoESpec(num_experts=8, top_k=3, expert_width=4, shared_width=6, latent_size=12),
    MoESpec(num_experts=4, top_k=1, expert_width=6, shared_width=4, latent_size=6),
)
CHILDREN = {**SERVED, "trtllm moe": TRTLLM_MOE}


@pytest.mark.parametrize(
    ("engine", "name"),
    [(e, n) for e in REPLAYS for n in ("mamba", "75b", "trtllm moe")] + [("sglang", "moe")],
)
def test_each_replay_allocates_every_tensor_of_a_child_it_serves(engine, name):
    spec = CHILDREN[name]
    config, shapes = vllm_checkpoint(spec)
    layers = REPLAYS[engine].replay(config)
    assert [layer.index for layer in layers] == list(range(spec.num_blocks))
    allocated = {tensor: shape for layer in layers for tensor, shape in layer.tensors.items()}
    assert allocated == {name: shape for name, shape in shapes.items() if name.startswith("backbone.layers.")}
    for layer, block in zip(layers, spec.blocks):
        assert layer.top_k == (block.top_k if isinstance(block, MoESpec) else None)
    assert REPLAYS[engine].mismatches(config, shapes, spec) == []
    assert engine_problems(spec, [engine]) == []


def test_the_75b_shaped_child_is_read_per_block_by_both():
    spec = puzzle_75b_shaped()
    assert spec.num_blocks == 88
    config, _ = vllm_checkpoint(spec)
    moe = [i for i, block in enumerate(spec.blocks) if isinstance(block, MoESpec)]
    for module in REPLAYS.values():
        layers = module.replay(config)
        assert all(layers[i].per_layer for i in moe)
        assert [layers[i].top_k for i in moe] == [spec.blocks[i].top_k for i in moe]
        widths = {layers[i].tensors[f"backbone.layers.{i}.mixer.experts.0.up_proj.weight"][0] for i in moe}
        assert widths == {spec.blocks[i].expert_width for i in moe}  # 5 widths, each block its own
    assert not any(layer.per_layer for layer in trtllm_replay.replay(config) if layer.char != "E")
    assert all(layer.per_layer for layer in sglang_replay.replay(config) if layer.char == "*")


def test_sglang_reads_attention_per_layer_and_mlp_mamba_globally():
    heads = _spec(ATTENTION, MAMBA, AttentionSpec(num_heads=4, num_kv_heads=1, head_dim=4))
    config, shapes = vllm_checkpoint(heads)
    assert sglang_replay.mismatches(config, shapes, heads) == []  # the replay builds it per layer
    assert [p.block for p in engine_problems(heads, ["sglang"])] == [2]  # the KV-pool rule refuses it
    mlp = _spec(MLPSpec(width=12), MAMBA, MLPSpec(width=7))
    config, shapes = vllm_checkpoint(mlp)
    found = sglang_replay.mismatches(config, shapes, mlp)
    assert {block for block, _ in found} == {2}
    assert "SGLang allocates" in found[0][1] or "global fields" in found[0][1]


def test_trtllm_reads_the_shared_expert_count_and_routing_globally():
    # block 1: no shared expert and its own routing; block 2: its own expert groups; TensorRT-LLM reads
    # n_shared_experts, routed_scaling_factor, n_group and topk_group from the globals
    found = dict.fromkeys(range(4), "")
    for block, reason in trtllm_replay.mismatches(*vllm_checkpoint(SERVED["moe"]), SERVED["moe"]):
        found[block] += reason
    assert "shared_experts" in found[1] and "routed_scaling_factor 1.0 (the child: 2.5)" in found[1]
    assert "n_group 1 (the child: 4)" in found[2]
    assert found[0] == found[3] == ""


def test_trtllm_reads_attention_and_mlp_globally():
    heads = _spec(ATTENTION, MAMBA, AttentionSpec(num_heads=4, num_kv_heads=1, head_dim=4))
    config, shapes = vllm_checkpoint(heads)
    found = trtllm_replay.mismatches(config, shapes, heads)
    assert {block for block, _ in found} == {2}
    assert any("k_proj.weight" in reason and "TensorRT-LLM allocates" in reason for _, reason in found)
    mlp = _spec(MLPSpec(width=12), MAMBA, MLPSpec(width=7))
    assert _blocks(mlp, "trtllm") == {2}


@pytest.mark.parametrize("engine", list(REPLAYS))
def test_what_neither_serves(engine):
    per_block_mamba = _spec(MAMBA, MAMBA, dataclasses.replace(MAMBA, state_size=3))
    assert _blocks(per_block_mamba, engine) == {2}
    per_expert = _spec(MoESpec(4, 2, 8, 8), MoESpec(4, 2, (8, 6, 8, 4), 8))
    assert _blocks(per_expert, engine) == {1}
    assert _blocks(_spec(MLPSpec(width=8), NoOpSpec(), MLPSpec(width=8)), engine) == {1}
    assert _blocks(_spec(MLPSpec(width=8), LinearSpec()), engine) == {1}


def test_trtllm_refuses_fp8_routed_experts_only_and_engine_support_names_both():
    """The ModelOpt layout holds fp8 and nvfp4 blocks for TensorRT-LLM, but its fused MoE has no per-channel fp8."""
    fp8 = _spec(MAMBA, dataclasses.replace(MoESpec(4, 2, 8, 8), weight_format="fp8"))
    assert _blocks(fp8, "trtllm") == {1}
    nvfp4 = _spec(
        dataclasses.replace(MAMBA, weight_format="fp8"),
        dataclasses.replace(MoESpec(4, 2, 16, 16), weight_format="nvfp4"),
    )
    assert _blocks(nvfp4, "trtllm") == set()
    assert "sglang" in ENGINES and "trtllm" in ENGINES
    support = engine_support(SERVED["75b"])
    assert support["sglang"] == [] and support["trtllm"] == []


def _moe(**fields):
    return MoESpec(
        **{"num_experts": 6, "top_k": 2, "expert_width": 8, "shared_width": 8, "latent_size": 12, **fields}
    )


# README's engine table, row by row: a child that has what the row names (README's first column, as written).
README_ROWS = {
    "one shape per kind (plain `nemotron_h`)": _spec(MAMBA, _moe(), ATTENTION, _moe()),
    "per-block MoE width and top-k, one Mamba state size (the Puzzle-75B shape)": puzzle_75b_shaped(),
    "per-block expert count, shared or latent size": _spec(
        MAMBA, _moe(), _moe(num_experts=8), _moe(shared_width=4), _moe(latent_size=6)
    ),
    "per-block routing settings (groups, scaling factor), a shared expert in some MoE blocks only": _spec(
        MAMBA, _moe(), _moe(routed_scaling_factor=2.5)
    ),
    "per-block attention heads": _spec(ATTENTION, MAMBA, dataclasses.replace(ATTENTION, num_kv_heads=1)),
    "per-block Mamba shape or settings (e.g. state sizes, chunk size)": _spec(
        MAMBA, _moe(), dataclasses.replace(MAMBA, state_size=4)
    ),
    "dense MLP blocks in a model with MoE blocks": _spec(MAMBA, _moe(), MLPSpec(width=8)),
    "MoE without a shared expert": _spec(MAMBA, _moe(shared_width=0), _moe(shared_width=0)),
    "MoE without latent projection": _spec(MAMBA, _moe(latent_size=None), _moe(latent_size=None)),
    "a width per expert inside one block, linear or no-op blocks": _spec(
        MAMBA, _moe(), NoOpSpec(), LinearSpec()
    ),
}
README_COLUMNS = {"vLLM": "vllm", "SGLang": "sglang", "TensorRT-LLM": "trtllm"}


def test_the_readme_engine_table_says_what_the_replays_find():
    lines = (Path(__file__).parents[1] / "README.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| child | vLLM |"))
    columns = [cell.strip() for cell in lines[header].strip("|").split("|")]
    rows = {}
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(columns, cells))
    assert set(README_ROWS) <= set(rows), set(README_ROWS) - set(rows)
    for row, spec in README_ROWS.items():
        support = engine_support(spec)
        for column, engine in README_COLUMNS.items():
            says_yes = rows[row][column].startswith("yes")
            assert says_yes == (support[engine] == []), (row, column, support[engine][:1])
