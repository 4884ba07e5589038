"""Quantized exports for TensorRT-LLM (`puzzle.nemotron_h.modelopt`): ModelOpt's hf_quant_config.json and tensor
layout, read back by the replay of TensorRT-LLM's loading (`puzzle.nemotron_h.trtllm_quant_replay`), which must
give the fake-quantized weights scoring used: fp8 bit for bit, nvfp4 within fp32 rounding."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import puzzle
from puzzle.export import ExportError, export
from puzzle.model import HybridLM
from puzzle.nemotron_h import CheckpointError, modelopt, trtllm_quant_replay
from puzzle.nemotron_h.engines import engine_problems
from puzzle.nemotron_h.trtllm_quant_replay import TrtllmQuantError, layer_table, read, resolve
from puzzle.nemotron_h.weights import hub_state
from puzzle.quant_blocks import fake_quantize_mixer_, quantized_weights
from puzzle.spec import with_weight_formats
from tests.test_quant_export import FORMATS as QUANT_EXPORT_FORMATS
from tests.test_quant_export import SPEC, _model

# test_quant_export's formats (each kind in fp8 and nvfp4, one block bf16) but its fp8 MoE (block 6) in nvfp4:
# TensorRT-LLM's fused MoE serves nvfp4 only.
FORMATS = {**QUANT_EXPORT_FORMATS, "backbone.layers.6.mixer": "nvfp4"}
BLOCKS = {int(key.split(".")[2]): fmt for key, fmt in FORMATS.items()}
ALGO = {"fp8": "FP8_PER_CHANNEL_PER_TOKEN", "nvfp4": "W4A16_NVFP4", "bf16": None}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[HybridLM, Path]:
    model = _model()
    path = export(
        model,
        tmp_path_factory.mktemp("trtllm") / "child",
        weight_formats=FORMATS,
        format="engine",
        engines=["trtllm"],
    )
    return model, path


def _fake_quantized(model: HybridLM) -> dict[str, torch.Tensor]:
    """The hub weights of `model` with each block's covered weights fake-quantized in its format: the values
    scoring, assembly and `puzzle.load` compute with."""
    served = copy.deepcopy(model)
    for index, fmt in BLOCKS.items():
        if fmt != "bf16":
            fake_quantize_mixer_(served.layers[index].mixer, SPEC.blocks[index], SPEC.hidden_size, fmt)
    return {name: tensor.detach().float() for name, tensor in hub_state(served).items()}


def test_a_mixed_fp8_nvfp4_child_exported_for_trtllm_is_read_exactly(exported):
    """Every module TensorRT-LLM builds gets its block's algo (q/k/v fused, experts as one fused MoE), and every
    matmul weight it loads, dequantized as it dequantizes, is the fake-quantized weight: fp8 bit for bit,
    nvfp4 within fp32 rounding; bf16 blocks and the rest of the model unquantized, as written."""
    model, path = exported
    assert engine_problems(with_weight_formats(SPEC, BLOCKS), ["trtllm"]) == []
    got = read(path)
    for module, algo in got.algos.items():
        assert algo == ALGO[BLOCKS[int(module.split(".")[2])]], module
    # Mamba in/out x2, qkv/o x2, one MLP up/down, MoE experts+shared up/down (+latent fc1/fc2 in block 2)
    assert sum(a is not None for a in got.algos.values()) == 4 + 4 + 2 + 5 + 3
    want = _fake_quantized(model)
    covered = {
        f"backbone.layers.{i}.mixer.{name}": fmt
        for i, fmt in BLOCKS.items()
        for name in quantized_weights(SPEC.blocks[i], SPEC.hidden_size)
    }
    assert set(covered) <= set(got.weights)
    worst = {"fp8": 0.0, "nvfp4": 0.0, "bf16": 0.0}
    for name, value in got.weights.items():
        fmt = covered.get(name, "bf16")
        if fmt == "nvfp4":
            torch.testing.assert_close(value, want[name], rtol=2**-22, atol=0)
            worst[fmt] = max(
                worst[fmt], float(((value - want[name]).abs() / want[name].abs().clamp_min(1e-30)).max())
            )
        else:  # fp8 values times a per-row fp32 scale: one rounding, the same one
            assert torch.equal(value, want[name]), name
    print(
        f"\nTensorRT-LLM replay: {len(got.weights)} weights read, nvfp4 worst relative error {worst['nvfp4']:.2e}"
    )


def test_the_checkpoint_is_modelopts_and_the_record_says_who_reads_it(exported):
    _, path = exported
    table = json.loads((path / modelopt.HF_QUANT_CONFIG).read_text())
    assert table["producer"]["name"] == "modelopt"
    assert table["quantization"]["quant_algo"] == "MIXED_PRECISION"
    layers = table["quantization"]["quantized_layers"]
    assert layers["backbone.layers.0.mixer.in_proj"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    assert layers["backbone.layers.1.mixer.q_proj"] == {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
    assert "backbone.layers.7.mixer.up_proj" not in layers  # bf16: no entry, unquantized
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    record = json.loads((path / "puzzle.json").read_text())
    assert record["quant_layout"]["layout"] == "modelopt" and record["quant_layout"]["read_by"] == ["trtllm"]
    assert record["engines"]["trtllm"] == []
    assert any("ModelOpt's layout" in reason for reason in record["engines"]["vllm"])
    card = (path / "README.md").read_text()
    assert "trtllm-serve ./CHILD" in card
    assert "vllm serve" not in card and "AutoModelForCausalLM" not in card  # neither reads ModelOpt's layout
    with pytest.raises(
        CheckpointError, match="quant_method 'modelopt'"
    ):  # puzzle.load reads compressed-tensors
        puzzle.load(path)


def test_what_trtllm_would_refuse_or_misread_is_caught(exported, tmp_path):
    """The replay has teeth: a k_proj whose algo differs from q_proj's (TensorRT-LLM would quantize the fused
    qkv as q says), an fp8 expert entry (no fused-MoE path), a table naming no module, an inverted nvfp4 global
    scale (compressed-tensors' convention under ModelOpt's name) and a checkpoint without the file."""
    _, path = exported
    config = json.loads((path / "config.json").read_text())
    table = json.loads((path / modelopt.HF_QUANT_CONFIG).read_text())
    layers = table["quantization"]["quantized_layers"]
    for change, message in (
        ({"backbone.layers.5.mixer.k_proj": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}}, "one algo"),
        (
            {
                f"backbone.layers.6.mixer.experts.{e}.{p}": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
                for e in range(4)
                for p in ("up_proj", "down_proj")
            },
            "CutlassFusedMoE",
        ),
        ({"backbone.layers.9.mixer.in_proj": {"quant_algo": "W4A16_NVFP4"}}, "match no module"),
    ):
        with pytest.raises(TrtllmQuantError, match=message):
            resolve(
                config,
                layer_table(
                    {
                        **table,
                        "quantization": {**table["quantization"], "quantized_layers": {**layers, **change}},
                    }
                ),
            )
    from safetensors.torch import load_file, save_file

    inverted = tmp_path / "inverted"
    inverted.mkdir()
    for file in path.iterdir():
        if file.suffix != ".safetensors" and file.is_file():
            (inverted / file.name).write_bytes(file.read_bytes())
    tensors = load_file(path / "model.safetensors")
    key = "backbone.layers.0.mixer.in_proj.weight_scale_2"
    tensors[key] = 1.0 / tensors[key]
    save_file(tensors, inverted / "model.safetensors")
    good, bad = read(path).weights, read(inverted).weights
    name = "backbone.layers.0.mixer.in_proj.weight"
    assert (bad[name] - good[name]).abs().max() > 1e3 * good[name].abs().max()
    (inverted / modelopt.HF_QUANT_CONFIG).unlink()
    with pytest.raises(TrtllmQuantError, match=r"no hf_quant_config\.json"):
        read(inverted)


def test_a_child_trtllm_cannot_read_is_refused_with_its_reason(tmp_path):
    """fp8 routed experts: TensorRT-LLM's fused MoE has no per-channel fp8; and one checkpoint cannot hold both
    layouts, so trtllm with vLLM is refused too. Without trtllm the export stays compressed-tensors."""
    model = _model()
    fp8_moe = {**FORMATS, "backbone.layers.6.mixer": "fp8"}
    with pytest.raises(ExportError, match=r"trtllm: block 6 \(moe\): fp8 routed experts"):
        export(model, tmp_path / "a", weight_formats=fp8_moe, format="engine", engines=["trtllm"])
    with pytest.raises(ExportError, match="ModelOpt's layout"):
        export(model, tmp_path / "b", weight_formats=FORMATS, format="engine", engines=["trtllm", "vllm"])
    path = export(model, tmp_path / "c", weight_formats=FORMATS)
    assert not (path / modelopt.HF_QUANT_CONFIG).exists()
    record = json.loads((path / "puzzle.json").read_text())
    assert record["quant_layout"]["layout"] == "compressed-tensors"
    assert any("compressed-tensors" in reason for reason in record["engines"]["trtllm"])
    with pytest.raises(TrtllmQuantError):
        trtllm_quant_replay.read(path)


def test_trtllm_reads_a_75b_shaped_mixed_child_module_by_module():
    """The Puzzle-75B-A9B-like child (meta weights: names, dtypes and shapes only), its Mamba and MoE blocks in
    nvfp4 and its attention in fp8, as the ModelOpt export writes it: TensorRT-LLM resolves every module to
    its block's algo and finds every tensor it loads in the dtype and shape it allocates."""
    from collections import Counter

    from puzzle.export import export_config
    from puzzle.nemotron_h import quantized
    from puzzle.nemotron_h.stream import model_entries
    from puzzle.nemotron_h.trtllm_quant_replay import check_layout
    from puzzle.presets import puzzle_75b_a9b_like

    with torch.device("meta"):
        child = HybridLM(puzzle_75b_a9b_like())
    kinds = {"mamba": "nvfp4", "moe": "nvfp4", "attention": "fp8"}
    formats = {i: kinds[b.kind] for i, b in enumerate(child.spec.blocks) if b.kind in kinds}
    config = export_config(child, "engine", ["trtllm"], formats)
    plan = quantized.plan(child, formats)
    entries = quantized.quantized_entries(model_entries(child, {}), plan, modelopt.modelopt_names)
    stored = {entry.name: (entry.dtype, list(entry.shape)) for entry in entries}
    algos = check_layout(config, modelopt.hf_quant_config(plan.weights), stored)
    counts = Counter(algo for algo in algos.values())
    by_kind = Counter(child.spec.blocks[i].kind for i in formats)
    # Mamba: in/out; MoE: fused experts, shared up/down, latent fc1/fc2; attention: qkv, o
    assert counts["W4A16_NVFP4"] == 2 * by_kind["mamba"] + 5 * by_kind["moe"]
    assert counts["FP8_PER_CHANNEL_PER_TOKEN"] == 2 * by_kind["attention"]
    assert counts[None] == 0
    print(
        f"\n75B-shaped child ({child.spec.num_blocks} blocks: {dict(by_kind)}): TensorRT-LLM resolves "
        f"{dict(counts)} modules, {len(stored)} tensors checked"
    )


def test_trtllm_cannot_read_our_compressed_tensors_nvfp4_which_is_why_the_second_layout():
    """TensorRT-LLM's compressed-tensors reader, replayed on the config groups our compressed-tensors export
    writes: the fp8 group resolves to FP8_PER_CHANNEL_PER_TOKEN, the weight-only nvfp4 group (NVFP4A16,
    input_activations null) fails, as the mixed NVFP4 + FP8 checkpoint was reported to."""
    from puzzle.nemotron_h import quantized
    from puzzle.nemotron_h.trtllm_quant_replay import compressed_tensors_algo

    plan = quantized.plan(_model(), BLOCKS)
    config = quantized.quantization_config(plan)
    assert config["format"] == "mixed-precision"
    groups = {group["format"]: group for group in config["config_groups"].values()}  # one group per format
    assert compressed_tensors_algo(groups["float-quantized"]) == "FP8_PER_CHANNEL_PER_TOKEN"
    with pytest.raises(TrtllmQuantError, match="input_activations null"):
        compressed_tensors_algo(groups["nvfp4-pack-quantized"])
    w4a4 = {**groups["nvfp4-pack-quantized"], "input_activations": {"strategy": "tensor_group"}}
    assert compressed_tensors_algo(w4a4) == "NVFP4"  # the replay accepts what TensorRT-LLM accepts


def test_a_compressed_tensors_export_over_a_trtllm_one_leaves_no_stale_hf_quant_config(tmp_path):
    """Saved beside the user's files (overwrite=True), the new checkpoint must not keep the old
    hf_quant_config.json: TensorRT-LLM would read the compressed-tensors weights as ModelOpt's."""
    model = _model()
    path = tmp_path / "child"
    path.mkdir()
    (path / "notes.txt").write_text("the user's")
    export(model, path, weight_formats=FORMATS, format="engine", engines=["trtllm"], overwrite=True)
    assert (path / modelopt.HF_QUANT_CONFIG).is_file()
    export(model, path, weight_formats=FORMATS, overwrite=True)
    assert not (path / modelopt.HF_QUANT_CONFIG).exists() and (path / "notes.txt").is_file()
