"""`puzzle search` on synthetic libraries in NVIDIA's formats (NVlabs block_library.json, puzzletron replacements)."""

from __future__ import annotations

import csv
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from puzzle.cli import main

WIDTHS = (1.0, 0.75, 0.5, 0.25)


def _library(num_layers: int = 5, seed: int = 0) -> dict:
    """An NVlabs-shaped library: per layer, variants from the parent (first) down to 25% width."""
    rng = np.random.default_rng(seed)
    library = {}
    for layer in range(num_layers):
        variants = {}
        for width in WIDTHS:
            name = f"attention = 8 kv heads\t&&\tffn = intermediate size (parent * {int(width * 100)}%)"
            variants[name] = {
                "stats": {
                    "memory_mib": round(400 + 1000 * width * rng.uniform(0.9, 1.1), 3),
                    "runtime_ms": round(200 + 600 * width**0.9 * rng.uniform(0.9, 1.1), 3),
                    "num_params": int(1e8 + 7e8 * width),
                    "state_size": 128 if width >= 0.5 else 64,
                },
                "metrics": {
                    "kl_div": 0.0 if width == 1.0 else round(float(rng.uniform(0.2, 1.0) * (1 - width)), 5),
                    "lm_loss": 1.6 + (1 - width) * 0.01,
                },
            }
        library[f"layer_{layer}"] = variants
    return library


@pytest.fixture
def library_file(tmp_path: Path) -> tuple[Path, dict]:
    library = _library()
    path = tmp_path / "block_library.json"
    path.write_text(json.dumps(library, indent=1))
    return path, library


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["search", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _brute(library: dict, budgets: dict[str, float]) -> float:
    layers = list(library)
    best = np.inf
    for combo in itertools.product(*[list(library[layer].values()) for layer in layers]):
        if all(sum(v["stats"][key.split(".")[1]] for v in combo) <= bound for key, bound in budgets.items()):
            best = min(best, sum(v["metrics"]["kl_div"] for v in combo))
    return best


def _parent_total(library: dict, stat: str) -> float:
    return sum(next(iter(variants.values()))["stats"][stat] for variants in library.values())


def test_json_shape_and_optimum(capsys, library_file):
    path, library = library_file
    budget = 0.7 * _parent_total(library, "memory_mib")
    code, out, _ = _run(capsys, "--library", str(path), "--budget", f"stats.memory_mib<={budget}", "--json")
    assert code == 0
    result = json.loads(out)
    assert set(result) >= {"objective", "status", "gap", "solver", "seconds", "choices", "totals"}
    assert result["status"] == "optimal"
    assert list(result["choices"]) == list(library)
    chosen = [library[layer][name] for layer, name in result["choices"].items()]
    assert result["objective"] == pytest.approx(sum(v["metrics"]["kl_div"] for v in chosen))
    assert result["totals"]["stats.memory_mib"] == pytest.approx(
        sum(v["stats"]["memory_mib"] for v in chosen)
    )
    assert result["totals"]["stats.memory_mib"] <= budget
    assert result["objective"] == pytest.approx(_brute(library, {"stats.memory_mib": budget}), abs=1e-9)


def test_relative_budgets_equal_absolute(capsys, library_file):
    path, library = library_file
    memory, runtime = _parent_total(library, "memory_mib"), _parent_total(library, "runtime_ms")
    relative = _run(
        capsys,
        "--library",
        str(path),
        "--budget",
        "stats.memory_mib<=0.6x",
        "--budget",
        "stats.runtime_ms<=0.8x",
        "--json",
    )
    absolute = _run(
        capsys,
        "--library",
        str(path),
        "--budget",
        f"stats.memory_mib<={0.6 * memory}",
        "--budget",
        f"stats.runtime_ms<={0.8 * runtime}",
        "--json",
    )
    assert relative[0] == absolute[0] == 0
    rel, ab = json.loads(relative[1]), json.loads(absolute[1])
    assert rel["choices"] == ab["choices"]
    assert rel["totals"]["stats.memory_mib"] <= 0.6 * memory + 1e-9
    expected = _brute(library, {"stats.memory_mib": 0.6 * memory, "stats.runtime_ms": 0.8 * runtime})
    assert rel["objective"] == pytest.approx(expected, abs=1e-9)


def test_infeasible_budget_exit_code_2_names_budget(capsys, library_file):
    path, library = library_file
    smallest = sum(min(v["stats"]["memory_mib"] for v in variants.values()) for variants in library.values())
    code, out, err = _run(
        capsys,
        "--library",
        str(path),
        "--budget",
        "stats.memory_mib<=1000",
        "--budget",
        "stats.runtime_ms<=0.9x",
        "--json",
    )
    assert code == 2
    assert "stats.memory_mib<=1000" in err
    payload = json.loads(out)
    assert payload["status"] == "infeasible"
    assert payload["budget"] == "stats.memory_mib<=1000"
    assert payload["best"] == pytest.approx(smallest)


def test_k_best_with_diversity(capsys, library_file):
    path, _ = library_file
    code, out, _ = _run(
        capsys,
        "--library",
        str(path),
        "--budget",
        "stats.memory_mib<=0.7x",
        "--solutions",
        "3",
        "--min-diff",
        "2",
        "--json",
    )
    assert code == 0
    results = json.loads(out)
    assert len(results) == 3
    objectives = [r["objective"] for r in results]
    assert objectives == sorted(objectives)
    for a, b in itertools.combinations(results, 2):
        assert sum(a["choices"][k] != b["choices"][k] for k in a["choices"]) >= 2


def test_counts_and_seconds_read_as_every_command_reads_numbers(capsys, library_file):
    """`puzzle search` takes `3e0` solutions and `1e3` seconds, as `puzzle costs` takes `--context 1e6`."""
    path, _ = library_file
    common = ("--library", str(path), "--budget", "stats.memory_mib<=0.7x", "--json")
    code, out, _ = _run(capsys, *common, "--solutions", "3e0", "--min-diff", "2", "--time-limit", "1e3")
    assert code == 0 and len(json.loads(out)) == 3
    with pytest.raises(SystemExit) as caught:  # a count must still come out whole
        _run(capsys, *common, "--solutions", "2.5")
    assert caught.value.code == 2 and "--solutions" in capsys.readouterr().err


def test_same_rule_and_keep_block(capsys, library_file):
    path, library = library_file
    code, out, _ = _run(
        capsys,
        "--library",
        str(path),
        "--budget",
        "stats.memory_mib<=0.75x",
        "--same",
        "stats.state_size",
        "--keep-block",
        "layer_2",
        "--json",
    )
    assert code == 0
    result = json.loads(out)
    states = {library[layer][name]["stats"]["state_size"] for layer, name in result["choices"].items()}
    assert len(states) == 1
    assert result["choices"]["layer_2"] == next(iter(library["layer_2"]))


def test_sweep_writes_frontier(capsys, library_file, tmp_path):
    path, _ = library_file
    prefix = tmp_path / "out" / "frontier"
    code, out, _ = _run(
        capsys,
        "--library",
        str(path),
        "--sweep",
        "stats.memory_mib=0.5x,0.6x,0.8x,1.0x,0.1x",
        "--frontier",
        str(prefix),
        "--json",
    )
    assert code == 0
    points = json.loads(out)
    assert [p["budget"] for p in points] == [
        f"stats.memory_mib<={v}x" for v in ("0.5", "0.6", "0.8", "1", "0.1")
    ]
    assert points[-1]["status"] == "infeasible"
    objectives = [p["objective"] for p in points[:4]]
    assert objectives == sorted(objectives, reverse=True)  # more memory, lower KL
    rows = list(csv.DictReader(prefix.with_suffix(".csv").open()))
    assert len(rows) == 5 and "stats.runtime_ms" in rows[0] and "architecture" in rows[0]
    assert json.loads(prefix.with_suffix(".json").read_text())[0]["budget"] == points[0]["budget"]
    pytest.importorskip("matplotlib")  # the plot is an optional extra
    assert prefix.with_suffix(".png").stat().st_size > 1000


def test_puzzletron_replacements_match_nvlabs(capsys, library_file, tmp_path):
    path, library = library_file
    replacements = {}
    for layer_index, variants in enumerate(library.values()):
        for variant_index, (name, variant) in enumerate(reversed(list(variants.items()))):
            replacements[f"replacement_{len(replacements)}"] = {
                **variant,
                "block_config": {"attention": {"no_op": False}, "ffn": {"intermediate_size": 1000}},
                "block_repr": name,
                "parent_layer_indices": [layer_index],
                "is_teacher": variant_index == len(variants) - 1,  # listed last, must still be the parent
            }
    other = tmp_path / "replacement_metrics_and_stats.json"
    other.write_text(json.dumps(replacements))
    nvlabs = json.loads(
        _run(capsys, "--library", str(path), "--budget", "stats.runtime_ms<=0.7x", "--json")[1]
    )
    code, out, _ = _run(capsys, "--library", str(other), "--budget", "stats.runtime_ms<=0.7x", "--json")
    assert code == 0
    puzzletron = json.loads(out)
    assert puzzletron["objective"] == pytest.approx(nvlabs["objective"])
    assert list(puzzletron["choices"].values()) == list(nvlabs["choices"].values())

    replacements["replacement_0"]["parent_layer_indices"] = [0, 1]
    other.write_text(json.dumps(replacements))
    code, _, err = _run(capsys, "--library", str(other), "--budget", "stats.runtime_ms<=0.7x")
    assert code == 1 and "spans parent layers [0, 1]" in err


def test_bad_input_names_the_key(capsys, library_file, tmp_path):
    path, library = library_file
    del library["layer_3"][next(iter(library["layer_3"]))]["stats"]["runtime_ms"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(library))
    code, _, err = _run(capsys, "--library", str(broken), "--budget", "stats.runtime_ms<=0.7x")
    assert code == 1
    assert "layer 'layer_3'" in err and "'stats.runtime_ms'" in err
    code, _, err = _run(capsys, "--library", str(path), "--budget", "stats.memory_mib<0.7x")
    assert code == 1 and "cannot read budget" in err


def test_command_line_end_to_end(library_file):
    """The installed entry point: clean JSON on stdout (no solver banner) and exit code 2."""
    path, _ = library_file
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "puzzle",
            "search",
            "--library",
            str(path),
            "--budget",
            "stats.memory_mib<=0.7x",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["status"] == "optimal"
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "puzzle",
            "search",
            "--library",
            str(path),
            "--budget",
            "stats.memory_mib<=10",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "stats.memory_mib<=10" in bad.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ("--gap", "-1"),
        ("--gap", "5"),
        ("--gap", "nan"),
        ("--gap", "1"),
        ("--time-limit", "-1"),
        ("--time-limit", "0"),
        ("--time-limit", "nan"),
        ("--time-limit", "inf"),
    ],
)
def test_solver_flags_that_make_no_sense_exit_2(capsys, library_file, flags):
    path, _ = library_file
    with pytest.raises(SystemExit) as caught:
        main(["search", "--library", str(path), "--budget", "stats.memory_mib<=0.7x", *flags])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert flags[0] in err and "Traceback" not in err


def _fails(capsys, *argv: str) -> tuple[int, str]:
    """Run `puzzle search` expecting a clean failure: (exit code, stderr); never a traceback."""
    try:
        code = main(["search", *argv])
    except SystemExit as exit_:  # argparse errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code in (1, 2), err
    assert "Traceback" not in err
    return code, err


def test_library_that_is_a_directory(capsys, tmp_path):
    code, err = _fails(capsys, "--library", str(tmp_path), "--budget", "stats.memory_mib<=0.7x")
    assert code == 1 and "is a directory" in err and str(tmp_path) in err


def test_frontier_unwritable_fails_before_solving(capsys, library_file, tmp_path):
    path, _ = library_file
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    code, err = _fails(
        capsys, "--library", str(path), "--sweep", "stats.memory_mib=0.6x", "--frontier", str(blocker / "x")
    )
    assert code == 1 and str(blocker) in err


@pytest.mark.parametrize("trailing_slash", [True, False])
def test_frontier_folder_gets_files_inside(capsys, library_file, tmp_path, trailing_slash):
    path, _ = library_file
    folder = tmp_path / "out"
    if not trailing_slash:
        folder.mkdir()  # an existing folder, named without a slash
    target = f"{folder}/" if trailing_slash else str(folder)
    code, _, _ = _run(
        capsys, "--library", str(path), "--sweep", "stats.memory_mib=0.6x,0.8x", "--frontier", target
    )
    assert code == 0
    assert (folder / "frontier.csv").is_file() and (folder / "frontier.json").is_file()
    assert not (tmp_path / "out.csv").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--frontier", "x"), "--frontier needs --sweep"),
        (("--min-diff", "2"), "--min-diff needs --solutions"),
        (("--solutions", "0"), "--solutions"),
        (("--sweep", "stats.memory_mib=0.6x", "--solutions", "2"), "do not combine with --sweep"),
    ],
)
def test_options_that_need_another_one(capsys, library_file, extra, message):
    path, _ = library_file
    code, err = _fails(capsys, "--library", str(path), "--budget", "stats.memory_mib<=0.7x", *extra)
    assert code == 2 and message in err


@pytest.mark.parametrize("option", ["--fixed", "--same"])
def test_keys_that_no_variant_has(capsys, library_file, option):
    path, _ = library_file
    value = "stats.nope=5" if option == "--fixed" else "stats.nope"
    code, err = _fails(capsys, "--library", str(path), "--budget", "stats.memory_mib<=0.7x", option, value)
    assert code == 1 and f"{option} key 'stats.nope' is in no variant" in err


def test_fixed_on_an_unbudgeted_key_counts_in_its_total(capsys, library_file):
    path, library = library_file
    code, out, _ = _run(
        capsys,
        "--library",
        str(path),
        "--budget",
        "stats.memory_mib<=0.7x",
        "--fixed",
        "metrics.lm_loss=3",
        "--json",
    )
    assert code == 0
    result = json.loads(out)
    chosen = [library[layer][name] for layer, name in result["choices"].items()]
    assert result["totals"]["metrics.lm_loss"] == pytest.approx(
        3 + sum(v["metrics"]["lm_loss"] for v in chosen)
    )


def test_boolean_metric_is_not_a_number(capsys, library_file, tmp_path):
    _, library = library_file
    first = next(iter(library["layer_1"].values()))
    first["metrics"]["kl_div"] = True
    broken = tmp_path / "bool.json"
    broken.write_text(json.dumps(library))
    code, err = _fails(capsys, "--library", str(broken), "--budget", "stats.memory_mib<=0.7x")
    assert code == 1 and "'metrics.kl_div' is true, expected a finite number" in err


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ("stats.memory_mib<=1e400", "overflows"),
        ("stats.memory_mib<=inf", "cannot read budget"),
        ("stats.memory_mib<=70G", "names its unit"),
        ("stats.runtime_ms<=3k", "names its unit"),
        ("stats.memory_mib<=1e400x", "finite factor"),
    ],
)
def test_budget_values_overflow_and_unit_suffixes(capsys, library_file, budget, message):
    path, _ = library_file
    code, err = _fails(capsys, "--library", str(path), "--budget", budget)
    assert code == 1 and message in err


def test_suffix_on_a_count_key_still_works(capsys, library_file):
    path, library = library_file
    bound = 0.8 * _parent_total(library, "num_params")
    code, out, _ = _run(
        capsys, "--library", str(path), "--budget", f"stats.num_params<={bound / 1e9}G", "--json"
    )
    assert code == 0 and json.loads(out)["totals"]["stats.num_params"] <= bound * (1 + 1e-12)


def test_help_states_defaults_and_units(capsys):
    with pytest.raises(SystemExit):
        main(["search", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default auto" in text and "seconds" in text and "default: none" in text
    assert "k=1e3" in text and "G or B=1e9" in text


def test_library_search_imports_nothing_heavy(library_file):
    """A fresh interpreter solves a small library from JSON under one budget (the knapsack path): none of the
    heavy or unneeded modules is imported, not the cost model or the spec types either (`puzzle search
    --library` on NVIDIA's 70B library runs in < 0.5 s, most of it interpreter and numpy start-up)."""
    path, _ = library_file
    heavy = ("torch", "pulp", "highspy", "matplotlib", "scipy", "pandas", "tqdm", "yaml", "safetensors")
    heavy += ("transformers", "numpy.ma", "numpy.random", "numpy.polynomial", "numpy.fft")
    # The budget syntax lives in puzzle.cost.limits; the cost model beside it must stay unloaded.
    heavy += ("puzzle.cost.analytic", "puzzle.cost.kinds", "puzzle.cost.roofline", "puzzle.cost.hardware")
    heavy += ("puzzle.spec", "puzzle.presets", "puzzle.commands.costs")
    script = f"""
import sys, json, io, contextlib
from puzzle.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    code = main(["search", "--library", {str(path)!r}, "--budget", "stats.memory_mib<=0.7x"])
print(json.dumps({{"code": code, "loaded": [name for name in {heavy!r} if name in sys.modules]}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"code": 0, "loaded": []}


def test_library_search_imports_no_torch_and_keeps_the_plotting_backend(library_file, tmp_path):
    """A fresh interpreter runs a library sweep with a frontier plot: torch is never imported (a library
    search needs none), and the caller's matplotlib backend and pyplot state are left as they were."""
    pytest.importorskip("matplotlib")
    path, _ = library_file
    script = f"""
import sys, json
import matplotlib
matplotlib.use("svg")
from puzzle.cli import main
code = main(["search", "--library", {str(path)!r}, "--sweep", "stats.memory_mib=0.6x,0.8x",
             "--frontier", {str(tmp_path / "front")!r}, "--json"])
print(json.dumps({{"code": code, "torch": "torch" in sys.modules, "backend": matplotlib.get_backend(),
                  "pyplot": "matplotlib.pyplot" in sys.modules}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"code": 0, "torch": False, "backend": "svg", "pyplot": False}
    assert (tmp_path / "front.png").stat().st_size > 1000


def test_frontier_never_replaces_files_of_the_users(capsys, library_file, tmp_path):
    """--frontier PREFIX where PREFIX.csv is the user's: refused before solving, kept; a second sweep replaces
    the first's files; --overwrite replaces the user's as asked."""
    path, _ = library_file
    (tmp_path / "front.csv").write_text("the user's table\n")
    argv = [
        "--library",
        str(path),
        "--sweep",
        "stats.memory_mib=0.6x,0.8x",
        "--frontier",
        str(tmp_path / "front"),
    ]
    code, out, err = _run(capsys, *argv)
    assert code != 0 and out == "" and "front.csv" in err and "--overwrite" in err, err
    assert (tmp_path / "front.csv").read_text() == "the user's table\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["block_library.json", "front.csv"]
    assert _run(capsys, *argv, "--overwrite")[0] == 0
    assert (tmp_path / "front.csv").read_text().startswith("budget,status,")
    assert _run(capsys, *argv)[0] == 0  # the earlier sweep's files: replaced
