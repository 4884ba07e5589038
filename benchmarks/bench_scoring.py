"""Replace-one-block scoring: `puzzle.score.score_variants` (suffix-only recomputation) vs one full forward per variant.

Run: `PYTHONPATH=. python benchmarks/bench_scoring.py [--hidden 256] [--repeats 3]`. Writes
benchmarks/results/bench_scoring.json and prints a markdown table. Both run interleaved in one process on
the same tiny hybrid parent, variants and tokens. The naive side is favoured: it keeps the parent's full
log-probabilities per batch (computed once) and computes only the KL and top-1 agreement from whole-vocab
logits, where `score_variants` also computes the loss change, top-5 and hidden-state NMSE, streams the
vocabulary in chunks and writes its files. Figures of merit: the ratios of medians and of minima. The CPU
is shared with other jobs, so absolute times are noisy; ratios less so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from puzzle.blocks import build_block
from puzzle.model import HybridLM
from puzzle.score import ScoreSettings, score_variants
from puzzle.spec import AttentionSpec, LinearSpec, MambaSpec, MLPSpec, ModelSpec, MoESpec, NoOpSpec, Variant

RESULTS = Path(__file__).parent / "results" / "bench_scoring.json"


def parent_spec(hidden: int, vocab: int) -> ModelSpec:
    """Pattern `MEM*EM-E`, small widths."""
    mamba = MambaSpec(num_heads=hidden // 32, head_dim=64, state_size=32, n_groups=2, chunk_size=64)
    attention = AttentionSpec(num_heads=hidden // 64, num_kv_heads=2, head_dim=64)
    moe = MoESpec(num_experts=8, top_k=2, expert_width=hidden, shared_width=hidden)
    mlp = MLPSpec(width=4 * hidden)
    blocks = (mamba, moe, mamba, attention, moe, mamba, mlp, moe)
    return ModelSpec(vocab_size=vocab, hidden_size=hidden, blocks=blocks)


def variants_of(spec: ModelSpec) -> dict[Variant, torch.nn.Module]:
    """Four per block: a smaller one of the same kind, a linear replacement, a no-op, and the parent's own."""
    smaller = {
        MambaSpec: lambda b: MambaSpec(b.num_heads // 2, b.head_dim, b.state_size, b.n_groups, b.chunk_size),
        MoESpec: lambda b: MoESpec(b.num_experts, 1, b.expert_width, b.shared_width),
        AttentionSpec: lambda b: AttentionSpec(b.num_heads, 1, b.head_dim),
        MLPSpec: lambda b: MLPSpec(b.width // 2),
    }
    library: dict[Variant, torch.nn.Module | None] = {}
    for index, block in enumerate(spec.blocks):
        library[Variant(index, block)] = None
        for child in (smaller[type(block)](block), LinearSpec(), NoOpSpec()):
            library[Variant(index, child)] = build_block(child, spec.hidden_size).eval()
    return library


@torch.no_grad()
def naive(parent: HybridLM, library, batches) -> dict[Variant, float]:
    """Mean KL per variant: a full forward of the parent with the block swapped, whole-vocab log-softmax."""
    references = [F.log_softmax(parent(ids).logits[:, :-1], -1) for ids in batches]
    kls = {}
    for variant, mixer in library.items():
        index = variant.block_index
        saved_mixer, saved_norm = parent.layers[index].mixer, parent.layers[index].norm
        if mixer is not None:
            parent.replace_mixer(index, mixer)
        total, tokens = 0.0, 0
        for ids, logp in zip(batches, references):
            logq = F.log_softmax(parent(ids).logits[:, :-1], -1)
            total += float((logp.exp() * (logp - logq)).sum())
            tokens += logp.shape[0] * logp.shape[1]
            _ = (logq.argmax(-1) == logp.argmax(-1)).sum()
        parent.replace_mixer(index, saved_mixer, norm=saved_norm)
        kls[variant] = total / tokens
    return kls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--vocab-chunk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    spec = parent_spec(args.hidden, args.vocab)
    parent = HybridLM(spec).eval()
    library = variants_of(spec)
    generator = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator) for _ in range(args.batches)
    ]
    settings = ScoreSettings(vocab_chunk=args.vocab_chunk)
    scratch = Path(tempfile.mkdtemp(prefix="bench_scoring_"))

    def suffix() -> dict[Variant, float]:
        shutil.rmtree(scratch / "run", ignore_errors=True)  # no reuse: every repeat scores everything
        scores = score_variants(parent, library, library, batches, scratch / "run", settings)
        return {variant: score.kl for variant, score in scores.variants.items()}

    runs = {"naive_full_forward": lambda: naive(parent, library, batches), "score_variants": suffix}
    results = {name: run() for name, run in runs.items()}  # warm-up, and the two must agree
    worst = max(abs(results["score_variants"][v] - results["naive_full_forward"][v]) for v in library)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    shutil.rmtree(scratch, ignore_errors=True)

    base, base_min = statistics.median(times["naive_full_forward"]), min(times["naive_full_forward"])
    rows = [
        {
            "run": name,
            "median_s": statistics.median(values),
            "min_s": min(values),
            "ratio_to_naive": statistics.median(values) / base,
            "ratio_of_mins": min(values) / base_min,
        }
        for name, values in times.items()
    ]
    result = {
        "benchmark": "bench_scoring",
        "pattern": spec.pattern,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "vocab_chunk": args.vocab_chunk,
        "variants": len(library),
        "tokens": args.batch * args.seq * args.batches,
        "repeats": args.repeats,
        "threads": args.threads,
        "max_abs_kl_difference": worst,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "rows": rows,
        "note": "shared CPU (other jobs running): absolute times are noisy; compare the ratios",
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, args.output)
    print(
        f"scoring {len(library)} variants, pattern {spec.pattern}, H={args.hidden}, V={args.vocab}, "
        f"{result['tokens']} tokens; max |KL difference| {worst:.2e}\n"
    )
    print("| run | median s | min s | ratio of medians | ratio of mins |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['run']} | {row['median_s']:.3f} | {row['min_s']:.3f} | "
            f"{row['ratio_to_naive']:.2f}x | {row['ratio_of_mins']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
