"""Quantized exports (`puzzle.nemotron_h.quantized`): vLLM's reading of the quantization_config replayed from
its source (`puzzle.nemotron_h.vllm_quant_replay`: every quantized module resolves to its scheme, every other
to none), the stored tensors read by compressed-tensors' own decompressors, and `puzzle.load` of the export
giving the fake-quantized child's logits."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import puzzle
from puzzle.export import export
from puzzle.model import HybridLM
from puzzle.nemotron_h import CheckpointError, quantized
from puzzle.nemotron_h.checkpoint import convert_checkpoint, save_pretrained
from puzzle.nemotron_h.vllm_quant_replay import VllmQuantError, resolve
from puzzle.quant import QuantError, nvfp4_global_scale
from puzzle.quant_blocks import fake_quantize_mixer_
from puzzle.spec import (
    AttentionSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
    weight_formats,
    with_weight_formats,
)

pytest.importorskip(
    "compressed_tensors"
)  # the [quant] extra (in dev): writes the config, reads as the oracle

# Every kind twice (dimensions multiples of 16, as nvfp4 needs; one expert width, as vLLM needs).
SPEC = ModelSpec(
    vocab_size=64,
    hidden_size=32,
    blocks=(
        MambaSpec(num_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=8),
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
        MoESpec(num_experts=4, top_k=2, expert_width=16, shared_width=32, latent_size=16),
        MLPSpec(width=32),
        MambaSpec(num_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=8),
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
        MoESpec(num_experts=4, top_k=2, expert_width=16, shared_width=32),
        MLPSpec(width=32),
    ),
)
# Each kind in each format, one block left out and one explicitly bf16.
FORMATS = {
    "backbone.layers.0.mixer": "nvfp4",
    "backbone.layers.1.mixer": "fp8",
    "backbone.layers.2.mixer": "nvfp4",
    "backbone.layers.3.mixer": "fp8",
    "backbone.layers.4.mixer": "fp8",
    "backbone.layers.5.mixer": "nvfp4",
    "backbone.layers.6.mixer": "fp8",
    "backbone.layers.7.mixer": "bf16",
}
LINEAR_SCHEME = {"fp8": "CompressedTensorsW8A8Fp8", "nvfp4": "CompressedTensorsW4A4Fp4(use_a16=True)"}
MOE_SCHEME = {
    "fp8": "CompressedTensorsW8A8Fp8MoEMethod",
    "nvfp4": "CompressedTensorsW4A4Nvfp4MoEMethod(use_a16=True)",
}


def _model(seed: int = 0) -> HybridLM:
    torch.manual_seed(seed)
    model = HybridLM(SPEC)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(std=0.3 if parameter.dim() > 1 else 0.1)
            if name.endswith("norm.weight"):
                parameter.add_(1.0)
    return model.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[HybridLM, Path]:
    model = _model()
    path = export(model, tmp_path_factory.mktemp("quant") / "child", weight_formats=FORMATS)
    return model, path


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _header(path: Path) -> dict[str, tuple[str, list[int]]]:
    with safe_open(path / "model.safetensors", "pt") as handle:
        return {k: (handle.get_slice(k).get_dtype(), handle.get_slice(k).get_shape()) for k in handle.keys()}  # noqa: SIM118


# ------------------------------------------------------------------------------- vLLM's reading, replayed


def test_vllm_resolves_every_quantized_module_to_its_scheme_and_every_other_to_none(exported):
    _, path = exported
    config = _config(path)
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["quantization_config"]["format"] == "mixed-precision"
    layers = resolve(config)
    by_block = {i: FORMATS.get(f"backbone.layers.{i}.mixer", "bf16") for i in range(SPEC.num_blocks)}
    seen = set()
    for layer in layers:
        if layer.name.startswith("model.layers."):
            fmt = by_block[int(layer.name.split(".")[2])]
            table = MOE_SCHEME if layer.module_class == "RoutedExperts" else LINEAR_SCHEME
            assert layer.scheme == table.get(fmt), layer
            seen.add(layer.module_class)
        else:  # embeddings and lm_head stay unquantized
            assert layer.scheme is None, layer
    # Every quantized module kind was seen: Mamba, fused qkv, o_proj, MLP / shared / latent, routed experts.
    assert {"MergedColumnParallelLinear", "QKVParallelLinear", "RoutedExperts", "ReplicatedLinear"} <= seen
    names = {layer.name for layer in layers}
    assert (
        "model.layers.2.mixer.fc1_latent_proj" in names
        and "model.layers.6.mixer.shared_experts.up_proj" in names
    )


def test_the_replay_catches_targets_vllm_would_resolve_otherwise(exported):
    """The checks above can fail: exact per-expert targets make vLLM refuse the MoE block (its non-gated experts
    resolve through `experts.0.None`, which only a pattern matches), and a q/k/v group missing k_proj leaves
    the fused qkv_proj unquantized."""
    _, path = exported
    config = _config(path)
    broken = copy.deepcopy(config)
    for group in broken["quantization_config"]["config_groups"].values():
        group["targets"] = [t for t in group["targets"] if not t.startswith("re:")] + [
            f"backbone.layers.{i}.mixer.experts.{j}.{proj}"
            for i in (2, 6)
            if any(f"layers\\.{i}\\." in t for t in group["targets"])
            for j in range(4)
            for proj in ("up_proj", "down_proj")
        ]
    with pytest.raises(VllmQuantError, match="All MoE projections need to have same quantization scheme"):
        resolve(broken)
    broken = copy.deepcopy(config)
    for group in broken["quantization_config"]["config_groups"].values():
        group["targets"] = [t for t in group["targets"] if not t.endswith(r"layers\.1\.mixer\.k_proj$")]
    qkv = next(layer for layer in resolve(broken) if layer.name == "model.layers.1.mixer.qkv_proj")
    assert qkv.scheme is None


def test_stored_tensors_are_what_vllm_allocates_and_compressed_tensors_decompresses(exported):
    """Names, dtypes and shapes of vLLM's create_weights (W8A8Fp8: weight fp8 [out, in], weight_scale fp32
    [out, 1]; W4A4Fp4: weight_packed uint8 [out, in/2], weight_scale fp8 [out, in/16], weight_global_scale
    fp32 [1] per shard); compressed-tensors' decompressors give the weights puzzle.load reads back."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme

    _, path = exported
    header = _header(path)
    assert header["backbone.layers.1.mixer.q_proj.weight"] == ("F8_E4M3", [32, 32])
    assert header["backbone.layers.1.mixer.q_proj.weight_scale"] == ("F32", [32, 1])
    assert header["backbone.layers.0.mixer.in_proj.weight_packed"] == ("U8", [100, 16])
    assert header["backbone.layers.0.mixer.in_proj.weight_scale"] == ("F8_E4M3", [100, 2])
    assert header["backbone.layers.0.mixer.in_proj.weight_global_scale"] == ("F32", [1])
    assert header["backbone.layers.2.mixer.experts.3.down_proj.weight_packed"] == ("U8", [16, 8])
    # Not quantized: norms, router, conv1d, SSM parameters, the bf16 block, embeddings, lm_head.
    for name in (
        "backbone.layers.0.mixer.conv1d.weight",
        "backbone.layers.0.mixer.A_log",
        "backbone.layers.2.mixer.gate.weight",
        "backbone.layers.7.mixer.up_proj.weight",
        "backbone.layers.3.norm.weight",
        "backbone.embeddings.weight",
        "lm_head.weight",
    ):
        assert header[name][0] == "F32", name
    groups = _config(path)["quantization_config"]["config_groups"].values()
    schemes = {g["format"]: QuantizationScheme.model_validate(g) for g in groups}
    loaded = puzzle.load(path, dtype=torch.float32)
    state = dict(loaded.named_parameters())
    with safe_open(path / "model.safetensors", "pt") as handle:
        fp8 = {
            s: handle.get_tensor(f"backbone.layers.1.mixer.o_proj.{s}") for s in ("weight", "weight_scale")
        }
        out = FloatQuantizationCompressor.decompress(fp8, schemes["float-quantized"])["weight"]
        torch.testing.assert_close(out.float(), state["layers.1.mixer.o_proj.weight"], rtol=0, atol=0)
        suffixes = ("weight_packed", "weight_scale", "weight_global_scale")
        nv = {s: handle.get_tensor(f"backbone.layers.0.mixer.out_proj.{s}") for s in suffixes}
        out = NVFP4PackedCompressor.decompress(nv, schemes["nvfp4-pack-quantized"])["weight"]
        # compressed-tensors unpacks to bf16: one bf16 rounding of our fp32 values
        ours = state["layers.0.mixer.out_proj.weight"]
        torch.testing.assert_close(out.float(), ours.to(torch.bfloat16).float(), rtol=2**-8, atol=0)


def test_q_k_v_share_one_nvfp4_global_scale(exported):
    model, path = exported
    with safe_open(path / "model.safetensors", "pt") as handle:
        stored = [handle.get_tensor(f"backbone.layers.5.mixer.{p}_proj.weight_global_scale") for p in "qkv"]
    assert stored[0] == stored[1] == stored[2]
    mixer = model.layers[5].mixer
    g = nvfp4_global_scale(mixer.q_proj.weight, mixer.k_proj.weight, mixer.v_proj.weight)
    torch.testing.assert_close(stored[0], (1.0 / g).reshape(1), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- reading back


def _served(model: HybridLM) -> HybridLM:
    """`model`'s weights under the spec of its exported FORMATS: each block's forward fake-quantizes its
    weights (and, fp8, its matmuls' inputs per token) as the engines serve the export."""
    formats = {int(key.split(".")[2]): fmt for key, fmt in FORMATS.items()}
    served = HybridLM(with_weight_formats(SPEC, formats)).eval()
    served.load_state_dict(model.state_dict())
    return served


def test_load_of_the_export_gives_the_fake_quantized_childs_logits(exported):
    model, path = exported
    child = _served(model)
    loaded = puzzle.load(path, dtype=torch.float32)
    ids = torch.randint(0, SPEC.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got, plain = child(ids).logits, loaded(ids).logits, model(ids).logits
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale
    assert (plain - want).abs().max() > 1e-3 * scale  # quantization moved the logits: the check has teeth
    assert json.loads((path / "puzzle.json").read_text())["weight_formats"] == FORMATS


def test_a_loaded_export_keeps_its_block_formats_and_its_logits(exported):
    """The loaded model's spec carries each block's format (read from the stored tensors), and its quantized
    forward, which fake-quantizes the already-quantized weights again, gives the logits of the master
    weights under the same formats exactly: on the format's grid fake quantization is the identity, bit for
    bit."""
    model, path = exported
    loaded = puzzle.load(path, dtype=torch.float32)
    expected = {int(k.split(".")[2]): f for k, f in FORMATS.items() if f != "bf16"}
    assert weight_formats(loaded.spec) == expected
    ids = torch.randint(0, SPEC.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = loaded(ids).logits, _served(model)(ids).logits
    assert torch.equal(got, want)


def _outlier_mlp(weight_format: str = "bf16") -> HybridLM:
    """Issue 35 §2's repro: one MLP block, N(0, 0.3) weights and up_proj[3, 5] = 1e5, so most of up_proj's
    nvfp4 block scales are E4M3 subnormals."""
    torch.manual_seed(0)
    block = MLPSpec(width=64, weight_format=weight_format)
    model = HybridLM(ModelSpec(vocab_size=64, hidden_size=64, blocks=(block,))).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(std=0.3 if parameter.dim() > 1 else 0.1)
            if name.endswith("norm.weight"):
                parameter.add_(1.0)
        model.layers[0].mixer.up_proj.weight[3, 5] = 1e5
    return model


def _nvfp4_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118


@pytest.mark.parametrize("route", ["assembled", "weight_formats"])
def test_an_nvfp4_outlier_child_is_stored_loaded_and_saved_again_exactly(tmp_path, route):
    """Issue 35 §2, end to end, both ways a child reaches an export: assembled (an nvfp4 spec, the weights
    baked as assembly bakes them) and a plain model exported with weight_formats (its child: the mixer
    fake-quantized in place). The baked weights are the forward's; compressed-tensors' own unpacking and
    dequantization of the export gives them (its division by the stored encode scale within 2 fp32 ulps of
    our multiplication); `puzzle.load` gives the child's logits exactly; saving the loaded model again writes
    the same bytes (was: 25% off in 74 elements, logits 0.104 off, 304 packed bytes and 38 block scales
    changed)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    from puzzle.blocks import formats

    if route == "assembled":
        child = _outlier_mlp("nvfp4")
        formats.bake(child.layers[0].mixer)
        mixer = child.layers[0].mixer
        baked = {name: getattr(mixer, name).weight.detach().clone() for name in ("up_proj", "down_proj")}
        with formats.fake_quantized(mixer):
            for name, weight in baked.items():
                assert torch.equal(getattr(mixer, name).weight, weight), name  # bake equals forward
        path = export(child, tmp_path / "child")
    else:
        model = _outlier_mlp()
        child = copy.deepcopy(model)
        fake_quantize_mixer_(child.layers[0].mixer, model.spec.blocks[0], 64, "nvfp4")
        mixer = child.layers[0].mixer
        baked = {name: getattr(mixer, name).weight.detach().clone() for name in ("up_proj", "down_proj")}
        path = export(model, tmp_path / "child", weight_formats={"layers.0": "nvfp4"})
    stored = _nvfp4_tensors(path)
    (group,) = _config(path)["quantization_config"]["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    for name, weight in baked.items():
        module = f"backbone.layers.0.mixer.{name}"
        packed = stored[f"{module}.weight_packed"]
        values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        theirs = dequantize(
            x_q=values,
            scale=stored[f"{module}.weight_scale"].float(),
            args=scheme.weights,
            global_scale=stored[f"{module}.weight_global_scale"],
            dtype=torch.float32,
        )
        torch.testing.assert_close(theirs, weight, rtol=2**-22, atol=0)
    loaded = puzzle.load(path, dtype=torch.float32)
    for name, weight in baked.items():
        assert torch.equal(getattr(loaded.layers[0].mixer, name).weight, weight), name
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, child(ids).logits)
    again = save_pretrained(loaded, tmp_path / "again")
    first, second = stored, _nvfp4_tensors(again)
    assert first.keys() == second.keys()
    for key, tensor in first.items():
        width = torch.uint8 if tensor.element_size() == 1 else torch.int32  # bits, not values
        assert torch.equal(tensor.view(width), second[key].view(width)), key
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()


def test_a_partly_quantized_block_loads_exactly_under_its_plain_spec(exported):
    """A block whose covered weights are not all stored quantized (another tool's choice of targets) keeps
    its bf16 spec, so its plain weights are not fake-quantized in the forward."""
    _, path = exported
    from puzzle.nemotron_h.weights import map_checkpoint, open_safetensors, weight_files

    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(open_safetensors(f)) for f in weight_files(path)}
        sources = quantized.dequantizing_sources(map_checkpoint(handles)[0], str(path))
    assert weight_formats(quantized.spec_with_formats(SPEC, sources)) == {
        int(k.split(".")[2]): f for k, f in FORMATS.items() if f != "bf16"
    }
    dropped = {k: v for k, v in sources.items() if k != "layers.1.mixer.q_proj.weight"}
    dropped["layers.1.mixer.q_proj.weight"] = sources["layers.0.mixer.in_proj.weight"].parts[0][1]
    assert 1 not in weight_formats(quantized.spec_with_formats(SPEC, dropped))


def test_a_loaded_quantized_export_saves_in_its_formats_or_plain_and_convert_refuses_it(exported, tmp_path):
    """Saved again, a loaded export keeps its formats and stores the same bytes: quantized codes, block
    scales, fp8's per-channel and nvfp4's global scales (its weights are on the grid); `weight_formats={}`
    saves it plain."""
    _, path = exported
    loaded = puzzle.load(path, dtype=torch.float32)
    again = save_pretrained(loaded, tmp_path / "again")
    assert (
        _config(again)["quantization_config"]["config_groups"]
        == _config(path)["quantization_config"]["config_groups"]
    )
    with (
        safe_open(path / "model.safetensors", "pt") as first,
        safe_open(again / "model.safetensors", "pt") as second,
    ):
        assert set(first.keys()) == set(second.keys())
        for key in first.keys():  # noqa: SIM118
            a, b = first.get_tensor(key), second.get_tensor(key)
            width = torch.uint8 if a.element_size() == 1 else torch.int32  # compare bits, not values
            assert torch.equal(a.view(width), b.view(width)), key
    saved = save_pretrained(loaded, tmp_path / "plain", weight_formats={})
    assert "quantization_config" not in _config(saved)
    assert all(dtype == "F32" for dtype, _ in _header(saved).values())
    with pytest.raises(CheckpointError, match="describes a quantized checkpoint; puzzle convert"):
        convert_checkpoint(path, tmp_path / "converted")


def test_other_quantized_checkpoints_are_refused(exported, tmp_path):
    _, path = exported
    foreign = tmp_path / "modelopt"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    config = _config(path)
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (foreign / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method 'modelopt'"):
        puzzle.load(foreign)
    config["quantization_config"] = copy.deepcopy(_config(path)["quantization_config"])
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (foreign / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="puzzle reads back compressed-tensors fp8"):
        puzzle.load(foreign)


# ------------------------------------------------------------------------------------------- puzzle costs


def _costs(capsys, target: Path) -> dict:
    from puzzle.cli import main

    code = main(["costs", str(target), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return {key: value for key, value in json.loads(captured.out).items() if key != "target"}


def test_costs_of_a_quantized_export_are_those_of_its_spec_with_formats(exported, capsys, tmp_path):
    """`puzzle costs EXPORT` (and of its config.json) counts each block's weights in the format they are
    stored in: the figures of the model spec JSON with the same per-block formats, not bf16's."""
    _, path = exported
    blocks = list(SPEC.blocks)
    for key, fmt in FORMATS.items():
        index = int(key.split(".")[2])
        blocks[index] = dataclasses.replace(blocks[index], weight_format=fmt)
    spec_file = tmp_path / "child.spec.json"
    spec_file.write_text(dataclasses.replace(SPEC, blocks=tuple(blocks)).to_json())
    want = _costs(capsys, spec_file)
    assert want["weight_formats"] == {k.split(".")[2]: f for k, f in FORMATS.items() if f != "bf16"}
    assert _costs(capsys, path) == want
    assert _costs(capsys, path / "config.json") == want
    plain = tmp_path / "plain.spec.json"
    plain.write_text(SPEC.to_json())
    assert want["weight_bytes"] < 0.6 * _costs(capsys, plain)["weight_bytes"]


def test_costs_of_quantized_configs_without_weights_or_of_another_tool(exported, capsys, tmp_path):
    """A compressed-tensors config.json without its weights cannot say its blocks' formats: a clear error,
    not bf16 figures. Another tool's quantized checkpoint (ModelOpt) is costed by its architecture, as before."""
    from puzzle.cli import main

    _, path = exported
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "config.json").write_text((path / "config.json").read_text())
    for target in (alone, alone / "config.json"):
        assert main(["costs", str(target)]) == 2
        err = capsys.readouterr().err
        assert "describes a quantized checkpoint, whose blocks' formats are read from its weight files" in err
        assert "has no safetensors weights" in err
    config = _config(path)
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (alone / "config.json").write_text(json.dumps(config))
    plain = tmp_path / "plain.spec.json"
    plain.write_text(SPEC.to_json())
    got = _costs(capsys, alone)
    assert got["weight_formats"] == {} and got["weight_bytes"] == _costs(capsys, plain)["weight_bytes"]


# ------------------------------------------------------------------------------------------- refusals


def test_plan_refusals(tmp_path):
    model = _model()
    # module-name prefixes are read at the edge (save_pretrained / export), before anything is written
    with pytest.raises(QuantError, match=r"expected backbone\.layers\.I\.mixer"):
        save_pretrained(model, tmp_path / "part", weight_formats={"backbone.layers.3.mixer.up_proj": "fp8"})
    with pytest.raises(QuantError, match="unknown weight format 'int4'"):
        save_pretrained(model, tmp_path / "int4", weight_formats={"backbone.layers.3.mixer": "int4"})
    with pytest.raises(CheckpointError, match="not both"):
        save_pretrained(model, tmp_path / "both", weight_formats={}, block_weight_formats={})
    assert not any((tmp_path / name).exists() for name in ("part", "int4", "both"))
    odd = HybridLM(ModelSpec(vocab_size=64, hidden_size=32, blocks=(MLPSpec(width=24),)))
    with pytest.raises(QuantError, match=r"layers\.0\.mixer\.down_proj\.weight: nvfp4 needs in_features"):
        save_pretrained(odd, tmp_path / "odd", weight_formats={"backbone.layers.0.mixer": "nvfp4"})
    assert not (tmp_path / "odd").exists()  # refused before anything was written
    save_pretrained(
        odd, tmp_path / "odd", weight_formats={"backbone.layers.0.mixer": "fp8"}
    )  # fp8 has no blocks


@pytest.mark.parametrize(
    ("formats", "message"),
    [
        (  # a no-op block has nothing to quantize: exporting it plain would hide a wrong block index
            {"backbone.layers.1.mixer": "fp8"},
            r"^weight format 'fp8' for block 1 \(backbone\.layers\.1\.mixer, a noop block\): it has no matmul "
            r"weights to store in fp8; name a block with weights or give it 'bf16'$",
        ),
        (
            {0: "nvfp4"},
            r"^weight format key 0 \(int\): expected a string 'backbone\.layers\.0\.mixer' \(or "
            r"'backbone\.layers\.I', or either without 'backbone\.'\) with I a block index below 2$",
        ),
        (
            ["layers.0"],
            r"^weight formats: expected a mapping \{'backbone\.layers\.I\.mixer': format\}, found list",
        ),
        ({"layers.0": 8}, r"^weight format of 'layers\.0': unknown weight format 8; choose one of"),
    ],
)
def test_export_refuses_weight_formats_it_cannot_apply(tmp_path, formats, message):
    """One-line errors naming the key or block, before anything is written."""
    model = HybridLM(ModelSpec(vocab_size=64, hidden_size=32, blocks=(MLPSpec(width=32), NoOpSpec())))
    with pytest.raises(QuantError, match=message):
        export(model, tmp_path / "child", weight_formats=formats)
    assert not (tmp_path / "child").exists()


def test_only_bf16_blocks_write_no_quantization_config(tmp_path):
    """Formats that quantize nothing ('bf16', also for a no-op block) give a plain checkpoint, not an empty
    compressed-tensors config."""
    model = HybridLM(ModelSpec(vocab_size=64, hidden_size=32, blocks=(MLPSpec(width=32), NoOpSpec())))
    path = export(model, tmp_path / "child", weight_formats={"layers.0": "bf16", "layers.1": "bf16"})
    assert "quantization_config" not in _config(path)
    assert {dtype for dtype, _ in _header(path).values()} == {"F32"}


def test_block_indices_module_prefixes_and_the_specs_own_formats_write_the_same_checkpoint(
    exported, tmp_path
):
    """Module-name prefixes are read once at the edge into {block index: format}: the same formats given as
    block indices, or carried by the blocks' own specs (an assembled child's), write the same bytes, and
    puzzle.json records them under their hub names whichever way they were given."""
    model, path = exported
    by_index = {int(key.split(".")[2]): fmt for key, fmt in FORMATS.items()}
    indexed = save_pretrained(model, tmp_path / "indexed", block_weight_formats=by_index)
    assert (indexed / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    assert _config(indexed)["quantization_config"] == _config(path)["quantization_config"]
    blocks = tuple(
        dataclasses.replace(block, weight_format=by_index[i]) for i, block in enumerate(model.spec.blocks)
    )
    own = HybridLM(dataclasses.replace(model.spec, blocks=blocks))
    own.load_state_dict(model.state_dict())
    carried = export(own, tmp_path / "carried")
    assert (carried / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    record = json.loads((carried / "puzzle.json").read_text())["weight_formats"]
    assert record == {key: fmt for key, fmt in FORMATS.items() if fmt != "bf16"}
    short = export(
        _model(), tmp_path / "short", weight_formats={"layers.1": "fp8", "backbone.layers.3": "fp8"}
    )
    assert json.loads((short / "puzzle.json").read_text())["weight_formats"] == {
        "backbone.layers.1.mixer": "fp8",
        "backbone.layers.3.mixer": "fp8",
    }
