"""GKD training throughput against its ideal: the teacher's plain forward plus the student's plain forward and
backward on the same tokens, with no distillation loss machinery.

Run: `PYTHONPATH=.:benchmarks python benchmarks/bench_gkd.py [--hidden 256] [--vocab 2048 8192]`. Writes
benchmarks/results/bench_gkd.json and prints a markdown table. The teacher is the `bench_importance` parent
(pattern `MEM*EM-E`), the student that parent with every MoE at half its experts and top-k and every Mamba at
half its heads (fresh weights: throughput only). Measured interleaved in one process on the same batch:

- gkd: one `puzzle.gkd` optimiser step (teacher and student block by block, cosine per block, chunked KL
  with the head gradients made in the loss, clipping and the AdamW step), with per-block activation
  checkpointing as `GKDSettings` defaults to (`--no-checkpointing` times it without: the backward then runs
  no block's forward again);
- ideal: `teacher(ids)` under no_grad plus `student(ids)` forward and backward of the mean of its logits
  (both heads make full [tokens, V] fp32 logits: no chunking, no KL, no cosine);
- ideal+opt: ideal plus the clipping and AdamW step GKD cannot avoid;
- plain: what one would write without chunking: full-vocabulary log-softmax KL and the cosine terms from
  `output_hidden_states`, forward and backward, plus the optimiser step.

Figures of merit: gkd / ideal and gkd / (ideal+opt) from medians and minima; tokens/s of each. The CPU is
shared with other jobs, so absolute times are noisy; ratios less so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_importance import parent_spec

from puzzle import gkd
from puzzle.model import HybridLM
from puzzle.spec import MambaSpec, ModelSpec, MoESpec

RESULTS = Path(__file__).parent / "results" / "bench_gkd.json"


def child_spec(spec: ModelSpec) -> ModelSpec:
    """`spec` with every MoE at half its experts and top-k and every Mamba at half its heads."""
    blocks = []
    for block in spec.blocks:
        if isinstance(block, MoESpec):
            block = dataclasses.replace(
                block, num_experts=block.num_experts // 2, top_k=max(1, block.top_k // 2)
            )
        elif isinstance(block, MambaSpec):
            block = dataclasses.replace(block, num_heads=block.num_heads // 2)
        blocks.append(block)
    return dataclasses.replace(spec, blocks=tuple(blocks))


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(hidden: int, vocab: int, batch: torch.Tensor, chunk: int, repeats: int, checkpointing: bool) -> dict:
    torch.manual_seed(0)
    teacher = HybridLM(parent_spec(hidden, vocab)).eval().requires_grad_(False)
    student = HybridLM(child_spec(teacher.spec)).train()
    settings = gkd.GKDSettings(
        lr=1e-5,
        batch_size=batch.shape[0],
        vocab_chunk=chunk,
        steps=10**6,
        activation_checkpointing=checkpointing,
    )
    distiller = gkd._Distiller(student, settings.activation_checkpointing)
    params = list(student.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    blocks = len(student.layers)

    def gkd_step() -> None:
        gkd._train_step(distiller, teacher, optimizer, batch, 1e-5, settings, batch.shape[0])

    def teacher_forward() -> None:
        with torch.no_grad():
            teacher(batch)

    def student_fwd_bwd() -> None:
        student(batch).logits.mean().backward()

    def optimiser() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def plain() -> None:
        out = student(batch, output_hidden_states=True)
        with torch.no_grad():
            ref = teacher(batch, output_hidden_states=True)
        log_q = out.logits[:, :-1].log_softmax(-1)
        log_p = ref.logits[:, :-1].log_softmax(-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
        cosine = sum(
            (1 - torch.nn.functional.cosine_similarity(s, t, dim=-1)).mean()
            for s, t in zip(out.hidden_states[1:], ref.hidden_states[1:])
        )
        (kl + cosine / blocks).backward()
        optimiser()

    gkd_step()  # warm-up: allocator, optimiser states
    plain()
    times: dict[str, list[float]] = {"gkd": [], "teacher": [], "fwd_bwd": [], "opt": [], "plain": []}
    for _ in range(repeats):
        times["gkd"].append(_time(gkd_step))
        times["teacher"].append(_time(teacher_forward))
        times["fwd_bwd"].append(_time(student_fwd_bwd))
        times["opt"].append(_time(optimiser))
        times["plain"].append(_time(plain))
    tokens = batch.numel()
    row: dict = {
        "hidden": hidden,
        "vocab": vocab,
        "vocab_chunk": chunk,
        "tokens_per_step": tokens,
        "activation_checkpointing": checkpointing,
    }
    for stat, pick in (("median", statistics.median), ("min", min)):
        t = {k: pick(v) for k, v in times.items()}
        ideal = t["teacher"] + t["fwd_bwd"]
        row[stat] = {
            "gkd_s": t["gkd"],
            "ideal_s": ideal,
            "ideal_opt_s": ideal + t["opt"],
            "plain_s": t["plain"],
            "gkd_tokens_per_s": tokens / t["gkd"],
            "ideal_tokens_per_s": tokens / ideal,
            "plain_tokens_per_s": tokens / t["plain"],
            "ratio_vs_ideal": t["gkd"] / ideal,
            "ratio_vs_ideal_opt": t["gkd"] / (ideal + t["opt"]),
            "ratio_vs_plain": t["gkd"] / t["plain"],
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--vocab-chunk", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--no-checkpointing",
        dest="checkpointing",
        action="store_false",
        help="time GKD without per-block activation checkpointing (on by default, as in GKDSettings)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for vocab in args.vocab:
        with device:
            batch = torch.randint(
                0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
            )
            rows.append(
                run(args.hidden, vocab, batch.to(device), args.vocab_chunk, args.repeats, args.checkpointing)
            )
    result = {"settings": {**vars(args), "output": str(args.output), "device": str(device)}, "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        "| V | chunk | GKD tok/s | ideal tok/s | plain tok/s | GKD/ideal (median, min) | GKD/(ideal+opt) | GKD/plain |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        med, low = row["median"], row["min"]
        print(
            f"| {row['vocab']} | {row['vocab_chunk']} | {med['gkd_tokens_per_s']:.0f} | "
            f"{med['ideal_tokens_per_s']:.0f} | {med['plain_tokens_per_s']:.0f} | "
            f"{med['ratio_vs_ideal']:.2f}, {low['ratio_vs_ideal']:.2f} | "
            f"{med['ratio_vs_ideal_opt']:.2f}, {low['ratio_vs_ideal_opt']:.2f} | "
            f"{med['ratio_vs_plain']:.2f}, {low['ratio_vs_plain']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
