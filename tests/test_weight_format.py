"""The weight_format axis end to end: a variant is a shape plus a format (bf16 / fp8 / nvfp4) of its matmul
weights; BLD trains it quantization-aware from the parent's weights, scoring and assembly run it
fake-quantized, the cost model prices it in its format, and the search picks formats under a weight budget.

Oracles: `puzzle.quant.fake_quantize` applied by hand to the named hub weights (not through
`puzzle.blocks.formats`), the cost model's whole-model figures and `puzzle costs`, and fingerprints and
variant ids computed by the checkout before the axis existed (pinned below).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from run_helpers import SPEC, config_dict, make_inputs, write_config

import puzzle
from puzzle import quant
from puzzle import spec as spec_formats
from puzzle.artifacts import fingerprint_json, fingerprint_spec
from puzzle.bld import default_init
from puzzle.blocks import build_block, formats
from puzzle.blocks.formats import fake_quantized
from puzzle.blocks.tensors import TensorInfo
from puzzle.cli import main as puzzle_main
from puzzle.cost import model_performance, model_weight_bytes, state_bytes_per_request
from puzzle.cost.analytic import block_tensors, block_weight_bytes, tensor_bytes
from puzzle.cost.formats import get_recipe, with_weight_format
from puzzle.formats import NVFP4_BLOCK, QUANTIZED_ROLES, ROLE_QUANTIZED, ROLES
from puzzle.model import HybridLM
from puzzle.quant import fake_quantize
from puzzle.quant_tokens import quantize_input_hook
from puzzle.run import Run
from puzzle.space import SearchSpace, SpaceError
from puzzle.spec import (
    WEIGHT_FORMATS,
    MLPSpec,
    ModelSpec,
    MoESpec,
    Variant,
    block_to_dict,
    weight_formats,
    without_weight_formats,
)

# The matmul weights each format covers, by hand (the hub names of the mixers used below).
COVERED = {
    "attention": ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"),
    "mlp": ("up_proj.weight", "down_proj.weight"),
}


def _bf16(spec):
    return dataclasses.replace(spec, weight_format="bf16") if hasattr(spec, "weight_format") else spec


# The format facts; each is assigned (at a module's top level) in puzzle/formats.py and nowhere else.
_FACTS = (
    "WEIGHT_FORMATS",
    "DEFAULT_WEIGHT_FORMAT",
    "NVFP4_BLOCK",
    "ROLES",
    "QUANTIZED_ROLES",
    "NVFP4_SHARED_SCALE",
)


def test_every_format_fact_has_one_home():
    package = Path(puzzle.__file__).parent
    assignment = re.compile(rf"^({'|'.join(_FACTS)}|MATMUL_ROLES)\b[^=\n]*=", re.M)
    homes = {
        (path.relative_to(package).as_posix(), match[1])
        for path in package.rglob("*.py")
        for match in assignment.finditer(path.read_text())
    }
    assert homes == {("formats.py", fact) for fact in _FACTS}
    assert (spec_formats.WEIGHT_FORMATS, quant.NVFP4_BLOCK) == (WEIGHT_FORMATS, NVFP4_BLOCK)


def test_each_quantized_recipe_covers_exactly_the_roles_the_table_marks():
    """A role the table marks covered is priced in the recipe's format, every other keeps bf16 (the router
    bias fp32): no role is priced as fp8 or nvfp4 by default."""
    for name in ("fp8", "nvfp4"):
        recipe = get_recipe(name)
        for role in ROLES:
            expected = name if ROLE_QUANTIZED[role] else ("fp32" if role == "router_bias" else "bf16")
            assert recipe.format_of(role) == expected, (name, role)
        block = with_weight_format(get_recipe("bf16"), name)
        assert {r for r in ROLES if block.format_of(r) == name} == set(QUANTIZED_ROLES)


def test_a_tensor_says_whether_a_format_covers_it_and_an_unlisted_role_is_refused():
    assert TensorInfo("in_proj.weight", (8, 4), "mamba_proj").covered
    assert not TensorInfo("conv1d.weight", (8, 1, 4), "mamba_conv").covered
    assert not TensorInfo("o_proj.bias", (8,), "bias").covered
    with pytest.raises(ValueError, match="ROLE_QUANTIZED"):
        TensorInfo("state.weight", (8, 4), "mamba_state")


def test_the_covered_weights_are_the_exports():
    """The torch-free role table (cost model, space) is the export's (`puzzle.quant_blocks`), and a baked
    mixer is `fake_quantize_mixer_`'s, value for value."""
    from puzzle import quant_blocks
    from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec

    torch.manual_seed(0)
    specs = (
        AttentionSpec(4, 2, 16),
        MambaSpec(4, 8, 16, n_groups=2),
        MoESpec(4, 2, (16, 32, 16, 48), shared_width=16, latent_size=32),
        MLPSpec(width=32),
        LinearSpec(),
    )
    for spec in specs:
        for fmt in ("fp8", "nvfp4"):
            mine = build_block(dataclasses.replace(spec, weight_format=fmt), 32)
            theirs = build_block(spec, 32)
            with torch.no_grad():  # q/k/v of different ranges: the shared scale matters
                for p in theirs.parameters():
                    p.mul_(torch.rand(()) * 4)
            mine.load_state_dict(theirs.state_dict())
            formats.bake(mine)
            quant_blocks.fake_quantize_mixer_(theirs, spec, 32, fmt)
            for name, tensor in theirs.state_dict().items():
                assert torch.equal(mine.state_dict()[name], tensor), f"{spec.kind} {fmt} {name}"


def test_a_space_without_formats_keeps_its_ids_and_fingerprints():
    """Pinned from the checkout before the axis: the parent's and the space's fingerprints and the variant
    ids (run.json fingerprints and library file names) do not change."""
    space = SearchSpace.from_dict(
        {"kinds": {"moe": {"top_k": [1]}, "mlp": {"width_fraction": [0.5], "noop": True}}}
    )
    assert fingerprint_spec(SPEC) == "6a279f403cc4581e9d021b30c0dd2b52aef4f28c0fa5fce2ed533e14bd7771db"
    assert (
        fingerprint_json(space.to_dict())
        == "336095d27354a902c65a5413197ecf43536f3f33a254e8061b96ede76cc6560f"
    )
    ids = [v.id for variants in space.all_variants(SPEC).values() for v in variants]
    assert ids == [
        "mamba:h4:p4:n8:g2:chunk8",
        "attn:q4:kv2:d4",
        "mlp:w16",
        "mlp:w8",
        "noop",
        "moe:e4:k2:w8:s8",
        "moe:e4:k1:w8:s8",
    ]
    assert "weight_format" not in block_to_dict(SPEC.blocks[2])


def test_the_space_multiplies_shapes_by_formats_per_kind_and_override():
    space = SearchSpace.from_dict(
        {
            "kinds": {"mlp": {"width_fraction": [0.5], "weight_format": ["nvfp4", "fp8"], "noop": True}},
            "overrides": [{"blocks": [1], "attention": {"weight_format": "fp8"}}],
        }
    )
    variants = space.all_variants(SPEC)
    assert [v.id for v in variants[1]] == ["attn:q4:kv2:d4", "attn:q4:kv2:d4:fp8"]
    # Shape by shape, the parent's format first; the width-8 MLP's down_proj has 8 inputs: no nvfp4 block
    # of 16 fits, so that shape has no nvfp4 variant.
    assert [v.id for v in variants[2]] == [
        "mlp:w16",
        "mlp:w16:fp8",
        "mlp:w16:nvfp4",
        "mlp:w8",
        "mlp:w8:fp8",
        "noop",
    ]
    assert variants[2][2].spec == MLPSpec(width=16, weight_format="nvfp4")
    assert SearchSpace.from_dict(space.to_dict()) == space
    with pytest.raises(SpaceError, match=r"space.kinds.mlp.weight_format\[0\] must be one of"):
        SearchSpace.from_dict({"kinds": {"mlp": {"weight_format": ["int4"]}}})


def test_a_quantized_mixer_runs_fake_quantized_weights_with_straight_through_gradients():
    """Forward of an nvfp4 MoE (routed experts one tensor each, down transposed, shared expert) and an fp8
    MLP equals the bf16-spec mixer with those hub weights fake-quantized by hand; the master weights get
    the hand-quantized weights' gradients (straight through) and are left unchanged; Block.step too."""
    from puzzle.blocks.moe import module_hub_state

    torch.manual_seed(0)
    for spec, fmt in ((MoESpec(4, 2, 16, shared_width=16), "nvfp4"), (MLPSpec(width=32), "fp8")):
        quantized = build_block(dataclasses.replace(spec, weight_format=fmt), 32)
        reference = build_block(spec, 32)
        master = {k: v.clone() for k, v in quantized.state_dict().items()}
        hub = module_hub_state(quantized)
        by_hand = {}
        for name, tensor in hub.items():
            if name.startswith(("experts.", "shared_experts.", "up_proj", "down_proj")):
                by_hand[name] = fake_quantize(tensor.detach().clone(), fmt)
        reference.load_state_dict(master)
        if fmt == "fp8":  # by hand too: each matmul's input per token, as FP8_DYNAMIC serves it
            for module in (reference.up_proj, reference.down_proj):
                module.register_forward_pre_hook(quantize_input_hook)
        ref_hub = module_hub_state(reference)
        with torch.no_grad():
            for name, value in by_hand.items():
                ref_hub[name].copy_(value)  # views of the bank: writes through
        x = torch.randn(2, 5, 32)
        out, expected = quantized(x), reference(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        unquantized = build_block(spec, 32)
        unquantized.load_state_dict(master)
        assert not torch.equal(out, unquantized(x))  # the hooks did quantize
        out.square().sum().backward()
        expected.square().sum().backward()
        for (name, p), (_, q) in zip(quantized.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
        for name, tensor in quantized.state_dict().items():
            assert torch.equal(tensor, master[name]), f"{name}: the master weight changed"
    # Decoding calls mixer.step directly (no hooks): Block.step still runs the quantized weights.
    model = HybridLM(ModelSpec(32, 32, (MLPSpec(width=32, weight_format="nvfp4"),)))
    plain = HybridLM(ModelSpec(32, 32, (MLPSpec(width=32),)))
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        formats.bake(plain.layers[0].mixer, "nvfp4")
        x = torch.randn(2, 1, 32)
        stepped = model.layers[0].step(x, None)
        torch.testing.assert_close(stepped, plain.layers[0].step(x, None), rtol=0, atol=0)
        plain.load_state_dict(model.state_dict())  # the master weights, unquantized
        assert not torch.equal(stepped, plain.layers[0].step(x, None))


def test_a_weight_a_format_cannot_store_is_an_error_that_leaves_the_mixer_whole():
    """nvfp4 of a 24-input weight: the error names the tensor; every parameter is still the master."""
    from puzzle.quant import QuantError

    mixer = build_block(MLPSpec(width=16, weight_format="nvfp4"), 24)  # up_proj has 24 inputs
    before = dict(mixer.named_parameters())
    with pytest.raises(QuantError, match=r"up_proj\.weight"):
        mixer(torch.randn(1, 2, 24))
    assert dict(mixer.named_parameters()) == before
    assert all(isinstance(p, torch.nn.Parameter) for p in mixer.parameters())


def test_costs_price_the_covered_weights_in_the_blocks_format():
    """An nvfp4 / fp8 block's bytes: its matmul weights in the format, norms and router as the recipe has them."""
    moe = MoESpec(4, 2, 16, shared_width=16)
    for fmt in ("fp8", "nvfp4"):
        spec = dataclasses.replace(moe, weight_format=fmt)
        expected = 0.0
        for tensor in block_tensors(spec, 32):
            role_fmt = fmt if tensor.role in ("routed_expert", "shared_expert") else None
            if role_fmt is None:
                role_fmt = "fp32" if tensor.role in ("router", "router_bias") else "bf16"
            expected += tensor_bytes(tensor.shape, role_fmt)
        assert block_weight_bytes(spec, 32) == expected
        assert block_weight_bytes(spec, 32) < block_weight_bytes(moe, 32)
    assert block_weight_bytes(
        dataclasses.replace(moe, weight_format="bf16"), 32, "fp8"
    ) == block_weight_bytes(moe, 32, "fp8")  # a bf16 block is priced as the recipe says, as before the axis


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_quantized_block_is_timed_as_the_recipe_of_its_format_times_it(fmt):
    """For kinds whose non-matmul tensors the bf16 and the fp8 / nvfp4 recipes store alike (Mamba, attention,
    MLP), a block in `fmt` under the bf16 recipe is the bf16 block under the `fmt` recipe: the same bytes and
    roofline latency (decode reads fewer weight bytes than in bf16)."""
    from puzzle.cost import Scenario, block_latency

    for spec in (SPEC.blocks[0], SPEC.blocks[1], MLPSpec(width=4096)):
        quantized = dataclasses.replace(spec, weight_format=fmt)
        bf16, by_recipe = Scenario(8, 512, 128), Scenario(8, 512, 128, recipe=fmt)
        assert block_weight_bytes(quantized, 4096) == block_weight_bytes(spec, 4096, fmt)
        assert block_latency(quantized, 4096, bf16, "b200") == block_latency(spec, 4096, by_recipe, "b200")
        slower = block_latency(spec, 4096, bf16, "b200").decode_step_s
        assert block_latency(quantized, 4096, bf16, "b200").decode_step_s < slower


# ------------------------------------------------------------------------------------------ a whole run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny run of run_helpers with attention in fp8 and the MLP in nvfp4 offered, under a weight budget
    that only both quantized blocks meet (nothing else in the space saves weight bytes)."""
    root = tmp_path_factory.mktemp("formats")
    make_inputs(root)
    data = config_dict(root)
    data["space"] = {
        "kinds": {
            "attention": {"weight_format": ["bf16", "fp8"]},
            "mlp": {"weight_format": ["bf16", "nvfp4"]},
            "moe": {"top_k": [1]},
        }
    }
    saved = [
        block_weight_bytes(SPEC.blocks[i], SPEC.hidden_size)
        - block_weight_bytes(dataclasses.replace(SPEC.blocks[i], weight_format=fmt), SPEC.hidden_size)
        for i, fmt in ((1, "fp8"), (2, "nvfp4"))
    ]
    bound = model_weight_bytes(SPEC) - max(saved) - 0.5 * min(saved)  # needs both
    data["search"] = {
        "budgets": [f"weight_bytes<={bound:.1f}", "memory_bytes[chat]<=2x", "throughput[chat]>=0.1x"]
    }
    data["hardware"]["scenarios"]["chat"]["batch_size"] = 4
    return Run.from_config(write_config(root / "config.yaml", data))


def test_a_run_trains_scores_picks_and_assembles_quantized_variants(run):
    library = run.library()
    trained = {v.id: v for v, r in library.results.items() if r.status == "trained"}
    assert {"attn:q4:kv2:d4:fp8", "mlp:w16:nvfp4", "moe:e4:k1:w8:s8"} <= set(trained)
    parent = run.parent()
    # A format-only variant starts from the parent's weights; its forward is quantized, so even there its
    # held-out error is not 0; BLD keeps whichever of those and its (quantization-aware) training is better.
    variant = trained["mlp:w16:nvfp4"]
    parent_mlp = parent.layers[2].mixer.state_dict()
    start = default_init(parent, run.importance())(variant)
    assert start.spec == variant.spec
    assert all(torch.equal(t, parent_mlp[k]) for k, t in start.state_dict().items())
    result = library.results[variant]
    assert result.init_nmse > 0 and result.kept in ("init", "trained")
    kept = library.load_mixer(variant, SPEC.hidden_size).state_dict()
    same = all(torch.equal(t, parent_mlp[k]) for k, t in kept.items())
    assert same == (result.kept == "init")

    scores = run.scores()
    kl = {v.id: record.kl for v, record in scores.variants.items()}
    assert kl["mlp:w16:nvfp4"] > 0 and kl["attn:q4:kv2:d4:fp8"] > 0
    assert kl["mlp:w16:nvfp4"] != kl.get("mlp:w16", 0.0)

    (solution,) = run.search()
    child = run.assemble(solution)
    assert weight_formats(child.spec) == {1: "fp8", 2: "nvfp4"}
    blocks = child.assembly.to_dict()["solution"]
    assert [b.get("weight_format", "bf16") for b in blocks] == ["bf16", "fp8", "nvfp4", "bf16"]

    # The child's logits are those of a bf16-spec model with the library's (master) weights and the covered
    # weights fake-quantized by hand twice: assembly bakes fake_quantize(master) into the child, and the
    # child's forward quantizes those baked weights again, as a server quantizes the exported values.
    # Fake quantization is not exactly idempotent: nvfp4's global scale g = amax / 2688 is recomputed from
    # the baked weights, whose amax is 2688 * g rounded to fp32, so g may move by an ulp (whether it does
    # depends on the trained weights, and so on the CPU's arithmetic: the oracle must not rely on it).
    plain = ModelSpec(SPEC.vocab_size, SPEC.hidden_size, tuple(_bf16(b) for b in child.spec.blocks))
    reference = HybridLM(plain)
    state = dict(parent.state_dict())
    for block in blocks:
        if block["source"] != "library":
            continue
        i = block["block"]
        master = library.load_mixer(Variant(i, child.spec.blocks[i]), SPEC.hidden_size).state_dict()
        for name, tensor in master.items():
            hand = name in COVERED.get(child.spec.blocks[i].kind, ())
            fmt = block.get("weight_format", "bf16")
            state[f"layers.{i}.mixer.{name}"] = (
                fake_quantize(tensor, fmt) if hand and fmt != "bf16" else tensor
            )
    baked = dict(state)
    for block in blocks:
        fmt = block.get("weight_format", "bf16")
        for name in COVERED.get(child.spec.blocks[block["block"]].kind, ()) if fmt != "bf16" else ():
            key = f"layers.{block['block']}.mixer.{name}"
            state[key] = fake_quantize(baked[key], fmt)
    reference.load_state_dict(state)
    for block in blocks:  # fp8 blocks by hand too: each matmul's input quantized per token
        if block.get("weight_format") == "fp8":
            mixer = reference.layers[block["block"]].mixer
            for name in COVERED[child.spec.blocks[block["block"]].kind]:
                mixer.get_submodule(name.removesuffix(".weight")).register_forward_pre_hook(
                    quantize_input_hook
                )
    ids = torch.randint(0, SPEC.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(child(ids).logits, reference(ids).logits, rtol=0, atol=0)
        # The child carries the fake-quantized values themselves (what an export writes).
        for name in COVERED["mlp"]:
            assert torch.equal(child.layers[2].mixer.state_dict()[name], baked[f"layers.2.mixer.{name}"])


def test_the_search_and_puzzle_costs_agree_on_a_mixed_precision_child(run, tmp_path, capsys):
    (solution,) = run.search()
    child = run.assemble(solution)
    spec = child.spec
    assert weight_formats(spec)  # mixed precision
    chat = run.cost_model().scenarios["chat"]
    totals = solution.totals
    assert totals["weight_bytes[bf16]"] == pytest.approx(model_weight_bytes(spec), rel=1e-12)
    context = chat.prompt_tokens + chat.generated_tokens
    memory = model_weight_bytes(spec, chat.recipe) + chat.batch_size * state_bytes_per_request(spec, context)
    assert totals["memory_bytes[chat]"] == pytest.approx(memory, rel=1e-12)
    performance = model_performance(spec, chat, run.cost_model().profile)
    assert totals["seconds[chat]"] == pytest.approx(performance.total_s, rel=1e-9)

    path = tmp_path / "child.json"
    path.write_text(spec.to_json())
    assert puzzle_main(["costs", str(path), "--json"]) == 0
    costs = json.loads(capsys.readouterr().out)
    assert costs["weight_formats"] == {"1": "fp8", "2": "nvfp4"}
    assert costs["weight_bytes"] == int(-(-totals["weight_bytes[bf16]"] // 1))  # rounded up to whole bytes
    bf16_child = ModelSpec(spec.vocab_size, spec.hidden_size, tuple(_bf16(b) for b in spec.blocks))
    assert costs["weight_bytes"] < model_weight_bytes(bf16_child)


def test_the_assembled_child_exports_in_its_formats_and_loads_back(run, tmp_path):
    """`puzzle.export` of the mixed child writes each block in its spec's format (compressed-tensors config
    groups, recorded in puzzle.json) without being told, and `puzzle.load` dequantizes it to the child's
    logits; `weight_formats={}` writes it unquantized (llama.cpp), its weights the fake-quantized values."""
    pytest.importorskip("compressed_tensors")
    import puzzle
    from puzzle.export import export

    (solution,) = run.search()
    child = run.assemble(solution)
    path = export(child, tmp_path / "child")
    config = json.loads((path / "config.json").read_text())
    targets = {
        fmt: {re.search(r"layers\\.(\d+)\\.", t).group(1) for t in group["targets"]}
        for group in config["quantization_config"]["config_groups"].values()
        for fmt in ["nvfp4" if group["weights"]["num_bits"] == 4 else "fp8"]
    }
    assert targets == {"fp8": {"1"}, "nvfp4": {"2"}}
    assert json.loads((path / "puzzle.json").read_text())["weight_formats"] == {
        "backbone.layers.1.mixer": "fp8",
        "backbone.layers.2.mixer": "nvfp4",
    }
    ids = torch.randint(0, SPEC.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = child(ids).logits
        torch.testing.assert_close(
            puzzle.load(path, dtype="float32")(ids).logits, expected, rtol=1e-5, atol=0
        )
        plain = export(child, tmp_path / "plain", weight_formats={})
        assert "quantization_config" not in json.loads((plain / "config.json").read_text())
        # The unquantized export holds what the child multiplies by: its baked weights quantized once more,
        # computed as a bf16 model (no fp8 activations: an engine serving it unquantized has none).
        with contextlib.ExitStack() as stack:
            for index in weight_formats(child.spec):
                stack.enter_context(fake_quantized(child.layers[index].mixer))
            effective = {name: tensor.clone() for name, tensor in child.state_dict().items()}
        unquantized = HybridLM(without_weight_formats(child.spec)).eval()
        unquantized.load_state_dict(effective)
        torch.testing.assert_close(
            puzzle.load(plain, dtype="float32")(ids).logits, unquantized(ids).logits, rtol=0, atol=0
        )
