"""BLD training throughput against its ideal: one plain parent forward plus each variant's own forward and
backward on the same tokens.

Run: `PYTHONPATH=.:benchmarks python benchmarks/bench_bld.py [--hidden 256] [--variants 4 8]`. Writes
benchmarks/results/bench_bld.json and prints a markdown table. For V variants per block (every block of the
`bench_importance` parent, pattern `MEM*EM-E`), measured interleaved in one process on the same batch:

- bld: one `puzzle.bld` training step (parent pass block by block, every variant's forward + backward on
  the detached block input, gradient clipping and the AdamW step of every variant);
- ideal: the parent's `backbone` under no_grad, plus each variant's forward + backward on precomputed
  block inputs (nothing else);
- ideal+opt: ideal plus each variant's clipping and AdamW step (the optimiser work BLD cannot avoid).

Figures of merit: bld / ideal and bld / ideal+opt (target <= 1.3x), from medians and minima; tokens/s.
The CPU is shared with other jobs, so absolute times are noisy; ratios less so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_importance import parent_spec

from puzzle import bld
from puzzle.library import VariantResult
from puzzle.model import HybridLM
from puzzle.spec import AttentionSpec, BlockSpec, LinearSpec, MambaSpec, MLPSpec, MoESpec, Variant

RESULTS = Path(__file__).parent / "results" / "bench_bld.json"


def candidates(spec: BlockSpec) -> list[BlockSpec]:
    """Eight smaller variants of a block of `parent_spec` (the first V are used)."""
    if isinstance(spec, MambaSpec):
        nh, p, n = spec.num_heads, spec.head_dim, spec.state_size
        shapes = [(nh, 3 * p // 4, n), (nh // 2, p, n), (nh, p, n // 2), (nh, p // 2, n)]
        shapes += [(nh - spec.n_groups, p, n), (nh, p, n // 4), (nh // 2, p // 2, n // 2)]
        specs = [MambaSpec(h, d, s, spec.n_groups, spec.conv_kernel, spec.chunk_size) for h, d, s in shapes]
    elif isinstance(spec, MoESpec):
        e, k, w, s = spec.num_experts, spec.top_k, spec.expert_width, spec.shared_width
        shapes = [(e, k // 2, w, s), (3 * e // 4, k, w, s), (e, k, w // 2, s), (e // 2, k, w, s)]
        shapes += [(e, k, 3 * w // 4, s), (e // 2, k // 2, w, s), (e, k, w, s // 2)]
        specs = [
            MoESpec(num_experts=a, top_k=b, expert_width=c, shared_width=d, latent_size=spec.latent_size)
            for a, b, c, d in shapes
        ]
    elif isinstance(spec, AttentionSpec):
        q, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        shapes = [(q, 1, d), (q // 2, kv, d), (q // 2, 1, d), (q, kv, 3 * d // 4), (q, kv, d // 2)]
        shapes += [(q, 1, d // 2), (q // 2, 1, d // 2)]
        specs = [AttentionSpec(num_heads=a, num_kv_heads=b, head_dim=c) for a, b, c in shapes]
    elif isinstance(spec, MLPSpec):
        specs = [MLPSpec(width=spec.width * f // 8) for f in (6, 4, 3, 2, 5, 1, 7)]
    else:
        raise TypeError(f"no candidates for {spec.kind}")
    return [*specs[:3], LinearSpec(), *specs[3:]]


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(parent: HybridLM, per_block: int, batch: torch.Tensor, repeats: int) -> dict:
    settings = bld.BLDSettings(lr=1e-5, token_budget=10**12, checkpoint_every=0)
    variants = [
        Variant(i, s) for i, block in enumerate(parent.spec.blocks) for s in candidates(block)[:per_block]
    ]
    init = bld.default_init(parent, None)
    torch.manual_seed(0)
    mixers = {}
    for variant in variants:
        try:
            mixers[variant] = init(variant)
        except (ValueError, KeyError):  # no importance here: fresh weights, same shapes and cost
            mixers[variant] = bld.build_block(variant.spec, parent.spec.hidden_size)
    optimizers = {v: torch.optim.AdamW(bld._param_groups(m, settings), lr=1e-5) for v, m in mixers.items()}
    wave = bld._Wave(0, mixers, optimizers, {v: VariantResult(v, "trained") for v in variants})
    last = len(parent.layers) - 1
    inputs = [(i, h, p) for i, h, p in bld._parent_blocks(parent, batch, last)]

    def bld_step() -> None:
        bld._train_step(parent, wave, batch, settings)

    def parent_forward() -> None:
        with torch.no_grad():
            parent.backbone(batch)

    def variants_fwd_bwd() -> None:
        for index, h, p in inputs:
            target = p.float()
            scale = target.pow(2).sum()
            for variant in variants:
                if variant.block_index == index:
                    loss = (mixers[variant](h).float() - target).pow(2).sum() / scale
                    loss.backward()

    def optimiser() -> None:
        for variant, mixer in mixers.items():
            torch.nn.utils.clip_grad_norm_(list(mixer.parameters()), 1.0)
            optimizers[variant].step()
            optimizers[variant].zero_grad(set_to_none=True)

    bld_step()  # warm-up: allocator, optimiser states
    times: dict[str, list[float]] = {"bld": [], "parent": [], "fwd_bwd": [], "opt": []}
    for _ in range(repeats):
        times["bld"].append(_time(bld_step))
        times["parent"].append(_time(parent_forward))
        times["fwd_bwd"].append(_time(variants_fwd_bwd))
        times["opt"].append(_time(optimiser))
    assert all(r.status == "trained" for r in wave.results.values())
    tokens = batch.numel()
    row: dict = {"variants_per_block": per_block, "variants": len(variants), "tokens_per_step": tokens}
    for stat, pick in (("median", statistics.median), ("min", min)):
        t = {k: pick(v) for k, v in times.items()}
        ideal = t["parent"] + t["fwd_bwd"]
        row[stat] = {
            "bld_s": t["bld"],
            "ideal_s": ideal,
            "ideal_opt_s": ideal + t["opt"],
            "bld_tokens_per_s": tokens / t["bld"],
            "ideal_tokens_per_s": tokens / ideal,
            "ratio_vs_ideal": t["bld"] / ideal,
            "ratio_vs_ideal_opt": t["bld"] / (ideal + t["opt"]),
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--variants", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    with device:
        parent = HybridLM(parent_spec(args.hidden, args.vocab)).eval().requires_grad_(False)
        batch = torch.randint(0, args.vocab, (args.batch, args.seq))
    rows = []
    for per_block in args.variants:
        with device:
            rows.append(run(parent, per_block, batch, args.repeats))
    result = {"settings": {**vars(args), "output": str(args.output), "device": str(device)}, "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        "| V/block | variants | BLD tok/s | ideal tok/s | BLD/ideal (median, min) | BLD/(ideal+opt) (median, min) |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        med, low = row["median"], row["min"]
        print(
            f"| {row['variants_per_block']} | {row['variants']} | {med['bld_tokens_per_s']:.0f} | "
            f"{med['ideal_tokens_per_s']:.0f} | {med['ratio_vs_ideal']:.2f}, {low['ratio_vs_ideal']:.2f} | "
            f"{med['ratio_vs_ideal_opt']:.2f}, {low['ratio_vs_ideal_opt']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
