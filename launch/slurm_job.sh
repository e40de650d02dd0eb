#!/usr/bin/env bash
# Example Slurm batch script: one DeepSpeed launcher per node, no ssh between nodes.
#   sbatch --nodes=4 launch/slurm_job.sh -- --input_dir /data/bert_h5
# Change the settings below or export them before sbatch (sbatch passes the environment by default).
#SBATCH --job-name=bert-ds
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=%x_%j.out
set -euo pipefail
export LAUNCH_PROFILE="${LAUNCH_PROFILE:-roce}"      # roce (Gaudi NICs), efa (DL1), nccl-efa (GPU), tcp (CPU)
export LAUNCH_PRESET="${LAUNCH_PRESET:-bert_large}"
export LAUNCH_SLOTS="${LAUNCH_SLOTS:-8}"             # accelerators per node (SLURM_GPUS_ON_NODE wins when set)
export MASTER_PORT="${MASTER_PORT:-29500}"
REPO="${REPO:-$SLURM_SUBMIT_DIR}"
exec "$REPO/launch/run.sh" --launcher srun "$@"
