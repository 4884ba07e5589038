"""The Mamba-2 mixer of Nemotron-H (same parameter names as transformers' NemotronHMamba2Mixer), with its cache.

Plain torch (puzzle.blocks.ssd) is the reference path; on CUDA, when mamba_ssm and causal_conv1d are installed,
the same maths runs through their kernels instead.

One deliberate difference from transformers: the dt clamp [dt_clamp_min, dt_clamp_max] applies in the one-token
step too, so decoding token by token equals a full forward. transformers (and mamba_ssm) clamp only in the
chunked path, so their decode differs from ours for heads whose softplus(dt + dt_bias) falls below the clamp.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from puzzle.blocks import ssd
from puzzle.blocks.tensors import TensorInfo, linear_tensors
from puzzle.spec import MambaSpec


@dataclass
class MambaCache:
    """Decode state of one Mamba mixer for a batch of sequences.

    conv_state: [b, conv_dim, k-1], the last k-1 inputs of the causal conv (x | B | C channels), model dtype.
    ssm_state: [b, num_heads, head_dim, state_size], fp32.
    """

    conv_state: torch.Tensor
    ssm_state: torch.Tensor


@functools.cache
def _cuda_kernels() -> SimpleNamespace | None:
    """The mamba_ssm / causal_conv1d kernels, or None when either package is missing (imported once, lazily)."""
    try:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:
        return None
    return SimpleNamespace(
        conv1d_fn=causal_conv1d_fn,
        conv1d_update=causal_conv1d_update,
        chunk_scan=mamba_chunk_scan_combined,
        state_update=selective_state_update,
    )


def _kernels_for(tensor: torch.Tensor) -> SimpleNamespace | None:
    # Decided per call by where the data is: a CPU tensor always takes the torch path.
    return _cuda_kernels() if tensor.is_cuda else None


class GatedGroupRMSNorm(nn.Module):
    """RMSNorm of `y * silu(z)` over groups of d / n_groups channels, then the scale `weight` [d]."""

    def __init__(self, size: int, n_groups: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.n_groups = n_groups
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z: [..., d] -> [..., d], computed in fp32 (the caller casts to the model dtype)."""
        # Without autograd every step after the first works in place: big temporaries are the main CPU cost.
        inplace = not torch.is_grad_enabled()
        gated = F.silu(z.float())
        gated = gated.mul_(y) if inplace else gated * y
        grouped = gated.unflatten(-1, (self.n_groups, -1))
        mean_square = torch.linalg.vector_norm(grouped, dim=-1, keepdim=True).square() / grouped.shape[-1]
        inv_rms = torch.rsqrt(mean_square + self.eps)
        normed = (grouped.mul_(inv_rms) if inplace else grouped * inv_rms).flatten(-2)
        return normed.mul_(self.weight) if inplace else normed * self.weight


class MambaMixer(nn.Module):
    """Mamba-2 mixer: in_proj -> causal conv + SiLU -> SSD scan (+ D skip) -> gated group RMSNorm -> out_proj.

    Parameters (shapes with H hidden, d = num_heads * head_dim, conv_dim = d + 2 * n_groups * state_size):
    in_proj.weight [d + conv_dim + num_heads, H] with rows z | x | B | C | dt; conv1d.weight [conv_dim, 1, k]
    (+ bias); dt_bias, A_log, D [num_heads]; norm.weight [d]; out_proj.weight [H, d].
    """

    def __init__(self, spec: MambaSpec, hidden_size: int, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.spec = spec
        self.hidden_size = hidden_size
        self.norm_eps = norm_eps
        d, conv_dim, k = spec.d_inner, spec.conv_dim, spec.conv_kernel
        self.in_proj = nn.Linear(hidden_size, spec.in_proj_dim, bias=spec.proj_bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, k, groups=conv_dim, padding=k - 1, bias=spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(spec.num_heads))
        self.A_log = nn.Parameter(torch.empty(spec.num_heads))
        self.D = nn.Parameter(torch.empty(spec.num_heads))
        self.norm = GatedGroupRMSNorm(d, spec.n_groups, norm_eps)
        self.out_proj = nn.Linear(d, hidden_size, bias=spec.proj_bias)
        self.reset_ssm_parameters()

    @staticmethod
    def hub_tensors(spec: MambaSpec, hidden_size: int) -> list[TensorInfo]:
        """The tensors this mixer stores (names as in NemotronH checkpoints, relative to the mixer), in order."""
        H, nh, d, conv_dim = hidden_size, spec.num_heads, spec.d_inner, spec.conv_dim
        tensors = linear_tensors("in_proj", spec.in_proj_dim, H, "mamba_proj", spec.proj_bias)
        tensors.append(TensorInfo("conv1d.weight", (conv_dim, 1, spec.conv_kernel), "mamba_conv"))
        if spec.conv_bias:
            tensors.append(TensorInfo("conv1d.bias", (conv_dim,), "mamba_conv"))
        tensors += [
            TensorInfo("dt_bias", (nh,), "mamba_ssm"),
            TensorInfo("A_log", (nh,), "mamba_ssm"),
            TensorInfo("D", (nh,), "mamba_ssm"),
            TensorInfo("norm.weight", (d,), "norm"),
        ]
        return tensors + linear_tensors("out_proj", H, d, "mamba_proj", spec.proj_bias)

    @torch.no_grad()
    def reset_ssm_parameters(self) -> None:
        """The Nemotron-H initial values: A = -(1..num_heads), D = 1, dt_bias = 1, norm scale 1."""
        # Nothing to fill on meta, where decomposed arange / log calls would cost more than the rest.
        if self.A_log.is_meta:
            return
        heads = torch.arange(1, self.spec.num_heads + 1, dtype=torch.float32, device=self.A_log.device)
        self.A_log.copy_(torch.log(heads))
        self.D.fill_(1.0)
        self.dt_bias.fill_(1.0)
        self.norm.weight.fill_(1.0)

    def init_cache(
        self, batch_size: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> MambaCache:
        """A zero state (= the start of a sequence). conv_state in `dtype` (default: the weights'), ssm_state fp32."""
        weight = self.in_proj.weight
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        spec = self.spec
        return MambaCache(
            conv_state=torch.zeros(
                batch_size, spec.conv_dim, spec.conv_kernel - 1, device=device, dtype=dtype
            ),
            ssm_state=torch.zeros(
                batch_size, spec.num_heads, spec.head_dim, spec.state_size, device=device, dtype=torch.float32
            ),
        )

    # -- pieces shared by forward and step -------------------------------------------------------------------

    def _check_cache(self, cache: MambaCache, batch_size: int) -> None:
        spec = self.spec
        expected = {
            "conv_state": (batch_size, spec.conv_dim, spec.conv_kernel - 1),
            "ssm_state": (batch_size, spec.num_heads, spec.head_dim, spec.state_size),
        }
        for name, shape in expected.items():
            found = tuple(getattr(cache, name).shape)
            if found != shape:
                raise ValueError(
                    f"MambaCache.{name} has shape {list(found)}, expected {list(shape)} for a batch of "
                    f"{batch_size} and {spec.short_name()} (make the cache with init_cache)"
                )

    def split_projection(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """in_proj output [..., in_proj_dim] -> z [..., d], xBC [..., conv_dim], dt [..., num_heads] (views)."""
        spec = self.spec
        # One split, not three slices: a slice's backward makes a zero tensor of the whole projection and
        # autograd adds them up (3 allocations and 2 sums of [..., in_proj_dim] a call); split's is one cat.
        z, xbc, dt = projected.split((spec.d_inner, spec.conv_dim, spec.num_heads), dim=-1)
        return z, xbc, dt

    def split_conv_output(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv output [..., conv_dim] -> x [..., nh, p], B [..., g, n], C [..., g, n] (views)."""
        spec = self.spec
        groups = spec.n_groups * spec.state_size
        # One split, as in split_projection: one cat in the backward.
        x, B, C = xbc.split((spec.d_inner, groups, groups), dim=-1)
        return (
            x.unflatten(-1, (spec.num_heads, spec.head_dim)),
            B.unflatten(-1, (spec.n_groups, spec.state_size)),
            C.unflatten(-1, (spec.n_groups, spec.state_size)),
        )

    def time_step(self, dt: torch.Tensor) -> torch.Tensor:
        """softplus(dt + dt_bias) clamped to the spec's range, fp32."""
        dt = F.softplus(dt.float() + self.dt_bias.float())
        upper = self.spec.dt_clamp_max
        return dt.clamp(min=self.spec.dt_clamp_min, max=math.inf if upper is None else upper)

    def _gated_norm_out(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """out_proj(norm(y, gate=z)) in the model dtype; y, z: [..., d] -> [..., H]."""
        return self.out_proj(self.norm(y, z).to(dtype))

    # -- the two entry points -----------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, cache: MambaCache | None = None) -> torch.Tensor:
        """x: [b, t, H] -> [b, t, H]. With a cache: start from its state and leave it at the end of x."""
        spec = self.spec
        t = x.shape[1]
        if cache is not None:
            self._check_cache(cache, x.shape[0])
        z, xbc, dt = self.split_projection(self.in_proj(x))
        A = -torch.exp(self.A_log.float())
        dt = self.time_step(dt)
        weight = self.conv1d.weight.squeeze(1)  # [conv_dim, k]
        kernels = _kernels_for(x)

        # Causal conv over x | B | C, continuing the cached inputs.
        conv_state = cache.conv_state if cache is not None else None
        if kernels is None:
            # Without autograd the conv output takes the place of its input inside the in_proj output.
            xbc, final_conv = ssd.causal_conv1d(
                xbc,
                weight,
                self.conv1d.bias,
                conv_state,
                silu=True,
                overwrite_input=not torch.is_grad_enabled(),
            )
        else:
            xbc_t = xbc.transpose(1, 2)
            if conv_state is not None:
                xbc_t = torch.cat([conv_state.to(xbc_t.dtype), xbc_t], dim=-1)
            else:  # the strided view is channel-last, which causal_conv1d refuses unless its strides are 8k
                xbc_t = xbc_t.contiguous()
            final_conv = xbc_t[:, :, -(spec.conv_kernel - 1) :]
            xbc = kernels.conv1d_fn(xbc_t, weight, self.conv1d.bias, activation="silu")
            xbc = xbc[:, :, xbc.shape[-1] - t :].transpose(1, 2)
        if cache is not None:
            cache.conv_state.copy_(final_conv)

        # SSD scan over the sequence (+ D skip), from the cached SSM state.
        xs, B, C = self.split_conv_output(xbc)
        initial = cache.ssm_state if cache is not None else None
        if kernels is None:
            y, final_ssm = ssd.ssd_chunk_scan(
                xs, dt, A, B, C, spec.chunk_size, initial_state=initial, return_final_state=cache is not None
            )
            y.addcmul_(xs, self.D.float()[:, None])  # y is the scan's own buffer
        else:  # note: mamba_ssm returns the final state in C's dtype, so a bf16 model rounds it once here
            y, final_ssm = kernels.chunk_scan(
                xs,
                dt,
                A,
                B,
                C,
                spec.chunk_size,
                D=self.D.float(),
                initial_states=initial,
                return_final_states=True,
            )
        if cache is not None:
            cache.ssm_state.copy_(final_ssm)

        return self._gated_norm_out(y.flatten(2), z, x.dtype)

    def step(self, x: torch.Tensor, cache: MambaCache) -> torch.Tensor:
        """One-token decode: x [b, 1, H] -> [b, 1, H]; updates `cache` in place."""
        spec = self.spec
        b = x.shape[0]
        if x.shape[1] != 1:
            raise ValueError(f"MambaMixer.step takes one token, x has shape {list(x.shape)}; use forward")
        self._check_cache(cache, b)
        z, xbc, dt = self.split_projection(self.in_proj(x[:, 0]))
        A = -torch.exp(self.A_log.float())
        dt = self.time_step(dt)  # [b, nh]
        weight = self.conv1d.weight.squeeze(1)
        kernels = _kernels_for(x)

        if kernels is None:
            xbc = F.silu(ssd.causal_conv1d_update(xbc, cache.conv_state, weight, self.conv1d.bias))
        else:
            xbc = kernels.conv1d_update(xbc, cache.conv_state, weight, self.conv1d.bias, activation="silu")
        xs, B, C = self.split_conv_output(xbc)  # [b, nh, p], [b, g, n], [b, g, n]

        if kernels is None:
            y = ssd.ssd_state_update(cache.ssm_state, xs, dt, A, B, C)
            y.addcmul_(xs, self.D.float()[:, None])
        else:
            # The kernel wants per-channel dt, A and D; stride-0 expands cost nothing. dt is already final.
            p, n = spec.head_dim, spec.state_size
            y = kernels.state_update(
                cache.ssm_state,
                xs,
                dt[..., None].expand(-1, -1, p),
                A[:, None, None].expand(-1, p, n),
                B,
                C,
                D=self.D.float()[:, None].expand(-1, p),
                dt_softplus=False,
            )
        return self._gated_norm_out(y.view(b, 1, spec.d_inner), z[:, None], x.dtype)
