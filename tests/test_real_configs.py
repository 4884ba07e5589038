"""NVIDIA's published config.json files parse to our presets and give the published parameter counts.

The config dicts below are facts about public checkpoints (config fields only), each with its source.
The oracle is the published figure: the safetensors parameter totals that Hugging Face reports for
the checkpoints, as quoted by the public sources named next to each number.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from puzzle import nemotron_h
from puzzle.cost.analytic import block_params, model_active_params, model_params
from puzzle.presets.nemotron import (
    PUZZLE_75B_MOE,
    nemotron3_nano,
    nemotron3_super,
    nemotron_h_8b,
    nemotron_nano_9b_v2,
    puzzle_75b_a9b_like,
)
from puzzle.spec import AttentionSpec, MambaSpec, ModelSpec, MoESpec

# nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4 config.json @ 4f0cf9da, as transcribed verbatim by a
# public C++ test header ("Super's config.json"), without its 5.7 MB quantization_config (irrelevant to
# the architecture). The BF16 / FP8 releases share these architecture fields.
SUPER_120B_A12B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_nemotron_h.NemotronHConfig",
        "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM",
    },
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "dtype": "bfloat16",
    "eos_token_id": 2,
    "expand": 2,
    "head_dim": 128,
    "hidden_dropout": 0.0,
    "hidden_size": 4096,
    "hybrid_override_pattern": (
        "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
    ),
    "initializer_range": 0.02,
    "intermediate_size": 2688,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 128,
    "mamba_proj_bias": False,
    "mamba_ssm_cache_dtype": "float32",
    "max_position_embeddings": 262144,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "moe_intermediate_size": 2688,
    "moe_latent_size": 1024,
    "moe_shared_expert_intermediate_size": 5376,
    "moe_shared_expert_overlap": False,
    "mtp_hybrid_override_pattern": "*E",
    "n_group": 1,
    "n_groups": 8,
    "n_routed_experts": 512,
    "n_shared_experts": 1,
    "norm_eps": 1e-05,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts_per_tok": 22,
    "num_hidden_layers": 88,
    "num_key_value_heads": 2,
    "num_logits_to_keep": 1,
    "num_nextn_predict_layers": 1,
    "pad_token_id": 0,
    "partial_rotary_factor": 1.0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rope_theta": 10000,
    "routed_scaling_factor": 5.0,
    "sliding_window": None,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "time_step_floor": 0.0001,
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "topk_group": 1,
    "transformers_version": "4.57.6",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}

# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-NVFP4 config.json @ 6efb4a2a, verbatim (same public C++ test
# header, "Nano's config.json ... verbatim"); the BF16 release has the same architecture fields.
NANO_30B_A3B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_nemotron_h.NemotronHConfig",
        "AutoModel": "modeling_nemotron_h.NemotronHForCausalLM",
        "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM",
    },
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "eos_token_id": 2,
    "expand": 2,
    "head_dim": 128,
    "hidden_dropout": 0.0,
    "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "initializer_range": 0.02,
    "intermediate_size": 1856,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 64,
    "mamba_proj_bias": False,
    "mamba_ssm_cache_dtype": "float32",
    "max_position_embeddings": 262144,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "n_group": 1,
    "n_groups": 8,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "norm_eps": 1e-05,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 52,
    "num_key_value_heads": 2,
    "num_logits_to_keep": 1,
    "pad_token_id": 0,
    "partial_rotary_factor": 1.0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "sliding_window": None,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "time_step_floor": 0.0001,
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.53.2",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}

# nvidia/Nemotron-H-8B-Base-8K config.json as the NVIDIA-NeMo/Megatron-Bridge NemotronH bridge tests
# transcribe it (their added "hidden_act" and "n_routed_experts": null test shims left out). The old
# remote-code schema: "attention_head_dim" (no "head_dim"), "rms_norm_eps" next to "layer_norm_epsilon",
# no MoE fields, no "time_step_min".
H_8B_BASE_8K: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_head_dim": 128,
    "auto_map": {
        "AutoConfig": "configuration_nemotron_h.NemotronHConfig",
        "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM",
    },
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "eos_token_id": 2,
    "expand": 2,
    "hidden_dropout": 0.0,
    "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "initializer_range": 0.02,
    "intermediate_size": 21504,
    "layer_norm_epsilon": 1e-05,
    "mamba_head_dim": 64,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 128,
    "mamba_proj_bias": False,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "n_groups": 8,
    "num_attention_heads": 32,
    "num_hidden_layers": 52,
    "num_key_value_heads": 8,
    "num_logits_to_keep": 1,
    "pad_token_id": 0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rms_norm_eps": 1e-05,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.0.dev0",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}

# nvidia/NVIDIA-Nemotron-Nano-9B-v2 config.json (revision 6533e8de), trimmed to its architecture fields:
# no verbatim copy was found; these values agree across several public transcriptions (NVIDIA
# TensorRT-Model-Connect's VoiceChat thinker config pinned to that revision, Megatron-Bridge's Nano-9B-v2
# recipe, a vLLM memory-fit test). Fields not listed take transformers' NemotronH defaults.
NANO_9B_V2: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 131072,
    "hidden_size": 4480,
    "intermediate_size": 15680,
    "num_hidden_layers": 56,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    "mamba_num_heads": 128,
    "mamba_head_dim": 80,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "max_position_embeddings": 131072,
}

# Published totals (Hugging Face safetensors metadata), as quoted by public sources:
# - Super BF16: 123,611,033,088 in all = backbone + MTP module 2,942,324,736 + fp32
#   e_score_correction_bias of 41 MoE routers (40 backbone + 1 MTP) x 512 experts (a public catalog test).
# - Nano BF16: "total" 31,577,937,344 without its fp32 buffers (23 x 128 router biases), 31,577,940,288
#   with them (several public tests quoting the safetensors API).
# - Nemotron-H-8B-Base-8K: 8,100,852,736 (a public architecture analysis of the checkpoint).
# - Nano-9B-v2 @ 6533e8de: 8,888,227,328 (public model registries pinning that revision).
SUPER_SAFETENSORS_TOTAL = 123_611_033_088
SUPER_MTP_PARAMS = 2_942_324_736


@pytest.mark.parametrize(
    ("config", "preset", "total", "active"),
    [
        (
            SUPER_120B_A12B,
            nemotron3_super,
            SUPER_SAFETENSORS_TOTAL - SUPER_MTP_PARAMS - 41 * 512,
            12_770_216_960,
        ),
        (NANO_30B_A3B, nemotron3_nano, 31_577_937_344, 3_580_073_408),
        (H_8B_BASE_8K, nemotron_h_8b, 8_100_852_736, 8_100_852_736),
        (NANO_9B_V2, nemotron_nano_9b_v2, 8_888_227_328, 8_888_227_328),
    ],
    ids=["super-120b-a12b", "nano-30b-a3b", "h-8b-base-8k", "nano-9b-v2"],
)
def test_published_config_gives_the_preset_and_the_published_totals(config, preset, total, active, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = nemotron_h.spec_from_config(nemotron_h.read_config(tmp_path), where=str(tmp_path / "config.json"))
    assert spec == preset()
    assert model_params(spec) == total
    assert model_active_params(spec) == active


@pytest.mark.parametrize("config", [SUPER_120B_A12B, NANO_30B_A3B, H_8B_BASE_8K, NANO_9B_V2])
def test_published_config_survives_our_writer(config):
    """Rewriting an unchanged parent keeps it a transformers-loadable nemotron_h config, MTP fields kept."""
    spec = nemotron_h.spec_from_config(config)
    written = nemotron_h.config_from_spec(spec, base=config)
    assert written["model_type"] == "nemotron_h"
    assert nemotron_h.spec_from_config(json.loads(json.dumps(written))) == spec
    for key in ("mtp_hybrid_override_pattern", "num_nextn_predict_layers", "max_position_embeddings"):
        assert written.get(key) == config.get(key)


def test_published_active_counts_round_to_the_model_cards():
    # The cards' headline figures: Super "12.7B"/"12.8B active", Nano "3.6B" active with embeddings.
    assert model_active_params(nemotron3_super()) == pytest.approx(12.77e9, abs=0.05e9)
    assert model_active_params(nemotron3_nano()) == pytest.approx(3.58e9, abs=0.05e9)


def mtp_params(config: dict[str, Any], mtp_spec: ModelSpec) -> int:
    """NemotronH MTP module: eh_proj [H, 2H], enorm, hnorm, its blocks (with norms), final_layernorm."""
    hidden = config["hidden_size"]
    return 2 * hidden * hidden + 3 * hidden + sum(block_params(b, hidden) for b in mtp_spec.blocks)


def test_super_mtp_module_and_the_whole_checkpoint_match_the_safetensors_counts():
    """The MTP module (pattern "*E", global fields) is parsed like the backbone; MTP fields are ignored."""
    mtp_spec = nemotron_h.spec_from_config(
        {**SUPER_120B_A12B, "hybrid_override_pattern": SUPER_120B_A12B["mtp_hybrid_override_pattern"]}
    )
    assert mtp_spec.pattern == "*E"
    assert mtp_params(SUPER_120B_A12B, mtp_spec) == SUPER_MTP_PARAMS
    backbone = model_params(nemotron_h.spec_from_config(SUPER_120B_A12B))
    assert backbone + SUPER_MTP_PARAMS + 41 * 512 == SUPER_SAFETENSORS_TOTAL


def test_old_schema_head_dim_defaults_like_transformers():
    # Nemotron-H-8B has "attention_head_dim" and no "head_dim"; transformers' default head_dim 128 applies.
    attention = next(
        b for b in nemotron_h.spec_from_config(H_8B_BASE_8K).blocks if isinstance(b, AttentionSpec)
    )
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim) == (32, 8, 128)


# The nemotron_h_puzzle schema of nvidia/NVIDIA-Nemotron-Labs-3-Puzzle-75B-A9B-{BF16,FP8,NVFP4}, as the
# public readers use it (vLLM NemotronHPuzzleConfig, TensorRT-LLM's puzzle tests "mimicking the real
# puzzle model", Megatron-Bridge's NemotronHPuzzleBridge, mlx-lm's nemotron_h tests, llama.cpp's
# NemotronHPuzzleModel converter): the Super globals with ssm_state_size 96, num_hidden_layers null,
# moe_intermediate_size / num_experts_per_tok removed from the globals ("strictly blockwise members"),
# one block_configs entry per block (MoE entries repeat n_routed_experts, moe_latent_size and
# moe_shared_expert_intermediate_size), and the MTP module in mtp_block_configs (attention + MoE
# 2688 / top-22). NVIDIA's per-block (width, top_k) values were not found in any public source we could
# reach, so the illustrative PUZZLE_75B_MOE values stand in for them.
def puzzle_75b_config(with_nulls: bool = False) -> dict[str, Any]:
    config = {
        key: value
        for key, value in SUPER_120B_A12B.items()
        if key not in ("moe_intermediate_size", "num_experts_per_tok", "mtp_hybrid_override_pattern")
    }
    pattern = config.pop("hybrid_override_pattern")
    kinds = {"M": "mamba", "*": "attention", "E": "moe"}
    choices = iter(PUZZLE_75B_MOE)
    block_configs = []
    for char in pattern:
        entry: dict[str, Any] = {"block_type": kinds[char]}
        if char == "E":
            width, top_k = next(choices)
            entry.update(
                {
                    "moe_intermediate_size": width,
                    "n_routed_experts": 512,
                    "num_experts_per_tok": top_k,
                    "moe_latent_size": 1024,
                    "moe_shared_expert_intermediate_size": 5376,
                }
            )
        elif with_nulls:  # what a per-block dataclass serialises for fields it leaves unset
            entry.update({"moe_intermediate_size": None, "num_experts_per_tok": None, "ssm_state_size": None})
        block_configs.append(entry)
    mtp_moe = {
        "block_type": "moe",
        "moe_intermediate_size": 2688,
        "n_routed_experts": 512,
        "num_experts_per_tok": 22,
        "moe_latent_size": 1024,
        "moe_shared_expert_intermediate_size": 5376,
    }
    config.update(
        {
            "model_type": "nemotron_h_puzzle",
            "architectures": ["NemotronHPuzzleForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_nemotron_h_puzzle.NemotronHPuzzleConfig",
                "AutoModelForCausalLM": "modeling_nemotron_h_puzzle.NemotronHPuzzleForCausalLM",
            },
            "num_hidden_layers": None,
            "ssm_state_size": 96,
            "layers_block_type": [entry["block_type"] for entry in block_configs],
            "block_configs": block_configs,
            "mtp_block_configs": [{"block_type": "attention"}, mtp_moe],
            "mtp_layers_block_type": ["attention", "moe"],
            "num_nextn_predict_layers": 1,
        }
    )
    return config


@pytest.mark.parametrize("with_nulls", [False, True], ids=["plain", "null-fields"])
def test_puzzle_schema_gives_the_per_block_shapes(with_nulls, tmp_path):
    config = puzzle_75b_config(with_nulls)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = nemotron_h.spec_from_config(nemotron_h.read_config_file(tmp_path / "config.json"))
    assert spec == puzzle_75b_a9b_like()
    assert spec.num_blocks == 88 and spec.pattern.count("E") == 40
    moe = [b for b in spec.blocks if isinstance(b, MoESpec)]
    assert [(b.expert_width, b.top_k) for b in moe] == list(PUZZLE_75B_MOE)
    assert {(b.num_experts, b.latent_size, b.shared_width, b.routed_scaling_factor) for b in moe} == {
        (512, 1024, 5376, 5.0)
    }
    assert {b.state_size for b in spec.blocks if isinstance(b, MambaSpec)} == {96}
    # Published: 75.3B total, 9.3B active (the illustrative widths share the published sums).
    assert model_params(spec) == 75_353_324_544
    assert model_active_params(spec) == 9_301_949_440


def test_puzzle_mtp_block_configs_describe_the_supers_mtp_module():
    config = puzzle_75b_config()
    mtp_spec = nemotron_h.spec_from_config(
        {**config, "layers_block_type": None, "block_configs": config["mtp_block_configs"]}
    )
    assert mtp_spec.pattern == "*E"
    assert mtp_params(config, mtp_spec) == SUPER_MTP_PARAMS


def test_puzzle_export_roundtrips_and_keeps_the_mtp_fields():
    config = puzzle_75b_config()
    spec = nemotron_h.spec_from_config(config)
    written = nemotron_h.config_from_spec(spec, base=config)
    assert written["model_type"] == "nemotron_h_puzzle"
    assert written["mtp_block_configs"] == config["mtp_block_configs"]
    assert written["num_nextn_predict_layers"] == 1
    assert nemotron_h.spec_from_config(json.loads(json.dumps(written))) == spec


def test_export_never_relies_on_a_null_override():
    """Nulls in entries inherit, so a block without a latent projection must not be written as a null."""
    spec = puzzle_75b_a9b_like()
    index = next(i for i, b in enumerate(spec.blocks) if isinstance(b, MoESpec))
    spec = spec.replace_block(index, dataclasses.replace(spec.blocks[index], latent_size=None))
    written = nemotron_h.config_from_spec(spec, base=puzzle_75b_config())
    assert all(value is not None for entry in written["block_configs"] for value in entry.values())
    assert nemotron_h.spec_from_config(json.loads(json.dumps(written))) == spec


def test_real_configs_are_json_objects_a_file_reader_accepts(tmp_path: Path):
    for name, config in {"super": SUPER_120B_A12B, "nano": NANO_30B_A3B}.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        assert nemotron_h.read_config_file(path) == config
