"""HybridLM: meta-device builds of real sizes, caches (prefill then decode), hidden states, generate, norms."""

from __future__ import annotations

import pytest
import torch
from nemotron_helpers import VOCAB, token_batch
from torch.testing import assert_close
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm

from puzzle import nemotron_h
from puzzle.blocks import build_block
from puzzle.blocks.moe import module_hub_state
from puzzle.model import Block, HybridLM, RMSNorm, parameter_counts
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, NoOpSpec, SpecError

# Published configs (see shared/reference/nemotron-architectures.md) and their derived parameter totals.
NANO_30B = {
    "model_type": "nemotron_h",
    "vocab_size": 131072,
    "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
}
NANO_30B_PARAMS = 31_577_937_344

SUPER_120B = {
    **NANO_30B,
    "hidden_size": 4096,
    "hybrid_override_pattern": "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
    "mamba_num_heads": 128,
    "n_routed_experts": 512,
    "num_experts_per_tok": 22,
    "moe_intermediate_size": 2688,
    "moe_latent_size": 1024,
    "moe_shared_expert_intermediate_size": 5376,
    "routed_scaling_factor": 5.0,
}
SUPER_120B_PARAMS = 120_668_687_360


def _meta_model(config: dict) -> HybridLM:
    with torch.device("meta"):
        return HybridLM(nemotron_h.spec_from_config(config))


def test_meta_build_of_nano_30b():
    model = _meta_model(NANO_30B)
    assert all(p.is_meta for p in model.parameters())
    assert model.spec.pattern.count("E") == 23 and model.spec.num_blocks == 52
    counts = parameter_counts(model)
    assert sum(counts.values()) == sum(p.numel() for p in model.parameters()) == NANO_30B_PARAMS


@pytest.mark.slow
def test_meta_build_of_super_120b():
    model = _meta_model(SUPER_120B)
    assert all(p.is_meta for p in model.parameters())
    counts = parameter_counts(model)
    assert sum(counts.values()) == SUPER_120B_PARAMS
    assert counts["embeddings"] == counts["lm_head"] == 536_870_912
    assert counts["mamba"] == 40 * 109_640_064 and counts["attention"] == 8 * 35_655_680
    # The reference's per-block MoE figure counts the 512 router-bias entries, a buffer here, which
    # its 120.7B total leaves out.
    assert counts["moe"] == 40 * (2_873_102_848 - 512)


def every_kind_spec() -> ModelSpec:
    """One block of every kind, tiny; chunk size 4 so prompts span several chunks."""
    return ModelSpec(
        vocab_size=96,
        hidden_size=32,
        blocks=(
            MambaSpec(num_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=4, dt_clamp_min=0.001),
            AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
            MoESpec(
                num_experts=6, top_k=2, expert_width=(16, 8, 12, 16, 4, 8), shared_width=24, latent_size=12
            ),
            MLPSpec(width=40),
            LinearSpec(),
            NoOpSpec(),
            MambaSpec(num_heads=2, head_dim=8, state_size=4, n_groups=1, chunk_size=4),
        ),
    )


@pytest.fixture(scope="module")
def model() -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(every_kind_spec()).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
    return model


def test_prefill_then_decode_equals_full_forward(model):
    ids = token_batch(batch=2, length=15, seed=1)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.init_cache(batch_size=2)
        prefill = model(ids[:, :6], cache=cache).logits
        steps = [model(ids[:, t : t + 1], cache=cache).logits for t in range(6, 15)]
    assert cache.position == 15
    assert_close(prefill, full[:, :6], atol=1e-5, rtol=1e-5)
    assert_close(torch.cat(steps, dim=1), full[:, 6:], atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_full_forward(model):
    ids = token_batch(batch=2, length=15, seed=2)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.init_cache(batch_size=2)
        parts = [model(ids[:, a:b], cache=cache).logits for a, b in [(0, 5), (5, 11), (11, 15)]]
    assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_hidden_states(model):
    ids = token_batch(batch=1, length=5, seed=3)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    hidden = out.hidden_states
    assert len(hidden) == model.spec.num_blocks + 1
    assert torch.equal(hidden[0], model.embeddings(ids))
    assert torch.equal(hidden[6], hidden[5])  # the no-op block passes the residual stream through
    assert_close(out.logits, model.lm_head(model.norm_f(hidden[-1])), atol=0, rtol=0)
    assert model(ids).hidden_states is None


def test_greedy_generate_equals_argmax_of_full_forward(model):
    prompt = token_batch(batch=2, length=4, seed=4)
    generated = model.generate(prompt, max_new_tokens=12)
    assert generated.shape == (2, 16) and torch.equal(generated[:, :4], prompt)
    tokens = prompt
    with torch.no_grad():
        for _ in range(12):  # no cache: every step recomputes the whole sequence
            tokens = torch.cat([tokens, model(tokens).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, tokens)


def test_sampling_is_reproducible_and_top_k_one_is_greedy(model):
    prompt = token_batch(batch=2, length=3, seed=5)
    first = model.generate(prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(7))
    second = model.generate(prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(first, second)
    other = model.generate(prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(first, other)
    top1 = model.generate(prompt, 10, temperature=0.7, top_k=1, generator=torch.Generator().manual_seed(9))
    assert torch.equal(top1, model.generate(prompt, 10))


def test_generate_stops_at_eos(model):
    prompt = token_batch(batch=1, length=3, seed=6)
    greedy = model.generate(prompt, 8)
    eos = int(greedy[0, 5])  # the third generated token
    stopped = model.generate(prompt, 8, eos_token_id=eos)
    first_eos = int((greedy[0, 3:] == eos).nonzero()[0]) + 3
    assert torch.equal(stopped, greedy[:, : first_eos + 1])


def test_rmsnorm_matches_transformers_in_bf16():
    ours, theirs = RMSNorm(64, eps=1e-5), NemotronHRMSNorm(64, eps=1e-5)
    weight = 1.0 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert ours(x).dtype == torch.bfloat16
    assert torch.equal(ours(x), theirs(x))
    assert torch.equal(ours.to(torch.bfloat16)(x), theirs.to(torch.bfloat16)(x))


def test_bf16_model_keeps_residual_dtype(model):
    bf16 = HybridLM(every_kind_spec())
    bf16.load_state_dict(model.state_dict())
    bf16 = bf16.to(torch.bfloat16).eval()
    ids = token_batch(batch=1, length=6, seed=7)
    with torch.no_grad():
        out = bf16(ids, output_hidden_states=True)
    assert all(h.dtype == torch.bfloat16 for h in out.hidden_states)
    assert out.logits.dtype == torch.float32
    with torch.no_grad():
        reference = model(ids).logits
    assert (out.logits - reference).abs().max() < 0.1 * reference.abs().max()


def test_tied_embeddings_share_storage():
    tied = HybridLM(ModelSpec(vocab_size=32, hidden_size=16, blocks=(MLPSpec(width=8),), tie_embeddings=True))
    assert tied.lm_head.weight is tied.embeddings.weight
    counts = parameter_counts(tied)
    assert "lm_head" not in counts and sum(counts.values()) == sum(p.numel() for p in tied.parameters())


def test_state_dict_keys_follow_the_hub_names(model):
    keys = set(model.state_dict())
    assert {"embeddings.weight", "norm_f.weight", "lm_head.weight", "layers.0.norm.weight"} <= keys
    assert {"layers.0.mixer.A_log", "layers.0.mixer.in_proj.weight", "layers.1.mixer.q_proj.weight"} <= keys
    # The routed experts are one bank in the model and one tensor pair per expert on the hub.
    assert {"layers.2.mixer.experts.up", "layers.2.mixer.gate.e_score_correction_bias"} <= keys
    hub = set(module_hub_state(model))
    assert "layers.2.mixer.experts.5.up_proj.weight" in hub and "layers.2.mixer.experts.up" not in hub
    assert hub - keys == {
        f"layers.2.mixer.experts.{j}.{proj}_proj.weight"
        for j in range(len(model.layers[2].mixer.experts))
        for proj in ("up", "down")
    }
    assert {"layers.4.mixer.linear.weight"} <= keys
    assert not any(key.startswith("layers.5.") for key in keys)  # the no-op block: no mixer, no norm


def test_the_spec_follows_the_mixers(tmp_path):
    """Swapping a mixer changes the model's spec: forward, save and load all see the new shape."""
    spec = ModelSpec(
        vocab_size=VOCAB, hidden_size=16, blocks=(MLPSpec(width=32), NoOpSpec(), MLPSpec(width=32))
    )
    torch.manual_seed(0)
    model = HybridLM(spec).eval()
    ids = token_batch(batch=1, length=6, seed=2)
    before = model(ids).logits
    narrower, real = MLPSpec(width=8), MLPSpec(width=24)
    model.replace_mixer(0, build_block(narrower, 16))
    model.replace_mixer(1, build_block(real, 16))  # a real mixer where a no-op was: it must run
    assert model.spec.blocks == (narrower, real, MLPSpec(width=32))
    assert model.layers[1].spec == real
    after = model(ids).logits
    assert not torch.allclose(before, after)
    loaded = nemotron_h.load(model.save_pretrained(tmp_path / "child"))
    assert loaded.spec == model.spec
    assert_close(loaded(ids).logits, after, atol=0, rtol=0)
    with pytest.raises(TypeError, match=r"needs a \.spec"):
        model.replace_mixer(0, torch.nn.Linear(16, 16))


# ---------------------------------------------------------------------------------------------------
# No-op blocks own nothing; models assembled from given mixers.


def test_a_no_op_block_has_no_parameters_and_every_other_parameter_gets_a_gradient():
    """DDP and FSDP wait for a gradient of every parameter: a no-op block must not keep an unused norm."""
    assert list(Block(NoOpSpec(), 16, 1e-5).parameters()) == []
    spec = ModelSpec(
        vocab_size=VOCAB,
        hidden_size=16,
        blocks=(
            MambaSpec(2, 8, 4, chunk_size=4),
            NoOpSpec(),
            AttentionSpec(2, 1, 8),
            LinearSpec(),
            MLPSpec(8),
        ),
    )
    torch.manual_seed(0)
    model = HybridLM(spec)
    assert list(model.layers[1].parameters()) == [] and model.layers[1].norm is None
    model(token_batch(batch=2, length=6, seed=1)).logits.square().mean().backward()
    unused = [name for name, p in model.named_parameters() if p.grad is None]
    assert unused == []


def test_a_checkpoint_with_a_no_op_norm_still_loads(tmp_path):
    """Files written while no-op blocks kept a pre-norm carry `backbone.layers.{i}.norm.weight`: dropped on load."""
    from safetensors.torch import load_file, save_file

    spec = ModelSpec(vocab_size=VOCAB, hidden_size=16, blocks=(MLPSpec(width=32), NoOpSpec(), LinearSpec()))
    torch.manual_seed(0)
    model = HybridLM(spec).eval()
    out = model.save_pretrained(tmp_path / "child")
    (weights,) = out.glob("*.safetensors")
    tensors = load_file(weights)
    assert "backbone.layers.1.norm.weight" not in tensors  # nothing to write for a no-op block
    tensors["backbone.layers.1.norm.weight"] = torch.ones(16)  # what older saves wrote
    save_file(tensors, weights, metadata={"format": "pt"})
    loaded = nemotron_h.load(out)
    assert loaded.spec == spec and "layers.1.norm.weight" not in loaded.state_dict()
    assert (
        "backbone.layers.1.norm.weight" not in loaded.extra_tensors
    )  # dropped, not carried to the next save
    ids = token_batch(batch=1, length=5, seed=2)
    assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    # A stray norm of a real block's kind elsewhere is still an error, not silently dropped.
    tensors["backbone.layers.7.norm.weight"] = torch.ones(16)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(
        nemotron_h.CheckpointError, match=r"unexpected tensor\(s\) 'backbone\.layers\.7\.norm\.weight'"
    ):
        nemotron_h.load(out)


def test_replace_mixer_moves_the_norm_with_the_no_op():
    """A no-op mixer drops the block's norm; putting the saved mixer and norm back restores the block exactly."""
    spec = ModelSpec(vocab_size=VOCAB, hidden_size=16, blocks=(MLPSpec(width=32), MLPSpec(width=16)))
    torch.manual_seed(0)
    model = HybridLM(spec).eval()
    with torch.no_grad():
        model.layers[0].norm.weight.mul_(1.5)
    ids = token_batch(batch=1, length=5, seed=3)
    before = model(ids).logits
    saved_mixer, saved_norm = model.layers[0].mixer, model.layers[0].norm
    model.replace_mixer(0, build_block(NoOpSpec(), 16))
    assert model.layers[0].norm is None and "layers.0.norm.weight" not in model.state_dict()
    with pytest.raises(SpecError, match="block 0: a no-op block has no norm"):
        model.replace_mixer(0, build_block(NoOpSpec(), 16), norm=saved_norm)
    model.replace_mixer(0, saved_mixer, norm=saved_norm)
    assert torch.equal(model(ids).logits, before)
    # Without a norm to put back, a real mixer gets a fresh one (weight 1, as a new model's).
    model.replace_mixer(0, build_block(NoOpSpec(), 16))
    model.replace_mixer(0, saved_mixer)
    assert torch.equal(model.layers[0].norm.weight, torch.ones(16))
    with pytest.raises(
        SpecError, match=r"block 1: mixer tensor 'up_proj\.weight' is shape \[16, 8\], expected \[16, 16\]"
    ):
        model.replace_mixer(1, build_block(MLPSpec(width=16), 8))  # built for another hidden size


def test_a_model_from_given_mixers_uses_them_as_they_are():
    """Assembly: `HybridLM(spec, mixers=...)` takes built (e.g. trained) mixers, None builds from the spec."""
    spec = ModelSpec(
        vocab_size=VOCAB, hidden_size=16, blocks=(MLPSpec(width=32), NoOpSpec(), AttentionSpec(2, 1, 8))
    )
    torch.manual_seed(0)
    reference = HybridLM(spec).eval()
    given = [reference.layers[0].mixer, build_block(NoOpSpec(), 16), None]
    with torch.device("meta"):  # the given mixers stay as they are; the rest is a shape to fill
        model = HybridLM(spec, mixers=given).eval()
    assert model.layers[0].mixer is given[0] and model.layers[1].mixer is given[1]
    assert not model.layers[0].mixer.up_proj.weight.is_meta and model.embeddings.weight.is_meta
    assert model.spec == spec and model.layers[1].norm is None
    # The rest from the reference's tensors: then it is the reference model.
    rest = {k: v for k, v in reference.state_dict().items() if not k.startswith("layers.0.mixer.")}
    result = model.load_state_dict(rest, strict=False, assign=True)
    assert sorted(result.missing_keys) == ["layers.0.mixer.down_proj.weight", "layers.0.mixer.up_proj.weight"]
    assert result.unexpected_keys == []
    ids = token_batch(batch=1, length=5, seed=4)
    assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize(
    ("mixers", "error", "message"),
    [
        (
            [build_block(MLPSpec(width=8), 16), None],
            SpecError,
            r"block 0: the given mixer is a mlp:w8, the model spec has mlp:w32",
        ),
        (
            [None, build_block(MLPSpec(width=32), 16)],
            SpecError,
            r"block 1: the given mixer is a mlp:w32, the model spec has noop",
        ),
        (
            [build_block(MLPSpec(width=32), 8), None],
            SpecError,
            r"block 0: mixer tensor 'up_proj\.weight' is shape \[32, 8\], expected \[32, 16\]",
        ),
        ([torch.nn.Linear(16, 16), None], TypeError, r"block 0: a mixer needs a \.spec"),
        (
            [None],
            SpecError,
            r"mixers: expected one entry \(a mixer or None\) per block \(2\), found 1 entries",
        ),
        (build_block(MLPSpec(width=32), 16), SpecError, r"mixers: expected one entry .* found a MLPMixer"),
    ],
)
def test_given_mixers_that_do_not_fit_are_named(mixers, error, message):
    spec = ModelSpec(vocab_size=VOCAB, hidden_size=16, blocks=(MLPSpec(width=32), NoOpSpec()))
    with pytest.raises(error, match=message):
        HybridLM(spec, mixers=mixers)
