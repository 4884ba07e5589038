"""Ablations: Puzzle against the alternatives at equal budget on the demo parent -> docs/RESULTS.md.

    python benchmarks/ablations.py            # the quick demo parent, four levels (~10-15 min on 2 cores)
    python benchmarks/ablations.py --full     # the full demo parent
    python benchmarks/ablations.py --quick    # CI-sized smoke run (tiny tokens, two levels, 2 seeds)

One run directory (`runs/ablations[-full|-quick]`, reused: a rerun only re-measures) holds the pipeline's
importance, BLD library and replace-one-block scores (`puzzle.run.Run` up to `scores`) over a space with
every axis (Mamba state and heads, MoE top-k, expert width and count, attention KV heads, no-op blocks).
At each budget (a fraction of the parent's active parameters) every method picks one variant per block
from that library:

- puzzle: the MIP (`puzzle.search`) over the BLD library with KL scores, as the `solutions` stage runs it;
- homogeneous: one shape per block kind in every block of that kind (Minitron-style uniform pruning; a
  no-op for every block of a kind counts as a shape), the combination with the least predicted KL that
  meets the budget (all combinations enumerated), BLD weights;
- greedy: from the parent, repeatedly take the block swap with the least KL increase per active parameter
  saved until the budget holds (once per shared Mamba state size, the best kept);
- random: a uniformly random architecture of the library that meets the budget (rejection sampling over
  the whole product), one per seed;
- mip_no_bld: the MIP over the variants straight from pruning (`puzzle.prune.init_child`, no BLD), scored
  by the same replace-one-block KL on the same held-out text, and assembled with those untrained weights;
- mip_lm_loss: the MIP with replace-one-block LM-loss increase scores instead of KL;
- no_state_axis / no_width_axis: the MIP without the Mamba state-size axis / without the MoE expert-width
  axis (variants that keep the parent's value only).

Every architecture is assembled (`puzzle.assemble`) and measured against the parent on the run's held-out
tokens (`puzzle.assemble.measured_kl`: KL, LM-loss increase, top-1 agreement); those of `--gkd` methods are
then distilled by the run's own GKD settings (`puzzle.gkd.distill`) and measured again. The summed
replace-one-block KL the search predicts is set against the measured KL of every BLD-assembled child
(Spearman rank correlation, numpy ranks). Output: the JSON (benchmarks/results/ablations.json), the table
per level and the plot (docs/RESULTS.md, docs/results_kl.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from puzzle.assemble import assemble, measured_kl
from puzzle.bld import Library, default_init, read_library
from puzzle.config.run import load_config_data
from puzzle.cost.analytic import model_active_params
from puzzle.demo.pipeline import FULL, QUICK, DemoSize, demo_config
from puzzle.files import atomic_write_bytes
from puzzle.run import Run
from puzzle.search import InfeasibleError, search
from puzzle.search.mip import resolve_limits
from puzzle.search.run_dir import RunCandidates, RunProblem, run_candidates, run_problem
from puzzle.spec import BlockSpec, MambaSpec, ModelSpec, MoESpec, Variant

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

LEVELS = (0.85, 0.70, 0.55, 0.40)
METHODS = (
    "puzzle",
    "homogeneous",
    "greedy",
    "random",
    "mip_no_bld",
    "mip_lm_loss",
    "no_state_axis",
    "no_width_axis",
)
GKD_METHODS = ("puzzle", "homogeneous", "greedy")
# Every axis the ablations take away exists in this space (Mamba state, MoE expert width), besides heads,
# top-k, expert count and no-op blocks.
SPACE = {
    "mamba": {"state_size": [8], "num_heads": [2], "noop": True},
    "moe": {"top_k": [1], "expert_width_fraction": [0.5], "num_experts": [4], "noop": True},
    "attention": {"num_kv_heads": [1], "noop": True},
}
DEFAULT = dataclasses.replace(QUICK, space=SPACE)
FULL_SPACE = {
    "mamba": {"state_size": [8], "num_heads": [2], "noop": True},
    "moe": {"top_k": [2, 1], "expert_width_fraction": [0.5], "num_experts": [8], "noop": True},
    "attention": {"num_kv_heads": [1], "noop": True},
}
SMOKE = DemoSize(
    seq_len=64,
    held_out_tokens=1024,
    importance_tokens=512,
    bld_tokens=2048,
    gkd_tokens=2048,
    batch_size=4,
    space=SPACE,
)


# ----------------------------------------------------------------------------------------- architectures


Arch = tuple[BlockSpec, ...]  # one spec per parent block


@dataclass
class Choice:
    """One method's architecture at one level (None: the method found none that meets the budget)."""

    method: str
    level: float
    arch: Arch | None
    weights: str = "bld"  # "bld": the library's trained mixers; "init": pruning's, untrained
    seed: int | None = None
    note: str = ""


def _arch(table_choices: Sequence[int], candidates: RunCandidates) -> Arch:
    return tuple(candidates.variants[b][j] for b, j in enumerate(table_choices))


def restrict(candidates: RunCandidates, keep: Callable[[BlockSpec, BlockSpec], bool]) -> RunCandidates:
    """The candidates whose spec `keep(spec, parent block)` accepts (the parent's own block always stays)."""
    variants, scores = [], []
    for b, (specs, values) in enumerate(zip(candidates.variants, candidates.scores)):
        kept = [
            (s, v)
            for j, (s, v) in enumerate(zip(specs, values))
            if j == 0 or keep(s, candidates.parent.blocks[b])
        ]
        variants.append([s for s, _ in kept])
        scores.append([v for _, v in kept])
    return RunCandidates(candidates.parent, variants, scores, list(candidates.notes))


def same_state(spec: BlockSpec, parent: BlockSpec) -> bool:
    """A variant without the Mamba state axis: the parent's state size (or no state at all)."""
    return not isinstance(spec, MambaSpec) or spec.state_size == getattr(parent, "state_size", None)


def same_width(spec: BlockSpec, parent: BlockSpec) -> bool:
    """A variant without the expert-width axis: the parent's expert width (or no experts at all)."""
    return not isinstance(spec, MoESpec) or spec.expert_width == getattr(parent, "expert_width", None)


class Problem:
    """One level's search problem over a set of candidates: the table, limits and rules of the run's search,
    and vectorised feasibility for the baselines."""

    def __init__(self, run: Run, candidates: RunCandidates, level: float) -> None:
        self.candidates = candidates
        self.run_problem: RunProblem = run_problem(
            run.layout,
            [f"active_params<={level}x"],
            cost_model=run.cost_model(),
            shared_state_size=run.config.search.shared_state_size,
            candidates=candidates,
        )
        self.table = self.run_problem.table
        self.limits = self.run_problem.problem.limits
        self.rules = self.run_problem.problem.rules
        self.resolved = resolve_limits(self.table, self.limits)

    def mip(self) -> Arch | None:
        try:
            solution = search(self.table, self.limits, self.rules)
        except InfeasibleError:
            return None
        return _arch(solution.choices, self.candidates)

    def feasible(self, choices: np.ndarray) -> np.ndarray:
        """Which rows of `choices` ([N, blocks] variant index per block) meet the limits and the rules."""
        rows = self.table.offsets[:-1][None, :] + choices
        ok = np.ones(len(choices), dtype=bool)
        for limit, lower, upper in self.resolved:
            total = self.table.cost(limit.key)[rows].sum(axis=1)
            if upper is not None:
                ok &= total <= upper + 1e-6 * max(1.0, abs(upper))
            if lower is not None:
                ok &= total >= lower - 1e-6 * max(1.0, abs(lower))
        for attr in self.rules.shared_attributes():
            values = self.table.attrs.get(attr)
            if values is None:
                continue
            coded = np.array([-1 if v is None else v for v in values], dtype=np.int64)[rows]
            present = np.where(coded >= 0, coded, np.iinfo(np.int64).max)
            low = present.min(axis=1)
            high = np.where(coded >= 0, coded, -1).max(axis=1)
            ok &= (high < 0) | (low == high)
        return ok

    def score(self, choices: Sequence[int]) -> float:
        return float(self.table.score[self.table.offsets[:-1] + np.asarray(choices)].sum())

    def greedy(self) -> Arch | None:
        """Best of one greedy descent per shared state size (the rule holds at every step)."""
        states = self.table.attrs.get("state_size", [])
        values = sorted({v for v in states if v is not None}) or [None]
        best: tuple[float, list[int]] | None = None
        for state in values:
            found = self._descend(state)
            if found is not None and (best is None or self.score(found) < best[0]):
                best = (self.score(found), found)
        return None if best is None else _arch(best[1], self.candidates)

    def _descend(self, state: int | None) -> list[int] | None:
        table, cost = self.table, self.table.cost("active_params")
        states = table.attrs.get("state_size", [None] * table.num_variants)
        allowed = np.array([state is None or s is None or s == state for s in states])
        current = []
        for b in range(table.num_blocks):  # start from the least damaging allowed variant of each block
            rows = np.arange(table.offsets[b], table.offsets[b + 1])
            rows = rows[allowed[rows]]
            current.append(int(rows[np.argmin(table.score[rows])] - table.offsets[b]))
        while not self.feasible(np.array([current]))[0]:
            best = None
            for b in range(table.num_blocks):
                here = table.offsets[b] + current[b]
                for row in range(table.offsets[b], table.offsets[b + 1]):
                    saved = cost[here] - cost[row]
                    if not allowed[row] or saved <= 0:
                        continue
                    ratio = (table.score[row] - table.score[here]) / saved
                    if best is None or ratio < best[0]:
                        best = (ratio, b, int(row - table.offsets[b]))
            if best is None:
                return None
            current[best[1]] = best[2]
        return current

    def random(self, seed: int, draws: int = 20_000, rounds: int = 50) -> Arch | None:
        """A uniform draw among the feasible architectures (rejection sampling of the whole product)."""
        rng = np.random.default_rng(seed)
        sizes = np.diff(self.table.offsets)
        for _ in range(rounds):
            choices = rng.integers(0, sizes[None, :], size=(draws, len(sizes)))
            hits = np.flatnonzero(self.feasible(choices))
            if len(hits):
                return _arch(choices[hits[0]].tolist(), self.candidates)
        return None

    def homogeneous(self) -> tuple[Arch | None, int]:
        """The least predicted KL among one-shape-per-kind architectures that meet the budget, and how many
        such architectures there are."""
        parent = self.candidates.parent
        kinds: dict[str, list[int]] = {}
        for b, block in enumerate(parent.blocks):
            kinds.setdefault(block.kind, []).append(b)
        shapes: dict[str, list[BlockSpec]] = {}
        for kind, blocks in kinds.items():
            common = [
                s
                for s in self.candidates.variants[blocks[0]]
                if all(s in self.candidates.variants[b] for b in blocks)
            ]
            shapes[kind] = common
        best: tuple[float, list[int]] | None = None
        count = 0
        for combo in itertools.product(*shapes.values()):
            by_kind = dict(zip(shapes, combo))
            choices = [
                self.candidates.variants[b].index(by_kind[block.kind])
                for b, block in enumerate(parent.blocks)
            ]
            if not self.feasible(np.array([choices]))[0]:
                continue
            count += 1
            if best is None or self.score(choices) < best[0]:
                best = (self.score(choices), choices)
        return (None if best is None else _arch(best[1], self.candidates)), count


# ------------------------------------------------------------------------------------------ measurement


class PrunedLibrary(Library):
    """The library's variants as pruning initialises them (`puzzle.bld.default_init`), before any BLD."""

    def __init__(self, library: Library, init: Callable[[Variant], torch.nn.Module]) -> None:
        super().__init__(library.directory, library.parent, library.results, library.plan)
        self._init = init

    def load_mixer(self, variant: Variant, hidden_size: int, norm_eps: float = 1e-5) -> torch.nn.Module:
        return self._init(variant)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties), without scipy."""

    def ranks(values: Sequence[float]) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        order = np.argsort(values, kind="stable")
        out = np.empty(len(values))
        out[order] = np.arange(len(values), dtype=np.float64)
        for value in np.unique(values):
            tied = values == value
            out[tied] = out[tied].mean()
        return out

    if len(x) < 3:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    return float(np.corrcoef(rx, ry)[0, 1])


class Bench:
    """The run (up to its scores), the parent, the held-out batches, and the measurements made so far."""

    def __init__(self, run: Run, init_scores: bool = True) -> None:
        from puzzle.prune.importance import load_importance
        from puzzle.score import load_scores

        self.run = run
        self.parent = run.load_parent()
        self.spec: ModelSpec = self.parent.spec
        self.held_out = run.held_out_batches()
        self.library = read_library(run.layout.library)
        self.bld_scores = load_scores(run.layout.scores)
        self.init = default_init(self.parent, load_importance(run.layout.importance))
        self.pruned = PrunedLibrary(self.library, self.init)
        self.kl = run_candidates(run.layout, "kl", self.spec)
        self.lm = run_candidates(run.layout, "lm_loss_delta", self.spec)
        self.kl_of = self._lookup(self.kl)
        self.lm_of = self._lookup(self.lm)
        self.init_kl = self._init_candidates() if init_scores else None
        self.init_kl_of = self._lookup(self.init_kl) if self.init_kl is not None else {}
        self.measured: dict[tuple[Arch, str], dict[str, Any]] = {}
        self.parent_lm_loss: float | None = None

    @staticmethod
    def _lookup(candidates: RunCandidates) -> dict[tuple[int, BlockSpec], float]:
        return {
            (b, spec): value
            for b, (specs, values) in enumerate(zip(candidates.variants, candidates.scores))
            for spec, value in zip(specs, values)
        }

    def _init_candidates(self) -> RunCandidates:
        """Replace-one-block KL of the untrained (pruned) variants, scored as the run scores the library."""
        from puzzle.artifacts import fingerprint_json
        from puzzle.blocks import build_block
        from puzzle.score import score_variants

        directory = self.run.layout.root / "ablations" / "scores-pruned"
        usable = [v for v, r in self.library.results.items() if r.status != "failed"]
        hidden = self.spec.hidden_size

        def mixer(variant: Variant) -> torch.nn.Module | None:
            status = self.library.results[variant].status
            if status == "parent":
                return None
            if status == "noop":
                return build_block(variant.spec, hidden)
            return self.init(variant).to(dtype=self.parent.embeddings.weight.dtype)

        scores = score_variants(
            self.run.load_parent(),
            usable,
            mixer,
            self.held_out,
            directory,
            self.run.config.scoring,
            data_fingerprint=fingerprint_json(["pruned", self.library.parent, self.run.layout.root.name]),
        )
        values = [list(row) for row in self.kl.scores]
        for b, specs in enumerate(self.kl.variants):
            for j, spec in enumerate(specs):
                if j == 0:
                    continue
                record = scores.variants[Variant(b, spec)]
                values[b][j] = float(record.kl)
        return RunCandidates(self.spec, [list(s) for s in self.kl.variants], values)

    def predicted(self, arch: Arch, table: dict[tuple[int, BlockSpec], float]) -> float:
        return float(sum(table[(b, spec)] for b, spec in enumerate(arch)))

    def child(self, arch: Arch, weights: str) -> Any:
        library = self.library if weights == "bld" else self.pruned
        return assemble(dict(enumerate(arch)), library, self.parent)

    def measure(self, arch: Arch, weights: str) -> dict[str, Any]:
        key = (arch, weights)
        if key not in self.measured:
            child = self.child(arch, weights)
            vocab_chunk = self.run.config.scoring.vocab_chunk
            self.measured[key] = {"before": measured_kl(child, self.parent, self.held_out, vocab_chunk)}
        return self.measured[key]

    def distil(self, arch: Arch, weights: str, name: str) -> dict[str, Any]:
        """GKD of the child by the run's settings, measured again as before (cached on disk by `distill`)."""
        from puzzle.gkd import distill

        record = self.measure(arch, weights)
        if "after" not in record:
            child = self.child(arch, weights)
            directory = self.run.layout.root / "ablations" / "gkd" / name
            result = distill(
                child, self.parent, self.run.data.train, self.held_out, self.run.config.gkd, directory
            )
            vocab_chunk = self.run.config.scoring.vocab_chunk
            record["after"] = measured_kl(child.eval(), self.parent, self.held_out, vocab_chunk)
            record["gkd"] = {"steps": result.steps, "tokens": result.tokens}
            self.parent_lm_loss = result.last_eval.get("parent_lm_loss", self.parent_lm_loss)
        return record


def choose(bench: Bench, level: float, methods: Sequence[str], seeds: int) -> list[Choice]:
    """Every method's architecture at `level`."""
    out: list[Choice] = []
    kl = Problem(bench.run, bench.kl, level)
    for method in methods:
        if method == "puzzle":
            out.append(Choice(method, level, kl.mip()))
        elif method == "homogeneous":
            arch, count = kl.homogeneous()
            out.append(Choice(method, level, arch, note=f"best of {count} feasible one-shape-per-kind"))
        elif method == "greedy":
            out.append(Choice(method, level, kl.greedy()))
        elif method == "random":
            out += [Choice(method, level, kl.random(seed), seed=seed) for seed in range(seeds)]
        elif method == "mip_no_bld":
            if bench.init_kl is not None:
                arch = Problem(bench.run, bench.init_kl, level).mip()
                out.append(Choice(method, level, arch, weights="init", note="pruned variants' own scores"))
        elif method == "mip_lm_loss":
            out.append(Choice(method, level, Problem(bench.run, bench.lm, level).mip()))
        elif method == "no_state_axis":
            out.append(Choice(method, level, Problem(bench.run, restrict(bench.kl, same_state), level).mip()))
        elif method == "no_width_axis":
            out.append(Choice(method, level, Problem(bench.run, restrict(bench.kl, same_width), level).mip()))
        else:
            raise ValueError(f"unknown method {method!r}; methods: {', '.join(METHODS)}")
    return out


def row(bench: Bench, choice: Choice, gkd: bool) -> dict[str, Any]:
    """The JSON record of one method at one level: its architecture, costs, predictions and measurements."""
    from puzzle.cost.hardware import get_hardware
    from puzzle.cost.roofline import model_performance

    base = {
        "method": choice.method,
        "level": choice.level,
        "seed": choice.seed,
        "weights": choice.weights,
        "note": choice.note,
    }
    if choice.arch is None:
        return {**base, "feasible": False}
    spec = dataclasses.replace(bench.spec, blocks=choice.arch)
    cost_model = bench.run.cost_model()
    scenario = cost_model.scenarios["decode"]
    hardware = get_hardware(cost_model.hardware)
    speedup = (
        model_performance(bench.spec, scenario, hardware).decode_step_s
        / model_performance(spec, scenario, hardware).decode_step_s
    )
    active = model_active_params(spec)
    name = f"{choice.level:.2f}-{choice.method}" + ("" if choice.seed is None else f"-{choice.seed}")
    record = (
        bench.distil(choice.arch, choice.weights, name) if gkd else bench.measure(choice.arch, choice.weights)
    )
    return {
        **base,
        "feasible": True,
        "blocks": [block.short_name() for block in choice.arch],
        "changed": [i for i, (a, p) in enumerate(zip(choice.arch, bench.spec.blocks)) if a != p],
        "active_params": active,
        "active_fraction": active / model_active_params(bench.spec),
        "predicted_decode_speedup": speedup,
        "predicted_kl": bench.predicted(choice.arch, bench.kl_of),
        "predicted_lm_loss_delta": bench.predicted(choice.arch, bench.lm_of),
        "predicted_kl_pruned": bench.predicted(choice.arch, bench.init_kl_of) if bench.init_kl_of else None,
        "before": record["before"],
        "after": record.get("after"),
        "gkd": record.get("gkd"),
    }


# --------------------------------------------------------------------------------------------- the report


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Random seeds folded into mean and standard deviation; Spearman over the BLD-assembled children."""
    children = {}
    for r in rows:
        if r["feasible"] and r["weights"] == "bld":
            children[tuple(r["blocks"])] = (r["predicted_kl"], r["before"]["kl"])
    pairs = list(children.values())
    pruned = {
        tuple(r["blocks"]): (r["predicted_kl_pruned"], r["before"]["kl"])
        for r in rows
        if r["feasible"] and r["weights"] == "init"
    }
    return {
        "spearman_bld": spearman([p for p, _ in pairs], [m for _, m in pairs]),
        "children_bld": len(pairs),
        "spearman_pruned": spearman([p for p, _ in pruned.values()], [m for _, m in pruned.values()]),
        "children_pruned": len(pruned),
    }


def _fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def level_rows(rows: list[dict[str, Any]], level: float) -> list[dict[str, Any]]:
    """The rows of one level with the random seeds folded into one (mean, and std in `*_std`)."""
    here = [r for r in rows if r["level"] == level]
    out = [r for r in here if r["method"] != "random"]
    draws = [r for r in here if r["method"] == "random" and r["feasible"]]
    if draws:

        def stat(get: Callable[[dict], float]) -> tuple[float, float]:
            values = [get(r) for r in draws]
            return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0

        folded = {"method": "random", "level": level, "feasible": True, "seeds": len(draws), "weights": "bld"}
        for key, get in {
            "active_fraction": lambda r: r["active_fraction"],
            "predicted_kl": lambda r: r["predicted_kl"],
            "predicted_decode_speedup": lambda r: r["predicted_decode_speedup"],
            "kl": lambda r: r["before"]["kl"],
            "lm_loss_delta": lambda r: r["before"]["lm_loss_delta"],
            "top1": lambda r: r["before"]["top1"],
        }.items():
            folded[key], folded[key + "_std"] = stat(get)
        index = next(i for i, r in enumerate(out) if r["method"] not in ("puzzle", "homogeneous", "greedy"))
        out.insert(index, folded)
    return out


def markdown(data: dict[str, Any]) -> str:
    rows, meta, summary = data["rows"], data["meta"], data["summary"]
    lines = [
        "# Results: Puzzle against the alternatives at equal budget",
        "",
        "Reproduce (writes this file, docs/results_kl.png and benchmarks/results/ablations.json):",
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"Parent: {meta['parent']} ({meta['parent_blocks']}; {meta['parent_active_params']:,} active parameters, "
        f"held-out LM loss {_fmt(meta.get('parent_lm_loss'), 3)} nats/token). Library: {meta['variants']} "
        f"variants over the space `{json.dumps(meta['space'])}`, trained by BLD on {meta['bld_tokens']:,} tokens "
        f"each; replace-one-block scores and every measurement on the same {meta['held_out_tokens']:,} held-out "
        f"tokens (the parent never trained on them). GKD: {meta['gkd_tokens']:,} tokens per child, the same "
        f"settings for every method. Budget at each level: active parameters <= the fraction x the parent's; the "
        f"predicted decode speed-up (cost model on this machine, batch 1) is reported, not bounded. "
        f"Whole benchmark: {meta['seconds']:.0f} s on {meta['machine']}.",
        "",
        "Methods: **puzzle** = MIP over the BLD library with KL scores; **homogeneous** = one shape per block "
        "kind everywhere (Minitron-style; chosen by least predicted KL among all such combinations that meet "
        "the budget, BLD weights); **greedy** = from the parent, the swap with least KL increase per active "
        "parameter saved until the budget holds; **random** = uniform feasible architecture of the library, "
        f"mean ± std over {meta['seeds']} seeds; **mip_no_bld** = MIP over the pruned, untrained variants, "
        "scored and assembled untrained; **mip_lm_loss** = MIP with LM-loss scores; **no_state_axis** / "
        "**no_width_axis** = MIP without Mamba state-size / MoE expert-width variants.",
        "",
        "Columns: KL = mean KL(parent || child) in nats/token on held-out text; ΔLM = child's minus parent's LM "
        "loss (nats/token); top-1 = agreement with the parent's top token; *pred.* = the search's summed "
        "replace-one-block KL; *after GKD* where distilled.",
        "",
    ]
    for level in meta["levels"]:
        lines += [
            f"## {level:.0%} of the parent's active parameters",
            "",
            "| method | active | decode speed-up (pred.) | KL pred. | KL | ΔLM | top-1 | KL after GKD | ΔLM after | top-1 after | changed blocks |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in level_rows(rows, level):
            if not r["feasible"]:
                lines.append(f"| {r['method']} | infeasible | | | | | | | | | |")
                continue
            if r["method"] == "random":
                lines.append(
                    f"| random (n={r['seeds']}) | {r['active_fraction']:.1%} ± {r['active_fraction_std']:.1%} "
                    f"| {r['predicted_decode_speedup']:.2f}x | {_fmt(r['predicted_kl'])} "
                    f"| {_fmt(r['kl'])} ± {_fmt(r['kl_std'])} | {_fmt(r['lm_loss_delta'])} ± {_fmt(r['lm_loss_delta_std'])} "
                    f"| {r['top1']:.1%} ± {r['top1_std']:.1%} | - | - | - | - |"
                )
                continue
            before, after = r["before"], r.get("after") or {}
            changed = ", ".join(f"{i}:{r['blocks'][i]}" for i in r["changed"]) or "none"
            lines.append(
                f"| {r['method']} | {r['active_fraction']:.1%} | {r['predicted_decode_speedup']:.2f}x "
                f"| {_fmt(r['predicted_kl'] if r['weights'] == 'bld' else r['predicted_kl_pruned'])} "
                f"| {_fmt(before['kl'])} | {_fmt(before['lm_loss_delta'])} | {before['top1']:.1%} "
                f"| {_fmt(after.get('kl'))} | {_fmt(after.get('lm_loss_delta'))} "
                f"| {'-' if 'top1' not in after else format(after['top1'], '.1%')} | {changed} |"
            )
        lines.append("")
    lines += [
        "## How additive are the scores",
        "",
        f"Spearman rank correlation of the predicted (summed replace-one-block) KL against the measured KL of "
        f"the assembled child, over all {summary['children_bld']} distinct BLD-assembled children of every "
        f"method and level: **{_fmt(summary['spearman_bld'], 3)}**"
        + (
            f" (the {summary['children_pruned']} children of mip_no_bld, their own pruned-variant scores: "
            f"{_fmt(summary['spearman_pruned'], 3)})."
            if summary["children_pruned"]
            else "."
        ),
        "",
        "![measured KL against active parameters](results_kl.png)",
        "",
    ]
    lines += data.get("findings", [])
    return "\n".join(lines) + "\n"


def findings(data: dict[str, Any]) -> list[str]:
    """Where Puzzle wins and loses against each method, level by level (measured KL before GKD, and after)."""
    rows = data["rows"]
    out = ["## Findings", ""]
    for level in data["meta"]["levels"]:
        here = {r["method"]: r for r in level_rows(rows, level) if r["feasible"]}
        puzzle = here.get("puzzle")
        if puzzle is None:
            out.append(f"- {level:.0%}: Puzzle infeasible.")
            continue
        p_kl = puzzle["before"]["kl"]
        parts = []
        for method, r in here.items():
            if method == "puzzle":
                continue
            kl = r["kl"] if method == "random" else r["before"]["kl"]
            parts.append(f"{method} {kl / p_kl:.2f}x")
        text = (
            f"- {level:.0%} ({1 - level:.0%} compression): measured KL of each method / Puzzle's: "
            + ", ".join(parts)
        )
        homo = here.get("homogeneous")
        if homo is not None and homo.get("after") and puzzle.get("after"):
            text += f"; after GKD, homogeneous / Puzzle {homo['after']['kl'] / puzzle['after']['kl']:.2f}x"
        greedy = here.get("greedy")
        if greedy is not None and greedy.get("after") and puzzle.get("after"):
            text += f", greedy / Puzzle {greedy['after']['kl'] / puzzle['after']['kl']:.2f}x"
        out.append(text + ".")
    out.append("")
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    rows, levels = data["rows"], data["meta"]["levels"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for method in methods:
        points = []
        for level in levels:
            for r in level_rows(rows, level):
                if r["method"] == method and r["feasible"]:
                    kl = r["kl"] if method == "random" else r["before"]["kl"]
                    err = r.get("kl_std", 0.0) if method == "random" else 0.0
                    points.append((r["active_fraction"], kl, err))
        if points:
            x, y, e = zip(*sorted(points))
            style = "-" if method in ("puzzle", "homogeneous", "greedy", "random") else "--"
            axes[0].errorbar(
                x, y, yerr=e if any(e) else None, marker="o", linestyle=style, label=method, capsize=3
            )
        after = [
            (r["active_fraction"], r["after"]["kl"])
            for r in rows
            if r["method"] == method and r["feasible"] and r.get("after")
        ]
        if after:
            x, y = zip(*sorted(after))
            axes[1].plot(x, y, marker="o", label=method)
    for ax, title in zip(axes, ("assembled (before GKD)", "after GKD")):
        ax.set_xlabel("active parameters / parent's")
        ax.set_ylabel("KL(parent || child), nats/token (held out)")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path.with_suffix(".tmp.png"), dpi=110)
    os.replace(path.with_suffix(".tmp.png"), path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- the run


def prepare(parent: Any, size: DemoSize, run_dir: Path, seed: int = 0) -> Run:
    """The demo's run config over `parent` with `size` (its space), run up to the scores (reused if done)."""
    data = demo_config(parent.path, parent.corpus.path, run_dir, size, seed)
    run = Run(run_dir, load_config_data(data))
    run.run(until="scores")
    return run


def ablate(
    run: Run,
    levels: Sequence[float] = LEVELS,
    methods: Sequence[str] = METHODS,
    gkd_methods: Sequence[str] = GKD_METHODS,
    seeds: int = 5,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every method at every level on the run's library (see the module docstring); the JSON's data."""
    bench = Bench(run, init_scores="mip_no_bld" in methods)
    rows = []
    for level in levels:
        for choice in choose(bench, level, methods, seeds):
            started = time.perf_counter()
            record = row(bench, choice, choice.method in gkd_methods)
            rows.append(record)
            if record["feasible"]:
                after = record.get("after") or {}
                log(
                    f"{level:.2f} {choice.method}{'' if choice.seed is None else f' seed {choice.seed}'}: "
                    f"active {record['active_fraction']:.3f}, KL pred {record['predicted_kl']:.4f} measured "
                    f"{record['before']['kl']:.4f}"
                    + (f" after GKD {after['kl']:.4f}" if after else "")
                    + f" ({time.perf_counter() - started:.1f} s)"
                )
            else:
                log(f"{level:.2f} {choice.method}: infeasible")
    parent_lm = bench.parent_lm_loss
    return {
        "rows": rows,
        "summary": summarize(rows),
        "parent": {
            "active_params": model_active_params(bench.spec),
            "blocks": [b.short_name() for b in bench.spec.blocks],
            "lm_loss": parent_lm,
        },
        "variants": sum(1 for r in bench.library.results.values() if r.status != "parent"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--full", action="store_true", help="the full demo parent and the demo's full sizes")
    group.add_argument("--quick", action="store_true", help="CI-sized smoke run (tiny token counts)")
    parser.add_argument(
        "--levels", type=float, nargs="+", help=f"fractions of active params (default {LEVELS})"
    )
    parser.add_argument(
        "--seeds", type=int, help="random architectures per level (default 5, 2 with --quick)"
    )
    parser.add_argument("--gkd", nargs="*", default=None, help=f"methods distilled (default {GKD_METHODS})")
    parser.add_argument(
        "--run-dir", type=Path, help="the cached run directory (default runs/ablations[-full|-quick])"
    )
    parser.add_argument("--cache", type=Path, help="the demo parent's cache (default puzzle.demo.parent's)")
    parser.add_argument("--output", type=Path, help="the JSON (default benchmarks/results/ablations.json)")
    parser.add_argument("--doc", type=Path, help="the Markdown (default docs/RESULTS.md; none with --quick)")
    parser.add_argument("--plot", type=Path, help="the PNG (default docs/results_kl.png; none with --quick)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)

    from puzzle.demo.parent import demo_parent

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("PUZZLE_PROGRESS", "0")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    suffix = "-full" if args.full else "-quick" if args.quick else ""
    size = dataclasses.replace(FULL, space=FULL_SPACE) if args.full else SMOKE if args.quick else DEFAULT
    levels = args.levels or ((0.7, 0.4) if args.quick else LEVELS)
    seeds = args.seeds or (2 if args.quick else 5)
    gkd = GKD_METHODS if args.gkd is None else tuple(args.gkd)
    run_dir = (args.run_dir or ROOT / "runs" / f"ablations{suffix}").absolute()
    results = HERE / "results" / ("quick" if args.quick else "")
    output = args.output or results / "ablations.json"
    doc = args.doc or (None if args.quick else ROOT / "docs" / "RESULTS.md")
    png = args.plot or (None if args.quick else (doc.parent if doc else ROOT / "docs") / "results_kl.png")

    parent = demo_parent(args.cache, quick=not args.full, progress=False)
    print(f"parent: {parent.path}", flush=True)
    run = prepare(parent, size, run_dir)
    print(f"run (up to the scores): {run_dir} ({time.perf_counter() - started:.0f} s)", flush=True)
    data = ablate(run, levels, METHODS, gkd, seeds)
    command = "python benchmarks/ablations.py" + (
        " --full" if args.full else " --quick" if args.quick else ""
    )
    data["parent"]["lm_loss"] = data["parent"]["lm_loss"] or parent.record.get("held_out_loss")
    data["meta"] = {
        "command": command,
        "parent": "the full demo parent" if args.full else "the quick demo parent",
        "parent_blocks": " ".join(data["parent"]["blocks"]),
        "parent_active_params": data["parent"]["active_params"],
        "parent_lm_loss": data["parent"]["lm_loss"],
        "variants": data["variants"],
        "space": size.space,
        "bld_tokens": size.bld_tokens,
        "held_out_tokens": size.held_out_tokens,
        "gkd_tokens": size.gkd_tokens,
        "levels": list(levels),
        "seeds": seeds,
        "gkd_methods": list(gkd),
        "seconds": time.perf_counter() - started,
        "machine": f"{platform.machine()} CPU, {args.threads} torch threads",
    }
    data["findings"] = findings(data)
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(output, (json.dumps(data, indent=2, default=str) + "\n").encode())
    print(f"wrote {output}")
    if png is not None:
        plot(data, png)
        print(f"wrote {png}")
    if doc is not None:
        atomic_write_bytes(doc, markdown(data).encode())
        print(f"wrote {doc}")
    print(
        f"Spearman (predicted vs measured KL, {data['summary']['children_bld']} children): "
        f"{data['summary']['spearman_bld']:.3f}; {data['meta']['seconds']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
