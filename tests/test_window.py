"""Sliding-window attention (`AttentionSpec.window`) through the tables: the mixer, its cache, costs, the
search, `puzzle costs` and the export, each against an oracle computed here."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from puzzle.blocks import build_block
from puzzle.spec import AttentionSpec, SpecError

H = 16
SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4)


def banded_reference(mixer, x: torch.Tensor, window: int | None) -> torch.Tensor:
    """Attention of x [b, T, H] written out with torch ops: softmax over keys t - W + 1 .. t, masked by hand."""
    spec = mixer.spec
    b, T, _ = x.shape
    q = mixer.q_proj(x).view(b, T, spec.num_heads, spec.head_dim).transpose(1, 2)
    k = mixer.k_proj(x).view(b, T, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    v = mixer.v_proj(x).view(b, T, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    group = spec.num_heads // spec.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(spec.head_dim)
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        first = 0 if window is None else max(0, t - window + 1)
        allowed[t, first : t + 1] = True
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    y = (weights @ v).transpose(1, 2).reshape(b, T, -1)
    return mixer.o_proj(y)


@pytest.mark.parametrize("window", [1, 3, 5, 40])
def test_windowed_mixer_equals_attention_with_a_band_mask(window):
    torch.manual_seed(0)
    mixer = build_block(dataclasses.replace(SPEC, window=window), H).eval()
    x = torch.randn(2, 11, H)
    with torch.no_grad():
        assert torch.allclose(mixer(x), banded_reference(mixer, x, window), atol=1e-5)
        if window < 11:  # the band really cuts: full attention differs
            full = banded_reference(mixer, x, None)
            assert not torch.allclose(mixer(x), full, atol=1e-3)


@pytest.mark.parametrize("window", [1, 3, 4])
@pytest.mark.parametrize("chunks", [[1] * 9, [4, 1, 1, 3], [2, 5, 2]])
def test_incremental_cache_equals_the_full_forward_and_holds_the_window(window, chunks):
    torch.manual_seed(1)
    mixer = build_block(dataclasses.replace(SPEC, window=window, rope_theta=10000.0), H).eval()
    x = torch.randn(2, sum(chunks), H)
    cache = mixer.init_cache(2, max_length=64)
    outputs, start = [], 0
    with torch.no_grad():
        full = mixer(x)
        for size in chunks:
            outputs.append(mixer(x[:, start : start + size], cache))
            start += size
            assert cache.stored <= window - 1 and cache.key.shape[2] <= window - 1  # bounded by the window
    assert cache.length == x.shape[1]
    assert torch.allclose(torch.cat(outputs, dim=1), full, atol=1e-5)


def test_a_window_must_be_a_positive_integer_and_names_itself():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(SpecError, match=r"AttentionSpec\.window"):
            AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4, window=bad)
    assert AttentionSpec(num_heads=32, num_kv_heads=2, head_dim=128, window=4096).short_name() == (
        "attn:q32:kv2:d128:w4096"
    )
    assert SPEC.short_name() == "attn:q4:kv2:d4"  # ids of full attention unchanged
    from puzzle.spec import block_from_dict, block_to_dict

    assert "window" not in block_to_dict(SPEC)  # saved runs' JSON unchanged
    windowed = dataclasses.replace(SPEC, window=7)
    assert block_from_dict(block_to_dict(windowed)) == windowed


def test_child_init_keeps_the_parents_weights_and_refuses_a_wider_window():
    from puzzle.prune.init import init_child

    torch.manual_seed(2)
    parent = build_block(SPEC, H)
    child = init_child(parent, SPEC, dataclasses.replace(SPEC, window=3))
    assert child.spec.window == 3
    for name, tensor in parent.state_dict().items():
        assert torch.equal(child.state_dict()[name], tensor), name
    narrow = dataclasses.replace(SPEC, window=3)
    parent_narrow = build_block(narrow, H)
    for wider in (5, None):
        with pytest.raises(SpecError, match="window"):
            init_child(parent_narrow, narrow, dataclasses.replace(SPEC, window=wider))


# ---------------------------------------------------------------------------------------------------
# Costs, the search and `puzzle costs` at 1M tokens of context.

MILLION = 1_000_000
WINDOW = 4096


def _hybrid(window: int | None = None):
    from puzzle.spec import MambaSpec, MLPSpec, ModelSpec

    attention = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, window=window)
    mamba = MambaSpec(num_heads=4, head_dim=16, state_size=16, n_groups=2)
    return ModelSpec(
        vocab_size=256,
        hidden_size=64,
        blocks=(mamba, attention, MLPSpec(width=128), attention, mamba, attention),
    )


def _kv_bytes_by_hand(spec, context: int) -> int:
    """bf16 K and V of every attention block, for the tokens it keeps: 2 x kv heads x head_dim x 2 bytes each."""
    return sum(
        2 * b.num_kv_heads * b.head_dim * 2 * (context if b.window is None else min(context, b.window))
        for b in spec.blocks
        if isinstance(b, AttentionSpec)
    )


def test_kv_cache_and_attention_flops_are_capped_by_the_window():
    from puzzle.cost.analytic import (
        decode_flops_per_token,
        kv_cache_bytes,
        prefill_flops_per_token,
        state_bytes_per_request,
        state_bytes_per_sequence,
    )

    full, windowed = _hybrid(), _hybrid(WINDOW)
    for spec in (full, windowed):
        for context in (100, WINDOW, MILLION):
            assert kv_cache_bytes(spec, context) == _kv_bytes_by_hand(spec, context)
            assert state_bytes_per_request(spec, context) == _kv_bytes_by_hand(
                spec, context
            ) + state_bytes_per_sequence(spec)
    block, block_full = windowed.blocks[1], full.blocks[1]
    mixing = 4.0 * block.num_heads * block.head_dim  # QK^T and AV per (query, key) pair
    linear = decode_flops_per_token(block, 64, 1)
    assert decode_flops_per_token(block, 64, MILLION) - linear == pytest.approx(mixing * (WINDOW - 1))
    assert decode_flops_per_token(block_full, 64, MILLION) - linear == pytest.approx(mixing * (MILLION - 1))
    # A prompt of T > W tokens: query t sees min(t + 1, W) keys; summed by brute force over a small case.
    small = dataclasses.replace(block, window=5)
    T = 12
    keys = sum(min(t + 1, 5) for t in range(T)) / T
    base = prefill_flops_per_token(small, 64, T) - mixing * keys
    assert base == pytest.approx(prefill_flops_per_token(block_full, 64, 1) - mixing)


def test_a_memory_budget_at_1m_tokens_picks_windows_where_they_pay():
    """Three attention blocks offered full, w4096 or w512 by a search space; bf16 KV at 1M tokens of context.
    A tight memory budget makes the MIP window the blocks it must (and no more), a loose one keeps full
    attention; both equal brute force over all 27 children with memory computed by hand."""
    import itertools

    from puzzle.cost import Scenario, model_weight_bytes
    from puzzle.cost.analytic import state_bytes_per_sequence
    from puzzle.cost.limits import Relative
    from puzzle.cost.serving import CostModel
    from puzzle.search import search
    from puzzle.search.budget import Budget, choices_to_spec, deployment_problem
    from puzzle.space import SearchSpace

    parent = _hybrid()
    space = SearchSpace.from_dict({"kinds": {"attention": {"window": [WINDOW, 512]}}})
    variants = [[v.spec for v in options] for options in space.all_variants(parent).values()]
    attention = [i for i, b in enumerate(parent.blocks) if isinstance(b, AttentionSpec)]
    assert [[b.window for b in variants[i]] for i in attention] == [[None, WINDOW, 512]] * 3
    # Loss of windowing each block (a smaller window costs more), different per block so one optimum.
    scores = [[0.0] * len(options) for options in variants]
    for rank, i in enumerate(attention):
        scores[i] = [0.0, 0.1 * (rank + 1), 0.25 * (rank + 1)]
    scenario = Scenario(batch_size=1, prompt_tokens=MILLION, generated_tokens=1, name="million")
    cost_model = CostModel("h100", scenarios={"million": scenario})
    context = MILLION + 1

    def memory(spec) -> float:
        return model_weight_bytes(spec) + _kv_bytes_by_hand(spec, context) + state_bytes_per_sequence(spec)

    picked = {}
    for factor in (0.5, 0.2, 1.0):
        budget = Budget.of(memory_bytes={"million": Relative(factor)}, cost_model=cost_model)
        problem = deployment_problem(parent, variants, scores, budget)
        solution = search(problem.table, problem.limits, problem.rules)
        best = min(
            (
                (sum(scores[i][c] for i, c in enumerate(choices)), choices)
                for choices in itertools.product(*[range(len(options)) for options in variants])
                if memory(choices_to_spec(parent, variants, choices)) <= factor * memory(parent)
            ),
        )
        assert solution.objective == pytest.approx(best[0], abs=1e-12)
        assert tuple(solution.choices) == best[1]
        child = choices_to_spec(parent, variants, solution.choices)
        assert solution.totals["memory_bytes[million]"] == pytest.approx(memory(child), rel=1e-9)
        picked[factor] = [child.blocks[i].window for i in attention]
    assert picked[1.0] == [None, None, None]  # loose: full attention everywhere (windows cost score)
    # Each full block holds 256 MB at 1M tokens, the rest of the model ~2 MB: half the memory leaves room
    # for one full block (the one whose window costs most), a fifth for none; the milder window suffices.
    assert picked[0.5] == [WINDOW, WINDOW, None]
    assert picked[0.2] == [WINDOW, WINDOW, WINDOW]


def test_puzzle_costs_counts_more_1m_token_requests_for_the_windowed_child(tmp_path, capsys):
    """`puzzle costs CONFIG --context 1M`: the windowed child serves floor((0.9 x 80 GB - weights) / per
    request) requests, the KV of each request taken by hand at min(context, window) tokens per block."""
    import json

    from puzzle.cli import main
    from puzzle.cost import get_hardware, model_weight_bytes
    from puzzle.cost.analytic import state_bytes_per_sequence
    from puzzle.nemotron_h import config_from_spec

    counts = {}
    for name, spec in (("full", _hybrid()), ("windowed", _hybrid(WINDOW))):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config_from_spec(spec)))
        assert main(["costs", str(path), "--hardware", "h100", "--context", "1M", "--json"]) == 0
        costs = json.loads(capsys.readouterr().out)
        per_request = _kv_bytes_by_hand(spec, MILLION) + state_bytes_per_sequence(spec)
        usable = 0.9 * get_hardware("h100").memory_bytes - model_weight_bytes(spec)
        assert costs["state_bytes_per_request"] == per_request
        assert costs["max_concurrent_requests"] == math.floor(usable / per_request)
        counts[name] = costs["max_concurrent_requests"]
    # 3 blocks x 256 B/token: full 768 MB per request; windowed 3 x 1 MB + the Mamba states.
    assert counts["windowed"] > 100 * counts["full"] > 0


# ---------------------------------------------------------------------------------------------------
# Export: config.json, the remote code, the engines.


def _windowed_child():
    from puzzle.spec import MambaSpec, MLPSpec, ModelSpec

    attention = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4)
    return ModelSpec(
        vocab_size=48,
        hidden_size=16,
        blocks=(
            dataclasses.replace(attention, window=3),
            MambaSpec(num_heads=4, head_dim=4, state_size=6, n_groups=2, chunk_size=8),
            attention,
            dataclasses.replace(attention, window=5),
            MLPSpec(width=8),
        ),
    )


def test_a_windowed_child_exports_a_per_block_sliding_window_that_reads_back():
    from puzzle.nemotron_h import config_from_spec, spec_from_config

    spec = _windowed_child()
    config = config_from_spec(spec)
    assert config["model_type"] == "nemotron_h_puzzle"
    assert "sliding_window" not in config  # per block only, never a global every layer would take
    assert [entry.get("sliding_window") for entry in config["block_configs"]] == [3, None, None, 5, None]
    assert spec_from_config(config) == spec
    # All attention blocks windowed alike: still stated per entry, still no global.
    same = dataclasses.replace(
        spec,
        blocks=tuple(
            dataclasses.replace(b, window=3) if isinstance(b, AttentionSpec) else b for b in spec.blocks
        ),
    )
    config = config_from_spec(same)
    assert "sliding_window" not in config and spec_from_config(config) == same
    # No window anywhere: the config is what it was (no sliding_window key at all).
    plain = dataclasses.replace(
        spec,
        blocks=tuple(
            dataclasses.replace(b, window=None) if isinstance(b, AttentionSpec) else b for b in spec.blocks
        ),
    )
    assert "sliding_window" not in json_dump(config_from_spec(plain))


def json_dump(config) -> str:
    import json

    return json.dumps(config)


def test_engines_read_or_refuse_the_window():
    from puzzle.nemotron_h import config_from_spec, vllm_replay
    from puzzle.nemotron_h.config import CheckpointError
    from puzzle.nemotron_h.engines import engine_support, vllm_checkpoint

    spec = _windowed_child()
    support = engine_support(spec)
    # vLLM builds each attention layer from its per-layer config and reads its sliding_window: no refusal
    # for the window (the replay confirms each layer reads the child's window).
    assert not [reason for reason in support["vllm"] if "window" in reason or "attention" in reason], support[
        "vllm"
    ]
    config, shapes = vllm_checkpoint(spec)
    windows = {
        layer.index: layer.fields.get("sliding_window")
        for layer in vllm_replay.replay(config)
        if layer.char == "*"
    }
    assert windows == {0: 3, 2: None, 3: 5}
    # The replay can fail: an entry that lost its window describes another block than the child's.
    del config["block_configs"][3]["sliding_window"]
    assert any(index == 3 and "window" in why for index, why in vllm_replay.mismatches(config, shapes, spec))
    # llama.cpp: no per-layer window; both windowed blocks refused by name.
    refused = [reason for reason in support["llama.cpp"] if "sliding-window" in reason]
    assert len(refused) == 2 and "block 0 (attention)" in refused[0] and "block 3 (attention)" in refused[1]
    # transformers' stock NemotronH ignores sliding_window: refused, and a plain nemotron_h save is an error.
    assert any("sliding-window attention" in reason for reason in support["transformers"])
    with pytest.raises(CheckpointError, match="sliding-window attention"):
        config_from_spec(spec, model_type="nemotron_h")


def test_remote_code_cache_holds_only_the_window(tmp_path, hf_modules_cache):
    from transformers import AutoModelForCausalLM

    from puzzle.model import HybridLM

    spec = _windowed_child()
    torch.manual_seed(0)
    out = HybridLM(spec).eval().save_pretrained(tmp_path / "child")
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ours = HybridLM(spec).eval()
    ours.load_state_dict(__import__("puzzle").load(out).state_dict())
    ids = torch.randint(0, spec.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = None
        for t in range(ids.shape[1]):
            cache = remote(ids[:, t : t + 1], cache=cache, use_cache=True).cache
        held = [layer.keys.shape[2] for layer in (cache.layers[0], cache.layers[2], cache.layers[3])]
        assert held == [2, 12, 4]  # window - 1 kept for each windowed block; everything for the full one
        assert torch.allclose(remote(ids).logits, ours(ids).logits, atol=1e-5)


def test_bld_trains_and_scoring_scores_a_windowed_variant_as_full_forwards_do(tmp_path):
    """A windowed variant of a trained parent's attention block through BLD and scoring: it starts from the
    parent's weights (the band is the only change), training lowers its held-out error, and its score equals
    the KL of one full forward of the parent with that block replaced by the trained, windowed mixer."""
    import copy

    from bld_helpers import load_setup, save_setup, settings, token_batches
    from kl_helpers import naive_kl

    from puzzle.bld import build_library
    from puzzle.score import score_variants
    from puzzle.spec import Variant

    (tmp_path / "setup").mkdir()
    save_setup(tmp_path / "setup")
    parent, importance = load_setup(tmp_path / "setup")
    index = next(i for i, b in enumerate(parent.spec.blocks) if isinstance(b, AttentionSpec))
    variant = Variant(index, dataclasses.replace(parent.spec.blocks[index], window=4))  # sequences of 16
    held_out = token_batches(2, seed=400)
    library = build_library(
        parent,
        {index: [variant]},
        token_batches(12, seed=300),
        held_out,
        importance,
        settings(),
        tmp_path / "library",
        data_fingerprint="train-300",
    )
    result = library.results[variant]
    assert result.status == "trained" and 0 < result.final_nmse < result.init_nmse, result
    trained = library.load_mixer(variant, parent.spec.hidden_size)
    own = parent.layers[index].mixer.state_dict()
    assert trained.spec.window == 4 and any(
        not torch.equal(v, own[k]) for k, v in trained.state_dict().items()
    )

    scores = score_variants(parent, [variant], {variant: trained}, held_out, tmp_path / "scores")

    def kl_with(mixer) -> float:  # one full forward, whole vocabulary in fp64
        child = copy.deepcopy(parent)
        child.replace_mixer(index, copy.deepcopy(mixer))
        return naive_kl(parent, child, held_out)

    # Scoring runs the suffix in fp32 (the oracle's logits are fp32 too, its softmax fp64): agreement to
    # ~1e-5 relative on a KL of ~1e-3; the same weights without the band score far off, so the band is seen.
    unbanded = build_block(dataclasses.replace(variant.spec, window=None), parent.spec.hidden_size)
    unbanded.load_state_dict(trained.state_dict())
    assert scores[variant].kl == pytest.approx(kl_with(trained), rel=1e-4)
    assert abs(kl_with(unbanded) - scores[variant].kl) > 0.05 * scores[variant].kl
    assert scores[variant].kl > 1e-6
