"""`puzzle report RUN`: every section of a tiny real run (library, scores, a solution, an assembled child
distilled a few steps and exported), valid PNGs, notes for missing sections, the pyplot backend untouched."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import sys
from pathlib import Path

import matplotlib
import matplotlib.image
import pytest
from bld_helpers import token_batches, trained_parent
from rundir_helpers import make_run

from puzzle.assemble import assemble, measured_kl
from puzzle.cli import main
from puzzle.cost import Scenario, model_performance, model_throughput
from puzzle.cost.hardware import HardwareProfile, profile_from_json, profile_to_json
from puzzle.export import export
from puzzle.files import atomic_write_bytes
from puzzle.gkd import GKDSettings, distill
from puzzle.layout import RunDirError, RunLayout
from puzzle.problem import CostModel, frontier_budgets, frontier_sweep, run_problem, search_run
from puzzle.report import PLOT_HINT, _format, readable_budget, write_report

NAME = "small"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    layout = make_run(tmp_path_factory.mktemp("run") / "run", failures=True)
    chat = Scenario(batch_size=2, prompt_tokens=16, generated_tokens=4, name="chat")
    solution = search_run(
        layout,
        ["params<=0.85x", "throughput[chat]>=1x"],
        cost_model=CostModel(scenarios={"chat": chat}),
        note=lambda text: None,
    )
    atomic_write_bytes(layout.solution(NAME), json.dumps(solution.to_json(), indent=2).encode())
    # The frontier the solutions stage of `puzzle run` sweeps (the report reads it and solves nothing).
    cost_model = CostModel(scenarios={"chat": chat})
    problem = run_problem(layout, frontier_budgets(cost_model), cost_model=cost_model)
    swept = frontier_sweep(problem, {NAME: solution.to_json()})
    atomic_write_bytes(layout.frontier, json.dumps(swept).encode())
    parent = trained_parent(steps=8)  # the parent make_run built the library from
    child = assemble(solution, layout.library, parent)
    measured_kl(child, parent, token_batches(1, seed=600), vocab_chunk=16)
    export(child, layout.export(NAME), solution=solution)
    settings = GKDSettings(lr=1e-3, steps=2, token_budget=None, batch_size=4, vocab_chunk=16, eval_every=1)
    distill(
        child, parent, token_batches(2, seed=700), token_batches(1, seed=800), settings, layout.child(NAME)
    )
    # The run config: only its hardware section is read by the report (scenario throughput).
    (layout.root / "parent").mkdir()
    (layout.root / "corpus.txt").write_text("text\n")
    layout.config.write_text(
        "run_dir: .\nparent: {path: parent}\ndata: {sources: [corpus.txt], seq_len: 8}\n"
        "space: {kinds: {mlp: {width_fraction: [0.5]}}}\nsearch: {budgets: ['params<=0.85x']}\n"
        "hardware: {scenarios: {chat: {batch_size: 2, prompt_tokens: 16, generated_tokens: 4},\n"
        "  fast: {batch_size: 1, prompt_tokens: 16, generated_tokens: 4, user_speed: 20000}}}\n"
    )
    return layout.root


def _is_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 50 and image.shape[1] > 50, (path, image.shape)


def test_report_has_every_section_and_valid_plots(run_dir, capsys):
    backend = matplotlib.get_backend()
    pyplot_loaded = "matplotlib.pyplot" in sys.modules
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out.strip()
    report = run_dir / "report" / "report.md"
    assert out == str(report)
    text = report.read_text()
    for heading in (
        "## Pareto frontier",
        "### KL against `params`",
        "## Architecture per block",
        f"### {NAME}",
        "## Costs, parent vs child",
        "## BLD losses",
        "Failed variants:",
        "## Global knowledge distillation",
        "## Measured vs predicted KL",
    ):
        assert heading in text, heading
    assert "Skipped" not in text and "skipped" not in text
    assert (
        "| throughput chat (generated tokens/s of the batch, prefill of the 16-token prompts included, "
        "h100-80gb) |" in text
    )
    assert "| decode speed chat (tokens/s per request, decode steps only, h100-80gb) |" in text
    # A scenario with a per-user speed also gets the throughput at the largest batch keeping it.
    assert "| throughput fast at 20000 tokens/s/user (tokens/s, h100-80gb) |" in text
    assert PLOT_HINT not in text
    pngs = sorted(p.name for p in report.parent.glob("*.png"))
    for expected in ("frontier_params.png", f"blocks_{NAME}.png", "costs.png", "bld.png", f"gkd_{NAME}.png"):
        assert expected in pngs, pngs
        assert f"]({expected})" in text
    assert "kl_measured.png" in pngs and "frontier_weight_bytes_bf16.png" in pngs
    assert "frontier_seconds_chat.png" in pngs  # the scenario cost of the solution's throughput budget
    for name in pngs:
        _is_png(report.parent / name)
    # The failed BLD variant is listed by id.
    assert "`linear`" in text.split("Failed variants:")[1]
    assert matplotlib.get_backend() == backend
    assert ("matplotlib.pyplot" in sys.modules) == pyplot_loaded


def test_missing_sections_are_noted(run_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("parent.json", "library"):  # no config.yaml either: no scenario row
        source = run_dir / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, bare / name)
    path = write_report(bare, tmp_path / "out")
    assert path == tmp_path / "out" / "report.md"
    text = path.read_text()
    assert "## BLD losses" in text and (tmp_path / "out" / "bld.png").is_file()
    assert f"_Skipped: no solutions in {bare / 'solutions'}._" in text
    assert "_Skipped: no children/NAME/history.json._" in text
    assert "_Skipped: no exports/NAME/puzzle.json._" in text
    assert not (bare / "report").exists()


def test_the_frontier_is_drawn_from_the_run_s_sweep_without_solving(run_dir, tmp_path):
    """The report draws frontier.json as the run swept it: with the scores gone (nothing to solve with) the
    table still shows every swept point; without frontier.json the section says how to get one."""
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied, ignore=shutil.ignore_patterns("report"))
    shutil.rmtree(copied / "scores")
    swept = json.loads((copied / "frontier.json").read_text())
    text = write_report(copied, tmp_path / "out").read_text()
    for key, entry in swept["keys"].items():
        assert f"### KL against `{key}`" in text
        assert all(readable_budget(point["budget"]) in text for point in entry["points"])
    (copied / "frontier.json").unlink()
    text = write_report(copied, tmp_path / "out2").read_text()
    assert f"_Skipped: no frontier in {copied / 'frontier.json'}" in text


def test_tables_without_matplotlib(run_dir, tmp_path, monkeypatch):
    import puzzle.report

    monkeypatch.setattr(puzzle.report, "_figure_class", lambda: None)
    path = write_report(run_dir, tmp_path)
    text = path.read_text()
    assert PLOT_HINT in text and "## BLD losses" in text and "| params |" in text
    assert not list(tmp_path.glob("*.png"))


def _figures(run_dir: Path, out: Path, monkeypatch) -> dict[str, object]:
    """write_report's figures by PNG name, as saved (laid out and drawn on their Agg canvas)."""
    import puzzle.report

    figures = {}
    save = puzzle.report._Report.save

    def keep(self, figure, name, alt):
        save(self, figure, name, alt)
        figures[name] = figure

    monkeypatch.setattr(puzzle.report._Report, "save", keep)
    write_report(run_dir, out)
    return figures


def _in_view(figure) -> tuple[list, list]:
    """(every drawn text of `figure`, the drawn tick labels of each axis): matplotlib also makes labels for
    ticks beyond an axis's limits, which are never drawn."""
    from matplotlib.text import Text

    ticks, hidden = [], set()
    for axis in figure.axes:
        for labels, limits, coordinate in (
            (axis.get_xticklabels(), axis.get_xlim(), 0),
            (axis.get_xticklabels(minor=True), axis.get_xlim(), 0),
            (axis.get_yticklabels(), axis.get_ylim(), 1),
            (axis.get_yticklabels(minor=True), axis.get_ylim(), 1),
        ):
            low, high = sorted(limits)
            drawn = [t for t in labels if low <= t.get_position()[coordinate] <= high]
            hidden.update(id(t) for t in labels if t not in drawn)
            ticks.append([t for t in drawn if t.get_visible() and t.get_text()])
    texts = [
        t for t in figure.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in hidden
    ]
    return texts, ticks


def test_every_plot_label_is_readable_inside_its_figure_and_apart(run_dir, tmp_path, monkeypatch):
    """Titles, tick labels, legends and annotations: at least 8 pt, inside the PNG (none cut at an edge),
    and no two tick labels of an axis on top of each other."""

    figures = _figures(run_dir, tmp_path, monkeypatch)
    assert {"costs.png", "bld.png", f"blocks_{NAME}.png", f"gkd_{NAME}.png", "kl_measured.png"} <= set(
        figures
    )
    for name, figure in figures.items():
        _assert_readable(name, figure)


def _assert_readable(name: str, figure) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure).draw()  # as savefig drew it (its own Agg canvas, same dpi)
    renderer = figure.canvas.get_renderer()
    box = figure.bbox
    texts, ticks = _in_view(figure)
    for text in texts:
        label = f"{name}: {text.get_text()!r}"
        assert text.get_fontsize() >= 8, label
        extent = text.get_window_extent(renderer)
        assert extent.x0 >= box.x0 - 1 and extent.x1 <= box.x1 + 1, (label, extent, box)
        assert extent.y0 >= box.y0 - 1 and extent.y1 <= box.y1 + 1, (label, extent, box)
    for labels in ticks:
        extents = [t.get_window_extent(renderer) for t in labels]
        for first, second in itertools.pairwise(extents):
            assert not first.overlaps(second), (name, [t.get_text() for t in labels])


def test_a_long_solution_name_stays_inside_the_block_map(tmp_path, monkeypatch):
    """The block map of a child named as `puzzle run` names solutions (its budgets), on the small parent."""
    from bld_helpers import SPEC

    import puzzle.report

    names = [
        "active_params-le-0.5x",
        "active_params-le-0.5x+throughput_chat-ge-1.5x+memory_bytes_chat-le-0.8x",
    ]
    figures = {}
    monkeypatch.setattr(
        puzzle.report._Report, "save", lambda self, figure, name, alt: figures.update({name: figure})
    )
    puzzle.report._block_map(puzzle.report._Report(tmp_path), SPEC, dict.fromkeys(names, SPEC), {})
    assert len(figures) == 2
    for name, figure in figures.items():
        figure.tight_layout()  # as _Report.save lays it out
        _assert_readable(name, figure)


def test_gkd_section_tables_as_many_evaluations_as_it_counts(run_dir, tmp_path):
    text = write_report(run_dir, tmp_path).read_text()
    section = text.split("## Global knowledge distillation")[1].split("\n## ")[0]
    history = json.loads((run_dir / "children" / NAME / "history.json").read_text())
    count = len(history["eval"])
    assert count > 2  # the fixture's GKD evaluates at every step: more than a first and a last
    assert f"{count} evaluations." in section
    assert f"The weights kept are step {history['kept_step']}'s (the lowest held-out KL)." in section
    rows = [line for line in section.splitlines() if line.startswith("| step ")]
    assert [row.split(" |")[0] for row in rows] == [f"| step {e['step']}" for e in history["eval"]]


def test_a_child_without_a_token_mixer_is_noted(tmp_path):
    """A child of MoE / MLP / linear / no-op blocks only (no Mamba, no attention) gets a note; one that keeps
    a Mamba block does not."""
    import dataclasses

    from bld_helpers import SPEC

    from puzzle.report import _block_map, _Report, mixes_tokens
    from puzzle.spec import NoOpSpec

    assert {b.kind for b in SPEC.blocks} >= {"mamba", "attention"}
    mixers = [i for i, b in enumerate(SPEC.blocks) if b.kind in ("mamba", "attention")]
    none_left = tuple(NoOpSpec() if i in mixers else b for i, b in enumerate(SPEC.blocks))
    one_left = tuple(NoOpSpec() if i in mixers[1:] else b for i, b in enumerate(SPEC.blocks))
    children = {
        "bigram": dataclasses.replace(SPEC, blocks=none_left),
        "mamba_kept": dataclasses.replace(SPEC, blocks=one_left),
    }
    assert not mixes_tokens(children["bigram"]) and mixes_tokens(children["mamba_kept"])
    report = _Report(tmp_path)
    report.figure = None  # tables only: the note is in the text
    _block_map(report, SPEC, children, {})
    notes = [line for line in report.lines if "mixes tokens" in line]
    assert len(notes) == 1 and notes[0].startswith("_Note: bigram: it keeps no Mamba or attention block")


def test_run_without_library_is_an_error(tmp_path, capsys):
    with pytest.raises(RunDirError, match=str(tmp_path / "library")):
        write_report(tmp_path)
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_out_holding_other_files_is_refused(run_dir, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["report", str(run_dir), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and str(tmp_path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_malformed_solution_is_an_error_naming_it(run_dir, tmp_path, capsys):
    bare = tmp_path / "run"
    bare.mkdir()
    for name in ("parent.json", "library", "scores"):
        source = run_dir / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, bare / name)
    (bare / "solutions").mkdir()
    (bare / "solutions" / "broken.json").write_text('{"objective": 1}')
    assert main(["report", str(bare)]) == 2
    err = capsys.readouterr().err
    assert str(bare / "solutions" / "broken.json") in err and "Traceback" not in err
    assert not (bare / "report" / "report.md").exists()


def test_later_rounds_get_their_own_report(run_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("parent.json", "library", "scores"):
        source = run_dir / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, run / name)
    shutil.copytree(run, tmp_path / "round-2")
    shutil.move(tmp_path / "round-2", run / "round-2")
    (run / "round-3").mkdir()  # started, no library yet
    text = write_report(run).read_text()
    assert "- [round 2](round-2/report.md)" in text
    assert "- round 3: no report (" in text and str(run / "round-3" / "library") in text
    assert "## BLD losses" in (run / "report" / "round-2" / "report.md").read_text()
    write_report(run)  # a second report over the first, round directories included


def _throughput_rows(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.startswith("| throughput chat ")]


def test_this_machine_figures_are_the_runs_stored_calibration(run_dir, tmp_path, capsys):
    """Two reports and a search of one run price on this machine with the calibration stored in the run:
    measured once when absent, then read back (a hand-made one shows it is read, not measured again)."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("parent.json", "library", "scores", "solutions"):
        source = run_dir / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, run / name)
    config = (
        (run_dir / "run.resolved.yaml")
        .read_text()
        .replace("hardware: {", "hardware: {profile: this-machine, ")
    )
    (run / "run.resolved.yaml").write_text(config)
    layout = RunLayout(run)
    chat = Scenario(batch_size=2, prompt_tokens=16, generated_tokens=4, name="chat")

    first = _throughput_rows(write_report(run, tmp_path / "first"))
    stored = layout.calibration.read_bytes()  # measured by the first report
    profile = profile_from_json(json.loads(stored), str(layout.calibration))
    parent = layout.read_parent()
    assert first[0].startswith(
        f"| throughput chat (generated tokens/s of the batch, prefill of the 16-token prompts included, "
        f"this-machine) | {_format(model_throughput(parent, chat, profile))} |"
    )
    # One request's decode speed, 1 / decode step: the figure demo.md predicts (`puzzle.demo.pipeline`),
    # beside the batch's throughput, which also counts the prompt's prefill.
    step = model_performance(parent, chat, profile).decode_step_s
    speed = next(
        line
        for line in (tmp_path / "first" / "report.md").read_text().splitlines()
        if line.startswith("| decode speed chat ")
    )
    assert speed.split(" | ")[1] == _format(1 / step)
    assert _throughput_rows(write_report(run, tmp_path / "second")) == first
    assert layout.calibration.read_bytes() == stored
    argv = ["search", str(run), "--budget", "throughput[chat]>=1x", "--json"]
    assert main(argv) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["totals"]["seconds[chat]"] == pytest.approx(
        model_performance(parent, chat, profile).total_s
    )
    assert layout.calibration.read_bytes() == stored

    # A calibration no machine measures: the report's figures are its own.
    made = HardwareProfile("this-machine", (("fp32", 3e9),), 1e9, 2**30, 2e-5, eager=True, source="tests")
    layout.calibration.write_text(json.dumps(profile_to_json(made)))
    rows = _throughput_rows(write_report(run, tmp_path / "third"))
    assert rows[0].startswith(
        f"| throughput chat (generated tokens/s of the batch, prefill of the 16-token prompts included, "
        f"this-machine) | {_format(model_throughput(parent, chat, made))} |"
    )


# ------------------------------------------------------------------ outputs: the user's files, errors


def _entries(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (and beside it: a staging leftover would show) with its bytes."""
    return {
        str(p.relative_to(folder.parent)): p.read_bytes()
        for p in sorted(folder.parent.rglob("*"))
        if p.is_file()
    }


def test_a_report_md_of_the_users_is_never_replaced_without_overwrite(run_dir, tmp_path, capsys):
    """`--out DIR` holding the user's report.md: refused in one line, nothing written; with --overwrite the
    report's files are written beside the user's other files, which stay as they were."""
    mine = tmp_path / "area" / "userrep"
    mine.mkdir(parents=True)
    (mine / "report.md").write_text("mine\n")
    (mine / "notes.txt").write_text("keep\n")
    before = _entries(mine)
    assert main(["report", str(run_dir), "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "report.md" in err and "--overwrite" in err and str(mine) in err
    assert _entries(mine) == before
    assert main(["report", str(run_dir), "--out", str(mine), "--overwrite"]) == 0
    capsys.readouterr()
    assert (mine / "notes.txt").read_text() == "keep\n"
    assert "## BLD losses" in (mine / "report.md").read_text() and (mine / "bld.png").is_file()
    assert sorted(p.name for p in mine.parent.iterdir()) == ["userrep"]  # no staging left beside it


def test_a_report_replaces_an_earlier_report_whole(run_dir, tmp_path):
    """A report re-run into its own directory (marked report.md) replaces it whole, stale plots included;
    a report.md written before the marker (the report's title first) is recognised as a report too."""
    out = tmp_path / "rep"
    write_report(run_dir, out)
    (out / "frontier_gone.png").write_bytes(b"stale plot of an earlier report")
    write_report(run_dir, out)
    assert not (out / "frontier_gone.png").exists() and (out / "bld.png").is_file()
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "report.md").write_text("# Puzzle report: run\n\nwritten by an earlier version\n")
    (legacy / "costs.png").write_bytes(b"old")
    write_report(run_dir, legacy)
    assert "## BLD losses" in (legacy / "report.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["legacy", "rep"]


@pytest.mark.parametrize("where", ["a-file", "a-file/below", "/proc/nope"])
def test_an_out_that_cannot_be_a_directory_is_one_sentence(run_dir, tmp_path, capsys, where):
    """A file, a path under a file, a folder nothing can be created in (/proc, even for root): exit 2, one
    line naming the path and what was expected, no `[Errno N]`, nothing written."""
    if where.startswith("/proc") and not Path("/proc").is_dir():
        pytest.skip("needs /proc")
    (tmp_path / "a-file").write_text("the user's\n")
    out = Path(where) if where.startswith("/") else tmp_path / where
    before = _entries(tmp_path / "a-file")
    assert main(["report", str(run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err and "expected a directory" in err, err
    assert "Errno" not in err
    assert _entries(tmp_path / "a-file") == before


def test_measured_kl_shows_before_and_after_gkd(run_dir, tmp_path):
    """The KL table gives each export its KL before GKD (the assembled child's, puzzle.json `measured`) and
    after GKD (the kept evaluation: the export record's when the run recorded one, else history.json's),
    labelled, and says which weights the export holds."""
    copied = tmp_path / "run"
    shutil.copytree(run_dir, copied, ignore=shutil.ignore_patterns("report"))
    record = json.loads((copied / "exports" / NAME / "puzzle.json").read_text())
    history = json.loads((copied / "children" / NAME / "history.json").read_text())
    kept = next(e for e in history["eval"] if e["step"] == history["kept_step"])
    assert kept["kl"] != record["measured"]["kl"]

    def row(text: str) -> list[str]:
        section = text.split("## Measured vs predicted KL")[1]
        assert "| measured KL before GKD | measured KL after GKD | exported weights |" in section
        return next(line for line in section.splitlines() if line.startswith(f"| {NAME} ")).split(" | ")

    cells = row(write_report(copied, tmp_path / "a").read_text())
    assert cells[2:5] == [_format(record["measured"]["kl"]), _format(kept["kl"]), "-"]
    # As `puzzle run` records its export: the GKD evaluation of the weights it exports.
    record["run"] = {"source": "distill", "distill": {"kept_step": 7, "kept_eval": {"kl": 0.0109}}}
    (copied / "exports" / NAME / "puzzle.json").write_text(json.dumps(record))
    cells = row(write_report(copied, tmp_path / "b").read_text())
    assert cells[2:5] == [_format(record["measured"]["kl"]), "0.0109", "after GKD"]


def test_numbers_in_tables_are_never_in_scientific_notation(run_dir, tmp_path):
    from puzzle.report import readable_number

    assert _format(8.107e-05) == "0.00008107" and _format(1.02936e06) == "1,029,360"
    assert _format(383.44) == "383.4" and _format(999.99) == "1,000" and _format(0.04212) == "0.04212"
    assert readable_budget("weight_bytes[bf16]<=1.02936e+06") == "weight_bytes[bf16]<=1,029,360"
    assert readable_budget("active_params<=0.75x") == "active_params<=0.75x"
    assert readable_number(-2.5e-07) == "-0.00000025"
    text = write_report(run_dir, tmp_path / "out").read_text()
    cells = [cell for line in text.splitlines() if line.startswith("|") for cell in line.split("|")]
    assert not [cell for cell in cells if re.search(r"\d[eE][+-]\d", cell)]
