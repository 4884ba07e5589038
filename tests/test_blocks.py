"""Attention, MoE, MLP, Linear and NoOp mixers against transformers' NemotronH modules and brute force."""

from __future__ import annotations

import copy as copy_module
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply_rotary
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHAttention, NemotronHMLP, NemotronHMoE

from puzzle.blocks import BLOCK_TYPES, build_block
from puzzle.blocks import moe as moe_module
from puzzle.blocks.attention import AttentionMixer, KVCache, apply_rope
from puzzle.blocks.mamba import MambaMixer
from puzzle.blocks.mlp import LinearMixer, MLPMixer, NoOpMixer
from puzzle.blocks.moe import ExpertBank, MoEMixer, allocate_banks, module_hub_state
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

ATOL = 1e-5


def nemotron_config(hidden_size: int, **overrides) -> NemotronHConfig:
    """A tiny NemotronHConfig; only the fields the mixer under test reads matter."""
    fields = dict(
        vocab_size=64,
        hidden_size=hidden_size,
        layers_block_type=["moe"],
        mlp_hidden_act="relu2",
        mamba_num_heads=2,
        mamba_head_dim=4,
        n_groups=1,
        ssm_state_size=4,
    )
    fields.update(overrides)
    config = NemotronHConfig(**fields)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def randomize_(module: torch.nn.Module, generator: torch.Generator, scale: float = 0.3) -> None:
    """Fill every parameter with N(0, scale^2) (transformers leaves some as torch.empty)."""
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)


def hf_moe_to_ours(state: dict[str, torch.Tensor], has_shared: bool) -> dict[str, torch.Tensor]:
    """transformers' in-memory MoE keys (experts fused into [E, I, L] / [E, L, I]) -> our bank keys."""
    out = {}
    for key, value in state.items():
        if key == "experts.up_proj":
            out["experts.up"] = ExpertBank.state_from_hub(list(value), list(state["experts.down_proj"]))["up"]
        elif key == "experts.down_proj":
            out["experts.down"] = ExpertBank.state_from_hub(list(state["experts.up_proj"]), list(value))[
                "down"
            ]
        elif key.startswith("shared_experts.") and not has_shared:
            continue
        else:
            out[key] = value
    return out


def causal_additive_mask(t: int) -> torch.Tensor:
    """[1, 1, t, t] mask for eager attention: 0 on and below the diagonal, -inf above."""
    return torch.full((t, t), float("-inf")).triu(1)[None, None]


# ----------------------------------------------------------------------------------------- MoE


MOE_CASES = {
    "plain-shared-norm": dict(
        spec=MoESpec(num_experts=8, top_k=2, expert_width=12, shared_width=10, routed_scaling_factor=2.5),
        hidden=16,
    ),
    "latent-groups-unnormed": dict(
        spec=MoESpec(
            num_experts=16,
            top_k=3,
            expert_width=6,
            shared_width=8,
            latent_size=8,
            routed_scaling_factor=1.7,
            norm_topk_prob=False,
            n_group=4,
            topk_group=2,
        ),
        hidden=20,
    ),
    "latent-no-shared-groups-normed": dict(
        spec=MoESpec(
            num_experts=12,
            top_k=4,
            expert_width=5,
            latent_size=6,
            routed_scaling_factor=5.0,
            n_group=3,
            topk_group=2,
        ),
        hidden=12,
    ),
    "plain-no-shared-unnormed": dict(
        spec=MoESpec(num_experts=6, top_k=1, expert_width=7, norm_topk_prob=False), hidden=10
    ),
}


def hf_moe_for(spec: MoESpec, hidden: int, seed: int) -> NemotronHMoE:
    config = nemotron_config(
        hidden,
        n_routed_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        moe_intermediate_size=spec.widths[0],
        # transformers always builds a shared expert; width 1 with zeroed weights stands for "none".
        moe_shared_expert_intermediate_size=spec.shared_width or 1,
        moe_latent_size=spec.latent_size,
        routed_scaling_factor=spec.routed_scaling_factor,
        norm_topk_prob=spec.norm_topk_prob,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
    )
    hf = NemotronHMoE(config).eval()
    generator = torch.Generator().manual_seed(seed)
    randomize_(hf, generator)
    with torch.no_grad():
        # Biases of the size of the score spread, so that they change which experts are chosen.
        hf.gate.e_score_correction_bias.copy_(torch.randn(spec.num_experts, generator=generator) * 0.3)
        if not spec.shared_width:
            hf.shared_experts.down_proj.weight.zero_()
    return hf


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_matches_transformers(case):
    spec, hidden = MOE_CASES[case]["spec"], MOE_CASES[case]["hidden"]
    hf = hf_moe_for(spec, hidden, seed=1)
    ours = MoEMixer(spec, hidden).eval()
    ours.load_state_dict(hf_moe_to_ours(hf.state_dict(), spec.shared_width > 0), strict=True)

    x = torch.randn(3, 7, hidden, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(x)
        got = ours(x)
        # The biases must matter for this to test anything: selection without them differs.
        _, chosen = ours.gate(x.reshape(-1, hidden))
        bias = ours.gate.e_score_correction_bias.clone()
        ours.gate.e_score_correction_bias.zero_()
        _, unbiased = ours.gate(x.reshape(-1, hidden))
        ours.gate.e_score_correction_bias.copy_(bias)
    assert not torch.equal(chosen.sort(dim=-1).values, unbiased.sort(dim=-1).values)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)
    assert got.abs().max() > 0.1  # not trivially zero


def test_moe_gradients_match_transformers():
    spec, hidden = MOE_CASES["latent-groups-unnormed"]["spec"], MOE_CASES["latent-groups-unnormed"]["hidden"]
    hf = hf_moe_for(spec, hidden, seed=12)
    ours = MoEMixer(spec, hidden)
    ours.load_state_dict(hf_moe_to_ours(hf.state_dict(), True))
    x = torch.randn(2, 6, hidden, generator=torch.Generator().manual_seed(13))
    target = torch.randn(2, 6, hidden, generator=torch.Generator().manual_seed(14))
    (hf(x) * target).sum().backward()
    (ours(x) * target).sum().backward()
    hf_grads = hf_moe_to_ours({name: p.grad for name, p in hf.named_parameters()}, True)
    our_grads = {name: p.grad for name, p in ours.named_parameters()}
    assert set(our_grads) == set(hf_grads)
    assert our_grads["gate.weight"].abs().max() > 0  # the router is trained through the weights
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, hf_grads[name], atol=ATOL, rtol=1e-4, msg=name)


def test_moe_top1_normalised_router_gets_no_gradient_and_routes_as_transformers():
    """w / w = 1 for one expert: transformers' computed router gradient is rounding noise (Adam turns it into
    full-size random steps, which made BLD's 1- and 2-rank libraries differ by 4e-3); ours is exactly none."""
    spec = MoESpec(num_experts=4, top_k=1, expert_width=8, shared_width=8, norm_topk_prob=True)
    hidden = 16
    hf = hf_moe_for(spec, hidden, seed=5)
    ours = MoEMixer(spec, hidden)
    ours.load_state_dict(hf_moe_to_ours(hf.state_dict(), True))
    x = torch.randn(2, 32, hidden, generator=torch.Generator().manual_seed(6))
    target = torch.randn(2, 32, hidden, generator=torch.Generator().manual_seed(7))
    (hf(x) * target).sum().backward()
    got = ours(x)
    (got * target).sum().backward()
    torch.testing.assert_close(got, hf(x), atol=ATOL, rtol=1e-5)
    hf_router = hf.gate.weight.grad.abs().max()
    experts = ours.experts.up.grad.abs().max()
    assert 0 < hf_router < 1e-5 * experts  # what Adam would amplify: noise, not signal
    assert ours.gate.weight.grad is None
    two = dataclasses.replace(spec, top_k=2)
    mixer = MoEMixer(two, hidden)
    mixer(x).pow(2).sum().backward()
    assert mixer.gate.weight.grad.abs().max() > 1e-3  # with two experts the router does learn


def test_training_backward_makes_each_bank_and_projection_gradient_once():
    """The training loop takes each expert's rows by one split of the bank, Mamba its z | xBC | dt by one
    split of in_proj's output: the backward makes one gradient of each (a slice per part made a zero tensor
    of the whole per part, E of each bank, and summed them)."""
    from fresh_helpers import FreshTensors

    hidden = 16
    moe = MoEMixer(MoESpec(num_experts=8, top_k=2, expert_width=12, latent_size=8), hidden)
    x = torch.randn(2, 16, hidden, generator=torch.Generator().manual_seed(3))
    loss = moe(x).square().sum()
    bank = tuple(moe.experts.up.shape)
    with FreshTensors(moe.experts.up.untyped_storage().nbytes()) as fresh:
        loss.backward()
    assert fresh.shapes(bank) == 2, fresh.found  # one gradient of up, one of down
    mamba = MambaMixer(MambaSpec(num_heads=4, head_dim=4, state_size=8, n_groups=2, chunk_size=8), hidden)
    loss = mamba(x).square().sum()
    projected = (2, 16, mamba.spec.in_proj_dim)
    with FreshTensors(1) as fresh:
        loss.backward()
    assert fresh.shapes(projected) == 1, fresh.found


def test_moe_moves_from_meta_with_to_empty():
    with torch.device("meta"):
        mixer = MoEMixer(MoESpec(4, 2, 8, latent_size=4), 8)
    mixer.to_empty(device="cpu")
    assert mixer.gate.e_score_correction_bias.device.type == "cpu"
    assert mixer.gate.e_score_correction_bias.dtype == torch.float32


def test_moe_router_matches_transformers_weights_and_indices():
    spec, hidden = MOE_CASES["latent-groups-unnormed"]["spec"], MOE_CASES["latent-groups-unnormed"]["hidden"]
    hf = hf_moe_for(spec, hidden, seed=3)
    ours = MoEMixer(spec, hidden)
    ours.load_state_dict(hf_moe_to_ours(hf.state_dict(), True))
    x = torch.randn(40, hidden, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, hf_weights, hf_indices = hf.gate(x)
        weights, indices = ours.gate(x)
    hf_order, order = hf_indices.argsort(dim=-1), indices.argsort(dim=-1)
    assert torch.equal(indices.gather(1, order), hf_indices.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), atol=1e-6, rtol=1e-6)
    # Group-limited: every token's experts come from at most topk_group groups.
    group_size = spec.num_experts // spec.n_group
    assert max(len(set((indices[n] // group_size).tolist())) for n in range(len(x))) <= spec.topk_group


def reference_moe(mixer: MoEMixer, x: torch.Tensor) -> torch.Tensor:
    """The MoE written out token by token and expert by expert from the mixer's weights (brute force)."""
    spec = mixer.spec
    state = {key: value.double() for key, value in module_hub_state(mixer).items()}
    group_size = spec.num_experts // spec.n_group
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n, token in enumerate(x.double()):
        scores = [
            1 / (1 + math.exp(-float(state["gate.weight"][e] @ token))) for e in range(spec.num_experts)
        ]
        biased = [s + float(b) for s, b in zip(scores, state["gate.e_score_correction_bias"])]
        group_score = [
            sum(sorted(biased[g * group_size : (g + 1) * group_size], reverse=True)[:2])
            for g in range(spec.n_group)
        ]
        groups = sorted(range(spec.n_group), key=lambda g: -group_score[g])[: spec.topk_group]
        eligible = [e for e in range(spec.num_experts) if e // group_size in groups]
        chosen = sorted(eligible, key=lambda e: -biased[e])[: spec.top_k]
        total = sum(scores[e] for e in chosen) if spec.norm_topk_prob else 1.0
        h = state["fc1_latent_proj.weight"] @ token if spec.latent_size else token
        routed = torch.zeros_like(h)
        for e in chosen:
            hidden = torch.relu(state[f"experts.{e}.up_proj.weight"] @ h) ** 2
            routed += (
                scores[e]
                / total
                * spec.routed_scaling_factor
                * (state[f"experts.{e}.down_proj.weight"] @ hidden)
            )
        if spec.latent_size:
            routed = state["fc2_latent_proj.weight"] @ routed
        if spec.shared_width:
            shared_hidden = torch.relu(state["shared_experts.up_proj.weight"] @ token) ** 2
            routed += state["shared_experts.down_proj.weight"] @ shared_hidden
        out[n] = routed
    return out


@pytest.mark.parametrize("latent", [None, 6])
def test_moe_heterogeneous_widths_match_brute_force(latent):
    widths = (3, 9, 1, 6, 4, 12, 2, 5)
    spec = MoESpec(
        num_experts=8,
        top_k=3,
        expert_width=widths,
        shared_width=4,
        latent_size=latent,
        routed_scaling_factor=2.0,
        n_group=2,
        topk_group=1,
    )
    hidden = 10
    torch.manual_seed(5)
    mixer = MoEMixer(spec, hidden)
    with torch.no_grad():
        mixer.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.2)
    for j, width in enumerate(widths):
        assert mixer.experts.up_weight(j).shape == (latent or hidden, width)[::-1]
        assert mixer.experts.down_weight(j).shape == (latent or hidden, width)
    x = torch.randn(2, 9, hidden)
    with torch.no_grad():
        got = mixer(x)
    expected = reference_moe(mixer, x.reshape(-1, hidden)).reshape(x.shape).float()
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)


def test_moe_dispatch_runs_only_experts_with_tokens():
    spec = MoESpec(num_experts=8, top_k=1, expert_width=4)
    mixer = MoEMixer(spec, 6)
    with torch.no_grad():
        mixer.gate.weight.zero_()  # all scores equal: the bias alone decides
        mixer.gate.e_score_correction_bias.copy_(torch.arange(8.0) == 5)
    calls = []
    mixer.experts.register_observer(lambda j, x, a, y, w: calls.append((j, x.shape[0], a.shape, y.shape)))
    mixer(torch.randn(2, 3, 6))
    assert calls == [(5, 6, (6, 4), (6, 6))]
    mixer.experts.path = "grouped"  # observers still see expert by expert
    mixer(torch.randn(2, 3, 6))
    assert calls[1:] == [(5, 6, (6, 4), (6, 6))]


def test_moe_router_and_bias_stay_fp32_in_bf16():
    spec = MoESpec(
        num_experts=8, top_k=2, expert_width=8, shared_width=4, latent_size=4, routed_scaling_factor=2.5
    )
    torch.manual_seed(6)
    mixer = MoEMixer(spec, 16)
    with torch.no_grad():
        mixer.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3 + 1e-4)
    bias = mixer.gate.e_score_correction_bias.clone()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = mixer(x)
        mixer.to(torch.bfloat16)
        got = mixer(x.bfloat16())
    assert mixer.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(mixer.gate.e_score_correction_bias, bias)
    assert "gate.e_score_correction_bias" in mixer.state_dict()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.05)


def test_moe_is_stateless():
    spec = MoESpec(num_experts=4, top_k=2, expert_width=4)
    mixer = MoEMixer(spec, 8)
    x = torch.randn(3, 1, 8)
    assert mixer.init_cache(3) is None
    torch.testing.assert_close(mixer.step(x, None), mixer(x))


# A shape the grouped matmuls accept (rows of 16 bytes and more), with experts that get no tokens.
GROUPED_SPEC = MoESpec(num_experts=16, top_k=2, expert_width=8, shared_width=8, latent_size=16, n_group=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_grouped_path_equals_the_loop_and_transformers(dtype):
    hidden = 16
    hf = hf_moe_for(GROUPED_SPEC, hidden, seed=21)
    ours = MoEMixer(GROUPED_SPEC, hidden).eval()
    ours.load_state_dict(hf_moe_to_ours(hf.state_dict(), True))
    hf.to(dtype)
    ours.to(dtype)
    x = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(22)).to(dtype)
    assert ours.experts.grouped_runs(torch.zeros(10, 16, dtype=dtype))
    assert not ours.experts.uses_grouped(torch.zeros(10, 16, dtype=dtype))  # auto: the loop on the CPU
    outputs = {}
    with torch.no_grad():
        _, indices = ours.gate(x.reshape(-1, hidden))
        assert len(set(indices.reshape(-1).tolist())) < GROUPED_SPEC.num_experts  # some experts idle
        for path in ("loop", "grouped"):
            ours.experts.path = path
            outputs[path] = ours(x)
        expected = hf(x)
    # The same products (torch's CPU grouped_mm loops over the groups in C++), summed in another order that
    # two slots cannot show: a + b == b + a in floating point.
    torch.testing.assert_close(outputs["grouped"], outputs["loop"], atol=0, rtol=0)
    tolerance = dict(atol=ATOL, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
    torch.testing.assert_close(outputs["grouped"], expected, **tolerance)


def test_moe_grouped_path_gradients_equal_the_loop():
    hidden = 16
    torch.manual_seed(23)
    mixer = MoEMixer(GROUPED_SPEC, hidden)
    x = torch.randn(3, 4, hidden)
    target = torch.randn(3, 4, hidden)
    grads = {}
    for path in ("loop", "grouped"):
        mixer.zero_grad()
        mixer.experts.path = path
        (mixer(x) * target).sum().backward()
        grads[path] = {name: p.grad.clone() for name, p in mixer.named_parameters()}
    assert grads["loop"]["experts.up"].abs().max() > 0
    for name, grad in grads["loop"].items():
        torch.testing.assert_close(grads["grouped"][name], grad, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("widths", [8, (8, 3, 5, 8, 1, 6, 2, 7, 8, 4, 4, 4, 9, 8, 8, 8)])
def test_moe_decode_pairs_one_by_one_equal_the_loop(widths):
    spec = dataclasses.replace(GROUPED_SPEC, expert_width=widths)
    torch.manual_seed(25)
    mixer = MoEMixer(spec, 16)
    x = torch.randn(3, 1, 16, requires_grad=True)  # 6 (token, slot) pairs for 16 experts: one by one
    results = {}
    for path in ("auto", "loop"):
        mixer.zero_grad()
        x.grad = None
        mixer.experts.path = path
        out = mixer(x)
        out.square().sum().backward()
        results[path] = (out.detach(), x.grad.clone(), mixer.experts.down.grad.clone())
    for got, expected in zip(results["auto"], results["loop"]):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert results["loop"][2].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths", [8, (8, 3, 5, 8, 1, 6, 2, 7, 8, 4, 4, 4, 9, 8, 8, 8)])
def test_moe_chunked_loop_equals_the_loop_under_autograd(widths, dtype, monkeypatch):
    """Without autograd the loop runs chunks of experts (batched gathers, activations and scatters): the same
    products summed in the same order as expert by expert under autograd, bit for bit, observers included."""
    monkeypatch.setattr(moe_module, "_CHUNK_ROWS", 5)  # several chunks, some of one expert, at this size
    monkeypatch.setattr(moe_module, "_PREFETCH_ROWS", 2)
    spec = dataclasses.replace(GROUPED_SPEC, expert_width=widths, top_k=3)
    torch.manual_seed(26)
    mixer = MoEMixer(spec, 16).to(dtype)
    mixer.experts.path = "loop"
    x = torch.randn(2, 7, 16).to(dtype)
    results = {}
    for tracked in (True, False):
        calls = []
        handle = mixer.experts.register_observer(
            lambda j, *tensors, calls=calls: calls.append((j, [t.detach().clone() for t in tensors]))
        )
        with torch.set_grad_enabled(tracked):
            out = mixer(x)
        handle.remove()
        results[tracked] = (out.detach(), calls)
    (out, calls), (expected_out, expected_calls) = results[False], results[True]
    assert torch.equal(out, expected_out)
    assert [j for j, _ in calls] == [j for j, _ in expected_calls] == sorted(j for j, _ in calls)
    assert len(calls) > 7  # most of the 16 experts receive some of the 14 x 3 pairs
    for (_, got), (_, expected) in zip(calls, expected_calls):
        for got_tensor, expected_tensor in zip(got, expected, strict=True):
            assert torch.equal(got_tensor, expected_tensor)


def test_expert_bank_views_follow_the_bank_tensors():
    """The loops without autograd reuse per-expert views of the bank: new tensors must not be missed."""
    torch.manual_seed(28)
    mixer = MoEMixer(GROUPED_SPEC, 16)
    x = torch.randn(2, 5, 16)

    def both():
        with torch.no_grad():
            fast = mixer(x)
        return fast, mixer(x).detach()  # under autograd: no cached views

    fast, expected = both()
    torch.testing.assert_close(fast, expected, atol=0, rtol=0)
    mixer.experts.up.data = mixer.experts.up.data * 2  # new memory, no module call
    fast, expected = both()
    torch.testing.assert_close(fast, expected, atol=0, rtol=0)
    mixer.double()
    x = x.double()
    fast, expected = both()
    assert fast.dtype == torch.float64
    torch.testing.assert_close(fast, expected, atol=0, rtol=0)
    copy = copy_module.deepcopy(mixer)
    assert copy.experts._views is None
    with torch.no_grad():
        torch.testing.assert_close(copy(x), expected, atol=0, rtol=0)


def test_moe_decode_pairs_one_by_one_without_autograd_equal_the_loop():
    torch.manual_seed(27)
    mixer = MoEMixer(dataclasses.replace(GROUPED_SPEC, expert_width=(8, 3, 5, 8) * 4, top_k=3), 16)
    x = torch.randn(3, 1, 16)  # 9 (token, slot) pairs for 16 experts: one by one, added by addmm_
    outputs = {}
    with torch.no_grad():
        for path in ("auto", "loop"):
            mixer.experts.path = path
            outputs[path] = mixer(x)
    torch.testing.assert_close(outputs["auto"], outputs["loop"], atol=1e-6, rtol=1e-6)
    assert outputs["loop"].abs().max() > 0.1


def test_expert_bank_picks_the_loop_where_grouped_cannot_run():
    uniform, mixed = ExpertBank(16, (8,) * 4), ExpertBank(16, (8, 4, 8, 8))
    pairs = torch.empty(8, 16)
    assert uniform.grouped_runs(pairs) and ExpertBank(16, (8,) * 4).bfloat16().grouped_runs(pairs.bfloat16())
    assert not uniform.grouped_runs(pairs.bfloat16())  # inputs in another dtype than the bank
    assert not uniform.uses_grouped(pairs)  # on the CPU auto runs the loop, faster there
    assert not uniform.grouped_runs(pairs.double())
    assert not ExpertBank(16, (6,) * 4).grouped_runs(pairs)  # rows of 24 bytes
    assert not mixed.grouped_runs(pairs)
    handle = uniform.register_observer(lambda *args: None)
    assert not uniform.grouped_runs(pairs)  # observers see expert by expert
    handle.remove()
    assert uniform.grouped_runs(pairs)
    mixed.path = "grouped"
    with pytest.raises(ValueError, match=r"one width for all experts.*widths \[4, 8\]"):
        mixed(pairs, torch.ones(8, 1), torch.zeros(8, 1, dtype=torch.long))
    uniform.path = "fast"
    with pytest.raises(ValueError, match="'auto', 'loop' or 'grouped', found 'fast'"):
        uniform(pairs, torch.ones(8, 1), torch.zeros(8, 1, dtype=torch.long))


def test_hub_tensors_are_views_of_the_bank_and_load_back():
    spec = MoESpec(3, 2, (4, 6, 5), latent_size=8)
    torch.manual_seed(24)
    mixer = MoEMixer(spec, 16)
    hub = module_hub_state(mixer)
    up = [hub[f"experts.{j}.up_proj.weight"] for j in range(3)]
    down = [hub[f"experts.{j}.down_proj.weight"] for j in range(3)]
    assert torch.equal(up[1], mixer.experts.up[4:10]) and torch.equal(down[2], mixer.experts.down[10:15].T)
    x = torch.randn(7, 8)
    torch.testing.assert_close(mixer.experts.expert(1, x), torch.relu(x @ up[1].T) ** 2 @ down[1].T)
    assert ExpertBank.state_from_hub(up, down).keys() == {"up", "down"}
    assert torch.equal(ExpertBank.state_from_hub(up, down)["down"], mixer.experts.down)
    # Loading: a meta mixer's banks become real tensors, filled through the hub views.
    with torch.device("meta"):
        fresh = MoEMixer(spec, 16)
    views = allocate_banks(fresh, torch.bfloat16, "cpu")
    assert set(views) == {key for key in hub if key.startswith("experts.")}
    for key, view in views.items():
        view.copy_(hub[key])
    assert fresh.experts.up.dtype == torch.bfloat16 and not fresh.experts.up.is_meta
    assert torch.equal(fresh.experts.down, mixer.experts.down.bfloat16())


# ----------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_attention_matches_transformers(num_kv_heads):
    hidden, heads, head_dim = 24, 4, 10  # head_dim != hidden / heads
    config = nemotron_config(
        hidden,
        layers_block_type=["attention"],
        num_attention_heads=heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
    )
    hf = NemotronHAttention(config, layer_idx=0).eval()
    randomize_(hf, torch.Generator().manual_seed(7))
    ours = AttentionMixer(AttentionSpec(heads, num_kv_heads, head_dim), hidden)
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(2, 9, hidden, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected, _ = hf(x, attention_mask=causal_additive_mask(9))
        got = ours(x)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)


ATTENTION_SPECS = {
    "nope-gqa1": AttentionSpec(4, 1, 8),
    "nope-gqa2-bias": AttentionSpec(4, 2, 6, bias=True),
    "rope-partial": AttentionSpec(4, 2, 8, rope_theta=10_000.0, rotary_fraction=0.5),
    "rope-full": AttentionSpec(2, 2, 8, rope_theta=500.0),
}


@pytest.mark.parametrize("name", sorted(ATTENTION_SPECS))
def test_attention_prefill_chunks_and_decode_equal_full_forward(name):
    torch.manual_seed(9)
    mixer = AttentionMixer(ATTENTION_SPECS[name], 16)
    x = torch.randn(2, 11, 16)
    with torch.no_grad():
        full = mixer(x)
        cache = mixer.init_cache(2)
        pieces = [mixer(x[:, :4], cache), mixer(x[:, 4:7], cache)]  # prefill, then a chunk after a prefix
        pieces += [mixer.step(x[:, t : t + 1], cache) for t in range(7, 11)]
    assert cache.length == 11 and cache.capacity >= 11
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=ATOL, rtol=1e-5)


def test_attention_is_causal_and_rope_changes_output():
    torch.manual_seed(10)
    nope = AttentionMixer(AttentionSpec(2, 1, 8), 16)
    rope = AttentionMixer(AttentionSpec(2, 1, 8, rope_theta=100.0), 16)
    rope.load_state_dict(nope.state_dict())
    x = torch.randn(1, 6, 16)
    y = torch.randn(1, 6, 16)
    y[:, :3] = x[:, :3]
    with torch.no_grad():
        torch.testing.assert_close(nope(x)[:, :3], nope(y)[:, :3])  # the future does not leak back
        assert not torch.allclose(nope(x), nope(y))
        torch.testing.assert_close(
            nope(x)[:, :1], rope(x)[:, :1], atol=ATOL, rtol=1e-5
        )  # position 0: no rotation
        assert not torch.allclose(nope(x)[:, 1:], rope(x)[:, 1:], atol=1e-3)


def test_rope_matches_gpt_neox_partial_rotary():
    head_dim, fraction, theta, offset = 12, 0.5, 1000.0, 5
    rot = int(head_dim * fraction)
    q = torch.randn(2, 3, 4, head_dim)
    k = torch.randn(2, 3, 4, head_dim)
    positions = torch.arange(offset, offset + 4)
    # Independent oracle: the textbook frequencies and transformers' GPT-NeoX partial rotary application.
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2).float() / rot)
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    expected_q, expected_k = neox_apply_rotary(q, k, emb.cos(), emb.sin())
    torch.testing.assert_close(apply_rope(q, positions, theta, rot), expected_q)
    torch.testing.assert_close(apply_rope(k, positions, theta, rot), expected_k)


def test_attention_cache_grows_and_preallocates():
    mixer = AttentionMixer(AttentionSpec(2, 1, 4), 8)
    cache = mixer.init_cache(3, max_length=16)
    assert isinstance(cache, KVCache) and cache.key.shape == (3, 1, 16, 4) and cache.length == 0
    grown = mixer.init_cache(3)
    assert grown.capacity == 0
    with torch.no_grad():
        mixer(torch.randn(3, 5, 8), grown)
        mixer.step(torch.randn(3, 1, 8), grown)
    assert grown.length == 6 and grown.capacity == 10  # doubled from 5
    with pytest.raises(ValueError, match="KV cache holds"):
        mixer(torch.randn(2, 1, 8), grown)


def test_attention_rejects_odd_rotary_channels():
    with pytest.raises(SpecError, match="rotary"):
        AttentionMixer(AttentionSpec(2, 1, 6, rope_theta=1e4, rotary_fraction=0.5), 8)


# ------------------------------------------------------------------------------ MLP, Linear, NoOp


@pytest.mark.parametrize("activation", MLPSpec.ACTIVATIONS)
def test_mlp_matches_transformers(activation):
    config = nemotron_config(12, layers_block_type=["mlp"], intermediate_size=20, mlp_hidden_act=activation)
    hf = NemotronHMLP(config).eval()
    randomize_(hf, torch.Generator().manual_seed(11))
    ours = MLPMixer(MLPSpec(20, activation=activation), 12)
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(2, 5, 12)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), atol=ATOL, rtol=1e-5)
    assert ours.init_cache(2) is None
    torch.testing.assert_close(ours.step(x[:, :1], None), ours(x[:, :1]))


def test_linear_and_noop():
    linear = LinearMixer(LinearSpec(), 8)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(linear(x), x @ linear.linear.weight.T)
    noop = NoOpMixer(NoOpSpec(), 8)
    assert list(noop.parameters()) == [] and noop.state_dict() == {}
    assert torch.equal(noop(x), torch.zeros_like(x)) and noop.init_cache(2) is None


# ------------------------------------------------------------------------ registry, names, meta


def test_registry_covers_every_spec_type():
    assert set(BLOCK_TYPES) == set(BLOCK_SPEC_TYPES.values())
    with pytest.raises(SpecError, match="no mixer for a str"):
        build_block("attention", 8)


def shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in module.state_dict().items()}


def test_parameter_names_and_shapes_follow_the_contract():
    H = 16
    moe = build_block(MoESpec(3, 2, (4, 6, 5), shared_width=7, latent_size=8), H)
    common = {
        "gate.weight": (3, H),
        "gate.e_score_correction_bias": (3,),
        "fc1_latent_proj.weight": (8, H),
        "fc2_latent_proj.weight": (H, 8),
        "shared_experts.up_proj.weight": (7, H),
        "shared_experts.down_proj.weight": (H, 7),
    }
    assert shapes(moe) == {"experts.up": (15, 8), "experts.down": (15, 8), **common}
    # The hub's names: one up_proj / down_proj per expert, in place of the bank.
    assert {key: tuple(value.shape) for key, value in module_hub_state(moe).items()} == {
        **{f"experts.{j}.up_proj.weight": (w, 8) for j, w in enumerate((4, 6, 5))},
        **{f"experts.{j}.down_proj.weight": (8, w) for j, w in enumerate((4, 6, 5))},
        **common,
    }
    assert set(module_hub_state(build_block(MoESpec(2, 1, 4), H))) == {
        "gate.weight",
        "gate.e_score_correction_bias",
        "experts.0.up_proj.weight",
        "experts.0.down_proj.weight",
        "experts.1.up_proj.weight",
        "experts.1.down_proj.weight",
    }
    assert shapes(build_block(AttentionSpec(4, 2, 6), H)) == {
        "q_proj.weight": (24, H),
        "k_proj.weight": (12, H),
        "v_proj.weight": (12, H),
        "o_proj.weight": (H, 24),
    }
    assert set(shapes(build_block(AttentionSpec(4, 2, 6, bias=True), H))) == {
        f"{name}_proj.{kind}" for name in "qkvo" for kind in ("weight", "bias")
    }
    assert shapes(build_block(MLPSpec(20), H)) == {"up_proj.weight": (20, H), "down_proj.weight": (H, 20)}
    assert shapes(build_block(LinearSpec(), H)) == {"linear.weight": (H, H)}
    assert shapes(build_block(NoOpSpec(), H)) == {}


def test_every_kind_builds_on_meta_at_120b_scale():
    """Nemotron-3 Super shapes instantiate without memory; counts match the published per-block figures."""
    H = 4096
    specs = {
        "mamba": MambaSpec(num_heads=128, head_dim=64, state_size=128, n_groups=8),
        "attention": AttentionSpec(32, 2, 128),
        "moe": MoESpec(512, 22, 2688, shared_width=5376, latent_size=1024, routed_scaling_factor=5.0),
        "mlp": MLPSpec(21504),
        "linear": LinearSpec(),
        "noop": NoOpSpec(),
    }
    with torch.device("meta"):
        mixers = {kind: build_block(spec, H) for kind, spec in specs.items()}
    for kind, mixer in mixers.items():
        assert mixer.spec == specs[kind]
        assert all(t.is_meta for t in mixer.state_dict().values()), kind
    # Published per-block figures include the block's RMSNorm (H weights) and the router bias.
    state_numel = {
        kind: sum(t.numel() for t in mixer.state_dict().values()) for kind, mixer in mixers.items()
    }
    assert state_numel["attention"] + H == 35_655_680
    assert state_numel["moe"] + H == 2_873_102_848
    assert state_numel["mlp"] == 2 * H * 21504
    assert state_numel["noop"] == 0


def test_build_block_builds_the_registered_class():
    for spec_type, mixer_type in BLOCK_TYPES.items():
        if spec_type is MambaSpec:
            spec = MambaSpec(num_heads=2, head_dim=4, state_size=4)
        elif spec_type is AttentionSpec:
            spec = AttentionSpec(2, 1, 4)
        elif spec_type is MoESpec:
            spec = MoESpec(2, 1, 4)
        elif spec_type is MLPSpec:
            spec = MLPSpec(4)
        else:
            spec = spec_type()
        block = build_block(spec, 8)
        assert type(block) is mixer_type and block.spec is spec
        x = torch.randn(1, 3, 8)
        with torch.no_grad():
            assert block(x).shape == x.shape
            assert block.step(x[:, :1], block.init_cache(1)).shape == (1, 1, 8)


def test_gelu_is_exact():
    mixer = MLPMixer(MLPSpec(4, activation="gelu"), 4)
    x = torch.randn(3, 4)
    torch.testing.assert_close(mixer(x), mixer.down_proj(F.gelu(mixer.up_proj(x), approximate="none")))
