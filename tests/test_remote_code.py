"""The trust_remote_code files of nemotron_h_puzzle checkpoints: transformers builds every child puzzle exports.

The oracle is `puzzle.load` of the same directory: logits, hidden states and greedy generations must match
for every block kind, with no missing or unexpected tensors.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoConfig, AutoModelForCausalLM

import puzzle
from puzzle.model import HybridLM
from puzzle.nemotron_h import block_config_fields
from puzzle.nemotron_h.remote import AUTO_MAP, REMOTE_CODE_FILES
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, NoOpSpec
from tests.nemotron_helpers import EVERY_KIND_SPEC

HIDDEN, VOCAB = 16, 48


def _spec(*blocks, **fields) -> ModelSpec:
    return ModelSpec(vocab_size=VOCAB, hidden_size=HIDDEN, blocks=blocks, **fields)


# One child per block kind, each with blocks of different shapes (so it saves as nemotron_h_puzzle).
CHILDREN = {
    "mamba": _spec(
        MambaSpec(num_heads=4, head_dim=4, state_size=6, n_groups=2, chunk_size=8),
        MambaSpec(
            num_heads=6,
            head_dim=2,
            state_size=3,
            n_groups=3,
            conv_kernel=3,
            chunk_size=5,
            conv_bias=False,
            proj_bias=True,
            dt_clamp_min=0.05,
            dt_clamp_max=0.8,
        ),
        MambaSpec(num_heads=2, head_dim=8, state_size=10, n_groups=1, chunk_size=32),
    ),
    "attention": _spec(
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4),
        AttentionSpec(num_heads=2, num_kv_heads=1, head_dim=6, bias=True),
        AttentionSpec(num_heads=3, num_kv_heads=3, head_dim=5),
    ),
    "moe": _spec(
        MoESpec(num_experts=6, top_k=2, expert_width=8, shared_width=8),
        MoESpec(
            num_experts=6,
            top_k=4,
            expert_width=(8, 3, 5, 8, 2, 6),
            shared_width=0,
            routed_scaling_factor=2.5,
            norm_topk_prob=False,
        ),
        MoESpec(
            num_experts=8, top_k=3, expert_width=4, shared_width=6, latent_size=12, n_group=4, topk_group=2
        ),
        MoESpec(num_experts=8, top_k=1, expert_width=(4, 4, 2, 6, 4, 3, 4, 5), latent_size=6),
    ),
    "mlp": _spec(
        MLPSpec(width=12), MLPSpec(width=7, activation="silu", bias=True), MLPSpec(width=5, activation="gelu")
    ),
    "linear": _spec(LinearSpec(), MLPSpec(width=8), LinearSpec(bias=True), tie_embeddings=True),
    "noop": _spec(
        NoOpSpec(), AttentionSpec(num_heads=2, num_kv_heads=1, head_dim=8), NoOpSpec(), MLPSpec(width=8)
    ),
    # Sliding-window attention beside full attention of the same shape (windows shorter than the sequences).
    "window": _spec(
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4, window=3),
        MambaSpec(num_heads=4, head_dim=4, state_size=6, n_groups=2, chunk_size=8),
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4),
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4, window=5),
        MLPSpec(width=8),
    ),
    "every_kind": EVERY_KIND_SPEC,
}


def random_child(spec: ModelSpec, seed: int = 0) -> HybridLM:
    """A HybridLM with every tensor random, the ones puzzle initialises to constants included."""
    torch.manual_seed(seed)
    model = HybridLM(spec).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith("A_log"):
                tensor.copy_(noise * 0.5)
            elif name.endswith("dt_bias"):
                tensor.copy_(noise * 2.0)  # wide enough that both dt clamps are active for some heads
            elif name.endswith((".D", "norm.weight", "norm_f.weight")):
                tensor.copy_(1.0 + 0.3 * noise)
            elif name.endswith(("bias", "e_score_correction_bias")):
                tensor.copy_(0.2 * noise)  # large enough to change which experts are chosen
    return model


@pytest.fixture(scope="module", autouse=True)
def modules_cache(hf_modules_cache):
    return hf_modules_cache


def load_remote(path: Path, cache: str, **kwargs):
    model, info = AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, output_loading_info=True, **kwargs
    )
    assert {key: sorted(info[key]) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
    }
    assert type(model).__name__ == "NemotronHPuzzleForCausalLM"
    assert Path(sys.modules[type(model).__module__].__file__).is_relative_to(cache)  # the copied remote code
    return model.eval()


@pytest.mark.parametrize("name", list(CHILDREN))
def test_remote_code_logits_equal_puzzle_load(name, tmp_path, modules_cache):
    spec = CHILDREN[name]
    out = random_child(spec, seed=len(name)).save_pretrained(tmp_path / name)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "nemotron_h_puzzle" and config["auto_map"] == AUTO_MAP
    assert all((out / file).is_file() for file in REMOTE_CODE_FILES)
    ours = puzzle.load(out)
    assert ours.spec == spec
    remote = load_remote(out, modules_cache)
    assert remote.dtype == torch.float32
    ids = torch.randint(0, spec.vocab_size, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ours(ids, output_hidden_states=True)
        found = remote(ids, output_hidden_states=True)
    assert_close(found.logits, expected.logits, atol=1e-5, rtol=1e-5)
    assert len(found.hidden_states) == len(expected.hidden_states) == spec.num_blocks + 1
    for got, want in zip(found.hidden_states, expected.hidden_states):
        assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_remote_code_reads_the_published_schema(tmp_path, modules_cache):
    """Block kinds from block_configs alone, num_hidden_layers null, every field in every entry (null = inherit),
    globals that describe no block: what other writers (vLLM-style dataclass dumps) produce."""
    spec = CHILDREN["every_kind"]
    out = random_child(spec, seed=4).save_pretrained(tmp_path / "child")
    config = json.loads((out / "config.json").read_text())
    for key in ("layers_block_type", "hybrid_override_pattern"):
        del config[key]
    config.update(num_hidden_layers=None, ssm_state_size=99, n_routed_experts=77, intermediate_size=55)
    config["block_configs"] = [
        {"block_type": block.kind, "moe_latent_size": None, **block_config_fields(block)}
        for block in spec.blocks
    ]
    (out / "config.json").write_text(json.dumps(config))
    ours = puzzle.load(out)
    assert ours.spec == spec
    ids = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(load_remote(out, modules_cache)(ids).logits, ours(ids).logits, atol=1e-5, rtol=1e-5)


def test_remote_code_generates_what_puzzle_generates(tmp_path, modules_cache):
    child = random_child(EVERY_KIND_SPEC, seed=5)
    child.extra_tensors = {"mtp.layers.0.norm.weight": torch.ones(16)}  # MTP weights: not part of the model
    out = child.save_pretrained(tmp_path / "child")
    ours, remote = puzzle.load(out), load_remote(out, modules_cache)
    prompt = torch.randint(0, EVERY_KIND_SPEC.vocab_size, (1, 6), generator=torch.Generator().manual_seed(8))
    expected = ours.generate(prompt, max_new_tokens=10)
    no_cache = remote.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=False)
    default = remote.generate(prompt, max_new_tokens=10, do_sample=False)  # with the cache: same tokens
    assert torch.equal(no_cache, expected) and torch.equal(default, expected)
    # The loss transformers users train with: next-token cross-entropy of the logits puzzle computes.
    ids = torch.cat([prompt, expected], dim=1)
    with torch.no_grad():
        loss = remote(ids, labels=ids).loss
        logits = ours(ids).logits
    assert_close(loss, torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]), atol=1e-5, rtol=1e-5)


def _tokens_per_forward(model) -> tuple[list[int], object]:
    """The number of tokens each forward of `model` embeds (a hook on the embeddings), and the hook handle."""
    seen: list[int] = []
    handle = model.get_input_embeddings().register_forward_hook(
        lambda mod, args, out: seen.append(out.shape[1])
    )
    return seen, handle


@pytest.mark.parametrize("name", list(CHILDREN))
def test_remote_code_generates_the_same_tokens_with_and_without_the_cache(name, tmp_path, modules_cache):
    """Greedy, 20 new tokens, batch of 2: the cache changes the cost (one token per step), not the tokens."""
    spec = CHILDREN[name]
    remote = load_remote(random_child(spec, seed=7).save_pretrained(tmp_path / name), modules_cache)
    prompt = torch.randint(0, spec.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    seen, handle = _tokens_per_forward(remote)
    without = remote.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, use_cache=False)
    assert seen == list(range(7, 27))  # without: the whole sequence every step
    seen.clear()
    cached = remote.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, use_cache=True)
    handle.remove()
    assert seen == [7] + [1] * 19  # with: the prompt, then one token per step
    assert torch.equal(cached, without)


@pytest.mark.parametrize("name", list(CHILDREN))
def test_remote_code_incremental_logits_equal_the_full_forward(name, tmp_path, modules_cache):
    """Prompt, then one token, then 6 at once (more than a Mamba chunk, after cached ones), then one: fp32
    logits within 1e-4 of one forward over the whole sequence; an empty DynamicCache() works the same."""
    from transformers import DynamicCache

    spec = CHILDREN[name]
    remote = load_remote(random_child(spec, seed=11).save_pretrained(tmp_path / name), modules_cache)
    ids = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    pieces = (0, 9, 10, 16)
    with torch.no_grad():
        full = remote(ids, use_cache=False).logits
        for cache in (None, DynamicCache()):
            steps = []
            for start, end in itertools.pairwise(pieces):
                out = remote(ids[:, start:end], cache=cache, use_cache=True)
                cache = out.cache
                steps.append(out.logits)
            if not isinstance(cache, DynamicCache):  # transformers' counts keys: none in a Mamba-only model
                assert cache.get_seq_length() == 16
            assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


def test_remote_code_cache_serves_beam_search_sampling_and_prompt_embeddings(tmp_path, modules_cache):
    remote = load_remote(
        random_child(EVERY_KIND_SPEC, seed=3).save_pretrained(tmp_path / "child"), modules_cache
    )
    prompt = torch.randint(0, EVERY_KIND_SPEC.vocab_size, (2, 6), generator=torch.Generator().manual_seed(6))
    for settings in ({"num_beams": 3}, {"do_sample": True, "top_k": 5}):
        generated = []
        for use_cache in (False, True):
            torch.manual_seed(0)
            generated.append(
                remote.generate(prompt, max_new_tokens=12, min_new_tokens=12, use_cache=use_cache, **settings)
            )
        assert torch.equal(*generated), settings
    greedy = remote.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    embeds = remote.get_input_embeddings()(prompt).detach()
    from_embeds = remote.generate(inputs_embeds=embeds, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert torch.equal(from_embeds, greedy[:, 6:])  # the prompt as embeddings: the same new tokens


def test_remote_code_refuses_a_cache_of_another_model(tmp_path, modules_cache):
    remote = load_remote(random_child(EVERY_KIND_SPEC).save_pretrained(tmp_path / "child"), modules_cache)
    other = type(remote.new_cache())(["attention"] * EVERY_KIND_SPEC.num_blocks)
    with pytest.raises(ValueError, match="expected one per block"):
        remote(torch.zeros(1, 3, dtype=torch.long), cache=other, use_cache=True)


def test_remote_code_keeps_the_router_fp32_and_refuses_padding(tmp_path, modules_cache):
    out = random_child(EVERY_KIND_SPEC).save_pretrained(tmp_path / "child")
    remote = load_remote(out, modules_cache, dtype=torch.bfloat16)
    gate = remote.backbone.layers[2].mixer.gate
    assert remote.lm_head.weight.dtype == torch.bfloat16
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    ids = torch.randint(0, EVERY_KIND_SPEC.vocab_size, (2, 7))
    with pytest.raises(NotImplementedError, match="padding"):
        remote(ids, attention_mask=torch.tensor([[0] + [1] * 6, [1] * 7]))


def test_transformers_save_of_a_remote_model_loads_in_puzzle(tmp_path, modules_cache):
    """A user who fine-tunes the remote model and saves it with transformers still has a puzzle checkpoint."""
    out = random_child(CHILDREN["moe"], seed=2).save_pretrained(tmp_path / "child")
    remote = load_remote(out, modules_cache)
    again = tmp_path / "again"
    remote.save_pretrained(again)
    assert AutoConfig.from_pretrained(again, trust_remote_code=True).block_kinds() == ["moe"] * 4
    ids = torch.randint(0, VOCAB, (1, 11))
    with torch.no_grad():
        assert_close(puzzle.load(again)(ids).logits, puzzle.load(out)(ids).logits, atol=0, rtol=0)


def test_resaving_over_a_puzzle_checkpoint_and_homogeneous_children(tmp_path):
    """The remote-code files count as checkpoint files; a nemotron_h child gets neither them nor auto_map."""
    target = random_child(CHILDREN["linear"]).save_pretrained(tmp_path / "out")
    random_child(CHILDREN["linear"], seed=1).save_pretrained(target)  # no overwrite=True needed
    homogeneous = _spec(MLPSpec(width=8), MLPSpec(width=8))
    random_child(homogeneous).save_pretrained(target)
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "nemotron_h" and "auto_map" not in config
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]


def test_remote_config_reads_every_field_puzzle_writes_with_the_same_defaults():
    """The remote code keeps its own copy of the field defaults: a field added to puzzle's writer must reach it."""
    from puzzle.nemotron_h.config import DEFAULTS, KIND_TABLES
    from puzzle.nemotron_h.remote.configuration_nemotron_h_puzzle import BLOCK_DEFAULTS

    written = {field.key for table in KIND_TABLES.values() for field in table.fields}
    assert written <= set(BLOCK_DEFAULTS)
    assert {key: DEFAULTS[key] for key in written} == {key: BLOCK_DEFAULTS[key] for key in written}


def test_remote_code_imports_only_torch_transformers_and_the_standard_library():
    directory = Path(puzzle.__file__).parent / "nemotron_h" / "remote"
    for file in REMOTE_CODE_FILES:
        tree = ast.parse((directory / file).read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
        third_party = imported - set(sys.stdlib_module_names) - {"__future__"}
        assert third_party <= {"torch", "transformers"}, (file, third_party)


@pytest.mark.slow
def test_remote_code_loads_offline_in_a_fresh_process(tmp_path):
    """No hub access: HF_HUB_OFFLINE and an unreachable endpoint; the modules cache starts empty."""
    out = random_child(EVERY_KIND_SPEC, seed=9).save_pretrained(tmp_path / "child")
    script = textwrap.dedent(
        f"""
        import torch, puzzle
        from transformers import AutoModelForCausalLM
        remote = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
        ids = torch.arange(12)[None] % {EVERY_KIND_SPEC.vocab_size}
        with torch.no_grad():
            print(float((remote(ids).logits - puzzle.load({str(out)!r})(ids).logits).abs().max()))
        """
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(puzzle.__file__).parent.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.strip().splitlines()[-1]) < 1e-5
    assert list((tmp_path / "modules").rglob("modeling_nemotron_h_puzzle.py"))
