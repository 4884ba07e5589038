"""NemotronH checkpoints in and out (puzzle.nemotron_h), against transformers' NemotronHForCausalLM as the oracle (CPU, fp32, tiny)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from nemotron_helpers import CONFIGS, EVERY_KIND_SPEC, random_hf_model, save_hf, tiny_config, token_batch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.testing import assert_close
from transformers import NemotronHForCausalLM

import puzzle
from puzzle import nemotron_h
from puzzle.files import OWNER_MARKER, default_mode, owner_record, remove_stale_staging
from puzzle.model import HybridLM
from puzzle.nemotron_h import CheckpointError
from puzzle.nemotron_h.config import (
    KIND_TABLES,
    QUANTIZATION_FIELDS,
    block_config_fields,
    block_spec_from_fields,
)
from puzzle.spec import (
    BLOCK_SPEC_TYPES,
    AttentionSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
)

ATOL = 1e-5


@pytest.fixture(scope="module")
def parents(tmp_path_factory) -> dict[str, tuple[NemotronHForCausalLM, Path]]:
    """One random transformers model per tiny config, saved by transformers."""
    out = {}
    for index, name in enumerate(CONFIGS):
        model = random_hf_model(tiny_config(name), seed=index)
        out[name] = (model, save_hf(model, tmp_path_factory.mktemp(name)))
    return out


def hf_logits(model: NemotronHForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def our_logits(model: HybridLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_load_matches_transformers(parents, name):
    parent, path = parents[name]
    model = puzzle.load(path)
    assert model.spec.pattern == parent.config.hybrid_override_pattern
    ids = token_batch()
    assert_close(our_logits(model, ids), hf_logits(parent, ids), atol=ATOL, rtol=ATOL)
    # Block outputs too (transformers' last hidden state is after norm_f; ours is the last block's output).
    with torch.no_grad():
        theirs = parent(ids, output_hidden_states=True).hidden_states
        ours = model(ids, output_hidden_states=True).hidden_states
    assert len(ours) == len(theirs) == model.spec.num_blocks + 1
    for mine, reference in zip(ours[:-1], theirs[:-1]):
        assert_close(mine, reference, atol=ATOL, rtol=ATOL)
    assert_close(model.norm_f(ours[-1]), theirs[-1], atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_loads_in_transformers(parents, name, tmp_path):
    parent, path = parents[name]
    model = puzzle.load(path)
    out = model.save_pretrained(tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "nemotron_h"
    assert "block_configs" not in config
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "backbone.embeddings.weight" in keys and "lm_head.weight" in keys
    assert all(key.startswith(("backbone.", "lm_head.")) for key in keys)
    if "moe" in parent.config.layers_block_type:
        assert any(".mixer.experts.0.up_proj.weight" in key for key in keys)
    reloaded = NemotronHForCausalLM.from_pretrained(out).eval()
    ids = token_batch(seed=3)
    assert_close(hf_logits(reloaded, ids), hf_logits(parent, ids), atol=ATOL, rtol=ATOL)


def _nvidia_style(source: Path, target: Path) -> Path:
    """Rewrite a transformers checkpoint the way NVIDIA's hub configs look: pattern string, old field names."""
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["hybrid_override_pattern"] = "".join(
        {"linear_attention": "M", "full_attention": "*", "moe": "E", "mlp": "-"}[kind]
        for kind in config.pop("layers_block_type")
    )
    for new, old in [
        ("n_groups", "mamba_n_groups"),
        ("conv_kernel", "mamba_d_conv"),
        ("chunk_size", "mamba_chunk_size"),
        ("use_conv_bias", "mamba_conv_bias"),
        ("time_step_limit", "mamba_dt_limit"),
    ]:
        config[old] = config.pop(new)
    config["mamba_dt_limit"] = [0.0, 1e9]  # JSON has no infinity; transformers ignores this limit anyway
    config["num_hidden_layers"] = len(config["hybrid_override_pattern"])
    config["auto_map"] = {"AutoConfig": "configuration_nemotron_h.NemotronHConfig"}
    (target / "config.json").write_text(json.dumps(config))
    tensors = load_file(source / "model.safetensors")
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_nvidia_style_checkpoint(parents, tmp_path):
    parent, path = parents["latent_moe"]
    nvidia = _nvidia_style(path, tmp_path / "nvidia")
    assert "layers_block_type" not in json.loads((nvidia / "config.json").read_text())
    model = puzzle.load(nvidia)
    ids = token_batch(seed=1)
    assert_close(our_logits(model, ids), hf_logits(parent, ids), atol=ATOL, rtol=ATOL)
    # Saving normalises the config: no aliases or remote code left for transformers to trip on.
    config = json.loads((model.save_pretrained(tmp_path / "out") / "config.json").read_text())
    assert "mamba_n_groups" not in config and "auto_map" not in config and config["n_groups"] == 2


def test_transformers_memory_layout(parents, tmp_path):
    """`model.` prefix, fused 3-D expert tensors and `embedding.weight` (as transformers 5.3-5.6 wrote)."""
    parent, path = parents["plain_moe"]
    target = tmp_path / "fused"
    target.mkdir()
    (target / "config.json").write_text((path / "config.json").read_text())
    state = {
        key.replace("embeddings", "embedding"): value.contiguous()
        for key, value in parent.state_dict().items()
    }
    assert any(value.ndim == 3 for value in state.values())
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    model = puzzle.load(target)
    ids = token_batch(seed=2)
    assert_close(our_logits(model, ids), hf_logits(parent, ids), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_generate_matches_transformers(parents, name):
    parent, path = parents[name]
    model = puzzle.load(path)
    prompt = token_batch(batch=2, length=7, seed=5)
    theirs = parent.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = model.generate(prompt, max_new_tokens=24)
    assert ours.shape == (2, 31)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_labels_give_the_loss_transformers_gives(parents, name):
    """forward(input_ids, labels=...) returns transformers' shifted causal LM loss (ignore_index -100), and
    its gradient flows; without labels there is no loss."""
    parent, path = parents[name]
    model = puzzle.load(path)
    ids = token_batch()
    labels = ids.clone()
    labels[0, :4] = -100  # e.g. a prompt
    labels[1, -1] = -100
    with torch.no_grad():
        expected = parent(ids, labels=labels).loss
    out = model(ids, labels=labels)
    assert_close(out.loss, expected, atol=ATOL, rtol=ATOL)
    assert out.loss.shape == () and out.loss.requires_grad
    out.loss.backward()
    assert model.lm_head.weight.grad is not None
    assert model(ids).loss is None


def test_labels_errors_name_the_problem(parents):
    model = puzzle.load(parents["latent_moe"][1])
    ids = token_batch()
    with pytest.raises(ValueError, match=r"labels have shape \[2, 12\], expected \[2, 13\]"):
        model(ids, labels=ids[:, 1:])
    with pytest.raises(ValueError, match="logits_to_keep=0"):
        model(ids, labels=ids, logits_to_keep=1)


def test_sharded_checkpoint_roundtrip(parents, tmp_path):
    parent, path = parents["dense_mlp"]
    model = puzzle.load(path)
    out = model.save_pretrained(tmp_path / "sharded", max_shard_bytes=8_000)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {shard.name for shard in shards}
    assert index["metadata"]["total_size"] == sum(
        p.numel() * p.element_size() for p in model.state_dict().values()
    )
    ids = token_batch(seed=4)
    assert_close(our_logits(puzzle.load(out), ids), hf_logits(parent, ids), atol=ATOL, rtol=ATOL)
    assert_close(
        hf_logits(NemotronHForCausalLM.from_pretrained(out).eval(), ids),
        hf_logits(parent, ids),
        atol=ATOL,
        rtol=ATOL,
    )


def test_mtp_tensors_survive_roundtrip(parents, tmp_path):
    parent, path = parents["latent_moe"]
    source = tmp_path / "with_mtp"
    source.mkdir()
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (source / "config.json").write_text(json.dumps(config))
    mtp = {
        "mtp.layers.0.eh_proj.weight": torch.randn(32, 64),
        "mtp.layers.0.mixer.experts.3.up_proj.weight": torch.randn(16, 12),
    }
    save_file(
        {**load_file(path / "model.safetensors"), **mtp},
        source / "model.safetensors",
        metadata={"format": "pt"},
    )
    model = puzzle.load(source)
    assert set(model.extra_tensors) == set(mtp)
    out = model.save_pretrained(tmp_path / "out", max_shard_bytes=10_000)  # sharded, so MTP is in the index
    saved = {}
    for shard in out.glob("*.safetensors"):
        saved.update(load_file(shard))
    for key, value in mtp.items():
        assert torch.equal(saved[key], value)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    again = puzzle.load(out)
    assert set(again.extra_tensors) == set(mtp)
    ids = token_batch(seed=6)
    assert_close(our_logits(again, ids), hf_logits(parent, ids), atol=ATOL, rtol=ATOL)


def heterogeneous_spec() -> ModelSpec:
    """A Puzzle child: per-block shapes, per-expert widths, linear and removed blocks, a silu MLP."""
    moe = MoESpec(
        num_experts=6, top_k=2, expert_width=16, shared_width=24, latent_size=12, routed_scaling_factor=2.0
    )
    return ModelSpec(
        vocab_size=96,
        hidden_size=32,
        blocks=(
            MambaSpec(num_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=8, dt_clamp_min=0.001),
            moe,
            AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
            MoESpec(
                num_experts=6,
                top_k=4,
                expert_width=(8, 16, 12, 8, 4, 16),
                shared_width=24,
                latent_size=12,
                routed_scaling_factor=2.0,
            ),
            MambaSpec(num_heads=2, head_dim=8, state_size=4, n_groups=2, chunk_size=8, dt_clamp_min=0.001),
            LinearSpec(),
            NoOpSpec(),
            MLPSpec(width=20, activation="silu"),
            MoESpec(
                num_experts=6,
                top_k=1,
                expert_width=10,
                shared_width=0,
                latent_size=12,
                routed_scaling_factor=2.0,
            ),
        ),
    )


def randomised(model: HybridLM, seed: int = 0) -> HybridLM:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
    return model.eval()


def test_heterogeneous_roundtrip_writes_puzzle_config(tmp_path):
    spec = heterogeneous_spec()
    model = randomised(HybridLM(spec))
    out = model.save_pretrained(tmp_path / "child")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "nemotron_h_puzzle"
    assert config["layers_block_type"] == [
        "mamba",
        "moe",
        "attention",
        "moe",
        "mamba",
        "linear",
        "noop",
        "mlp",
        "moe",
    ]
    assert len(config["block_configs"]) == spec.num_blocks
    # Every entry of a kind states the keys where some block of that kind differs from the globals (the
    # most common shape of each kind); every MoE entry also states NVIDIA's MoE fields (llama.cpp's rule).
    moe_keys = {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"}
    moe_keys |= {"moe_shared_expert_intermediate_size", "moe_latent_size", "n_shared_experts"}
    assert {index: set(config["block_configs"][index]) - {"block_type"} for index in (1, 3, 8)} == {
        index: moe_keys for index in (1, 3, 8)
    }
    assert config["block_configs"][1]["moe_intermediate_size"] == 16
    assert config["block_configs"][4] == {"block_type": "mamba", "mamba_num_heads": 2, "ssm_state_size": 4}
    assert config["block_configs"][0] == {"block_type": "mamba", "mamba_num_heads": 4, "ssm_state_size": 8}
    assert config["block_configs"][3]["moe_intermediate_size"] == [8, 16, 12, 8, 4, 16]
    # MLP entries always state their width; no global MoE width or top-k (NVIDIA's Puzzle schema), and the
    # global expert count is the largest block's (what vLLM maps experts by).
    assert config["block_configs"][7] == {
        "block_type": "mlp",
        "intermediate_size": 20,
        "mlp_hidden_act": "silu",
    }
    assert "moe_intermediate_size" not in config and "num_experts_per_tok" not in config
    assert config["n_routed_experts"] == max(
        block.num_experts for block in spec.blocks if block.kind == "moe"
    )
    loaded = puzzle.load(out)
    assert loaded.spec == spec
    ids = token_batch(seed=7)
    assert_close(our_logits(loaded, ids), our_logits(model, ids), atol=0, rtol=0)


def test_puzzle_config_blocks_inherit_globals():
    """The published Puzzle schema: globals plus per-block overrides, num_hidden_layers null."""
    config = {
        "model_type": "nemotron_h_puzzle",
        "vocab_size": 1000,
        "hidden_size": 64,
        "num_hidden_layers": None,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 32,
        "n_groups": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "n_routed_experts": 16,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 48,
        "moe_shared_expert_intermediate_size": 96,
        "moe_latent_size": 32,
        "block_configs": [
            {"block_type": "mamba", "ssm_state_size": 24},
            {"block_type": "moe", "moe_intermediate_size": 24, "num_experts_per_tok": 4},
            {"block_type": "attention"},
            {"block_type": "moe"},
        ],
    }
    spec = nemotron_h.spec_from_config(config)
    assert spec.pattern == "ME*E"
    mamba, moe, attention, moe_default = spec.blocks
    assert (mamba.num_heads, mamba.head_dim, mamba.state_size, mamba.n_groups) == (8, 16, 24, 2)
    assert (moe.expert_width, moe.top_k, moe.shared_width, moe.latent_size) == (24, 4, 96, 32)
    assert (moe_default.expert_width, moe_default.top_k) == (48, 6)
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (8, 2, 16)
    assert nemotron_h.spec_from_config(nemotron_h.config_from_spec(spec)) == spec


def test_puzzle_globals_describe_the_child_and_every_moe_entry_states_width_and_top_k(parents, tmp_path):
    """llama.cpp reads width and top-k from every MoE entry (no fallback), engines read the other shapes from
    the globals: so the globals are the child's most common shapes and each MoE entry states its own."""
    _, path = parents["latent_moe"]
    model = puzzle.load(path)
    child_spec = model.spec.replace_block(1, MoESpec(8, 2, 10, 24, 12, 2.5, True, 2, 1))
    child = randomised(HybridLM(child_spec))
    child.source_config = model.source_config
    config = json.loads((child.save_pretrained(tmp_path / "child") / "config.json").read_text())
    assert config["model_type"] == "nemotron_h_puzzle"
    assert config["num_hidden_layers"] == 5 and config["layers_block_type"][1] == "moe"
    assert "mtp_block_configs" not in config
    entries = config["block_configs"]
    assert entries[1] == {
        "block_type": "moe",
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 10,
        "moe_shared_expert_intermediate_size": 24,
        "moe_latent_size": 12,
    }
    assert (entries[3]["moe_intermediate_size"], entries[3]["num_experts_per_tok"]) == (16, 3)
    assert entries[0] == entries[4] == {"block_type": "mamba"} and entries[2] == {"block_type": "attention"}
    assert nemotron_h.spec_from_config(config) == child_spec


def test_dtype_and_router_precision(parents):
    _, path = parents["latent_moe"]
    model = puzzle.load(path, dtype=torch.bfloat16)
    assert model.embeddings.weight.dtype == torch.bfloat16
    assert model.layers[0].mixer.in_proj.weight.dtype == torch.bfloat16
    router = model.layers[1].mixer.gate
    assert router.e_score_correction_bias.dtype == torch.float32 and router.weight.dtype == torch.float32
    assert model.layers[0].mixer.in_proj.weight.requires_grad
    bank = model.layers[1].mixer.experts  # filled expert by expert through views
    assert bank.up.dtype == bank.down.dtype == torch.bfloat16
    assert isinstance(bank.down, torch.nn.Parameter) and bank.down.requires_grad


def test_bf16_load_matches_transformers_bf16(parents):
    """Dtype handling end to end (norms in fp32, residual in bf16, fp32 router): within bf16 rounding of transformers."""
    parent, path = parents["latent_moe"]
    # transformers' default grouped_mm experts fail on CPU in bf16 for these tiny shapes; eager is the reference.
    theirs = NemotronHForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, experts_implementation="eager"
    ).eval()
    ours = puzzle.load(path, dtype=torch.bfloat16)
    ids = token_batch(seed=9)
    reference = hf_logits(parent, ids)
    assert_close(our_logits(ours, ids), hf_logits(theirs, ids), atol=4e-3, rtol=0)
    assert (our_logits(ours, ids) - reference).abs().max() < 2e-2


def test_tied_embeddings_roundtrip(tmp_path):
    spec = ModelSpec(vocab_size=96, hidden_size=32, blocks=(MLPSpec(width=16),), tie_embeddings=True)
    model = randomised(HybridLM(spec))
    assert model.lm_head.weight is model.embeddings.weight
    loaded = puzzle.load(model.save_pretrained(tmp_path / "tied"))
    assert loaded.lm_head.weight is loaded.embeddings.weight
    ids = token_batch(seed=8)
    assert_close(our_logits(loaded, ids), our_logits(model, ids), atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------- errors


def test_error_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        puzzle.load(tmp_path / "nowhere")


def test_error_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        puzzle.load(tmp_path)


def test_error_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(
        CheckpointError, match=r"unsupported model_type 'llama'.*nemotron_h.*nemotron_h_puzzle"
    ):
        puzzle.load(tmp_path)


def test_error_quantized_checkpoint(parents, tmp_path):
    _, path = parents["dense_mlp"]
    target = tmp_path / "nvfp4"
    shutil.copytree(path, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"quantized checkpoint .*'modelopt'.*use the BF16 release"):
        puzzle.load(target)
    assert nemotron_h.spec_from_config(config) == puzzle.load(path).spec  # the architecture is still readable


def _copy_with(source: Path, target: Path, change) -> Path:
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    change(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_error_missing_tensor(parents, tmp_path):
    _, path = parents["dense_mlp"]
    broken = _copy_with(path, tmp_path / "b", lambda t: t.pop("backbone.layers.2.mixer.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) 'backbone\.layers\.2\.mixer\.A_log'"):
        puzzle.load(broken)


def test_error_wrong_shape(parents, tmp_path):
    _, path = parents["dense_mlp"]

    def shrink(tensors):
        tensors["backbone.layers.1.mixer.up_proj.weight"] = torch.zeros(39, 32)

    broken = _copy_with(path, tmp_path / "b", shrink)
    with pytest.raises(
        CheckpointError,
        match=r"'backbone\.layers\.1\.mixer\.up_proj\.weight' has shape \[39, 32\], expected \[40, 32\]",
    ):
        puzzle.load(broken)


def test_error_unexpected_backbone_tensor(parents, tmp_path):
    _, path = parents["dense_mlp"]

    def add(tensors):
        tensors["backbone.layers.0.mixer.surprise.weight"] = torch.zeros(3)

    broken = _copy_with(path, tmp_path / "b", add)
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor\(s\) 'backbone\.layers\.0\.mixer\.surprise\.weight'"
    ):
        puzzle.load(broken)


@pytest.mark.parametrize("keep_fraction", [0.5, 0.999])
def test_error_truncated_safetensors(parents, tmp_path, keep_fraction):
    _, path = parents["dense_mlp"]
    broken = tmp_path / "b"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    data = (path / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(CheckpointError, match=r"safetensors file .*model\.safetensors is truncated"):
        puzzle.load(broken)


def test_error_corrupt_header(parents, tmp_path):
    _, path = parents["dense_mlp"]
    broken = tmp_path / "b"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(
        CheckpointError, match=r"safetensors file .*model\.safetensors is corrupt: its header is not JSON"
    ):
        puzzle.load(broken)


def test_error_block_configs_length(tmp_path):
    config = {
        "model_type": "nemotron_h_puzzle",
        "hybrid_override_pattern": "M*",
        "block_configs": [{"block_type": "mamba"}],
    }
    with pytest.raises(
        CheckpointError, match=r"block_configs has 1 entries but the layer layout has 2 blocks"
    ):
        nemotron_h.spec_from_config(config)


def test_error_invalid_block_in_config():
    config = {"model_type": "nemotron_h", "hybrid_override_pattern": "M", "mamba_num_heads": 6, "n_groups": 4}
    with pytest.raises(
        CheckpointError, match=r"block 0 \(mamba\).*num_heads \(6\) must be divisible by n_groups \(4\)"
    ):
        nemotron_h.spec_from_config(config)


# ------------------------------------------------------------------------------------------------ saving


def test_save_refuses_source_directory(parents):
    _, path = parents["dense_mlp"]
    model = puzzle.load(path)
    with pytest.raises(CheckpointError, match="refusing to write into"):
        model.save_pretrained(path)
    with pytest.raises(CheckpointError, match="refusing to write into"):
        model.save_pretrained(path.parent)
    with pytest.raises(CheckpointError, match="refusing to write into"):
        model.save_pretrained(path / "child")
    assert not (path / "child").exists()


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_save_refuses_a_directory_holding_other_files(parents, tmp_path):
    """save_pretrained(".") in a project folder used to replace the folder's code and data."""
    _, path = parents["dense_mlp"]
    model = puzzle.load(path)
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "train.py").write_text("print('my code')\n")
    (project / "data" / "tokens.bin").write_bytes(b"\x01\x02")
    (project / "config.json").write_text('{"my": "settings"}')
    before = _files(project)
    with pytest.raises(
        CheckpointError, match=r"refusing to write into .*project.*data, train\.py.*overwrite=True"
    ):
        model.save_pretrained(project)
    assert _files(project) == before and (project / "data" / "tokens.bin").read_bytes() == b"\x01\x02"
    assert [p.name for p in tmp_path.iterdir()] == ["project"]  # no staging directory left


def test_save_overwrite_writes_beside_other_files(parents, tmp_path):
    _, path = parents["dense_mlp"]
    model = puzzle.load(path)
    repo = tmp_path / "repo"  # e.g. a clone of a hub repository
    (repo / ".git").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / "README.md").write_text("# my model\n")
    model.save_pretrained(repo, max_shard_bytes=8_000, overwrite=True)
    shards = sorted(p.name for p in repo.glob("model-*.safetensors"))
    assert len(shards) > 2 and (repo / "model.safetensors.index.json").is_file()
    # Saved again unsharded: the earlier shards and index go (a loader would read them), the rest stays.
    model.save_pretrained(repo, overwrite=True)
    assert sorted(p.name for p in repo.iterdir()) == [
        ".git",
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert (repo / "README.md").read_text() == "# my model\n"
    assert (repo / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]
    ids = token_batch(seed=4)
    assert_close(our_logits(puzzle.load(repo), ids), our_logits(model, ids), atol=0, rtol=0)


def test_save_replaces_an_earlier_checkpoint_atomically(parents, tmp_path):
    _, path = parents["dense_mlp"]
    model = puzzle.load(path)
    target = tmp_path / "out"
    model.save_pretrained(target, max_shard_bytes=8_000)
    assert len(list(target.glob("model-*-of-*.safetensors"))) > 2
    child = randomised(HybridLM(model.spec), seed=1)
    child.save_pretrained(target)  # only checkpoint files there: replaced as a whole
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or backup directories left behind
    ids = token_batch(seed=4)
    assert_close(our_logits(puzzle.load(target), ids), our_logits(child, ids), atol=0, rtol=0)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert puzzle.load(child.save_pretrained(empty)).spec == model.spec


def test_saved_files_all_get_default_mode(parents, tmp_path):
    """safetensors wrote its files 0o600 beside a 0o644 config.json; copied tokenizer files kept their mode."""
    _, path = parents["dense_mlp"]
    source = tmp_path / "source"
    shutil.copytree(path, source)
    (source / "tokenizer.json").write_text("{}")
    (source / "tokenizer.json").chmod(0o600)
    (source / "special_tokens_map.json").write_text("{}")
    (source / "special_tokens_map.json").chmod(0o444)
    model = puzzle.load(source)
    for name, shard_bytes in [("single", None), ("sharded", 8_000)]:
        out = model.save_pretrained(tmp_path / name, max_shard_bytes=shard_bytes)
        files = sorted(out.iterdir())
        assert {"tokenizer.json", "special_tokens_map.json", "config.json"} <= {p.name for p in files}
        assert {p.name: os.stat(p).st_mode & 0o777 for p in files} == {p.name: default_mode() for p in files}
        assert os.stat(out).st_mode & 0o777 == default_mode(directory=True)


def test_failed_save_leaves_nothing_behind(parents, tmp_path):
    """An error midway (here an extra tensor whose file vanished) leaves neither staging nor target."""
    _, path = parents["dense_mlp"]
    source = tmp_path / "source"
    shutil.copytree(path, source)
    model = puzzle.load(source)
    model.extra_tensors["mtp.weight"] = nemotron_h.LazyTensor(
        source / "gone.safetensors", "mtp.weight", (2,), "F32"
    )
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"gone\.safetensors"):
        model.save_pretrained(out, max_shard_bytes=8_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


# A process that saves `spec` (random weights from `seed`) to `target`, one tensor per shard, and stops
# for good at `stage`: after writing 3 tensors into staging, after moving the old checkpoint aside, or
# before removing it. The test SIGKILLs it there, as an out-of-memory killer or a scheduler would.
_SAVER = r"""
import os, shutil, sys, time
import torch
from puzzle.nemotron_h.stream import StreamWriter
from puzzle.model import HybridLM
from puzzle.spec import ModelSpec

spec_json, seed, target, stage = sys.argv[1:]

def stop():
    print("stopped", flush=True)
    time.sleep(600)

real_write, real_rename, real_rmtree = StreamWriter.write, os.rename, shutil.rmtree
written = []

def write(self, name, tensor):
    real_write(self, name, tensor)
    written.append(name)
    if stage == "shards" and len(written) == 3:
        stop()

def rename(source, destination):
    real_rename(source, destination)
    if stage == "swap" and ".old-" in str(destination):
        stop()

def rmtree(path, *args, **kwargs):
    if stage == "cleanup" and ".old-" in str(path):
        stop()
    real_rmtree(path, *args, **kwargs)

StreamWriter.write, os.rename, shutil.rmtree = write, rename, rmtree
torch.manual_seed(int(seed))
HybridLM(ModelSpec.from_json(spec_json)).save_pretrained(target, max_shard_bytes=1)
"""


def _save_killed_at(stage: str, spec: ModelSpec, seed: int, target: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(puzzle.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    with subprocess.Popen(
        [sys.executable, "-c", _SAVER, spec.to_json(), str(seed), str(target), stage],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as saver:
        try:
            assert saver.stdout.readline() == "stopped\n", f"the saver did not reach {stage!r}"
        finally:
            saver.send_signal(signal.SIGKILL)
            saver.wait()
    assert saver.returncode == -signal.SIGKILL


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name.split("-")[0] for p in directory.iterdir() if p.name.startswith("."))


def _seeded(spec: ModelSpec, seed: int) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(spec).eval()


@pytest.mark.parametrize("stage", ["shards", "swap", "cleanup"])
def test_a_save_killed_midway_is_cleaned_up_by_the_next(tmp_path, stage):
    spec = EVERY_KIND_SPEC
    target = tmp_path / "out"
    if stage != "shards":  # a previous checkpoint to replace
        _seeded(spec, 1).save_pretrained(target)
    previous = _files(target) if target.exists() else None
    _save_killed_at(stage, spec, 2, target)
    expected = {"shards": [".out.tmp"], "swap": [".out.old", ".out.tmp"], "cleanup": [".out.old"]}[stage]
    assert _leftovers(tmp_path) == expected  # what used to stay forever (846 MB in one case)
    if stage == "swap":  # killed between the renames: the previous checkpoint is brought back
        remove_stale_staging(target)
        assert _files(target) == previous
    model = _seeded(spec, 3)
    model.save_pretrained(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == [  # a puzzle child: with its trust_remote_code files
        "config.json",
        "configuration_nemotron_h_puzzle.py",
        "model.safetensors",
        "modeling_nemotron_h_puzzle.py",
    ]
    ids = token_batch(seed=4) % spec.vocab_size
    assert_close(our_logits(puzzle.load(target), ids), our_logits(model, ids), atol=0, rtol=0)


def test_a_live_save_is_not_cleaned_up(tmp_path):
    """Another process still writing (its staging marker names a live process) is left alone."""
    target = tmp_path / "out"
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        staging = tmp_path / ".out.tmp-live"
        staging.mkdir()
        (staging / OWNER_MARKER).write_text(json.dumps({**owner_record(), "pid": running.pid, "start": None}))
        _seeded(EVERY_KIND_SPEC, 1).save_pretrained(target)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp-live", "out"]
    finally:
        running.kill()
        running.wait()


# ------------------------------------------------------------------------------------------ dtypes, meta


def test_error_integer_weight(parents, tmp_path):
    """An int8 weight used to load and then fail in the forward with a bare torch RuntimeError."""
    _, path = parents["dense_mlp"]

    def quantize(tensors):
        weight = tensors["backbone.layers.1.mixer.up_proj.weight"]
        tensors["backbone.layers.1.mixer.up_proj.weight"] = weight.mul(100).round().to(torch.int8)

    broken = _copy_with(path, tmp_path / "b", quantize)
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'backbone\.layers\.1\.mixer\.up_proj\.weight' is stored as I8 \(torch\.int8\); "
        r"expected a floating-point weight, one of BF16, F16, F32, F64",
    ):
        puzzle.load(broken)


def test_error_fp8_weight(parents, tmp_path):
    _, path = parents["dense_mlp"]

    def to_fp8(tensors):
        key = "backbone.layers.0.mixer.in_proj.weight"
        tensors[key] = tensors[key].to(torch.float8_e4m3fn)

    broken = _copy_with(path, tmp_path / "b", to_fp8)
    with pytest.raises(CheckpointError, match=r"in_proj\.weight' is stored as F8_E4M3 .*scales"):
        puzzle.load(broken)


@pytest.mark.parametrize("dtype", [torch.int8, "int8", torch.float8_e4m3fn, "bogus", torch.bool])
def test_error_load_dtype_not_float(parents, dtype):
    _, path = parents["dense_mlp"]
    with pytest.raises(ValueError, match=r"is not a dtype a model can be loaded in; use torch\.bfloat16"):
        puzzle.load(path, dtype=dtype)


def test_load_on_meta_builds_the_structure_only(parents, tmp_path):
    _, path = parents["latent_moe"]
    real = puzzle.load(path, dtype="bfloat16")
    meta = puzzle.load(path, dtype="bfloat16", device="meta")
    assert meta.spec == real.spec
    ours, theirs = meta.state_dict(), real.state_dict()
    assert list(ours) == list(theirs)
    for key, tensor in ours.items():
        assert tensor.is_meta and (tensor.shape, tensor.dtype) == (theirs[key].shape, theirs[key].dtype), key
    with pytest.raises(CheckpointError, match="meta device"):
        meta.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # The checkpoint is still checked: a misshapen tensor is an error on meta as well.
    _, dense = parents["dense_mlp"]

    def shrink(tensors):
        tensors["backbone.layers.1.mixer.up_proj.weight"] = torch.zeros(39, 32)

    with pytest.raises(CheckpointError, match=r"has shape \[39, 32\], expected \[40, 32\]"):
        puzzle.load(_copy_with(dense, tmp_path / "b", shrink), device="meta")


SAMPLE_BLOCKS = (  # one per kind, every field away from its default where a config can carry it
    MambaSpec(
        num_heads=4,
        head_dim=8,
        state_size=16,
        n_groups=2,
        conv_kernel=3,
        chunk_size=32,
        conv_bias=False,
        proj_bias=True,
        dt_clamp_min=0.01,
        dt_clamp_max=5.0,
    ),
    AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, bias=True),
    MoESpec(
        num_experts=4,
        top_k=2,
        expert_width=(8, 4, 8, 6),
        shared_width=12,
        latent_size=6,
        routed_scaling_factor=2.5,
        norm_topk_prob=False,
        n_group=2,
        topk_group=2,
    ),
    MLPSpec(width=8, activation="silu", bias=True),
    LinearSpec(bias=True),
    NoOpSpec(),
)


def test_every_kind_has_a_field_table_that_covers_its_spec():
    """Adding a block kind or a spec field without its config mapping fails here, not in a user's save."""
    assert set(KIND_TABLES) == set(BLOCK_SPEC_TYPES.values()) == {type(block) for block in SAMPLE_BLOCKS}
    for spec_type, table in KIND_TABLES.items():
        assert table.spec_type is spec_type
        carried = {field.attr for field in table.fields if field.attr is not None}
        spec_fields = {field.name for field in dataclasses.fields(spec_type)}
        quantization = set(QUANTIZATION_FIELDS) & spec_fields  # the weight format: quantization_config's
        assert carried | set(table.not_in_config) | quantization == spec_fields, spec_type.kind
        assert not carried & set(table.not_in_config), spec_type.kind


@pytest.mark.parametrize("block", SAMPLE_BLOCKS, ids=lambda block: block.kind)
def test_field_table_reads_back_what_it_writes(block):
    fields = {**nemotron_h.config.DEFAULTS, "hidden_size": 32, **block_config_fields(block)}
    assert block_spec_from_fields(block.kind, json.loads(json.dumps(fields))) == block
    # and through a whole config.json
    spec = ModelSpec(vocab_size=64, hidden_size=32, blocks=(block, block))
    assert nemotron_h.spec_from_config(json.loads(json.dumps(nemotron_h.config_from_spec(spec)))) == spec


def test_attention_with_rope_cannot_be_written():
    with pytest.raises(CheckpointError, match=r"attention block with rope_theta=10000\.0 cannot be written"):
        block_config_fields(AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0))
