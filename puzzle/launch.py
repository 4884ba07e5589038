"""The command lines that start `puzzle run` on several nodes: torchrun on each node, and a Slurm batch script.

docs/SCALE.md and examples/slurm/puzzle_run.sbatch quote what these functions render (tests/test_launch.py
holds them to it, and parses the torchrun lines with torchrun's own argument parser); `puzzle plan --nodes N
--gpus-per-node G` prints the torchrun line for its N and G. Every node runs the same command: torchrun starts
G ranks there (LOCAL_WORLD_SIZE = G, which `shard: hsdp` reads as the size of a node) and all N x G join one
c10d rendezvous on the first node, so no node rank and no MASTER_ADDR need be given. Shell variables
("$HEAD_NODE") are left for the shell to expand.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

RDZV_PORT = 29500  # torchrun's default port, for the rendezvous on the first node


def shell_join(args: Sequence[str]) -> str:
    """`args` as one shell line: an argument holding a shell variable in double quotes (the shell expands it),
    any other quoted as `shlex.quote` quotes it."""
    return " ".join(f'"{a}"' if "$" in a else shlex.quote(a) for a in args)


def torchrun_args(
    nodes: int,
    gpus_per_node: int,
    config: str,
    *,
    endpoint: str = f"$HEAD_NODE:{RDZV_PORT}",
    job_id: str = "$JOB_ID",
    static: bool = False,
) -> list[str]:
    """torchrun's argv that runs `puzzle run CONFIG` as one of `nodes` nodes of `gpus_per_node` ranks, joining
    the c10d rendezvous at `endpoint` (host:port of the first node) under the id `job_id` (the same on every
    node, another for each job). One node: `--standalone` (a local rendezvous, nothing to give).

    `static`: the rendezvous without a store of its own, where the launcher numbers the nodes: each node gives
    its NODE_RANK (0 on the first) and every node the first node's MASTER_ADDR and MASTER_PORT."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"nodes and gpus_per_node must be >= 1, found {nodes} and {gpus_per_node}")
    if nodes == 1:
        return [
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            str(gpus_per_node),
            "-m",
            "puzzle",
            "run",
            config,
        ]
    head = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(gpus_per_node)]
    if static:
        rendezvous = [
            "--node-rank",
            "$NODE_RANK",
            "--master-addr",
            "$MASTER_ADDR",
            "--master-port",
            "$MASTER_PORT",
        ]
    else:
        rendezvous = ["--rdzv-id", job_id, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    return [*head, *rendezvous, "-m", "puzzle", "run", config]


def sbatch_script(nodes: int, gpus_per_node: int, cpus_per_task: int = 64) -> str:
    """A Slurm batch script that runs `puzzle run CONFIG` (its first argument) on `nodes` nodes of
    `gpus_per_node` GPUs: one task per node (srun), each a torchrun of `torchrun_args` whose rendezvous is on
    the first node of the job, its id the job's."""
    command = torchrun_args(
        nodes,
        gpus_per_node,
        "$CONFIG",
        endpoint="$HEAD_NODE:$PORT",
        job_id="$SLURM_JOB_ID",
    )
    command[command.index("--nproc-per-node") + 1] = "$GPUS_PER_NODE"
    if nodes > 1:
        command[command.index("--nnodes") + 1] = "$SLURM_JOB_NUM_NODES"
    launch = " \\\n    ".join(_pairs(command))
    return f"""#!/bin/bash
# `puzzle run CONFIG` on {nodes} node(s) of {gpus_per_node} GPUs under Slurm: one torchrun per node (srun), all
# joining one c10d rendezvous on the first node. Submit with: sbatch examples/slurm/puzzle_run.sbatch my_run.yaml
# (`sbatch --nodes M` runs it on M nodes instead). Set `shard: hsdp` in the config's importance / bld / scoring /
# gkd sections to shard each unit inside a node and replicate it across nodes; `fsdp` (the default) shards over
# every GPU of the job. `puzzle plan my_run.yaml --nodes {nodes} --gpus-per-node {gpus_per_node}` plans it first.
# The run directory (`run_dir`) and the parent must be on a filesystem every node sees.
#SBATCH --job-name=puzzle-run
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --cpus-per-task={cpus_per_task}
#SBATCH --exclusive
#SBATCH --output=puzzle-run-%j.out

set -euo pipefail
CONFIG=${{1:?usage: sbatch puzzle_run.sbatch CONFIG.yaml}}
GPUS_PER_NODE=${{SLURM_GPUS_ON_NODE:-{gpus_per_node}}}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # reads all: no SIGPIPE under pipefail
PORT=${{PUZZLE_RDZV_PORT:-{RDZV_PORT}}}

# One task per node; each starts GPUS_PER_NODE ranks (LOCAL_WORLD_SIZE = GPUS_PER_NODE, which "hsdp" reads).
srun --kill-on-bad-exit=1 {launch}
"""


def _pairs(args: Sequence[str]) -> list[str]:
    """The argv as shell words, an option and its value on one line, `-m puzzle run CONFIG` on the last."""
    lines: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "-m":
            lines.append(shell_join(args[i:]))
            break
        if args[i].startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("-"):
            lines.append(shell_join(args[i : i + 2]))
            i += 2
        else:
            lines.append(shell_join(args[i : i + 1]))
            i += 1
    return lines
