"""transformers reads puzzle's quantized exports as the engines serve them, or they are not written for it.

The oracle is transformers itself (`AutoModelForCausalLM.from_pretrained` with compressed-tensors 0.20.1, its
quantized forward enabled): plain `NemotronHForCausalLM` for a `nemotron_h` export, the trust_remote_code
model for a `nemotron_h_puzzle` one, compared with `puzzle.load` of the same export. What plain transformers
cannot run as served (nvfp4 routed experts, which it misreads; fp8 MoE, whose fused experts skip the fp8
activations) makes the export the remote-code type, and `format="nemotron_h"` refuses it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import puzzle
from puzzle.export import export
from puzzle.model import HybridLM
from puzzle.nemotron_h import CheckpointError
from puzzle.quant_blocks import quantized_weights
from puzzle.spec import AttentionSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, without_weight_formats

pytest.importorskip("compressed_tensors")  # the [quant] extra (in dev)
transformers = pytest.importorskip("transformers")

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
        MoESpec(num_experts=4, top_k=2, expert_width=16, shared_width=32, latent_size=16),
        MLPSpec(width=32),
    ),
)
DENSE = (0, 1, 3, 4, 5, 7)  # every block but the MoEs
IDS = torch.randint(0, SPEC.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))


def _child() -> HybridLM:
    # Weights at the scale of a trained model's, so that a bf16 forward stays close to the fp32 one.
    torch.manual_seed(0)
    model = HybridLM(SPEC)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(std=0.08 if parameter.dim() > 1 else 0.05)
            if name.endswith("norm.weight"):
                parameter.add_(1.0)
    return model.eval()


def _export(path: Path, formats: dict[int, str], **kwargs) -> Path:
    return export(
        _child(), path, weight_formats={f"backbone.layers.{i}.mixer": f for i, f in formats.items()}, **kwargs
    )


def _model_type(path: Path) -> str:
    return json.loads((path / "config.json").read_text())["model_type"]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


def _transformers(path: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _quantized_modules(model) -> set[str]:
    """The modules compressed-tensors matched to a scheme, named as the hub names them."""
    return {
        re.sub(r"^model\.", "backbone.", name)
        for name, module in model.named_modules()
        if getattr(module, "quantization_scheme", None) is not None
    }


def _planned_modules(formats: dict[int, str]) -> set[str]:
    return {
        f"backbone.layers.{i}.mixer.{name.removesuffix('.weight')}"
        for i, fmt in formats.items()
        if fmt != "bf16"
        for name in quantized_weights(SPEC.blocks[i], SPEC.hidden_size)
    }


def test_plain_transformers_serves_fp8_blocks_as_puzzle_computes_them(tmp_path):
    """Every planned module gets its scheme in NemotronHForCausalLM (named `model.…` there), and its logits at
    the default dtype equal `puzzle.load`'s within fp32 rounding, per-token fp8 activations included. With
    exact `backbone.…` targets, as exports wrote them before, nothing matches and the logits are far off."""
    formats = dict.fromkeys(DENSE, "fp8")
    path = _export(tmp_path / "fp8", formats)
    assert _model_type(path) == "nemotron_h"
    want = _logits(puzzle.load(path, dtype=torch.float32))
    model = _transformers(path)
    assert type(model).__name__ == "NemotronHForCausalLM"
    assert _quantized_modules(model) == _planned_modules(formats)
    got = _logits(model)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()

    config = json.loads((path / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["targets"] = [
            "backbone." + re.sub(r"\\\.", ".", t.removeprefix("re:^(?:backbone|model)\\.").removesuffix("$"))
            for t in group["targets"]
        ]
    (path / "config.json").write_text(json.dumps(config))
    old = _transformers(path)
    assert _quantized_modules(old) == set()
    assert (_logits(old) - want).abs().max() > 0.1 * want.abs().max()


def test_plain_transformers_reads_nvfp4_dense_blocks_within_bf16_error(tmp_path):
    """nvfp4 decompresses to bf16 in transformers: loaded in bf16, its logits are as close to the fp32
    `puzzle.load` as puzzle's own bf16 forward is (random weights would be ~100% off)."""
    formats = {0: "nvfp4", 1: "nvfp4", 3: "nvfp4", 4: "fp8", 5: "nvfp4", 7: "fp8"}
    path = _export(tmp_path / "nvfp4", formats)
    assert _model_type(path) == "nemotron_h"
    want = _logits(puzzle.load(path, dtype=torch.float32))
    bf16_error = (_logits(puzzle.load(path, dtype=torch.bfloat16)) - want).abs().max()
    model = _transformers(path, dtype=torch.bfloat16)
    assert _quantized_modules(model) == _planned_modules(formats)
    assert (_logits(model) - want).abs().max() <= 2 * bf16_error


@pytest.mark.parametrize(
    ("fmt", "reason"),
    [("nvfp4", "nvfp4 routed experts"), ("fp8", "fp8 MoE")],
)
def test_quantized_moe_blocks_export_as_the_remote_code_type(tmp_path, fmt, reason):
    """transformers misreads nvfp4 routed experts (no weight_global_scale) and runs fp8 ones without their
    activations: such a child is written as nemotron_h_puzzle, plain nemotron_h is refused saying why, and
    puzzle.json lists the reason under transformers."""
    path = _export(tmp_path / "auto", {2: fmt})
    assert _model_type(path) == "nemotron_h_puzzle"
    record = json.loads((path / "puzzle.json").read_text())
    assert any(reason in problem for problem in record["engines"]["transformers"])
    with pytest.raises(CheckpointError, match=reason):
        _export(tmp_path / "plain", {2: fmt}, format="nemotron_h")
    assert not (tmp_path / "plain").exists()


def test_the_remote_code_computes_puzzles_fp8_forward(tmp_path):
    """The trust_remote_code model, whose matmuls compressed-tensors' quantized forward runs (weights and
    per-token fp8 activations: routed experts, latent and shared projections included), gives puzzle's
    logits within fp32 rounding at the default dtype and at dtype="auto"; both sides did quantize the
    activations (without them the logits move)."""
    from compressed_tensors.quantization import disable_quantization

    formats = dict.fromkeys(range(SPEC.num_blocks), "fp8")
    path = _export(tmp_path / "fp8", formats)
    assert _model_type(path) == "nemotron_h_puzzle"
    loaded = puzzle.load(path, dtype=torch.float32)
    want = _logits(loaded)
    scale = want.abs().max()
    for kwargs in ({}, {"dtype": "auto"}):
        model = _transformers(path, trust_remote_code=True, **kwargs)
        assert _quantized_modules(model) == _planned_modules(formats)  # routed experts one by one
        assert (_logits(model) - want).abs().max() <= 1e-5 * scale
    model.apply(disable_quantization)
    weights_only = HybridLM(without_weight_formats(loaded.spec)).eval()
    weights_only.load_state_dict(loaded.state_dict())
    assert (_logits(model) - _logits(weights_only)).abs().max() <= 1e-5 * scale
    assert (_logits(weights_only) - want).abs().max() > 1e-3 * scale


def test_the_remote_code_runs_an_fp32_childs_nvfp4_export_at_default_dtypes(tmp_path):
    """compressed-tensors decompresses nvfp4 weights to bf16; the remote code widens them to the model's
    dtype, so an fp32 child's export runs at the default dtype, "auto" and float32 (it raised a dtype
    mismatch), within the bf16 rounding of those weights."""
    formats = dict.fromkeys(range(SPEC.num_blocks), "nvfp4")
    path = _export(tmp_path / "nvfp4", formats)
    loaded = puzzle.load(path, dtype=torch.float32)
    want = _logits(loaded)
    rounded = HybridLM(without_weight_formats(loaded.spec)).eval()
    rounded.load_state_dict(
        {
            name: tensor.bfloat16().float() if name.rsplit(".", 1)[0] in _mixer_modules(formats) else tensor
            for name, tensor in loaded.state_dict().items()
        }
    )
    bound = 4 * (_logits(rounded) - want).abs().max()
    for kwargs in ({}, {"dtype": "auto"}, {"dtype": torch.float32}):
        model = _transformers(path, trust_remote_code=True, **kwargs)
        assert (_logits(model) - want).abs().max() <= bound


def _mixer_modules(formats: dict[int, str]) -> set[str]:
    """`HybridLM` state-dict module names of the covered weights (bank tensors for routed experts)."""
    names = set()
    for i in formats:
        for name in quantized_weights(SPEC.blocks[i], SPEC.hidden_size):
            module = name.removesuffix(".weight")
            names.add(f"layers.{i}.mixer.{'experts' if module.startswith('experts.') else module}")
    return names


def test_blocks_of_one_shape_in_different_formats_export_as_plain_nemotron_h(tmp_path):
    """A format is no shape: two attention blocks of one shape, one fp8 and one nvfp4, are one attention
    shape for transformers (it was refused: "2 different attention shapes"), and it reads both."""
    formats = {1: "fp8", 5: "nvfp4", 0: "fp8"}
    path = _export(tmp_path / "mixed", formats, format="nemotron_h")
    assert _model_type(path) == "nemotron_h"
    model = _transformers(path, dtype=torch.bfloat16)
    assert _quantized_modules(model) == _planned_modules(formats)


def test_per_token_fp8_activations_are_compressed_tensors_own():
    """`puzzle.quant_tokens` equals compressed-tensors' dynamic quantization of an FP8_DYNAMIC input, bit for
    bit in fp32 (a zero token, outliers and tiny values included), and its gradient is straight-through."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from puzzle.quant_tokens import fake_quantize_tokens

    args = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).input_activations
    x = torch.randn(3, 7, 48, generator=torch.Generator().manual_seed(0))
    x[0, 1] = 0.0
    x[1, 2, 5] = 1e4
    x[2, 3] *= 1e-6
    module = torch.nn.Linear(48, 8)
    scale, zero_point = compute_dynamic_scales_and_zp(x, args, module)
    want = ct_fake_quantize(x, scale, zero_point, args)
    assert torch.equal(fake_quantize_tokens(x), want)
    assert not torch.equal(want, x)
    leaf = x.clone().requires_grad_()
    fake_quantize_tokens(leaf).mul(torch.arange(48.0)).sum().backward()
    assert torch.equal(leaf.grad, torch.arange(48.0).expand_as(x))
