#!/usr/bin/env bash
# Example Slurm batch script: one DeepSpeed launcher per node, no ssh between nodes.
#   sbatch --nodes=4 launch/slurm_job.sh -- --input_dir /data/bert_h5
# Change the settings below or export them before sbatch (sbatch passes the environment by default).
# Near the time limit Slurm sends USR1 (--signal): every rank finishes its step, saves a checkpoint and exits 75; the
# job then queues itself again (--requeue, scontrol requeue) and the next run continues with --resume. Set
# LAUNCH_REQUEUE=0 to end the job there instead.
#SBATCH --job-name=bert-ds
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=%x_%j.out
#SBATCH --open-mode=append
#SBATCH --signal=USR1@300
#SBATCH --requeue
set -euo pipefail
export LAUNCH_PROFILE="${LAUNCH_PROFILE:-roce}"      # roce (Gaudi NICs), efa (DL1), nccl-efa (GPU), tcp (CPU)
export LAUNCH_PRESET="${LAUNCH_PRESET:-bert_large}"
export LAUNCH_SLOTS="${LAUNCH_SLOTS:-8}"             # accelerators per node (SLURM_GPUS_ON_NODE wins when set)
export MASTER_PORT="${MASTER_PORT:-29500}"
REPO="${REPO:-$SLURM_SUBMIT_DIR}"
args=("$@")
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then     # a requeued job: continue the run from its newest checkpoint
  case " ${args[*]-} " in
    *" -- "*) args+=(--resume) ;;
    *) args+=(-- --resume) ;;
  esac
fi
status=0
"$REPO/launch/run.sh" --launcher srun ${args[@]+"${args[@]}"} || status=$?
if [ "$status" -eq 75 ] && [ "${LAUNCH_REQUEUE:-1}" = 1 ]; then  # stopped with a checkpoint saved: run again
  echo "[slurm_job.sh] exit 75 (checkpoint saved, stopped early): requeueing job $SLURM_JOB_ID to resume"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
