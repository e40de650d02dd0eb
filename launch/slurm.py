"""Slurm per-node entry: run once per node (`srun --ntasks-per-node=1 python -m launch.slurm ...`, which is what
`python -m launch.run --launcher srun` starts). Each node expands SLURM_JOB_NODELIST into the same hostfile, takes
SLURM_NODEID as its node rank and the first node as master, and starts DeepSpeed's launcher with
`--no_ssh --node_rank`. No ssh between nodes and no `scontrol` needed. Options are those of launch.run.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from launch import hostfile as hf
from launch import run


def slots_from_env(env: Mapping[str, str], default: int) -> int:
    # SLURM_GPUS_ON_NODE is set when the job asked for GPUs (--gpus-per-node / --gres); Gaudi jobs usually don't
    value = env.get("SLURM_GPUS_ON_NODE", "")
    return int(value) if value.isdigit() and int(value) > 0 else default


def prepare(args, env: Mapping[str, str], hostfile_given: bool = False) -> None:
    """Fill hostfile / node_rank / master_addr / launcher from the Slurm environment."""
    node_id = env.get("SLURM_NODEID", "")
    if not node_id.isdigit():
        raise run.LaunchError("launch.slurm: SLURM_NODEID is not set; start it with "
                              "`srun --ntasks-per-node=1 python -m launch.slurm ...` inside an allocation")
    hosts = hf.hosts_from_slurm(env, slots_from_env(env, args.slots))
    # default: a node-local file, so nodes sharing a working directory never write the same path
    path = Path(args.hostfile) if hostfile_given else \
        Path(tempfile.gettempdir()) / f"ds_hostfile_{env.get('SLURM_JOB_ID', 'nojob')}_{socket.gethostname()}"
    hf.write_hostfile(hosts, path)  # every node writes identical contents
    args.hostfile = str(path)
    args.node_rank = int(node_id)
    args.master_addr = args.master_addr or hosts[0].name
    args.launcher = "no_ssh"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__)
    run.add_run_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    own, extra = run.split_extra(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(own)
    try:
        prepare(args, os.environ, hostfile_given=args.hostfile != p.get_default("hostfile"))
        return run.launch(args, extra)
    except (run.LaunchError, hf.HostfileError, run.envmod.EnvFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
