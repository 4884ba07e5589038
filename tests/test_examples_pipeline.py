"""The pipeline examples run as a user would: examples/quickstart.ipynb's code cells in order in one
namespace, and examples/compress_nemotron3_nano.py as a process (alone and under torchrun with 2 gloo
ranks), all on a tiny trained NemotronH checkpoint and token data (tests/run_helpers.py), with tiny
settings in place of the Nano config's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_helpers import make_inputs

import puzzle

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples_pipeline")
    return root, make_inputs(root)


def _tiny_parameters(root: Path, tiny: dict) -> str:
    """The notebook's parameters cell for the tiny parent (what papermill's -p would inject)."""
    values = {
        "PARENT": tiny["parent"]["path"],
        "DATA": tiny["data"]["sources"][0],
        "RUN_DIR": str(root / "notebook-run"),
        "SEQ_LEN": 16,
        "BATCH_SIZE": 4,
        "HELD_OUT_TOKENS": 256,
        "BLD_TOKENS": 640,
        "GKD_TOKENS": 640,
        "VOCAB_CHUNK": 16,
    }
    return "\n".join(f"{key} = {value!r}" for key, value in values.items())


def test_quickstart_notebook_runs_every_stage(inputs, capsys):
    root, tiny = inputs
    notebook = json.loads((EXAMPLES / "quickstart.ipynb").read_text())
    assert notebook["nbformat"] == 4
    cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert "parameters" in cells[0]["metadata"]["tags"]
    namespace: dict = {"__name__": "__main__"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for cell in cells:
            exec(compile("".join(cell["source"]), "quickstart.ipynb", "exec"), namespace)
            if cell is cells[0]:  # the user's defaults are defined; the test's tiny ones replace them
                exec(_tiny_parameters(root, tiny), namespace)
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    run, exports, child, parent = (
        namespace["run"],
        namespace["exports"],
        namespace["child"],
        namespace["parent"],
    )
    assert [p.name for p in exports.values()] == list(namespace["solutions"])
    assert all(p.parent == root / "notebook-run" / "exports" for p in exports.values())
    manifest = json.loads(run.layout.manifest.read_text())
    assert all(stage["status"] == "done" for stage in manifest["stages"].values())
    (name,) = exports
    solution = json.loads(run.layout.solution(name).read_text())
    for block, variant in solution["choices"].items():
        assert f"  {block}: {variant}" in printed
    measured = namespace["assembled"][name]["measured"]
    assert f"measured KL {measured['kl']:.4g}" in printed and measured["kl"] > 0
    # The child reloaded from the export is the distilled one, and meets the budget.
    from puzzle.cost.analytic import model_active_params
    from puzzle.gkd import load_distilled

    distilled = load_distilled(run.layout.child(name), run._child(name))
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(child(ids).logits, distilled(ids).logits, rtol=0, atol=0)
    assert model_active_params(child.spec) <= 0.8 * model_active_params(parent.spec)


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
