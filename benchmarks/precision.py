"""Precision evidence: shape and weight format searched together, against shape-only searches and a uniform
format, at equal weight memory, before and after the same GKD -> docs/RESULTS-precision.md.

    python benchmarks/precision.py            # the quick parent (seed 0), 65/50/35% of its bf16 bytes, 2 GKD seeds
    python benchmarks/precision.py --parent deep   # the 20-block parent -> docs/RESULTS-precision-deep-s0.md
    python benchmarks/precision.py --smoke    # CI-sized (tiny token counts, one level, no GKD)
    python benchmarks/precision.py --render   # the document again from the JSON, nothing rerun

One run directory (`runs/precision-<parent>-s<seed>`, reused) holds the pipeline's importance, BLD library and
replace-one-block scores over the ablations' coarse space (`ablations.SPACE`: Mamba state and heads, MoE top-k,
expert width and count, attention KV heads, no-op blocks) with `weight_format: [bf16, fp8, nvfp4]` on every
kind: each shape in each format, quantized variants trained quantization-aware by BLD (fake-quantized
forward, straight-through gradients; `puzzle.blocks.formats`) and scored fake-quantized. At each level, a
fraction of the parent's bf16 weight bytes (`weight_bytes`: every stored tensor, each block's matmul weights
in its own format, embeddings, norms and routers in bf16), every method picks one variant per block from
that library:

- joint: the MIP over every (shape, format), the `solutions` stage's search;
- shape+fp8: the MIP over the shapes with every block in fp8, so the shape search knows the blocks will be
  fp8 (the strongest form of "search shapes, then quantize to fp8": the shapes' scores are the fp8 ones);
- shape-bf16: the MIP over the shapes in bf16 (what the pipeline searched before weight formats existed);
- nvfp4: the parent's shapes, every block in nvfp4; one child whose size is what it is (its weight bytes
  are above the smallest level on a parent whose embeddings stay bf16), compared at equal size against
  the joint search's KL-vs-size curve.

A removed block (no-op) has no weights and no format: every method may use it. Each child is assembled
(`puzzle.assemble`: quantized blocks carry fake-quantized weights and keep quantizing in their forward, so
GKD is quantization-aware too) and measured against the parent on a test split that no search or GKD
checkpoint choice saw (`ablations.test_split`), then distilled by the run's GKD once per GKD seed and
measured again. The report: each method's KL over the joint search's on the same test batches, per GKD
seed, with 95% intervals (`ablation_stats.paired_ratio`); the formats each child chose per block; and each
child's predicted throughput on one B200 at a fixed per-user decode speed (`max_batch_at_speed`, the
8k-in / 64k-out scenario) over the bf16 parent's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from puzzle.cost.analytic import block_weight_bytes, model_active_params, model_weight_bytes
from puzzle.cost.hardware import get_hardware
from puzzle.cost.roofline import max_batch_at_speed, model_performance
from puzzle.cost.serving import parse_scenario
from puzzle.files import atomic_write_bytes
from puzzle.problem import RunCandidates
from puzzle.spec import BlockSpec, ModelSpec, weight_format_of

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import ablations  # noqa: E402  (a sibling module)
from ablation_stats import interpolate, paired_ratio  # noqa: E402

FORMATS = ("bf16", "fp8", "nvfp4")
LEVELS = (0.65, 0.50, 0.35)
METHODS = ("joint", "shape+fp8", "shape-bf16", "nvfp4")
SCENARIO = "8k-64k:batch=1,prompt=8192,generated=65536"  # the seed's long-generation workload
HARDWARE = "b200"
# The fixed per-user decode speed, as a fraction of the bf16 parent's own speed at batch 1: a tiny parent on a
# B200 decodes at hundreds of thousands of tokens/s, so an absolute figure such as the seed's 500 tokens/s
# would put every child at its memory limit; half the parent's best speed leaves the speed as the bound.
SPEED_FRACTION = 0.5
EXCLUDED = 1e6  # the score of a candidate a restricted search must not take (KL is nats/token: far above)


def precision_space(space: dict[str, Any], formats: Sequence[str] = FORMATS) -> dict[str, Any]:
    """`space` (kinds -> axes) with every kind also searched in each of `formats`."""
    return {kind: {**axes, "weight_format": list(formats)} for kind, axes in space.items()}


def only_format(candidates: RunCandidates, fmt: str) -> RunCandidates:
    """The candidates in weight format `fmt` and the removed blocks (which have no weights). The parent's own
    block stays first (the search's tables are priced against it) but, when in another format, with the
    score `EXCLUDED`, which no search picks while another choice meets the budget (`in_format` checks)."""
    variants, scores = [], []
    for specs, values in zip(candidates.variants, candidates.scores):
        kept = [(s, v) for s, v in zip(specs[1:], values[1:]) if format_of(s) in (fmt, "removed")]
        own = values[0] if format_of(specs[0]) == fmt else EXCLUDED
        variants.append([specs[0], *(s for s, _ in kept)])
        scores.append([own, *(v for _, v in kept)])
    return RunCandidates(candidates.parent, variants, scores, list(candidates.notes))


def in_format(arch: ablations.Arch | None, fmt: str) -> ablations.Arch | None:
    """`arch` if every block is in `fmt` or removed, else None (the search had to take an excluded block)."""
    if arch is None or any(format_of(b) not in (fmt, "removed") for b in arch):
        return None
    return arch


def uniform_format(parent: ModelSpec, fmt: str) -> ablations.Arch:
    """The parent's shapes, every block with weights in `fmt`."""
    return tuple(
        dataclasses.replace(b, weight_format=fmt) if hasattr(b, "weight_format") else b for b in parent.blocks
    )


def format_of(spec: BlockSpec) -> str:
    """A block's weight format, or "removed" for a no-op (no weights)."""
    return weight_format_of(spec) if hasattr(spec, "weight_format") else "removed"


def choose(bench: ablations.Bench, level: float, methods: Sequence[str] = METHODS) -> list[ablations.Choice]:
    """Each method's architecture at `level` of the parent's bf16 weight bytes (one absolute limit for all)."""
    limit = f"weight_bytes<={level * model_weight_bytes(bench.spec, 'bf16'):.1f}"

    def mip(candidates: RunCandidates) -> ablations.Arch | None:
        return ablations.Problem(bench.run, candidates, level, budget="weight_bytes", limit=limit).mip()

    out = []
    for method in methods:
        if method == "joint":
            out.append(ablations.Choice(method, level, mip(bench.kl)))
        elif method == "shape+fp8":
            out.append(ablations.Choice(method, level, in_format(mip(only_format(bench.kl, "fp8")), "fp8")))
        elif method == "shape-bf16":
            out.append(ablations.Choice(method, level, in_format(mip(only_format(bench.kl, "bf16")), "bf16")))
        elif method == "nvfp4":
            out.append(
                ablations.Choice(method, level, uniform_format(bench.spec, "nvfp4"), note="parent's shapes")
            )
        else:
            raise ValueError(f"unknown method {method!r}; methods: {', '.join(METHODS)}")
    return out


class Throughput:
    """Predicted server throughput of a spec at the fixed per-user speed, over the bf16 parent's."""

    def __init__(self, parent: ModelSpec, scenario: str = SCENARIO, hardware: str = HARDWARE) -> None:
        self.scenario = parse_scenario(scenario)
        self.hardware = get_hardware(hardware)
        batch_one = model_performance(parent, self.scenario, self.hardware).per_user_tokens_per_s
        self.speed = SPEED_FRACTION * batch_one
        self.parent = self.at(parent)

    def at(self, spec: ModelSpec) -> dict[str, Any]:
        point = max_batch_at_speed(spec, self.scenario, self.hardware, self.speed)
        return {"batch": point.batch, "limited_by": point.limited_by, "tokens_per_s": point.throughput}


def measure_row(
    bench: ablations.Bench, choice: ablations.Choice, gkd_seeds: int, throughput: Throughput
) -> dict[str, Any]:
    """The JSON record of one method at one level: architecture, formats, costs, KL before and after GKD."""
    base = {"method": choice.method, "level": choice.level, "note": choice.note}
    if choice.arch is None:
        return {**base, "feasible": False}
    spec = dataclasses.replace(bench.spec, blocks=choice.arch)
    name = f"precision-{choice.level:.2f}-{choice.method}"
    if gkd_seeds:
        record = bench.distil(choice.arch, "bld", name, tuple(range(gkd_seeds)))
    else:
        record = bench.measure(choice.arch, "bld")
    speed = throughput.at(spec)
    return {
        **base,
        "feasible": True,
        "blocks": [b.short_name() for b in choice.arch],
        "formats": [format_of(b) for b in choice.arch],
        "weight_fraction": model_weight_bytes(spec, "bf16") / model_weight_bytes(bench.spec, "bf16"),
        "active_fraction": model_active_params(spec) / model_active_params(bench.spec),
        "predicted_kl": bench.predicted(choice.arch, bench.kl_of),
        "before": record["before"],
        "after_seeds": record.get("after_seeds") or [],
        "throughput": {**speed, "ratio": speed["tokens_per_s"] / throughput.parent["tokens_per_s"]},
    }


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every method's KL over the joint search's on the same test batches, per level, before GKD and per GKD
    seed (> 1: the joint search lower); and the nvfp4 child against the joint curve at its own size."""
    out: dict[str, Any] = {"ratios": {}, "equal_size": {}}
    joint = {r["level"]: r for r in rows if r["method"] == "joint" and r["feasible"]}
    for r in rows:
        ref = joint.get(r["level"])
        if r["method"] == "joint" or not r["feasible"] or ref is None:
            continue
        entry = {"before": paired_ratio(r["before"]["kl_batches"], ref["before"]["kl_batches"])}
        entry["after"] = [
            paired_ratio(mine["kl_batches"], theirs["kl_batches"])
            for mine, theirs in zip(r["after_seeds"], ref["after_seeds"])
        ]
        out["ratios"].setdefault(f"{r['level']:.2f}", {})[r["method"]] = entry
    uniform = next((r for r in rows if r["method"] == "nvfp4" and r["feasible"]), None)
    if uniform is not None and joint:
        refs = list(joint.values())
        size = uniform["weight_fraction"]
        curve = {"before": interpolate([(j["weight_fraction"], j["before"]["kl"]) for j in refs], size)}
        seeds = len(uniform["after_seeds"])
        curve["after"] = [
            interpolate([(j["weight_fraction"], j["after_seeds"][s]["kl"]) for j in refs], size)
            for s in range(seeds)
        ]
        out["equal_size"] = {
            "weight_fraction": size,
            "before": uniform["before"]["kl"] / curve["before"],
            "after": [u["kl"] / c for u, c in zip(uniform["after_seeds"], curve["after"])],
            "joint_curve": curve,
        }
    return out


def evaluate(
    run: Any,
    levels: Sequence[float] = LEVELS,
    methods: Sequence[str] = METHODS,
    gkd_seeds: int = 2,
    test_tokens: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every method at every level on the run's library; the uniform nvfp4 child once (its size is fixed)."""
    bench = ablations.Bench(run, init_scores=False, test_tokens=test_tokens)
    throughput = Throughput(bench.spec)
    rows = []
    for index, level in enumerate(levels):
        wanted = [m for m in methods if m != "nvfp4" or index == 0]
        for choice in choose(bench, level, wanted):
            started = time.perf_counter()
            record = measure_row(bench, choice, gkd_seeds, throughput)
            if choice.method == "nvfp4":
                record["level"] = None  # one child, at its own size
            rows.append(record)
            if record["feasible"]:
                after = "; ".join(f"{a['kl']:.4f}" for a in record["after_seeds"])
                log(
                    f"{level:.2f} {choice.method}: weight {record['weight_fraction']:.3f}, KL pred "
                    f"{record['predicted_kl']:.4f} measured {record['before']['kl']:.4f}"
                    + (f" after GKD {after}" if after else "")
                    + f" ({time.perf_counter() - started:.1f} s)"
                )
            else:
                log(f"{level:.2f} {choice.method}: infeasible")
    return {
        "rows": rows,
        "comparison": compare(rows),
        "parent": {
            "blocks": [b.short_name() for b in bench.spec.blocks],
            "weight_bytes": model_weight_bytes(bench.spec, "bf16"),
            "outside_fraction": outside_fraction(bench.spec),
            "throughput": throughput.parent,
        },
        "speed": throughput.speed,
        "test_tokens": sum(b.numel() for b in bench.test) if bench.test else 0,
        "variants": sum(1 for r in bench.library.results.values() if r.status != "parent"),
        "bld": bld_by_format(bench.library),
    }


def outside_fraction(spec: ModelSpec) -> float:
    """The share of the bf16 bytes outside the blocks (embeddings, lm_head, final norm): no format covers it."""
    blocks = sum(block_weight_bytes(b, spec.hidden_size, "bf16") for b in spec.blocks)
    return 1 - blocks / model_weight_bytes(spec, "bf16")


def bld_by_format(library: Any) -> dict[str, dict[str, int]]:
    """Per weight format, how many variants BLD trained and how many of them kept their trained weights
    (the rest kept their initial ones: training left them worse on the held-out tokens)."""
    out: dict[str, dict[str, int]] = {}
    for variant, result in library.results.items():
        if result.status != "trained":
            continue
        entry = out.setdefault(format_of(variant.spec), {"trained": 0, "kept_trained": 0})
        entry["trained"] += 1
        entry["kept_trained"] += result.kept == "trained"
    return out


# --------------------------------------------------------------------------------------------- the report

NAMES = {
    "joint": "joint (shape + format)",
    "shape+fp8": "shape search, every block fp8",
    "shape-bf16": "shape search, bf16",
    "nvfp4": "uniform nvfp4, parent's shapes",
}


def _ratio(r: dict[str, float]) -> str:
    return f"{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"


def _kl(value: float) -> str:
    return f"{value:.3g}"


def _formats(formats: Sequence[str]) -> str:
    short = {"bf16": "b", "fp8": "8", "nvfp4": "4", "removed": "-"}
    return "".join(short[f] for f in formats)


def verdicts(data: dict[str, Any]) -> list[str]:
    """Plain sentences on the goal (the joint search best at every level, beyond the GKD-seed noise)."""
    lines = []
    ratios = data["comparison"]["ratios"]
    for level, methods in ratios.items():
        for method, entry in methods.items():
            after = entry["after"]
            if not after:
                verdict = "before GKD " + (
                    "beyond the noise" if entry["before"]["low"] > 1 else "not beyond the noise"
                )
            elif all(a["low"] > 1 for a in after):
                verdict = "joint lower after GKD in every seed, beyond the noise"
            elif all(a["high"] < 1 for a in after):
                verdict = f"**{method} lower** after GKD in every seed, beyond the noise"
            else:
                verdict = "within the noise after GKD (an interval spans 1, or the seeds disagree)"
            lines.append(f"- {float(level):.0%}, {NAMES[method]}: {verdict}.")
    equal = data["comparison"].get("equal_size") or {}
    if equal:
        after = ", ".join(f"{v:.2f}" for v in equal["after"])
        lines.append(
            f"- Uniform nvfp4 ({equal['weight_fraction']:.1%} of the bf16 bytes) over the joint search's curve at "
            f"that size: {equal['before']:.2f} before GKD, {after or '-'} after (per GKD seed; > 1: joint lower)."
        )
    return lines


def markdown(data: dict[str, Any], others: Sequence[Path] = ()) -> str:
    """The document of `data`; `others`: the pages of the same comparison on other parents, linked."""
    meta = data["meta"]
    lines = [
        "# Shape and weight format searched together",
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"Parent: {meta['parent']} ({' '.join(data['parent']['blocks'])}), "
        f"{data['parent']['weight_bytes'] / 2**20:.2f} MiB in bf16. Library: {data['variants']} variants "
        f"(each shape of `ablations.SPACE` in bf16, fp8 and nvfp4, trained by BLD, quantized ones "
        f"quantization-aware). KL to the parent in nats/token on a {data['test_tokens']:,}-token test split "
        f"no search saw; GKD: the run's settings ({meta['gkd_tokens']:,} tokens), once per GKD seed. Wall time "
        f"{meta['seconds'] / 60:.0f} min on {meta['machine']}.",
        "",
        *(
            [
                "Other parents: "
                + ", ".join(f"[{o.stem.removeprefix('RESULTS-')}]({o.name})" for o in others)
                + ".",
                "",
            ]
            if others
            else []
        ),
        "Weight memory: every stored tensor, each block's matmul weights in its format (fp8: E4M3 with one "
        "fp32 scale per output channel; nvfp4: E2M1 in blocks of 16 with an E4M3 scale each and one fp32 "
        "scale per tensor), embeddings, norms, routers and 1-D tensors in bf16, as a fraction of the bf16 "
        "parent's bytes. Formats per block: `b` bf16, `8` fp8, `4` nvfp4, `-` removed. Throughput: predicted "
        f"output tokens/s on one B200 ({SCENARIO.split(':')[1].replace(',', ', ')}) at a fixed per-user speed "
        f"of {data['speed']:,.0f} tokens/s (half the bf16 parent's batch-1 speed), over the bf16 parent's.",
        "",
        "| level | method | weight memory | active | formats | before GKD | after GKD (per seed) | GKD kept step | "
        "KL / joint's after GKD [95%] | throughput (batch) |",
        "|---|---|---:|---:|---|---:|---:|---|---|---:|",
    ]
    ratios = data["comparison"]["ratios"]
    for r in data["rows"]:
        level = "-" if r["level"] is None else f"{r['level']:.0%}"
        if not r["feasible"]:
            lines.append(f"| {level} | {NAMES[r['method']]} | infeasible | | | | | | | |")
            continue
        after = "; ".join(_kl(a["kl"]) for a in r["after_seeds"]) or "-"
        kept = "; ".join(str((a.get("gkd") or {}).get("kept_step", "-")) for a in r["after_seeds"]) or "-"
        entry = ratios.get(f"{r['level']:.2f}", {}).get(r["method"]) if r["level"] is not None else None
        vs = "; ".join(_ratio(a) for a in entry["after"]) if entry else "-"
        lines.append(
            f"| {level} | {NAMES[r['method']]} | {r['weight_fraction']:.1%} | {r['active_fraction']:.1%} | "
            f"`{_formats(r['formats'])}` | {_kl(r['before']['kl'])} | {after} | {kept} | {vs} | "
            f"{r['throughput']['ratio']:.2f}x ({r['throughput']['batch']:,}) |"
        )
    lines += [
        "",
        "BLD kept its trained weights for "
        + ", ".join(
            f"{v['kept_trained']} of {v['trained']} {fmt} variants"
            for fmt, v in sorted(data.get("bld", {}).items())
        )
        + " (the others kept their initial weights, the parent's or pruned ones: training left them worse on "
        "the held-out tokens).",
        "",
        f"The bf16 parent serves {data['parent']['throughput']['batch']:,} requests at that speed "
        f"(limited by {data['parent']['throughput']['limited_by']}). GKD kept step 0 where the child came out "
        "of assembly better than any later held-out evaluation (`gkd.keep_best`): both seeds then report the "
        "same child.",
        "",
        "## Against the goal (the joint search best at every level, beyond the noise)",
        "",
    ]
    lines += verdicts(data)
    lines += [
        "",
        "## Caveats",
        "",
        "- One seed of this parent: the GKD-seed intervals say nothing of how another parent would rank the "
        "methods (the other parents' pages are listed above).",
        f"- The parent is tiny: {data['parent']['outside_fraction']:.0%} of its bf16 bytes lie outside the "
        "blocks (embeddings, lm_head) and stay bf16, so no format alone reaches 35%; on Nemotron-3-Super the "
        "blocks hold ~98% of the bytes.",
        "- The budget bounds weight memory only, where a format is far cheaper in KL than a shape: the "
        "shape-only bf16 search is the pipeline as it was, not a strong baseline. The strong ones are the "
        "fp8 shape search and uniform nvfp4.",
        "- The throughput figures come from the cost model (roofline on a B200 profile), not a measurement. "
        "On a parent this small a request's KV cache at 72k tokens of context (tens of MiB) outweighs all the "
        "weights (about 1 MiB), so the decode step, and with it the batch at a fixed "
        "speed, is set by the attention and SSM state: weight formats barely move it (1.00x) and removing "
        "the attention block moves it by orders of magnitude. At Super's size the weights are ~64 GB per "
        "replica and formats move throughput (`puzzle costs --user-speed`).",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CI-sized: tiny token counts, 50%% only, no GKD")
    parser.add_argument("--render", action="store_true", help="the document again from --output's JSON")
    parser.add_argument("--parent", default="quick", choices=ablations.PARENTS)
    parser.add_argument("--parent-seed", type=int, default=0)
    parser.add_argument("--levels", type=float, nargs="+", default=None, help=f"default {LEVELS}")
    parser.add_argument("--gkd-seeds", type=int, default=None, help="GKD runs per child (default 2; smoke 0)")
    parser.add_argument("--cache", type=Path, help="the demo parent's cache (default puzzle.demo.parent's)")
    parser.add_argument("--run-dir", type=Path, help="default runs/precision-<parent>-s<seed>[-smoke]")
    parser.add_argument("--output", type=Path, default=None, help="default benchmarks/results/precision.json")
    parser.add_argument(
        "--doc", type=Path, default=None, help="default docs/RESULTS-precision.md (none: smoke)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared CPU)")
    args = parser.parse_args(argv)
    default = args.parent == "quick" and args.parent_seed == 0
    tag = f"{args.parent}-s{args.parent_seed}" + ("-smoke" if args.smoke else "")
    name = "precision" if default and not args.smoke else f"precision-{tag}"
    output = args.output or HERE / "results" / ("quick/precision.json" if args.smoke else f"{name}.json")
    doc = args.doc or (None if args.smoke else ROOT / "docs" / f"RESULTS-{name}.md")
    others = sorted(p for p in (ROOT / "docs").glob("RESULTS-precision-*.md") if doc is None or p != doc)
    others = others if doc is not None and doc.name == "RESULTS-precision.md" else []
    if args.render:
        data = json.loads(output.read_text())
        if doc is not None:
            atomic_write_bytes(doc, markdown(data, others).encode())
            print(f"wrote {doc}")
        return 0
    torch.set_num_threads(args.threads)
    command = "python benchmarks/precision.py" + " ".join(["", *(argv if argv is not None else sys.argv[1:])])
    started = time.perf_counter()
    parent = ablations.load_parent(args.parent, args.parent_seed, args.cache)
    base = ablations.SMOKE if args.smoke else ablations.DEFAULT
    size = dataclasses.replace(base, space=precision_space(ablations.SPACE))
    run_dir = args.run_dir or ROOT / "runs" / f"precision-{tag}"
    run = ablations.prepare(parent, size, run_dir)
    print(f"run (up to the scores): {run_dir} ({time.perf_counter() - started:.0f} s)", flush=True)
    levels = args.levels or ((0.5,) if args.smoke else LEVELS)
    gkd_seeds = args.gkd_seeds if args.gkd_seeds is not None else (0 if args.smoke else 2)
    data = evaluate(run, levels, METHODS, gkd_seeds, size.held_out_tokens)
    data["meta"] = {
        "command": ablations.shown_command(command),
        "parent": f"the {args.parent} ablation parent (seed {args.parent_seed})",
        "gkd_tokens": size.gkd_tokens,
        "gkd_seeds": gkd_seeds,
        "levels": list(levels),
        "stages": ablations._stage_seconds(run),
        "seconds": time.perf_counter() - started,
        "machine": f"{platform.machine()} CPU, {args.threads} torch thread(s)",
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(output, (json.dumps(data, indent=2, default=str) + "\n").encode())
    print(f"wrote {output}")
    if doc is not None:
        atomic_write_bytes(doc, markdown(data, others).encode())
        print(f"wrote {doc}")
    print("\n".join(verdicts(data)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
