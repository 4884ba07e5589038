"""The multi-node launch recipes (`puzzle.launch`, issue 34 §3): the torchrun lines docs/SCALE.md and `puzzle plan
--nodes` print and the Slurm example runs are what `torchrun_args` / `sbatch_script` render, and torchrun's own
argument parser reads them as N nodes of G ranks running `puzzle run CONFIG`. No cluster: the sbatch script runs
under bash with stand-ins for srun and scontrol that record what they are given."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.distributed.run import config_from_args, get_args_parser

from puzzle.cli import main
from puzzle.launch import sbatch_script, shell_join, torchrun_args

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "slurm" / "puzzle_run.sbatch"
SCALE = ROOT / "docs" / "SCALE.md"
SUPER = "examples/nemotron3_super/config.yaml"
RANK_ARGS = [
    "-u",
    "-m",
    "puzzle",
    "run",
    "my_run.yaml",
]  # each rank runs `python -u -m puzzle run my_run.yaml`


def _expand(line: str, **values: str) -> list[str]:
    """The argv the shell makes of `line` with these variables set (bash itself expands it)."""
    script = f'printf "%s\\0" {line}'
    out = subprocess.run(
        ["bash", "-c", script], env={"PATH": os.environ["PATH"], **values}, capture_output=True, check=True
    )
    return out.stdout.decode().split("\0")[:-1]


def _torchrun(argv: list[str], monkeypatch):
    """torchrun's parsed arguments, launch config and each rank's python arguments of `argv` (argv[0] is
    "torchrun")."""
    assert argv[0] == "torchrun"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args would set it
    args = get_args_parser().parse_args(argv[1:])
    config, _entry, entry_args = config_from_args(args)
    return args, config, entry_args


def test_the_multi_node_line_is_n_nodes_of_g_ranks_to_torchrun(monkeypatch):
    line = shell_join(torchrun_args(2, 8, "my_run.yaml"))
    argv = _expand(line, HEAD_NODE="node-a", JOB_ID="job-7")
    args, config, entry_args = _torchrun(argv, monkeypatch)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 8)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("c10d", "node-a:29500", "job-7")
    assert args.module and args.training_script == "puzzle" and entry_args == RANK_ARGS
    # The static rendezvous: node rank and master address from the environment.
    static = _expand(
        shell_join(torchrun_args(2, 8, "my_run.yaml", static=True)),
        NODE_RANK="1",
        MASTER_ADDR="node-a",
        MASTER_PORT="29400",
    )
    args, config, entry_args = _torchrun(static, monkeypatch)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 8)
    assert (args.node_rank, args.master_addr, args.master_port) == (1, "node-a", 29400)
    assert config.rdzv_backend == "static" and entry_args == RANK_ARGS
    # One node: standalone, nothing to give.
    args, config, entry_args = _torchrun(torchrun_args(1, 4, "my_run.yaml"), monkeypatch)
    assert args.standalone and (config.max_nodes, config.nproc_per_node) == (1, 4)


def test_the_slurm_example_is_the_rendered_script():
    assert SBATCH.read_text() == sbatch_script(2, 8)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_slurm_script_starts_one_torchrun_per_node_on_the_jobs_nodes(tmp_path, monkeypatch):
    """Under `sbatch --nodes 3` on nodes of 4 GPUs: srun starts torchrun with 3 nodes of 4 ranks, the job's
    first node as the rendezvous, the job id as its id, and `puzzle run CONFIG`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun.args"
    (bin_dir / "srun").write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" > {shlex.quote(str(record))}\n')
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\n[ "$*" = "show hostnames gpu[07-09]" ] && printf "gpu07\\ngpu08\\ngpu09\\n"\n'
    )
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu[07-09]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_JOB_ID": "81234",
    }
    subprocess.run(["bash", str(SBATCH), "my_run.yaml"], env=env, check=True, timeout=60)
    argv = record.read_bytes().decode().split("\0")[:-1]
    assert argv[0] == "--kill-on-bad-exit=1"
    _, config, entry_args = _torchrun(argv[1:], monkeypatch)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (3, 3, 4)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("c10d", "gpu07:29500", "81234")
    assert entry_args == RANK_ARGS
    # Without a config: the usage, and srun is never called.
    record.unlink()
    failed = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert failed.returncode != 0 and "usage: sbatch puzzle_run.sbatch CONFIG.yaml" in failed.stderr
    assert not record.exists()


def test_docs_quote_the_rendered_lines():
    page = SCALE.read_text()
    assert shell_join(torchrun_args(2, 8, "my_run.yaml")) in page.splitlines()
    assert shell_join(torchrun_args(2, 8, "my_run.yaml", static=True)) in page.splitlines()
    script = sbatch_script(2, 8)
    srun = script[script.index("srun ") :].rstrip("\n")
    assert f"```bash\n{srun}\n```" in page


def test_the_plan_prints_the_launch_line_for_its_nodes(capsys):
    assert main(["plan", SUPER, "--nodes", "2", "--gpus-per-node", "8", "--hardware", "b200"]) == 0
    last = capsys.readouterr().out.rstrip("\n").splitlines()[-1]
    assert last == (
        "launch on each of the 2 nodes (HEAD_NODE: the first node's host name, JOB_ID: one id for the job): "
        + shell_join(torchrun_args(2, 8, SUPER))
    )
    assert main(["plan", SUPER, "--gpus", "16", "--hardware", "b200"]) == 0
    assert "launch" not in capsys.readouterr().out  # without --nodes the nodes are not known
    # A plan that refuses (exit 2: one H100 per node cannot hold the library) prints no launch line.
    assert main(["plan", SUPER, "--nodes", "2", "--gpus-per-node", "1", "--hardware", "h100"]) == 2
    assert "launch" not in capsys.readouterr().out


def test_bad_sizes_are_errors():
    with pytest.raises(ValueError, match="nodes and gpus_per_node must be >= 1, found 0 and 8"):
        torchrun_args(0, 8, "run.yaml")
