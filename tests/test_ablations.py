"""benchmarks/ablations.py on a tiny trained demo parent: every method meets the budget, the MIP's predicted KL
is the least of the methods that search the same table, the restricted spaces keep their axis, the tables and
the plot are written, and the numpy Spearman matches the closed form."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
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
    assert {"puzzle", "homogeneous", "greedy", "random", "mip_no_bld", "mip_lm_loss"} <= methods
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
    assert -1 <= data["summary"]["spearman_bld"] <= 1 or math.isnan(data["summary"]["spearman_bld"])


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
