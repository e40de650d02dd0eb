"""The launch settings: every wrapper (launch.run, launch.slurm, launch.aws_batch) resolves ONE LaunchSettings, from
its flags, the environment variables that give the flags their defaults, and the cluster's own variables (Slurm,
AWS Batch), before any launcher command is built. The command builders in launch.run take this object, not the flags.

    settings = LaunchSettings.from_args(build_parser().parse_args(own), extra)   # flags + $LAUNCH_* defaults
    settings = launch.slurm.resolve(settings, os.environ)                         # or launch.aws_batch.resolve
    settings = settings.with_hosts()                                              # the hostfile, read and checked

Declared once: each field is a flag of the same name (and so argparse dest; launch.run's helpers take either), with
its help and the environment variable giving its default in the field's metadata. add_run_arguments builds the
flags from the fields, and to_argv writes settings back as flags (srun hands them to launch.slurm on each node).
Resolution returns a new object (dataclasses.replace); nothing rewrites a settings object or a Namespace in place.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from launch import env as envmod, hostfile as hf

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


def _flag(default: Any, help: str, env: str = "", **argparse_kw: Any) -> Any:
    """A LaunchSettings field that is also the flag --<name>: its help, the environment variable that gives its
    default when set (read when the parser is built), and any other add_argument keyword (choices, metavar)."""
    return field(default=default, metadata={"help": help, "env": env, "argparse": argparse_kw})


@dataclass(frozen=True)
class LaunchSettings:
    """One launch, resolved. Every field but module_args and hosts is a flag of the same name (add_run_arguments)."""
    launcher: str = _flag("pdsh", "how ranks are started (see above); $LAUNCH_LAUNCHER, default pdsh",
                          env="LAUNCH_LAUNCHER", choices=LAUNCHERS)
    hostfile: str = _flag("hostfile", "DeepSpeed hostfile (`host slots=N` lines); $LAUNCH_HOSTFILE, default ./hostfile",
                          env="LAUNCH_HOSTFILE")
    nodes: int = _flag(0, "use the first N hosts of the hostfile (0: all); $LAUNCH_NODES, default 0",
                       env="LAUNCH_NODES")
    profile: str = _flag("", "fabric env profile from launch/env/ ({profiles}); pdsh/openmpi/mpich: must already be in "
                         ".deepspeed_env (python -m launch.env write); no_ssh/mpirun: passed to the ranks by this "
                         "wrapper; $LAUNCH_PROFILE, default none", env="LAUNCH_PROFILE")
    module: str = _flag("bert_ref.train", "training module run as `python -m MODULE` on every rank; $LAUNCH_MODULE, "
                        "default bert_ref.train", env="LAUNCH_MODULE")
    preset: str = _flag("", "passed as `--preset NAME` to the module (e.g. debug, bert_large); $LAUNCH_PRESET, "
                        "default none (the module's default)", env="LAUNCH_PRESET")
    deepspeed_config: str = _flag("", "DeepSpeed JSON passed as `--deepspeed_config` to the module; $LAUNCH_DS_CONFIG, "
                                  "default none: the module uses its recipe's or preset's (ds_configs.DEFAULT_JSON; "
                                  "--dry_run names it)", env="LAUNCH_DS_CONFIG")
    master_addr: str = _flag("", "address of node 0 that every rank can reach; required for no_ssh; pdsh asks the "
                             "first host over ssh (`hostname -I`) when empty, openmpi/mpich/mpirun use rank 0's "
                             "address (broadcast through mpi4py by launch.guard), srun the first host's name; "
                             "$MASTER_ADDR", env="MASTER_ADDR")
    master_port: int = _flag(0, "TCP port on node 0 for the rendezvous; $MASTER_PORT; default (0): 29500, except under "
                             "MPI (openmpi, mpich, mpirun) where rank 0 picks a free port and broadcasts it. Where "
                             "node 0 is this machine, a port already in use is refused before anything starts",
                             env="MASTER_PORT")
    node_rank: int = _flag(-1, "no_ssh: this node's index in the hostfile (0 = the master_addr node); "
                           "$LAUNCH_NODE_RANK", env="LAUNCH_NODE_RANK")
    dist_timeout_s: int = _flag(0, "collective timeout passed to the module as --dist_timeout_s (0: the module's own, "
                                f"{DEFAULT_DIST_TIMEOUT_S} s unless given after --); $LAUNCH_DIST_TIMEOUT_S",
                                env="LAUNCH_DIST_TIMEOUT_S")
    stall_grace_s: int = _flag(60, "a rank silent (stopped, frozen) for the collective timeout plus this many seconds "
                               "is killed by launch.guard, so every node's launcher exits non-zero; 0 disables the "
                               "guard's kill; $LAUNCH_STALL_GRACE_S, default 60", env="LAUNCH_STALL_GRACE_S")
    launcher_arg: tuple[str, ...] = _flag((), "one extra argument for the underlying launcher (mpirun / srun / "
                                          "DeepSpeed's --launcher_args for openmpi/mpich); repeat for several; write "
                                          "--launcher_arg=-x for one that starts with '-'", metavar="ARG")
    mpi_flavor: str = _flag("auto", "mpirun launcher: which MPI's flags to use (auto: ask `mpirun --version`); the "
                            "ranks' mpi4py loads the library of the mpirun on PATH",
                            choices=("auto", "mpich", "openmpi"))
    slots: int = _flag(8, "srun: accelerators per node for the hostfile launch.slurm builds; $LAUNCH_SLOTS, default 8",
                       env="LAUNCH_SLOTS")
    dry_run: bool = _flag(False, "print the command (JSON, one argument per line), the variables added and the "
                          "DeepSpeed JSON the run will use (and what chose it), then exit")
    module_args: tuple[str, ...] = ()  # the arguments after `--`, for the module, unchanged
    hosts: tuple[hf.Host, ...] = field(default=(), compare=False)  # with_hosts(): the hostfile's hosts, checked

    @classmethod
    def flag_fields(cls) -> tuple[dataclasses.Field, ...]:
        return tuple(f for f in dataclasses.fields(cls) if "help" in f.metadata)

    @classmethod
    def from_args(cls, args: argparse.Namespace, module_args: Sequence[str] = ()) -> "LaunchSettings":
        """From a parser built with add_run_arguments (other parsers' extra options are ignored)."""
        values = {f.name: getattr(args, f.name) for f in cls.flag_fields() if hasattr(args, f.name)}
        if "launcher_arg" in values:
            values["launcher_arg"] = tuple(values["launcher_arg"])
        return cls(**values, module_args=tuple(module_args))

    def to_argv(self, names: Sequence[str] | None = None) -> list[str]:
        """These settings as flags that add_run_arguments parses back to the same values: the fields `names` (default:
        every flag), each written out even where it equals the default, so the receiving side's environment
        defaults cannot change it. Values are separate arguments (`--launcher_arg=V` for the repeated one, whose
        values may start with '-'); nothing here passes through a shell."""
        fields = {f.name: f for f in self.flag_fields()}
        unknown = [n for n in (names or ()) if n not in fields]
        if unknown:
            raise ValueError(f"LaunchSettings.to_argv: {unknown} are not flags (flags: {sorted(fields)})")
        out: list[str] = []
        for name in (fields if names is None else names):
            value = getattr(self, name)
            if fields[name].type in (bool, "bool"):
                out += [f"--{name}"] if value else []
            elif isinstance(value, tuple):
                out += [f"--{name}={v}" for v in value]
            else:
                out += [f"--{name}", str(value)]
        return out

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


# field.type is the annotation as a string under `from __future__ import annotations`
_TYPES = {"int": int, "str": str, int: int, str: str}


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The LaunchSettings fields as flags, in field order, each defaulting to its environment variable when set."""
    g = p.add_argument_group("run settings (each defaults to the environment variable named in its help)")
    for f in LaunchSettings.flag_fields():
        md, kw = f.metadata, dict(f.metadata["argparse"])
        kw["help"] = md["help"].format(profiles=", ".join(envmod.profile_names())) if f.name == "profile" \
            else md["help"]
        if f.type in (bool, "bool"):
            g.add_argument(f"--{f.name}", action="store_true", **kw)
        elif isinstance(f.default, tuple):
            g.add_argument(f"--{f.name}", action="append", default=[], **kw)
        else:
            conv = _TYPES[f.type]
            raw = os.environ.get(md["env"]) if md["env"] else None
            try:
                default = f.default if raw is None else conv(raw)
            except ValueError:
                p.error(f"${md['env']}={raw!r} (the default of --{f.name}): expected {f.type}")
            g.add_argument(f"--{f.name}", type=conv, default=default, **kw)
