"""Tiny random transformers NemotronH models, the oracle for tests of puzzle.model and puzzle.nemotron_h."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM
from transformers.utils import logging as hf_logging

from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, NoOpSpec

# The reference kernels' "falling back to PyTorch" notices are expected on CPU.
hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 96

# A tiny puzzle model with one block of every kind (heterogeneous expert widths included).
EVERY_KIND_SPEC = ModelSpec(
    vocab_size=40,
    hidden_size=16,
    blocks=(
        MambaSpec(num_heads=4, head_dim=4, state_size=6, n_groups=2, chunk_size=8),
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4),
        MoESpec(num_experts=5, top_k=2, expert_width=(8, 6, 8, 8, 4), shared_width=8, latent_size=12),
        MLPSpec(width=12),
        LinearSpec(),
        NoOpSpec(),
    ),
)

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=40,
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=8,
    n_groups=2,
    chunk_size=8,
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24,
    eos_token_id=None,
    pad_token_id=0,
    bos_token_id=1,
)

# Tiny parents covering the axes that matter: latent MoE with group routing, plain MoE with unnormalised
# weights, dense MLP blocks with n_groups=4 and an active dt clamp; chunk sizes that do not divide 13.
CONFIGS = {
    "latent_moe": dict(
        layers_block_type=["linear_attention", "moe", "full_attention", "moe", "linear_attention"],
        moe_latent_size=12,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
    ),
    "plain_moe": dict(
        layers_block_type=["moe", "linear_attention", "full_attention", "moe"],
        n_groups=1,
        chunk_size=5,
        norm_topk_prob=False,
        num_key_value_heads=4,
    ),
    "dense_mlp": dict(
        layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention", "mlp"],
        mamba_num_heads=8,
        mamba_head_dim=4,
        n_groups=4,
        chunk_size=4,
        time_step_min=0.05,
    ),
}


def tiny_config(name: str, **overrides) -> NemotronHConfig:
    return NemotronHConfig(**{**BASE, **CONFIGS[name], **overrides})


def random_hf_model(config: NemotronHConfig, seed: int = 0) -> NemotronHForCausalLM:
    """A NemotronHForCausalLM with every parameter random, including those transformers initialises to constants.

    e_score_correction_bias (zero at init) gets values large enough to change routing; dt_bias gets a
    wide spread so the time_step_min clamp is active for some heads.
    """
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("A_log"):
                param.copy_(noise * 0.5)
            elif name.endswith("dt_bias"):
                param.copy_(noise * 2.0)
            elif name.endswith((".D", "norm.weight", "norm_f.weight")):
                param.copy_(1.0 + 0.3 * noise)
            elif name.endswith("conv1d.bias"):
                param.copy_(0.1 * noise)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                bias = module.e_score_correction_bias
                bias.copy_(0.2 * torch.randn(bias.shape, generator=generator))
    return model


def save_hf(model: NemotronHForCausalLM, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def token_batch(batch: int = 2, length: int = 13, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
