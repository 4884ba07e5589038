"""Child-block weights from a parent block: slice the most important units on every axis the search varies.

`init_child(parent_block, parent_spec, child_spec, importance)` builds the child with
`puzzle.blocks.build_block` and fills it with slices of the parent's tensors, chosen by the scores of
`puzzle.prune.importance` (higher = keep). Kept units stay in their original order. Axes:

- Mamba: state size (the same channels n of B and C in every group, and their conv channels), heads
  (whole heads, the same number kept in every group), head_dim (each kept head keeps its own best
  channels). When a norm group loses channels its gated-RMSNorm weights are rescaled by
  sqrt(mean over kept channels of E[(v_c / rms(v))^2]) so the child's smaller RMS does not inflate the
  output (the parent's statistics `norm_q`).
- MoE: number of routed experts (router rows and correction bias sliced), per-expert width (each expert
  keeps its own best channels; a tuple `expert_width` refers to the child's experts, i.e. the kept parent
  experts in their original order), top-k (no weight change), shared-expert width, latent size (PCA
  projections of the latent input and of the block's routed output when the importance holds their
  second moments, else the best latent dims).
- Attention: fewer KV heads, either keeping the best groups with their best query heads (`kv_mode="keep"`)
  or mean-pooling K and V of consecutive groups merged into one (`kv_mode="mean"`, all their query heads
  stay available); `"auto"` keeps when the child's queries per group fit in one parent group, else merges.
  A sliding window (`window`) keeps every weight as it is: it only narrows what a query sees.
- Dense MLP: width.
- Linear replacement of any block: the least-squares fit of the mixer's output on its input over the
  calibration tokens (`lin_*` sums in the importance; ridge 1e-6 x mean diagonal), which is the best
  linear map in exactly the BLD loss. Without those sums, attention falls back to W_o @ W_v (value heads
  expanded to the query heads: attention that only sees the current token) and an MLP to W_down @ W_up
  (ignores the activation; poor for relu^2), as the reference code does; other kinds need the fit.
- No-op: no weights.

A child whose spec equals the parent's is a bit-identical copy. A child that cannot be derived (a
larger size on any axis, a change of a field that is not an axis, a kind change other than to linear or
no-op) raises `SpecError` naming the axis.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from puzzle.axes import pruning_axes, pruning_axis
from puzzle.blocks import build_block
from puzzle.prune.importance import BlockImportance
from puzzle.spec import (
    AttentionSpec,
    BlockSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    MoESpec,
    NoOpSpec,
    SpecError,
    kind_entry,
)

_RIDGE = 1e-6


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores along the last dim, in ascending index order (ties: lower index first).

    scores [..., n] -> int64 [..., k].
    """
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices
    return order[..., :k].sort(dim=-1).values


def _hidden_size(block: nn.Module, spec: BlockSpec) -> int:
    rules = child_init_rules(spec)
    if not rules.has_weights:
        raise SpecError(f"kind: a {spec.kind} block has nothing to derive a non-empty block from")
    try:
        return rules.hidden_size(block)
    except AttributeError as error:  # a module without the layer the kind's rule reads
        raise SpecError(f"cannot infer the hidden size of a {spec.kind} block; pass hidden_size=") from error


def _check_axes(parent: BlockSpec, child: BlockSpec) -> None:
    # The weight format is not a shape: a child in another format starts from the same weights (its
    # forward fake-quantizes them, `puzzle.blocks.formats`), so it may differ from the parent's freely.
    axes = [axis.name for axis in pruning_axes(parent)] + ["weight_format"]
    for f in dataclasses.fields(parent):
        if f.name not in axes and getattr(parent, f.name) != getattr(child, f.name):
            raise SpecError(
                f"{type(child).__name__}.{f.name}: {getattr(child, f.name)!r} differs from the parent's "
                f"{getattr(parent, f.name)!r} and is not a pruning axis (axes: {list(axes)})"
            )


def _not_larger(owner: str, axis: str, parent_value: int, child_value: int) -> None:
    if child_value > parent_value:
        raise SpecError(
            f"{owner}.{axis} = {child_value} exceeds the parent's {parent_value}: a child can only be "
            f"smaller on a pruning axis"
        )


def _need(importance: BlockImportance | None, key: str, axis: str, kind: str) -> torch.Tensor:
    if importance is None:
        raise ValueError(f"pruning {kind} axis {axis!r} needs importance scores ({key!r}); got none")
    if importance.kind != kind:
        raise ValueError(f"importance was measured on a {importance.kind} block, not a {kind} block")
    return importance[key]


def _load(child: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module:
    """Give `child` exactly these tensors (dtype and device included) and freeze nothing."""
    child.load_state_dict({name: tensor.detach().clone() for name, tensor in state.items()}, assign=True)
    return child


def init_child(
    parent_block: nn.Module,
    parent_spec: BlockSpec,
    child_spec: BlockSpec,
    importance: BlockImportance | None = None,
    *,
    hidden_size: int | None = None,
    norm_eps: float | None = None,
    kv_mode: str = "auto",
) -> nn.Module:
    """A child mixer for `child_spec` initialised from `parent_block` (whose spec is `parent_spec`).

    `importance`: the parent block's `BlockImportance`; needed whenever units are dropped by ranking.
    Returns a new module on the parent's device with the parent's dtypes; the parent is not modified.
    """
    own = getattr(parent_block, "spec", parent_spec)
    if own != parent_spec:
        raise SpecError(f"parent_block.spec {own} does not match parent_spec {parent_spec}")
    child_rules = child_init_rules(child_spec)
    child_init_rules(parent_spec)  # an unknown parent kind is an error before any work
    if hidden_size is not None:
        hidden = hidden_size
    elif not child_rules.has_weights:
        hidden = 0  # e.g. a no-op mixer: its hidden size is never used
    else:
        hidden = _hidden_size(parent_block, parent_spec)
    eps = norm_eps if norm_eps is not None else getattr(getattr(parent_block, "norm", None), "eps", 1e-5)
    device = next((p.device for p in parent_block.parameters()), torch.device("cpu"))

    with torch.device(device):
        child = build_block(child_spec, hidden, eps)
    if child_spec == parent_spec:
        return _load(child, parent_block.state_dict())
    if child_rules.from_any_kind is not None:
        return _load(
            child, child_rules.from_any_kind(parent_block, parent_spec, child_spec, importance, hidden)
        )
    if type(child_spec) is not type(parent_spec) or child_rules.shrink is None:
        raise SpecError(
            f"kind: cannot derive a {child_spec.kind} block from a {parent_spec.kind} block "
            f"(a block may only shrink, or become linear or no-op)"
        )
    _check_axes(parent_spec, child_spec)
    state = parent_block.state_dict()  # routed MoE experts as the bank: experts.{up, down} [sum w_j, D]
    return _load(child, child_rules.shrink(state, parent_spec, child_spec, importance, kv_mode))


# ----------------------------------------------------------------------------------------------------------
# Per-kind surgery: each returns the child's state dict (slices of the parent's tensors).


def _mamba_state(
    state: dict[str, torch.Tensor], parent: MambaSpec, child: MambaSpec, importance: BlockImportance | None
) -> dict[str, torch.Tensor]:
    owner = "MambaSpec"
    _not_larger(owner, "num_heads", parent.num_heads, child.num_heads)
    _not_larger(owner, "head_dim", parent.head_dim, child.head_dim)
    _not_larger(owner, "state_size", parent.state_size, child.state_size)
    nh, P, G, N = parent.num_heads, parent.head_dim, parent.n_groups, parent.state_size
    per_group = nh // G
    d = parent.d_inner
    device = state["in_proj.weight"].device

    # Heads: the best child.num_heads / G of each group.
    if child.num_heads < nh:
        head_score = _need(importance, "head", "num_heads", "mamba").view(G, per_group)
        local = top_indices(head_score, child.num_heads // G)  # [G, kept per group]
        heads = (local + torch.arange(G)[:, None] * per_group).reshape(-1)
    else:
        heads = torch.arange(nh)
    # head_dim: each kept head its own best channels.
    if child.head_dim < P:
        channel_score = _need(importance, "channel", "head_dim", "mamba")[heads]
        within = top_indices(channel_score, child.head_dim)  # [kept heads, child P]
    else:
        within = torch.arange(P).expand(len(heads), P)
    channels = (heads[:, None] * P + within).reshape(-1)  # into d
    # State: per group, the best channels n, the same for B and C.
    if child.state_size < N:
        states = top_indices(_need(importance, "state", "state_size", "mamba"), child.state_size)
    else:
        states = torch.arange(N).expand(G, N)
    bc = (states + torch.arange(G)[:, None] * N).reshape(-1)  # into G*N

    channels, heads, bc = channels.to(device), heads.to(device), bc.to(device)
    rows = parent.in_proj_sections()  # z | x | B | C | dt; the conv's channels are rows x..C
    kept = {"z": channels, "x": channels, "B": bc, "C": bc, "dt": heads}
    proj_rows = torch.cat([rows[name].start + index for name, index in kept.items()])
    conv_rows = torch.cat([rows[name].start - rows["x"].start + kept[name] for name in ("x", "B", "C")])
    new = {
        "in_proj.weight": state["in_proj.weight"][proj_rows],
        "conv1d.weight": state["conv1d.weight"][conv_rows],
        "dt_bias": state["dt_bias"][heads],
        "A_log": state["A_log"][heads],
        "D": state["D"][heads],
        "norm.weight": state["norm.weight"][channels],
        "out_proj.weight": state["out_proj.weight"][:, channels],
    }
    for name, rows in (("in_proj.bias", proj_rows), ("conv1d.bias", conv_rows)):
        if name in state:
            new[name] = state[name][rows]
    if "out_proj.bias" in state:
        new["out_proj.bias"] = state["out_proj.bias"]
    if len(channels) < d and importance is not None and "norm_q" in importance:
        new["norm.weight"] = new["norm.weight"] * _norm_rescale(importance["norm_q"], channels, G, d).to(
            new["norm.weight"]
        )
    return new


def _norm_rescale(norm_q: torch.Tensor, channels: torch.Tensor, groups: int, d: int) -> torch.Tensor:
    """Per kept channel: sqrt(mean over the kept channels of its group of E[(v_c / rms_parent)^2]).

    That is E[rms_child^2 / rms_parent^2] of the group, so w_c * v_c / rms_child * factor ~ the parent's
    w_c * v_c / rms_parent. Groups that keep every channel get exactly 1.
    """
    channels = channels.cpu()
    group_of = channels // (d // groups)
    q = norm_q.double()[channels]
    factor = torch.ones(len(channels), dtype=torch.float64)
    for g in range(groups):
        mask = group_of == g
        if int(mask.sum()) < d // groups:
            factor[mask] = q[mask].mean().clamp(min=1e-12).sqrt()
    return factor


def _attention_state(
    state: dict[str, torch.Tensor],
    parent: AttentionSpec,
    child: AttentionSpec,
    importance: BlockImportance | None,
    kv_mode: str,
) -> dict[str, torch.Tensor]:
    owner = "AttentionSpec"
    _not_larger(owner, "num_kv_heads", parent.num_kv_heads, child.num_kv_heads)
    _not_larger(owner, "num_heads", parent.num_heads, child.num_heads)
    # A window changes which keys a query sees, not the weights: the parent's carry over unchanged.
    if pruning_axis(parent, "window").above(child.window, parent.window):
        raise SpecError(
            f"{owner}.window = {child.window} exceeds the parent's {parent.window} (None: full attention): "
            "a child can only attend to fewer tokens"
        )
    if kv_mode not in ("auto", "keep", "mean"):
        raise ValueError(f"kv_mode must be 'auto', 'keep' or 'mean', found {kv_mode!r}")
    hd, nkv = parent.head_dim, parent.num_kv_heads
    r_parent = parent.num_heads // nkv
    r_child = child.num_heads // child.num_kv_heads
    mode = kv_mode if kv_mode != "auto" else ("keep" if r_child <= r_parent else "mean")
    q_score = importance["q_head"] if importance is not None and "q_head" in importance else None

    if mode == "keep":
        if r_child > r_parent:
            raise SpecError(
                f"{owner}.num_heads: {r_child} query heads per KV head exceed the parent's {r_parent}; "
                f"keeping whole groups cannot provide them (use kv_mode='mean')"
            )
        if child.num_kv_heads < nkv:
            groups = top_indices(
                _need(importance, "kv_group", "num_kv_heads", "attention"), child.num_kv_heads
            )
        else:
            groups = torch.arange(nkv)
        merged = groups[:, None]  # [child kv, 1 parent group each]
    else:
        if nkv % child.num_kv_heads:
            raise SpecError(
                f"{owner}.num_kv_heads: {child.num_kv_heads} does not divide the parent's {nkv}; "
                f"mean-pooling merges equal numbers of consecutive groups"
            )
        m = nkv // child.num_kv_heads
        merged = torch.arange(nkv).view(child.num_kv_heads, m)
    # Query heads available to each child group: those of its parent groups, in order.
    candidates = (merged[:, :, None] * r_parent + torch.arange(r_parent)).reshape(len(merged), -1)
    if r_child < candidates.shape[1]:
        if q_score is None:
            _need(importance, "q_head", "num_heads", "attention")
        pick = top_indices(q_score[candidates], r_child)
        q_heads = torch.gather(candidates, 1, pick).reshape(-1)
    else:
        q_heads = candidates.reshape(-1)

    def rows(heads: torch.Tensor) -> torch.Tensor:
        return (heads[:, None] * hd + torch.arange(hd)).reshape(-1)

    q_rows = rows(q_heads)

    def pool(tensor: torch.Tensor) -> torch.Tensor:
        # [nkv * hd, ...] -> [child kv * hd, ...], the mean over each child group's parent groups.
        grouped = tensor.view(nkv, hd, *tensor.shape[1:])[merged.reshape(-1)]
        grouped = grouped.view(merged.shape[0], merged.shape[1], hd, *tensor.shape[1:])
        return grouped.float().mean(1).to(tensor.dtype).reshape(-1, *tensor.shape[1:])

    device = state["q_proj.weight"].device
    q_rows = q_rows.to(device)
    new = {
        "q_proj.weight": state["q_proj.weight"][q_rows],
        "o_proj.weight": state["o_proj.weight"][:, q_rows],
    }
    if merged.shape[1] == 1:  # plain slicing keeps the parent's values bit for bit
        kv_rows = rows(merged.reshape(-1)).to(device)
        for name in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"):
            if name in state:
                new[name] = state[name][kv_rows]
    else:
        for name in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"):
            if name in state:
                new[name] = pool(state[name])
    if "q_proj.bias" in state:
        new["q_proj.bias"] = state["q_proj.bias"][q_rows]
    if "o_proj.bias" in state:
        new["o_proj.bias"] = state["o_proj.bias"]
    return new


def _moe_state(
    state: dict[str, torch.Tensor], parent: MoESpec, child: MoESpec, importance: BlockImportance | None
) -> dict[str, torch.Tensor]:
    owner = "MoESpec"
    _not_larger(owner, "num_experts", parent.num_experts, child.num_experts)
    _not_larger(owner, "shared_width", parent.shared_width, child.shared_width)
    if (parent.latent_size is None) != (child.latent_size is None):
        raise SpecError(
            f"{owner}.latent_size: {child.latent_size!r} vs the parent's {parent.latent_size!r}; "
            f"a latent projection can be narrowed but not added or removed"
        )
    if parent.latent_size is not None:
        _not_larger(owner, "latent_size", parent.latent_size, child.latent_size)
    if child.num_experts < parent.num_experts and parent.n_group > 1:
        raise SpecError(
            f"{owner}.num_experts: removing experts from a group-limited router (n_group={parent.n_group}) "
            f"is not supported"
        )
    if child.num_experts < parent.num_experts:
        experts = top_indices(_need(importance, "expert", "num_experts", "moe"), child.num_experts)
    else:
        experts = torch.arange(parent.num_experts)
    # Latent: PCA projections when the second moments are there, else the best latent dims.
    project_in = project_out = None  # [L', L] maps parent latent -> child latent
    lift_out = None  # [H, L'] the child's fc2
    pruning_latent = parent.latent_size is not None and child.latent_size < parent.latent_size
    if (
        pruning_latent
        and importance is not None
        and "latent_in_cov" in importance
        and "latent_out_cov" in importance
    ):
        project_in, project_out, lift_out = _latent_pca(state, importance, child.latent_size)
    elif pruning_latent:
        latent = top_indices(_need(importance, "latent", "latent_size", "moe"), child.latent_size)
        # fp64, like the PCA projections: `_mm` then keeps the weight's dtype and device.
        project_in = project_out = torch.eye(parent.latent_size, dtype=torch.float64)[latent]
        lift_out = None

    device = state["gate.weight"].device
    new = {
        "gate.weight": state["gate.weight"][experts.to(device)],
        "gate.e_score_correction_bias": state["gate.e_score_correction_bias"][experts.to(device)],
    }
    # The bank: rows offsets[j]:offsets[j + 1] of `up` and of `down` are expert j's channels (ExpertBank).
    bank_up, bank_down = state["experts.up"], state["experts.down"]
    offsets = list(itertools.accumulate(parent.widths, initial=0))
    ups, downs = [], []
    for i, j in enumerate(experts.tolist()):
        width, parent_width = child.widths[i], parent.widths[j]
        if width > parent_width:
            raise SpecError(
                f"{owner}.expert_width[{i}] = {width} exceeds the width {parent_width} of parent expert {j} "
                f"(child expert {i} is parent expert {j})"
            )
        up, down = bank_up[offsets[j] : offsets[j + 1]], bank_down[offsets[j] : offsets[j + 1]]  # [w_j, D]
        if width < parent_width:
            keep = top_indices(_need(importance, f"expert_channel.{j}", "expert_width", "moe"), width).to(
                device
            )
            up, down = up[keep], down[keep]
        if project_in is not None:
            up, down = _mm(up, project_in.T), _mm(down, project_out.T)
        ups.append(up)
        downs.append(down)
    new["experts.up"], new["experts.down"] = torch.cat(ups), torch.cat(downs)
    if parent.latent_size is not None:
        fc1, fc2 = state["fc1_latent_proj.weight"], state["fc2_latent_proj.weight"]
        if project_in is not None:
            fc1 = _mm(project_in, fc1)
            fc2 = _mm(fc2, project_out.T) if lift_out is None else lift_out.to(fc2)
        new["fc1_latent_proj.weight"], new["fc2_latent_proj.weight"] = fc1, fc2
    if child.shared_width > 0:
        up, down = state["shared_experts.up_proj.weight"], state["shared_experts.down_proj.weight"]
        if child.shared_width < parent.shared_width:
            keep = top_indices(
                _need(importance, "shared_channel", "shared_width", "moe"), child.shared_width
            ).to(device)
            up, down = up[keep], down[:, keep]
        new["shared_experts.up_proj.weight"], new["shared_experts.down_proj.weight"] = up, down
    return new


def expert_widths_by_importance(
    importance: BlockImportance, experts: Sequence[int], total_width: int, min_width: int = 1
) -> tuple[int, ...]:
    """Heterogeneous widths for the kept `experts` (parent indices, in child order) summing to `total_width`.

    Every expert first gets its `min_width` best channels; the rest of the budget goes to the channels
    with the highest `expert_channel.{j}` scores over all kept experts. Those scores are comparable across
    experts (each is a channel's mean contribution per token of the block, routing weight included), so
    a rarely used expert shrinks more than a busy one. Use the result as `MoESpec.expert_width`.
    """
    channel = [importance[f"expert_channel.{j}"] for j in experts]
    widths = [len(c) for c in channel]
    if not sum(min(min_width, w) for w in widths) <= total_width <= sum(widths):
        raise SpecError(
            f"MoESpec.expert_width: a total of {total_width} channels cannot be spread over experts of "
            f"widths {widths} with at least {min_width} each"
        )
    floor = [min(min_width, w) for w in widths]
    rest = []  # (score, expert position) of every channel beyond each expert's floor
    for i, scores in enumerate(channel):
        ranked = torch.sort(scores.float(), descending=True, stable=True).values
        rest += [(float(v), i) for v in ranked[floor[i] :]]
    rest.sort(key=lambda item: -item[0])
    for _, i in rest[: total_width - sum(floor)]:
        floor[i] += 1
    return tuple(floor)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp64, in the dtype and on the device of whichever operand is a weight of the block."""
    like = a if a.dtype != torch.float64 else b
    return (a.double().to(like.device) @ b.double().to(like.device)).to(like.dtype)


def _top_eigenvectors(matrix: torch.Tensor, k: int) -> torch.Tensor:
    """The k leading eigenvectors of a symmetric PSD matrix [n, n], as rows [k, n] (fp64)."""
    values, vectors = torch.linalg.eigh(matrix.double())
    return vectors[:, values.argsort(descending=True)[:k]].T.contiguous()


def _latent_pca(
    state: dict[str, torch.Tensor], importance: BlockImportance, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projections for a narrower latent space: (U_in [L', L], P_out [L', L], child fc2 [H, L']).

    Input side: the experts read h = fc1 x; keep the top principal directions of h (U_in = leading
    eigenvectors of E[h h^T]), so the child's fc1 is U_in fc1 and each up_proj is up U_in^T. Output side:
    the block writes fc2 r (r the routed sum in the latent space); its best rank-L' approximation is
    V V^T fc2 r with V the leading eigenvectors of fc2 E[r r^T] fc2^T, so the child's fc2 is V and each
    down_proj becomes (V^T fc2) down.
    """
    u_in = _top_eigenvectors(importance["latent_in_cov"], size)
    fc2 = state["fc2_latent_proj.weight"].double().cpu()
    v = _top_eigenvectors(fc2 @ importance["latent_out_cov"].double() @ fc2.T, size).T  # [H, L']
    return u_in, v.T @ fc2, v


def _mlp_state(
    state: dict[str, torch.Tensor], parent: MLPSpec, child: MLPSpec, importance: BlockImportance | None
) -> dict[str, torch.Tensor]:
    _not_larger("MLPSpec", "width", parent.width, child.width)
    keep = top_indices(_need(importance, "channel", "width", "mlp"), child.width)
    keep = keep.to(state["up_proj.weight"].device)
    new = {
        "up_proj.weight": state["up_proj.weight"][keep],
        "down_proj.weight": state["down_proj.weight"][:, keep],
    }
    if "up_proj.bias" in state:
        new["up_proj.bias"] = state["up_proj.bias"][keep]
    if "down_proj.bias" in state:
        new["down_proj.bias"] = state["down_proj.bias"]
    return new


def linear_fit(importance: BlockImportance, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Least-squares W [H_out, H_in] (and b [H_out]) minimising sum_t ||W x_t + b - y_t||^2 over calibration tokens.

    Solved from the streamed sums in fp64 with a ridge of 1e-6 x the mean diagonal of X^T X (keeps a
    rank-deficient calibration set solvable without visibly biasing a well-conditioned one).
    """
    xtx, xty = importance["lin_xtx"].double(), importance["lin_xty"].double()
    if bias:
        n = float(importance["lin_count"])
        xsum, ysum = importance["lin_xsum"].double(), importance["lin_ysum"].double()
        # Augment x with a constant 1: [[X^T X, X^T 1], [1^T X, n]] [W^T; b^T] = [X^T Y; 1^T Y].
        xtx = torch.cat(
            [
                torch.cat([xtx, xsum[:, None]], 1),
                torch.cat([xsum, torch.tensor([n], dtype=xsum.dtype)])[None],
            ],
            0,
        )
        xty = torch.cat([xty, ysum[None]], 0)
    ridge = _RIDGE * xtx.diagonal().mean().clamp(min=1e-30)
    solution = torch.linalg.solve(xtx + ridge * torch.eye(xtx.shape[0], dtype=xtx.dtype), xty)
    if bias:
        return solution[:-1].T.contiguous(), solution[-1].contiguous()
    return solution.T.contiguous(), None


def _linear_state(
    parent_block: nn.Module,
    parent_spec: BlockSpec,
    child_spec: LinearSpec,
    importance: BlockImportance | None,
    hidden: int,
) -> dict[str, torch.Tensor]:
    reference = next(iter(parent_block.parameters()), None)
    dtype = reference.dtype if reference is not None else torch.float32
    device = reference.device if reference is not None else torch.device("cpu")
    parent_rules = child_init_rules(parent_spec)
    if not parent_rules.has_weights:
        raise SpecError(f"kind: a {parent_spec.kind} block has nothing to derive a linear block from")
    bias = None
    if importance is not None and importance.has_linear_fit:
        weight, bias = linear_fit(importance, child_spec.bias)
    elif parent_rules.linear_without_fit is not None:
        weight, bias = parent_rules.linear_without_fit(parent_block, parent_spec)
    else:
        raise ValueError(
            f"a linear replacement of a {parent_spec.kind} block needs the least-squares sums "
            f"(collect importance with linear_fit=True)"
        )
    if child_spec.bias and bias is None:
        bias = torch.zeros(hidden, dtype=torch.float64)
    new = {"linear.weight": weight.to(device=device, dtype=dtype)}
    if child_spec.bias:
        new["linear.bias"] = bias.to(device=device, dtype=dtype)
    return new


# Structural linear maps of a block without the least-squares sums: (W [H, H], b [H] or None), fp64.


def _linear_as_linear(block: nn.Module, spec: LinearSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = block.linear.bias
    return block.linear.weight.detach().double(), bias.detach().double() if bias is not None else None


def _attention_as_linear(block: nn.Module, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    # W_o @ W_v with the value heads expanded to the query heads: attention that only sees the current token.
    r = spec.num_heads // spec.num_kv_heads
    v = block.v_proj.weight.detach().double().view(spec.num_kv_heads, spec.head_dim, -1)
    v = v.repeat_interleave(r, dim=0).reshape(spec.num_heads * spec.head_dim, -1)
    return block.o_proj.weight.detach().double() @ v, None


def _mlp_as_linear(block: nn.Module, spec: MLPSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    # W_down @ W_up: ignores the activation (poor for relu^2), as the reference code does.
    return block.down_proj.weight.detach().double() @ block.up_proj.weight.detach().double(), None


# ----------------------------------------------------------------------------------------------------------
# The registry: how children of each block kind are initialised, keyed by spec type.

# (parent state, parent spec, child spec, importance, kv_mode) -> the child's state dict
Shrink = Callable[
    [dict[str, torch.Tensor], BlockSpec, BlockSpec, BlockImportance | None, str], dict[str, torch.Tensor]
]
# (parent block, parent spec, child spec, importance, hidden size) -> the child's state dict
FromAnyKind = Callable[
    [nn.Module, BlockSpec, BlockSpec, BlockImportance | None, int], dict[str, torch.Tensor]
]


@dataclass(frozen=True)
class ChildInit:
    """How `init_child` treats one block kind, as a child and as a parent.

    The spec fields a child of the same kind may change (every other field must equal the parent's)
    are the kind's `puzzle.axes.PRUNING_AXES`. `shrink`: the surgery for a smaller child of the same
    kind; `from_any_kind`: builds a child of this kind from a parent of any kind (a linear fit, a
    no-op), replacing `shrink`;
    `has_weights`: False for a kind with nothing to derive from; `hidden_size`: reads H off a parent
    block of this kind; `linear_without_fit`: a structural linear map of a parent of this kind for
    when the least-squares sums are missing (None: the fit is needed).
    """

    shrink: Shrink | None = None
    from_any_kind: FromAnyKind | None = None
    has_weights: bool = True
    hidden_size: Callable[[nn.Module], int] | None = None
    linear_without_fit: Callable[[nn.Module, BlockSpec], tuple[torch.Tensor, torch.Tensor | None]] | None = (
        None
    )


CHILD_INITS: dict[type, ChildInit] = {
    MambaSpec: ChildInit(
        shrink=lambda state, parent, child, importance, kv_mode: _mamba_state(
            state, parent, child, importance
        ),
        hidden_size=lambda block: block.out_proj.weight.shape[0],
    ),
    AttentionSpec: ChildInit(
        shrink=_attention_state,
        hidden_size=lambda block: block.o_proj.weight.shape[0],
        linear_without_fit=_attention_as_linear,
    ),
    MoESpec: ChildInit(
        shrink=lambda state, parent, child, importance, kv_mode: _moe_state(state, parent, child, importance),
        hidden_size=lambda block: block.gate.weight.shape[1],
    ),
    MLPSpec: ChildInit(
        shrink=lambda state, parent, child, importance, kv_mode: _mlp_state(state, parent, child, importance),
        hidden_size=lambda block: block.down_proj.weight.shape[0],
        linear_without_fit=_mlp_as_linear,
    ),
    LinearSpec: ChildInit(
        from_any_kind=_linear_state,
        hidden_size=lambda block: block.linear.weight.shape[0],
        linear_without_fit=_linear_as_linear,
    ),
    NoOpSpec: ChildInit(
        from_any_kind=lambda parent_block, parent_spec, child_spec, importance, hidden: {},
        has_weights=False,
    ),
}


def child_init_rules(spec: BlockSpec) -> ChildInit:
    """The `ChildInit` entry of `spec`'s kind; SpecError for a type without one in CHILD_INITS."""
    return kind_entry(CHILD_INITS, spec, "kind: no child initialisation for block spec type")
