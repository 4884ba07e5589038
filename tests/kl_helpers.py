"""The whole-vocabulary KL oracle of the scoring, assembly and window tests: one full forward of each model."""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def naive_kl(parent: torch.nn.Module, model: torch.nn.Module, batches: Iterable[torch.Tensor]) -> float:
    """Mean KL(parent || model) over the positions with a next token, from whole-vocabulary fp64 softmaxes."""
    total, count = 0.0, 0
    for ids in batches:
        logp = torch.log_softmax(parent(ids).logits[:, :-1].double(), -1)
        logq = torch.log_softmax(model(ids).logits[:, :-1].double(), -1)
        total += float((logp.exp() * (logp - logq)).sum())
        count += logp.shape[0] * logp.shape[1]
    return total / count
