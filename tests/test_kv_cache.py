"""fp8 KV cache with calibrated per-layer scales (`puzzle.kv_cache`): calibration, the fake-quantized attention
forward, scoring's KL of a KV-fp8 model, the export vLLM reads (replayed), `puzzle.load` and the remote code.

Oracles: every finite E4M3 value enumerated (nearest one, brute force); forward hooks on k_proj / v_proj
(NoPE: the cached keys are k_proj's output) for the amax and for an explicitly fake-quantized model; the
KL from whole-vocabulary softmaxes; transformers' trust_remote_code model of the export.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from kl_helpers import naive_kl
from safetensors import safe_open

import puzzle
from puzzle.compare import compare_models
from puzzle.export import ExportError, export
from puzzle.kv_cache import (
    FP8_MAX,
    KVCacheError,
    calibrate_kv_scales,
    calibrated,
    kv_scales,
    quantize_kv_fp8,
    set_kv_scales,
)
from puzzle.model import HybridLM
from puzzle.nemotron_h import CheckpointError
from puzzle.nemotron_h.kv_export import KV_CACHE_SCHEME
from puzzle.nemotron_h.vllm_kv_replay import VllmKVError, load_kv_scales, map_name
from puzzle.spec import AttentionSpec, MambaSpec, MLPSpec, ModelSpec

SPEC = ModelSpec(
    vocab_size=48,
    hidden_size=16,
    blocks=(
        MambaSpec(num_heads=4, head_dim=4, state_size=6, n_groups=2, chunk_size=8),
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=4),
        MLPSpec(width=24),
        AttentionSpec(num_heads=4, num_kv_heads=1, head_dim=4),
    ),
)
ATTENTION = (1, 3)
GEN = torch.Generator().manual_seed(5)
CALIBRATION = [torch.randint(0, SPEC.vocab_size, (2, 16), generator=GEN) for _ in range(3)]
HELD_OUT = [torch.randint(0, SPEC.vocab_size, (2, 16), generator=GEN) for _ in range(2)]


def _parent() -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(SPEC)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(std=0.3 if parameter.dim() > 1 else 0.05)
            if name.endswith("norm.weight"):
                parameter.add_(1.0)
    return model.eval()


def _e4m3_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, from its 256 bit patterns."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values)].unique()


def _brute_force_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The grid value nearest x / scale (clamped to +-448), times scale."""
    grid = _e4m3_grid().double()
    scale32 = torch.tensor(scale, dtype=torch.float32)
    y = (x.float() / scale32).clamp(-FP8_MAX, FP8_MAX).double()  # the division in fp32, as vLLM's
    distance = (y[..., None] - grid).abs()
    nearest = grid[distance.argmin(-1)]
    # a tie goes to the even mantissa (the grid value whose last bit is 0)
    tie = (distance == distance.min(-1, keepdim=True).values).sum(-1) > 1
    if bool(tie.any()):
        raise AssertionError("a value exactly between two E4M3 values: choose other test data")
    return (nearest.float() * scale32).to(x.dtype)


def _amax_by_hooks(model: HybridLM, batches) -> dict[int, tuple[float, float]]:
    seen = {i: [0.0, 0.0] for i in ATTENTION}
    handles = []
    for i in ATTENTION:
        mixer = model.layers[i].mixer
        for half, proj in enumerate((mixer.k_proj, mixer.v_proj)):

            def hook(module, args, out, i=i, half=half):
                seen[i][half] = max(seen[i][half], float(out.abs().max()))

            handles.append(proj.register_forward_hook(hook))
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for handle in handles:
        handle.remove()
    return {i: (k, v) for i, (k, v) in seen.items()}


def _explicitly_quantized(model: HybridLM, scales) -> HybridLM:
    """A copy of `model` (KV cache unquantized) whose k_proj / v_proj outputs go through `_brute_force_fp8`."""
    copy_ = copy.deepcopy(model)
    set_kv_scales(copy_, None)
    for i, (k, v) in scales.items():
        mixer = copy_.layers[i].mixer
        mixer.k_proj.register_forward_hook(lambda m, a, out, s=k: _brute_force_fp8(out, s))
        mixer.v_proj.register_forward_hook(lambda m, a, out, s=v: _brute_force_fp8(out, s))
    return copy_


def test_fp8_kv_values_are_the_nearest_e4m3_value_saturated():
    x = torch.randn(3, 2, 7, 4, generator=torch.Generator().manual_seed(1)) * 2.0
    scale = float(x.abs().amax()) / FP8_MAX / 3  # a third of the calibrated scale: the largest saturate
    got = quantize_kv_fp8(x, torch.tensor(scale))
    assert torch.equal(got, _brute_force_fp8(x, scale))
    assert float(got.max()) == pytest.approx(FP8_MAX * scale)
    assert not torch.equal(got, x)


def test_calibrated_scales_are_the_amax_over_the_calibration_tokens_over_448():
    parent = _parent()
    scales = calibrate_kv_scales(parent, CALIBRATION)
    amax = _amax_by_hooks(parent, CALIBRATION)
    assert set(scales) == set(ATTENTION)
    for i in ATTENTION:
        assert scales[i] == pytest.approx((amax[i][0] / FP8_MAX, amax[i][1] / FP8_MAX), rel=1e-6)
    assert kv_scales(parent) == {}  # calibration leaves the model's cache as it was
    fewer = calibrate_kv_scales(parent, CALIBRATION[:1])
    assert all(fewer[i][0] <= scales[i][0] and fewer[i][1] <= scales[i][1] for i in ATTENTION)


def test_the_kv_fp8_forward_is_the_explicitly_fake_quantized_one_and_decoding_agrees():
    parent = _parent()
    model = calibrated(copy.deepcopy(parent), CALIBRATION)
    scales = kv_scales(model)
    ids = HELD_OUT[0]
    with torch.no_grad():
        got = model(ids).logits
        want = _explicitly_quantized(model, scales)(ids).logits
        plain = parent(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - plain).abs().max() > 1e-4  # the fp8 cache moved the logits
    # Prefill then one token at a time through the cache: each key is quantized once, as stored, so the
    # logits are the full forward's.
    with torch.no_grad():
        cache = model.init_cache(ids.shape[0])
        pieces = [model(ids[:, :5], cache=cache).logits]
        pieces += [model(ids[:, t : t + 1], cache=cache).logits for t in range(5, ids.shape[1])]
    torch.testing.assert_close(torch.cat(pieces, dim=1), got, rtol=0, atol=1e-5)


def test_scoring_measures_a_kv_fp8_variants_kl():
    parent = _parent()
    variant = calibrated(copy.deepcopy(parent), CALIBRATION)
    measured = compare_models(parent, variant, HELD_OUT).kl  # what scoring and assembly report
    naive = naive_kl(parent, variant, HELD_OUT)
    explicit = naive_kl(parent, _explicitly_quantized(variant, kv_scales(variant)), HELD_OUT)
    assert naive == pytest.approx(explicit, rel=1e-4)
    assert measured == pytest.approx(naive, rel=3e-2)  # compare_models' fp32 softmaxes at a KL of ~1e-6
    assert 0 < measured < 1e-3  # fp8 keys and values: a small but real change
    assert compare_models(parent, copy.deepcopy(parent), HELD_OUT).kl == pytest.approx(0, abs=1e-9)


def test_kv_scales_must_fit_the_model():
    model = _parent()
    with pytest.raises(KVCacheError, match=r"not attention blocks"):
        set_kv_scales(model, {0: (1.0, 1.0), 1: (1.0, 1.0), 3: (1.0, 1.0)})
    with pytest.raises(KVCacheError, match=r"no KV scales for attention block\(s\) \[3\]"):
        set_kv_scales(model, {1: (1.0, 1.0)})
    with pytest.raises(KVCacheError, match=r"positive finite"):
        set_kv_scales(model, {1: (1.0, 0.0), 3: (1.0, 1.0)})


# ------------------------------------------------------------------------------------------- the export


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = calibrated(_parent(), CALIBRATION)
    path = export(model, tmp_path_factory.mktemp("kv") / "child")  # "auto": the remote-code type
    return model, path


def _scale_tensors(path: Path) -> dict[str, float]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            for key in handle.keys():  # noqa: SIM118
                if key.endswith("_scale"):
                    out[key] = float(handle.get_tensor(key).reshape(()))
    return out


def test_the_export_holds_compressed_tensors_kv_cache_scheme_and_per_layer_scales(exported):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    model, path = exported
    config = json.loads((path / "config.json").read_text())
    quantization = config["quantization_config"]
    assert quantization["kv_cache_scheme"] == KV_CACHE_SCHEME
    parsed = QuantizationConfig.model_validate(quantization)  # compressed-tensors' own reading of it
    assert parsed.kv_cache_scheme == QuantizationArgs.model_validate(KV_CACHE_SCHEME)
    stored = _scale_tensors(path)
    want = {}
    for i, (k, v) in kv_scales(model).items():
        want[f"backbone.layers.{i}.mixer.k_scale"] = k
        want[f"backbone.layers.{i}.mixer.v_scale"] = v
    assert stored == pytest.approx(want, rel=0, abs=0)


def test_vllm_gives_every_attention_layer_its_scales(exported):
    model, path = exported
    config = json.loads((path / "config.json").read_text())
    replayed = load_kv_scales(config, _scale_tensors(path))
    want = {f"model.layers.{i}.mixer.attn": pair for i, pair in kv_scales(model).items()}
    assert replayed.unexpected == []
    assert replayed.scales == want  # the fp32 values, exactly
    # Served with --kv-cache-dtype auto, vLLM ignores them.
    assert set(load_kv_scales(config, _scale_tensors(path), "auto").scales.values()) == {(1.0, 1.0)}


def test_the_replay_catches_scales_vllm_would_not_load(exported):
    _, path = exported
    config = json.loads((path / "config.json").read_text())
    tensors = _scale_tensors(path)
    # compressed-tensors' older names meet NemotronH's stacked q/k/v rename before their suffix rule.
    assert (
        map_name("backbone.layers.1.mixer.k_proj.output_scale")
        == "model.layers.1.mixer.qkv_proj.output_scale"
    )
    older = {name.replace(".k_scale", ".k_proj.output_scale"): value for name, value in tensors.items()}
    replayed = load_kv_scales(config, older)
    assert len(replayed.unexpected) == len(ATTENTION)
    assert all(k == v for k, v in replayed.scales.values())  # v only: vLLM duplicates the one scale it got
    # A layer without scales serves with 1.0 (vLLM's warning), which the replay shows.
    dropped = {name: value for name, value in tensors.items() if ".layers.3." not in name}
    assert load_kv_scales(config, dropped).scales["model.layers.3.mixer.attn"] == (1.0, 1.0)
    per_head = {**config, "quantization_config": {**config["quantization_config"]}}
    per_head["quantization_config"]["kv_cache_scheme"] = {**KV_CACHE_SCHEME, "strategy": "attn_head"}
    with pytest.raises(VllmKVError, match="Expected strategy: tensor"):
        load_kv_scales(per_head, tensors)


def test_puzzle_load_applies_the_scales_and_saves_them_again(exported, tmp_path):
    model, path = exported
    loaded = puzzle.load(path, dtype=torch.float32)
    assert kv_scales(loaded) == kv_scales(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(HELD_OUT[0]).logits, model(HELD_OUT[0]).logits, rtol=0, atol=1e-6)
    again = export(loaded, tmp_path / "again", format="nemotron_h_puzzle")
    assert _scale_tensors(again) == _scale_tensors(path)


def test_a_kv_cache_scheme_without_scales_is_refused(exported, tmp_path):
    model, path = exported
    plain = copy.deepcopy(model)
    set_kv_scales(plain, None)
    out = export(plain, tmp_path / "plain", format="nemotron_h_puzzle")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = json.loads((path / "config.json").read_text())["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="kv_cache_scheme but the weights hold no k_scale"):
        puzzle.load(out)


def test_the_remote_code_applies_the_scales(exported):
    transformers = pytest.importorskip("transformers")
    model, path = exported
    remote = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    with torch.no_grad():
        got = remote(HELD_OUT[0]).logits.float()
        want = model(HELD_OUT[0]).logits
        plain = copy.deepcopy(model)
        set_kv_scales(plain, None)
        unquantized = plain(HELD_OUT[0]).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - unquantized).abs().max() > 1e-4


def test_a_kv_fp8_child_exports_as_the_remote_code_type_and_records_its_scales(tmp_path):
    """Plain transformers' NemotronHForCausalLM loads a checkpoint's k_scale / v_scale as unexpected keys
    and runs an unquantized cache, so a KV-fp8 child of a shape it could hold is still written
    nemotron_h_puzzle, and format="nemotron_h" is refused."""
    same_heads = ModelSpec(
        vocab_size=48, hidden_size=16, blocks=(SPEC.blocks[0], SPEC.blocks[1], SPEC.blocks[1])
    )
    torch.manual_seed(0)
    plain = HybridLM(same_heads).eval()
    assert (
        json.loads((export(plain, tmp_path / "plain") / "config.json").read_text())["model_type"]
        == "nemotron_h"
    )
    model = calibrated(copy.deepcopy(plain), CALIBRATION)
    path = export(model, tmp_path / "kv")
    assert json.loads((path / "config.json").read_text())["model_type"] == "nemotron_h_puzzle"
    record = json.loads((path / "puzzle.json").read_text())["kv_cache"]
    assert record == {"dtype": "fp8", "scales": {str(i): list(pair) for i, pair in kv_scales(model).items()}}
    with pytest.raises(CheckpointError, match="plain nemotron_h config"):
        export(model, tmp_path / "refused", format="nemotron_h")
    # Who serves the scales: vLLM (replayed) and SGLang read them; the others are named with their reason.
    engines = json.loads((path / "puzzle.json").read_text())["engines"]
    plain_engines = json.loads((tmp_path / "plain" / "puzzle.json").read_text())["engines"]
    changed = {engine for engine in engines if engines[engine] != plain_engines[engine]}
    assert changed == {"llama.cpp", "transformers", "trtllm"}
    assert any("hf_quant_config.json" in reason for reason in engines["trtllm"])
    with pytest.raises(ExportError, match=r"llama.cpp: an fp8 KV cache"):
        export(model, tmp_path / "engine", format="engine")
    assert export(model, tmp_path / "vllm", format="engine", engines=("vllm",)).is_dir()


def test_vllm_gives_each_attention_layer_of_a_75b_shaped_child_its_own_scales():
    """The Puzzle-75B-A9B-like child (meta weights: no memory), each attention layer given scales of its own:
    the config.json and scale tensors an export writes, replayed through vLLM's loading."""
    from puzzle.export import export_config
    from puzzle.nemotron_h import quantized
    from puzzle.nemotron_h.kv_export import scale_tensors, with_kv_cache_scheme
    from puzzle.presets import puzzle_75b_a9b_like

    with torch.device("meta"):
        child = HybridLM(puzzle_75b_a9b_like())
    attention = [i for i, block in enumerate(child.spec.blocks) if block.kind == "attention"]
    set_kv_scales(child, {i: (0.01 * (n + 1), 0.002 * (n + 1)) for n, i in enumerate(attention)})
    config = export_config(child)
    assert config["model_type"] == "nemotron_h_puzzle"
    config["quantization_config"] = with_kv_cache_scheme(
        quantized.quantization_config(quantized.QuantPlan({}, {}))
    )
    tensors = {name: float(t) for name, t in scale_tensors(child).items()}
    replayed = load_kv_scales(config, tensors)
    assert replayed.unexpected == []
    want = {f"model.layers.{i}.mixer.attn": kv_scales(child)[i] for i in attention}
    assert replayed.scales == want and len(want) == len(attention) > 0
    print(
        f"\n75B-shaped child: {len(attention)} attention layers {attention}, each with its own k/v scales in vLLM"
    )


def test_puzzle_costs_of_a_kv_fp8_export_prices_its_cache_in_fp8(exported, tmp_path, capsys):
    """`puzzle costs DIR` of an export whose config.json has the fp8 kv_cache_scheme prices its KV cache in
    fp8 unless told otherwise; an export without one stays at bf16."""
    from puzzle.cli import main
    from puzzle.cost.analytic import kv_bytes_per_token

    model, path = exported

    def costs(target: Path, *argv: str) -> dict:
        assert main(["costs", str(target), "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    fp8 = costs(path)
    assert fp8["kv_dtype"] == "fp8"
    assert fp8["kv_bytes_per_token"] == kv_bytes_per_token(model.spec, "fp8") > 0
    assert costs(path / "config.json")["kv_dtype"] == "fp8"  # the config.json itself too
    bf16 = costs(path, "--kv-dtype", "bf16")  # what the user asks for wins
    assert bf16["kv_dtype"] == "bf16" and bf16["kv_bytes_per_token"] == 2 * fp8["kv_bytes_per_token"]
    plain = copy.deepcopy(model)
    set_kv_scales(plain, None)
    assert costs(export(plain, tmp_path / "plain"))["kv_dtype"] == "bf16"
