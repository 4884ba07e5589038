"""Mixture of relu^2 experts with a sigmoid top-k router (DeepSeek-V3 / Nemotron-3), optionally latent.

Routed experts may have different widths inside one block, so each expert is its own pair of
Linear layers and tokens are dispatched expert by expert (only experts that received tokens run).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from puzzle.blocks.mlp import relu2
from puzzle.spec import MoESpec

# transformers' NemotronHTopkRouter adds this to the sum of the chosen scores before dividing.
_NORM_EPS = 1e-20


class _ExpertLinear(nn.Linear):
    """nn.Linear whose random initialisation is skipped on the meta device, where there is nothing to fill.

    A 512-expert block has 1,024 of these; initialising them on meta (decomposed uniform_ calls)
    was most of the time it took to build a Nemotron-3-Super spec on meta.
    """

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Expert(nn.Module):
    """One non-gated relu^2 expert `down(relu(up(x))**2)`: up_proj [I, D], down_proj [D, I]."""

    def __init__(self, input_size: int, width: int) -> None:
        super().__init__()
        self.up_proj = _ExpertLinear(input_size, width, bias=False)
        self.down_proj = _ExpertLinear(width, input_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> [..., D]."""
        return self.down_proj(relu2(self.up_proj(x)))


def _keep_fp32(tensor: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`fn` (a module-wide .to / .cuda / to_empty) applied to `tensor`, moved but never cast below fp32."""
    with torch.no_grad():
        moved = fn(tensor)
        if moved.is_floating_point() and moved.dtype != torch.float32:
            moved = tensor.to(device=moved.device, dtype=torch.float32)
    if isinstance(tensor, nn.Parameter):
        if moved is tensor:
            return tensor
        return nn.Parameter(moved, requires_grad=tensor.requires_grad)
    return moved


class TopKRouter(nn.Module):
    """Sigmoid router: weight [E, H], e_score_correction_bias [E] (an fp32 buffer, kept fp32 by `.to()`).

    Logits are computed in fp32 whatever the model dtype. The correction bias steers which experts
    are chosen but not their weights. With n_group > 1 only experts of the `topk_group` groups with
    the best top-2 sums of biased scores are eligible (DeepSeek-V3 group-limited routing).
    """

    def __init__(self, spec: MoESpec, hidden_size: int) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(spec.num_experts, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's default

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> TopKRouter:
        # Dtype casts of the module (model.to(torch.bfloat16)) must round neither the router weight nor the
        # bias: they decide routing. `puzzle.load(dtype=...)` keeps both fp32 too (as transformers >= 5.25),
        # so a model routes the same however it was made.
        weight = self._parameters.pop("weight")
        bias = self._buffers.pop("e_score_correction_bias")
        try:
            super()._apply(fn, recurse)
        finally:
            self._parameters["weight"] = _keep_fp32(weight, fn)
            self._buffers["e_score_correction_bias"] = _keep_fp32(bias, fn)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [n, H] -> (weights [n, top_k] fp32, expert indices [n, top_k] int64)."""
        spec = self.spec
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [n, E]
        choice = scores + self.e_score_correction_bias.float()
        if spec.topk_group < spec.n_group:
            group_size = spec.num_experts // spec.n_group
            grouped = choice.view(-1, spec.n_group, group_size)
            group_scores = grouped.topk(min(2, group_size), dim=-1).values.sum(dim=-1)  # [n, n_group]
            kept = group_scores.topk(spec.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = choice.masked_fill(~group_mask.repeat_interleave(group_size, dim=1), float("-inf"))
        indices = choice.topk(spec.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS)
        return weights * spec.routed_scaling_factor, indices


class MoEMixer(nn.Module):
    """out = fc2(sum_k w_k * expert_k(fc1(x))) + shared(x); fc1/fc2 only when latent, shared only when width > 0.

    Parameters: gate.{weight, e_score_correction_bias}, experts.{j}.{up_proj, down_proj}.weight,
    fc1_latent_proj.weight [L, H], fc2_latent_proj.weight [H, L], shared_experts.{up_proj, down_proj}.weight.
    Stateless: `init_cache` returns None and `step` is `forward`. `norm_eps` is unused.
    """

    def __init__(self, spec: MoESpec, hidden_size: int, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.spec = spec
        expert_input = spec.expert_input_size(hidden_size)
        self.gate = TopKRouter(spec, hidden_size)
        self.experts = nn.ModuleList(Expert(expert_input, width) for width in spec.widths)
        if spec.latent_size is not None:
            self.fc1_latent_proj = nn.Linear(hidden_size, spec.latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(spec.latent_size, hidden_size, bias=False)
        if spec.shared_width > 0:
            self.shared_experts = Expert(hidden_size, spec.shared_width)

    def init_cache(
        self, batch_size: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """None: the MoE keeps no state across tokens."""
        return None

    def forward(self, x: torch.Tensor, cache: None = None) -> torch.Tensor:
        """x: [b, t, H] -> [b, t, H]."""
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat)
        routed = flat
        if self.spec.latent_size is not None:
            routed = self.fc1_latent_proj(routed)
        routed = self.dispatch(routed, weights, indices)
        if self.spec.latent_size is not None:
            routed = self.fc2_latent_proj(routed)
        out = routed.view(x.shape)
        if self.spec.shared_width > 0:
            out = out + self.shared_experts(x)
        return out

    def step(self, x: torch.Tensor, cache: None = None) -> torch.Tensor:
        """x: [b, 1, H] -> [b, 1, H]."""
        return self.forward(x)

    def dispatch(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """sum_k weights[:, k] * expert_{indices[:, k]}(h): h [n, D], weights / indices [n, top_k] -> [n, D].

        The (token, slot) pairs are sorted by expert so each expert runs once on a contiguous batch;
        the weighted sum accumulates in the weights' dtype (fp32) and is cast back to h's dtype.
        """
        top_k = indices.shape[1]
        expert_of_pair = indices.reshape(-1)
        order = torch.argsort(expert_of_pair, stable=True)
        token_of_pair = order // top_k
        counts = torch.bincount(expert_of_pair, minlength=len(self.experts)).tolist()
        inputs = h[token_of_pair]
        outputs = []
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                outputs.append(expert(inputs[start : start + count]))
                start += count
        out = torch.zeros(h.shape, dtype=weights.dtype, device=h.device)
        if outputs:
            weighted = torch.cat(outputs) * weights.reshape(-1)[order, None]
            out.index_add_(0, token_of_pair, weighted.to(weights.dtype))
        return out.to(h.dtype)
