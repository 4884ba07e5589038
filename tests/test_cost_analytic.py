"""Analytic costs against the real modules: parameter counts, tensor layout, bytes, cache sizes, FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from puzzle.blocks import build_block
from puzzle.blocks.moe import module_hub_state
from puzzle.cost.analytic import (
    ROLES,
    QuantRecipe,
    block_active_params,
    block_params,
    block_tensors,
    block_weight_bytes,
    decode_flops_per_token,
    get_recipe,
    kv_bytes_per_token,
    model_params,
    model_tensors,
    model_weight_bytes,
    prefill_flops_per_token,
    state_bytes_per_request,
    state_bytes_per_sequence,
    tensor_bytes,
)
from puzzle.cost.kinds import BLOCK_COSTS, BlockCost, block_cost, routed_expert_params
from puzzle.presets import nemotron3_super, tiny_hybrid
from puzzle.spec import (
    BLOCK_SPEC_TYPES,
    AttentionSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
    SpecError,
)

H = 32
TINY_SPECS = [
    MambaSpec(num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4),
    MambaSpec(
        num_heads=2, head_dim=8, state_size=4, n_groups=1, conv_kernel=3, conv_bias=False, proj_bias=True
    ),
    AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
    AttentionSpec(num_heads=2, num_kv_heads=1, head_dim=16, bias=True),
    MoESpec(num_experts=4, top_k=2, expert_width=16, shared_width=24, latent_size=8),
    MoESpec(num_experts=3, top_k=2, expert_width=(8, 16, 24)),
    MLPSpec(width=48),
    MLPSpec(width=40, bias=True),
    LinearSpec(),
    LinearSpec(bias=True),
    NoOpSpec(),
]


@pytest.mark.parametrize("spec", TINY_SPECS, ids=lambda s: s.short_name())
def test_block_tensors_are_the_built_modules_hub_tensors(spec):
    """The hub's tensors (what checkpoints store and quantisers see): routed experts one by one, not the bank."""
    from puzzle.model import Block

    block = Block(spec, H, 1e-5)
    expected = {name: tuple(t.shape) for name, t in module_hub_state(block).items()}
    assert {t.name: t.shape for t in block_tensors(spec, H)} == expected
    assert ("norm.weight" in expected) != isinstance(spec, NoOpSpec)  # a no-op block has no pre-norm
    # Parameters exclude buffers (the router's correction bias) but include the block's norm.
    assert block_params(spec, H) == sum(p.numel() for p in block.parameters())


def test_cost_registry_covers_every_spec_type():
    """One cost entry per block kind, and the tests above see every kind."""
    assert set(BLOCK_COSTS) == set(BLOCK_SPEC_TYPES.values())
    assert all(isinstance(cost, BlockCost) for cost in BLOCK_COSTS.values())
    assert {type(spec) for spec in TINY_SPECS} == set(BLOCK_SPEC_TYPES.values())
    with pytest.raises(SpecError, match="no cost model for block spec type str; known spec types: MambaSpec"):
        block_cost("attention")
    with pytest.raises(SpecError, match="no cost model for block spec type str"):
        block_params("attention", H)


@pytest.mark.parametrize("spec", TINY_SPECS, ids=lambda s: s.short_name())
def test_tensor_lists_mark_roles_and_routed_experts(spec):
    tensors = block_tensors(spec, H)
    assert all(t.role in ROLES for t in tensors)
    for t in tensors:
        # Routed experts (and only they) carry their expert index; hub names say which expert.
        assert (t.role == "routed_expert") == (t.expert is not None), t.name
        if t.expert is not None:
            assert t.name.startswith(f"mixer.experts.{t.expert}."), t.name
    experts = routed_expert_params(spec, H)
    if isinstance(spec, MoESpec):
        expert_input = spec.expert_input_size(H)
        assert list(experts) == [2 * width * expert_input for width in spec.widths]
    else:
        assert experts == ()


@pytest.mark.parametrize(
    "spec", [s for s in TINY_SPECS if isinstance(s, MoESpec)], ids=lambda s: s.short_name()
)
def test_moe_active_params_are_top_k_of_the_experts(spec):
    mixer = build_block(spec, H)
    bank = mixer.experts
    expert_sizes = [bank.up_weight(j).numel() + bank.down_weight(j).numel() for j in range(len(bank))]
    assert sum(expert_sizes) == bank.up.numel() + bank.down.numel()
    non_expert = block_params(spec, H) - sum(expert_sizes)
    expected = non_expert + spec.top_k * sum(expert_sizes) / len(expert_sizes)
    assert block_active_params(spec, H) == round(expected)


def test_model_counts_equal_a_built_hybrid_lm():
    from puzzle.model import HybridLM

    spec = ModelSpec(vocab_size=64, hidden_size=H, blocks=tuple(TINY_SPECS))
    model = HybridLM(spec)
    assert model_params(spec) == sum(p.numel() for p in model.parameters())
    assert {t.name: t.shape for t in model_tensors(spec)} == {
        name: tuple(t.shape) for name, t in module_hub_state(model).items()
    }
    # Stored bytes in bf16: every tensor 2 bytes except the router's weight and bias, which stay fp32.
    model = model.to(torch.bfloat16)
    assert model_weight_bytes(spec, "bf16") == sum(
        t.numel() * t.element_size() for t in model.state_dict().values()
    )


def test_tied_embeddings_are_counted_once():
    from puzzle.model import HybridLM

    spec = ModelSpec(vocab_size=64, hidden_size=H, blocks=tuple(TINY_SPECS[:3]), tie_embeddings=True)
    model = HybridLM(spec)
    assert model_params(spec) == sum(p.numel() for p in model.parameters())
    assert model_params(spec) == model_params(ModelSpec(64, H, tuple(TINY_SPECS[:3]))) - 64 * H


def test_full_nemotron3_super_on_meta_matches():
    from puzzle.model import HybridLM

    spec = nemotron3_super()
    with torch.device("meta"):
        model = HybridLM(spec)
    assert model_params(spec) == sum(p.numel() for p in model.parameters()) == 120_668_687_360
    state = module_hub_state(model)
    assert {t.name: t.shape for t in model_tensors(spec)} == {
        name: tuple(t.shape) for name, t in state.items()
    }
    # bf16 stores the router's weight and correction bias in fp32 (2 more bytes per element).
    router = sum(t.numel() for name, t in state.items() if ".gate." in name)
    assert model_weight_bytes(spec, "bf16") == 2 * sum(t.numel() for t in state.values()) + 2 * router


def test_nemotron3_super_block_counts_match_the_reference():
    spec = nemotron3_super()
    mamba, moe, attention = spec.blocks[0], spec.blocks[1], spec.blocks[7]
    assert block_params(mamba, 4096) == 109_640_064
    assert block_params(attention, 4096) == 35_655_680
    # The reference's 2,873,102,848 includes the 512-entry correction bias, a buffer; totals leave it out.
    assert block_params(moe, 4096) == 2_873_102_848 - 512
    assert sum(t.numel for t in block_tensors(moe, 4096)) == 2_873_102_848


def test_tensor_bytes_of_each_format():
    assert tensor_bytes((32, 64), "bf16") == 32 * 64 * 2
    assert tensor_bytes((32, 64), "fp32") == 32 * 64 * 4
    assert tensor_bytes((32, 64), "fp8") == 32 * 64 + 32 * 4  # one fp32 scale per output channel
    # nvfp4: half a byte per value, one fp8 scale per 16 values of a row, one fp32 tensor scale.
    assert tensor_bytes((32, 64), "nvfp4") == 32 * 64 / 2 + 32 * 4 + 4
    assert tensor_bytes((3, 20), "nvfp4") == 30 + 3 * 2 + 4  # a partial block still has a scale
    assert tensor_bytes((64,), "nvfp4") == 128  # 1-D tensors stay bf16
    with pytest.raises(SpecError, match="unknown storage format"):
        tensor_bytes((4, 4), "int3")


def test_recipes_assign_formats_by_role():
    spec = MoESpec(num_experts=4, top_k=2, expert_width=32, shared_width=32, latent_size=16)
    experts_bf16 = 4 * 2 * 32 * 16 * 2
    mixed = get_recipe("nvfp4-experts")
    assert mixed.format_of("routed_expert") == "nvfp4" and mixed.format_of("shared_expert") == "fp8"
    assert mixed.format_of("embedding") == "bf16" and mixed.format_of("router_bias") == "fp32"
    saved = block_weight_bytes(spec, H, "bf16") - block_weight_bytes(spec, H, "nvfp4-experts")
    shared_and_latent = 2 * 32 * H + 2 * 16 * H
    experts_nvfp4 = 4 * (2 * (32 * 16 / 2 + 4)) + 4 * (32 * 1 + 16 * 2)
    router_weight = 2 * 4 * H  # fp32 in bf16, bf16 in nvfp4-experts
    fp8_scales = 4 * (32 + H + 16 + H)  # one fp32 per output channel of shared up / down, latent fc1 / fc2
    assert saved == pytest.approx(
        experts_bf16 - experts_nvfp4 + shared_and_latent - fp8_scales + router_weight
    )
    with pytest.raises(SpecError, match="unknown quantisation recipe"):
        get_recipe("int2")
    with pytest.raises(SpecError, match="missing roles"):
        QuantRecipe("partial", (("embedding", "bf16"),))


def test_kv_bytes_equal_a_filled_attention_cache():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8)
    mixer = build_block(spec, H).to(torch.bfloat16)
    tokens = 7
    cache = mixer.init_cache(1)
    with torch.no_grad():
        mixer(torch.randn(1, tokens, H, dtype=torch.bfloat16), cache=cache)
    held = sum(t[:, :, : cache.length].numel() * t.element_size() for t in (cache.key, cache.value))
    assert kv_bytes_per_token(spec, "bf16") * tokens == held
    assert kv_bytes_per_token(spec, "fp8") * 2 == kv_bytes_per_token(spec, "bf16")
    assert kv_bytes_per_token(nemotron3_super(), "fp8") == 8 * 2 * 2 * 128


def test_state_bytes_equal_a_mamba_cache():
    spec = TINY_SPECS[0]
    mixer = build_block(spec, H)
    cache = mixer.init_cache(1, dtype=torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in (cache.conv_state, cache.ssm_state))
    assert state_bytes_per_sequence(spec, ssm_dtype="fp32", conv_dtype="bf16") == held
    assert state_bytes_per_sequence(AttentionSpec(4, 2, 8)) == 0
    model = tiny_hybrid()
    assert state_bytes_per_request(model, 100, "bf16") == (
        100 * kv_bytes_per_token(model) + state_bytes_per_sequence(model)
    )


def _counted_flops(module, *args) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        module(*args)
    return counter.get_total_flops()


def test_mlp_and_linear_flops_equal_the_counted_matmuls():
    for spec in (MLPSpec(width=48), LinearSpec()):
        mixer = build_block(spec, H)
        tokens = 5
        counted = _counted_flops(mixer, torch.randn(1, tokens, H))
        assert prefill_flops_per_token(spec, H, tokens) * tokens == counted
        assert decode_flops_per_token(spec, H, 100) * tokens == counted


def test_attention_decode_flops_are_the_counted_projections_plus_scores():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8)
    mixer = build_block(spec, H)
    cache = mixer.init_cache(2)
    with torch.no_grad():
        mixer(torch.randn(2, 9, H), cache=cache)
    # FlopCounterMode does not see inside CPU SDPA: it counts the four projections only.
    projections = _counted_flops(mixer.step, torch.randn(2, 1, H), cache)
    scores = 2 * 2 * spec.num_heads * spec.head_dim * 10  # QK^T and AV over 10 keys, per token
    assert decode_flops_per_token(spec, H, context_len=10) * 2 == projections + 2 * scores


def test_moe_flops_with_every_expert_active_equal_the_counted_matmuls():
    # top_k = num_experts makes routing irrelevant: every token runs through every expert.
    spec = MoESpec(num_experts=3, top_k=3, expert_width=(8, 16, 24), shared_width=16, latent_size=8)
    mixer = build_block(spec, H)
    tokens = 4
    counted = _counted_flops(mixer, torch.randn(1, tokens, H))
    assert prefill_flops_per_token(spec, H, tokens) * tokens == counted


def test_context_terms():
    attention = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8)
    mamba = TINY_SPECS[0]
    # Attention decode grows linearly with context; prefill per token grows with prompt length.
    step = decode_flops_per_token(attention, H, 200) - decode_flops_per_token(attention, H, 100)
    assert step == 4 * 4 * 8 * 100
    assert (
        prefill_flops_per_token(attention, H, 101) - prefill_flops_per_token(attention, H, 1)
        == 4 * 4 * 8 * 50
    )
    # Mamba decode does not depend on context; its prefill scan term saturates at the chunk size.
    assert decode_flops_per_token(mamba, H, 10) == decode_flops_per_token(mamba, H, 10_000)
    long = mamba.chunk_size * 4
    assert prefill_flops_per_token(mamba, H, long) == prefill_flops_per_token(mamba, H, long * 8)
    assert prefill_flops_per_token(mamba, H, 8) < prefill_flops_per_token(mamba, H, long)


def test_bad_hidden_size_is_a_clear_error():
    with pytest.raises(SpecError, match="hidden_size"):
        block_params(MLPSpec(width=8), 0)
