"""benchmarks/ablations.py on a tiny trained demo parent: every method meets the budget, the MIP's predicted KL
is the least of the methods that search the same table, the restricted spaces keep their axis, the tables and
the plot are written, and the numpy Spearman matches the closed form."""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np
import pytest
from ablation_helpers import benchmark_module, tiny_parent, tiny_size

from puzzle.data import held_out_documents
from puzzle.rerank import source_kind
from puzzle.spec import MambaSpec, MoESpec

ablations = benchmark_module("ablations")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("ablations")
    run, config = ablations.prepare_config(tiny_parent(root), tiny_size(ablations), root / "run")
    data = ablations.ablate(
        run,
        levels=(0.6,),
        gkd_methods=("puzzle", "puzzle_rerank"),
        seeds=2,
        log=lambda _: None,
        config=config,
    )
    return data, run, root


def test_every_method_meets_the_budget_and_the_mip_predicts_least(result):
    data, _, _ = result
    rows = [r for r in data["rows"] if r["feasible"]]
    methods = {r["method"] for r in rows}
    assert {
        "puzzle",
        "puzzle_rerank",
        "homogeneous",
        "greedy",
        "greedy-norefill",
        "random",
        "mip_no_bld",
        "mip_lm_loss",
    } <= methods
    for r in rows:
        assert r["active_fraction"] <= 0.6 + 1e-9, r
        assert r["before"]["kl"] > 0 and 0 < r["before"]["top1"] < 1
    puzzle = next(r for r in rows if r["method"] == "puzzle")
    # Every BLD method chooses from the same KL table: none can predict less than the MIP's optimum.
    for r in rows:
        if r["weights"] == "bld":
            assert puzzle["predicted_kl"] <= r["predicted_kl"] + 1e-9, r["method"]
    assert puzzle["after"]["kl"] < puzzle["before"]["kl"]  # GKD heals
    randoms = [r for r in rows if r["method"] == "random"]
    assert [r["seed"] for r in randoms] == [0, 1]
    assert all(r["active_fraction"] >= 0.6 - ablations.RANDOM_BAND - 1e-9 for r in randoms)
    assert next(r for r in rows if r["method"] == "mip_no_bld")["weights"] == "init"


def _closed_form_spearman(x: list[float], y: list[float]) -> float:
    """1 - 6 sum d^2 / (n (n^2 - 1)) over the ranks of x and y (no ties)."""
    assert len(set(x)) == len(x) and len(set(y)) == len(y), "the closed form needs distinct values"
    rank_x = {v: i for i, v in enumerate(sorted(x))}
    rank_y = {v: i for i, v in enumerate(sorted(y))}
    n = len(x)
    return 1 - 6 * sum((rank_x[a] - rank_y[b]) ** 2 for a, b in zip(x, y)) / (n * (n**2 - 1))


def test_the_summary_spearman_is_the_closed_form_on_the_distinct_bld_children(result):
    data, _, _ = result
    children = {
        tuple(r["blocks"]): (r["predicted_kl"], r["before"]["kl"])
        for r in data["rows"]
        if r["feasible"] and r["weights"] == "bld"
    }
    assert len(children) >= 4, children  # enough children that the value says something
    predicted, measured = (list(values) for values in zip(*children.values()))
    assert data["summary"]["spearman_bld"] == pytest.approx(_closed_form_spearman(predicted, measured))


def test_refilled_greedy_fills_the_budget_the_descent_left(result):
    """At every level the refill meets the budget, predicts no more KL than the descent alone and uses at
    least as many parameters; at some level strictly more (the descent stops at the first fit)."""
    data, run, _ = result
    assert {"greedy", "greedy-norefill"} <= {r["method"] for r in data["rows"] if r["feasible"]}
    bench = ablations.Bench(run, init_scores=False)

    def active(arch) -> float:
        spec = dataclasses.replace(bench.spec, blocks=arch)
        return ablations.model_active_params(spec) / ablations.model_active_params(bench.spec)

    gained = []
    for level in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        problem = ablations.Problem(run, bench.kl, level)
        refilled, plain = problem.greedy(), problem.greedy(refill=False)
        if plain is None:
            assert refilled is None
            continue
        assert active(refilled) <= level + 1e-9 and active(refilled) >= active(plain)
        assert bench.predicted(refilled, bench.kl_of) <= bench.predicted(plain, bench.kl_of) + 1e-12
        mip = problem.mip()  # the MIP is optimal on the same table
        assert bench.predicted(mip, bench.kl_of) <= bench.predicted(refilled, bench.kl_of) + 1e-9
        gained.append(active(refilled) - active(plain))
    assert max(gained) > 0.01, gained


def test_restricted_and_homogeneous_spaces_keep_their_shape(result):
    data, run, _ = result
    parent = run.load_parent().spec.blocks
    by_method = {r["method"]: r for r in data["rows"] if r["feasible"] and r["seed"] is None}
    bench_specs = ablations.Bench(run, init_scores=False)
    names = {
        (b, spec.short_name()): spec for b, specs in enumerate(bench_specs.kl.variants) for spec in specs
    }
    chosen = {m: [names[(b, n)] for b, n in enumerate(r["blocks"])] for m, r in by_method.items()}
    for b, spec in enumerate(chosen.get("no_state_axis", [])):
        if isinstance(spec, MambaSpec):
            assert spec.state_size == parent[b].state_size
    for b, spec in enumerate(chosen.get("no_width_axis", [])):
        if isinstance(spec, MoESpec):
            assert spec.expert_width == parent[b].expert_width
    for method in ("homogeneous", "homogeneous_width"):
        kinds: dict[str, set] = {}
        for b, spec in enumerate(chosen.get(method, [])):
            kinds.setdefault(parent[b].kind, set()).add(spec)
        assert all(len(shapes) == 1 for shapes in kinds.values()), method
    assert all(spec.kind != "noop" for spec in chosen.get("homogeneous_width", []))


def test_the_report_and_plot_are_written(result, tmp_path):
    data, _, _ = result
    data = {
        **data,
        "meta": {
            "command": "python benchmarks/ablations.py",
            "parent": "tiny",
            "parent_blocks": " ".join(data["parent"]["blocks"]),
            "parent_active_params": data["parent"]["active_params"],
            "parent_lm_loss": data["parent"]["lm_loss"],
            "variants": data["variants"],
            "space": {},
            "bld_tokens": 1,
            "held_out_tokens": 1,
            "gkd_tokens": 1,
            "levels": [0.6],
            "bld": data["bld"],
            "seeds": 2,
            "seconds": 1.0,
            "machine": "test",
        },
    }
    data["findings"] = ablations.findings(data)
    text = ablations.markdown(data)
    assert "### 60% of the parent's active parameters" in text and "| puzzle |" in text
    assert "random (n=2)" in text and "Spearman" in text
    rerank = next(r for r in data["rows"] if r["method"] == "puzzle_rerank")
    assert "## Re-ranking by short GKD" in text and "| 60% | " + ", ".join(rerank["rerank"]["won_by"]) in text
    assert "](results_kl.png)" in text and "benchmarks/results/ablations.json" in text  # the default run's
    other = ablations.markdown(
        data, tmp_path / "a.json", tmp_path / "docs" / "kl.png", tmp_path / "docs" / "R.md"
    )
    assert "](kl.png)" in other and f"{tmp_path / 'a.json'}" in other  # the files this run wrote
    assert "Budgets bound active parameters only" in text
    bounded = ablations.markdown({**data, "meta": {**data["meta"], "speedups": {"0.6": 1.2}}})
    assert "predicted decode throughput" in bounded and "active parameters only" not in bounded
    ablations.plot(data, tmp_path / "kl.png")
    assert (tmp_path / "kl.png").read_bytes()[:4] == b"\x89PNG"


def test_the_shown_command_leaves_out_where_this_machine_caches_the_parent():
    shown = ablations.shown_command(
        "python benchmarks/ablations.py --full --cache /tmp/c --gkd puzzle --cache=/x"
    )
    assert shown == "python benchmarks/ablations.py --full --gkd puzzle"


def test_spearman_matches_the_closed_form_without_ties():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=12), rng.normal(size=12)
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    closed = 1 - 6 * float(((rx - ry) ** 2).sum()) / (12 * (12**2 - 1))
    assert ablations.spearman(x, y) == pytest.approx(closed)
    assert ablations.spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)


# ------------------------------------------------------------------- issue 24: fine grid, seeds, test split

stats = sys.modules["ablation_stats"]  # the sibling module ablations.py imports


def test_the_fine_grid_meets_budgets_the_coarse_space_cannot():
    """Uniform pruning on the quick demo parent: width only (Minitron's widths, no block removed) the coarse
    space's one step per axis cannot reach 65% of the active parameters at all, the fine grid lands within
    1%; with removal, the coarse space misses 55% of the total parameters by over 5%, the fine grid by <1%."""
    from puzzle.presets.demo import demo_quick_parent_spec

    parent = demo_quick_parent_spec()
    fine = stats.fine_space(parent)
    assert fine["mamba"]["state_size"] == [14, 12, 10, 8, 6, 4]  # 0.875 ... 0.25 of 16
    assert fine["moe"]["num_experts"] == [7, 6, 5, 4, 3, 2]

    def gap(kinds, level, budget, noop):
        reached = stats.closest_under(stats.uniform_fractions(parent, kinds, budget, noop=noop), level)
        return math.inf if reached is None else level - reached

    assert gap(ablations.SPACE, 0.65, "active_params", noop=False) == math.inf
    assert gap(fine, 0.65, "active_params", noop=False) < 0.01
    assert gap(ablations.SPACE, 0.55, "params", noop=True) > 0.05
    assert gap(fine, 0.55, "params", noop=True) < 0.01
    for level in (0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4):
        assert gap(fine, level, "active_params", noop=True) < 0.02, level


def test_interpolation_at_known_points():
    points = [
        (0.4, math.exp(-1.0)),
        (0.6, math.exp(-3.0)),
        (0.6, math.exp(-5.0)),
    ]  # two at 0.6: logs averaged
    assert stats.interpolate(points, 0.4) == pytest.approx(math.exp(-1.0))
    assert stats.interpolate(points, 0.6) == pytest.approx(math.exp(-4.0))
    assert stats.interpolate(points, 0.5) == pytest.approx(math.exp(-2.5))  # linear in log KL
    assert math.isnan(stats.interpolate(points, 0.7)) and math.isnan(stats.interpolate(points, 0.3))
    # A little past the ends: the end segment extended (slope -15 per unit of size in log KL), not further.
    assert stats.interpolate(points, 0.62, reach=0.03) == pytest.approx(math.exp(-4.0 - 15 * 0.02))
    assert stats.interpolate(points, 0.38, reach=0.03) == pytest.approx(math.exp(-1.0 + 15 * 0.02))
    assert math.isnan(stats.interpolate(points, 0.64, reach=0.03))


def test_the_paired_ratio_interval_is_the_hand_computed_delta_method():
    a, b = [1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 2.0, 2.0]
    # means 5/2, 3/2; sample variances 5/3, 1/3; covariance 2/3:
    # var(log R) = (5/3 / (25/4) + 1/3 / (9/4) - 2 (2/3) / (15/4)) / 4 = (36 + 20 - 48) / 135 / 4 = 2/135
    se = math.sqrt(2 / 135)
    found = stats.paired_ratio(a, b)
    assert found["ratio"] == pytest.approx(5 / 3)
    assert found["low"] == pytest.approx(5 / 3 * math.exp(-1.959963984540054 * se))
    assert found["high"] == pytest.approx(5 / 3 * math.exp(1.959963984540054 * se))
    # Pairing matters: a method exactly twice Puzzle on every batch is 2x with no doubt at all, though
    # the batches themselves vary a lot; unpaired (reordered) the same numbers leave a wide interval.
    puzzle = [0.1, 0.5, 0.2, 0.9, 0.3]
    paired = stats.paired_ratio([2 * x for x in puzzle], puzzle)
    assert paired["low"] == pytest.approx(2.0) and paired["high"] == pytest.approx(2.0)
    shuffled = stats.paired_ratio([2 * x for x in reversed(puzzle)], puzzle)
    assert shuffled["high"] - shuffled["low"] > 1.0


def test_the_crossover_is_the_interpolated_zero_and_its_interval_holds_it():
    compressions = [0.1, 0.2, 0.3, 0.4]
    puzzle, uniform = [1.0] * 4, [0.5, 0.8, 2.0, 4.0]  # uniform better up to 20%, worse from 30%
    d0, d1 = math.log(0.8), math.log(2.0)
    assert stats.crossover(compressions, puzzle, uniform) == pytest.approx(0.2 + 0.1 * -d0 / (d1 - d0))
    assert stats.crossover(compressions, puzzle, [2.0] * 4) == -math.inf  # Puzzle better everywhere
    assert stats.crossover(compressions, puzzle, [2.0, 2.0, 2.0, 0.5]) == math.inf  # not at the largest
    # Batches without noise: every bootstrap draw finds the same crossover.
    levels = [1 - c for c in compressions]
    rng = np.random.default_rng(0)
    base = rng.uniform(0.5, 1.5, size=16)
    p = {lv: (lv, np.array([base])) for lv in levels}
    u = {lv: (lv, np.array([base * k])) for lv, k in zip(levels, uniform)}
    exact = stats.bootstrap_crossover(levels, p, u, draws=50)
    assert exact["crossover"] == pytest.approx(stats.crossover(compressions, puzzle, uniform))
    assert exact["low"] == pytest.approx(exact["crossover"]) and exact["high"] == pytest.approx(
        exact["crossover"]
    )
    noisy = {
        lv: (lv, np.array([base * k * rng.uniform(0.7, 1.3, size=16)])) for lv, k in zip(levels, uniform)
    }
    spread = stats.bootstrap_crossover(levels, p, noisy, draws=200)
    assert spread["low"] <= spread["crossover"] <= spread["high"] and spread["high"] > spread["low"]


def test_the_named_parents():
    deep = ablations.parent_spec("deep")
    assert deep.num_blocks >= 19 and {b.kind for b in deep.blocks} == {"mamba", "moe", "attention"}
    # The new parent differs from deep in pattern and in proportions of every kind.
    wide = ablations.parent_spec("wide")
    share = lambda spec, kind: sum(b.kind == kind for b in spec.blocks) / spec.num_blocks  # noqa: E731
    assert [b.kind for b in wide.blocks] != [b.kind for b in deep.blocks][: wide.num_blocks]
    assert all(share(wide, kind) != share(deep, kind) for kind in ("mamba", "moe", "attention"))
    tokens = lambda s: s.steps * s.batch_size * s.seq_len  # noqa: E731
    assert tokens(ablations.QUICK_PARENT) > 2 * tokens(ablations.QUICK_SETTINGS)  # trained longer than ~41k


@pytest.fixture(scope="module")
def fine(tmp_path_factory):
    """A tiny parent over a fine grid (two steps per axis), two levels, two GKD seeds, a test split and
    total-parameter budgets."""
    root = tmp_path_factory.mktemp("fine")
    parent = tiny_parent(root)
    size = tiny_size(
        ablations, bld_tokens=256, gkd_tokens=128, space=stats.fine_space(parent.model.spec, (0.75, 0.5))
    )
    run, config = ablations.prepare_config(parent, size, root / "run")
    data = ablations.ablate(
        run,
        levels=(0.8, 0.6),
        methods=("puzzle", "homogeneous", "greedy", "random"),
        gkd_methods=("puzzle", "homogeneous", "greedy"),
        seeds=2,
        log=lambda _: None,
        gkd_seeds=2,
        test_tokens=512,
        params_methods=("puzzle", "homogeneous"),
    )
    data["meta"] = {"levels": [0.8, 0.6]}
    data["analysis"] = ablations.analysis(data)
    return data, run, config


def test_the_test_split_is_held_out_files_the_scoring_never_reads(fine):
    _, run, _ = fine
    scoring, test = run.held_out_batches(), ablations.test_split(run, 512)
    assert test and sum(b.numel() for b in test) >= 512
    assert run.config.data.test_fraction == pytest.approx(
        run.config.data.held_out_fraction * ablations.TEST_SHARE
    )
    # Whole files (the demo corpus's documents) of the parent's held-out ones, so the parent never trained
    # on them (tests/test_test_split.py: no stage of a run reads them). Rows are compared with the scoring
    # held-out only: train has rows of 32 spaces too, the same bytes from other files.
    settings = run.config.data
    tested = run.data.test_documents
    parents = held_out_documents(run.data.documents, settings.held_out_fraction, settings.split_seed)
    assert int(tested.sum()) >= 1 and bool((parents | ~tested).all())
    seen = {tuple(row.tolist()) for batch in scoring for row in batch}
    assert not any(tuple(row.tolist()) in seen for batch in test for row in batch)


def test_a_run_without_test_files_has_no_test_split(fine, monkeypatch):
    _, run, _ = fine
    monkeypatch.setattr(run.data, "test", None)  # data.test_fraction 0
    with pytest.raises(ValueError, match="no test split"):
        ablations.test_split(run, 512)


def test_reported_numbers_come_from_the_test_split_and_each_gkd_seed(fine):
    data, run, _ = fine
    rows = [r for r in data["rows"] if r["feasible"] and r["budget"] == "active_params"]
    bench = ablations.Bench(run, init_scores=False, test_tokens=512)
    puzzle = next(r for r in rows if r["method"] == "puzzle" and r["level"] == 0.6)
    arch = tuple(
        bench.kl.variants[b][[s.short_name() for s in bench.kl.variants[b]].index(n)]
        for b, n in enumerate(puzzle["blocks"])
    )
    child = bench.child(arch, "bld")
    on_test = ablations.measured_kl(child, bench.parent, bench.test, run.config.scoring.vocab_chunk)
    on_scoring = ablations.measured_kl(child, bench.parent, bench.held_out, run.config.scoring.vocab_chunk)
    assert puzzle["before"]["kl"] == pytest.approx(on_test["kl"], rel=1e-5)
    assert puzzle["scoring"]["kl"] == pytest.approx(on_scoring["kl"], rel=1e-5)
    assert puzzle["before"]["kl"] != pytest.approx(puzzle["scoring"]["kl"], rel=1e-6)
    assert len(puzzle["after_seeds"]) == 2
    first, second = (s["kl"] for s in puzzle["after_seeds"])
    assert first != pytest.approx(second, rel=1e-7)  # the GKD seed changes the child
    assert [s["gkd"]["seed"] for s in puzzle["after_seeds"]] == [0, 1]


def test_paired_ratios_per_seed_and_within_level_spearman(fine):
    data, _, _ = fine
    rows = {
        (r["method"], r["level"]): r for r in data["rows"] if r["feasible"] and r["budget"] == "active_params"
    }
    paired = data["analysis"]["paired"]["greedy"]["0.6"]
    greedy, puzzle = rows[("greedy", 0.6)], rows[("puzzle", 0.6)]
    assert paired["before"] == stats.paired_ratio(
        greedy["before"]["kl_batches"], puzzle["before"]["kl_batches"]
    )
    assert len(paired["after"]) == 2
    for seed in (0, 1):
        assert paired["after"][seed] == stats.paired_ratio(
            greedy["after_seeds"][seed]["kl_batches"], puzzle["after_seeds"][seed]["kl_batches"]
        )
    within = data["summary"]["spearman_within"]
    assert set(within) == {"0.8", "0.6"}
    for level in (0.8, 0.6):
        children = {
            tuple(r["blocks"]): (r["predicted_kl"], r["scoring"]["kl"])
            for r in data["rows"]
            if r["feasible"] and r["level"] == level and r["budget"] == "active_params"
        }
        p, m = zip(*children.values())
        expected = stats.spearman(p, m)
        assert within[str(level)] == pytest.approx(expected, nan_ok=True)
        assert data["summary"]["children_within"][str(level)] == len(children)


def test_total_parameter_budgets_and_equal_size(fine):
    data, _, _ = fine
    totals = [r for r in data["rows"] if r["budget"] == "params" and r["feasible"]]
    assert {r["method"] for r in totals} == {"puzzle", "homogeneous"}
    assert all(r["params_fraction"] <= r["level"] + 1e-9 for r in totals)
    distilled = {tuple(r["blocks"]) for r in data["rows"] if r["feasible"] and r["budget"] == "active_params"}
    # Assembled and measured, not distilled (a child some active-parameter method distilled shows its GKD).
    assert all(r["after"] is None for r in totals if tuple(r["blocks"]) not in distilled)
    equal = data["analysis"]["equal_size"]["before"]
    puzzle_curve = [(e["size"], e["kl"]) for e in equal["puzzle"].values()]
    for entry in equal["puzzle"].values():  # Puzzle's own curve at its own sizes: itself
        assert entry["ratio_at_size"] == pytest.approx(1.0)
    for entry in equal["homogeneous"].values():
        expected = stats.interpolate(puzzle_curve, entry["size"], stats.REACH)
        assert entry["puzzle_at_size"] == pytest.approx(expected, nan_ok=True)
    assert "equal_size_params" in data["analysis"]
    lines = "\n".join(ablations.evidence_sections(data))
    assert "Paired ratios to Puzzle" in lines and "Equal size (active parameters)" in lines


def test_the_search_options_against_the_mip_and_refilled_greedy(fine):
    """--additivity on the tiny run: the plain option is the benchmark's own MIP, re-ranking never keeps a
    child that measures worse than the MIP's best, and the goals are evaluated."""
    _, run, config = fine
    result = ablations.additivity(
        run,
        config,
        0.6,
        options=("mip", "rerank", "context"),
        gkd_seeds=1,
        test_tokens=512,
        draws=3,
        walks=4,
        log=lambda _: None,
    )
    f = result["figures"]
    bench = ablations.Bench(run, init_scores=False)
    mip = ablations.Problem(run, bench.kl, 0.6).mip()
    assert f["mip"]["blocks"] == [b.short_name() for b in mip]
    # The expansion around a child predicts that child exactly (its own KL in its context is its measured).
    for name in ("mip", "context"):
        own = next(c for c in f["spearman_children"] if c["blocks"] == f[name]["blocks"])
        assert own["predicted"][f"around {name}"] == pytest.approx(own["measured_kl"], rel=1e-5, abs=1e-7)
    assert {"all", "search", "walk"} <= set(f["rankings"])
    assert f["rankings"]["all"]["children"] == f["children"]
    assert f["rankings"]["all"]["sum"]["spearman"] == pytest.approx(f["spearman_within"])
    # The short-GKD re-ranking study: every searched child got a quarter of the GKD tokens, then the full GKD.
    study = f["gkd_rerank"]
    assert study["children"] == f["rankings"]["search"]["children"] and study["fraction"] == 0.25
    for ranked_by in ("before", "short_gkd"):
        assert study[ranked_by]["pick"] >= 1.0 and len(study[ranked_by]["greedy_ratio_after"]) == 1
    tokens = study["tokens"]
    # At least one optimiser step, never more than the full GKD (here the full GKD is one step).
    assert all(0 < short <= full for short, full in zip(tokens["short"], tokens["full"], strict=True)), tokens
    assert f["rerank"]["measured_kl"] <= f["mip"]["measured_kl"] + 1e-9
    assert f["rerank"]["record"]["rerank"]["candidates"]
    assert f["context"]["record"]["context"]["rounds"]
    assert f["children"] >= 3 and len(f["spearman_children"]) == f["children"]
    children = f["spearman_children"]
    closed = _closed_form_spearman(
        [c["predicted_kl"] for c in children], [c["measured_kl"] for c in children]
    )
    assert math.isclose(f["spearman_within"], closed, abs_tol=1e-12)
    for name in ("mip", "rerank", "context"):
        assert set(f[name]["goals"]) == {
            "spearman_within_0.8",
            "measured_within_1.5x",
            "beats_greedy_every_seed",
            "beats_greedy_over_the_seeds",
        }
        assert len(f[name]["greedy_ratio_after"]) == 1
        pooled = f[name]["greedy_ratio_after_pooled"]  # one GKD seed: the batch bootstrap alone
        assert pooled["seeds"] == 1 and pooled["ratio"] == pytest.approx(
            f[name]["greedy_ratio_after"][0]["ratio"]
        )
        assert f[name]["goals"]["beats_greedy_over_the_seeds"] == (pooled["low"] > 1)
    text = ablations.additivity_markdown(result, {"parent": "tiny", "command": "x", "seconds": 1.0})
    assert "| rerank |" in text and "| greedy |" in text


def test_puzzle_rerank_keeps_the_candidate_of_least_short_gkd_kl(result):
    """puzzle_rerank is the run's own `search.rerank: {by: short_gkd}`: its candidates are the MIP's best,
    refilled greedy's and the best uniform pruning's children at the budget (the benchmark's own baselines),
    and its pick is the candidate that a short GKD of each one, distilled again here by the bench, leaves
    with the least KL on the scoring held-out; its cost is the short GKDs' tokens over one full GKD's."""
    data, run, _ = result
    level = 0.6
    r = next(r for r in data["rows"] if r["method"] == "puzzle_rerank")
    assert r["feasible"] and r["active_fraction"] <= level + 1e-9, r
    record = r["rerank"]
    candidates = record["candidates"]
    bench = ablations.Bench(run, init_scores=False)
    problem = ablations.Problem(run, bench.kl, level)
    archs = [tuple(run.child_of({"choices": c["choices"]}).spec.blocks) for c in candidates]
    by_source = {source: arch for c, arch in zip(candidates, archs, strict=True) for source in c["sources"]}
    assert by_source["mip-1"] == problem.mip()
    assert by_source["greedy"] == problem.greedy()
    assert by_source["uniform"] == problem.homogeneous()[0]
    assert len(set(archs)) == len(archs)  # identical children are one candidate
    # Brute force: every candidate distilled for the same short GKD by the bench's own path.
    fraction = ablations.RERANK["tokens"]
    shorts = [bench.short_gkd(arch, f"oracle-{i}", fraction)["kl"] for i, arch in enumerate(archs)]
    assert shorts == pytest.approx([c["short_gkd_kl"] for c in candidates], rel=1e-4)
    best = min(range(len(archs)), key=shorts.__getitem__)
    assert record["chosen"] == best + 1 and r["blocks"] == [b.short_name() for b in archs[best]]
    assert set(record["won_by"]) == {source_kind(s) for s in candidates[best]["sources"]}
    cost = r["rerank_cost"]
    assert cost["short_tokens"] == sum(c["tokens"] for c in candidates)
    assert cost["tokens_multiple"] == pytest.approx(cost["short_tokens"] / r["gkd"]["tokens"])
    assert cost["seconds"] > 0 and r["after"]["kl"] > 0


def test_puzzle_rerank_needs_the_config_and_the_active_parameter_budget(fine):
    _, run, config = fine
    rerank = {"short_tokens": 96, "seconds": 9.0, "candidates": [{"seconds": 1.0}, {"seconds": 2.0}]}
    assert ablations.rerank_cost(rerank, {"tokens": 64}, [2.0, 6.0, 4.0]) == {
        "short_tokens": 96,
        "full_tokens": 64,
        "tokens_multiple": 1.5,
        "seconds": 3.0,
        "seconds_of": "short GKDs",
        "full_seconds": 4.0,
        "full_gkds_timed": 3,
        "seconds_multiple": 0.75,
    }
    untimed = ablations.rerank_cost({**rerank, "candidates": [{"seconds": None}]}, None, [])
    assert (
        untimed["seconds"] == 9.0
        and untimed["seconds_multiple"] is None
        and untimed["tokens_multiple"] is None
    )
    with pytest.raises(ValueError, match="config data"):
        ablations.ablate(run, levels=(0.6,), methods=("puzzle_rerank",), gkd_methods=(), log=lambda _: None)
    with pytest.raises(ValueError, match="budget params"):
        ablations.ablate(
            run,
            levels=(0.6,),
            methods=(),
            gkd_methods=(),
            log=lambda _: None,
            params_methods=("puzzle_rerank",),
            config=config,
        )


def test_random_walks_end_at_the_budget_with_no_upgrade_left_that_fits(fine):
    """Each walk meets the budget and the rules, no single-block upgrade of it still fits (it ends just under
    the budget), the same seed walks the same way, and different seeds reach different architectures."""
    _, run, _ = fine
    bench = ablations.Bench(run, init_scores=False)
    problem = ablations.Problem(run, bench.kl, 0.6)
    table, cost = problem.table, problem.table.cost("active_params")
    walks = [problem.random_walk(seed) for seed in range(6)]
    assert all(w is not None for w in walks) and len(set(walks)) >= 3
    assert problem.random_walk(0) == walks[0]
    rows = {(b, spec): j for b, specs in enumerate(bench.kl.variants) for j, spec in enumerate(specs)}
    states = table.attrs.get("state_size", [None] * table.num_variants)
    for walk in walks:
        choices = [rows[(b, spec)] for b, spec in enumerate(walk)]
        assert problem.feasible(np.array([choices]))[0]
        # The walk keeps the one state size it drew: upgrades within it.
        drawn = {states[table.offsets[b] + c] for b, c in enumerate(choices)} - {None}
        for b in range(table.num_blocks):
            for j in range(table.offsets[b + 1] - table.offsets[b]):
                row = table.offsets[b] + j
                if cost[row] > cost[table.offsets[b] + choices[b]] and (
                    states[row] is None or {states[row]} >= drawn
                ):
                    trial = list(choices)
                    trial[b] = j
                    assert not problem.feasible(np.array([trial]))[0], (b, j)


def test_rankings_give_each_predictors_spearman_and_pick_per_group():
    measured = [1.0, 2.0, 3.0, 4.0, 5.0]
    groups = ["near", "near", "near", "far", "far"]
    predictors = {"right": [0.1, 0.2, 0.3, 0.4, 0.5], "wrong": [0.5, 0.4, 0.3, 0.2, 0.1]}
    out = ablations.rankings(predictors, measured, groups)
    assert out["all"]["children"] == 5 and out["near"]["children"] == 3 and out["far"]["children"] == 2
    assert out["all"]["right"] == {"spearman": pytest.approx(1.0), "pick": 1.0}
    assert out["all"]["wrong"] == {"spearman": pytest.approx(-1.0), "pick": 5.0}  # picks the worst child
    assert out["near"]["wrong"]["pick"] == 3.0 and out["far"]["right"]["spearman"] is None
    assert out["far"]["wrong"]["pick"] == 5.0 / 4.0


def test_the_replication_verdicts_rest_on_the_interval_over_the_gkd_seeds():
    beyond = {"ratio": 1.5, "low": 1.2, "high": 1.8}
    within = {"ratio": 1.1, "low": 0.9, "high": 1.3}
    below = {"ratio": 0.6, "low": 0.5, "high": 0.7}
    assert ablations._verdict(beyond) == "1.50 +"
    assert ablations._verdict(within) == "1.10 ~"
    assert ablations._verdict(below) == "0.60 -"
    assert ablations._verdict(None) == "-"
    # The case: greedy's child 0.97x, 0.87x and 0.92x Puzzle's after three GKD seeds, each seed's
    # batch interval below 1 (the old verdict: "-", greedy lower beyond the noise in every seed). Over the
    # seeds the interval holds 1: no claim. Uniform pruning 1.5x in every seed stays "+".
    rng = np.random.default_rng(0)
    batches = rng.lognormal(0.0, 0.4, size=(3, 16))

    def row(method, ratios):
        kls = [b * k * rng.lognormal(0.0, 0.01, 16) for b, k in zip(batches, ratios)]
        seeds = [{"kl": float(v.mean()), "kl_batches": list(v)} for v in kls]
        return {
            "method": method,
            "level": 0.7,
            "budget": "active_params",
            "feasible": True,
            "before": {"kl": float(batches[0].mean()), "kl_batches": list(batches[0])},
            "after_seeds": seeds,
        }

    data = {
        "meta": {"levels": [0.7]},
        "rows": [row("puzzle", (1, 1, 1)), row("greedy", (0.97, 0.87, 0.92)), row("homogeneous", (1.5,) * 3)],
    }
    data["analysis"] = {"paired": ablations.paired_ratios(data)}
    greedy = data["analysis"]["paired"]["greedy"]["0.7"]
    assert all(r["high"] < 1 for r in greedy["after"])  # every seed alone: "beyond the noise"
    assert greedy["after_pooled"]["low"] < 1 < greedy["after_pooled"]["high"]
    table = "\n".join(ablations.verdict_table({"quick-s0": data}))
    assert "| greedy | quick-s0 | 0.92 ~ |" in table
    assert "| homogeneous | quick-s0 | 1.49 + |" in table  # 1.5x times the per-cell noise


def test_runs_one_level_each_merge_into_the_page_of_one_run():
    """`--merge`: quick-s0-rerank's page, split back into its per-level runs (in another order), merges into
    the same rows, and the summary and analysis of them all; parts of another library or a repeated level
    are refused."""
    import json
    from pathlib import Path

    ablations = benchmark_module("ablations")
    page = Path(__file__).parents[1] / "benchmarks/results/replicate-seeds/quick-s0-rerank.json"
    whole = json.loads(page.read_text())
    parts = []
    for level, command in zip(whole["meta"]["levels"], whole["meta"]["commands"]):
        part = {key: whole[key] for key in ablations.SHARED_BY_LEVELS}
        part["rows"] = [row for row in whole["rows"] if row["level"] == level]
        part["meta"] = {**whole["meta"], "levels": [level], "command": command, "seconds": 1.0}
        part["summary"] = ablations.summarize(part["rows"])
        del part["meta"]["commands"]
        parts.append(part)
    merged = ablations.merge_levels(parts[::-1])
    assert merged["rows"] == whole["rows"] and merged["meta"]["levels"] == whole["meta"]["levels"]
    assert merged["meta"]["command"] == whole["meta"]["command"]
    assert merged["meta"]["commands"] == whole["meta"]["commands"] and merged["meta"]["seconds"] == 4.0
    assert merged["summary"] == ablations.summarize(whole["rows"])
    assert merged["analysis"] == ablations.analysis(whole) and merged["findings"] == ablations.findings(whole)
    other = {**parts[1], "variants": parts[1]["variants"] + 1}
    with pytest.raises(ValueError, match="differ in 'variants'"):
        ablations.merge_levels([parts[0], other])
    with pytest.raises(ValueError, match="repeat a level"):
        ablations.merge_levels([parts[0], parts[0]])
