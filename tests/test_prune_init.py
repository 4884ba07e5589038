"""Child-block surgery: identity, exact shapes, each axis against a hand-sliced reference, and errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from puzzle.axes import pruning_axes
from puzzle.blocks import build_block
from puzzle.prune.importance import BlockImportance, collect_block_importance
from puzzle.prune.init import CHILD_INITS, expert_widths_by_importance, init_child, linear_fit, top_indices
from puzzle.spec import (
    BLOCK_SPEC_TYPES,
    AttentionSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    MoESpec,
    NoOpSpec,
    SpecError,
)

H = 24
MAMBA = MambaSpec(num_heads=6, head_dim=4, state_size=8, n_groups=2, chunk_size=8)
ATTENTION = AttentionSpec(num_heads=8, num_kv_heads=4, head_dim=6, bias=True)
MOE = MoESpec(num_experts=6, top_k=2, expert_width=10, shared_width=12, latent_size=16)
MOE_FLAT = MoESpec(num_experts=6, top_k=2, expert_width=(10, 8, 10, 6, 10, 10))
MLP = MLPSpec(width=20, bias=True)


def parent(spec, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    block = build_block(spec, H)
    with torch.no_grad():  # non-default values everywhere, so a wrong slice cannot pass by accident
        for tensor in block.state_dict().values():
            tensor.copy_(torch.randn_like(tensor.float()).to(tensor.dtype))
        if isinstance(spec, MambaSpec):
            block.A_log.copy_(torch.rand(spec.num_heads))
            block.norm.weight.copy_(1 + 0.1 * torch.rand(spec.d_inner))
    return block


def scores(kind: str, seed: int = 1, **shapes: tuple[int, ...]) -> BlockImportance:
    generator = torch.Generator().manual_seed(seed)
    return BlockImportance(
        kind, {k.replace("__", "."): torch.rand(s, generator=generator) for k, s in shapes.items()}, 100
    )


def sorted_top(values: list[float], k: int) -> list[int]:
    """Reference top-k: indices of the k largest values, ascending (written independently of top_indices)."""
    ranked = sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]
    return sorted(ranked)


X = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("spec", [MAMBA, ATTENTION, MOE, MOE_FLAT, MLP, LinearSpec(), NoOpSpec()])
def test_identity_child_is_bit_identical(spec):
    block = parent(spec)
    child = init_child(block, spec, spec, None)
    assert child is not block and child.spec == spec
    state, child_state = block.state_dict(), child.state_dict()
    assert state.keys() == child_state.keys()
    for name in state:
        assert torch.equal(state[name], child_state[name]) and state[name].dtype == child_state[name].dtype
        assert state[name].data_ptr() != child_state[name].data_ptr() or state[name].numel() == 0
    with torch.no_grad():
        assert torch.equal(child(X), block(X))


def test_child_init_registry_covers_every_spec_type():
    """One entry per block kind; every kind with weights can become a least-squares linear block and a no-op."""
    assert set(CHILD_INITS) == set(BLOCK_SPEC_TYPES.values())
    specs = [MAMBA, ATTENTION, MOE, MLP, LinearSpec(bias=True), NoOpSpec()]
    assert {type(spec) for spec in specs} == set(CHILD_INITS)
    for spec in specs:
        rules = CHILD_INITS[type(spec)]
        assert {axis.name for axis in pruning_axes(spec)} <= {f.name for f in dataclasses.fields(spec)}, (
            spec.kind
        )
        # A child of this kind is built one way: shrinking a parent of the kind, or from a parent of any kind.
        assert (rules.shrink is None) != (rules.from_any_kind is None), spec.kind
        block = parent(spec)
        if rules.has_weights:
            assert rules.hidden_size(block) == H
            importance = collect_block_importance(block, [X], linear_fit_every=1)
            child = init_child(block, spec, LinearSpec(), importance)
            assert torch.equal(child.linear.weight, linear_fit(importance, bias=False)[0].float()), spec.kind
        noop = init_child(block, spec, NoOpSpec(), None, hidden_size=H)
        assert noop.state_dict() == {} and torch.equal(noop(X), torch.zeros_like(X))
    with pytest.raises(SpecError, match="no child initialisation for block spec type str; known spec types"):
        init_child(parent(MLP), MLP, "mlp", None)


def test_top_indices_keeps_order_and_breaks_ties_low():
    assert top_indices(torch.tensor([0.1, 0.9, 0.5, 0.9]), 2).tolist() == [1, 3]
    assert top_indices(torch.tensor([[3.0, 1.0, 2.0], [0.0, 5.0, 5.0]]), 2).tolist() == [[0, 2], [1, 2]]


def test_mamba_all_axes_against_hand_slices():
    spec = MAMBA
    child_spec = MambaSpec(num_heads=4, head_dim=3, state_size=5, n_groups=2, chunk_size=8)
    block = parent(spec)
    imp = scores("mamba", head=(6,), channel=(6, 4), state=(2, 8))
    child = init_child(block, spec, child_spec, imp)
    d, G, N, P = spec.d_inner, spec.n_groups, spec.state_size, spec.head_dim
    heads = []
    for g in range(G):  # 3 heads per group, keep 2 each
        local = sorted_top(imp["head"][3 * g : 3 * g + 3].tolist(), 2)
        heads += [3 * g + h for h in local]
    channels = [h * P + p for h in heads for p in sorted_top(imp["channel"][h].tolist(), 3)]
    bc = [g * N + n for g in range(G) for n in sorted_top(imp["state"][g].tolist(), 5)]
    x_rows = [d + c for c in channels]
    b_rows = [2 * d + i for i in bc]
    c_rows = [2 * d + G * N + i for i in bc]
    dt_rows = [2 * d + 2 * G * N + h for h in heads]
    W = block.in_proj.weight
    assert torch.equal(child.in_proj.weight, W[channels + x_rows + b_rows + c_rows + dt_rows])
    conv = [c for c in channels] + [d + i for i in bc] + [d + G * N + i for i in bc]
    assert torch.equal(child.conv1d.weight, block.conv1d.weight[conv])
    assert torch.equal(child.conv1d.bias, block.conv1d.bias[conv])
    for name in ("dt_bias", "A_log", "D"):
        assert torch.equal(getattr(child, name), getattr(block, name)[heads])
    assert torch.equal(child.out_proj.weight, block.out_proj.weight[:, channels])
    # No norm statistics given: the norm weights are plain slices.
    assert torch.equal(child.norm.weight, block.norm.weight[channels])
    assert child.in_proj.weight.shape == (child_spec.in_proj_dim, H)
    with torch.no_grad():
        assert child(X).shape == X.shape


def test_mamba_state_pruning_is_exact_when_the_dropped_channels_are_dead():
    """Zeroing the B rows (in_proj and conv) of the dropped state channels makes them contribute nothing."""
    block = parent(MAMBA)
    child_spec = MambaSpec(num_heads=6, head_dim=4, state_size=5, n_groups=2, chunk_size=8)
    imp = scores("mamba", state=(2, 8))
    d, N = MAMBA.d_inner, MAMBA.state_size
    with torch.no_grad():
        for g in range(2):
            for n in set(range(N)) - set(sorted_top(imp["state"][g].tolist(), 5)):
                block.in_proj.weight[2 * d + g * N + n] = 0
                block.conv1d.weight[d + g * N + n] = 0
                block.conv1d.bias[d + g * N + n] = 0
        child = init_child(block, MAMBA, child_spec, imp)
        torch.testing.assert_close(child(X), block(X), rtol=1e-5, atol=1e-5)


def test_mamba_norm_rescale_uses_the_parent_statistics():
    block = parent(MAMBA)
    imp = collect_block_importance(block, [X], linear_fit=False)
    child_spec = MambaSpec(num_heads=6, head_dim=2, state_size=8, n_groups=2, chunk_size=8)
    child = init_child(block, MAMBA, child_spec, imp)
    kept = [h * 4 + p for h in range(6) for p in sorted_top(imp["channel"][h].tolist(), 2)]
    ratio = child.norm.weight / block.norm.weight[kept]
    for g in range(2):
        group = kept[6 * g : 6 * g + 6]
        expected = imp["norm_q"][group].double().mean().sqrt().float()
        torch.testing.assert_close(ratio[6 * g : 6 * g + 6], expected.expand(6))
    # Only the state axis shrinks: the norm keeps every channel, so no rescale at all.
    state_only = init_child(block, MAMBA, MambaSpec(6, 4, 4, n_groups=2, chunk_size=8), imp)
    assert torch.equal(state_only.norm.weight, block.norm.weight)


def test_attention_keep_best_groups_against_hand_slices():
    block = parent(ATTENTION)
    imp = scores("attention", q_head=(8,), kv_group=(4,))
    child = init_child(block, ATTENTION, AttentionSpec(2, 2, 6, bias=True), imp)
    groups = sorted_top(imp["kv_group"].tolist(), 2)
    q_heads = [2 * g + sorted_top(imp["q_head"][2 * g : 2 * g + 2].tolist(), 1)[0] for g in groups]
    q_rows = [h * 6 + i for h in q_heads for i in range(6)]
    kv_rows = [g * 6 + i for g in groups for i in range(6)]
    assert torch.equal(child.q_proj.weight, block.q_proj.weight[q_rows])
    assert torch.equal(child.q_proj.bias, block.q_proj.bias[q_rows])
    assert torch.equal(child.k_proj.weight, block.k_proj.weight[kv_rows])
    assert torch.equal(child.v_proj.bias, block.v_proj.bias[kv_rows])
    assert torch.equal(child.o_proj.weight, block.o_proj.weight[:, q_rows])
    assert torch.equal(child.o_proj.bias, block.o_proj.bias)


def test_attention_keep_is_exact_when_dropped_groups_are_silent():
    block = parent(ATTENTION)
    imp = scores("attention", q_head=(8,), kv_group=(4,))
    groups = sorted_top(imp["kv_group"].tolist(), 2)
    with torch.no_grad():
        for g in set(range(4)) - set(groups):
            block.o_proj.weight[:, 12 * g : 12 * g + 12] = 0
        child = init_child(block, ATTENTION, AttentionSpec(4, 2, 6, bias=True), imp)
        torch.testing.assert_close(child(X), block(X), rtol=1e-5, atol=1e-5)


def test_attention_mean_pool_merges_consecutive_groups():
    block = parent(ATTENTION)
    child = init_child(block, ATTENTION, AttentionSpec(8, 2, 6, bias=True), None)
    for name in ("k_proj", "v_proj"):
        w = getattr(block, name).weight.view(4, 6, H)
        expected = torch.stack([(w[0] + w[1]) / 2, (w[2] + w[3]) / 2]).reshape(12, H)
        torch.testing.assert_close(getattr(child, name).weight, expected)
    assert torch.equal(child.q_proj.weight, block.q_proj.weight)
    assert torch.equal(child.o_proj.weight, block.o_proj.weight)
    # Identical K and V inside each merged pair: pooling changes nothing.
    with torch.no_grad():
        for name in ("k_proj", "v_proj"):
            w = getattr(block, name)
            w.weight.view(2, 2, 6, H)[:, 1] = w.weight.view(2, 2, 6, H)[:, 0].clone()
            w.bias.view(2, 2, 6)[:, 1] = w.bias.view(2, 2, 6)[:, 0].clone()
        child = init_child(block, ATTENTION, AttentionSpec(8, 2, 6, bias=True), None)
        torch.testing.assert_close(child(X), block(X), rtol=1e-5, atol=1e-5)


def test_moe_experts_widths_shared_latent_against_hand_slices():
    block = parent(MOE)
    shapes = {f"expert_channel__{j}": (10,) for j in range(6)}
    imp = scores("moe", expert=(6,), shared_channel=(12,), latent=(16,), **shapes)
    child_spec = MoESpec(num_experts=3, top_k=2, expert_width=(4, 10, 7), shared_width=5, latent_size=9)
    child = init_child(block, MOE, child_spec, imp)
    experts = sorted_top(imp["expert"].tolist(), 3)
    latent = sorted_top(imp["latent"].tolist(), 9)
    assert torch.equal(child.gate.weight, block.gate.weight[experts])
    assert torch.equal(child.gate.e_score_correction_bias, block.gate.e_score_correction_bias[experts])
    assert child.gate.e_score_correction_bias.dtype == torch.float32
    for i, (j, width) in enumerate(zip(experts, (4, 10, 7))):
        keep = sorted_top(imp[f"expert_channel.{j}"].tolist(), width)
        up, down = block.experts.up_weight(j), block.experts.down_weight(j)
        assert torch.equal(child.experts.up_weight(i), up[keep][:, latent])
        assert torch.equal(child.experts.down_weight(i), down[latent][:, keep])
    assert torch.equal(child.fc1_latent_proj.weight, block.fc1_latent_proj.weight[latent])
    assert torch.equal(child.fc2_latent_proj.weight, block.fc2_latent_proj.weight[:, latent])
    keep = sorted_top(imp["shared_channel"].tolist(), 5)
    assert torch.equal(child.shared_experts.up_proj.weight, block.shared_experts.up_proj.weight[keep])
    assert torch.equal(child.shared_experts.down_proj.weight, block.shared_experts.down_proj.weight[:, keep])
    with torch.no_grad():
        assert child(X).shape == X.shape


def test_moe_expert_removal_is_exact_for_never_routed_experts():
    block = parent(MOE_FLAT)
    imp = scores("moe", expert=(6,))
    kept = sorted_top(imp["expert"].tolist(), 4)
    with torch.no_grad():
        for j in set(range(6)) - set(kept):
            block.gate.e_score_correction_bias[j] = -100.0  # never chosen
        child_spec = MoESpec(4, 2, tuple(MOE_FLAT.widths[j] for j in kept))
        child = init_child(block, MOE_FLAT, child_spec, imp)
        torch.testing.assert_close(child(X), block(X), rtol=1e-5, atol=1e-5)


def test_moe_shared_expert_can_be_dropped_and_top_k_changed():
    block = parent(MOE)
    child = init_child(block, MOE, MoESpec(6, 3, 10, shared_width=0, latent_size=16), None)
    assert not hasattr(child, "shared_experts") and child.spec.top_k == 3
    assert torch.equal(child.gate.weight, block.gate.weight)


def test_mlp_width_against_hand_slices_and_exact_when_dropped_channels_are_dead():
    block = parent(MLP)
    imp = scores("mlp", channel=(20,))
    child = init_child(block, MLP, MLPSpec(9, bias=True), imp)
    keep = sorted_top(imp["channel"].tolist(), 9)
    assert torch.equal(child.up_proj.weight, block.up_proj.weight[keep])
    assert torch.equal(child.up_proj.bias, block.up_proj.bias[keep])
    assert torch.equal(child.down_proj.weight, block.down_proj.weight[:, keep])
    assert torch.equal(child.down_proj.bias, block.down_proj.bias)
    with torch.no_grad():
        block.down_proj.weight[:, sorted(set(range(20)) - set(keep))] = 0
        torch.testing.assert_close(child(X), block(X), rtol=1e-5, atol=1e-4)


def test_linear_fit_recovers_a_linear_map_and_structural_fallbacks():
    torch.manual_seed(3)
    W, b = torch.randn(H, H), torch.randn(H)
    xs = [torch.randn(4, 16, H) for _ in range(3)]
    linear = build_block(LinearSpec(bias=True), H)
    with torch.no_grad():
        linear.linear.weight.copy_(W)
        linear.linear.bias.copy_(b)
    imp = collect_block_importance(linear, xs, linear_fit_every=1)
    weight, bias = linear_fit(imp, bias=True)
    torch.testing.assert_close(weight.float(), W, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(bias.float(), b, rtol=1e-3, atol=1e-3)
    # Attention without statistics: W_o @ (V expanded to the query heads).
    block = parent(AttentionSpec(4, 2, 6))
    child = init_child(block, AttentionSpec(4, 2, 6), LinearSpec(), None)
    v = block.v_proj.weight.view(2, 6, H).repeat_interleave(2, dim=0).reshape(24, H)
    torch.testing.assert_close(child.linear.weight, block.o_proj.weight @ v)
    mlp = parent(MLPSpec(20))
    child = init_child(mlp, MLPSpec(20), LinearSpec(), None)
    torch.testing.assert_close(child.linear.weight, mlp.down_proj.weight @ mlp.up_proj.weight)


def test_noop_child_has_no_weights_and_returns_zeros():
    child = init_child(parent(MAMBA), MAMBA, NoOpSpec(), None)
    assert not list(child.parameters())
    assert torch.equal(child(X), torch.zeros_like(X))


@pytest.mark.parametrize(
    ("spec", "child", "axis"),
    [
        (MAMBA, MambaSpec(6, 4, 16, n_groups=2, chunk_size=8), "state_size"),
        (MAMBA, MambaSpec(8, 4, 8, n_groups=2, chunk_size=8), "num_heads"),
        (MAMBA, MambaSpec(6, 8, 8, n_groups=2, chunk_size=8), "head_dim"),
        (MAMBA, MambaSpec(6, 4, 8, n_groups=3, chunk_size=8), "n_groups"),
        (MOE, MoESpec(8, 2, 10, shared_width=12, latent_size=16), "num_experts"),
        (MOE, MoESpec(6, 2, 11, shared_width=12, latent_size=16), "expert_width[0]"),
        (MOE, MoESpec(6, 2, 10, shared_width=13, latent_size=16), "shared_width"),
        (MOE, MoESpec(6, 2, 10, shared_width=12), "latent_size"),
        (
            MOE,
            MoESpec(6, 2, 10, shared_width=12, latent_size=16, routed_scaling_factor=2.0),
            "routed_scaling_factor",
        ),
        (ATTENTION, AttentionSpec(8, 4, 8, bias=True), "head_dim"),
        (ATTENTION, AttentionSpec(16, 4, 6, bias=True), "num_heads"),
        (MLP, MLPSpec(21, bias=True), "width"),
        (MLP, MLPSpec(10, activation="silu", bias=True), "activation"),
        (MLP, MambaSpec(6, 4, 8, n_groups=2), "kind"),
        (MAMBA, MLPSpec(10), "kind"),
    ],
)
def test_non_derivable_child_names_the_axis(spec, child, axis):
    block = parent(spec)
    with pytest.raises(SpecError, match=axis.replace("[", r"\[").replace("]", r"\]")):
        init_child(block, spec, child, None)


def test_missing_importance_is_a_clear_error():
    with pytest.raises(ValueError, match="state_size"):
        init_child(parent(MAMBA), MAMBA, MambaSpec(6, 4, 4, n_groups=2, chunk_size=8), None)
    with pytest.raises(ValueError, match="least-squares"):
        init_child(parent(MOE), MOE, LinearSpec(), None)
    with pytest.raises(ValueError, match="measured on a mlp block"):
        init_child(
            parent(MAMBA), MAMBA, MambaSpec(6, 4, 4, n_groups=2, chunk_size=8), scores("mlp", state=(2, 8))
        )


def test_moe_latent_pca_is_exact_when_the_latent_spaces_have_low_rank():
    """fc1 and fc2 of rank 6: a 6-dim child latent loses nothing when init projects onto the principal directions."""
    block = parent(MOE)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        block.fc1_latent_proj.weight.copy_(
            torch.randn(16, 6, generator=generator) @ torch.randn(6, H, generator=generator)
        )
        block.fc2_latent_proj.weight.copy_(
            torch.randn(H, 6, generator=generator) @ torch.randn(6, 16, generator=generator)
        )
    calibration = torch.randn(
        4, 16, H, generator=generator
    )  # second moments from every 4th token: 16 of them
    imp = collect_block_importance(block, [calibration], linear_fit=False)
    child = init_child(block, MOE, MoESpec(6, 2, 10, shared_width=12, latent_size=6), imp)
    assert child.fc1_latent_proj.weight.shape == (6, H) and child.experts.up_weight(0).shape == (10, 6)
    # The PCA bases come from fp32 second moments and relu^2 of these random weights gives outputs up to
    # ~3e5: relative errors of ~1e-4 (2e-5 even in fp64) are rounding; selecting latent dims instead of
    # projecting is off by ~50%.
    with torch.no_grad():
        torch.testing.assert_close(child(X), block(X), rtol=1e-3, atol=1e-3)


def test_expert_widths_by_importance_spreads_a_budget_by_global_rank():
    imp = BlockImportance(
        "moe",
        {
            "expert_channel.0": torch.tensor([9.0, 8.0, 7.0, 6.0]),
            "expert_channel.1": torch.tensor([0.1, 0.2, 0.3, 0.4]),
            "expert_channel.2": torch.tensor([5.0, 0.0, 4.5, 0.0]),
        },
        10,
    )
    assert expert_widths_by_importance(imp, [0, 1, 2], total_width=6, min_width=1) == (4, 1, 1)
    assert expert_widths_by_importance(imp, [2, 0], total_width=5, min_width=2) == (2, 3)
    assert expert_widths_by_importance(imp, [0, 1, 2], total_width=12) == (4, 4, 4)
    with pytest.raises(SpecError, match="expert_width"):
        expert_widths_by_importance(imp, [0, 1], total_width=9)


def test_children_keep_the_parents_dtypes():
    """A bf16 parent gives a bf16 child (the router's correction bias stays fp32), for slices and rescales."""
    for spec, child_spec in (
        (MAMBA, MambaSpec(4, 2, 5, n_groups=2, chunk_size=8)),
        (MOE, MoESpec(3, 2, 5, shared_width=6, latent_size=8)),
    ):
        block = parent(spec).to(torch.bfloat16)
        imp = collect_block_importance(block, [X.to(torch.bfloat16)], linear_fit=False)
        child = init_child(block, spec, child_spec, imp)
        dtypes = {name: t.dtype for name, t in block.state_dict().items()}
        for name, tensor in child.state_dict().items():
            assert tensor.dtype == dtypes[name], name
    assert child.gate.e_score_correction_bias.dtype == torch.float32
    assert init_child(block, MOE, MOE, None).gate.weight.dtype == torch.float32  # the router stays fp32


def test_latent_dims_without_second_moments_keep_the_parents_dtypes():
    """Latent pruning by the `latent` score alone (no PCA moments) leaves no fp32 tensor in a bf16 child."""
    block = parent(MOE).to(torch.bfloat16)
    imp = collect_block_importance(block, [X.to(torch.bfloat16)], linear_fit=False)
    imp = BlockImportance("moe", {k: v for k, v in imp.scores.items() if not k.endswith("_cov")}, imp.tokens)
    child = init_child(block, MOE, MoESpec(6, 2, 10, shared_width=12, latent_size=8), imp)
    dtypes = {name: t.dtype for name, t in block.state_dict().items()}
    for name, tensor in child.state_dict().items():
        assert tensor.dtype == dtypes[name], name
