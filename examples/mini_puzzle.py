"""Mini Puzzle: every stage of the method, end to end, on a tiny NemotronH parent, on a CPU in seconds.

Demonstrates that the pieces fit: a transformers NemotronH parent (Mamba, MoE, attention, MLP blocks)
read with `puzzle.load`; brief training on a synthetic language so that activations mean something;
importance (`puzzle.prune.importance_for`); a few variants per block initialised from the parent
(`init_child`); replace-one-block KL scores (`puzzle.score`); costs from `puzzle.cost` through `deployment_problem`; the MIP under
an active-parameter budget with one Mamba state size for all Mamba blocks; the child assembled,
measured, saved and reloaded.

Simplified: no BLD (every variant is used exactly as `init_child` makes it, untrained), no distillation
of the child, synthetic data, KL on a thousand tokens. The MIP minimises the sum of block KLs, a proxy
for the assembled child's KL, which is measured next to it.

    python examples/mini_puzzle.py [--steps 150] [--budget 0.7] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import NemotronHConfig, NemotronHForCausalLM
from transformers.utils import logging as hf_logging

import puzzle
from puzzle.cost.analytic import model_active_params, model_params
from puzzle.cost.limits import Relative
from puzzle.model import HybridLM
from puzzle.nemotron_h import transformers_incompatibilities
from puzzle.prune import importance_for, init_child
from puzzle.score import score_variants
from puzzle.search import search
from puzzle.search.budget import Budget, choices_to_spec, deployment_problem
from puzzle.spec import (
    AttentionSpec,
    BlockSpec,
    LinearSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NoOpSpec,
    Variant,
)

hf_logging.set_verbosity_error()  # "falling back to the PyTorch implementation" is expected on CPU
hf_logging.disable_progress_bar()
VOCAB = 64


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: int = 150  # Adam steps on the parent
    batch_size: int = 16
    seq_len: int = 64
    calibration_batches: int = 4  # for importance
    eval_sequences: int = 16  # held-out sequences for every KL
    budget: float = 0.7  # the child's active parameters, as a fraction of the parent's
    seed: int = 0


def parent_config() -> NemotronHConfig:
    """Pattern `ME*ME-`: Mamba-2 (state 16), MoE (8 experts, top-2, shared expert), GQA attention, MLP."""
    kinds = ["linear_attention", "moe", "full_attention", "linear_attention", "moe", "mlp"]
    sizes = dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16)
    sizes |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=128)
    sizes |= dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    sizes |= dict(moe_shared_expert_intermediate_size=32)
    return NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, layers_block_type=kinds, eos_token_id=None, **sizes
    )


def sample_tokens(n: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """[n, seq_len] int64: each token has three likely successors (p = 0.75, 0.2, 0.05) set by the previous
    token and the one before it (mod 4), from a table fixed by seed 1234. The best loss is 0.68 nats/token
    (after the first two tokens); ignoring the token before last it is 2.0, so the parent must mix positions.
    """
    table = torch.randint(0, VOCAB, (VOCAB, 4, 3), generator=torch.Generator().manual_seed(1234))
    ids = torch.empty(n, seq_len, dtype=torch.long)
    ids[:, :2] = torch.randint(0, VOCAB, (n, 2), generator=generator)
    for t in range(2, seq_len):
        pick = torch.multinomial(torch.tensor([0.75, 0.2, 0.05]), n, replacement=True, generator=generator)
        ids[:, t] = table[ids[:, t - 1], ids[:, t - 2] % 4, pick]
    return ids


def train(model: HybridLM, settings: Settings, generator: torch.Generator) -> float:
    """A few Adam steps of next-token cross-entropy; returns the last loss (nats/token)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(settings.steps):
        ids = sample_tokens(settings.batch_size, settings.seq_len, generator)
        loss = F.cross_entropy(model(ids[:, :-1]).logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def kl_divergence(reference_logp: torch.Tensor, model: HybridLM, ids: torch.Tensor) -> float:
    """Mean over tokens of KL(parent || model) of the next-token distributions (nats); reference [b, t, V]."""
    logp = F.log_softmax(model(ids).logits.double(), dim=-1)
    return float((reference_logp.exp() * (reference_logp - logp)).sum(-1).mean())


@contextmanager
def run_directory(out_dir: str | Path | None):
    """(directory, how to name a path in it): `out_dir`, kept; else a temporary directory, deleted on exit."""
    if out_dir is not None:
        yield Path(out_dir), str
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp), lambda path: f"{path} (temporary: deleted at exit; --out DIR keeps it)"


def candidates(block: BlockSpec) -> list[BlockSpec]:
    """The parent's block first, then smaller variants of it."""
    new = dataclasses.replace
    if isinstance(block, MambaSpec):
        n = block.state_size
        return [block, new(block, state_size=n * 3 // 4), new(block, state_size=n // 2)]
    if isinstance(block, MoESpec):
        k, w = max(1, block.top_k // 2), block.expert_width // 2
        return [block, new(block, top_k=k), new(block, expert_width=w), new(block, top_k=k, expert_width=w)]
    if isinstance(block, AttentionSpec):
        return [block, new(block, num_kv_heads=block.num_kv_heads // 2), LinearSpec(), NoOpSpec()]
    if isinstance(block, MLPSpec):
        return [block, new(block, width=block.width // 2), new(block, width=block.width // 4), NoOpSpec()]
    return [block]


@dataclasses.dataclass
class Library:
    """Per block: candidate specs (the parent's first), their mixers from `init_child`, replace-one-block KLs."""

    variants: list[list[BlockSpec]]
    mixers: list[list[nn.Module]]
    scores: list[list[float]]

    def child(self, parent: HybridLM, choices) -> HybridLM:
        """The assembled child for `choices` (a variant index per block), sharing no tensor with anything."""
        spec = choices_to_spec(parent.spec, self.variants, choices)
        return assemble(parent, spec, [self.mixers[i][c] for i, c in enumerate(choices)])


def build_library(parent: HybridLM, importance, ids: torch.Tensor, out_dir: Path) -> Library:
    """Initialise every candidate from the parent (no training) and score it with only its block replaced
    (`puzzle.score.score_variants`: the parent's own candidate runs the parent's mixer and scores 0)."""
    library = Library([candidates(block) for block in parent.spec.blocks], [], [])
    mixers: dict[Variant, nn.Module | None] = {}
    for i, (block, options) in enumerate(zip(parent.layers, library.variants)):
        library.mixers.append([init_child(block.mixer, block.spec, spec, importance[i]) for spec in options])
        mixers |= {Variant(i, spec): mixer for spec, mixer in zip(options[1:], library.mixers[i][1:])}
        mixers[Variant(i, options[0])] = None
    scores = score_variants(parent, mixers, mixers, [ids], out_dir)
    library.scores = [
        [scores[Variant(i, spec)].kl for spec in options] for i, options in enumerate(library.variants)
    ]
    return library


def assemble(parent: HybridLM, spec: ModelSpec, mixers: list[nn.Module]) -> HybridLM:
    """A HybridLM for `spec`: the parent's embeddings, norms and lm_head, block i's mixer a copy of mixers[i]."""
    with torch.device("meta"):  # no random init: the mixers are given, every other tensor is assigned below
        child = HybridLM(spec, mixers=[copy.deepcopy(mixer) for mixer in mixers])
    state = {k: v for k, v in parent.state_dict().items() if not k.startswith("layers.")}
    for i, block in enumerate(child.layers):
        if block.norm is not None:  # a no-op block has none
            state[f"layers.{i}.norm.weight"] = parent.layers[i].norm.weight
    result = child.load_state_dict(
        {k: v.detach().clone() for k, v in state.items()}, strict=False, assign=True
    )
    assert not result.unexpected_keys and all(".mixer." in key for key in result.missing_keys), result
    child.source_config = parent.source_config  # token ids etc. that the spec does not hold, for saving
    return child.eval()


@torch.no_grad()
def reload(model: HybridLM, path: Path, ids: torch.Tensor) -> dict:
    """Save; reload with puzzle.load, and with transformers when it can represent the model; compare logits."""
    saved, logits = model.save_pretrained(path), model(ids).logits
    out = {"identical": torch.equal(puzzle.load(saved)(ids).logits, logits), "transformers_diff": None}
    out["transformers_reasons"] = transformers_incompatibilities(model.spec)
    if not out["transformers_reasons"]:
        theirs = NemotronHForCausalLM.from_pretrained(saved).eval()
        out["transformers_diff"] = (theirs(ids).logits - logits).abs().max().item()
    return out


def main(settings: Settings | None = None, out_dir: str | Path | None = None, verbose: bool = True) -> dict:
    """Run every stage and print the results; returns them (models, library, search problem) for tests."""
    settings = settings or Settings()
    say = print if verbose else (lambda *args: None)
    torch.manual_seed(settings.seed)
    data = torch.Generator().manual_seed(settings.seed + 1)
    with run_directory(out_dir) as (run, where):
        NemotronHForCausalLM(parent_config()).save_pretrained(run / "parent-init")
        parent = puzzle.load(run / "parent-init")
        loss = train(parent, settings, data)
        say(f"parent {parent.spec.pattern}: {model_params(parent.spec):,} params, loss {loss:.3f} nats/token")

        size = (settings.batch_size, settings.seq_len, data)
        batches = [sample_tokens(*size) for _ in range(settings.calibration_batches)]
        importance, reused = importance_for(parent, batches, run / "importance")
        say(f"importance {'reused from' if reused else 'measured into'} {where(run / 'importance')}")
        held_out = sample_tokens(settings.eval_sequences, settings.seq_len, data)
        with torch.no_grad():
            reference = F.log_softmax(parent(held_out).logits.double(), dim=-1)
        library = build_library(parent, importance, held_out, run / "scores")

        budget = Budget.of(active_params=Relative(settings.budget))  # one SSM state size: the default rule
        problem = deployment_problem(parent.spec, library.variants, library.scores, budget)
        solution = search(problem.table, problem.limits, problem.rules)
        child = library.child(parent, solution.choices)
        say("chosen architecture (block KL: the parent with only that block replaced):")
        for i, c in enumerate(solution.choices):
            before, after = library.variants[i][0].short_name(), library.variants[i][c].short_name()
            say(f"  block {i}: {before:<20} -> {after:<20} block KL {library.scores[i][c]:.2e}")
        r = {"parent": parent, "library": library, "problem": problem, "solution": solution, "child": child}
        r |= {"held_out": held_out, "reference": reference, "sum_block_kl": solution.objective}
        r["budget_active"] = settings.budget * model_active_params(parent.spec)
        r["child_kl"] = kl_divergence(reference, child, held_out)
        counted = sum(p.numel() for p in child.parameters())
        say(f"params: predicted {model_params(child.spec):,}, counted {counted:,}")
        say(f"active params: predicted {model_active_params(child.spec):,}, budget {r['budget_active']:,.0f}")
        say(f"KL to the parent: sum of block KLs {solution.objective:.4f}, the child's {r['child_kl']:.4f}")

        # The worst-KL architecture under the same budget (the MIP maximising) as a baseline.
        worst = deployment_problem(parent.spec, library.variants, library.scores, budget, maximize=True)
        r["worst"] = search(worst.table, worst.limits, worst.rules)
        r["worst_kl"] = kl_divergence(reference, library.child(parent, r["worst"].choices), held_out)
        say(f"worst-KL architecture under the same budget: KL {r['worst_kl']:.4f}")

        r["reload"] = reload(child, run / "child", held_out)
        say(
            f"saved to {where(run / 'child')}; puzzle.load gives identical logits: {r['reload']['identical']}"
        )
        if r["reload"]["transformers_reasons"]:
            say(f"transformers' NemotronH cannot load it: {', '.join(r['reload']['transformers_reasons'])}")
        else:
            say(f"transformers' NemotronH loads it: max |logits diff| {r['reload']['transformers_diff']:.2e}")
    return r


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--budget", type=float, default=Settings.budget, help="active params, x parent")
    parser.add_argument("--out", help="keep the run directory (parent, importance, child) here")
    args = parser.parse_args()
    main(Settings(steps=args.steps, budget=args.budget), args.out)
