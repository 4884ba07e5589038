"""benchmarks/ablations.py on a tiny trained demo parent: every method meets the budget, the MIP's predicted KL
is the least of the methods that search the same table, the restricted spaces keep their axis, the tables and
the plot are written, and the numpy Spearman matches the closed form."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from puzzle.demo.corpus import stdlib_root
from puzzle.demo.parent import TrainSettings, demo_parent
from puzzle.presets.demo import demo_spec
from puzzle.spec import MambaSpec, MoESpec

ROOT = Path(__file__).resolve().parents[1]
TINY_PARENT = TrainSettings(seq_len=32, batch_size=4, steps=25, lr=1e-2, warmup_steps=3, held_out_sequences=4)


def _module():
    spec = importlib.util.spec_from_file_location("ablations", ROOT / "benchmarks" / "ablations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ablations"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ablations = _module()


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("ablations")
    parent = demo_parent(
        root / "cache",
        progress=False,
        spec=demo_spec("ME*E", 32, num_experts=4, top_k=2, num_heads=4),
        settings=TINY_PARENT,
        corpus_root=stdlib_root() / "email",
    )
    size = dataclasses.replace(
        ablations.SMOKE,
        seq_len=32,
        held_out_tokens=512,
        importance_tokens=256,
        bld_tokens=512,
        gkd_tokens=256,
    )
    run = ablations.prepare(parent, size, root / "run")
    data = ablations.ablate(run, levels=(0.6,), gkd_methods=("puzzle",), seeds=2, log=lambda _: None)
    return data, run, root


def test_every_method_meets_the_budget_and_the_mip_predicts_least(result):
    data, _, _ = result
    rows = [r for r in data["rows"] if r["feasible"]]
    methods = {r["method"] for r in rows}
    assert {
        "puzzle",
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
