"""vLLM reads our exports exactly: a replay of vLLM's NemotronH loading, without vLLM installed.

Followed: vllm-project/vllm `vllm/model_executor/models/nemotron_h.py` at commit
00b08dc44519a82cbdd9061d92d1226985094622, `NemotronHModel.__init__` (`get_layer`: the layer class from
`hybrid_override_pattern`, Mamba layers from the global config, MLP / attention / MoE layers from
`config.get_nemotron_h_config_for_layer(i)` when the config class has it) and the mixers it builds
(`MambaMixer2`, `NemotronHMLP`, `NemotronHAttention`, `NemotronHMoE`); `nemotron_h_mtp.py` at commit
01ca27739feb561c668e843bf55ca96845056e05 (`NemotronHMultiTokenPredictor.__init__`, `NemotronHMTP.load_weights`:
`mtp_hybrid_override_pattern`, layers num_hidden_layers + j, `mtp_n_routed_experts`). The replay is
`puzzle.nemotron_h.vllm_replay`; here it runs on checkpoints written to disk (safetensors headers) and the
config class transformers loads from them with trust_remote_code, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

import puzzle
from puzzle.model import HybridLM
from puzzle.nemotron_h import config_from_spec, spec_from_config, vllm_replay
from puzzle.nemotron_h.engines import engine_problems, vllm_checkpoint
from puzzle.nemotron_h.remote.configuration_nemotron_h_puzzle import NemotronHPuzzleConfig
from puzzle.presets.nemotron import PUZZLE_75B_MOE, SUPER_PATTERN
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, NoOpSpec
from tests.test_real_configs import puzzle_75b_config

HIDDEN, VOCAB = 16, 40
MAMBA = MambaSpec(num_heads=4, head_dim=4, state_size=6, n_groups=2, chunk_size=8)
ATTENTION = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4)
# Puzzle-75B's per-block MoE widths and top-k, scaled to 8 experts: 5 widths, 7 top-k values, as released.
TINY_WIDTH = {2688: 12, 2048: 10, 1792: 8, 1536: 6, 1280: 4}
TINY_TOP_K = {18: 7, 14: 6, 12: 5, 10: 4, 8: 3, 6: 2, 4: 1}


def _spec(*blocks: object) -> ModelSpec:
    return ModelSpec(vocab_size=VOCAB, hidden_size=HIDDEN, blocks=blocks)


def puzzle_75b_shaped() -> ModelSpec:
    """Nemotron-3-Super's 88-block pattern at tiny width, each MoE block with Puzzle-75B's width and top-k."""
    choices = iter(PUZZLE_75B_MOE)
    blocks = []
    for char in SUPER_PATTERN:
        if char == "E":
            width, top_k = next(choices)
            moe = MoESpec(8, TINY_TOP_K[top_k], TINY_WIDTH[width], 10, 12, routed_scaling_factor=5.0)
            blocks.append(moe)
        else:
            blocks.append(MAMBA if char == "M" else ATTENTION)
    return _spec(*blocks)


# Children vLLM can represent: what may differ per block does, one kind at a time.
SERVED = {
    "mamba": _spec(MAMBA, MLPSpec(width=8), MAMBA),
    "attention": _spec(ATTENTION, MAMBA, ATTENTION),
    "moe": _spec(
        MoESpec(num_experts=6, top_k=2, expert_width=8, shared_width=8),
        MoESpec(6, 4, 5, 0, None, routed_scaling_factor=2.5, norm_topk_prob=False),
        MoESpec(
            num_experts=8, top_k=3, expert_width=4, shared_width=6, latent_size=12, n_group=4, topk_group=2
        ),
        MoESpec(num_experts=4, top_k=1, expert_width=6, shared_width=4, latent_size=6),
    ),
    "mlp": _spec(MLPSpec(width=12), MLPSpec(width=7, bias=True), MLPSpec(width=5)),
    "75b": puzzle_75b_shaped(),
}
# Children vLLM cannot represent, and the blocks the replay must name.
REFUSED = {
    "per-block mamba": (_spec(MAMBA, MAMBA, dataclasses.replace(MAMBA, state_size=3)), {2}),
    "mamba chunk size": (_spec(MAMBA, MAMBA, dataclasses.replace(MAMBA, chunk_size=4)), {2}),
    "per-expert widths": (_spec(MoESpec(4, 2, 8, 8), MoESpec(4, 2, (8, 6, 8, 4), 8)), {1}),
    "linear": (_spec(MLPSpec(width=8), LinearSpec()), {1}),
    "noop": (_spec(MLPSpec(width=8), NoOpSpec(), MLPSpec(width=8)), {1}),
    "attention bias": (_spec(ATTENTION, AttentionSpec(4, 2, 4, bias=True)), {1}),
}


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the checkpoint's safetensors files, from their headers."""
    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def save_child(spec: ModelSpec, path: Path) -> Path:
    torch.manual_seed(0)
    return HybridLM(spec).save_pretrained(path)


@pytest.mark.parametrize("name", list(SERVED))
def test_vllm_allocates_every_tensor_of_the_checkpoint_with_its_shape(name, tmp_path):
    spec = SERVED[name]
    out = save_child(spec, tmp_path / name)
    config = json.loads((out / "config.json").read_text())
    shapes = checkpoint_shapes(out)
    layers = vllm_replay.replay(config)
    assert [layer.index for layer in layers] == list(range(spec.num_blocks))
    assert all(layer.unsupported is None for layer in layers)
    allocated = {tensor: shape for layer in layers for tensor, shape in layer.tensors.items()}
    in_layers = {tensor: shape for tensor, shape in shapes.items() if tensor.startswith("backbone.layers.")}
    assert allocated == in_layers  # every tensor, every shape, nothing left over
    for layer, block in zip(layers, spec.blocks):
        assert layer.top_k == (block.top_k if isinstance(block, MoESpec) else None)
    assert vllm_replay.mismatches(config, shapes, spec) == []
    assert engine_problems(spec, ["vllm"]) == []


def test_75b_shaped_child_routes_every_block_at_its_own_width_and_top_k(tmp_path):
    spec = SERVED["75b"]
    out = save_child(spec, tmp_path / "child")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "nemotron_h_puzzle"
    assert "moe_intermediate_size" not in config and "num_experts_per_tok" not in config
    # What vLLM gets: AutoConfig with trust_remote_code (no nemotron_h_puzzle in its registry).
    loaded = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert type(loaded).__name__ == "NemotronHPuzzleConfig"
    moe = [(i, block) for i, block in enumerate(spec.blocks) if isinstance(block, MoESpec)]
    assert len({block.top_k for _, block in moe}) == 7 and len({block.expert_width for _, block in moe}) == 5
    for index, block in moe:
        layer = loaded.get_nemotron_h_config_for_layer(index)
        assert (layer.moe_intermediate_size, layer.num_experts_per_tok) == (block.expert_width, block.top_k)
    assert not hasattr(loaded, "moe_intermediate_size")  # a reader ignoring block_configs fails loudly
    assert puzzle.load(out).spec == spec


def test_without_the_per_layer_config_vllm_misreads_the_75b_child(tmp_path, monkeypatch):
    """The replay fails when vLLM falls back to the global fields (the config class before issue 23)."""
    spec = SERVED["75b"]
    out = save_child(spec, tmp_path / "child")
    config = json.loads((out / "config.json").read_text())
    config.update(moe_intermediate_size=12, num_experts_per_tok=7)  # the old globals: the most common block
    monkeypatch.delattr(NemotronHPuzzleConfig, "get_nemotron_h_config_for_layer")
    found = vllm_replay.mismatches(config, checkpoint_shapes(out), spec)
    moe_blocks = {i for i, block in enumerate(spec.blocks) if isinstance(block, MoESpec)}
    assert {index for index, _ in found} <= moe_blocks and len({index for index, _ in found}) > 20
    assert any("shape" in reason for _, reason in found)
    assert any("the global fields, which give top_k 7 (the child: 1)" in reason for _, reason in found)


@pytest.mark.parametrize("name", list(REFUSED))
def test_the_replay_names_what_vllm_cannot_represent(name, tmp_path):
    spec, blocks = REFUSED[name]
    out = save_child(spec, tmp_path / "child")
    config = json.loads((out / "config.json").read_text())
    found = vllm_replay.mismatches(config, checkpoint_shapes(out), spec)
    assert {index for index, _ in found} == blocks
    # format="engine" refuses on the same replay (run on the config and meta tensors an export writes).
    assert {(p.block, p.reason) for p in engine_problems(spec, ["vllm"])} >= set(found)


def test_mtp_layers_are_read_from_mtp_block_configs(tmp_path):
    """vLLM's MTP module: layers num_hidden_layers + j from mtp_block_configs, its pattern and expert count."""
    config = json.loads((save_child(SERVED["moe"], tmp_path / "child") / "config.json").read_text())
    config.update(
        num_nextn_predict_layers=1,
        mtp_layers_block_type=["attention", "moe"],
        mtp_block_configs=[
            {"block_type": "attention"},
            {
                "block_type": "moe",
                "n_routed_experts": 5,
                "num_experts_per_tok": 3,
                "moe_intermediate_size": 9,
                "moe_shared_expert_intermediate_size": 4,
            },
        ],
    )
    loaded = NemotronHPuzzleConfig.from_dict(config)
    assert loaded.mtp_hybrid_override_pattern == "*E" and loaded.mtp_n_routed_experts == 5
    assert loaded.get_nemotron_h_config_for_layer(5).moe_intermediate_size == 9
    layers = vllm_replay.replay(config)
    assert [layer.prefix for layer in layers[-2:]] == ["mtp.layers.0", "mtp.layers.1"]
    assert layers[-1].top_k == 3 and layers[-1].tensors["mtp.layers.1.mixer.gate.weight"] == (5, HIDDEN)
    with pytest.raises(IndexError, match="block 6 does not exist"):
        loaded.get_nemotron_h_config_for_layer(6)


@pytest.mark.parametrize("with_nulls", [False, True], ids=["plain", "null-fields"])
def test_full_size_puzzle_75b_schema_and_our_export_of_it_replay_exactly(with_nulls):
    """NVIDIA's published schema (512 experts, latent 1024, MTP) and our re-export of it, at full size: the
    tensors an export writes (meta device) are what vLLM allocates, and every block routes its own top-k."""
    published = puzzle_75b_config(with_nulls)
    spec = spec_from_config(published)
    written, shapes = vllm_checkpoint(spec)
    for config in (published, config_from_spec(spec, base=published)):
        assert vllm_replay.mismatches(config, shapes, spec) == []
        layers = vllm_replay.replay(config)
        assert [layer.top_k for layer in layers[: spec.num_blocks] if layer.char == "E"] == [
            top_k for _, top_k in PUZZLE_75B_MOE
        ]
        assert layers[-1].prefix == "mtp.layers.1" and layers[-1].top_k == 22
    assert written["n_routed_experts"] == 512 and "num_experts_per_tok" not in written
