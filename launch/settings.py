"""The launch settings: every wrapper (launch.run, launch.slurm, launch.aws_batch) resolves ONE LaunchSettings, from
its flags, the environment variables that give the flags their defaults, and the cluster's own variables (Slurm,
AWS Batch), before any launcher command is built. The command builders in launch.run take this object, not the flags.

    settings = LaunchSettings.from_args(build_parser().parse_args(own), extra)   # flags + $LAUNCH_* defaults
    settings = launch.slurm.resolve(settings, os.environ)                         # or launch.aws_batch.resolve
    settings = settings.with_hosts()                                              # the hostfile, read and checked

Each field keeps the name of its flag (and so of the argparse dest): launch.run's helpers take either.
Resolution returns a new object (dataclasses.replace); nothing rewrites a settings object or a Namespace in place.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Sequence

from launch import env as envmod
from launch import hostfile as hf

LAUNCHERS = ("pdsh", "no_ssh", "openmpi", "mpich", "mpirun", "srun")
MPI_LAUNCHERS = ("openmpi", "mpich", "mpirun")
DEFAULT_MASTER_PORT = 29500  # DeepSpeed's and torch's default
# ds_core.config.TrainConfig.dist_timeout_s's default (a test keeps them equal; importing it here would pull in torch,
# and the wrappers must start fast on a login node)
DEFAULT_DIST_TIMEOUT_S = 1800
# launchers that start the same number of ranks on every node
EQUAL_SLOTS = {"mpich", "mpirun", "srun"}


class LaunchError(RuntimeError):
    """A setting or file that makes the launch impossible; the message names it."""


@dataclass(frozen=True)
class LaunchSettings:
    """One launch, resolved. Field names are the flags' names; `add_run_arguments` gives each one's help."""
    launcher: str = "pdsh"
    hostfile: str = "hostfile"
    nodes: int = 0                  # the first N hosts of the hostfile (0: all)
    slots: int = 8                  # srun / Slurm / AWS Batch: accelerators per node for the hostfile written here
    profile: str = ""               # fabric env profile (launch/env/NAME.env)
    module: str = "bert_ref.train"  # what every rank runs as `python -m MODULE`
    preset: str = ""
    deepspeed_config: str = ""
    master_addr: str = ""
    master_port: int = 0            # 0: DEFAULT_MASTER_PORT, or under MPI a free port rank 0 picks
    node_rank: int = -1             # no_ssh: this node's index in the hostfile
    dist_timeout_s: int = 0         # 0: the module's own
    stall_grace_s: int = 60
    launcher_arg: tuple[str, ...] = ()
    mpi_flavor: str = "auto"
    dry_run: bool = False
    module_args: tuple[str, ...] = ()  # the arguments after `--`, for the module, unchanged
    hosts: tuple[hf.Host, ...] = field(default=(), compare=False)  # with_hosts(): the hostfile's hosts, checked

    @classmethod
    def from_args(cls, args: argparse.Namespace, module_args: Sequence[str] = ()) -> "LaunchSettings":
        """From a parser built with add_run_arguments (other parsers' extra options are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"module_args", "hosts"}
        values = {k: v for k, v in vars(args).items() if k in names}
        if "launcher_arg" in values:
            values["launcher_arg"] = tuple(values["launcher_arg"])
        return cls(**values, module_args=tuple(module_args))

    def replace(self, **changes) -> "LaunchSettings":
        return dataclasses.replace(self, **changes)

    def with_hosts(self) -> "LaunchSettings":
        """The hostfile read and checked for this launcher (srun: none yet, launch.slurm writes it on each node).
        Our parser first: DeepSpeed's own (runner._parse_hostfile) accepts `node2;touch x slots=1` and slots=0."""
        if self.launcher == "srun":
            return self
        hosts = hf.read_hostfile(self.hostfile, equal_slots=self.launcher in EQUAL_SLOTS, nodes=self.nodes)
        return self.replace(hosts=tuple(hosts))

    @property
    def used_hosts(self) -> tuple[hf.Host, ...]:
        return self.hosts[:self.nodes] if self.nodes else self.hosts

    @property
    def port(self) -> int:
        return self.master_port or DEFAULT_MASTER_PORT


def _env_default(name: str, default: str) -> str:
    return os.environ.get(name, default)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run settings (each defaults to the environment variable named in its help)")
    g.add_argument("--launcher", choices=LAUNCHERS, default=_env_default("LAUNCH_LAUNCHER", "pdsh"),
                   help="how ranks are started (see above); $LAUNCH_LAUNCHER, default pdsh")
    g.add_argument("--hostfile", default=_env_default("LAUNCH_HOSTFILE", "hostfile"),
                   help="DeepSpeed hostfile (`host slots=N` lines); $LAUNCH_HOSTFILE, default ./hostfile")
    g.add_argument("--nodes", type=int, default=int(_env_default("LAUNCH_NODES", "0")),
                   help="use the first N hosts of the hostfile (0: all); $LAUNCH_NODES, default 0")
    g.add_argument("--profile", default=_env_default("LAUNCH_PROFILE", ""),
                   help="fabric env profile from launch/env/ (" + ", ".join(envmod.profile_names()) +
                        "); pdsh/openmpi/mpich: must already be in .deepspeed_env (python -m launch.env write); "
                        "no_ssh/mpirun: passed to the ranks by this wrapper; $LAUNCH_PROFILE, default none")
    g.add_argument("--module", default=_env_default("LAUNCH_MODULE", "bert_ref.train"),
                   help="training module run as `python -m MODULE` on every rank; $LAUNCH_MODULE, "
                        "default bert_ref.train")
    g.add_argument("--preset", default=_env_default("LAUNCH_PRESET", ""),
                   help="passed as `--preset NAME` to the module (e.g. debug, bert_large); $LAUNCH_PRESET, "
                        "default none (the module's default)")
    g.add_argument("--deepspeed_config", default=_env_default("LAUNCH_DS_CONFIG", ""),
                   help="DeepSpeed JSON passed as `--deepspeed_config` to the module; $LAUNCH_DS_CONFIG, "
                        "default none: the module uses its own default (each model package declares one)")
    g.add_argument("--master_addr", default=_env_default("MASTER_ADDR", ""),
                   help="address of node 0 that every rank can reach; required for no_ssh; pdsh asks the first "
                        "host over ssh (`hostname -I`) when empty, openmpi/mpich/mpirun use rank 0's address "
                        "(broadcast through mpi4py by launch.guard), srun the first host's name; $MASTER_ADDR")
    g.add_argument("--master_port", type=int, default=int(_env_default("MASTER_PORT", "0")),
                   help="TCP port on node 0 for the rendezvous; $MASTER_PORT; default (0): 29500, except under MPI "
                        "(openmpi, mpich, mpirun) where rank 0 picks a free port and broadcasts it. Where node 0 is "
                        "this machine, a port already in use is refused before anything starts")
    g.add_argument("--node_rank", type=int, default=int(_env_default("LAUNCH_NODE_RANK", "-1")),
                   help="no_ssh: this node's index in the hostfile (0 = the master_addr node); $LAUNCH_NODE_RANK")
    g.add_argument("--dist_timeout_s", type=int, default=int(_env_default("LAUNCH_DIST_TIMEOUT_S", "0")),
                   help="collective timeout passed to the module as --dist_timeout_s (0: the module's own, "
                        f"{DEFAULT_DIST_TIMEOUT_S} s unless given after --); $LAUNCH_DIST_TIMEOUT_S")
    g.add_argument("--stall_grace_s", type=int, default=int(_env_default("LAUNCH_STALL_GRACE_S", "60")),
                   help="a rank silent (stopped, frozen) for the collective timeout plus this many seconds is "
                        "killed by launch.guard, so every node's launcher exits non-zero; 0 disables the guard's "
                        "kill; $LAUNCH_STALL_GRACE_S, default 60")
    g.add_argument("--launcher_arg", action="append", default=[], metavar="ARG",
                   help="one extra argument for the underlying launcher (mpirun / srun / DeepSpeed's "
                        "--launcher_args for openmpi/mpich); repeat for several; write --launcher_arg=-x for one that "
                        "starts with '-'")
    g.add_argument("--mpi_flavor", choices=("auto", "mpich", "openmpi"), default="auto",
                   help="mpirun launcher: which MPI's flags to use (auto: ask `mpirun --version`); the ranks' mpi4py "
                        "loads the library of the mpirun on PATH")
    g.add_argument("--slots", type=int, default=int(_env_default("LAUNCH_SLOTS", "8")),
                   help="srun: accelerators per node for the hostfile launch.slurm builds; $LAUNCH_SLOTS, default 8")
    g.add_argument("--dry_run", action="store_true",
                   help="print the command (JSON, one argument per line) and the variables added, then exit")
