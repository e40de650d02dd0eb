#!/usr/bin/env bash
# Thin wrapper around `python -m launch.run`. Settings are named environment variables with defaults
# (`python -m launch.run --help` lists them); flags given here override them:
#   LAUNCH_LAUNCHER=pdsh LAUNCH_HOSTFILE=hostfile LAUNCH_NODES=0 LAUNCH_PROFILE= LAUNCH_MODULE=bert_ref.train
#   LAUNCH_PRESET= LAUNCH_DS_CONFIG=ds_configs/bert_large_zero1_bf16.json MASTER_ADDR= MASTER_PORT= (29500; MPI: free)
#   LAUNCH_NODE_RANK= LAUNCH_DIST_TIMEOUT_S= LAUNCH_STALL_GRACE_S=60
# Example: LAUNCH_PROFILE=efa LAUNCH_PRESET=bert_large launch/run.sh -- --input_dir /data/bert_h5
# The current directory is kept: DeepSpeed reads ./.deepspeed_env from where it is started.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m launch.run "$@"
