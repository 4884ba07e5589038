"""Mixture of relu^2 experts with a sigmoid top-k router (DeepSeek-V3 / Nemotron-3), optionally latent.

The routed experts of a block live in one `ExpertBank`: two matrices whose rows are the experts' channels,
so experts of different widths share one pair of tensors. The (token, slot) pairs are sorted by expert once
and each expert runs on its tokens: in a loop over views of the bank (the reference; without autograd in
chunks of experts, one gather, activation and scatter per chunk, so only the matmuls run per expert) or,
when every expert has the same width, in two grouped matmuls (`torch.nn.functional.grouped_mm`: in bf16 on a
Hopper / Blackwell GPU one CUTLASS kernel each and no host sync; on the CPU a C++ loop over the experts,
slower than the chunked loop, so "auto" runs it only on a GPU). A decode step's few pairs run one by one.
Checkpoints keep the hub's per-expert tensors: the bank owns that layout (`ExpertBank.hub_name`, `hub_views`,
`hub_shapes`, `allocate`, `state_from_hub`), and `module_hub_state` / `allocate_banks` apply it to a module.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from puzzle.blocks.mlp import relu2
from puzzle.blocks.tensors import TensorInfo, linear_tensors
from puzzle.spec import MoESpec

# transformers' NemotronHTopkRouter adds this to the sum of the chosen scores before dividing.
_NORM_EPS = 1e-20

_GROUPED_MM: Callable[..., torch.Tensor] | None = getattr(F, "grouped_mm", None) or getattr(
    torch, "_grouped_mm", None
)
# Grouped GEMM kernels need every row stride to be a multiple of 16 bytes (the widths and input size).
_GROUPED_ALIGNMENT_BYTES = 16

# The CPU loop gathers, activates, weights and scatters this many (token, slot) pairs at once (whole experts,
# in order): few enough that a chunk's buffers stay in the L2 cache, enough to amortise the per-op overhead.
_CHUNK_ROWS = 256
# Experts with at least this many pairs read their `up` rows sequentially before the matmul (see _chunked).
_PREFETCH_ROWS = 16

# observer(expert, inputs [c, D], activation [c, w], output [c, D] before the routing weight, weights [c] fp32)
ExpertObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _relu2_(a: torch.Tensor) -> torch.Tensor:
    """relu(a)^2 of a fresh temporary, in place when autograd does not need the intermediate."""
    if a.requires_grad:
        return relu2(a)
    return torch.relu_(a).square_()


class _Linear(nn.Linear):
    """nn.Linear whose random initialisation is skipped on the meta device, where there is nothing to fill
    (decomposed uniform_ calls on meta are most of the time it takes to build a large spec there)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Expert(nn.Module):
    """One non-gated relu^2 MLP `down(relu(up(x))**2)`: up_proj [I, D], down_proj [D, I] (the shared expert)."""

    def __init__(self, input_size: int, width: int) -> None:
        super().__init__()
        self.up_proj = _Linear(input_size, width, bias=False)
        self.down_proj = _Linear(width, input_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> [..., D]."""
        return self.down_proj(_relu2_(self.up_proj(x)))


class ExpertBank(nn.Module):
    """The routed experts of one block, expert j being `x -> relu(x @ up_j.T)**2 @ down_j`.

    up [W, D] and down [W, D], W = sum(widths): row c of `up` is channel c's input weights (a row of its
    expert's hub `up_proj.weight` [w_j, D]), row c of `down` its output weights (a column of the hub's
    `down_proj.weight` [D, w_j]). Expert j owns rows offsets[j]:offsets[j+1] of both, so pruning a channel
    removes one row of each, and with one width the bank is a [E, w, D] stack for grouped matmuls.

    `path`: "auto" (grouped where `uses_grouped`, a few pairs one by one, else the loop), "loop" (always the
    reference loop) or "grouped" (an error where it cannot run). Observers (`register_observer`) see every
    expert's batch.
    """

    def __init__(self, input_size: int, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.widths = tuple(widths)
        self.offsets = tuple(itertools.accumulate(self.widths, initial=0))
        self.up = nn.Parameter(torch.empty(self.offsets[-1], input_size))
        self.down = nn.Parameter(torch.empty(self.offsets[-1], input_size))
        self.path = "auto"
        # Set for an fp8 block (`puzzle.blocks.formats.install`): each matmul's input quantized per token, as
        # the served fp8 MoE does; the bank then runs the reference loop.
        self.activation_quant: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._observers: OrderedDict[int, ExpertObserver] = OrderedDict()
        self._views: tuple[tuple[int, int], list[torch.Tensor], list[torch.Tensor]] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default per expert: U(+-1/sqrt(fan_in)), fan_in D for up_proj and w_j for down_proj.

        Skipped on the meta device, where there is nothing to fill (and decomposed uniform_ calls are slow).
        """
        if self.up.is_meta:
            return
        with torch.no_grad():
            bound = 1 / math.sqrt(self.up.shape[1])
            self.up.uniform_(-bound, bound)
            for j, width in enumerate(self.widths):
                bound = 1 / math.sqrt(width)
                self.down[self.offsets[j] : self.offsets[j + 1]].uniform_(-bound, bound)

    def __len__(self) -> int:
        return len(self.widths)

    def extra_repr(self) -> str:
        widths = self.widths[0] if len(set(self.widths)) == 1 else "mixed"
        return f"experts={len(self)}, input_size={self.up.shape[1]}, width={widths}, path={self.path!r}"

    def up_weight(self, j: int) -> torch.Tensor:
        """Expert j's hub `up_proj.weight` [w_j, D]: a view of the bank."""
        return self.up[self.offsets[j] : self.offsets[j + 1]]

    def down_weight(self, j: int) -> torch.Tensor:
        """Expert j's hub `down_proj.weight` [D, w_j]: a (transposed) view of the bank."""
        return self.down[self.offsets[j] : self.offsets[j + 1]].T

    def expert(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Expert j alone, unweighted: x [c, D] -> [c, D]."""
        return relu2(x @ self.up_weight(j).T) @ self.down_weight(j).T

    # ------------------------------------------------------------ the hub layout: one tensor per expert
    # The hub (and every NemotronH checkpoint) stores expert j as `{j}.up_proj.weight` [w_j, D] and
    # `{j}.down_proj.weight` [D, w_j] (names relative to the bank, `experts.`); the bank keeps `down` transposed.

    @staticmethod
    def hub_name(j: int, half: str) -> str:
        """The hub name of expert j's `half` ("up" or "down") weight, relative to the bank."""
        return f"{j}.{half}_proj.weight"

    def hub_shapes(self) -> list[tuple[str, str, tuple[int, int]]]:
        """(hub name, half, shape) of the bank's hub tensors, expert by expert (up then down): metadata only,
        so it holds for a sharded or meta bank."""
        hidden = self.up.shape[1]
        out = []
        for j, width in enumerate(self.widths):
            out += [
                (self.hub_name(j, "up"), "up", (width, hidden)),
                (self.hub_name(j, "down"), "down", (hidden, width)),
            ]
        return out

    def hub_pieces(self, half: str, rows: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """`rows` (the whole `up` or `down` [sum w_j, D], e.g. gathered from shards) as the hub's per-expert
        tensors of that half, by hub name: views, `down`'s transposed."""
        pieces = [
            (self.hub_name(j, half), rows[self.offsets[j] : self.offsets[j + 1]]) for j in range(len(self))
        ]
        return pieces if half == "up" else [(name, piece.T) for name, piece in pieces]

    def experts_in_rows(self, start: int, stop: int) -> list[tuple[int, slice]]:
        """The experts that own bank rows [start, stop), each with its rows as a slice of its own hub tensor's
        width (rows of `up_proj.weight`, columns of `down_proj.weight`): what a rank's shard reads from disk."""
        out = []
        for j in range(len(self)):
            low, high = max(start, self.offsets[j]), min(stop, self.offsets[j + 1])
            if low < high:
                out.append((j, slice(low - self.offsets[j], high - self.offsets[j])))
        return out

    def hub_views(self) -> dict[str, torch.Tensor]:
        """The hub's per-expert tensors as views of the bank, by hub name, expert by expert (up then down)."""
        out = {}
        for j in range(len(self)):
            out[self.hub_name(j, "up")], out[self.hub_name(j, "down")] = (
                self.up_weight(j),
                self.down_weight(j),
            )
        return out

    def allocate(self, dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Give the bank new, uninitialised `up` / `down` (e.g. in place of meta tensors) and return its
        `hub_views` of them, writable and detached, for a loader to `copy_` each expert into."""
        for name in ("up", "down"):
            old = self._parameters[name]
            self._parameters[name] = nn.Parameter(
                torch.empty(old.shape, dtype=dtype, device=device), requires_grad=old.requires_grad
            )
        self._views = None
        with torch.no_grad():
            return {name: view.detach() for name, view in self.hub_views().items()}

    @staticmethod
    def state_from_hub(up: list[torch.Tensor], down: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The bank tensors {"up", "down"} [sum w_j, D] of experts given in the hub layout: up[j] [w_j, D]
        (`up_proj.weight`), down[j] [D, w_j] (`down_proj.weight`); the inverse of `hub_views`."""
        return {"up": torch.cat(up), "down": torch.cat([d.T for d in down])}

    def register_observer(self, observer: ExpertObserver) -> RemovableHandle:
        """Call `observer(j, inputs, activation, output, weights)` for every expert j that receives tokens.

        inputs [c, D], activation relu(inputs @ up_j.T)^2 [c, w_j], output activation @ down_j.T [c, D]
        (before the routing weight), weights [c] fp32: the routing weights of those c (token, slot) pairs,
        which are in token order. While an observer is registered the bank runs the loop, whatever `path` says.
        Without autograd the tensors are views of the loop's working buffers: copy what outlives the call.
        """
        handle = RemovableHandle(self._observers)
        self._observers[handle.id] = observer
        return handle

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ExpertBank:
        self._views = None  # views of the old tensors would keep them alive
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_views": None}  # a copy makes its own views

    def _expert_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every expert's up_j.T [D, w_j] and down_j [w_j, D], views of the bank made once per bank tensors:
        the loops without autograd would otherwise pay a slice and a transpose per expert and call (a tenth
        of a decode step's routed time). Kept while the bank's tensors are the same memory."""
        key = (self.up.data_ptr(), self.down.data_ptr())
        if self._views is None or self._views[0] != key:
            with torch.no_grad():
                if len(set(self.widths)) == 1:
                    shape = (len(self), self.widths[0], self.up.shape[1])
                    up_t = list(self.up.view(shape).transpose(1, 2).unbind(0))
                    downs = list(self.down.view(shape).unbind(0))
                else:
                    up_t = [up.T for up in self.up.split(self.widths)]
                    downs = list(self.down.split(self.widths))
            self._views = (key, up_t, downs)
        return self._views[1], self._views[2]

    def grouped_runs(self, h: torch.Tensor) -> bool:
        """Whether the grouped matmuls can run on expert inputs h [n, D] (path "grouped" raises where not).

        Needs torch's grouped_mm, one width for all experts, row strides that are multiples of 16 bytes, h in
        the bank's dtype (fp32, bf16 or fp16) and no observer.
        """
        width, size = self.widths[0], self.up.shape[1]
        if _GROUPED_MM is None or self._observers or any(w != width for w in self.widths):
            return False
        item = self.up.element_size()
        if (width * item) % _GROUPED_ALIGNMENT_BYTES or (size * item) % _GROUPED_ALIGNMENT_BYTES:
            return False
        return h.dtype == self.up.dtype and h.dtype in (torch.float32, torch.bfloat16, torch.float16)

    def uses_grouped(self, h: torch.Tensor) -> bool:
        """Whether `path` "auto" runs the grouped matmuls on expert inputs h [n, D]: on a GPU in bf16 where they
        can run (other dtypes fall back, inside torch, to a loop that syncs the host). Never on the CPU, where
        torch's grouped_mm is a loop over the experts on sorted, gathered copies of all pairs, slower than
        `_loop` (benchmarks/bench_blocks.py).
        """
        return h.is_cuda and h.dtype == torch.bfloat16 and self.grouped_runs(h)

    def forward(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """sum_k weights[:, k] * expert_{indices[:, k]}(h): h [n, D], weights / indices [n, top_k] -> [n, D].

        The weighted outputs are summed in the weights' dtype (fp32), whatever path ran, then cast to h's dtype.
        """
        if self.path not in ("auto", "loop", "grouped"):
            raise ValueError(f"ExpertBank.path must be 'auto', 'loop' or 'grouped', found {self.path!r}")
        if self.activation_quant is not None:
            return self._loop(self.activation_quant(h), weights, indices, self.activation_quant)
        # Observers see each expert's batch: they need the loop, whatever the path.
        grouped = not self._observers and (
            self.path == "grouped" or (self.path == "auto" and self.uses_grouped(h))
        )
        if grouped:
            return self._grouped_forward(h, weights, indices)
        if self.path == "auto" and not self._observers and indices.numel() < len(self):
            return self._each_pair(h, weights, indices)
        return self._loop(h, weights, indices)

    def _loop(
        self,
        h: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        quantize: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The reference: each expert that received pairs runs on its tokens, and its weighted outputs are added
        into the result expert by expert (transformers' eager order of summation).

        One stable sort of the flattened (token, slot) pairs gives every expert its tokens, in token order.
        Without autograd the experts run in chunks of consecutive experts (`_chunked`): the same products in
        the same order, with the gather, activation, weighting and scatter done once per chunk.
        `quantize`: applied to each expert's activation before its down matmul (then the loop always runs).
        """
        n, top_k = indices.shape
        experts, order = torch.sort(indices.reshape(-1), stable=True)
        hit, counts = (t.tolist() for t in torch.unique_consecutive(experts, return_counts=True))
        tokens = order // top_k
        pair_weights = weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros(n, h.shape[1], dtype=weights.dtype, device=h.device)
        tracked = torch.is_grad_enabled() and (
            h.requires_grad or weights.requires_grad or self.up.requires_grad or self.down.requires_grad
        )
        if not hit:
            return out.to(h.dtype)
        if not tracked and quantize is None:
            self._chunked(h, hit, counts, tokens, pair_weights, out)
            return out.to(h.dtype)
        # Each expert's rows by one split of each bank, not a slice per expert: a slice's backward makes a
        # zero gradient of the whole bank and autograd sums them (E bank-sized allocations and E - 1 sums a
        # backward); split's backward is one cat.
        ups, downs = self.up.split(self.widths), self.down.split(self.widths)
        start = 0
        for j, count in zip(hit, counts):
            token, weight = tokens[start : start + count], pair_weights[start : start + count]
            x = h.index_select(0, token)
            a = relu2(torch.mm(x, ups[j].T))
            if quantize is not None:
                a = quantize(a)
            y = torch.mm(a, downs[j])
            for observer in self._observers.values():
                observer(j, x, a, y, weight[:, 0])
            out.index_add_(0, token, y.to(weight.dtype) * weight)
            start += count
        return out.to(h.dtype)

    def _chunked(
        self,
        h: torch.Tensor,
        hit: list[int],
        counts: list[int],
        tokens: torch.Tensor,
        pair_weights: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """`_loop` without autograd, adding into `out` [n, D]: whole experts are taken in order until a chunk
        holds `_CHUNK_ROWS` pairs; a chunk's inputs are gathered, activated, weighted and scattered in one op
        each (into buffers that stay in cache) and only the two matmuls run per expert.

        On the CPU each expert's `up` rows are summed before its first matmul: a sequential read brings them
        from memory at full bandwidth, which the matmul's own access pattern does not (measured: about a tenth
        of the routed time of a prefill whose experts do not fit in the cache).
        """
        size = h.shape[1]
        uniform = len(set(self.widths)) == 1
        up_t, downs = self._expert_views()
        observers = tuple(self._observers.values())
        prefetch = h.device.type == "cpu"
        rows = min(tokens.numel(), _CHUNK_ROWS + max(counts))
        inputs, outputs = h.new_empty(rows, size), h.new_empty(rows, size)
        activations = h.new_empty(rows * max(self.widths[j] for j in hit))
        first = start = 0  # the chunk's first expert (index into hit) and first pair
        while first < len(hit):
            last, end = first, start
            while last < len(hit) and end - start < _CHUNK_ROWS:
                end += counts[last]
                last += 1
            token, experts, sizes = tokens[start:end], hit[first:last], counts[first:last]
            x = torch.index_select(h, 0, token, out=inputs[: end - start]).split(sizes)
            elements = [count * self.widths[j] for j, count in zip(experts, sizes)]
            used = activations[: sum(elements)]
            if uniform:  # one split rather than a slice and a view per expert
                a = used.view(end - start, -1).split(sizes)
            else:
                a = [part.view(count, -1) for part, count in zip(used.split(elements), sizes)]
            for j, x_j, a_j in zip(experts, x, a):
                if prefetch and x_j.shape[0] >= _PREFETCH_ROWS:
                    up_t[j].sum()
                torch.mm(x_j, up_t[j], out=a_j)
            torch.relu_(used).square_()
            y, weight = outputs[: end - start], pair_weights[start:end]
            for j, x_j, a_j, y_j, w_j in zip(experts, x, a, y.split(sizes), weight[:, 0].split(sizes)):
                torch.mm(a_j, downs[j], out=y_j)
                for observer in observers:
                    observer(j, x_j, a_j, y_j, w_j)
            out.index_add_(
                0, token, y.mul_(weight) if y.dtype == weight.dtype else y.to(weight.dtype).mul_(weight)
            )
            first, start = last, end

    def _grouped_forward(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The (token, slot) pairs sorted by expert, both projections as grouped matmuls, the weighted outputs
        summed over the slots in pair order; no host sync."""
        n, top_k = indices.shape
        expert_of_pair, order = torch.sort(indices.reshape(-1), stable=True)
        inputs = h.index_select(0, order // top_k)
        weighted = self._grouped(inputs, expert_of_pair) * weights.reshape(-1)[order][:, None]
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(order.numel(), device=order.device)
        return weighted.index_select(0, unsort).view(n, top_k, -1).sum(1).to(h.dtype)

    def _each_pair(self, h: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """`forward` pair by pair in pair order, for a few pairs (a decode step): no sort, gather or scatter.

        Without autograd each weighted output is added into the result by the down matmul itself (`addmm_`).
        """
        n, top_k = indices.shape
        up, down, offsets = self.up, self.down, self.offsets
        tracked = torch.is_grad_enabled() and (
            h.requires_grad or weights.requires_grad or up.requires_grad or down.requires_grad
        )
        if not tracked and h.dtype == weights.dtype:
            out = torch.zeros(n, h.shape[1], dtype=weights.dtype, device=h.device)
            rows, out_rows = (h.split(1), out.split(1)) if n > 1 else ((h,), (out,))
            pairs = zip(indices.reshape(-1).tolist(), weights.reshape(-1).tolist())
            up_t, downs = self._expert_views()
            for pair, (j, weight) in enumerate(pairs):
                a = torch.relu_(torch.mm(rows[pair // top_k], up_t[j])).square_()
                out_rows[pair // top_k].addmm_(a, downs[j], alpha=weight)
            return out
        outputs = []
        for pair, j in enumerate(indices.reshape(-1).tolist()):
            token = pair // top_k
            a = _relu2_(h[token : token + 1] @ up[offsets[j] : offsets[j + 1]].T)
            outputs.append(a @ down[offsets[j] : offsets[j + 1]])
        if not outputs:
            return h.new_zeros(n, h.shape[1])
        weighted = torch.cat(outputs) * weights.reshape(-1, 1)
        return weighted.view(n, top_k, -1).sum(1).to(h.dtype)

    def _grouped(self, inputs: torch.Tensor, expert_of_pair: torch.Tensor) -> torch.Tensor:
        """Both projections as grouped matmuls over the sorted pairs, inputs [P, D] -> [P, D]; no host sync."""
        if _GROUPED_MM is None or any(w != self.widths[0] for w in self.widths):
            raise ValueError(
                "ExpertBank.path 'grouped' needs torch's grouped_mm and one width for all experts, found "
                f"grouped_mm {'present' if _GROUPED_MM else 'absent'} and widths {sorted(set(self.widths))}"
            )
        experts, width, size = len(self), self.widths[0], self.up.shape[1]
        bounds = torch.arange(1, experts + 1, device=expert_of_pair.device)
        ends = torch.searchsorted(expert_of_pair, bounds).to(torch.int32)  # pairs of experts < j+1
        up = self.up.view(experts, width, size).transpose(1, 2)  # [E, D, w]
        a = _relu2_(_GROUPED_MM(inputs, up, offs=ends))
        return _GROUPED_MM(a, self.down.view(experts, width, size), offs=ends)


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
        if not self.weight.is_meta:
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
            if spec.top_k == 1:
                # One expert's weight normalised by itself is 1: its true gradient is zero, and the computed
                # one is rounding error (~1e-7 against ~10 for the experts) that Adam would scale up into
                # full-size random steps of the router. Same values, no gradient.
                weights = weights.detach()
        return weights * spec.routed_scaling_factor, indices


class MoEMixer(nn.Module):
    """out = fc2(sum_k w_k * expert_k(fc1(x))) + shared(x); fc1/fc2 only when latent, shared only when width > 0.

    Parameters: gate.{weight, e_score_correction_bias}, experts.{up, down} (the `ExpertBank`; the hub's
    experts.{j}.{up_proj, down_proj}.weight through `module_hub_state`), fc1_latent_proj.weight [L, H],
    fc2_latent_proj.weight [H, L], shared_experts.{up_proj, down_proj}.weight.
    Stateless: `init_cache` returns None and `step` is `forward`. `norm_eps` is unused.
    """

    def __init__(self, spec: MoESpec, hidden_size: int, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.spec = spec
        self.gate = TopKRouter(spec, hidden_size)
        self.experts = ExpertBank(spec.expert_input_size(hidden_size), spec.widths)
        if spec.latent_size is not None:
            self.fc1_latent_proj = _Linear(hidden_size, spec.latent_size, bias=False)
            self.fc2_latent_proj = _Linear(spec.latent_size, hidden_size, bias=False)
        if spec.shared_width > 0:
            self.shared_experts = Expert(hidden_size, spec.shared_width)

    @staticmethod
    def hub_tensors(spec: MoESpec, hidden_size: int) -> list[TensorInfo]:
        """The tensors this mixer stores, NemotronH hub names relative to the mixer, routed experts marked:
        the routed experts one by one (`module_hub_state` of a built mixer has exactly these names and shapes)."""
        H, E = hidden_size, spec.num_experts
        expert_input = spec.expert_input_size(H)
        tensors = [
            TensorInfo("gate.weight", (E, H), "router"),
            TensorInfo("gate.e_score_correction_bias", (E,), "router_bias", is_parameter=False),
        ]
        for j, width in enumerate(spec.widths):
            up, down = (
                f"experts.{ExpertBank.hub_name(j, half).removesuffix('.weight')}" for half in ("up", "down")
            )
            tensors += linear_tensors(up, width, expert_input, "routed_expert", expert=j)
            tensors += linear_tensors(down, expert_input, width, "routed_expert", expert=j)
        if spec.latent_size is not None:
            tensors += linear_tensors("fc1_latent_proj", spec.latent_size, H, "latent_proj")
            tensors += linear_tensors("fc2_latent_proj", H, spec.latent_size, "latent_proj")
        if spec.shared_width > 0:
            tensors += linear_tensors("shared_experts.up_proj", spec.shared_width, H, "shared_expert")
            tensors += linear_tensors("shared_experts.down_proj", H, spec.shared_width, "shared_expert")
        return tensors

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
        routed = self.experts(routed, weights, indices)
        if self.spec.latent_size is not None:
            routed = self.fc2_latent_proj(routed)
        out = routed.view(x.shape)
        if self.spec.shared_width > 0:
            out = out + self.shared_experts(x)
        return out

    def step(self, x: torch.Tensor, cache: None = None) -> torch.Tensor:
        """x: [b, 1, H] -> [b, 1, H]."""
        return self.forward(x)


# ---------------------------------------------------------------------- a module's banks <-> hub tensors
# The per-bank layout is ExpertBank's (hub_name, hub_views, allocate, ...); these walk a module's banks. They
# live with the bank (not with the checkpoint reader) so that the quantizer's block view and the checkpoint
# code, which both need the hub layout, import it from below.


def expert_banks(module: nn.Module) -> dict[str, ExpertBank]:
    """Every ExpertBank in `module`, by its state-dict prefix ("" for `module` itself, else "name.")."""
    return {f"{name}." if name else "": m for name, m in module.named_modules() if isinstance(m, ExpertBank)}


def module_hub_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with each bank's `up` / `down` replaced, in place, by the hub's per-expert tensors.

    Keys `{prefix}{j}.up_proj.weight` [w_j, D] and `{prefix}{j}.down_proj.weight` [D, w_j] (expert by expert,
    up then down), detached views of the bank (the down views are transposed: `.contiguous()` to write them).
    Works on the meta device, for names and shapes.
    """
    banks = expert_banks(module)
    up_keys = {prefix + "up": bank for prefix, bank in banks.items()}
    down_keys = {prefix + "down" for prefix in banks}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in module.state_dict().items():
        if key in up_keys:
            prefix = key.removesuffix("up")
            with torch.no_grad():
                out.update({prefix + name: view.detach() for name, view in up_keys[key].hub_views().items()})
        elif key not in down_keys:
            out[key] = tensor
    return out


def allocate_banks(
    module: nn.Module, dtype: torch.dtype, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """`ExpertBank.allocate` for every bank of `module`: the hub's per-expert tensors by `module_hub_state`
    name, writable views into the new banks, for a loader to `copy_` into."""
    out: dict[str, torch.Tensor] = {}
    for prefix, bank in expert_banks(module).items():
        out.update({prefix + name: view for name, view in bank.allocate(dtype, device).items()})
    return out
