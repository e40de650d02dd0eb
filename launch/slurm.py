"""Slurm per-node entry: run once per node (`srun --ntasks-per-node=1 python -m launch.slurm ...`, which is what
`python -m launch.run --launcher srun` starts). Each node expands SLURM_JOB_NODELIST into the same hostfile, takes
SLURM_NODEID as its node rank and the first node as master, and starts DeepSpeed's launcher with
`--no_ssh --node_rank`. No ssh between nodes and no `scontrol` needed. Options are those of launch.run.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from ds_core.cli import cli_main
from launch import hostfile as hf, run
from launch.settings import LaunchError, LaunchSettings, add_run_arguments


def slots_from_env(env: Mapping[str, str], default: int) -> int:
    # SLURM_GPUS_ON_NODE is set when the job asked for GPUs (--gpus-per-node / --gres); Gaudi jobs usually don't
    value = env.get("SLURM_GPUS_ON_NODE", "")
    return int(value) if value.isdigit() and int(value) > 0 else default


def resolve(settings: LaunchSettings, env: Mapping[str, str], hostfile_given: bool = False) -> LaunchSettings:
    """The settings with hostfile / node_rank / master_addr / launcher taken from the Slurm environment (a new
    object); writes this node's hostfile."""
    node_id = env.get("SLURM_NODEID", "")
    if not node_id.isdigit():
        raise LaunchError("launch.slurm: SLURM_NODEID is not set; start it with "
                          "`srun --ntasks-per-node=1 python -m launch.slurm ...` inside an allocation")
    hosts = hf.hosts_from_slurm(env, slots_from_env(env, settings.slots))
    if hostfile_given:
        path = hf.write_hostfile(hosts, settings.hostfile)  # every node writes identical contents
    else:
        path = node_hostfile(hosts, env)
    return settings.replace(hostfile=str(path), node_rank=int(node_id),
                            master_addr=settings.master_addr or hosts[0].name, launcher="no_ssh")


def node_hostfile(hosts: list, env: Mapping[str, str]) -> Path:
    """The default hostfile: node-local (nodes sharing a working directory never write the same path), in this
    user's private directory under the system temp dir (ds_core.files.private_dir: 0700, owner checked), created
    anew with O_EXCL under a unique name: no file another account placed there, or a requeued job's earlier file,
    is ever written through or taken."""
    from ds_core.files import private_dir

    text = hf.format_hostfile(hosts)
    hf.parse_hostfile(text, "hostfile from SLURM_JOB_NODELIST")  # what is about to be written: names, slots
    fd, name = tempfile.mkstemp(prefix=f"hostfile_{env.get('SLURM_JOB_ID', 'nojob')}_{socket.gethostname()}_",
                                dir=private_dir("ds_launch"))
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.slurm", description=__doc__, allow_abbrev=False)
    add_run_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # Slurm signals every process of this step: `#SBATCH --signal=USR1@N` before the time limit, SIGTERM from
    # scancel and from srun's --kill-on-bad-exit once another node's task has ended. DeepSpeed's runner (which this
    # process becomes) would die of either at once (their default action): of USR1 before the ranks' save, of TERM
    # while its ranks end with 75 on their own, turning the job's status into 143. Ignored here, which the runner
    # inherits across exec; it ends when its launch.py does, with its status. launch.py and launch.guard handle TERM
    # themselves; the ranks install their own handler for both (ds_core.run.stop.StopRequest: save, exit 75). Set
    # once the settings are resolved, just before the launch: a refusal leaves this process's dispositions alone.
    def body(args: argparse.Namespace, rest: list[str]) -> int:
        given = args.hostfile != build_parser().get_default("hostfile")  # a flag, or $LAUNCH_HOSTFILE: its default
        settings = resolve(LaunchSettings.from_args(args, rest), os.environ, given)
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        return run.launch(settings)

    return cli_main(argv, build_parser, body, run.LAUNCH_ERRORS, passthrough=True)


if __name__ == "__main__":
    sys.exit(main())
