"""Activation importance of every prunable axis of a parent, measured with forward hooks on calibration tokens.

One streaming collector per mixer kind keeps running sums (memory independent of the number of tokens)
and turns them into score tensors, each with the contract **one value per unit of the axis, higher = more
important (keep first)**. Wherever it can be measured exactly, a unit's score is the energy of its
contribution to the block output, E_t ||contribution_t||^2 (mean over calibration tokens), which is
the squared error (the BLD loss, unnormalised) that removing that unit alone adds. Scores are non-negative;
channel scores of different experts of one block are in the same units and comparable.

Scores per block kind (`BlockImportance.scores` keys; G groups, N state, nh heads, P head_dim, d = nh*P):

- mamba: ``head`` [nh] (E||W_h u_h||^2 with W_h the head's out_proj columns, u = out_proj input, from
  per-head second moments [nh, P, P]; heads are ranked within their group), ``channel`` [nh, P]
  (E[u_c^2] * ||out_proj[:, c]||^2), ``state`` [G, N] (an approximation of the same energy, below),
  ``norm_q`` [d] (auxiliary, not a score: E[(v_c / rms_group(v))^2] of the gated-norm input v, used to
  rescale the norm weights when a group loses channels).
- attention: ``q_head`` [nq], ``kv_group`` [nkv]: the energy E||W_o[:, S] u_S||^2 of the output contributed
  by the head's / the group's channels S (u = o_proj input), i.e. exactly the squared error of removing
  that head or group alone. From per-group second moments of u ([nkv, r*hd, r*hd], r = nq / nkv),
  so cross terms between the heads of a group are included.
- moe: ``expert`` [E] (mean over all tokens of ||w * expert output||^2, w the routing weight, 0 where
  not routed: the error of dropping the expert without re-routing its tokens), ``expert_frequency`` [E]
  (fraction of tokens routed to the expert; informative only), ``expert_channel.{j}`` [I_j] (mean over
  all tokens of (w * a_c)^2 * ||down_j[:, c]||^2, a the expert's activation), ``shared_channel`` [S]
  (E[a_c^2] * ||down[:, c]||^2); the expert scores are measured in the latent space when the MoE is
  latent (fc2 is shared by all experts). Latent MoE only: ``latent`` [L] (geometric mean of the input side,
  mean |fc1 output_l| x routing-weighted norm of the experts' up columns l, and the output side, mean
  |fc2 input_l| x ||fc2[:, l]||), plus ``latent_in_cov`` / ``latent_out_cov`` [L, L] (auxiliary: E[h h^T] of
  the fc1 output and E[r r^T] of the fc2 input, from which `init_child` builds PCA projections, better than
  selecting latent dims because the latent basis is not axis-aligned).
- mlp: ``channel`` [I] (E[a_c^2] * ||down_proj[:, c]||^2).
- every kind, when ``linear_fit``: ``lin_xtx`` [H, H], ``lin_xty`` [H, H], ``lin_xsum`` [H], ``lin_ysum`` [H],
  ``lin_count`` [] (fp64 sums of mixer input x and output y over every k-th token, and how many tokens):
  the normal equations of a least-squares linear replacement of the mixer (`puzzle.prune.init`).

The Mamba SSM-state score. Channel n of group g contributes y^(n)_t[h, :] = C_t[g, n] * s_t[h, :, n] to the
scan output of every head h in g, where s_t[h, :, n] = a_t[h] s_{t-1}[h, :, n] + dt_t[h] B_t[g, n] x_t[h, :] and
a = exp(dt * A). Pruning n removes exactly this term, so its energy E_t ||y^(n)_t||^2 is the error the
child makes. Materialising s_t per n is a second scan; instead we use the stationary approximation of that
recursion (inputs uncorrelated across time, read-out independent of the state):
``state[g, n] = E[C_n^2] * sum_{h in g} E[dt_h^2 ||x_h||^2 B_n^2] * min(1 / (1 - E[a_h^2]), T)``,
i.e. how strongly channel n is read out times how much energy is written into it, with the
geometric memory of each head capped at the sequence length T. It costs one [tokens, nh] x [tokens, G*N]
product per batch (a few % of in_proj) and needs only the in_proj output (conv and activations are
recomputed from it, so the mixer's scan is not touched). The same n is scored once for B and C because it
is removed from both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from puzzle import dist
from puzzle.artifacts import (
    Artifact,
    ArtifactError,
    fingerprint_json,
    fingerprint_model,
    fingerprint_tensors,
    safetensors_writer,
)
from puzzle.blocks import ssd
from puzzle.progress import progress
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, MoESpec, NoOpSpec, kind_entry

FORMAT_VERSION = 2  # 2: manifest by puzzle.artifacts, reuse keyed on calibration tokens and settings
SCORES_FILE = "importance.safetensors"
MANIFEST_FILE = "importance.manifest.json"
# The latent second moments (for PCA, [L, L] each) use 1 token in 4: a PCA basis needs far fewer tokens.
_COV_EVERY = 4
LINEAR_FIT_KEYS = ("lin_xtx", "lin_xty", "lin_xsum", "lin_ysum", "lin_count")


@dataclass
class BlockImportance:
    """Importance scores of one block: `scores[name]` is a CPU tensor (contract in the module docstring).

    `kind` is the block kind the scores were measured on; `tokens` how many tokens they average over.
    """

    kind: str
    scores: dict[str, torch.Tensor]
    tokens: int

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.scores:
            raise KeyError(
                f"no {name!r} importance for this {self.kind} block; present: {sorted(self.scores)}"
            )
        return self.scores[name]

    def __contains__(self, name: str) -> bool:
        return name in self.scores

    def replace(self, scores: Mapping[str, torch.Tensor]) -> BlockImportance:
        """A copy with some score tensors replaced (e.g. random scores for a baseline)."""
        return BlockImportance(self.kind, {**self.scores, **scores}, self.tokens)

    @property
    def has_linear_fit(self) -> bool:
        return all(key in self.scores for key in LINEAR_FIT_KEYS)


@dataclass
class ModelImportance:
    """Importance of every measured block of a parent: `blocks[i]` for block i, `parent` its fingerprint."""

    blocks: dict[int, BlockImportance]
    tokens: int
    parent: str
    linear_fit: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, index: int) -> BlockImportance:
        if index not in self.blocks:
            raise KeyError(f"no importance for block {index}; measured blocks: {sorted(self.blocks)}")
        return self.blocks[index]


# ----------------------------------------------------------------------------------------------------------
# Collectors: one per mixer kind. Each registers hooks on its mixer, keeps fp64 sums, and finalises scores.


def _column_norms(weight: torch.Tensor) -> torch.Tensor:
    """||W[:, c]|| for W [out, in] -> [in], fp32 on CPU."""
    return weight.detach().float().norm(dim=0).cpu()


class _Collector:
    """Base: owns hook handles and the token count."""

    def __init__(self, mixer: nn.Module, hidden_size: int, fit_every: int) -> None:
        self.mixer = mixer
        self.spec = mixer.spec
        self.tokens = 0
        self.handles: list[Any] = []
        self.generator = torch.Generator().manual_seed(0)
        self.fit_every = fit_every
        self.sums: dict[str, torch.Tensor] = {}
        if fit_every > 0:
            self.handles.append(mixer.register_forward_hook(self._fit_hook))

    def _add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float64)
        if name in self.sums:
            self.sums[name] += value
        else:
            self.sums[name] = value.clone()

    def _fit_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        # Every `fit_every`-th token only: the normal equations cost 4 H^2 flops per token, as much as a
        # sizeable part of the block itself, and H^2 unknowns are well determined by far fewer tokens.
        rows = self._sample(args[0].numel() // args[0].shape[-1], self.fit_every, args[0].device)
        x = args[0].detach().reshape(-1, args[0].shape[-1])[rows].float()
        y = output.detach().reshape(-1, output.shape[-1])[rows].float()
        self._add("lin_count", torch.tensor(float(x.shape[0])))
        self._add("lin_xtx", x.T @ x)
        self._add("lin_xty", x.T @ y)
        self._add("lin_xsum", x.sum(0))
        self._add("lin_ysum", y.sum(0))

    def start_batch(self, index: int) -> None:
        """Seed the token subsample from the batch's global index: the sample, and so the sums, are then the
        same however the batches are sharded over ranks."""
        self.generator.manual_seed(index)

    def rank_state(self) -> dict[str, Any]:
        """What the other ranks need to merge with this one: the token count and the shapes of the sums."""
        return {
            "tokens": self.tokens,
            "sums": {name: (tuple(v.shape), v.dtype) for name, v in self.sums.items()},
        }

    def merge_ranks(self, states: list[dict[str, Any]]) -> None:
        """Make the accumulators those of all ranks together; `states` holds every rank's `rank_state()`.

        A rank may lack a sum that another has (an expert none of its tokens were routed to, a rank with no
        batches): it joins the reduction with zeros. At world size 1 this changes nothing.
        """
        self.tokens = sum(state["tokens"] for state in states)
        for state in states:
            for name, (shape, dtype) in state["sums"].items():
                if name not in self.sums:
                    self.sums[name] = torch.zeros(shape, dtype=dtype)
        dist.all_reduce_sum_(self.sums)

    def _sample(self, n: int, every: int, device: torch.device) -> torch.Tensor | slice:
        """Rows for a 1-in-`every` subsample of n tokens: random (seeded) so that no position in the sequence
        is favoured (a fixed stride would see the same positions of every sequence)."""
        if every == 1:
            return slice(None)
        picked = torch.randperm(n, generator=self.generator)[: max(1, n // every)]
        return picked.to(device)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def finalize(self) -> BlockImportance:
        scores = self._scores()
        for key in LINEAR_FIT_KEYS:
            if key in self.sums:
                scores[key] = self.sums[key].cpu()  # fp64 sums, not means: the solve is scale-free
        return BlockImportance(self.spec.kind, scores, self.tokens)

    def _scores(self) -> dict[str, torch.Tensor]:
        return {}

    def _mean(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.sums or self.tokens == 0:
            return torch.zeros(shape, dtype=torch.float32)
        return (self.sums[name] / self.tokens).float().cpu()


class _MLPCollector(_Collector):
    def __init__(self, mixer: nn.Module, hidden_size: int, fit_every: int) -> None:
        super().__init__(mixer, hidden_size, fit_every)
        self.handles.append(mixer.down_proj.register_forward_pre_hook(self._down_hook))

    def _down_hook(self, module: nn.Module, args: tuple) -> None:
        a = args[0].detach()
        self.tokens += a.numel() // a.shape[-1]
        self._add("sq", a.float().square().reshape(-1, a.shape[-1]).sum(0))

    def _scores(self) -> dict[str, torch.Tensor]:
        width = self.spec.width
        return {"channel": self._mean("sq", (width,)) * _column_norms(self.mixer.down_proj.weight).square()}


class _AttentionCollector(_Collector):
    def __init__(self, mixer: nn.Module, hidden_size: int, fit_every: int) -> None:
        super().__init__(mixer, hidden_size, fit_every)
        self.handles.append(mixer.o_proj.register_forward_pre_hook(self._o_hook))

    def _o_hook(self, module: nn.Module, args: tuple) -> None:
        spec: AttentionSpec = self.spec
        u = args[0].detach().float().reshape(-1, spec.num_kv_heads, args[0].shape[-1] // spec.num_kv_heads)
        self.tokens += u.shape[0]
        self._add("cov", torch.einsum("tgi,tgj->gij", u, u))

    def _scores(self) -> dict[str, torch.Tensor]:
        spec: AttentionSpec = self.spec
        nkv, r, hd = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
        cov = self._mean("cov", (nkv, r * hd, r * hd)).double()  # E[u_g u_g^T] per group
        weight = self.mixer.o_proj.weight.detach().double().cpu().view(-1, nkv, r * hd)
        gram = torch.einsum("hgi,hgj->gij", weight, weight)  # W_g^T W_g
        energy = gram * cov  # summed over a block: E||W_S u_S||^2 of that block of channels
        kv_group = energy.sum((1, 2))
        q_head = torch.stack(
            [energy[:, i * hd : (i + 1) * hd, i * hd : (i + 1) * hd].sum((1, 2)) for i in range(r)], dim=1
        ).reshape(-1)
        return {"q_head": q_head.float(), "kv_group": kv_group.float()}


class _MambaCollector(_Collector):
    def __init__(self, mixer: nn.Module, hidden_size: int, fit_every: int) -> None:
        super().__init__(mixer, hidden_size, fit_every)
        self.max_len = 0
        self.handles.append(mixer.in_proj.register_forward_hook(self._in_hook))
        self.handles.append(mixer.out_proj.register_forward_pre_hook(self._out_hook))

    def rank_state(self) -> dict[str, Any]:
        return {**super().rank_state(), "max_len": self.max_len}

    def merge_ranks(self, states: list[dict[str, Any]]) -> None:
        super().merge_ranks(states)
        self.max_len = max(state["max_len"] for state in states)

    def _in_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        spec: MambaSpec = self.spec
        mixer = self.mixer
        nh, G = spec.num_heads, spec.n_groups
        proj = output.detach().float()  # [b, t, in_proj_dim]
        t = proj.shape[1]
        self.max_len = max(self.max_len, t)
        # Recompute the causal depthwise conv + SiLU over x|B|C (cheap: K taps per channel) and dt with the
        # mixer's own pieces: the conv is a function inside its forward, not a module a hook can see.
        with torch.no_grad():
            _, xbc, dt_raw = mixer.split_projection(proj)
            weight = mixer.conv1d.weight.float().squeeze(1)
            bias = mixer.conv1d.bias.float() if mixer.conv1d.bias is not None else None
            xbc, _ = ssd.causal_conv1d(xbc.contiguous(), weight, bias, silu=True)
            x, B, C = (part.flatten(0, 1) for part in mixer.split_conv_output(xbc))  # [T, nh, P], [T, G, N]
            dt = mixer.time_step(dt_raw).flatten(0, 1)  # [T, nh]
            A = -torch.exp(mixer.A_log.float())
        write = (dt.square() * x.square().sum(-1)).view(-1, G, nh // G)  # [T, G, heads per group]
        self._add("write", torch.einsum("tgh,tgn->ghn", write, B.square()))
        self._add("read", C.square().sum(0))
        self._add("decay2", torch.exp(2.0 * dt * A).sum(0))

    def _out_hook(self, module: nn.Module, args: tuple) -> None:
        u = args[0].detach().float()
        u = u.reshape(-1, u.shape[-1])
        self.tokens += u.shape[0]
        self._add("sq", u.square().sum(0))
        heads = u.view(-1, self.spec.num_heads, self.spec.head_dim)
        self._add("cov", torch.einsum("thi,thj->hij", heads, heads))

    def _scores(self) -> dict[str, torch.Tensor]:
        spec: MambaSpec = self.spec
        nh, P, G, N = spec.num_heads, spec.head_dim, spec.n_groups, spec.state_size
        weight = self.mixer.out_proj.weight.detach().double().cpu().view(-1, nh, P)
        channel = (self._mean("sq", (nh * P,)) * _column_norms(self.mixer.out_proj.weight).square()).view(
            nh, P
        )
        gram = torch.einsum("khi,khj->hij", weight, weight)  # W_h^T W_h per head
        head = (gram * self._mean("cov", (nh, P, P)).double()).sum((1, 2)).float()
        norm_weight = self.mixer.norm.weight.detach().float().cpu()
        safe = torch.where(norm_weight.abs() > 1e-12, norm_weight, torch.ones_like(norm_weight))
        norm_q = self._mean("sq", (nh * P,)) / safe.square()
        # Memory of each head: 1 / (1 - E[a^2]) for an AR(1) state, capped at the longest sequence seen.
        decay2 = self._mean("decay2", (nh,)).double()
        horizon = (1.0 / (1.0 - decay2).clamp(min=1e-12)).clamp(max=max(self.max_len, 1))
        write = self._mean("write", (G, nh // G, N)).double()
        read = self._mean("read", (G, N)).double()
        state = read * (write * horizon.view(G, nh // G, 1)).sum(1)
        return {"head": head, "channel": channel, "state": state.float(), "norm_q": norm_q}


class _MoECollector(_Collector):
    """Relies on `MoEMixer`: `gate(x)` returns (weights [n, k], indices [n, k]) and its `ExpertBank` hands
    each expert's batch (activations, output, routing weights) to an observer as it dispatches."""

    def __init__(self, mixer: nn.Module, hidden_size: int, fit_every: int) -> None:
        super().__init__(mixer, hidden_size, fit_every)
        self.handles.append(mixer.gate.register_forward_hook(self._gate_hook))
        self.handles.append(mixer.experts.register_observer(self._expert_observer))
        if self.spec.shared_width > 0:
            self.handles.append(mixer.shared_experts.down_proj.register_forward_pre_hook(self._shared_hook))
        if self.spec.latent_size is not None:
            self.handles.append(mixer.fc2_latent_proj.register_forward_pre_hook(self._latent_hook))
            self.handles.append(mixer.fc1_latent_proj.register_forward_hook(self._latent_in_hook))

    def _gate_hook(self, module: nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        _, indices = output
        self.tokens += indices.shape[0]
        self._add("count", torch.bincount(indices.reshape(-1), minlength=self.spec.num_experts))

    def _expert_observer(
        self,
        j: int,
        inputs: torch.Tensor,
        activation: torch.Tensor,
        output: torch.Tensor,
        weight: torch.Tensor,
    ) -> None:
        """One expert's batch from the bank: activation [c, w_j], output [c, D] (unweighted), weight [c]."""
        weight = weight.detach().float()
        self._add(f"act.{j}", (activation.detach().float() * weight[:, None]).square().sum(0))
        self._add(f"out.{j}", (output.detach().float().square().sum(-1) * weight.square()).sum())

    def _shared_hook(self, module: nn.Module, args: tuple) -> None:
        a = args[0].detach().float()
        self._add("shared", a.square().reshape(-1, a.shape[-1]).sum(0))

    def _latent_hook(self, module: nn.Module, args: tuple) -> None:
        r = args[0].detach().float().reshape(-1, args[0].shape[-1])
        self._add("latent", r.abs().sum(0))
        sample = r[self._sample(r.shape[0], _COV_EVERY, r.device)]
        self._add("cov_count", torch.tensor(float(sample.shape[0])))
        self._add("latent_out_cov", sample.T @ sample)

    def _latent_in_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        h = output.detach().float().reshape(-1, output.shape[-1])
        self._add("latent_in", h.abs().sum(0))
        sample = h[self._sample(h.shape[0], _COV_EVERY, h.device)]
        self._add("latent_in_cov", sample.T @ sample)

    def _scores(self) -> dict[str, torch.Tensor]:
        spec: MoESpec = self.spec
        mixer = self.mixer
        scores = {
            "expert": torch.stack([self._mean(f"out.{j}", ()) for j in range(spec.num_experts)]).reshape(
                spec.num_experts
            ),
            "expert_frequency": self._mean("count", (spec.num_experts,)),
        }
        bank = mixer.experts
        for j in range(spec.num_experts):
            # Column norms in the expert's own (latent) space: fc2 is shared by every expert.
            scores[f"expert_channel.{j}"] = (
                self._mean(f"act.{j}", (spec.widths[j],)) * _column_norms(bank.down_weight(j)).square()
            )  # energy per channel
        if spec.shared_width > 0:
            scores["shared_channel"] = (
                self._mean("shared", (spec.shared_width,))
                * _column_norms(mixer.shared_experts.down_proj.weight).square()
            )
        if spec.latent_size is not None:
            # A latent dim is read by every expert's up_proj and written by fc2: the geometric mean of its
            # input-side (mean |fc1_l| x routing-frequency-weighted norm of up columns l) and output-side
            # (mean |fc2 input_l| x ||fc2[:, l]||) contributions.
            out_side = self._mean("latent", (spec.latent_size,)) * _column_norms(mixer.fc2_latent_proj.weight)
            frequency = scores["expert_frequency"]
            up_sq = sum(f * _column_norms(bank.up_weight(j)).square() for j, f in enumerate(frequency))
            in_side = self._mean("latent_in", (spec.latent_size,)) * up_sq.sqrt()
            scores["latent"] = (out_side * in_side).sqrt()
            L = spec.latent_size
            count = float(self.sums.get("cov_count", torch.tensor(0.0))) or 1.0
            for name in ("latent_in_cov", "latent_out_cov"):
                scores[name] = (
                    (self.sums[name] / count).float().cpu() if name in self.sums else torch.zeros(L, L)
                )
        return scores


class _StatelessCollector(_Collector):
    """Linear and no-op mixers have no axis to prune; only the token count (and a linear fit if asked)."""

    def __init__(self, mixer: nn.Module, hidden_size: int, fit_every: int) -> None:
        super().__init__(mixer, hidden_size, fit_every)
        self.handles.append(mixer.register_forward_pre_hook(self._count_hook))

    def _count_hook(self, module: nn.Module, args: tuple) -> None:
        self.tokens += args[0].numel() // args[0].shape[-1]


class _NoOpCollector(_StatelessCollector):
    """A no-op block never calls its mixer (the model skips it), so there is nothing to fit."""

    def __init__(self, mixer: nn.Module, hidden_size: int, fit_every: int) -> None:
        super().__init__(mixer, hidden_size, 0)


# The importance collector of each block kind, keyed by spec type.
IMPORTANCE_COLLECTORS: dict[type, type[_Collector]] = {
    MambaSpec: _MambaCollector,
    AttentionSpec: _AttentionCollector,
    MoESpec: _MoECollector,
    MLPSpec: _MLPCollector,
    LinearSpec: _StatelessCollector,
    NoOpSpec: _NoOpCollector,
}


def _make_collector(mixer: nn.Module, hidden_size: int, fit_every: int) -> _Collector:
    collector = kind_entry(IMPORTANCE_COLLECTORS, mixer.spec, "no importance collector for block spec type")
    return collector(mixer, hidden_size, fit_every)


# ----------------------------------------------------------------------------------------------------------
# Public entry points.


def _fit_every(linear_fit: bool, every: int) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"linear_fit_every must be a positive integer, found {every!r}")
    return every if linear_fit else 0


@torch.no_grad()
def collect_block_importance(
    mixer: nn.Module, inputs: Iterable[torch.Tensor], *, linear_fit: bool = True, linear_fit_every: int = 8
) -> BlockImportance:
    """Importance of one mixer from its inputs (each [b, t, H], the normed block input).

    `linear_fit`: also accumulate the least-squares sums, over every `linear_fit_every`-th token.
    """
    hidden_size = None
    collector = None
    try:
        for x in inputs:
            if collector is None:
                hidden_size = x.shape[-1]
                collector = _make_collector(mixer, hidden_size, _fit_every(linear_fit, linear_fit_every))
            mixer(x)
    finally:
        if collector is not None:
            collector.remove()
    if collector is None:
        raise ValueError("collect_block_importance: `inputs` yielded no tensors")
    return collector.finalize()


def _is_sharded(model: nn.Module) -> bool:
    """Whether any unit of `model` is sharded with FSDP2 (its forwards are then collectives)."""
    return any(isinstance(module, FSDPModule) for module in model.modules())


@contextmanager
def _unsharded(mixer: nn.Module) -> Iterator[None]:
    """The mixer's whole weights in place for the body when it is an FSDP unit (a collective), else nothing:
    the scores weight the activation sums by column norms of the full matrices."""
    if not isinstance(mixer, FSDPModule):
        yield
        return
    mixer.unshard()
    try:
        yield
    finally:
        mixer.reshard()


def _own_batches(batches: Iterable[torch.Tensor], sharded: bool, state: dict[str, Any]) -> Iterator[Any]:
    """(global index, batch) of this rank's round-robin share; on a sharded model also counts every batch
    of the stream in `state["total"]` and keeps its first in `state["first"]` (the padding forwards')."""
    if not sharded:
        yield from dist.shard(enumerate(batches))
        return
    rank, world = dist.rank(), dist.world_size()
    for index, batch in enumerate(batches):
        state["total"] = index + 1
        if index == 0:
            state["first"] = batch
        if index % world == rank:
            yield index, batch


@torch.no_grad()
def collect_importance(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    linear_fit: bool = True,
    linear_fit_every: int = 8,
    layers: Iterable[int] | None = None,
    parent_fp: str | None = None,
) -> ModelImportance:
    """Run the parent (`HybridLM`) over `batches` of token ids [b, t] and score every block in `layers`.

    Memory is independent of the number of tokens (running sums only); the forward is the model's own
    `backbone` up to the last block in `layers` (no head: no logits are made).
    `linear_fit`: also accumulate the least-squares sums of every block (for linear replacements), over
    every `linear_fit_every`-th token (1 = all; the sums cost 4 H^2 flops per token and block).
    `parent_fp`: the fingerprint recorded as the parent's (default `parent_fingerprint(model)`).

    Under torch.distributed every rank passes the same `batches` and runs only its round-robin share
    (`puzzle.dist.shard`); the sums are then added over ranks, so every rank returns the scores of all
    batches (equal to a single-process run up to float summation order) and `tokens` is the global count.
    A parent sharded with FSDP2 (`puzzle.load(..., shard=True)`, `puzzle.shard.shard_parent`) works the
    same way: each unit all-gathers its weights in its own forward, a collective, so a rank with fewer
    batches than the others runs extra forwards (one row of the first batch) with the hooks removed, and
    every rank runs every unit equally often; the scores read the mixers' full weights a unit at a time.
    """
    indices = list(range(len(model.layers))) if layers is None else list(layers)
    hidden = model.spec.hidden_size
    fit_every = _fit_every(linear_fit, linear_fit_every)
    sharded = _is_sharded(model)
    collectors = {i: _make_collector(model.layers[i].mixer, hidden, fit_every) for i in indices}
    # The blocks up to the last measured one, without the head: nobody reads the [b, t, V] fp32 logits.
    num_blocks = max(indices, default=-1) + 1
    tokens, own = 0, 0
    stream: dict[str, Any] = {"total": 0, "first": None}
    try:
        for index, input_ids in progress(_own_batches(batches, sharded, stream), "importance", unit="batch"):
            for collector in collectors.values():
                collector.start_batch(index)
            model.backbone(input_ids, num_blocks)
            tokens += input_ids.numel()
            own += 1
    finally:
        for collector in collectors.values():
            collector.remove()
    if sharded:  # the padding forwards, hooks removed: their statistics are never collected
        for _ in range(math.ceil(stream["total"] / dist.world_size()) - own):
            model.backbone(stream["first"][:1], num_blocks)
    # Merge the ranks' running sums before any score is computed (scores are not additive, sums are).
    states = dist.all_gather_object((tokens, {i: c.rank_state() for i, c in collectors.items()}))
    tokens = sum(rank_tokens for rank_tokens, _ in states)
    for i, collector in collectors.items():
        collector.merge_ranks([blocks[i] for _, blocks in states])
    if tokens == 0:
        raise ValueError("collect_importance: `batches` yielded no tokens")
    blocks = {}
    for i, collector in collectors.items():  # the same order on every rank: unsharding is a collective
        with _unsharded(collector.mixer):
            blocks[i] = collector.finalize()
    extra = {"linear_fit_every": linear_fit_every} if linear_fit else {}
    return ModelImportance(blocks, tokens, parent_fp or parent_fingerprint(model), linear_fit, extra)


def parent_fingerprint(model: nn.Module) -> str:
    """The parent's fingerprint recorded with its importance: `puzzle.artifacts.fingerprint_model`."""
    return fingerprint_model(model)


def _artifact(directory: str | Path) -> Artifact:
    return Artifact(Path(directory), "importance", FORMAT_VERSION)


def save_importance(
    importance: ModelImportance, directory: str | Path, inputs: Mapping[str, str] | None = None
) -> Path:
    """Write `importance.safetensors` (keys `layers.{i}.{score}`) and its manifest atomically; returns the manifest.

    `inputs` are the fingerprints the scores were measured from (default: the parent's alone), recorded
    for `importance_for`'s reuse check. Collective under torch.distributed (rank 0 writes).
    """
    tensors = {
        f"layers.{i}.{name}": value
        for i, block in importance.blocks.items()
        for name, value in block.scores.items()
    }
    info = {
        "tokens": importance.tokens,
        "linear_fit": importance.linear_fit,
        "blocks": {str(i): {"kind": b.kind, "tokens": b.tokens} for i, b in importance.blocks.items()},
        **importance.extra,
    }
    artifact = _artifact(directory)
    inputs = {"parent": importance.parent} if inputs is None else dict(inputs)
    artifact.write(inputs, {SCORES_FILE: safetensors_writer(tensors)}, info)
    return artifact.manifest_path


def load_importance(directory: str | Path) -> ModelImportance:
    """Read what `save_importance` wrote; a missing or malformed file is an error naming it."""
    artifact = _artifact(directory)
    manifest = artifact.read_manifest()
    known = {"tokens", "linear_fit", "blocks"}
    missing = sorted(known - set(manifest.info))
    if missing or "parent" not in manifest.inputs:
        raise ArtifactError(
            f"{artifact.manifest_path} lacks {missing or ['inputs.parent']}: "
            f"expected info {sorted(known)} and inputs ['parent', ...]"
        )
    tensors = artifact.load_tensors(SCORES_FILE)
    blocks: dict[int, BlockImportance] = {}
    for key, block in manifest.info["blocks"].items():
        prefix = f"layers.{key}."
        scores = {name[len(prefix) :]: value for name, value in tensors.items() if name.startswith(prefix)}
        blocks[int(key)] = BlockImportance(block["kind"], scores, int(block["tokens"]))
    extra = {key: value for key, value in manifest.info.items() if key not in known}
    info = manifest.info
    return ModelImportance(
        blocks, int(info["tokens"]), manifest.inputs["parent"], bool(info["linear_fit"]), extra
    )


def importance_for(
    model: nn.Module,
    batches: Callable[[], Iterable[torch.Tensor]] | Iterable[torch.Tensor],
    directory: str | Path,
    *,
    linear_fit: bool = True,
    linear_fit_every: int = 8,
    calibration: str | None = None,
    parent_fp: str | None = None,
) -> tuple[ModelImportance, bool]:
    """The importance saved in `directory` if it was measured from exactly these inputs, else measure and save it.

    The inputs are the parent (`parent_fingerprint`), the calibration tokens and the settings (`linear_fit`,
    `linear_fit_every`); the saved scores are reused only when all three fingerprints and the format
    version match (`puzzle.artifacts.Artifact.load_if_current`). The calibration fingerprint is
    `calibration` when given (e.g. `fingerprint_file` of the token file: then a zero-argument callable
    `batches` is not even called when the scores are reused), else `fingerprint_tensors` of the batches,
    which are then read once and kept as a list (token ids are small: 1M tokens are 8 MB).
    `parent_fp`: the parent's fingerprint (`puzzle.Run` passes one from the parent's files; default
    `parent_fingerprint(model)`). Returns (importance, reused).

    Under torch.distributed every rank calls this with the same arguments (checked): rank 0 decides whether
    to reuse, the ranks measure their shares of `batches` together (`collect_importance`), rank 0 writes
    the files and the others then load them, so that every rank holds bit-identical scores. `directory`
    must be on a filesystem every rank sees.
    """
    stream = None
    if calibration is None:
        stream = list(batches() if callable(batches) else batches)
        calibration = fingerprint_tensors(stream)
    settings = {"linear_fit": linear_fit, "linear_fit_every": _fit_every(linear_fit, linear_fit_every)}
    inputs = {
        "parent": parent_fp or parent_fingerprint(model),
        "calibration": calibration,
        "settings": fingerprint_json(settings),
    }
    if _artifact(directory).load_if_current(inputs) is not None:
        return load_importance(directory), True
    if stream is None:
        stream = batches() if callable(batches) else batches
    importance = collect_importance(
        model, stream, linear_fit=linear_fit, linear_fit_every=linear_fit_every, parent_fp=inputs["parent"]
    )
    save_importance(importance, directory, inputs)
    if not dist.is_main():
        importance = load_importance(directory)  # rank 0's file: bit-identical on every rank
    return importance, False
