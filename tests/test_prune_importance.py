"""Importance collection: streaming, shapes and contracts, brute-force checks, save / load / reuse."""

from __future__ import annotations

import json

import pytest
import torch
from nemotron_helpers import EVERY_KIND_SPEC as SPEC

from puzzle.blocks import ssd
from puzzle.blocks.mlp import relu2
from puzzle.model import HybridLM
from puzzle.prune.importance import (
    MANIFEST_FILE,
    SCORES_FILE,
    collect_block_importance,
    collect_importance,
    load_importance,
    parent_fingerprint,
    save_importance,
)

EXPECTED_SHAPES = {
    0: {"head": (4,), "channel": (4, 4), "state": (2, 6), "norm_q": (16,)},
    1: {"q_head": (4,), "kv_group": (2,)},
    2: {"expert": (5,), "expert_frequency": (5,), "shared_channel": (8,), "latent": (12,)}
    | {"latent_in_cov": (12, 12), "latent_out_cov": (12, 12)}
    | {f"expert_channel.{j}": (w,) for j, w in enumerate((8, 6, 8, 8, 4))},
    3: {"channel": (12,)},
    4: {},
    5: {},
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return HybridLM(SPEC).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 40, (4, 24), generator=torch.Generator().manual_seed(1))


def test_shapes_and_contract(model, ids):
    importance = collect_importance(model, [ids])
    assert importance.tokens == ids.numel()
    for index, expected in EXPECTED_SHAPES.items():
        block = importance[index]
        assert block.kind == SPEC.blocks[index].kind
        scores = {k: tuple(v.shape) for k, v in block.scores.items() if not k.startswith("lin_")}
        assert scores == expected, index
        for name, value in block.scores.items():
            if name.endswith("_cov"):  # second moments: symmetric PSD
                torch.testing.assert_close(value, value.T)
                assert torch.linalg.eigvalsh(value.double()).min() > -1e-6
            elif not name.startswith("lin_"):
                assert torch.isfinite(value).all() and (value >= 0).all(), (index, name)
        if index != 5:  # a no-op mixer is never called
            assert block.has_linear_fit and block.tokens == ids.numel()
    assert importance[2]["expert_frequency"].sum().item() == pytest.approx(SPEC.blocks[2].top_k)


def test_streaming_equals_one_pass(model, ids):
    whole = collect_importance(model, [ids], linear_fit_every=1)
    halves = collect_importance(model, [ids[:2], ids[2:]], linear_fit_every=1)
    for index, block in whole.blocks.items():
        for name, value in block.scores.items():
            if name.endswith("_cov"):  # second moments of a random 1-in-4 sample of the tokens
                continue
            torch.testing.assert_close(
                halves[index][name], value, rtol=1e-5, atol=1e-6, msg=f"{index} {name}"
            )


def test_mlp_channel_score_is_the_energy_of_each_channel(model, ids):
    mixer = model.layers[3].mixer
    captured = []
    handle = mixer.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    with torch.no_grad():
        model(ids)
    handle.remove()
    x = captured[0].reshape(-1, 16)
    activation = relu2(x @ mixer.up_proj.weight.T)
    # E_t ||a_c down[:, c]||^2: the squared error of zeroing channel c alone.
    expected = (activation[:, :, None] * mixer.down_proj.weight.T[None]).pow(2).sum(-1).mean(0)
    block = collect_block_importance(mixer, [captured[0]])
    torch.testing.assert_close(block["channel"], expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(collect_importance(model, [ids])[3]["channel"], expected, rtol=1e-5, atol=1e-7)


def test_moe_expert_scores_match_a_brute_force_dispatch(model, ids):
    mixer = model.layers[2].mixer
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        block = collect_block_importance(mixer, [x])
        flat = x.reshape(-1, 16)
        weights, indices = mixer.gate(flat)
        latent = mixer.fc1_latent_proj(flat)
        saliency = torch.zeros(5)
        channel = [torch.zeros(w) for w in SPEC.blocks[2].widths]
        for token in range(flat.shape[0]):
            for slot in range(2):
                j, w = int(indices[token, slot]), float(weights[token, slot])
                up, down = mixer.experts.up_weight(j), mixer.experts.down_weight(j)
                a = relu2(up @ latent[token])
                saliency[j] += (w * down @ a).pow(2).sum()
                channel[j] += (w * a[:, None] * down.T).pow(2).sum(-1)
    n = flat.shape[0]
    torch.testing.assert_close(block["expert"], saliency / n, rtol=1e-4, atol=1e-6)
    for j in range(5):
        torch.testing.assert_close(block[f"expert_channel.{j}"], channel[j] / n, rtol=1e-4, atol=1e-6)


def test_never_routed_expert_scores_zero(model):
    mixer = model.layers[2].mixer
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(3))
    bias = mixer.gate.e_score_correction_bias
    saved = bias.clone()
    try:
        bias[3] = -100.0
        block = collect_block_importance(mixer, [x])
    finally:
        bias.copy_(saved)
    assert block["expert"][3] == 0 and block["expert_frequency"][3] == 0
    assert block["expert_channel.3"].abs().sum() == 0
    assert (block["expert"][[0, 1, 2, 4]] > 0).any()


def test_save_load_round_trip(model, ids, tmp_path):
    importance = collect_importance(model, [ids])
    save_importance(importance, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST_FILE, SCORES_FILE]  # no temporaries left
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert manifest["info"]["tokens"] == ids.numel()
    assert manifest["inputs"] == {"parent": parent_fingerprint(model)}
    assert manifest["outputs"] == {SCORES_FILE: (tmp_path / SCORES_FILE).stat().st_size}
    loaded = load_importance(tmp_path)
    assert loaded.tokens == importance.tokens and loaded.parent == importance.parent
    assert loaded.extra == importance.extra == {"linear_fit_every": 8}
    for index, block in importance.blocks.items():
        assert loaded[index].kind == block.kind and loaded[index].scores.keys() == block.scores.keys()
        for name, value in block.scores.items():
            assert torch.equal(loaded[index][name], value)


def test_load_errors_name_the_file(model, ids, tmp_path):
    with pytest.raises(FileNotFoundError, match=MANIFEST_FILE):
        load_importance(tmp_path)
    save_importance(collect_importance(model, [ids], layers=[3]), tmp_path)
    good = json.loads((tmp_path / MANIFEST_FILE).read_text())
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({**good, "format": 99}))
    with pytest.raises(ValueError, match="importance format 99, expected 2"):
        load_importance(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=f"{MANIFEST_FILE} is not valid JSON"):
        load_importance(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({**good, "info": {"tokens": 1}}))
    with pytest.raises(ValueError, match=rf"{MANIFEST_FILE} lacks \['blocks', 'linear_fit'\]"):
        load_importance(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(good))
    (tmp_path / SCORES_FILE).write_bytes(b"")
    with pytest.raises(ValueError, match=f"cannot read importance tensors .*{SCORES_FILE}"):
        load_importance(tmp_path)
    (tmp_path / SCORES_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=SCORES_FILE):
        load_importance(tmp_path)


def test_collection_stops_before_the_head_and_scores_are_those_of_the_full_forward(model, ids):
    """No logits are made (lm_head never runs), and every block's scores equal those measured on the
    inputs that block receives in the model's full forward."""
    block_inputs = {}
    handles = [
        block.mixer.register_forward_pre_hook(lambda m, args, i=i: block_inputs.setdefault(i, args[0]))
        for i, block in enumerate(model.layers)
    ]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    head_calls = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: head_calls.append(out.shape))
    try:
        importance = collect_importance(model, [ids])
        partial = collect_importance(model, [ids], layers=[0, 1])
    finally:
        handle.remove()
    assert head_calls == []
    for index, x in block_inputs.items():  # the no-op block's mixer is never called
        expected = collect_block_importance(model.layers[index].mixer, [x])
        for got in (importance, partial) if index in partial.blocks else (importance,):
            assert got[index].scores.keys() == expected.scores.keys()
            for name, value in expected.scores.items():
                torch.testing.assert_close(got[index][name], value, rtol=0, atol=0, msg=f"{index} {name}")
    # The backbone is the forward without the head.
    with torch.no_grad():
        output = model(ids, output_hidden_states=True)
        torch.testing.assert_close(model.backbone(ids), output.hidden_states[-1], rtol=0, atol=0)
        torch.testing.assert_close(model.backbone(ids, 2), output.hidden_states[2], rtol=0, atol=0)
        torch.testing.assert_close(model.lm_head(model.norm_f(model.backbone(ids))).float(), output.logits)


def test_mamba_state_score_matches_the_formula_on_the_mixers_own_pieces(model, ids):
    """state[g, n] = E[C^2] * sum_h E[dt^2 |x_h|^2 B^2] * min(1 / (1 - E[a^2]), T), built from the mixer's code."""
    mixer = model.layers[
        0
    ].mixer  # 4 heads x 4, 2 groups, state 6: in_proj rows z 16 | x 16 | B 12 | C 12 | dt 4
    x = torch.randn(3, 11, 16, generator=torch.Generator().manual_seed(5))
    block = collect_block_importance(mixer, [x], linear_fit=False)
    with torch.no_grad():
        projected = mixer.in_proj(x)
        xbc, _ = ssd.causal_conv1d(projected[..., 16:56], mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias)
        xbc = torch.nn.functional.silu(xbc)
        xs, B, C = xbc[..., :16].unflatten(-1, (4, 4)), xbc[..., 16:28], xbc[..., 28:40]
        dt = torch.nn.functional.softplus(projected[..., 56:] + mixer.dt_bias)  # [b, t, nh]
        a2 = torch.exp(2 * dt * -torch.exp(mixer.A_log)).reshape(-1, 4).mean(0)
        horizon = (1 / (1 - a2)).clamp(max=11)
        write = (dt.square() * xs.square().sum(-1)).reshape(-1, 4)  # [T, nh]
        B2, C2 = B.square().reshape(-1, 2, 6), C.square().reshape(-1, 2, 6)
        expected = torch.zeros(2, 6)
        for h in range(4):
            g = h // 2
            expected[g] += (write[:, h, None] * B2[:, g]).mean(0) * horizon[h]
        expected *= C2.mean(0)
    torch.testing.assert_close(block["state"], expected, rtol=1e-4, atol=1e-8)


def test_attention_scores_are_the_output_energy_of_each_head_and_group(model):
    mixer = model.layers[1].mixer  # 4 query heads of 4 channels, 2 KV groups
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(6))
    captured = []
    handle = mixer.o_proj.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    block = collect_block_importance(mixer, [x], linear_fit=False)
    handle.remove()
    u, W = captured[0].reshape(-1, 16), mixer.o_proj.weight
    with torch.no_grad():
        for h in range(4):
            energy = (u[:, 4 * h : 4 * h + 4] @ W[:, 4 * h : 4 * h + 4].T).pow(2).sum(-1).mean()
            torch.testing.assert_close(block["q_head"][h], energy, rtol=1e-4, atol=1e-7)
        for g in range(2):
            energy = (u[:, 8 * g : 8 * g + 8] @ W[:, 8 * g : 8 * g + 8].T).pow(2).sum(-1).mean()
            torch.testing.assert_close(block["kv_group"][g], energy, rtol=1e-4, atol=1e-7)


def test_mamba_head_and_channel_scores_are_output_energies(model):
    mixer = model.layers[0].mixer  # 4 heads x 4 channels
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(8))
    captured = []
    handle = mixer.out_proj.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    block = collect_block_importance(mixer, [x], linear_fit=False)
    handle.remove()
    u, W = captured[0].reshape(-1, 16), mixer.out_proj.weight
    with torch.no_grad():
        for h in range(4):
            energy = (u[:, 4 * h : 4 * h + 4] @ W[:, 4 * h : 4 * h + 4].T).pow(2).sum(-1).mean()
            torch.testing.assert_close(block["head"][h], energy, rtol=1e-4, atol=1e-7)
        channel = (u[:, :, None] * W.T[None]).pow(2).sum(-1).mean(0).view(4, 4)
        torch.testing.assert_close(block["channel"], channel, rtol=1e-4, atol=1e-7)
