"""FSDP2 units of mixed dtypes: a bf16 MoE block keeps its router in fp32, and FSDP2 wants one dtype over a
unit's trainable parameters; `puzzle.shard` makes such a submodule its own nested unit, so a trainable bf16
MoE (an assembled child, a GKD student) shards, and computes what the unsharded block computes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from gloo_helpers import gloo_rank, spawn_ranks

from puzzle import shard
from puzzle.blocks import build_block
from puzzle.spec import MoESpec

SPEC = MoESpec(num_experts=4, top_k=2, expert_width=8, shared_width=8, latent_size=8)


def _block() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_block(SPEC, 16).to(torch.bfloat16)  # the router stays fp32


def _grads(module: torch.nn.Module, x: torch.Tensor) -> dict[str, list[float]]:
    out = module(x)
    out.float().pow(2).sum().backward()
    grads = {n: shard.replicated(p.grad).float().sum().item() for n, p in module.named_parameters()}
    return {"out": out.float().sum().item(), **grads}


def _worker(rank: int, world: int, port: int, directory: str) -> None:
    with gloo_rank(rank, world, port):
        x = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        block = _block()
        assert {p.dtype for p in block.parameters()} == {torch.bfloat16, torch.float32}
        shard.shard_unit(block, "fsdp")
        Path(directory, f"rank{rank}.json").write_text(json.dumps(_grads(block, x)))


def test_a_trainable_bf16_moe_with_an_fp32_router_shards_and_equals_one_process(tmp_path):
    spawn_ranks(_worker, str(tmp_path))
    x = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    one = _grads(_block(), x)
    for rank in (0, 1):
        two = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert two.keys() == one.keys()
        for key, value in one.items():
            assert abs(two[key] - value) <= 1e-2 * max(1.0, abs(value)), (key, two[key], value)
