#!/bin/bash
# The seed's run (config.yaml beside this file) on 8 nodes of 8 x H100-80GB under Slurm. From the repository's
# root, once config.yaml's parent.path names the BF16 checkpoint and data.sources the distillation data:
#
#   sbatch examples/nemotron3_super/launch.sh [CONFIG]
#
# It plans the run on this job's GPUs first (`puzzle plan`, exit 2 naming the stage that does not fit:
# plan-64xH100.txt is that plan for 64 GPUs), then starts one torchrun per node (srun), all joining one c10d
# rendezvous on the first node; every rank runs `puzzle run CONFIG`, which makes the plan's checks again and
# resumes a killed job from the run directory (sbatch it again). run_dir and the parent must be on a
# filesystem every node sees.
#SBATCH --job-name=puzzle-nemotron3-super
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --output=puzzle-nemotron3-super-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"  # sbatch runs a copy of this file: relative paths are the submitter's
CONFIG=${1:-examples/nemotron3_super/config.yaml}
NODES=${SLURM_JOB_NUM_NODES:?run it with sbatch (or set SLURM_JOB_NUM_NODES and SLURM_JOB_NODELIST)}
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-8}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${PUZZLE_RDZV_PORT:-29500}

puzzle plan "$CONFIG" --gpus $((NODES * GPUS_PER_NODE)) --hardware h100-80gb

srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$NODES" \
    --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$HEAD_NODE:$PORT" \
    -m puzzle run "$CONFIG"
