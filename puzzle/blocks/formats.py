"""A block's weight format in its forward: the mixer's covered matmul weights, fake-quantized on the fly.

A spec with `weight_format` fp8 or nvfp4 (`puzzle.formats.WEIGHT_FORMATS`) stores its matmul weights in
that format when served. Which tensors a format covers comes from the tensor roles the cost model
prices (`puzzle.formats.QUANTIZED_ROLES`: Mamba, attention, expert, latent, MLP and linear
projections); norms, biases, the router, conv and SSM parameters and every 1-D tensor stay as they are.

The module keeps full-precision master weights (its parameters, state_dict and checkpoints are those
of a bf16 block of the same shape). `build_block` gives a quantized spec's mixer a forward pre-hook
that swaps each covered weight for `puzzle.quant.fake_quantize(weight, fmt)` for the duration of the
call (and a hook that puts the master weights back, also when the forward raises). fake_quantize's
gradient is straight-through, so training the mixer (BLD) is quantization-aware and its scores, an
assembled child and GKD all run the quantized block. An fp8 block also quantizes the input of each of
its matmuls per token (`puzzle.quant_tokens`, forward pre-hooks on its projections; an ExpertBank's
`activation_quant`), as the FP8_DYNAMIC scheme it is exported in is served. `bake` writes the fake-quantized values into the
parameters themselves (assembly: what the child carries and an export writes).

Fused matmuls: q/k/v share one NVFP4 global scale (vLLM serves them as one qkv_proj with one scale),
as `puzzle.quant_blocks.fake_quantize_mixer_` and the export quantize them; every other weight has its own.

Layouts: a covered weight is quantized as the hub stores it ([out, in]: per-output-channel scales,
blocks along the input dimension). An `ExpertBank` keeps `up` as the experts' up_proj rows and `down`
as the transposes of their down_proj, so each expert's slice is quantized on its own, `down` transposed
to the hub's [D, w_j] and back: each expert is its own tensor with its own scales, as in a checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from puzzle.blocks.moe import ExpertBank
from puzzle.formats import NVFP4_SHARED_SCALE, QUANTIZED_ROLES
from puzzle.spec import DEFAULT_WEIGHT_FORMAT, SpecError, weight_format_of


@dataclass(frozen=True)
class CoveredWeight:
    """One parameter a weight format covers: `owner._parameters[name]`, in `layout` "linear" (a hub
    [out, in] weight), "bank_up" or "bank_down" (an ExpertBank's `up` / `down`, per expert)."""

    owner: nn.Module
    name: str
    layout: str
    where: str = ""  # the hub name of the owner within the mixer, for error messages

    @property
    def hub_name(self) -> str:
        """The hub name within the mixer of a "linear" weight (`q_proj.weight`); a bank's prefix otherwise."""
        return f"{self.where}.{self.name}" if self.layout == "linear" else self.where

    def quantize(
        self, weight: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`weight` fake-quantized in `fmt` as the hub stores it (differentiable: straight-through);
        `global_scale`: nvfp4's shared decode scale of a fused group (q/k/v), for a "linear" weight."""
        from puzzle.quant import fake_quantize  # late: the number formats, torch only when used

        if self.layout == "linear":
            return fake_quantize(weight, fmt, self.hub_name, global_scale=global_scale)
        offsets = self.owner.offsets
        parts = []
        for j in range(len(offsets) - 1):
            rows = weight[offsets[j] : offsets[j + 1]]
            if self.layout == "bank_up":  # expert j's up_proj.weight [w_j, D]
                parts.append(fake_quantize(rows, fmt, f"{self.where}{j}.up_proj.weight"))
            else:  # expert j's down_proj.weight is rows.T [D, w_j]
                parts.append(fake_quantize(rows.T, fmt, f"{self.where}{j}.down_proj.weight").T)
        return torch.cat(parts, dim=0)


def _roles_by_name(mixer: nn.Module) -> dict[str, str]:
    # Hub names and roles do not depend on the hidden size; 1 lists them without knowing it.
    return {t.name: t.role for t in type(mixer).hub_tensors(mixer.spec, 1)}


def covered_weights(mixer: nn.Module) -> list[CoveredWeight]:
    """The parameters of `mixer` its spec's weight format covers (the roles in QUANTIZED_ROLES).

    Raises SpecError when a covered hub tensor has no parameter here (a mixer whose modules its
    `hub_tensors` does not describe), so a new kind cannot silently stay unquantized.
    """
    roles = _roles_by_name(mixer)
    wanted = {name for name, role in roles.items() if role in QUANTIZED_ROLES}
    covered: list[CoveredWeight] = []
    found: set[str] = set()
    banks = {f"{name}." if name else "": m for name, m in mixer.named_modules() if isinstance(m, ExpertBank)}
    for prefix, bank in banks.items():
        experts = {name for name in wanted if name.startswith(prefix) and name[len(prefix) :][:1].isdigit()}
        if experts:
            covered += [
                CoveredWeight(bank, "up", "bank_up", prefix),
                CoveredWeight(bank, "down", "bank_down", prefix),
            ]
            found |= experts
    for name in sorted(wanted - found):
        path, _, param = name.rpartition(".")
        try:
            owner = mixer.get_submodule(path)
        except AttributeError:
            owner = None
        if owner is None or param not in owner._parameters:
            raise SpecError(
                f"{type(mixer).__name__}: covered tensor {name!r} is not a parameter of the mixer"
            )
        covered.append(CoveredWeight(owner, param, "linear", path))
        found.add(name)
    return covered


@contextlib.contextmanager
def fake_quantized(mixer: nn.Module, fmt: str | None = None) -> Iterator[nn.Module]:
    """Within the block, `mixer`'s covered weights are fake-quantized in `fmt` (default: its spec's);
    the master weights are back afterwards. Gradients reach the master weights straight through."""
    fmt = fmt or weight_format_of(mixer.spec)
    if fmt == DEFAULT_WEIGHT_FORMAT:
        yield mixer
        return
    saved = _swap_in(mixer, fmt)
    try:
        yield mixer
    finally:
        _swap_back(saved)


def _global_scales(covered: list[CoveredWeight], fmt: str) -> dict[str, torch.Tensor]:
    """{hub name: the nvfp4 global scale it shares} for the fused groups present (q/k/v); {} otherwise."""
    if fmt != "nvfp4":
        return {}
    from puzzle.quant import nvfp4_global_scale

    by_name = {weight.hub_name: weight for weight in covered if weight.layout == "linear"}
    scales = {}
    for group in NVFP4_SHARED_SCALE:
        present = [by_name[name] for name in group if name in by_name]
        if len(present) > 1:
            scale = nvfp4_global_scale(*(w.owner._parameters[w.name] for w in present))
            scales.update(dict.fromkeys((w.hub_name for w in present), scale))
    return scales


def _quantized(mixer: nn.Module, fmt: str) -> Iterator[tuple[CoveredWeight, torch.Tensor, torch.Tensor]]:
    """(covered weight, its master, its fake-quantized value) for each weight `fmt` covers in `mixer`."""
    covered = covered_weights(mixer)
    for weight in covered:
        master = weight.owner._parameters[weight.name]
        if type(master) is not nn.Parameter and master.__class__.__name__ == "DTensor":
            raise SpecError(
                f"{type(mixer).__name__}: fake quantization of a sharded mixer is not supported (the "
                "per-tensor scales need the whole tensor); train and score quantized variants unsharded"
            )
    scales = _global_scales(covered, fmt)
    for weight in covered:
        master = weight.owner._parameters[weight.name]
        yield weight, master, weight.quantize(master, fmt, scales.get(weight.hub_name))


def _swap_in(mixer: nn.Module, fmt: str) -> list[tuple[nn.Module, str, torch.Tensor]]:
    saved: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for weight, master, quantized in _quantized(mixer, fmt):
            saved.append((weight.owner, weight.name, master))
            # A plain tensor in _parameters: attribute reads see it; nn.Module's setattr would refuse it.
            weight.owner._parameters[weight.name] = quantized
    except BaseException:
        _swap_back(saved)  # a weight that cannot be quantized leaves every master weight in place
        raise
    return saved


def _swap_back(saved: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    for owner, name, master in reversed(saved):
        owner._parameters[name] = master


_ACTIVE = "_puzzle_fake_quant_saved"


def _pre_hook(mixer: nn.Module, args: object) -> None:
    if getattr(mixer, _ACTIVE, None) is not None:  # re-entered (a step calling forward): already swapped
        return
    fmt = weight_format_of(mixer.spec)
    setattr(mixer, _ACTIVE, _swap_in(mixer, fmt) if fmt != DEFAULT_WEIGHT_FORMAT else [])


def _post_hook(mixer: nn.Module, args: object, output: object) -> None:
    saved = getattr(mixer, _ACTIVE, None)
    if saved is not None:
        setattr(mixer, _ACTIVE, None)
        _swap_back(saved)


def install(mixer: nn.Module) -> nn.Module:
    """Make every call of `mixer` run with its covered weights fake-quantized (a no-op for bf16), and, for
    fp8, the input of each of its matmuls quantized per token as the exported FP8_DYNAMIC scheme serves it
    (`puzzle.quant_tokens`)."""
    fmt = weight_format_of(mixer.spec)
    if fmt == DEFAULT_WEIGHT_FORMAT:
        return mixer
    if fmt == "fp8":
        from puzzle.quant_tokens import fake_quantize_tokens, quantize_input_hook

        for weight in covered_weights(mixer):
            if weight.layout == "linear":
                weight.owner.register_forward_pre_hook(quantize_input_hook)
            else:  # an ExpertBank: its two matmuls' inputs, expert by expert
                weight.owner.activation_quant = fake_quantize_tokens
    setattr(mixer, _ACTIVE, None)
    mixer.register_forward_pre_hook(_pre_hook)
    mixer.register_forward_hook(_post_hook, always_call=True)
    return mixer


def step_context(mixer: nn.Module) -> contextlib.AbstractContextManager:
    """For a direct `mixer.step` call (decoding skips `__call__` and its hooks): the fake-quantized weights."""
    if weight_format_of(getattr(mixer, "spec", None)) == DEFAULT_WEIGHT_FORMAT:
        return contextlib.nullcontext()
    if getattr(mixer, _ACTIVE, None) is not None:
        return contextlib.nullcontext()
    return fake_quantized(mixer)


@torch.no_grad()
def bake(mixer: nn.Module, fmt: str | None = None) -> nn.Module:
    """Write the fake-quantized values of the covered weights into `mixer`'s parameters, in place."""
    fmt = fmt or weight_format_of(mixer.spec)
    if fmt == DEFAULT_WEIGHT_FORMAT:
        return mixer
    for _, master, quantized in list(_quantized(mixer, fmt)):  # every value first: q/k/v share a scale
        master.copy_(quantized)
    return mixer
