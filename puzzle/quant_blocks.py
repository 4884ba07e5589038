"""Which tensors of a block a weight format covers, and a built mixer fake-quantized in place.

A format covers the matmul weights of a block's mixer, by the tensor roles the cost model already
prices (`puzzle.blocks.tensors.ROLES`, `puzzle.cost.formats`): Mamba in/out projections, attention
projections, routed and shared experts, latent projections, MLP and linear matrices. Norms, biases, the
router (gate and correction bias), Mamba's conv1d and SSM parameters, embeddings and lm_head keep their
dtype: the serving recipes leave them unquantized, and vLLM builds the router and conv1d without a
quantization config.

Tensors a server fuses into one matmul must share what is per tensor in a format: vLLM fuses q/k/v into
one `qkv_proj` and reads a single NVFP4 global scale for it (`puzzle.formats.NVFP4_SHARED_SCALE`), and fuses a block's
routed experts into one kernel that needs one scheme for all of them (`SAME_FORMAT`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from puzzle.blocks.moe import module_hub_state
from puzzle.blocks.registry import mixer_tensors
from puzzle.formats import WEIGHT_FORMATS, shared_scale_groups
from puzzle.quant import QuantError, fake_quantize, nvfp4_global_scale
from puzzle.spec import BlockSpec


def quantized_weights(spec: BlockSpec, hidden_size: int) -> list[str]:
    """Mixer-relative names of the weights a weight format covers (2-D, with a matmul role), in mixer order."""
    return [t.name for t in mixer_tensors(spec, hidden_size) if t.covered]


def check_format(fmt: str, where: str) -> None:
    if fmt not in WEIGHT_FORMATS:
        raise QuantError(f"{where}: unknown weight format {fmt!r}; choose one of {list(WEIGHT_FORMATS)}")


@torch.no_grad()
def fake_quantize_mixer_(mixer: nn.Module, spec: BlockSpec, hidden_size: int, fmt: str) -> nn.Module:
    """Replace the covered weights of a built `mixer` by their fake-quantized values in format `fmt`, in place.

    The routed experts are quantized expert by expert in the hub layout ([out, in] per expert, the down
    projection transposed back out of the bank), q/k/v with one shared NVFP4 global scale, as the export
    writes and vLLM serves them. Returns `mixer`. For QAT, call `puzzle.quant.fake_quantize` in the forward
    pass instead (this overwrites the weights).
    """

    check_format(fmt, f"{type(spec).__name__} block")
    state = module_hub_state(mixer)
    names = quantized_weights(spec, hidden_size)
    missing = [name for name in names if name not in state]
    if missing:
        raise QuantError(f"{type(mixer).__name__}: no tensor(s) {missing[:3]} among its weights")
    for group in shared_scale_groups(names):
        scale = nvfp4_global_scale(*(state[name] for name in group)) if fmt == "nvfp4" else None
        for name in group:
            state[name].copy_(fake_quantize(state[name], fmt, name=name, global_scale=scale))
    return mixer


def fake_quantize_bank(
    up: torch.Tensor, down: torch.Tensor, offsets: Sequence[int], fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """An ExpertBank's (`up`, `down`) [sum w_j, D] fake-quantized as served, differentiably (straight-through).

    Expert j is rows offsets[j]:offsets[j+1]; its up_proj is those rows of `up` ([w_j, D], per-row scales,
    nvfp4 blocks along D) and its down_proj the transpose of those rows of `down` ([D, w_j]: scales per
    column of the bank, blocks along w_j), each with its own nvfp4 global scale. For QAT: call it in the
    forward pass on the bank's parameters (e.g. from a `torch.nn.utils.parametrize` parametrization).
    """
    check_format(fmt, "expert bank")
    ups, downs = [], []
    for j in range(len(offsets) - 1):
        rows = slice(offsets[j], offsets[j + 1])
        ups.append(fake_quantize(up[rows], fmt, name=f"experts.{j}.up_proj.weight"))
        downs.append(fake_quantize(down[rows].T, fmt, name=f"experts.{j}.down_proj.weight").T)
    return torch.cat(ups), torch.cat(downs)


def block_formats(formats: Mapping[str, str], num_blocks: int) -> dict[int, str]:
    """{block index: format} from a mapping of module-name prefixes to formats.

    A key names one block's mixer: `backbone.layers.I.mixer` (the hub name), `backbone.layers.I`, or the
    same without `backbone.`. Blocks not named keep their dtype ("bf16" is a valid, explicit choice too).
    Unknown formats, keys that are not strings or name no block (or a part of a mixer: its tensors are
    quantized together, see the module docstring), and a block given twice are refused.
    """
    if not isinstance(formats, Mapping):
        raise QuantError(
            f"weight formats: expected a mapping {{'backbone.layers.I.mixer': format}}, found "
            f"{type(formats).__name__} {formats!r}"
        )
    out: dict[int, str] = {}
    for key, fmt in formats.items():
        if not isinstance(key, str):  # e.g. a bare block index: say which spelling is wanted
            raise QuantError(
                f"weight format key {key!r} ({type(key).__name__}): expected a string "
                f"'backbone.layers.{key}.mixer' (or 'backbone.layers.I', or either without 'backbone.') "
                f"with I a block index below {num_blocks}"
            )
        rest = key.removeprefix("backbone.").removesuffix(".mixer")
        index = rest.removeprefix("layers.")
        if not rest.startswith("layers.") or not index.isdigit() or int(index) >= num_blocks:
            raise QuantError(
                f"weight format key {key!r}: expected backbone.layers.I.mixer (or backbone.layers.I, or either "
                f"without 'backbone.') with I a block index below {num_blocks}"
            )
        check_format(fmt, f"weight format of {key!r}")
        if int(index) in out:
            raise QuantError(f"weight format key {key!r}: block {index} is given twice")
        out[int(index)] = fmt
    return out
