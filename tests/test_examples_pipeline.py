"""The pipeline examples run as a user would: examples/quickstart.ipynb in a Jupyter kernel (nbclient), and
examples/compress_nemotron3_nano.py as a process (alone and under torchrun with 2 gloo ranks), all on a tiny
trained NemotronH checkpoint and token data (tests/run_helpers.py), with tiny settings in place of the
defaults (the notebook's through PUZZLE_QUICKSTART, the script's through --set)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from run_helpers import make_inputs

import puzzle
from puzzle.layout import STAGES

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples_pipeline")
    return root, make_inputs(root)


def _tiny_parameters(root: Path, tiny: dict) -> dict:
    """The notebook's parameters for the tiny parent, as PUZZLE_QUICKSTART passes them (JSON)."""
    return {
        "PARENT": tiny["parent"]["path"],
        "DATA": tiny["data"]["sources"][0],
        "RUN_DIR": "notebook-run",  # relative: the kernel runs in `root`, as a user's runs in theirs
        "BUDGET": "active_params<=0.8x",
        "SEQ_LEN": 16,
        "BATCH_SIZE": 4,
        "HELD_OUT_FRACTION": tiny["data"]["held_out_fraction"],
        "HELD_OUT_TOKENS": 256,
        "IMPORTANCE_TOKENS": 512,
        "BLD_TOKENS": 640,
        "GKD_TOKENS": 640,
        "VOCAB_CHUNK": 16,
        "SPACE": tiny["space"]["kinds"],
    }


def _execute(notebook_path: Path, cwd: Path, parameters: dict, monkeypatch) -> Any:
    """Run the notebook in a real Jupyter kernel (nbclient, ipykernel) in `cwd`; returns the executed
    notebook. The kernel inherits this process's environment: the parameters, one thread, no bars, and
    this checkout's `puzzle` first on its path."""
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("PUZZLE_QUICKSTART", json.dumps(parameters))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PUZZLE_PROGRESS", "0")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")])
    )
    notebook = nbformat.read(notebook_path, as_version=4)
    nbformat.validate(notebook)
    client = nbclient.NotebookClient(
        notebook, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(cwd)}}
    )
    client.execute()
    return notebook


def _printed(notebook: Any) -> str:
    return "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.get("output_type") == "stream" and output.get("name") == "stdout"
    )


@pytest.mark.slow
def test_quickstart_notebook_runs_every_stage_in_a_kernel(inputs, monkeypatch):
    """examples/quickstart.ipynb executed by nbclient, as Jupyter runs it, with tiny parameters."""
    from puzzle.assemble import assemble
    from puzzle.cost.analytic import model_active_params
    from puzzle.gkd import load_distilled
    from puzzle.library import read_library
    from puzzle.score import load_scores

    root, tiny = inputs
    notebook_file = EXAMPLES / "quickstart.ipynb"
    cells = [cell for cell in json.loads(notebook_file.read_text())["cells"] if cell["cell_type"] == "code"]
    assert "parameters" in cells[0]["metadata"]["tags"]  # papermill's -p finds it
    printed = _printed(_execute(notebook_file, root, _tiny_parameters(root, tiny), monkeypatch))
    run_dir = root / "notebook-run"
    manifest = json.loads((run_dir / "run.json").read_text())
    assert [n for n in manifest["stages"] if n != "frontier"] == list(STAGES)
    assert all(stage["status"] == "done" for stage in manifest["stages"].values())
    (name,) = manifest["stages"]["solutions"]["outputs"]
    solution = json.loads((run_dir / "solutions" / f"{name}.json").read_text())
    for block, variant in solution["choices"].items():
        assert f"  {block}: {variant}" in printed
    measured = manifest["stages"]["assemble"]["outputs"][name]["measured"]
    assert f"measured KL {measured['kl']:.4g}" in printed and measured["kl"] > 0
    assert f"{name}: exported to {run_dir / 'exports' / name}" in printed
    # The export is the distilled child, and meets the budget.
    parent = puzzle.load(tiny["parent"]["path"])
    choice = {int(block.rsplit("_", 1)[1]): variant for block, variant in solution["choices"].items()}
    assembled = assemble(
        choice, read_library(run_dir / "library"), parent, scores=load_scores(run_dir / "scores")
    )
    distilled = load_distilled(run_dir / "children" / name, assembled)
    child = puzzle.load(run_dir / "exports" / name)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(child(ids).logits, distilled(ids).logits, rtol=0, atol=0)
    assert model_active_params(child.spec) <= 0.8 * model_active_params(parent.spec)


def test_quickstart_notebook_refuses_an_unknown_parameter(inputs, tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    root, tiny = inputs
    parameters = {**_tiny_parameters(root, tiny), "GKD_TOKEN": 64}  # a typo must not pass silently
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="unknown parameters \\['GKD_TOKEN'\\]"):
        _execute(EXAMPLES / "quickstart.ipynb", tmp_path, parameters, monkeypatch)
    assert not (tmp_path / "notebook-run").exists()


def _script(tiny: dict, out: Path, launcher: list[str]) -> subprocess.CompletedProcess:
    """compress_nemotron3_nano.py on the tiny parent: its paths, one budget, every other section `--set`."""
    command = [*launcher, str(EXAMPLES / "compress_nemotron3_nano.py")]
    command += ["--parent", tiny["parent"]["path"], "--data", tiny["data"]["sources"][0], "--out", str(out)]
    command += [
        "--budget",
        "active_params<=0.8x",
        "--set",
        "parent.dtype=float32",
        "--set",
        "space.overrides=[]",
    ]
    for section in tiny:
        if section not in ("run_dir", "parent"):
            command += ["--set", f"{section}={json.dumps(tiny[section])}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PUZZLE_PROGRESS": "0", "PYTHONPATH": str(EXAMPLES.parent)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def script_run(inputs):
    root, tiny = inputs
    out = root / "script-run"
    return out, _script(tiny, out, [sys.executable])


def test_compress_script_runs_the_pipeline_on_a_tiny_nemotron_h(script_run):
    out, done = script_run
    (export,) = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.startswith("export ")]
    assert Path(export).parent == out / "exports"
    model = puzzle.load(export)
    record = json.loads((Path(export) / "puzzle.json").read_text())
    solution = json.loads(next((out / "solutions").glob("*.json")).read_text())
    assert record["search"]["choices"] == solution["choices"]
    for block, variant in solution["choices"].items():
        assert f"  {block}: {variant}" in done.stdout
    assert model.spec.num_blocks == 4
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


@pytest.mark.slow
def test_compress_script_under_torchrun_with_two_gloo_processes(inputs, script_run):
    """The launch a user makes on a node (`torchrun --nproc-per-node N`), with 2 CPU processes: the same
    architecture as one process, printed once (by rank 0), and an export that loads."""
    root, tiny = inputs
    out = root / "script-run-2"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = _script(tiny, out, launcher)
    one = json.loads(next((script_run[0] / "solutions").glob("*.json")).read_text())
    (path,) = (out / "solutions").glob("*.json")
    assert json.loads(path.read_text())["choices"] == one["choices"]
    exports = [line for line in done.stdout.splitlines() if line.startswith("export ")]
    assert exports == [f"export {path.stem}: {out / 'exports' / path.stem}"]
    assert puzzle.load(out / "exports" / path.stem).spec.num_blocks == 4


def test_compress_script_rejects_a_bad_override(inputs, capsys):
    root, tiny = inputs
    sys.path.insert(0, str(EXAMPLES))
    try:
        import compress_nemotron3_nano as script
    finally:
        sys.path.remove(str(EXAMPLES))
    argv = [
        "--parent",
        tiny["parent"]["path"],
        "--data",
        tiny["data"]["sources"][0],
        "--out",
        str(root / "bad"),
    ]
    assert script.main([*argv, "--set", "bld.lr=-1"]) == 2
    assert "bld.lr" in capsys.readouterr().err
    assert not (root / "bad").exists()
