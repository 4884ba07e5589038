"""benchmarks/precision.py on a tiny trained demo parent: each method stays within the weight-memory budget in
the formats it may use, the joint search predicts no more KL than the searches over a subset of its table, the
paired ratios are the ratios of the measured means, and the report names every method."""

from __future__ import annotations

import math

import pytest
from ablation_helpers import benchmark_module, tiny_parent, tiny_size

ablations = benchmark_module("ablations")
precision = benchmark_module("precision")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    size = tiny_size(ablations, space=precision.precision_space(ablations.SPACE))
    run = ablations.prepare(tiny_parent(root), size, root / "run")
    data = precision.evaluate(run, levels=(0.6,), gkd_seeds=1, test_tokens=256, log=lambda _: None)
    return data, run


def test_each_method_meets_the_weight_budget_in_its_own_formats(result):
    data, _ = result
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == set(precision.METHODS)
    allowed = {"joint": {"bf16", "fp8", "nvfp4"}, "shape+fp8": {"fp8"}, "shape-bf16": {"bf16"}}
    for method, formats in allowed.items():
        r = rows[method]
        assert r["feasible"], method
        assert r["weight_fraction"] <= 0.6 + 1e-9, (method, r["weight_fraction"])
        assert set(r["formats"]) - {"removed"} <= formats, (method, r["formats"])
    assert rows["nvfp4"]["level"] is None and set(rows["nvfp4"]["formats"]) <= {"nvfp4", "bf16"}
    assert "nvfp4" in rows["nvfp4"]["formats"]
    # The joint search's table holds the other searches' candidates: an exact MIP predicts no more KL.
    for method in ("shape+fp8", "shape-bf16"):
        assert rows["joint"]["predicted_kl"] <= rows[method]["predicted_kl"] + 1e-9, method
    # Each child and the parent get a predicted throughput at the fixed per-user speed.
    assert (
        rows["joint"]["throughput"]["tokens_per_s"] > 0 and data["parent"]["throughput"]["tokens_per_s"] > 0
    )


def test_the_paired_ratios_are_the_ratios_of_the_measured_means(result):
    data, _ = result
    rows = {r["method"]: r for r in data["rows"]}
    entry = data["comparison"]["ratios"]["0.60"]["shape-bf16"]
    mine, joint = rows["shape-bf16"], rows["joint"]
    expected = sum(mine["before"]["kl_batches"]) / sum(joint["before"]["kl_batches"])
    assert math.isclose(entry["before"]["ratio"], expected, rel_tol=1e-9)
    after = [a["kl_batches"] for a in mine["after_seeds"]], [a["kl_batches"] for a in joint["after_seeds"]]
    assert math.isclose(entry["after"][0]["ratio"], sum(after[0][0]) / sum(after[1][0]), rel_tol=1e-9)
    assert entry["before"]["low"] <= entry["before"]["ratio"] <= entry["before"]["high"]


def test_a_restricted_search_never_takes_the_excluded_parent_block(result):
    _, run = result
    bench = ablations.Bench(run, init_scores=False)
    fp8 = precision.only_format(bench.kl, "fp8")
    for b, (specs, scores) in enumerate(zip(fp8.variants, fp8.scores)):
        assert specs[0] == bench.spec.blocks[b] and scores[0] == precision.EXCLUDED
        assert all(precision.format_of(s) in ("fp8", "removed") for s in specs[1:])
    assert precision.in_format(tuple(bench.spec.blocks), "fp8") is None
    assert precision.in_format(tuple(bench.spec.blocks), "bf16") == tuple(bench.spec.blocks)


def test_the_report_names_every_method_and_the_verdicts(result):
    data, _ = result
    data = {
        **data,
        "meta": {"command": "python benchmarks/precision.py", "parent": "tiny", "gkd_tokens": 256},
    }
    data["meta"].update(seconds=1.0, machine="test")
    text = precision.markdown(data)
    for name in precision.NAMES.values():
        assert name in text
    assert "## Against the goal" in text and "60%, shape search, bf16:" in text
