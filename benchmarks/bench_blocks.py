"""Our Mamba-2 and MoE mixers against transformers' NemotronHMamba2Mixer / NemotronHMoE on the CPU: same weights, threads.

Prefill (forward over T tokens) and the one-token decode step; median times with ours and theirs
interleaved, the ratio ours / theirs (< 1 = we are faster) and the largest output difference.
Writes benchmarks/results/bench_blocks.json and prints a markdown table.

    python benchmarks/bench_blocks.py            # Mamba: hidden 1024, 32 heads x 64, state 128, 8 groups;
                                                 # MoE: a scaled Super block, 128 experts top-8, latent 256
    python benchmarks/bench_blocks.py --only moe # one kind
    python benchmarks/bench_blocks.py --quick    # small sizes, for a smoke run

The MoE is compared with transformers' eager experts (a standalone NemotronHMoE's default) and with its
grouped_mm experts (a from_pretrained model's default where torch has grouped_mm).
The CPU is usually shared with other work, so single figures are noisy; the ratio of interleaved medians is
the figure to read, of wall time and of the thread's CPU time (which a busy machine disturbs less). One
thread by default: on a loaded machine a multi-threaded op waits for its slowest thread. Decode differences
include one known, deliberate one: transformers does not clamp dt at time_step_min in its Mamba decode
path, we do (see puzzle/blocks/mamba.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import NemotronHConfig
from transformers.cache_utils import DynamicCache
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer, NemotronHMoE
from transformers.utils import logging as hf_logging

from puzzle.blocks.mamba import MambaMixer
from puzzle.blocks.moe import ExpertBank, MoEMixer
from puzzle.spec import MambaSpec, MoESpec

RESULTS = Path(__file__).parent / "results" / "bench_blocks.json"


def build_pair(args: argparse.Namespace) -> tuple[NemotronHMamba2Mixer, MambaMixer]:
    """Both mixers with the same weights, SSM parameters drawn as Mamba-2 initialises them (dt in [1e-3, 0.1])."""
    config = NemotronHConfig(
        hidden_size=args.hidden,
        layers_block_type=["mamba"],
        mamba_num_heads=args.heads,
        mamba_head_dim=args.head_dim,
        ssm_state_size=args.state,
        n_groups=args.groups,
        chunk_size=args.chunk,
    )
    torch.manual_seed(0)
    theirs = NemotronHMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        theirs.A_log.copy_(torch.empty(args.heads).uniform_(1, 16).log())
        dt = torch.exp(torch.empty(args.heads).uniform_(math.log(1e-3), math.log(1e-1)))
        theirs.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        theirs.D.copy_(1 + 0.1 * torch.randn(args.heads))
        theirs.norm.weight.copy_(1 + 0.1 * torch.randn(theirs.norm.weight.shape))
    spec = MambaSpec(
        num_heads=args.heads,
        head_dim=args.head_dim,
        state_size=args.state,
        n_groups=args.groups,
        chunk_size=args.chunk,
        dt_clamp_min=config.time_step_min,
    )
    ours = MambaMixer(spec, args.hidden, norm_eps=config.layer_norm_epsilon).eval()
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def build_moe_pair(args: argparse.Namespace, experts_implementation: str) -> tuple[NemotronHMoE, MoEMixer]:
    """Both MoE mixers with the same weights (N(0, 0.05^2), correction bias N(0, 0.01^2)); no grouped routing."""
    config = NemotronHConfig(
        hidden_size=args.hidden,
        layers_block_type=["moe"],
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_width,
        moe_shared_expert_intermediate_size=args.shared_width,
        moe_latent_size=args.latent,
        mlp_hidden_act="relu2",
        n_group=1,
        topk_group=1,
    )
    config._experts_implementation = experts_implementation
    torch.manual_seed(0)
    theirs = NemotronHMoE(config).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn(param.shape) * 0.05)
        theirs.gate.e_score_correction_bias.copy_(torch.randn(args.experts) * 0.01)
    spec = MoESpec(
        num_experts=args.experts,
        top_k=args.top_k,
        expert_width=args.expert_width,
        shared_width=args.shared_width,
        latent_size=args.latent,
        routed_scaling_factor=config.routed_scaling_factor,
        norm_topk_prob=config.norm_topk_prob,
    )
    ours = MoEMixer(spec, args.hidden).eval()
    state = {k: v for k, v in theirs.state_dict().items() if not k.startswith("experts.")}
    experts = theirs.experts
    state.update(
        {
            f"experts.{k}": v
            for k, v in ExpertBank.state_from_hub(list(experts.up_proj), list(experts.down_proj)).items()
        }
    )
    ours.load_state_dict(state)
    return theirs, ours


def interleaved_times(
    ours: Callable[[], object], theirs: Callable[[], object], repeats: int, inner: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each (wall, and this thread's CPU time), `repeats` samples each, alternating which
    goes first so load drifts hit both alike."""
    times: dict[str, list[float]] = {"ours": [], "theirs": [], "ours_cpu": [], "theirs_cpu": []}
    for repeat in range(repeats):
        order = [("ours", ours), ("theirs", theirs)]
        for name, fn in order if repeat % 2 == 0 else order[::-1]:
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(inner):
                fn()
            times[f"{name}_cpu"].append((time.thread_time() - start_cpu) / inner)
            times[name].append((time.perf_counter() - start) / inner)
    return times


def summary(case: str, times: dict[str, list[float]], got: torch.Tensor, expected: torch.Tensor) -> dict:
    ours_s, theirs_s = statistics.median(times["ours"]), statistics.median(times["theirs"])
    ours_cpu, theirs_cpu = statistics.median(times["ours_cpu"]), statistics.median(times["theirs_cpu"])
    return {
        "case": case,
        "ours_ms": ours_s * 1e3,
        "theirs_ms": theirs_s * 1e3,
        "ratio": ours_s / theirs_s,
        "ours_min_ms": min(times["ours"]) * 1e3,
        "theirs_min_ms": min(times["theirs"]) * 1e3,
        "ratio_of_mins": min(times["ours"]) / min(times["theirs"]),
        "ours_cpu_ms": ours_cpu * 1e3,
        "theirs_cpu_ms": theirs_cpu * 1e3,
        "cpu_ratio": ours_cpu / theirs_cpu,
        "max_abs_diff": (got - expected).abs().max().item(),
        "max_abs_output": expected.abs().max().item(),
    }


def bench_prefill(theirs, ours, length: int, repeats: int) -> dict:
    x = torch.randn(1, length, theirs.hidden_size)
    expected, got = theirs(x), ours(x)  # warm-up, and the figures compared
    times = interleaved_times(lambda: ours(x), lambda: theirs(x), repeats)
    return summary(f"prefill T={length}", times, got, expected)


def bench_decode(theirs, ours, prompt: int, repeats: int, inner: int) -> dict:
    """One-token steps after a `prompt`-token prefill (both caches then keep advancing as timing goes on)."""
    x = torch.randn(1, prompt + 1, theirs.hidden_size)
    hf_cache = DynamicCache(config=theirs.config)
    cache = ours.init_cache(1)
    theirs(x[:, :prompt], cache=hf_cache)
    ours(x[:, :prompt], cache=cache)
    token = x[:, prompt:]
    expected, got = theirs(token, cache=hf_cache), ours.step(token, cache)
    times = interleaved_times(
        lambda: ours.step(token, cache), lambda: theirs(token, cache=hf_cache), repeats, inner
    )
    return summary(f"decode step after {prompt} tokens (batch 1)", times, got, expected)


def bench_moe(
    theirs: NemotronHMoE, ours: MoEMixer, label: str, length: int, repeats: int, inner: int
) -> dict:
    """One forward over `length` tokens of batch 1 (a prefill, or with length 1 a decode step: the MoE is stateless)."""
    x = torch.randn(1, length, theirs.config.hidden_size)
    expected, got = theirs(x), ours(x)
    times = interleaved_times(lambda: ours(x), lambda: theirs(x), repeats, inner)
    case = f"MoE prefill T={length}" if length > 1 else "MoE decode step (batch 1)"
    return summary(f"{case} vs {label}", times, got, expected)


def write_json_atomically(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as handle:
        json.dump(payload, handle, indent=2)
        handle.write("\n")
    os.replace(handle.name, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--state", type=int, default=128)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for both")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--decode-steps", type=int, default=50, help="steps per timed decode sample")
    parser.add_argument("--experts", type=int, default=128, help="MoE routed experts")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--shared-width", type=int, default=512)
    parser.add_argument("--latent", type=int, default=256)
    parser.add_argument("--moe-lengths", type=int, nargs="+", default=[512])
    parser.add_argument("--only", choices=["mamba", "moe"], default=None, help="one block kind")
    parser.add_argument("--quick", action="store_true", help="a small, fast configuration")
    parser.add_argument("--out", "--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.heads, args.head_dim, args.state, args.groups, args.chunk = 256, 8, 32, 32, 2, 64
        args.lengths, args.repeats, args.decode_steps = [256], 3, 10
        args.experts, args.top_k, args.expert_width, args.shared_width, args.latent = 16, 4, 64, 128, 64
        args.moe_lengths = [128]

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    rows = []
    with torch.inference_mode():
        if args.only in (None, "mamba"):
            theirs, ours = build_pair(args)
            rows += [bench_prefill(theirs, ours, length, args.repeats) for length in args.lengths]
            rows.append(bench_decode(theirs, ours, 64, args.repeats, args.decode_steps))
        if args.only in (None, "moe"):
            for implementation in ("eager", "grouped_mm"):
                theirs, ours = build_moe_pair(args, implementation)
                label = f"transformers {implementation}"
                rows += [
                    bench_moe(theirs, ours, label, length, args.repeats, 1) for length in args.moe_lengths
                ]
                rows.append(bench_moe(theirs, ours, label, 1, args.repeats, args.decode_steps))

    if args.only is not None and args.out.exists():
        # One kind re-measured: keep the other kind's rows of the previous results.
        previous = json.loads(args.out.read_text()).get("rows", [])
        kept = [row for row in previous if row["case"].startswith("MoE") != (args.only == "moe")]
        all_rows = kept + rows if args.only == "moe" else rows + kept
    else:
        all_rows = rows
    keys = ("hidden", "heads", "head_dim", "state", "groups", "chunk", "threads")
    keys += ("experts", "top_k", "expert_width", "shared_width", "latent")
    config = {k: getattr(args, k) for k in keys}
    payload = {
        "benchmark": "MambaMixer / MoEMixer (puzzle) vs NemotronHMamba2Mixer / NemotronHMoE (transformers), CPU, fp32",
        "config": config,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "note": "shared, loaded machine: absolute times are noisy; ratio = of interleaved medians",
        "rows": all_rows,
    }
    write_json_atomically(args.out, payload)

    print(f"puzzle mixers vs transformers NemotronH mixers, CPU fp32, {config}")
    print(
        "| case | ours (ms, median) | transformers (ms, median) | ours / theirs | ratio of minima "
        "| CPU time ours / theirs | max abs diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['case']} | {row['ours_ms']:.2f} | {row['theirs_ms']:.2f} | {row['ratio']:.2f} "
            f"| {row['ratio_of_mins']:.2f} | {row['cpu_ratio']:.2f} | {row['max_abs_diff']:.1e} |"
        )
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
