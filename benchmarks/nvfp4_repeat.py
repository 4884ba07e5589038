"""Issue 35 §2: does nvfp4 repeat itself exactly? A one-block nvfp4 MLP child with one outlier weight
(up_proj[3, 5] = 1e5, the rest ~N(0, 0.3)), so most blocks' E4M3 scales are subnormal. Prints:

- bake vs forward: the baked child's stored weights against the fake-quantized weights its forward uses
  (elements that differ, largest relative difference);
- load vs child: `puzzle.load(export)` logits against the child's (largest difference / largest logit);
- re-save: packed bytes, block scales and global scales that change when the loaded export is saved again.

Both ways a child reaches an export: assembled (an nvfp4 spec, its weights baked) and a plain model exported
with `weight_formats={"layers.0": "nvfp4"}` (its child: the mixer fake-quantized in place).

Run: python benchmarks/nvfp4_repeat.py [--seed N] [--hidden H] [--width W]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

import puzzle
from puzzle.blocks import formats
from puzzle.export import export
from puzzle.model import HybridLM
from puzzle.nemotron_h.checkpoint import save_pretrained
from puzzle.quant import fake_quantize
from puzzle.quant_blocks import fake_quantize_mixer_
from puzzle.spec import MLPSpec, ModelSpec


def parent_with_outlier(seed: int, hidden: int, width: int, weight_format: str = "bf16") -> HybridLM:
    """A one-MLP model whose up_proj[3, 5] is 1e5 among N(0, 0.3) weights."""
    block = MLPSpec(width=width, weight_format=weight_format)
    torch.manual_seed(seed)
    model = HybridLM(ModelSpec(vocab_size=64, hidden_size=hidden, blocks=(block,))).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(std=0.3 if parameter.dim() > 1 else 0.1)
            if name.endswith("norm.weight"):
                parameter.add_(1.0)
        model.layers[0].mixer.up_proj.weight[3, 5] = 1e5
    return model


def bake_vs_forward(child: HybridLM) -> str:
    """How far the weights `child` stores are from the fake-quantized weights its nvfp4 forward multiplies by."""
    worst, differ, total = 0.0, 0, 0
    for name in ("up_proj", "down_proj"):
        stored = getattr(child.layers[0].mixer, name).weight.detach()
        gap = (fake_quantize(stored, "nvfp4", name) - stored).abs()
        differ += int((gap > 0).sum())
        total += stored.numel()
        if bool((gap > 0).any()):
            worst = max(worst, float((gap / stored.abs().clamp_min(1e-30))[gap > 0].max()))
    return f"{differ} of {total} elements differ, largest relative difference {worst:.3g}"


def round_trip(child: HybridLM, exported: HybridLM, tmp: Path, **formats: object) -> tuple[str, str]:
    """(load vs child, re-save) for `exported` written with `formats` and loaded back."""
    path = export(exported, tmp / "export", **formats)
    loaded = puzzle.load(path, dtype=torch.float32)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = child(ids).logits, loaded(ids).logits
    logits = f"logits differ by {float((got - want).abs().max() / want.abs().max()):.3g} of the largest"
    again = save_pretrained(loaded, tmp / "again")
    counts = {"weight_packed": [0, 0], "weight_scale": [0, 0], "weight_global_scale": [0, 0]}
    with safe_open(path / "model.safetensors", "pt") as a, safe_open(again / "model.safetensors", "pt") as b:
        for key in a.keys():  # noqa: SIM118
            suffix = key.rsplit(".", 1)[-1]
            if suffix in counts:
                x, y = a.get_tensor(key).view(torch.uint8), b.get_tensor(key).view(torch.uint8)
                if suffix == "weight_global_scale":
                    x, y = x.view(torch.int32), y.view(torch.int32)
                counts[suffix][0] += int((x != y).sum())
                counts[suffix][1] += x.numel()
    return logits, ", ".join(f"{changed} of {n} {suffix} changed" for suffix, (changed, n) in counts.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    shape = (args.seed, args.hidden, args.width)
    assembled = parent_with_outlier(*shape, weight_format="nvfp4")
    formats.bake(assembled.layers[0].mixer)  # as assembly does: the child carries fake_quantize(master)
    plain = parent_with_outlier(*shape)
    plain_child = copy.deepcopy(plain)
    fake_quantize_mixer_(plain_child.layers[0].mixer, plain.spec.blocks[0], args.hidden, "nvfp4")
    print(f"assembled child, bake vs forward: {bake_vs_forward(assembled)}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, child, exported, options in (
            ("assembled child", assembled, assembled, {}),
            ("plain model + weight_formats", plain_child, plain, {"weight_formats": {"layers.0": "nvfp4"}}),
        ):
            Path(tmp, label).mkdir()
            logits, saved = round_trip(child, exported, Path(tmp, label), **options)
            print(f"{label}, load vs child: {logits}")
            print(f"{label}, re-save: {saved}")


if __name__ == "__main__":
    main()
