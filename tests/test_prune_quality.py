"""Importance-based child init beats random and first-k selection on a parent trained in the test.

A tiny HybridLM (Mamba, attention, latent MoE with a shared expert, MLP) learns an order-2 Markov
chain in 150 Adam steps (a few seconds on a CPU), so its activations carry structure. Then, for every pruning axis
at ~50% kept, the child built from the importance scores must reproduce the parent block's output on
held-out tokens better (normalised MSE, the BLD loss) than the children built from random scores
(mean over seeds) and from "keep the first k".
"""

from __future__ import annotations

import pytest
import torch

from puzzle.model import HybridLM
from puzzle.prune.importance import BlockImportance, collect_importance
from puzzle.prune.init import expert_widths_by_importance, init_child
from puzzle.spec import (
    AttentionSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
)

VOCAB, HIDDEN, SEQ = 32, 32, 64
MAMBA = MambaSpec(num_heads=16, head_dim=4, state_size=16, n_groups=2, chunk_size=16)
ATTENTION = AttentionSpec(num_heads=16, num_kv_heads=8, head_dim=4)
MOE = MoESpec(num_experts=8, top_k=2, expert_width=32, shared_width=32, latent_size=16)
MLP = MLPSpec(width=64)
PARENT = ModelSpec(vocab_size=VOCAB, hidden_size=HIDDEN, blocks=(MAMBA, ATTENTION, MOE, MLP))
RANDOM_SEEDS = 6
STEPS = 150


def markov_batches(generator: torch.Generator, table: torch.Tensor, batch: int) -> torch.Tensor:
    """Token ids [batch, SEQ] from the order-2 chain p(next | prev2, prev1) = table[prev2, prev1]."""
    ids = torch.empty(batch, SEQ, dtype=torch.long)
    ids[:, :2] = torch.randint(0, VOCAB, (batch, 2), generator=generator)
    for t in range(2, SEQ):
        probs = table[ids[:, t - 2], ids[:, t - 1]]
        ids[:, t] = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return ids


@pytest.fixture(scope="module")
def trained():
    """(parent model, importance, held-out block inputs {block: [b, t, H]}, final train loss)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    # Each (prev2, prev1) context has 3 likely successors: learnable, far from uniform.
    logits = torch.full((VOCAB, VOCAB, VOCAB), -4.0)
    successors = torch.randint(0, VOCAB, (VOCAB, VOCAB, 3), generator=generator)
    logits.scatter_(2, successors, torch.tensor([2.0, 1.0, 0.5]).expand(VOCAB, VOCAB, 3))
    table = logits.softmax(-1)

    model = HybridLM(PARENT)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(STEPS):
        ids = markov_batches(generator, table, 16)
        out = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

    calibration = [markov_batches(generator, table, 16) for _ in range(4)]
    importance = collect_importance(model, calibration)
    held_out = markov_batches(generator, table, 16)
    inputs: dict[int, torch.Tensor] = {}
    handles = [
        block.mixer.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0].detach()))
        for i, block in enumerate(model.layers)
    ]
    with torch.no_grad():
        model(held_out)
    for handle in handles:
        handle.remove()
    return model, importance, inputs, loss.item()


@torch.no_grad()
def nmse(model: HybridLM, index: int, child: torch.nn.Module, x: torch.Tensor) -> float:
    """MSE(child(x), parent(x)) / MSE(parent(x), 0) on the parent's held-out block input x."""
    reference = model.layers[index].mixer(x)
    return float((child(x) - reference).pow(2).mean() / reference.pow(2).mean())


def first_k_scores(scores: BlockImportance, keys: list[str]) -> BlockImportance:
    # Strictly decreasing along every row: top-k keeps the first k of each row.
    return scores.replace(
        {k: -torch.arange(scores[k].numel(), dtype=torch.float32).view_as(scores[k]) for k in keys}
    )


def random_scores(scores: BlockImportance, keys: list[str], seed: int) -> BlockImportance:
    generator = torch.Generator().manual_seed(seed)
    return scores.replace({k: torch.rand(scores[k].shape, generator=generator) for k in keys})


MOE_CHANNELS = [f"expert_channel.{j}" for j in range(MOE.num_experts)]
AXES = {
    "mamba.state_size": (0, MambaSpec(16, 4, 8, n_groups=2, chunk_size=16), ["state"]),
    "mamba.num_heads": (0, MambaSpec(8, 4, 16, n_groups=2, chunk_size=16), ["head"]),
    "mamba.head_dim": (0, MambaSpec(16, 2, 16, n_groups=2, chunk_size=16), ["channel"]),
    "attention.num_kv_heads": (1, AttentionSpec(8, 4, 4), ["kv_group", "q_head"]),
    "moe.num_experts": (2, MoESpec(4, 2, 32, shared_width=32, latent_size=16), ["expert"]),
    "moe.expert_width": (2, MoESpec(8, 2, 16, shared_width=32, latent_size=16), MOE_CHANNELS),
    "moe.shared_width": (2, MoESpec(8, 2, 32, shared_width=16, latent_size=16), ["shared_channel"]),
    "moe.latent_size": (2, MoESpec(8, 2, 32, shared_width=32, latent_size=8), ["latent"]),
    "mlp.width": (3, MLPSpec(32), ["channel"]),
}


def test_parent_learned_the_chain(trained):
    # Uniform is ln 32 = 3.47 nats; the chain's entropy is ~1.3: the parent must be well below uniform.
    assert trained[3] < 2.2


@pytest.mark.parametrize("axis", sorted(AXES))
def test_importance_beats_random_and_first_k(trained, axis):
    model, importance, inputs, _ = trained
    index, child_spec, keys = AXES[axis]
    parent_block, parent_spec, scores = model.layers[index].mixer, PARENT.blocks[index], importance[index]
    x = inputs[index]

    def child(block_scores: BlockImportance) -> torch.nn.Module:
        return init_child(parent_block, parent_spec, child_spec, block_scores)

    def error(block_scores: BlockImportance) -> float:
        return nmse(model, index, child(block_scores), x)

    ours = error(scores)
    by_score = None
    if axis == "moe.latent_size":  # the baselines select latent dims; ours rotates onto principal directions
        selection = {k: v for k, v in scores.scores.items() if not k.startswith("latent_") or k == "latent"}
        scores = BlockImportance(scores.kind, selection, scores.tokens)
        by_score = error(scores)
        print(f"latent selected by score: {by_score:.4f}")
        assert ours < by_score
    first_k = error(first_k_scores(scores, keys))
    same_as_first_k = all(
        torch.equal(a, b)
        for a, b in zip(child(scores).parameters(), child(first_k_scores(scores, keys)).parameters())
    )
    random = sum(error(random_scores(scores, keys, seed)) for seed in range(RANDOM_SEEDS)) / RANDOM_SEEDS
    print(f"{axis}: importance {ours:.4f}  first-k {first_k:.4f}  random {random:.4f}")
    assert ours < random, (axis, ours, random)
    if by_score is not None:  # the `latent` score itself also selects better than the baselines
        assert by_score < min(random, first_k), (axis, by_score, random, first_k)
    # Keeping the first k can coincide with the importance ranking (then the children are identical).
    assert ours < first_k or (same_as_first_k and ours == first_k), (axis, ours, first_k)


def test_heterogeneous_expert_widths_by_importance(trained):
    """Spreading the same channel budget by importance over experts is no worse than one width for all.

    (Better by 4-9% on 3 of 4 training seeds tried, 0.6% worse on the fourth: asserted within 5%.)
    """
    model, importance, inputs, _ = trained
    scores = importance[2]
    widths = expert_widths_by_importance(scores, range(8), total_width=8 * 16, min_width=4)
    assert sum(widths) == 8 * 16 and min(widths) >= 4 and len(set(widths)) > 1
    uniform = MoESpec(8, 2, 16, shared_width=32, latent_size=16)
    spread = MoESpec(8, 2, widths, shared_width=32, latent_size=16)
    errors = [
        nmse(model, 2, init_child(model.layers[2].mixer, MOE, spec, scores), inputs[2])
        for spec in (uniform, spread)
    ]
    print(f"expert widths {widths}: uniform {errors[0]:.4f}  by importance {errors[1]:.4f}")
    assert errors[1] < 1.05 * errors[0]


def test_top_k_changes_no_weight(trained):
    model, importance, inputs, _ = trained
    child = init_child(
        model.layers[2].mixer, MOE, MoESpec(8, 1, 32, shared_width=32, latent_size=16), importance[2]
    )
    parent_state = model.layers[2].mixer.state_dict()
    for name, tensor in child.state_dict().items():
        assert torch.equal(tensor, parent_state[name]), name
    assert 0.0 < nmse(model, 2, child, inputs[2]) < 1.0


@pytest.mark.parametrize("index", [1, 3])
def test_least_squares_linear_beats_structural_and_noop(trained, index):
    """The fitted linear replacement beats W_o W_v (attention) / W_down W_up (MLP) and removal, held out."""
    model, importance, inputs, _ = trained
    parent_block, parent_spec = model.layers[index].mixer, PARENT.blocks[index]
    fitted = init_child(parent_block, parent_spec, LinearSpec(bias=True), importance[index])
    no_fit = BlockImportance(importance[index].kind, {}, importance[index].tokens)
    structural = init_child(parent_block, parent_spec, LinearSpec(), no_fit)
    noop = init_child(parent_block, parent_spec, NoOpSpec(), importance[index])
    fit_error = nmse(model, index, fitted, inputs[index])
    print(
        f"block {index}: fitted {fit_error:.4f} structural {nmse(model, index, structural, inputs[index]):.4f}"
    )
    assert fit_error < nmse(model, index, structural, inputs[index])
    assert fit_error < nmse(model, index, noop, inputs[index]) == pytest.approx(1.0)


def _rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    ranks = torch.stack([a.flatten().argsort().argsort(), b.flatten().argsort().argsort()]).float()
    return float(torch.corrcoef(ranks)[0, 1])


@torch.no_grad()
def test_state_score_ranks_like_exact_ablation(trained):
    """Per group, the state-channel score orders channels like the error of removing each one alone."""
    model, importance, inputs, _ = trained
    mixer, x = model.layers[0].mixer, inputs[0]
    d, G, N = MAMBA.d_inner, MAMBA.n_groups, MAMBA.state_size
    reference = mixer(x)
    ablation = torch.zeros(G, N)
    state = {k: v.clone() for k, v in mixer.state_dict().items()}
    for g in range(G):
        for n in range(N):
            for conv_row in (d + g * N + n, d + G * N + g * N + n):  # B_n and C_n of group g
                mixer.in_proj.weight[d + conv_row] = 0
                mixer.conv1d.weight[conv_row] = 0
                mixer.conv1d.bias[conv_row] = 0
            ablation[g, n] = (mixer(x) - reference).pow(2).mean() / reference.pow(2).mean()
            mixer.load_state_dict(state)
    correlations = [_rank_correlation(importance[0]["state"][g], ablation[g]) for g in range(G)]
    print(f"state score vs ablation, Spearman per group: {correlations}")
    assert min(correlations) > 0.6
