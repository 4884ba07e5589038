"""Ablations: Puzzle against the alternatives at equal budget on the demo parents -> docs/RESULTS*.md.

    python benchmarks/ablations.py              # the quick parent (seed 0), fine grid, four levels, 2 GKD seeds
    python benchmarks/ablations.py --parent deep --parent-seed 0   # the 20-block parent, the same work
    python benchmarks/ablations.py --additivity # rerank / context rounds / trust region at 40%, 20-block parent;
                                                # predictors' rankings (random walks), short-GKD re-ranking
    python benchmarks/ablations.py --replicate  # the full replication (REPLICATE_HOURS; results/replicate/)
    python benchmarks/ablations.py --full       # the full demo parent
    python benchmarks/ablations.py --quick      # CI-sized smoke run (tiny tokens, two levels, 2 seeds)
    python benchmarks/ablations.py --render     # the document and plot again from the JSON, nothing rerun

Parents (`load_parent`, cached as the demo caches its own): `quick`, the quick demo's spec trained 4x longer
than the demo's (QUICK_PARENT, ~164k tokens), with any `--parent-seed`; `deep`, 20 blocks (DEEP_PATTERN:
Mamba, MoE and attention mixed, hidden 64, ~246k tokens); `full`, the full demo parent. The space is the fine
grid by default (`ablation_stats.fine_space`: widths and state sizes at 0.875 ... 0.25 of the parent's and the
expert count, one axis at a time, so that uniform pruning meets each budget within about 1%); `--grid coarse`
is the earlier one-step-per-axis SPACE. Every reported KL is measured on a test split (`test_split`: whole
held-out files, `data.test_fraction`, that no stage read: not the scores, the search, re-ranking or GKD's
checkpoint choice); the additivity figures (predicted vs measured) use the scoring held-out. Each distilled
child is distilled once per GKD seed (`--gkd-seeds`, default 2; the replication: REPLICATE_GKD_SEEDS). The
analysis (`analysis`): each method's KL over Puzzle's on the same test batches per GKD seed with 95%
intervals (`ablation_stats.paired_ratio`) and over every seed with an interval over seeds and batches
together (`ablation_stats.hierarchical_ratio`: what "beyond the noise" rests on), each method at equal size
(its KL over Puzzle's KL-vs-size curve at the size it reached, and its own curve at the budget), the
compression where Puzzle starts to beat uniform pruning with a bootstrap interval over test batches and GKD
seeds, the Spearman within each level next to the pooled one, and budgets on total parameters (`params`)
beside active ones (`--total-params`, assembled only).

One run directory (`runs/ablations[-full|-quick]`, reused: a rerun only re-measures) holds the pipeline's
importance, BLD library and replace-one-block scores (`puzzle.run.Run` up to `scores`) over a space with
every axis (Mamba state and heads, MoE top-k, expert width and count, attention KV heads, no-op blocks).
At each budget (a fraction of the parent's active parameters) every method picks one variant per block
from that library:

- puzzle: the MIP (`puzzle.search`) over the BLD library with KL scores, as the `solutions` stage runs it;
- puzzle_rerank: the `solutions` stage itself with `search.rerank: {by: short_gkd}` (RERANK; `rerank_choice`):
  the MIP's k best, refilled greedy's and the best uniform pruning's children each distilled for a short GKD,
  the least KL after it kept; its record names the source that won and the cost in multiples of one full GKD
  (`rerank_cost`). It needs the run's config data (`ablate(config=)`);
- homogeneous: one shape per block kind in every block of that kind (Minitron-style uniform pruning; a
  no-op for every block of a kind counts as a shape), the combination with the least predicted KL that
  meets the budget (all combinations enumerated), BLD weights;
- greedy: from the parent, repeatedly take the block swap with the least KL increase per active parameter
  saved until the budget holds, then refill: repeatedly the upgrade with the most KL decrease per active
  parameter added that still meets the budget (once per shared Mamba state size, the best kept);
- greedy-norefill: the greedy descent alone, stopped at the first architecture that fits;
- random: a uniformly random architecture of the library that meets the budget (rejection sampling over
  the whole product), one per seed;
- mip_no_bld: the MIP over the variants straight from pruning (`puzzle.prune.init_child`, no BLD), scored
  by the same replace-one-block KL on the same held-out text, and assembled with those untrained weights;
- mip_lm_loss: the MIP with replace-one-block LM-loss increase scores instead of KL;
- no_state_axis / no_width_axis: the MIP without the Mamba state-size axis / without the MoE expert-width
  axis (variants that keep the parent's value only).

Every architecture is assembled (`puzzle.assemble`) and measured against the parent on the test split and
on the scoring held-out tokens (`puzzle.assemble.measured_kl`: KL, LM-loss increase, top-1 agreement); those
of `--gkd` methods are then distilled by the run's own GKD settings (`puzzle.gkd.distill`), once per GKD
seed, and measured again on the test split. The summed replace-one-block KL the search predicts is set
against the KL measured on the scoring held-out of every BLD-assembled child (Spearman rank correlation,
numpy ranks; pooled and within each level). Output: the JSON (benchmarks/results/ablations.json), the table
per level and the plot (docs/RESULTS-quick.md, docs/results_kl.png); `--replicate` writes every parent's under
benchmarks/results/replicate/, which docs/RESULTS.md summarises.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from puzzle.assemble import assemble, measured_kl
from puzzle.baselines import RANDOM_BAND, Arch, Baselines, restrict, same_state, same_width
from puzzle.bld import default_init
from puzzle.config.run import load_config_data
from puzzle.cost.analytic import model_active_params, model_params
from puzzle.demo.parent import FULL_SETTINGS, QUICK_SETTINGS, TrainSettings
from puzzle.demo.pipeline import FULL, QUICK, DemoSize, demo_config
from puzzle.files import atomic_write_bytes
from puzzle.library import Library, read_library
from puzzle.presets.demo import demo_parent_spec, demo_quick_parent_spec, demo_spec
from puzzle.problem import RunCandidates, RunProblem, run_candidates, run_problem
from puzzle.run import Run
from puzzle.spec import BlockSpec, ModelSpec, Variant

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from ablation_stats import (  # noqa: E402  (a sibling module)
    REACH,
    bootstrap_crossover,
    fine_space,
    hierarchical_ratio,
    interpolate,
    paired_ratio,
    spearman,
    uniform_fractions,
    within_level_spearman,
)

__all__ = ["fine_space", "interpolate", "paired_ratio", "spearman", "uniform_fractions"]

LEVELS = (0.85, 0.70, 0.55, 0.40)
METHODS = (
    "puzzle",
    "puzzle_rerank",
    "homogeneous",
    "homogeneous_width",
    "greedy",
    "greedy-norefill",
    "random",
    "mip_no_bld",
    "mip_lm_loss",
    "no_state_axis",
    "no_width_axis",
)
GKD_METHODS = tuple(m for m in METHODS if m != "greedy-norefill")  # the weaker greedy: assembled only
# puzzle_rerank's `search.rerank` (`rerank_choice`): the settings a run's config would give it.
RERANK = {"by": "short_gkd", "tokens": 0.25, "candidates": 5}
# Every axis the ablations take away exists in this space (Mamba state, MoE expert width), besides heads,
# top-k, expert count and no-op blocks.
SPACE = {
    "mamba": {"state_size": [8], "num_heads": [2], "noop": True},
    "moe": {"top_k": [1], "expert_width_fraction": [0.5], "num_experts": [4], "noop": True},
    "attention": {"num_kv_heads": [1], "noop": True},
}
DEFAULT = dataclasses.replace(QUICK, space=SPACE)
# The share of the parent's held-out files (the demo's 5%) that make the test split: on this Python's stdlib 16
# files (380k tokens) for the test split and 21 (373k) for the scoring held-out.
TEST_SHARE = 0.5
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


@dataclass
class Choice:
    """One method's architecture at one level (None: the method found none that meets the budget)."""

    method: str
    level: float
    arch: Arch | None
    weights: str = "bld"  # "bld": the library's trained mixers; "init": pruning's, untrained
    seed: int | None = None
    note: str = ""
    rerank: dict[str, Any] | None = None  # puzzle_rerank: the solutions stage's record of its re-ranking


class Problem(Baselines):
    """One level's search problem over a set of candidates: the table, limits and rules of the run's search,
    and the baselines over it (`puzzle.baselines.Baselines`: greedy, random, random walk, uniform)."""

    def __init__(
        self,
        run: Run,
        candidates: RunCandidates,
        level: float,
        speedup: float | None = None,
        budget: str = "active_params",
        limit: str | None = None,
    ) -> None:
        """`limit`: the budget's own text instead of `{budget}<={level}x` (an absolute one, for candidates
        without the parent's own block, whose relative totals would be another model's)."""
        budgets = [limit or f"{budget}<={level}x"]
        if speedup is not None:  # predicted decode tokens/s at least `speedup` x the parent's
            budgets.append(f"throughput[decode]>={speedup}x")
        self.run_problem: RunProblem = run_problem(
            run.layout,
            budgets,
            cost_model=run.cost_model(),
            shared_state_size=run.config.search.shared_state_size,
            candidates=candidates,
        )
        super().__init__(self.run_problem, budget, level)

    def homogeneous(self, noop: bool = True) -> tuple[Arch | None, int]:
        """Uniform pruning (`Baselines.uniform`), under the name the pages and their JSON use."""
        return self.uniform(noop)


# ------------------------------------------------------------------------------------------ measurement


class PrunedLibrary(Library):
    """The library's variants as pruning initialises them (`puzzle.bld.default_init`), before any BLD."""

    def __init__(self, library: Library, init: Callable[[Variant], torch.nn.Module]) -> None:
        super().__init__(library.directory, library.parent, library.results, library.plan)
        self._init = init

    def load_mixer(self, variant: Variant, hidden_size: int, norm_eps: float = 1e-5) -> torch.nn.Module:
        return self._init(variant)


def test_split(run: Run, tokens: int) -> list[torch.Tensor]:
    """The test split: batches of the run's test documents (`data.test_fraction`, `puzzle.data.TokenData.test`:
    held-out files that neither the parent's training nor any stage of the run reads: not the scores, the
    search, GKD's evaluations or its best-checkpoint choice), up to `tokens`, in the seeded order of one epoch.
    Used only to report numbers, so that no choice has seen them. Raises ValueError when the run has no test
    split or too few test tokens for one batch."""
    settings = run.config.data
    split = run.data.test
    if split is None:
        raise ValueError(
            f"no test split in the data of {settings.sources}: data.test_fraction is 0; set it (below "
            f"data.held_out_fraction = {settings.held_out_fraction}) to report on held-out files no stage reads"
        )
    per_batch = settings.eval_batch_size * split.seq_len
    wanted = min(len(split) // settings.eval_batch_size, math.ceil(tokens / per_batch))
    if wanted < 1:
        raise ValueError(
            f"no test batch in the test split of {settings.sources}: its {len(split)} sequences of "
            f"{split.seq_len} (data.test_fraction = {settings.test_fraction}) make no batch of "
            f"{settings.eval_batch_size}; raise data.test_fraction"
        )
    stream = split.batches(settings.eval_batch_size, run.config.seed, rank=0, world=1, epochs=1)
    return [batch for _, batch in zip(range(wanted), stream)]


def measure_batches(
    child: Any, parent: Any, batches: Sequence[torch.Tensor], vocab_chunk: int
) -> dict[str, Any]:
    """`measured_kl` on each batch: the token-weighted means (as one call over all would give) and the KL of
    each batch (`kl_batches`, for paired intervals and the bootstrap)."""
    per = [measured_kl(child, parent, [batch], vocab_chunk) for batch in batches]
    tokens = sum(p["tokens"] for p in per)
    out: dict[str, Any] = {m: sum(p[m] * p["tokens"] for p in per) / tokens for m in METRICS}
    out["tokens"] = tokens
    out["kl_batches"] = [p["kl"] for p in per]
    return out


class Bench:
    """The run (up to its scores), the parent, the held-out batches, and the measurements made so far."""

    def __init__(
        self,
        run: Run,
        init_scores: bool = True,
        test_tokens: int = 0,
        config: dict[str, Any] | None = None,
    ) -> None:
        """`test_tokens`: the size of the test split (`test_split`) the reported numbers are measured on;
        0: none, they are measured on the scoring held-out (as before the split existed). `config`: the run's
        config data (`prepare_config`), which puzzle_rerank runs the solutions stage with."""
        from puzzle.prune.importance import load_importance
        from puzzle.score import load_scores

        self.run = run
        self.config = config
        self.parent = run.load_parent()
        self.spec: ModelSpec = self.parent.spec
        self.held_out = run.held_out_batches()
        self.test = test_split(run, test_tokens) if test_tokens else None
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
        self.gkd_seconds: list[float] = []  # the wall time of each full GKD trained here (not reused)
        self.parent_lm_loss: float | None = None
        self._decode: tuple[Any, Any, float] | None = None  # scenario, hardware, parent's step (s)

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

    def _measured(self, child: Any) -> dict[str, Any]:
        """The reported measurement: on the test split when there is one (per batch), else the held-out."""
        chunk = self.run.config.scoring.vocab_chunk
        if self.test is None:
            return measured_kl(child, self.parent, self.held_out, chunk)
        return measure_batches(child, self.parent, self.test, chunk)

    def measure(self, arch: Arch, weights: str, child: Any = None) -> dict[str, Any]:
        """The child's measurements before GKD (cached per architecture); `child`: it, already assembled.
        "before": reported (test split); "scoring": on the scoring held-out, the tokens the scores were
        computed on (what the additivity of the scores is judged on)."""
        key = (arch, weights)
        if key not in self.measured:
            child = child if child is not None else self.child(arch, weights)
            record = {"before": self._measured(child)}
            chunk = self.run.config.scoring.vocab_chunk
            record["scoring"] = (
                record["before"]
                if self.test is None
                else measured_kl(child, self.parent, self.held_out, chunk)
            )
            self.measured[key] = record
        return self.measured[key]

    def distil(self, arch: Arch, weights: str, name: str, seeds: Sequence[int] = (0,)) -> dict[str, Any]:
        """GKD of the child by the run's settings once per GKD seed (`gkd.seed`), each measured as before
        (cached on disk by `distill`): "after" the first seed's, "after_seeds" [one per seed]."""
        from puzzle.gkd import WEIGHTS_FILE, distill

        record = self.measure(arch, weights)
        done = record.setdefault("after_by_seed", {})
        for seed in seeds:
            if seed in done:
                continue
            child = self.child(arch, weights)
            settings = dataclasses.replace(self.run.config.gkd, seed=self.run.config.gkd.seed + seed)
            directory = (
                self.run.layout.root / "ablations" / "gkd" / (name if seed == 0 else f"{name}-g{seed}")
            )
            reused = (directory / WEIGHTS_FILE).is_file()  # a finished GKD's output: loaded, not trained
            started = time.perf_counter()
            result = distill(child, self.parent, self.run.data.train, self.held_out, settings, directory)
            seconds = None if reused else time.perf_counter() - started
            if seconds is not None:
                self.gkd_seconds.append(seconds)
            done[seed] = {
                **self._measured(child.eval()),
                "gkd": {
                    "seed": settings.seed,
                    "steps": result.steps,
                    "tokens": result.tokens,
                    "kept_step": getattr(result, "kept_step", None),
                    "seconds": seconds,  # None: a finished GKD of an earlier run reused
                },
            }
            self.parent_lm_loss = result.last_eval.get("parent_lm_loss", self.parent_lm_loss)
        record["after"] = done[seeds[0]]
        record["after_seeds"] = [done[seed] for seed in seeds]
        record["gkd"] = done[seeds[0]]["gkd"]
        return record

    def short_gkd(self, arch: Arch, name: str, fraction: float) -> dict[str, Any]:
        """{"kl", "tokens"}: the child's KL on the scoring held-out after a short GKD, and the tokens it trained
        on (`fraction` of the run's token budget, at least one optimiser step, the first GKD seed; cached on
        disk by `distill` and here): what a search could measure of each candidate before choosing, to predict
        its KL after the full GKD."""
        from puzzle.gkd import distill
        from puzzle.rerank import short_gkd_settings

        record = self.measure(arch, "bld")
        if fraction not in record.setdefault("short_gkd", {}):
            child = self.child(arch, "bld")
            # The settings `search.rerank: {by: short_gkd, tokens: fraction}` distils its candidates with.
            settings = short_gkd_settings(self.run.config.gkd, fraction, self.run.config.data.seq_len)
            directory = self.run.layout.root / "ablations" / "gkd-short" / f"{name}-{fraction:g}"
            result = distill(child, self.parent, self.run.data.train, self.held_out, settings, directory)
            chunk = self.run.config.scoring.vocab_chunk
            record["short_gkd"][fraction] = {
                "kl": measured_kl(child.eval(), self.parent, self.held_out, chunk)["kl"],
                "tokens": result.tokens,
            }
        return record["short_gkd"][fraction]

    def predicted_speedup(self, spec: ModelSpec) -> float:
        """The cost model's decode step time of the parent over that of `spec` (the run's decode scenario)."""
        from puzzle.cost.hardware import get_hardware
        from puzzle.cost.roofline import model_performance

        if self._decode is None:
            cost_model = self.run.cost_model()
            scenario, hardware = cost_model.scenarios["decode"], get_hardware(cost_model.profile)
            parent_s = model_performance(self.spec, scenario, hardware).decode_step_s
            self._decode = (scenario, hardware, parent_s)
        scenario, hardware, parent_s = self._decode
        return parent_s / model_performance(spec, scenario, hardware).decode_step_s


def choose(
    bench: Bench,
    level: float,
    methods: Sequence[str],
    seeds: int,
    speedup: float | None = None,
    budget: str = "active_params",
) -> list[Choice]:
    """Every method's architecture at `level` of the parent's `budget` (active_params or params, total) and
    the decode `speedup` bound, if any."""
    out: list[Choice] = []

    def problem(candidates: RunCandidates) -> Problem:
        return Problem(bench.run, candidates, level, speedup, budget)

    kl = problem(bench.kl)
    for method in methods:
        if method == "puzzle":
            out.append(Choice(method, level, kl.mip()))
        elif method == "puzzle_rerank":
            if speedup is not None or budget != "active_params":
                raise ValueError(
                    f"puzzle_rerank at {level:g}: it runs the solutions stage at active_params<={level:g}x "
                    f"alone, not with budget {budget} and speed-up {speedup}"
                )
            out.append(rerank_choice(bench, level))
        elif method == "homogeneous":
            arch, count = kl.homogeneous()
            out.append(Choice(method, level, arch, note=f"best of {count} feasible one-shape-per-kind"))
        elif method == "homogeneous_width":
            arch, count = kl.homogeneous(noop=False)
            out.append(Choice(method, level, arch, note=f"best of {count} feasible, no kind removed"))
        elif method == "greedy":
            out.append(Choice(method, level, kl.greedy()))
        elif method == "greedy-norefill":
            out.append(Choice(method, level, kl.greedy(refill=False)))
        elif method == "random":
            out += [Choice(method, level, kl.random(seed), seed=seed) for seed in range(seeds)]
        elif method == "mip_no_bld":
            if bench.init_kl is not None:
                arch = problem(bench.init_kl).mip()
                out.append(Choice(method, level, arch, weights="init", note="pruned variants' own scores"))
        elif method == "mip_lm_loss":
            out.append(Choice(method, level, problem(bench.lm).mip()))
        elif method == "no_state_axis":
            out.append(Choice(method, level, problem(restrict(bench.kl, same_state)).mip()))
        elif method == "no_width_axis":
            out.append(Choice(method, level, problem(restrict(bench.kl, same_width)).mip()))
        else:
            raise ValueError(f"unknown method {method!r}; methods: {', '.join(METHODS)}")
    return out


def rerank_choice(bench: Bench, level: float, rerank: dict[str, Any] | None = None) -> Choice:
    """puzzle_rerank at `level`: the child a real run keeps with `search.rerank` (`rerank`, default RERANK),
    by the pipeline's own solutions stage over the bench's run (`puzzle.run.rerank.short_gkd_rerank`: the
    MIP's k best, refilled greedy's and the best uniform pruning's children at the budget, each distilled
    for the short GKD and the least KL after it kept; the earlier stages reused, each candidate's short GKD
    cached under solutions/rerank/). The choice's `rerank`: the stage's record (the candidates, their
    sources, predictions and short-GKD KL, the winner's sources) with the stage's wall `seconds` and the
    short GKDs' `short_tokens` in all. Raises ValueError without the run's config data (`Bench(config=)`)."""
    if bench.config is None:
        raise ValueError(
            "puzzle_rerank needs the run's config data to run its solutions stage: give Bench / ablate "
            "`config` (prepare_config's second value)"
        )
    settings = {**RERANK, **(rerank or {})}
    staged = Run(
        bench.run.layout.root, load_config_data(_option_config(bench.config, level, {"rerank": settings}))
    )
    started = time.perf_counter()
    outputs = staged.record("solutions")
    seconds = time.perf_counter() - started
    label, entry = next(iter(outputs.items()))
    record = entry.get("rerank")
    if not record or record.get("by") != "short_gkd":
        raise ValueError(
            f"the solutions stage at {level:g} kept no short-GKD re-ranking: its record is {record!r}"
        )
    winner = record["candidates"][record["chosen"] - 1]
    record = {
        **record,
        "settings": settings,
        "seconds": seconds,
        "short_tokens": sum(c["tokens"] for c in record["candidates"]),
    }
    note = (
        f"short-GKD pick {record['chosen']} of {len(record['candidates'])} ({', '.join(winner['sources'])})"
    )
    return Choice("puzzle_rerank", level, _solution_arch(staged, label, entry), note=note, rerank=record)


def rerank_cost(
    rerank: dict[str, Any], gkd: dict[str, Any] | None, gkd_seconds: Sequence[float]
) -> dict[str, Any]:
    """The re-ranking's cost in multiples of one full GKD: the short GKDs' tokens over the full GKD's of its
    pick (`gkd`: that GKD's record, first seed), and their seconds (each candidate's as the run timed it;
    where a record has none, the solutions stage's, which also holds its MIP solves and frontier sweep) over
    the median of `gkd_seconds` (the full GKDs trained here at the same level; None without one)."""
    tokens = gkd.get("tokens") if gkd else None
    timed = [c.get("seconds") for c in rerank["candidates"]]
    each = all(t is not None for t in timed)
    seconds = sum(timed) if each else rerank["seconds"]
    full = statistics.median(gkd_seconds) if gkd_seconds else None
    return {
        "short_tokens": rerank["short_tokens"],
        "full_tokens": tokens,
        "tokens_multiple": rerank["short_tokens"] / tokens if tokens else None,
        "seconds": seconds,
        "seconds_of": "short GKDs" if each else "solutions stage",
        "full_seconds": full,
        "full_gkds_timed": len(gkd_seconds),
        "seconds_multiple": seconds / full if full else None,
    }


def row(
    bench: Bench,
    choice: Choice,
    gkd: bool,
    tag: str = "",
    gkd_seeds: Sequence[int] = (0,),
    budget: str = "active_params",
) -> dict[str, Any]:
    """The JSON record of one method at one level: its architecture, costs, predictions and measurements
    ("before"/"after": reported, on the test split if any; "scoring": on the scoring held-out; "after_seeds":
    one per GKD seed)."""
    base = {
        "method": choice.method,
        "budget": budget,
        "level": choice.level,
        "seed": choice.seed,
        "weights": choice.weights,
        "note": choice.note,
    }
    if choice.arch is None:
        return {**base, "feasible": False}
    spec = dataclasses.replace(bench.spec, blocks=choice.arch)
    speedup = bench.predicted_speedup(spec)
    active = model_active_params(spec)
    name = f"{choice.level:.2f}{tag}-{choice.method}" + ("" if choice.seed is None else f"-{choice.seed}")
    record = (
        bench.distil(choice.arch, choice.weights, name, gkd_seeds)
        if gkd
        else bench.measure(choice.arch, choice.weights)
    )
    return {
        **base,
        "feasible": True,
        "blocks": [block.short_name() for block in choice.arch],
        "active_params": active,
        "active_fraction": active / model_active_params(bench.spec),
        "params_fraction": model_params(spec) / model_params(bench.spec),
        "predicted_decode_speedup": speedup,
        "predicted_kl": bench.predicted(choice.arch, bench.kl_of),
        "predicted_lm_loss_delta": bench.predicted(choice.arch, bench.lm_of),
        "predicted_kl_pruned": bench.predicted(choice.arch, bench.init_kl_of) if bench.init_kl_of else None,
        "before": record["before"],
        "scoring": record["scoring"],
        "after": record.get("after"),
        "after_seeds": record.get("after_seeds"),
        "gkd": record.get("gkd"),
        **({} if choice.rerank is None else {"rerank": choice.rerank}),
    }


# --------------------------------------------------------------------------------------------- the report


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How well the summed scores predict the measured KL: Spearman over the distinct BLD-assembled children
    (and over the pruned ones against their own scores), Pearson of the logs, the measured / predicted ratios."""
    children = {}
    by_level: dict[float, dict[tuple[str, ...], tuple[float, float]]] = {}
    for r in rows:
        if r["feasible"] and r["weights"] == "bld":
            measured = (r.get("scoring") or r["before"])["kl"]  # on the tokens the scores were computed on
            children[tuple(r["blocks"])] = (r["predicted_kl"], measured)
            if r.get("budget", "active_params") == "active_params":
                by_level.setdefault(r["level"], {})[tuple(r["blocks"])] = (r["predicted_kl"], measured)
    pairs = list(children.values())
    pruned = {
        tuple(r["blocks"]): (r["predicted_kl_pruned"], r["before"]["kl"])
        for r in rows
        if r["feasible"] and r["weights"] == "init"
    }
    ratios = [m / p for p, m in pairs if p > 0]
    logs = np.log([[p, m] for p, m in pairs if p > 0 and m > 0]) if pairs else np.zeros((0, 2))
    return {
        "spearman_bld": spearman([p for p, _ in pairs], [m for _, m in pairs]),
        "spearman_within": {
            str(level): value
            for level, value in within_level_spearman(
                {lv: list(v.values()) for lv, v in by_level.items()}
            ).items()
        },
        "children_within": {str(level): len(v) for level, v in by_level.items()},
        "pearson_log_bld": float(np.corrcoef(logs.T)[0, 1]) if len(logs) > 2 else math.nan,
        "ratio_median": statistics.median(ratios) if ratios else math.nan,
        "ratio_min": min(ratios, default=math.nan),
        "ratio_max": max(ratios, default=math.nan),
        "children_bld": len(pairs),
        "spearman_pruned": spearman([p for p, _ in pruned.values()], [m for _, m in pruned.values()]),
        "children_pruned": len(pruned),
    }


def _fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def compact(name: str) -> str:
    """A block's short name in a few characters: `mamba:h4:p32:n8:...` -> M4n8, `moe:e8:k2:w32:...` -> E8k2w32,
    `attn:q4:kv1:...` -> A1 (KV heads), `noop` -> `-`."""
    parts = {part[0]: part[1:] for part in name.split(":")[1:] if part}
    if name.startswith("mamba:"):
        return f"M{parts['h']}n{parts['n']}"
    if name.startswith("moe:"):
        return f"E{parts['e']}k{parts['k']}w{parts['w']}"
    if name.startswith("attn:"):
        return f"A{name.split(':kv')[1].split(':')[0]}"
    return "-" if name == "noop" else name


METRICS = ("kl", "lm_loss_delta", "top1")


def level_rows(
    rows: list[dict[str, Any]], level: float, budget: str = "active_params"
) -> list[dict[str, Any]]:
    """The rows of one level of `budget` with the random seeds folded into one: means in `before` / `after`
    and the other fields, sample standard deviations in `*_std`."""
    here = [r for r in rows if r["level"] == level and r.get("budget", "active_params") == budget]
    out = [r for r in here if r["method"] != "random"]
    draws = [r for r in here if r["method"] == "random" and r["feasible"]]
    if not draws:
        return out

    def stat(values: list[float]) -> tuple[float, float]:
        return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    folded: dict[str, Any] = {
        "method": "random",
        "level": level,
        "feasible": True,
        "seeds": len(draws),
        "weights": "bld",
        "blocks": None,
    }
    for key in ("active_fraction", "params_fraction", "predicted_kl", "predicted_decode_speedup"):
        if all(key in r for r in draws):
            folded[key], folded[key + "_std"] = stat([r[key] for r in draws])
    for phase in ("before", "after"):
        if all(r.get(phase) for r in draws):
            pairs = {m: stat([r[phase][m] for r in draws]) for m in METRICS}
            folded[phase] = {m: mean for m, (mean, _) in pairs.items()}
            folded[phase + "_std"] = {m: std for m, (_, std) in pairs.items()}
    index = next(
        (
            i
            for i, r in enumerate(out)
            if r["method"] not in ("puzzle", "homogeneous", "homogeneous_width", "greedy")
        ),
        len(out),
    )
    out.insert(index, folded)
    return out


def _cell(r: dict[str, Any], phase: str, metric: str) -> str:
    values = r.get(phase)
    if not values:
        return "-"
    value = values[metric]
    text = f"{value:.1%}" if metric == "top1" else f"{value:.4f}"
    std = (r.get(phase + "_std") or {}).get(metric)
    if std is not None:
        text += f" ± {std:.1%}" if metric == "top1" else f" ± {std:.4f}"
    return text


def _level_title(meta: dict[str, Any], level: float) -> str:
    speedup = (meta.get("speedups") or {}).get(str(level))
    bound = f" and predicted decode speed-up >= {speedup}x" if speedup else ""
    return f"{level:.0%} of the parent's active parameters{bound} ({1 - level:.0%} compression)"


def summary_table(data: dict[str, Any], phase: str) -> list[str]:
    """Measured KL (nats/token) of every method at every level: one row per method, one column per level."""
    levels = data["meta"]["levels"]
    table = {level: {r["method"]: r for r in level_rows(data["rows"], level)} for level in levels}
    methods = list(dict.fromkeys(m for level in levels for m in table[level]))
    lines = [
        "| method | " + " | ".join(f"{level:.0%}" for level in levels) + " |",
        "|---|" + "---:|" * len(levels),
    ]
    for method in methods:
        cells = []
        for level in levels:
            r = table[level].get(method)
            if r is None or not r["feasible"]:
                cells.append("infeasible")
                continue
            cell = _cell(r, phase, "kl")
            best = min(
                (x[phase]["kl"] for x in table[level].values() if x["feasible"] and x.get(phase)),
                default=None,
            )
            if r.get(phase) and best is not None and r[phase]["kl"] == best:
                cell = f"**{cell}**"
            cells.append(cell)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def shown_command(command: str) -> str:
    """The command as a reader reruns it: without `--cache DIR` (where this machine keeps the demo parent,
    which is the same parent wherever it is cached)."""
    words = shlex.split(command)
    kept = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word == "--cache":
            skip = True
        elif not word.startswith("--cache="):
            kept.append(word)
    return shlex.join(kept)


def _shown_path(path: Path) -> str:
    """`path` relative to the repository when it lies inside it, else as given."""
    path = Path(path).absolute()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def markdown(
    data: dict[str, Any],
    json_path: Path | None = None,
    plot_path: Path | None = None,
    doc_path: Path | None = None,
) -> str:
    """The document: `json_path` and `plot_path` are where the JSON and the plot were written (named in the
    text; the plot is linked relative to `doc_path`'s folder). Defaults: the default run's files."""
    json_path = json_path or HERE / "results" / "ablations.json"
    plot_path = plot_path or ROOT / "docs" / "results_kl.png"
    doc_path = doc_path or ROOT / "docs" / "RESULTS-quick.md"
    link = os.path.relpath(Path(plot_path).absolute(), Path(doc_path).absolute().parent)
    rows, meta, summary = data["rows"], data["meta"], data["summary"]
    parent_arch = " ".join(compact(b) for b in data["parent"]["blocks"])
    bld = meta["bld"]
    lines = [
        "# Results: Puzzle against the alternatives at equal budget",
        "",
        f"Reproduce (writes this file, {_shown_path(plot_path)} and {_shown_path(json_path)}):",
        "",
        "```",
        shown_command(meta["command"]),
        "```",
        "",
        f"Parent: {meta['parent']}, `{parent_arch}` ({meta['parent_active_params']:,} active parameters, "
        f"held-out LM loss {_fmt(meta.get('parent_lm_loss'), 3)} nats/token). Block notation: `M<h>n<s>` = Mamba "
        "with h heads and state size s; `E<e>k<k>w<w>` = MoE with e routed experts, top-k, expert width w; "
        "`A<n>` = attention with n KV heads; `-` = block removed (no-op). "
        f"Library: {meta['variants']} variants over the space `{json.dumps(meta['space'])}` (every axis, "
        f"coupled), each trained by BLD on {meta['bld_tokens']:,} tokens (held-out normalised MSE after / before "
        f"BLD: median {bld['median_ratio']:.2f}, {bld['worse']} of {bld['trained']} variants worse after BLD). "
        f"Replace-one-block scores and every measurement on the same {meta['held_out_tokens']:,} held-out tokens "
        f"(the parent never trained on them). GKD: {meta['gkd_tokens']:,} tokens per child, the run's settings, "
        "the same for every method. Budget at each level: active parameters <= the fraction x the parent's"
        + (
            " and a predicted decode throughput bound (below)"
            if meta.get("speedups")
            else "; the predicted decode speed-up (cost model calibrated on this machine, batch 1) is reported, "
            "not bounded"
        )
        + f". This invocation: {meta['seconds']:.0f} s on {meta['machine']}"
        + _stages_text(meta.get("stages") or {})
        + ".",
        "",
        "Methods (all but mip_no_bld assemble the same BLD-trained library):",
        "",
        "- **puzzle**: the MIP over the BLD library with replace-one-block KL scores (the pipeline's search);",
        "- **puzzle_rerank**: the pipeline's search with `search.rerank: {by: short_gkd}`: the MIP's k best, "
        "refilled greedy's and the best uniform pruning's children each distilled by a short GKD, the least "
        'KL after it kept (section "Re-ranking by short GKD");',
        "- **homogeneous**: one shape per block kind in every block of that kind (Minitron-style uniform "
        "pruning; removing every block of a kind counts as a shape), the combination with the least predicted "
        "KL (the same scores) of all that meet the budget; **homogeneous_width**: the same without removing a "
        "kind (width pruning only);",
        "- **greedy**: from the parent, repeatedly the one-block swap with the least KL increase per active "
        "parameter saved, until the budget holds, then refilled: the upgrade with the most KL decrease per "
        "active parameter added that still meets the budget, until none fits (one descent per shared Mamba "
        "state size, the best kept);",
        "- **greedy-norefill**: the descent alone, stopped at the first architecture that fits;",
        f"- **random**: a uniformly random architecture of the library that meets the budget and uses at least "
        f"(level - {RANDOM_BAND:.0%}) of the parent's active parameters, mean ± std over {meta['seeds']} seeds;",
        "- **mip_no_bld**: the MIP over the pruned variants before BLD (`init_child` from activation "
        "importance), scored by the same replace-one-block KL and assembled with those untrained weights;",
        "- **mip_lm_loss**: the MIP with replace-one-block LM-loss increase scores instead of KL;",
        "- **no_state_axis** / **no_width_axis**: the MIP without Mamba state-size variants / without MoE "
        "expert-width variants (those axes held at the parent's value).",
        "",
        "## Summary: measured KL to the parent (nats/token, held out), best per level in bold",
        "",
        "Assembled, before GKD:",
        "",
        *summary_table(data, "before"),
        "",
        "After the same GKD:",
        "",
        *summary_table(data, "after"),
        "",
        f"![measured KL against active parameters]({link})",
        "",
    ]
    lines += data.get("findings", [])
    lines += rerank_text(data)
    lines += evidence_sections(data)
    lines += caveats(meta)
    lines += [
        "## How additive are the scores",
        "",
        f"Spearman rank correlation of the predicted (summed replace-one-block) KL against the measured KL of "
        f"the assembled child, over all {summary['children_bld']} distinct BLD-assembled children of every "
        f"method and level: **{_fmt(summary['spearman_bld'], 3)}** (Pearson of the logs "
        f"{_fmt(summary['pearson_log_bld'], 3)}; measured / predicted KL: median {_fmt(summary['ratio_median'], 2)}, "
        f"range {_fmt(summary['ratio_min'], 2)} to {_fmt(summary['ratio_max'], 2)})"
        + (
            f"; the {summary['children_pruned']} mip_no_bld children against their own pruned-variant scores: "
            f"{_fmt(summary['spearman_pruned'], 3)}."
            if summary["children_pruned"]
            else "."
        ),
        "",
        *_within_text(summary),
        "## Per level",
        "",
        "KL and ΔLM (child's minus parent's LM loss) in nats/token, top-1 = agreement with the parent's top "
        "token, on held-out text; *pred.* = the summed replace-one-block KL of the BLD library (of the pruned "
        "variants for mip_no_bld).",
        "",
    ]
    for level in meta["levels"]:
        lines += [
            f"### {_level_title(meta, level)}",
            "",
            "| method | architecture | active | decode speed-up (pred.) | KL pred. | KL | ΔLM | top-1 "
            "| KL after GKD | ΔLM after | top-1 after |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in level_rows(rows, level):
            if not r["feasible"]:
                lines.append(f"| {r['method']} | infeasible | | | | | | | | | |")
                continue
            name = r["method"] + (f" (n={r['seeds']})" if r["method"] == "random" else "")
            arch = (
                "(various)" if r["blocks"] is None else "`" + " ".join(compact(b) for b in r["blocks"]) + "`"
            )
            active = f"{r['active_fraction']:.1%}"
            if "active_fraction_std" in r:
                active += f" ± {r['active_fraction_std']:.1%}"
            predicted = r["predicted_kl"] if r["weights"] == "bld" else r["predicted_kl_pruned"]
            lines.append(
                f"| {name} | {arch} | {active} | {r['predicted_decode_speedup']:.2f}x | {_fmt(predicted)} | "
                + " | ".join(_cell(r, phase, m) for phase in ("before", "after") for m in METRICS)
                + " |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def rerank_text(data: dict[str, Any]) -> list[str]:
    """puzzle_rerank's choice at each level as Markdown lines: every candidate with its sources, prediction,
    KL before and after the short GKD, the winner's source and the cost in multiples of one full GKD."""
    rows = [r for r in data["rows"] if r.get("rerank")]
    if not rows:
        return []
    settings = rows[0]["rerank"].get("settings", RERANK)
    lines = [
        "## Re-ranking by short GKD",
        "",
        f"puzzle_rerank is the solutions stage with `search.rerank: {json.dumps(settings)}`: each candidate "
        "distilled for that fraction of the GKD's tokens (first GKD seed), its KL measured on the scoring "
        "held-out (not the test split), the least kept and then distilled in full like every method. Cost: the "
        "short GKDs' tokens (and seconds) over one full GKD's (its pick's tokens; the median seconds of the full "
        "GKDs trained at the same level).",
        "",
        "| level | candidate | sources | KL pred. | KL before | KL after short GKD | kept |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        record = r["rerank"]
        for c in record["candidates"]:
            kept = "**kept**" if c["candidate"] == record["chosen"] else ""
            lines.append(
                f"| {r['level']:.0%} | {c['candidate']} | {', '.join(c['sources'])} | {c['predicted']:.4f} | "
                f"{c['kl_before']:.4f} | {c['short_gkd_kl']:.4f} | {kept} |"
            )
    lines += [
        "",
        "| level | won by | short-GKD tokens | x one full GKD (tokens) | seconds | x one full GKD (s) |",
    ]
    lines.append("|---|---|---:|---:|---:|---:|")
    for r in rows:
        cost = r.get("rerank_cost") or {}
        lines.append(
            f"| {r['level']:.0%} | {', '.join(r['rerank']['won_by'])} | {cost.get('short_tokens', 0):,} | "
            f"{_fmt(cost.get('tokens_multiple'), 2)} | {_fmt(cost.get('seconds'), 0)} ({cost.get('seconds_of', '-')}) | "
            f"{_fmt(cost.get('seconds_multiple'), 2)} |"
        )
    return [*lines, ""]


def _within_text(summary: dict[str, Any]) -> list[str]:
    """Spearman within each level next to the pooled figure, which compression inflates (both the predicted
    and the measured KL rise with it)."""
    within = summary.get("spearman_within") or {}
    if not within:
        return []
    counts = summary.get("children_within") or {}
    cells = ", ".join(
        f"{float(lv):.0%}: {_fmt(v, 2)} (n={counts.get(lv, '?')})"
        for lv, v in sorted(within.items(), reverse=True)
    )
    return [f"Within each level (distinct children of that level only): {cells}.", ""]


def _stages_text(stages: dict[str, Any]) -> str:
    if not stages:
        return ""
    parts = [f"{name} {entry['seconds']:.0f} s ({entry['status']})" for name, entry in stages.items()]
    return (
        "; the run's stages when computed: "
        + ", ".join(parts)
        + " (reused = found done in the run directory)"
    )


def caveats(meta: dict[str, Any]) -> list[str]:
    """What the figures do not show, for this run's settings."""
    bound = (
        "- Budgets bound active parameters and the cost model's predicted decode throughput (calibrated on this "
        "machine, batch 1); the measured throughput is not part of the budget."
        if meta.get("speedups")
        else "- Budgets bound active parameters only (decode speed-up is predicted and reported); `--speedup` adds "
        "a decode-throughput bound per level."
    )
    return [
        "## Caveats",
        "",
        f"- One BLD, one GKD ({meta['gkd_tokens']:,} tokens) and one held-out set per child, no repeats: the "
        "spread of a method's own result is not measured here, so differences of a few percent between "
        "methods (the MIP variants, greedy) are not significant evidence either way; the gaps of 1.3x and "
        "more are.",
        "- The replace-one-block scores and the measured KL use the same held-out tokens, so the rank "
        "correlation measures additivity, not generalisation of the scores.",
        "- Short BLD on a small parent: where BLD makes a variant worse than its pruned initialisation (counted "
        "above), the MIP without BLD can pick a better child; the library's BLD budget is the demo's.",
        bound,
        "",
    ]


def findings(data: dict[str, Any]) -> list[str]:
    """Each method's measured KL over Puzzle's, level by level, before and after GKD (> 1: Puzzle better)."""
    rows, levels = data["rows"], data["meta"]["levels"]
    out = [
        "## Each method's measured KL / Puzzle's (> 1: Puzzle better)",
        "",
        "| method | " + " | ".join(f"{level:.0%} before / after GKD" for level in levels) + " |",
        "|---|" + "---:|" * len(levels),
    ]
    table = {level: {r["method"]: r for r in level_rows(rows, level) if r["feasible"]} for level in levels}
    methods = list(dict.fromkeys(m for level in levels for m in table[level] if m != "puzzle"))
    for method in methods:
        cells = []
        for level in levels:
            puzzle, r = table[level].get("puzzle"), table[level].get(method)
            if puzzle is None or r is None:
                cells.append("-")
                continue
            ratios = [
                f"{r[phase]['kl'] / puzzle[phase]['kl']:.2f}" if r.get(phase) and puzzle.get(phase) else "-"
                for phase in ("before", "after")
            ]
            cells.append(" / ".join(ratios))
        out.append(f"| {method} | " + " | ".join(cells) + " |")
    out.append("")
    # The Puzzle-vs-uniform-pruning crossover (NVIDIA's Puzzle vs Minitron: between 20% and 38% compression).
    for phase, label in (("before", "assembled"), ("after", "after GKD")):
        wins, losses = [], []
        for level in levels:
            puzzle, homo = table[level].get("puzzle"), table[level].get("homogeneous")
            if puzzle and homo and puzzle.get(phase) and homo.get(phase):
                (wins if puzzle[phase]["kl"] < homo[phase]["kl"] else losses).append(f"{1 - level:.0%}")
        out.append(
            f"- Puzzle vs homogeneous ({label}): Puzzle lower KL at {', '.join(wins) or 'no level'} compression"
            + (f", homogeneous lower at {', '.join(losses)}" if losses else ": no crossover in this range")
            + "."
        )
    for phase, label in (("before", "assembled"), ("after", "after GKD")):
        beaten = []
        for level in levels:
            puzzle = table[level].get("puzzle")
            if not (puzzle and puzzle.get(phase)):
                continue
            better = [
                m
                for m, r in table[level].items()
                if m != "puzzle" and r.get(phase) and r[phase]["kl"] < puzzle[phase]["kl"]
            ]
            if better:
                beaten.append(f"{1 - level:.0%}: {', '.join(better)}")
        out.append(
            f"- Methods with lower measured KL than Puzzle ({label}): " + ("; ".join(beaten) or "none") + "."
        )
    out.append("")
    return out


PHASES = (("before", "assembled"), ("after", "after GKD"))


def _size_key(budget: str) -> str:
    return "active_fraction" if budget == "active_params" else "params_fraction"


def equal_size(data: dict[str, Any], budget: str = "active_params") -> dict[str, Any]:
    """Each method at equal size: its KL-vs-size curve (over the levels) interpolated at each budget, and its
    KL over Puzzle's curve interpolated at the size the method actually reached (> 1: Puzzle better at that
    size). {phase: {method: {level: {"size", "kl", "at_budget", "puzzle_at_size", "ratio_at_size"}}}}."""
    levels = data["meta"]["levels"]
    size = _size_key(budget)
    table = {
        lv: {r["method"]: r for r in level_rows(data["rows"], lv, budget) if r["feasible"]} for lv in levels
    }
    out: dict[str, Any] = {}
    for phase, _ in PHASES:
        curves: dict[str, list[tuple[float, float]]] = {}
        for lv in levels:
            for method, r in table[lv].items():
                if r.get(phase) and size in r:
                    curves.setdefault(method, []).append((r[size], r[phase]["kl"]))
        puzzle = curves.get("puzzle", [])
        out[phase] = {}
        for method, points in curves.items():
            entry = {}
            for lv in levels:
                r = table[lv].get(method)
                if r is None or not r.get(phase) or size not in r:
                    continue
                at_size = interpolate(puzzle, r[size], REACH)
                entry[str(lv)] = {
                    "size": r[size],
                    "kl": r[phase]["kl"],
                    "at_budget": interpolate(points, lv, REACH),
                    "puzzle_at_size": at_size,
                    "ratio_at_size": r[phase]["kl"] / at_size if at_size == at_size else math.nan,
                }
            out[phase][method] = entry
    return out


def paired_ratios(data: dict[str, Any]) -> dict[str, Any]:
    """Each method's test-split KL over Puzzle's at each level (active parameters), per GKD seed, with 95%
    intervals over the test batches (`paired_ratio`), and over the seeds and batches together
    (`over_seeds`): {method: {level: {"before": r, "after": [r per seed], "after_pooled": r}}}.
    Random architectures are left out (one draw per seed is not one method's child)."""
    out: dict[str, Any] = {}
    for lv in data["meta"]["levels"]:
        here = {
            r["method"]: r
            for r in data["rows"]
            if r["level"] == lv and r.get("budget", "active_params") == "active_params" and r["feasible"]
        }
        puzzle = here.get("puzzle")
        if puzzle is None or "kl_batches" not in puzzle["before"]:
            continue
        for method, r in here.items():
            if method in ("puzzle", "random") or "kl_batches" not in r["before"]:
                continue
            entry = {"before": paired_ratio(r["before"]["kl_batches"], puzzle["before"]["kl_batches"])}
            mine, theirs = r.get("after_seeds") or [], puzzle.get("after_seeds") or []
            entry["after"] = [paired_ratio(a["kl_batches"], b["kl_batches"]) for a, b in zip(mine, theirs)]
            pooled = over_seeds(mine, theirs)
            if pooled is not None:
                entry["after_pooled"] = pooled
            out.setdefault(method, {})[str(lv)] = entry
    return out


def over_seeds(mine: Sequence[dict[str, Any]], theirs: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """One method's test KL over another's after GKD over every GKD seed they share (`after_seeds` records,
    paired by seed index and test batch), with the hierarchical 95% interval (`hierarchical_ratio`: seeds,
    then batches, resampled); None without a seed in common."""
    pairs = list(zip(mine, theirs))
    if not pairs:
        return None
    return hierarchical_ratio([a["kl_batches"] for a, _ in pairs], [b["kl_batches"] for _, b in pairs])


def crossovers(data: dict[str, Any], other: str = "homogeneous", draws: int = 2000) -> dict[str, Any]:
    """Where Puzzle starts to beat `other` (uniform pruning) at equal size, before and after GKD, with 95%
    intervals from resampling the test batches and the GKD seeds (`bootstrap_crossover`)."""
    out: dict[str, Any] = {}
    levels = data["meta"]["levels"]
    for phase, _ in PHASES:
        curves: dict[str, dict[float, tuple[float, np.ndarray]]] = {"puzzle": {}, other: {}}
        for r in data["rows"]:
            if r.get("budget", "active_params") != "active_params" or not r["feasible"]:
                continue
            if r["method"] not in curves or not r.get(phase) or "kl_batches" not in r[phase]:
                continue
            seeds = r.get("after_seeds") if phase == "after" else None
            values = np.array([s["kl_batches"] for s in seeds] if seeds else [r[phase]["kl_batches"]])
            curves[r["method"]][r["level"]] = (r["active_fraction"], values)
        if len(curves["puzzle"]) >= 2 and len(curves[other]) >= 2:
            out[phase] = bootstrap_crossover(levels, curves["puzzle"], curves[other], draws=draws)
    return out


def analysis(data: dict[str, Any]) -> dict[str, Any]:
    """The replication's comparisons, from the rows: equal size (active and total parameters),
    paired ratios per GKD seed, the crossover against uniform pruning."""
    out = {
        "equal_size": equal_size(data),
        "paired": paired_ratios(data),
        "crossover": crossovers(data),
    }
    if any(r.get("budget") == "params" for r in data["rows"]):
        out["equal_size_params"] = equal_size(data, "params")
    return out


def _ratio_text(r: dict[str, float]) -> str:
    star = "*" if r["low"] > 1 or r["high"] < 1 else ""
    return f"{r['ratio']:.2f} [{r['low']:.2f}, {r['high']:.2f}]{star}"


def _compression_text(value: float, compressions: Sequence[float]) -> str:
    """A crossover (`ablation_stats.crossover`) in words: -inf, Puzzle lower at every compression measured;
    +inf, uniform pruning at least as good at the largest one."""
    if value == -math.inf:
        return f"<= {min(compressions):.0%} (Puzzle lower at every level)"
    if value == math.inf:
        return f"none (uniform as good or better at {max(compressions):.0%})"
    return "-" if value != value else f"{value:.1%}"


def evidence_sections(data: dict[str, Any]) -> list[str]:
    """The document's sections on equal size, paired ratios per seed, the crossover and the within-level
    Spearman (empty where the run did not measure per batch)."""
    found = data.get("analysis") or {}
    levels = data["meta"]["levels"]
    lines: list[str] = []
    paired = found.get("paired") or {}
    if paired:
        lines += [
            "## Paired ratios to Puzzle on the test split (> 1: Puzzle better)",
            "",
            "Each method's mean KL over Puzzle's on the same test batches, with a 95% interval (delta method, "
            "paired over batches); after GKD over every GKD seed, with a hierarchical bootstrap interval "
            "(seeds, then their batches, resampled; paired by seed and batch: `ablation_stats.hierarchical_ratio`), "
            "then one per seed (batches only), each method paired with Puzzle's child of the same seed. `*`: the "
            'interval excludes 1; after GKD, the one over the seeds is what "beyond the noise" rests on.',
            "",
            "| method | "
            + " | ".join(
                f"{lv:.0%} before | {lv:.0%} after GKD, over the seeds | {lv:.0%} after GKD, per seed"
                for lv in levels
            )
            + " |",
            "|---|" + "---:|---:|---:|" * len(levels),
        ]
        for method, by_level in paired.items():
            cells = []
            for lv in levels:
                entry = by_level.get(str(lv))
                if entry is None:
                    cells += ["-", "-", "-"]
                    continue
                cells.append(_ratio_text(entry["before"]))
                cells.append(_ratio_text(entry["after_pooled"]) if entry.get("after_pooled") else "-")
                cells.append("; ".join(_ratio_text(r) for r in entry["after"]) or "-")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    for key, title in (("equal_size", "active"), ("equal_size_params", "total")):
        table = (found.get(key) or {}).get("before")
        if not table:
            continue
        lines += [
            f"## Equal size ({title} parameters): KL / Puzzle's curve at the size the method reached",
            "",
            "Each method lands at its own size under a budget; Puzzle's KL-vs-size curve (piecewise linear in "
            "log KL over the levels, extended at most 3 points of size past its ends) is read at that size. > 1: Puzzle better at equal size. "
            "Cells: size reached, ratio before / after GKD; in brackets both curves read at the budget itself "
            "(before GKD; - where a curve does not reach it).",
            "",
            "| method | " + " | ".join(f"{lv:.0%}" for lv in levels) + " |",
            "|---|" + "---:|" * len(levels),
        ]
        after = (found.get(key) or {}).get("after") or {}
        for method, by_level in table.items():
            cells = []
            for lv in levels:
                b, a = by_level.get(str(lv)), (after.get(method) or {}).get(str(lv))
                if b is None:
                    cells.append("-")
                    continue
                ratio_after = _fmt(a["ratio_at_size"], 2) if a else "-"
                puzzle_budget = ((table.get("puzzle") or {}).get(str(lv)) or {}).get("at_budget", math.nan)
                at_budget = _fmt(b["at_budget"] / puzzle_budget, 2)
                cells.append(f"{b['size']:.1%}: {_fmt(b['ratio_at_size'], 2)} / {ratio_after} [{at_budget}]")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    cross = found.get("crossover") or {}
    if cross:
        lines += ["## Where Puzzle starts to beat uniform pruning (homogeneous), at equal size", ""]
        for phase, label in PHASES:
            c = cross.get(phase)
            if not c:
                continue
            comp = c["compressions"]
            lines.append(
                f"- {label}: crossover at {_compression_text(c['crossover'], comp)} compression, 95% interval "
                f"{_compression_text(c['low'], comp)} to {_compression_text(c['high'], comp)} ({c['draws']} "
                f"bootstrap draws over test batches and GKD seeds; {c['below_range']:.0%} of draws below the "
                f"least compression, {c['above_range']:.0%} with none in range)."
            )
        lines.append("")
    return lines


def plot(data: dict[str, Any], path: Path) -> None:
    """Measured KL against active parameters, one line per method, before and after GKD (after: only the
    methods the run distilled; another method's child that equals a distilled one is not drawn there)."""
    from matplotlib.figure import Figure  # no pyplot: the caller's plotting backend stays as it is

    fig = Figure(figsize=(13, 5))
    axes = fig.subplots(1, 2)
    levels = data["meta"]["levels"]
    folded = [r for level in levels for r in level_rows(data["rows"], level) if r["feasible"]]
    methods = list(dict.fromkeys(r["method"] for r in folded))
    distilled = set(data["meta"].get("gkd_methods", methods))
    for index, method in enumerate(methods):
        style = "-" if method in ("puzzle", "homogeneous", "homogeneous_width", "greedy", "random") else "--"
        width = 2.5 if method == "puzzle" else 1.2
        for ax, phase in zip(axes, ("before", "after")):
            if phase == "after" and method not in distilled:
                continue
            points = [
                (
                    r["active_fraction"],
                    r[phase]["kl"],
                    (r.get(phase + "_std") or {}).get("kl", 0.0),
                )
                for r in folded
                if r["method"] == method and r.get(phase)
            ]
            if not points:
                continue
            x, y, e = zip(*sorted(points))
            ax.errorbar(
                x,
                y,
                yerr=e if any(e) else None,
                marker="o",
                linestyle=style,
                linewidth=width,
                label=method,
                color=f"C{index}",
                capsize=3,
            )
    for ax, title in zip(axes, ("assembled (before GKD)", "after the same GKD")):
        ax.set_xlabel("active parameters / parent's")
        ax.set_ylabel("KL(parent || child), nats/token, held out")
        ax.set_yscale("log")
        ax.set_title(f"{data['meta']['parent']}: {title}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.stem + ".tmp.png")
    fig.savefig(staging, dpi=110)
    os.replace(staging, path)


# ---------------------------------------------------------------------------------------------- the run


def prepare(parent: Any, size: DemoSize, run_dir: Path, seed: int = 0) -> Run:
    """The demo's run config over `parent` with `size` (its space), run up to the scores (reused if done)."""
    return prepare_config(parent, size, run_dir, seed)[0]


def prepare_config(parent: Any, size: DemoSize, run_dir: Path, seed: int = 0) -> tuple[Run, dict[str, Any]]:
    """`prepare`, and the run's config data (what `additivity` varies)."""
    data = demo_config(parent.path, parent.corpus.path, run_dir, size, seed)
    # The ablations search their own space, no-op blocks included, as the published studies did: not held to
    # the engines the demo serves with (`puzzle.demo.pipeline.ENGINES`), which leaves no-op blocks out.
    data["search"].pop("engines", None)
    # The test split (`test_split`): a share of the parent's held-out files, out of every stage's reach.
    data["data"]["test_fraction"] = data["data"]["held_out_fraction"] * TEST_SHARE
    run = Run(run_dir, load_config_data(data))
    run.run(until="scores")
    return run, data


def ablate(
    run: Run,
    levels: Sequence[float] = LEVELS,
    methods: Sequence[str] = METHODS,
    gkd_methods: Sequence[str] = GKD_METHODS,
    seeds: int = 5,
    log: Callable[[str], None] = print,
    speedups: Sequence[float] | None = None,
    gkd_seeds: int = 1,
    test_tokens: int = 0,
    params_methods: Sequence[str] = (),
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every method at every level on the run's library (see the module docstring); the JSON's data.
    `speedups`: one minimum predicted decode speed-up per level (a second budget), or None. `gkd_seeds`: GKD
    runs per distilled child (gkd.seed, +1, ...); `test_tokens`: the test split's size (0: report on the
    scoring held-out); `params_methods`: these methods also at each level of total parameters (assembled and
    measured, not distilled); `config`: the run's config data (`prepare_config`), which puzzle_rerank needs."""
    bench = Bench(run, init_scores="mip_no_bld" in methods, test_tokens=test_tokens, config=config)
    if speedups is not None and len(speedups) != len(levels):
        raise ValueError(f"{len(speedups)} speed-ups for {len(levels)} levels: give one per level")
    rows = []
    plan = [("active_params", index, level) for index, level in enumerate(levels)]
    plan += [("params", index, level) for index, level in enumerate(levels) if params_methods]
    for budget, index, level in plan:
        timed = len(bench.gkd_seconds)  # the full GKDs trained before this level
        speedup = None if speedups is None else speedups[index]
        tag = ("" if speedup is None else f"-s{speedup}") + ("" if budget == "active_params" else "-total")
        wanted = methods if budget == "active_params" else params_methods
        # puzzle_rerank last: its pick is often another method's child, whose GKDs it then reuses.
        choices = choose(bench, level, wanted, seeds, speedup, budget)
        for choice in sorted(choices, key=lambda c: c.method == "puzzle_rerank"):
            started = time.perf_counter()
            gkd = budget == "active_params" and choice.method in gkd_methods
            record = row(bench, choice, gkd, tag, tuple(range(gkd_seeds)), budget)
            if "rerank" in record:  # last of the level: every other full GKD of the level is timed by now
                record["rerank_cost"] = rerank_cost(
                    record["rerank"], record["gkd"], bench.gkd_seconds[timed:]
                )
            rows.append(record)
            if record["feasible"]:
                after = record.get("after") or {}
                log(
                    f"{budget} {level:.2f} {choice.method}"
                    f"{'' if choice.seed is None else f' seed {choice.seed}'}: "
                    f"{budget} {record[_size_key(budget)]:.3f}, KL pred {record['predicted_kl']:.4f} measured "
                    f"{record['before']['kl']:.4f}"
                    + (f" after GKD {after['kl']:.4f}" if after else "")
                    + f" ({time.perf_counter() - started:.1f} s)"
                )
            else:
                log(f"{budget} {level:.2f} {choice.method}: infeasible")
    parent_lm = bench.parent_lm_loss
    trained = [r for r in bench.library.results.values() if r.status == "trained" and r.init_nmse]
    ratios = [r.final_nmse / r.init_nmse for r in trained if r.final_nmse is not None]
    return {
        "bld": {
            "trained": len(trained),
            "median_ratio": statistics.median(ratios) if ratios else math.nan,
            "worse": sum(1 for ratio in ratios if ratio > 1),
        },
        "rows": rows,
        "summary": summarize(rows),
        "test_tokens": sum(b.numel() for b in bench.test) if bench.test else 0,
        "held_out_tokens": sum(b.numel() for b in bench.held_out),
        "parent": {
            "active_params": model_active_params(bench.spec),
            "blocks": [b.short_name() for b in bench.spec.blocks],
            "lm_loss": parent_lm,
        },
        "variants": sum(1 for r in bench.library.results.values() if r.status != "parent"),
    }


# What runs of one parent share, whatever their levels: the same run directory's library and splits.
SHARED_BY_LEVELS = ("bld", "held_out_tokens", "test_tokens", "parent", "variants")


def merge_levels(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One page's data from runs of the same parent and methods at different levels (one process per level,
    `--levels LV`, each its own JSON): their rows in order of level, highest first, the summary, findings and
    analysis computed again over all of them. ValueError when the parts differ in what they must share
    (`SHARED_BY_LEVELS`: another library, split or parent) or repeat a level."""
    if not parts:
        raise ValueError("nothing to merge: give the JSONs of the runs, one per level")
    ordered = sorted(parts, key=lambda part: -max(part["meta"]["levels"]))
    levels = [level for part in ordered for level in part["meta"]["levels"]]
    if len(set(levels)) != len(levels):
        raise ValueError(f"the runs repeat a level: {levels}")
    first = ordered[0]
    for part in ordered[1:]:
        for key in SHARED_BY_LEVELS:
            if part[key] != first[key]:
                raise ValueError(
                    f"the runs at {first['meta']['levels']} and {part['meta']['levels']} differ in {key!r}: "
                    "not the same parent and library"
                )
    rows = [row for part in ordered for row in part["rows"]]
    commands = [part["meta"]["command"] for part in ordered]
    shown = " ".join(f"{level:g}" for level in levels)
    meta = {
        **first["meta"],
        "command": re.sub(r"--levels( [0-9.]+)+", f"--levels {shown}", commands[0]),
        "levels": levels,
        "seconds": sum(part["meta"]["seconds"] for part in ordered),
        "commands": commands,
    }
    data = {
        **{key: first[key] for key in SHARED_BY_LEVELS},
        "rows": rows,
        "summary": summarize(rows),
        "meta": meta,
    }
    data["findings"], data["analysis"] = findings(data), analysis(data)
    return data


def write_outputs(data: dict[str, Any], output: Path, png: Path | None, doc: Path | None) -> None:
    """The plot and the document of `data` (the JSON written to `output`), where asked for."""
    if png is not None:
        plot(data, png)
        print(f"wrote {png}")
    if doc is not None:
        atomic_write_bytes(doc, markdown(data, output, png, doc).encode())
        print(f"wrote {doc}")


# ------------------------------------------------------------------------------------------------ parents

# Trained about 4x longer than the quick demo's parent (20 steps, ~41k tokens, about what GKD gives each
# child): a parent that has learned more is harder to compress, as real ones are.
QUICK_PARENT = dataclasses.replace(QUICK_SETTINGS, steps=80)
DEEP_PATTERN = "MEM*EMEM*EMEM*EMEM*E"  # 20 blocks: 8 Mamba, 8 MoE, 4 attention
DEEP_PARENT = TrainSettings(seq_len=256, batch_size=8, steps=120, lr=5e-3, warmup_steps=8)  # ~246k tokens
# A parent unlike `deep` in pattern and proportions (issue 36 §4): 12 blocks, 3 Mamba, 6 MoE of 16 experts (top
# 4), 3 attention, hidden 96; half its blocks are MoE and a quarter attention (deep: 40% and 20%).
WIDE_PATTERN = "MEE*MEE*MEE*"
PARENTS = ("quick", "deep", "full", "wide")
REPLICATE = (("quick", 0), ("quick", 1), ("quick", 2), ("deep", 0), ("wide", 0))
# The replication distils the methods the claims rest on (Puzzle, uniform pruning, refilled greedy, random,
# LM-loss scores) with two GKD seeds each, at the default four levels, with two random architectures per
# level; the other methods are assembled and measured before GKD. Sized to run in about an hour on 2 cores
# (two parents at a time: `--parent NAME --parent-seed S` with REPLICATE_ARGS fills the same run directories).
REPLICATE_LEVELS = LEVELS
REPLICATE_GKD = ("puzzle", "homogeneous", "greedy", "random", "mip_lm_loss")
REPLICATE_RANDOM = 2
# GKD seeds per distilled child in the replication: its claims "beyond the noise" rest on intervals over the
# seeds (`ablation_stats.hierarchical_ratio`), which two seeds cannot give.
REPLICATE_GKD_SEEDS = 3
REPLICATE_HOURS = (
    1.0  # one parent at a time on 2 cores (not timed: two at a time took 21 min + a 4.5 min pass)
)


def parent_spec(name: str) -> ModelSpec:
    """The spec of a named parent: quick (the quick demo's), deep (20 blocks, hidden 64), full (the demo's),
    wide (12 blocks, MoE-heavy, hidden 96)."""
    if name == "quick":
        return demo_quick_parent_spec()
    if name == "deep":
        return demo_spec(DEEP_PATTERN, 64, num_experts=8, top_k=2, num_heads=4)
    if name == "full":
        return demo_parent_spec()
    if name == "wide":
        return demo_spec(WIDE_PATTERN, 96, num_experts=16, top_k=4, num_heads=6)
    raise ValueError(f"unknown parent {name!r}; parents: {', '.join(PARENTS)}")


def load_parent(name: str, seed: int, cache: Path | None) -> Any:
    """The named parent trained with `seed` (`puzzle.demo.parent.demo_parent`: cached as the demo's is)."""
    from puzzle.demo.parent import demo_parent

    # wide is trained as deep is: the same tokens, so the two differ in shape only.
    settings = {"quick": QUICK_PARENT, "deep": DEEP_PARENT, "full": FULL_SETTINGS, "wide": DEEP_PARENT}[name]
    return demo_parent(cache, seed=seed, progress=False, spec=parent_spec(name), settings=settings)


def run_size(base: DemoSize, spec: ModelSpec, grid: str) -> DemoSize:
    """`base` over the `grid`'s space: coarse (SPACE, one step per axis) or fine (`fine_space`)."""
    if grid == "coarse":
        return dataclasses.replace(base, space=SPACE)
    if grid == "fine":
        return dataclasses.replace(base, space=fine_space(spec))
    raise ValueError(f"unknown grid {grid!r}: coarse or fine")


# ---------------------------------------------------------------------- the search where additivity fails

OPTIONS = {"mip": {}, "rerank": {"rerank": 5}, "context": {"context_rounds": 2}}
OPTIONS["both"] = {**OPTIONS["rerank"], **OPTIONS["context"]}
# Scores in context within a trust region: at most two blocks change from the child per round.
OPTIONS["trust"] = {"context_rounds": 3, "context_changes": 2}


def _solution_arch(run: Run, label: str, entry: dict[str, Any]) -> Arch:
    payload = json.loads((run.layout.root / entry["file"]).read_text())
    return tuple(run.child_of(payload).spec.blocks)


def additivity(
    run: Run,
    config: dict[str, Any],
    level: float = 0.4,
    options: Sequence[str] = tuple(OPTIONS),
    gkd_seeds: int = 2,
    test_tokens: int = 8192,
    draws: int = 5,
    walks: int = 20,
    short_gkd: float = 0.25,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The search options (OPTIONS: `search.rerank`, `search.context_rounds`, both, and the trust region
    `context_changes`) at `level` against the plain MIP and the refilled greedy (the 40% study). Each
    option runs the pipeline's solutions stage over `run`'s scores (`config`: the run's config data; the
    earlier stages reused); every child is measured on the scoring held-out (prediction) and the test split
    (report), and distilled once per GKD seed. The goals: within-level Spearman of predicted vs measured KL >= 0.8, the
    chosen child's measured KL within 1.5x of its prediction, Puzzle beating the refilled greedy beyond the
    noise (paired 95% interval above 1) after GKD in every seed."""
    bench = Bench(run, init_scores=False, test_tokens=test_tokens)
    problem = Problem(run, bench.kl, level)
    children: dict[str, tuple[Arch, float | None, dict[str, Any] | None]] = {}
    ranked: list[tuple[float, Arch]] = []  # rerank's candidates: (predicted, arch)
    staged_runs: dict[str, tuple[Run, str]] = {}
    for option in options:
        staged = Run(run.layout.root, load_config_data(_option_config(config, level, OPTIONS[option])))
        outputs = staged.record("solutions")
        label, entry = next(iter(outputs.items()))
        staged_runs[option] = (staged, label)
        arch = _solution_arch(staged, label, entry)
        children[option] = (
            arch,
            float(entry["objective"]),
            {k: entry[k] for k in ("rerank", "context") if k in entry},
        )
        for candidate in (entry.get("rerank") or {}).get("candidates", []):
            payload = {"choices": candidate["choices"]}
            ranked.append((candidate["predicted_kl"], tuple(staged.child_of(payload).spec.blocks)))
    children["greedy"] = (problem.greedy(), None, None)
    children["greedy-norefill"] = (problem.greedy(refill=False), None, None)
    seeds = tuple(range(gkd_seeds))
    figures: dict[str, Any] = {}
    for name, (arch, objective, record) in children.items():
        if arch is None:
            figures[name] = {"feasible": False}
            continue
        started = time.perf_counter()
        measured = bench.distil(arch, "bld", f"additivity-{level:.2f}-{name}", seeds)
        predicted = objective if objective is not None else bench.predicted(arch, bench.kl_of)
        spec = dataclasses.replace(bench.spec, blocks=arch)
        figures[name] = {
            "feasible": True,
            "blocks": [b.short_name() for b in arch],
            "active_fraction": model_active_params(spec) / model_active_params(bench.spec),
            "predicted_kl": predicted,  # the option's own prediction (in context: the last round's)
            "predicted_kl_sum": bench.predicted(arch, bench.kl_of),
            "measured_kl": measured["scoring"]["kl"],
            "measured_over_predicted": measured["scoring"]["kl"] / predicted if predicted > 0 else math.nan,
            "test_before": measured["before"],
            "test_after": measured["after_seeds"],
            "record": record,
        }
        log(
            f"{level:.2f} {name}: predicted {predicted:.4f} measured {measured['scoring']['kl']:.4f} test "
            f"{measured['before']['kl']:.4f} after GKD "
            + ", ".join(f"{a['kl']:.4f}" for a in measured["after_seeds"])
            + f" ({time.perf_counter() - started:.0f} s)"
        )
    # More children at this level for the Spearman, measured before GKD only: uniform pruning, the MIP on
    # LM-loss scores, random architectures (a wider band: at high compression on a deep parent a draw within
    # RANDOM_BAND of the budget is rare) and `walks` random walks to the budget (`Problem.random_walk`).
    origin: dict[Arch, str] = {}  # each child's group: the searches' (near the optimum), baselines, walks
    for arch in [a for _, a in ranked] + [c[0] for c in children.values() if c[0] is not None]:
        origin.setdefault(arch, "search")
    baselines = [problem.homogeneous()[0], Problem(run, bench.lm, level).mip()]
    baselines += [problem.random(seed, rounds=20, band=0.15) for seed in range(draws)]
    for group, archs in (("baseline", baselines), ("walk", [problem.random_walk(s) for s in range(walks)])):
        for arch in archs:
            if arch is not None:
                origin.setdefault(arch, group)
    archs = list(origin)
    measured = [bench.measure(arch, "bld")["scoring"]["kl"] for arch in archs]
    # Three predictors of the same children: the summed replace-one-block scores (in the parent), and the
    # first-order expansion around a searched child (`predict_in_context`: every candidate scored in that
    # child's context), around the plain MIP's child and around the last option's (the trust region's).
    predictors = {"sum": [bench.predicted(arch, bench.kl_of) for arch in archs]}
    for name in dict.fromkeys(["mip", options[-1]]):
        center = children.get(name, (None,))[0]
        if center is not None:
            predictors[f"around {name}"] = _predict_around(staged_runs[name], center, archs, bench)
    figures["spearman_within"] = spearman(predictors["sum"], measured)
    figures["children"] = len(archs)
    figures["rankings"] = rankings(predictors, measured, [origin[a] for a in archs])
    figures["spearman_children"] = sorted(
        (
            {
                "group": origin[arch],
                "measured_kl": measured[i],
                "predicted_kl": predictors["sum"][i],
                "predicted": {name: values[i] for name, values in predictors.items()},
                "blocks": [b.short_name() for b in arch],
            }
            for i, arch in enumerate(archs)
        ),
        key=lambda r: (r["measured_kl"], r["predicted_kl"]),
    )
    if short_gkd:
        searched = [arch for arch in archs if origin[arch] == "search"]
        figures["gkd_rerank"] = gkd_rerank(bench, searched, level, seeds, short_gkd, children.get("greedy"))
    greedy = figures.get("greedy", {})
    for name in options:
        mine = figures[name]
        if not mine.get("feasible") or not greedy.get("feasible"):
            continue
        mine["greedy_ratio_before"] = paired_ratio(
            greedy["test_before"]["kl_batches"], mine["test_before"]["kl_batches"]
        )
        mine["greedy_ratio_after"] = [
            paired_ratio(g["kl_batches"], m["kl_batches"])
            for g, m in zip(greedy["test_after"], mine["test_after"])
        ]
        mine["greedy_ratio_after_pooled"] = over_seeds(greedy["test_after"], mine["test_after"])
        pooled = mine["greedy_ratio_after_pooled"]
        mine["goals"] = {
            "spearman_within_0.8": figures["spearman_within"] >= 0.8,
            "measured_within_1.5x": mine["measured_over_predicted"] <= 1.5,
            "beats_greedy_every_seed": all(r["low"] > 1 for r in mine["greedy_ratio_after"]),
            "beats_greedy_over_the_seeds": pooled is not None and pooled["low"] > 1,
        }
    return {"level": level, "options": list(options), "gkd_seeds": gkd_seeds, "figures": figures}


def gkd_rerank(
    bench: Bench,
    archs: list[Arch],
    level: float,
    seeds: Sequence[int],
    fraction: float,
    greedy: tuple[Arch | None, Any, Any] | None,
) -> dict[str, Any]:
    """Would a search that re-ranks its candidates by a short GKD pick better? Over the searches' children
    (`archs`): each one's KL before GKD and after a short GKD (`fraction` of the tokens, on the scoring
    held-out: what a search could measure), against the full GKD's test KL (mean over `seeds`). Spearman of
    each against the full GKD's, and the child each would pick, as its full-GKD KL over the best child's and
    over refilled greedy's (paired 95% per seed, and over the seeds: `over_seeds`)."""
    before = [bench.measure(arch, "bld")["scoring"]["kl"] for arch in archs]
    shorts = [bench.short_gkd(arch, f"additivity-{level:.2f}-{i}", fraction) for i, arch in enumerate(archs)]
    short = [record["kl"] for record in shorts]
    after = [
        bench.distil(arch, "bld", f"additivity-{level:.2f}-search-{i}", seeds)["after_seeds"]
        for i, arch in enumerate(archs)
    ]
    full = [statistics.mean(a["kl"] for a in seeds_after) for seeds_after in after]
    best = min(full)
    out: dict[str, Any] = {
        "children": len(archs),
        "fraction": fraction,
        "tokens": {  # per child: the short GKD's and the full GKD's (first seed)
            "short": [record["tokens"] for record in shorts],
            "full": [seeds_after[0]["gkd"]["tokens"] for seeds_after in after],
        },
    }
    theirs = None
    if greedy is not None and greedy[0] is not None:
        theirs = bench.distil(greedy[0], "bld", f"additivity-{level:.2f}-greedy", seeds)["after_seeds"]
    for name, values in (("before", before), ("short_gkd", short)):
        picked = min(range(len(archs)), key=lambda i: values[i])
        entry: dict[str, Any] = {
            "spearman": spearman(values, full) if len(archs) >= 3 else None,
            "pick": full[picked] / best,
            "blocks": [b.short_name() for b in archs[picked]],
        }
        if theirs is not None:
            entry["greedy_ratio_after"] = [
                paired_ratio(g["kl_batches"], m["kl_batches"]) for g, m in zip(theirs, after[picked])
            ]
            entry["greedy_ratio_after_pooled"] = over_seeds(theirs, after[picked])
        out[name] = entry
    return out


def rankings(
    predictors: dict[str, Sequence[float]], measured: Sequence[float], groups: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """How well each predictor ranks the measured KL, over all children and within each group: the Spearman
    (None below 3 children), and the pick: the measured KL of the child it predicts lowest over the lowest
    measured (1.0: it finds the best child)."""
    out: dict[str, dict[str, Any]] = {}
    for group in ["all", *dict.fromkeys(groups)]:
        rows = [i for i, g in enumerate(groups) if group in ("all", g)]
        best = min(measured[i] for i in rows)
        out[group] = {"children": len(rows)}
        for name, values in predictors.items():
            picked = min(rows, key=lambda i: values[i])
            out[group][name] = {
                "spearman": spearman([values[i] for i in rows], [measured[i] for i in rows])
                if len(rows) >= 3
                else None,
                "pick": measured[picked] / best if best > 0 else math.nan,
            }
    return out


def _predict_around(staged: tuple[Run, str], center: Arch, archs: list[Arch], bench: Bench) -> list[float]:
    """Each of `archs`' KL predicted around the child `center` (`puzzle.context.predict_in_context`), from
    every candidate scored in that child's context (one scoring pass, cached in the run directory)."""
    from puzzle.context import predict_in_context

    run, label = staged
    wanted = [Variant(b, spec) for b, specs in enumerate(bench.kl.variants) for spec in specs]
    own = [Variant(b, spec) for b, spec in enumerate(center)]
    scores = run.scores_in_context(label, own, wanted).variants
    return [
        predict_in_context(scores, own, [Variant(b, spec) for b, spec in enumerate(arch)], "kl")
        for arch in archs
    ]


def _option_config(config: dict[str, Any], level: float, search: dict[str, Any]) -> dict[str, Any]:
    """The run's config data with the solutions stage's search at `level` and the option's settings."""
    data = dict(config)
    data["search"] = {"sweep": f"active_params<={level}x", "objective": "kl", **search}
    return data


GROUPS = {
    "all": "all children",
    "search": "the searches' (MIP, its k best, context rounds, trust region, greedy)",
    "baseline": "uniform pruning, LM-loss MIP, random draws",
    "walk": "random walks to the budget",
}


def rankings_table(rankings: dict[str, dict[str, Any]] | None) -> list[str]:
    """The predictors' Spearman and pick per group of children (`rankings`), as Markdown lines."""
    if not rankings:
        return []
    names = [k for k in rankings["all"] if k != "children"]
    lines = [
        "How each predictor ranks the children's measured KL: Spearman, and in brackets the measured KL of the "
        "child it predicts lowest over the lowest measured (1.00: it finds the best). *sum*: the summed "
        "replace-one-block scores, what the MIP solves; *around X*: the first-order expansion around X's "
        "child, every candidate scored in that child's context (`puzzle.context.predict_in_context`).",
        "",
        "| children | n | " + " | ".join(names) + " |",
        "|---|---:|" + "---:|" * len(names),
    ]
    for group, entry in rankings.items():
        cells = [
            f"{_fmt(entry[n]['spearman'], 2)} [{entry[n]['pick']:.2f}]"
            if entry[n]["spearman"] is not None
            else f"- [{entry[n]['pick']:.2f}]"
            for n in names
        ]
        lines.append(f"| {GROUPS.get(group, group)} | {entry['children']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def gkd_rerank_text(study: dict[str, Any] | None) -> list[str]:
    """`gkd_rerank`'s figures as Markdown lines."""
    if not study:
        return []
    lines = [
        f"Re-ranking the searches' {study['children']} children by their KL before GKD or after a short GKD "
        f"({study['fraction']:g} of the tokens, on the scoring held-out), against their test KL after the full "
        "GKD (mean of the seeds):",
        "",
        "| ranked by | Spearman with after GKD | pick's after GKD / best | refilled greedy / pick, after GKD, over the "
        "seeds (95%) | per seed (95%) |",
        "|---|---:|---:|---|---|",
    ]
    for name, label in (("before", "KL before GKD"), ("short_gkd", "KL after the short GKD")):
        r = study[name]
        ratios = "; ".join(_ratio_text(x) for x in r.get("greedy_ratio_after", [])) or "-"
        pooled = _ratio_text(r["greedy_ratio_after_pooled"]) if r.get("greedy_ratio_after_pooled") else "-"
        lines.append(f"| {label} | {_fmt(r['spearman'], 2)} | {r['pick']:.2f} | {pooled} | {ratios} |")
    return [*lines, ""]


def additivity_markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    """The additivity figures as a short Markdown page."""
    f = result["figures"]
    lines = [
        f"# Search options at {result['level']:.0%} of active parameters: {meta['parent']}",
        "",
        "```",
        shown_command(meta["command"]),
        "```",
        "",
        f"Within-level Spearman of predicted (summed replace-one-block) vs measured KL over {f['children']} "
        f"distinct children at this level: **{_fmt(f['spearman_within'], 3)}** (goal >= 0.8). {meta['seconds']:.0f} s.",
        "",
        *rankings_table(f.get("rankings")),
        *gkd_rerank_text(f.get("gkd_rerank")),
        "| search | active | predicted KL | measured KL | measured / predicted (goal <= 1.5) | test KL | "
        "after GKD, per seed | greedy / this after GKD, over the seeds (95%) | per seed (95%) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in [*result["options"], "greedy", "greedy-norefill"]:
        r = f.get(name, {})
        if not r.get("feasible"):
            lines.append(f"| {name} | infeasible | | | | | | | |")
            continue
        after = "; ".join(f"{a['kl']:.4f}" for a in r["test_after"])
        ratios = "; ".join(_ratio_text(x) for x in r.get("greedy_ratio_after", [])) or "-"
        pooled = _ratio_text(r["greedy_ratio_after_pooled"]) if r.get("greedy_ratio_after_pooled") else "-"
        lines.append(
            f"| {name} | {r['active_fraction']:.1%} | {r['predicted_kl']:.4f} | {r['measured_kl']:.4f} | "
            f"{r['measured_over_predicted']:.2f} | {r['test_before']['kl']:.4f} | {after} | {pooled} | {ratios} |"
        )
    return "\n".join(lines) + "\n"


@dataclass
class Setup:
    """One ablation run: which parent, how much work, which space, where the outputs go."""

    parent: str = "quick"  # PARENTS
    parent_seed: int = 0
    size: DemoSize = DEFAULT
    grid: str = "fine"
    levels: Sequence[float] = LEVELS
    seeds: int = 5  # random architectures per level
    methods: Sequence[str] = METHODS
    gkd: Sequence[str] = GKD_METHODS
    gkd_seeds: int = 2
    test_tokens: int | None = None  # None: as many as the scoring held-out
    params_methods: Sequence[str] = ("puzzle", "homogeneous", "greedy")
    speedups: Sequence[float] | None = None
    run_dir: Path = ROOT / "runs" / "ablations"
    output: Path = HERE / "results" / "ablations.json"
    doc: Path | None = None
    png: Path | None = None

    @property
    def tag(self) -> str:
        """The parent and its seed, e.g. quick-s1: names the run directory and the outputs."""
        return f"{self.parent}-s{self.parent_seed}"

    def describe(self) -> str:
        names = {
            "quick": "the quick demo parent",
            "deep": "the 20-block parent",
            "full": "the full demo parent",
            "wide": "the 12-block MoE-heavy parent",
        }
        return f"{names[self.parent]} (seed {self.parent_seed}), {self.grid} grid"


def _stage_seconds(run: Run) -> dict[str, Any]:
    stages = {}
    for name, entry in run.manifest()["stages"].items():
        if entry.get("started") and entry.get("finished"):
            seconds = (
                datetime.fromisoformat(entry["finished"]) - datetime.fromisoformat(entry["started"])
            ).total_seconds()
            stages[name] = {"seconds": seconds, "status": entry.get("status")}
    return stages


def run_setup(setup: Setup, cache: Path | None, command: str, threads: int) -> dict[str, Any]:
    """One ablation run (`Setup`) end to end: the parent (cached), the run up to its scores, every method at
    every level, the analysis; writes the JSON, the document and the plot where `setup` asks."""
    started = time.perf_counter()
    parent = load_parent(setup.parent, setup.parent_seed, cache)
    print(f"parent {setup.tag}: {parent.path}", flush=True)
    size = run_size(setup.size, parent.model.spec, setup.grid)
    run, config = prepare_config(parent, size, setup.run_dir)
    print(f"run (up to the scores): {setup.run_dir} ({time.perf_counter() - started:.0f} s)", flush=True)
    test_tokens = size.held_out_tokens if setup.test_tokens is None else setup.test_tokens
    data = ablate(
        run,
        setup.levels,
        setup.methods,
        setup.gkd,
        setup.seeds,
        speedups=setup.speedups,
        gkd_seeds=setup.gkd_seeds,
        test_tokens=test_tokens,
        params_methods=setup.params_methods,
        config=config,
    )
    data["parent"]["lm_loss"] = data["parent"]["lm_loss"] or parent.record.get("held_out_loss")
    data["meta"] = {
        "command": command,
        "parent": setup.describe(),
        "parent_seed": setup.parent_seed,
        "parent_train_tokens": parent.record.get("train_tokens"),
        "grid": setup.grid,
        "parent_blocks": " ".join(data["parent"]["blocks"]),
        "parent_active_params": data["parent"]["active_params"],
        "parent_lm_loss": data["parent"]["lm_loss"],
        "variants": data["variants"],
        "space": size.space,
        "bld_tokens": size.bld_tokens,
        "held_out_tokens": size.held_out_tokens,
        "test_tokens": data["test_tokens"],
        "gkd_tokens": size.gkd_tokens,
        "gkd_seeds": setup.gkd_seeds,
        "levels": list(setup.levels),
        "speedups": None
        if setup.speedups is None
        else {str(lv): sp for lv, sp in zip(setup.levels, setup.speedups)},
        "bld": data["bld"],
        "stages": _stage_seconds(run),
        "seeds": setup.seeds,
        "gkd_methods": list(setup.gkd),
        "seconds": time.perf_counter() - started,
        "machine": f"{platform.machine()} CPU, {threads} torch thread(s)",
    }
    setup.output.parent.mkdir(parents=True, exist_ok=True)
    # The measurements first, so that an analysis that fails loses no run (`--render` computes it again).
    atomic_write_bytes(setup.output, (json.dumps(data, indent=2, default=str) + "\n").encode())
    data["findings"] = findings(data)
    data["analysis"] = analysis(data)
    atomic_write_bytes(setup.output, (json.dumps(data, indent=2, default=str) + "\n").encode())
    print(f"wrote {setup.output}")
    write_outputs(data, setup.output, setup.png, setup.doc)
    summary = data["summary"]
    print(
        f"Spearman (predicted vs measured KL, {summary['children_bld']} children): pooled "
        f"{summary['spearman_bld']:.3f}, within levels "
        + ", ".join(f"{float(k):.0%} {v:.2f}" for k, v in summary["spearman_within"].items())
        + f"; {data['meta']['seconds']:.0f} s"
    )
    return data


def run_additivity(
    setup: Setup, cache: Path | None, command: str, threads: int, level: float
) -> dict[str, Any]:
    """`additivity` on `setup`'s parent at `level`: JSON and Markdown beside `setup.output`."""
    started = time.perf_counter()
    parent = load_parent(setup.parent, setup.parent_seed, cache)
    size = run_size(setup.size, parent.model.spec, setup.grid)
    run, config = prepare_config(parent, size, setup.run_dir)
    test_tokens = size.held_out_tokens if setup.test_tokens is None else setup.test_tokens
    result = additivity(run, config, level, gkd_seeds=setup.gkd_seeds, test_tokens=test_tokens)
    meta = {
        "command": command,
        "parent": setup.describe(),
        "seconds": time.perf_counter() - started,
        "machine": f"{platform.machine()} CPU, {threads} torch thread(s)",
    }
    result["meta"] = meta
    setup.output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(setup.output, (json.dumps(result, indent=2, default=str) + "\n").encode())
    markdown_path = setup.output.with_suffix(".md")
    atomic_write_bytes(markdown_path, additivity_markdown(result, meta).encode())
    print(f"wrote {setup.output} and {markdown_path} ({meta['seconds']:.0f} s)")
    return result


def replication_summary(results: dict[str, dict[str, Any]]) -> str:
    """One page over the replication's runs: per parent, the within-level and pooled Spearman and the
    crossover against uniform pruning (details: each run's own page beside it)."""
    lines = [
        f"# Replication: every parent, {REPLICATE_GKD_SEEDS} GKD seeds, a test split of held-out files",
        "",
        "```",
        "python benchmarks/ablations.py --replicate",
        "```",
        "",
        "| parent | Spearman pooled | within levels | crossover before GKD [95%] | after GKD [95%] | seconds |",
        "|---|---:|---|---|---|---:|",
    ]
    for tag, data in results.items():
        summary, cross = data["summary"], (data.get("analysis") or {}).get("crossover") or {}
        within = ", ".join(f"{float(k):.0%} {_fmt(v, 2)}" for k, v in summary["spearman_within"].items())
        cells = []
        for phase, _ in PHASES:
            c = cross.get(phase)
            cells.append(
                "-"
                if not c
                else f"{_compression_text(c['crossover'], c['compressions'])} "
                f"[{_compression_text(c['low'], c['compressions'])}, {_compression_text(c['high'], c['compressions'])}]"
            )
        lines.append(
            f"| [{tag}]({tag}.md) | {_fmt(summary['spearman_bld'], 2)} | {within} | {cells[0]} | {cells[1]} | "
            f"{data['meta']['seconds']:.0f} |"
        )
    lines += ["", *verdict_table(results), "", *interval_table(results)]
    return "\n".join(lines) + "\n"


def interval_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """Each method's KL over Puzzle's after GKD per parent and level with its 95% interval over the GKD seeds
    and test batches (`over_seeds`), then each seed's ratio alone: the figures the verdicts rest on."""
    levels = sorted({lv for data in results.values() for lv in data["meta"]["levels"]}, reverse=True)
    lines = [
        "After GKD, KL over Puzzle's over every GKD seed [95%, seeds and test batches resampled]; in brackets "
        "after it, each seed's ratio alone:",
        "",
        "| method | parent | " + " | ".join(f"{lv:.0%}" for lv in levels) + " |",
        "|---|---|" + "---|" * len(levels),
    ]
    for method in (m for m in METHODS if m not in ("puzzle", "random")):
        for tag, data in results.items():
            paired = ((data.get("analysis") or {}).get("paired") or {}).get(method, {})
            cells = []
            for lv in levels:
                entry = paired.get(str(lv)) or {}
                pooled = entry.get("after_pooled")
                seeds = ", ".join(f"{r['ratio']:.2f}" for r in entry.get("after") or [])
                cells.append(f"{_ratio_text(pooled)} ({seeds})" if pooled else "-")
            if any(c != "-" for c in cells):
                lines.append(f"| {method} | {tag} | " + " | ".join(cells) + " |")
    return lines


def _verdict(entry: dict[str, Any] | None) -> str:
    """One cell over a method's ratio to Puzzle: the ratio, then `+` when its interval is above 1 (Puzzle
    lower beyond the noise), `-` when below, `~` otherwise."""
    if not entry:
        return "-"
    mark = "+" if entry["low"] > 1 else "-" if entry["high"] < 1 else "~"
    return f"{entry['ratio']:.2f} {mark}"


def verdict_table(results: dict[str, dict[str, Any]], phase: str = "after") -> list[str]:
    """Each method's KL over Puzzle's per parent and level on the test split (`paired_ratios`; after GKD: over
    every GKD seed's batches, with the hierarchical interval), marked + (Puzzle lower beyond the noise), - (the
    method lower beyond it) or ~; random: the mean over its draws of their KL over Puzzle's, unmarked."""
    levels = sorted({lv for data in results.values() for lv in data["meta"]["levels"]}, reverse=True)
    lines = [
        f"KL over Puzzle's ({'after GKD, over the GKD seeds' if phase == 'after' else 'assembled'}); "
        "+ Puzzle lower beyond the noise (the 95% interval"
        f"{' over seeds and batches' if phase == 'after' else ''} above 1), - the method lower beyond it, ~ neither:",
        "",
        "| method | parent | " + " | ".join(f"{lv:.0%}" for lv in levels) + " |",
        "|---|---|" + "---:|" * len(levels),
    ]
    methods = [m for m in METHODS if m not in ("puzzle",)]
    for method in methods:
        for tag, data in results.items():
            paired = ((data.get("analysis") or {}).get("paired") or {}).get(method, {})
            cells = []
            for lv in levels:
                if method == "random":
                    cells.append(_random_ratio(data, lv, phase))
                    continue
                entry = paired.get(str(lv))
                cells.append(
                    "-"
                    if entry is None
                    else _verdict(entry.get("after_pooled") if phase == "after" else entry["before"])
                )
            if any(c != "-" for c in cells):
                lines.append(f"| {method} | {tag} | " + " | ".join(cells) + " |")
    return lines


def _random_ratio(data: dict[str, Any], level: float, phase: str) -> str:
    """The mean over random draws of their KL over Puzzle's at `level` (after GKD: the seeds' mean KL)."""

    def kl(r: dict[str, Any]) -> float | None:
        if phase == "after":
            seeds = r.get("after_seeds") or []
            return sum(s["kl"] for s in seeds) / len(seeds) if seeds else None
        return r["before"]["kl"]

    rows = [
        r
        for r in data["rows"]
        if r["level"] == level and r["feasible"] and r.get("budget", "active_params") == "active_params"
    ]
    puzzle = next((kl(r) for r in rows if r["method"] == "puzzle"), None)
    draws = [kl(r) for r in rows if r["method"] == "random"]
    draws = [d for d in draws if d is not None]
    if not puzzle or not draws:
        return "-"
    return f"{sum(d / puzzle for d in draws) / len(draws):.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--full", action="store_true", help="the full demo parent and the demo's full sizes")
    group.add_argument("--quick", action="store_true", help="CI-sized smoke run (tiny token counts)")
    group.add_argument(
        "--replicate",
        action="store_true",
        help=f"the full replication: parents {REPLICATE}, levels {REPLICATE_LEVELS}, then --additivity on the "
        f"deep parent (about {REPLICATE_HOURS:g} h on 2 shared cores); outputs in benchmarks/results/replicate/",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="PART",
        help="with --replicate: run only this part (a parent's tag, e.g. quick-s1, or 'additivity'; repeatable), "
        "so that parts run side by side in the same directories; the summary then reads the others' JSON",
    )
    group.add_argument(
        "--additivity",
        action="store_true",
        help="search.rerank and search.context_rounds against the plain MIP and the refilled greedy at the first "
        "--levels value (default 0.4), on --parent (default deep)",
    )
    parser.add_argument(
        "--parent", choices=PARENTS, help="the parent (default quick; deep with --additivity)"
    )
    parser.add_argument("--parent-seed", type=int, default=0, help="the parent's training seed (default 0)")
    parser.add_argument("--grid", choices=("fine", "coarse"), default="fine", help="the space (default fine)")
    parser.add_argument(
        "--levels", type=float, nargs="+", help=f"fractions of active params (default {LEVELS})"
    )
    parser.add_argument(
        "--seeds", type=int, help="random architectures per level (default 5, 2 with --quick)"
    )
    parser.add_argument("--gkd", nargs="*", default=None, help=f"methods distilled (default {GKD_METHODS})")
    parser.add_argument(
        "--methods", nargs="+", choices=METHODS, help="methods assembled and measured (default: every one)"
    )
    parser.add_argument("--gkd-seeds", type=int, default=2, help="GKD runs per distilled child (default 2)")
    parser.add_argument(
        "--test-tokens", type=int, help="the test split's tokens (default: the scoring held-out's; 0: none)"
    )
    parser.add_argument(
        "--total-params",
        nargs="*",
        default=None,
        help="methods also run at each level of total parameters (default puzzle homogeneous greedy)",
    )
    parser.add_argument(
        "--run-dir", type=Path, help="the cached run directory (default runs/ablations-<parent>-s<seed>[...])"
    )
    parser.add_argument("--cache", type=Path, help="the demo parent's cache (default puzzle.demo.parent's)")
    parser.add_argument("--output", type=Path, help="the JSON (default benchmarks/results/ablations.json)")
    parser.add_argument(
        "--doc", type=Path, help="the Markdown (default docs/RESULTS-quick.md; none with --quick)"
    )
    parser.add_argument("--plot", type=Path, help="the PNG (default docs/results_kl.png; none with --quick)")
    parser.add_argument(
        "--speedup",
        type=float,
        nargs="+",
        help="also bound the predicted decode throughput: one minimum speed-up over the parent per level",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="only merge the JSONs of runs of one parent at different levels into one page (--output, --doc, "
        "--plot)",
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="only write the document and the plot again from the JSON (--output) of an earlier run",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: steady on a shared CPU, where OpenMP threads spin)",
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    os.environ.setdefault("PUZZLE_PROGRESS", "0")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = "python benchmarks/ablations.py" + " ".join(["", *(argv if argv is not None else sys.argv[1:])])
    parent = args.parent or ("full" if args.full else "deep" if args.additivity else "quick")
    size = FULL if parent == "full" else SMOKE if args.quick else DEFAULT
    suffix = ("-coarse" if args.grid == "coarse" else "") + ("-smoke" if args.quick else "")
    setup = Setup(
        parent=parent,
        parent_seed=args.parent_seed,
        size=size,
        grid=args.grid,
        levels=args.levels or ((0.7, 0.4) if args.quick else LEVELS),
        seeds=args.seeds or (2 if args.quick else 5),
        methods=METHODS if args.methods is None else tuple(args.methods),
        gkd=GKD_METHODS if args.gkd is None else tuple(args.gkd),
        gkd_seeds=args.gkd_seeds,
        test_tokens=args.test_tokens,
        params_methods=Setup.params_methods if args.total_params is None else tuple(args.total_params),
        speedups=args.speedup,
    )
    setup.run_dir = (args.run_dir or ROOT / "runs" / f"ablations-{setup.tag}{suffix}").absolute()
    default_run = parent == "quick" and args.parent_seed == 0 and not suffix and not args.additivity
    results = HERE / "results" / ("quick" if args.quick else "")
    setup.output = args.output or results / (
        "ablations.json"
        if default_run or args.quick or parent == "full"
        else f"{'additivity' if args.additivity else 'ablations'}-{setup.tag}{suffix}.json"
    )
    if parent == "full" and args.output is None:
        setup.output = results / "ablations-full.json"
    setup.doc = args.doc or (ROOT / "docs" / "RESULTS-quick.md" if default_run else None)
    setup.png = args.plot or (ROOT / "docs" / "results_kl.png" if default_run else None)

    if args.merge:
        if args.output is None:
            parser.error("--merge writes the page's JSON to --output: give it")
        data = merge_levels([json.loads(path.read_text()) for path in args.merge])
        atomic_write_bytes(args.output, (json.dumps(data, indent=2, default=str) + "\n").encode())
        print(f"wrote {args.output}")
        write_outputs(data, args.output, args.plot, args.doc)
        return 0
    if args.render:
        if not setup.output.is_file():
            parser.error(f"--render reads the JSON of an earlier run: {setup.output} does not exist")
        data = json.loads(setup.output.read_text())
        if "meta" in data and "rows" in data:  # the analysis again, as this version computes it
            data["findings"], data["analysis"] = findings(data), analysis(data)
        write_outputs(data, setup.output, setup.png, setup.doc)
        return 0
    if args.additivity:
        level = (args.levels or (0.4,))[0]
        run_additivity(setup, args.cache, command, args.threads, level)
        return 0
    if args.replicate:
        given = {
            "levels": args.levels,
            "methods": args.methods,
            "gkd": args.gkd,
            "params_methods": args.total_params,
        }
        overrides = {k: tuple(v) for k, v in given.items() if v is not None}
        return replicate(setup, args.cache, command, args.threads, args.only, overrides)
    run_setup(setup, args.cache, command, args.threads)
    return 0


def replicate(
    base: Setup,
    cache: Path | None,
    command: str,
    threads: int,
    only: Sequence[str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> int:
    """The full replication (`--replicate`): each parent of REPLICATE at REPLICATE_LEVELS, then the search
    options on the deep parent at 40%, REPLICATE_GKD_SEEDS GKD seeds each; everything under
    benchmarks/results/replicate/. `only`: these parts (parent tags, "additivity"); the summary is written
    when every parent has its JSON. `overrides`: Setup fields given on the command line (--levels, --methods,
    --gkd, --total-params) instead of the replication's, to run less of it."""
    started = time.perf_counter()
    out = HERE / "results" / "replicate"
    parts = [f"{name}-s{seed}" for name, seed in REPLICATE] + ["additivity"]
    unknown = sorted(set(only or ()) - set(parts))
    if unknown:
        raise SystemExit(f"--only {', '.join(unknown)}: the replication's parts are {', '.join(parts)}")
    wanted = set(only or parts)
    results = {}
    for name, seed in REPLICATE:
        setup = dataclasses.replace(
            base,
            parent=name,
            parent_seed=seed,
            levels=REPLICATE_LEVELS,
            size=DEFAULT,
            gkd=REPLICATE_GKD,
            seeds=REPLICATE_RANDOM,
            gkd_seeds=REPLICATE_GKD_SEEDS,
        )
        setup = dataclasses.replace(setup, **(overrides or {}))
        setup.run_dir = ROOT / "runs" / f"ablations-{setup.tag}"
        setup.output, setup.doc, setup.png = (
            out / f"{setup.tag}.json",
            out / f"{setup.tag}.md",
            out / f"{setup.tag}.png",
        )
        if setup.tag in wanted:
            results[setup.tag] = run_setup(setup, cache, command, threads)
        elif setup.output.is_file():
            results[setup.tag] = json.loads(setup.output.read_text())
    if "additivity" in wanted:
        deep = dataclasses.replace(
            base, parent="deep", parent_seed=0, size=DEFAULT, gkd_seeds=REPLICATE_GKD_SEEDS
        )
        deep.run_dir, deep.output = ROOT / "runs" / "ablations-deep-s0", out / "additivity-deep-s0.json"
        run_additivity(deep, cache, command, threads, 0.4)
    if len(results) == len(REPLICATE):
        atomic_write_bytes(out / "README.md", replication_summary(results).encode())
        print(f"wrote {out / 'README.md'} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
