"""The seed's run, rehearsed (issue 34 §5): examples/nemotron3_super/config.yaml through every stage of
`puzzle run`, on 2 gloo ranks (torchrun, CPU), on a random tiny parent with Super's 88-block pattern.

    python benchmarks/super_rehearsal.py --out DIR   # benchmarks/results/super_rehearsal.json: its summary

What changes from the example, and nothing else (`rehearsal_config`; tests/test_super_rehearsal.py checks it
key by key): the parent path (the tiny parent), the token counts (`TOKEN_SETTINGS`: sequence length, batch
sizes, budgets), the data and the run directory (the example names a cluster's), and `hardware.price_as`: the
search prices every variant as the same change to Super's full-size block (examples/parents/nemotron3_super),
so the child it returns is under the seed's budgets at Super's size, not the tiny parent's.

The tiny parent (`write_parent`): transformers' NemotronHConfig / NemotronHForCausalLM with Super's
`hybrid_override_pattern`, hidden size 16, random weights, saved in bf16 as the real one is. It agrees with
Super on every axis the space varies (Mamba state 128, 24 experts of width 2688 at top-22; the latent size,
heads and hidden size are tiny), so the space (state 128/96/64, widths 2688..1280, top-k 22..4) is the
example's, variant for variant: 1131 variants trained, 1219 scored.

It prints the wall time of the torchrun, each stage's seconds and peak resident memory per rank (run.json's
`measured`), and the child: its choices and its full-size costs against the budgets, recomputed here from
Super's blocks with the child's state size, widths and top-k (`full_size_child`) by the cost model's
whole-model functions (the throughput at the largest batch keeping 500 tokens/s per user on 8 x B200, and the
1M-token requests that fit on one H100), not by the search's linearised table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "nemotron3_super" / "config.yaml"
SUPER = ROOT / "examples" / "parents" / "nemotron3_super"

# The token counts, at a size two CPU processes run through in minutes: one BLD step per wave, two GKD steps.
TOKEN_SETTINGS: dict[str, Any] = {
    "data.seq_len": 32,
    "data.batch_size": 2,  # global: one sequence per rank
    "data.eval_batch_size": 2,
    "data.held_out_tokens": 64,
    "importance.tokens": 64,
    "importance.batch_size": 2,
    "bld.token_budget": 64,
    "bld.warmup_tokens": 0,
    "gkd.token_budget": 128,
    "gkd.warmup_tokens": 0,
    "gkd.batch_size": 2,
}
# The other keys a rehearsal sets: where its parent, data and outputs are, and what prices the search.
PLACES = ("parent.path", "data.sources", "run_dir", "hardware.price_as")
DOCUMENTS = 2000  # of seq_len tokens: 1% held out (data.held_out_fraction) is ~20, more than held_out_tokens
VOCAB = 64


def super_pattern() -> str:
    return json.loads((SUPER / "config.json").read_text())["hybrid_override_pattern"]


def write_parent(path: Path, seed: int = 0) -> Path:
    """A random NemotronH checkpoint with Super's block pattern at tiny width (transformers' own classes)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    pattern = super_pattern()
    config = NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        hybrid_override_pattern=pattern,
        num_hidden_layers=len(pattern),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        mamba_num_heads=2,
        mamba_head_dim=8,
        n_groups=1,
        ssm_state_size=128,  # Super's: the space's state sizes 128 / 96 / 64 are Super's
        chunk_size=16,
        n_routed_experts=24,
        num_experts_per_tok=22,  # Super's top-k and expert width: the space's values are absolute
        moe_intermediate_size=2688,
        moe_latent_size=8,  # 8 bf16 values: 16-byte rows, as transformers' grouped matmul needs
        moe_shared_expert_intermediate_size=16,
        n_shared_experts=1,
        routed_scaling_factor=5.0,
        norm_topk_prob=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def write_data(path: Path, seq_len: int, seed: int = 0) -> Path:
    """Token documents (one per row of a 2-D tensor), each a fixed function of the previous two tokens with
    10% noise: something for the parent and child to agree or disagree on."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, VOCAB, (DOCUMENTS, seq_len), generator=generator)
    for t in range(2, seq_len):
        rule = (3 * rows[:, t - 1] + rows[:, t - 2] + 1) % VOCAB
        keep = torch.rand(DOCUMENTS, generator=generator) < 0.9
        rows[:, t] = torch.where(keep, rule, rows[:, t])
    path.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": rows.to(torch.int32)}, str(path / "tokens.safetensors"))
    return path


def set_key(data: dict[str, Any], key: str, value: Any) -> None:
    *path, last = key.split(".")
    node = data
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def rehearsal_config(parent: Path, data: Path, run_dir: Path) -> dict[str, Any]:
    """examples/nemotron3_super/config.yaml as a rehearsal: TOKEN_SETTINGS and PLACES changed, nothing else."""
    config = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    for key, value in TOKEN_SETTINGS.items():
        set_key(config, key, value)
    places = {
        "parent.path": str(parent),
        "data.sources": [str(data)],
        "run_dir": str(run_dir),
        "hardware.price_as": str(SUPER),
    }
    for key, value in places.items():
        set_key(config, key, value)
    return config


def prepare(out: Path) -> Path:
    """The tiny parent, the data and the rehearsal's config under `out`; the config's path."""
    parent = write_parent(out / "parent")
    data = write_data(out / "data", TOKEN_SETTINGS["data.seq_len"])
    config = out / "run.yaml"
    config.write_text(yaml.safe_dump(rehearsal_config(parent, data, out / "run"), sort_keys=False))
    return config


def run_two_ranks(config: Path, timeout_s: float) -> float:
    """`puzzle run CONFIG` under torchrun with 2 CPU processes (gloo), one torch thread each; wall seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "puzzle", "run", str(config), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PUZZLE_PROGRESS": "0"}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-6000:]}")
    return seconds


def full_size_child(child_dir: Path) -> Any:
    """The exported tiny child at Super's size: Super's blocks with the child's Mamba state size and MoE
    top-k and expert width, block by block (the axes the space varies; everything else is Super's)."""
    from puzzle import nemotron_h

    child = nemotron_h.spec_from_config(nemotron_h.read_config(child_dir))
    full = nemotron_h.spec_from_config(nemotron_h.read_config(SUPER))
    blocks = []
    for small, big in zip(child.blocks, full.blocks, strict=True):
        if small.kind == "mamba":
            big = dataclasses.replace(big, state_size=small.state_size)
        elif small.kind == "moe":
            big = dataclasses.replace(big, top_k=small.top_k, expert_width=small.expert_width)
        else:
            assert small.kind == big.kind, (small, big)
        blocks.append(big)
    return dataclasses.replace(full, blocks=tuple(blocks)), full


def budget_check(child: Any, parent: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The child's full-size figures for the seed's budgets, from the cost model's whole-model functions, and
    `meets`: {budget text: whether the child meets it}, judged by `within_bounds` (the relative tolerance the
    search holds every budget to) on those figures, not on the search's table."""
    from puzzle.cost import (
        Scenario,
        max_batch_at_speed,
        max_concurrent_requests,
        model_active_params,
        model_params,
        model_weight_bytes,
        state_bytes_per_request,
    )
    from puzzle.cost.limits import Relative, parse_limit, within_bounds

    hardware = config["hardware"]
    fraction = hardware["memory_fraction"]
    speed = Scenario(**hardware["scenarios"]["out_64k"])
    million = Scenario(**hardware["scenarios"]["million_h100"])
    child_point = max_batch_at_speed(child, speed, hardware["profile"], memory_fraction=fraction)
    parent_point = max_batch_at_speed(parent, speed, hardware["profile"], memory_fraction=fraction)
    context = million.prompt_tokens + million.generated_tokens

    def requests(spec: Any) -> int:
        return max_concurrent_requests(spec, "h100-80gb", context, million.recipe, million.kv_dtype, fraction)

    def memory(spec: Any) -> float:
        """memory_bytes[million_h100]: weights + the scenario's batch of 1M-token requests' KV and state."""
        per_request = state_bytes_per_request(
            spec, context, million.kv_dtype, million.ssm_dtype, million.conv_dtype
        )
        return model_weight_bytes(spec, million.recipe) + million.batch_size * per_request

    figures = {
        "throughput_at_speed[out_64k]": (child_point.throughput, parent_point.throughput),
        "memory_bytes[million_h100]": (memory(child), memory(parent)),
    }
    meets = {}
    for text in config["search"]["budgets"]:
        bound = parse_limit(text)
        value, of_parent = figures[bound.key]  # a KeyError names a budget this check does not know
        lower, upper = (
            None if side is None else side.resolve(of_parent) if isinstance(side, Relative) else float(side)
            for side in (bound.lower, bound.upper)
        )
        meets[text] = bool(within_bounds(value, lower, upper))
    return {
        "params": model_params(child),
        "active_params": model_active_params(child),
        "throughput_gain_at_500_tok_s": child_point.throughput / parent_point.throughput,
        "batch_at_speed": [parent_point.batch, child_point.batch],  # [Super's, the child's]
        "million_token_requests_on_h100": [requests(parent), requests(child)],
        "memory_bytes_million_h100": [memory(parent), memory(child)],
        "meets": meets,
    }


def summary(out: Path, seconds: float) -> dict[str, Any]:
    """What the rehearsal measured and returned: wall time, stages, per-rank peaks, the child at full size."""
    run_dir = out / "run"
    manifest = json.loads((run_dir / "run.json").read_text())
    stages = {
        name: record["measured"]
        for name, record in manifest["stages"].items()
        if isinstance(record, dict) and "measured" in record
    }
    peaks = [max(m["peak_rss_mib"][rank] for m in stages.values()) for rank in range(2)]
    (solution_file,) = sorted((run_dir / "solutions").glob("*.json"))
    solution = json.loads(solution_file.read_text())
    config = yaml.safe_load((out / "run.yaml").read_text())
    child, parent = full_size_child(run_dir / "exports" / solution_file.stem)
    return {
        "wall_s": round(seconds, 1),
        "stages": stages,
        "peak_rss_mib_per_rank": peaks,
        "solution": solution_file.name,
        "choices": solution["choices"],
        "totals": solution["totals"],
        "full_size": budget_check(child, parent, config),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Required: the run writes its parent, data, library and exports there (tens of MB, never the repository).
    parser.add_argument(
        "--out", type=Path, required=True, help="a new folder for the run (summary.json in it)"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds the torchrun may take")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty: give a new folder")
    args.out.mkdir(parents=True, exist_ok=True)
    config = prepare(args.out)
    seconds = run_two_ranks(config, args.timeout)
    result = summary(args.out, seconds)
    (args.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wall time {result['wall_s']} s (torchrun, 2 gloo ranks, {os.cpu_count()} CPU cores)")
    for name, measured in result["stages"].items():
        print(f"  {name}: {measured['seconds']} s, peak RSS per rank {measured['peak_rss_mib']} MiB")
    print(f"peak RSS per rank over the run: {result['peak_rss_mib_per_rank']} MiB")
    print(f"child ({result['solution']}), full-size: {json.dumps(result['full_size'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
