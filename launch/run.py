"""Start a training run on one or many nodes. Every setting is a named option whose default comes from an
environment variable (shown in --help), so a cluster script sets a few variables and calls `launch/run.sh`.

    python -m launch.run --hostfile hostfile --profile efa --preset bert_large -- --input_dir /data/h5
    python -m launch.run --launcher no_ssh --node_rank 1 --master_addr 10.0.0.5 --hostfile hostfile ...
    python -m launch.run --launcher mpirun --hostfile hostfile --profile roce ...
    python -m launch.run --dry_run ...          # print the command, one argument per line, and exit

Launchers:
  pdsh     `deepspeed --hostfile H` on the first node; DeepSpeed reaches the others over ssh (pdsh) and exports
           .deepspeed_env to them.
  no_ssh   one launcher per node (AWS Batch, Kubernetes, Slurm via launch.slurm):
           `deepspeed --hostfile H --no_ssh --node_rank I --master_addr A`. DeepSpeed does not read .deepspeed_env
           in this mode, so this wrapper puts the profile and .deepspeed_env entries into the launcher's environment.
  openmpi, mpich
           `deepspeed --hostfile H --launcher openmpi|mpich`: DeepSpeed builds the mpirun command.
  mpirun   mpirun (MPICH/Hydra or Open MPI) starts every rank directly; ranks find each other through mpi4py.
  srun     inside a Slurm allocation: `srun --ntasks-per-node=1 python -m launch.slurm ...` starts one no_ssh
           launcher per node, building the hostfile from SLURM_JOB_NODELIST.

Every rank runs under launch.guard (see there): a frozen rank is killed after the collective timeout plus
--stall_grace_s, so every node's launcher ends; under MPI the rendezvous comes from mpi4py, not DeepSpeed's
mpi_discovery. Arguments after `--` go to the training module unchanged. Every process gets its arguments as an
argument list; nothing is pasted into a shell command line.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

from launch import env as envmod
from launch import hostfile as hf
from launch import preflight

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    return p


def split_extra(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def deepspeed_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "deepspeed"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("deepspeed")
    # the runner module is what the `deepspeed` script runs; calling it keeps the same interpreter
    return [found] if found else [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]


def _given_dist_timeout(extra: Sequence[str]) -> int:
    """The last --dist_timeout_s among the module's own arguments (argparse keeps the last), 0 if none."""
    found = 0
    for i, a in enumerate(extra):
        if a == "--dist_timeout_s" and i + 1 < len(extra) and extra[i + 1].isdigit():
            found = int(extra[i + 1])
        elif a.startswith("--dist_timeout_s=") and a.partition("=")[2].isdigit():
            found = int(a.partition("=")[2])
    return found


def dist_timeout(args, extra: Sequence[str]) -> int:
    """The collective timeout the ranks will use: after `--`, else --dist_timeout_s here, else the module's default."""
    return _given_dist_timeout(extra) or args.dist_timeout_s or DEFAULT_DIST_TIMEOUT_S


def train_args(args, extra: Sequence[str]) -> list[str]:
    out = ["--deepspeed_config", args.deepspeed_config] if args.deepspeed_config else []
    if args.preset:
        out += ["--preset", args.preset]
    if args.dist_timeout_s:
        out += ["--dist_timeout_s", str(args.dist_timeout_s)]  # one given after `--` comes later and wins
    return out + list(extra)


def guard_args(args, extra: Sequence[str], mpi: dict | None = None) -> list[str]:
    """launch.guard's options and the module: every rank runs under the guard (see launch/guard.py)."""
    stall = dist_timeout(args, extra) + args.stall_grace_s if args.stall_grace_s > 0 else 0
    out = ["--stall_timeout_s", str(stall)]
    if mpi is not None:
        out.append("--mpi")
        if args.master_addr:
            out += ["--master_addr", args.master_addr]
        if args.master_port:
            out += ["--master_port", str(args.master_port)]
        if mpi.get("libmpi"):
            out += ["--mpi_lib", mpi["libmpi"]]
    return out + [args.module]


def rank_env_additions(args, cwd: str | None = None) -> dict[str, str]:
    """Variables this wrapper itself hands to the ranks (no_ssh, mpirun): profile, then .deepspeed_env files,
    which win as they do when DeepSpeed exports them over pdsh."""
    added = envmod.resolve_profile(args.profile) if args.profile else {}
    added.update(envmod.load_deepspeed_env(cwd))
    return added


def check_deepspeed_env_has_profile(args, cwd: str | None = None) -> None:
    """pdsh/openmpi/mpich: DeepSpeed exports .deepspeed_env itself; make sure the file is readable by it and holds
    the profile, so a node never starts without its fabric settings."""
    present = envmod.load_deepspeed_env(cwd)  # validates the file even without a profile
    if not args.profile:
        return
    ok, detail = envmod.compare_with_profile(envmod.profile_entries(args.profile), present)
    if not ok:
        raise LaunchError(
            f"profile {args.profile}: .deepspeed_env {detail}. DeepSpeed exports only that file to other nodes: "
            f"run `python -m launch.env write --profile {args.profile}` here first (add --set NAME=VALUE for a "
            "site value)")


def check_master_port(host: str, port: int) -> None:
    """A rendezvous port taken on this machine (another job, a leftover rank) otherwise shows up as a gloo/NCCL
    connection error after a minute or more; say so now. Bound as the store will bind it (SO_REUSEADDR), so a port
    with only TIME_WAIT sockets left counts as free."""
    if not preflight.is_local(host):
        return  # not this machine: launch.preflight checks it over ssh
    ok, detail = preflight.port_free(port)
    if not ok:
        raise LaunchError(f"master port {port} on {host}: {detail}; another run (or a leftover rank) holds it: "
                          "pick another --master_port / $MASTER_PORT")


def mpi_flavor_of(mpirun: str) -> str:
    """'openmpi' or 'mpich' (MPICH, Intel MPI and other Hydra-based mpiruns) for an mpirun executable."""
    try:
        out = subprocess.run([mpirun, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"cannot run `{mpirun} --version` ({e})") from None
    return "openmpi" if "Open MPI" in out or "OpenRTE" in out else "mpich"


def libmpi_of(flavor: str, mpirun: str) -> str:
    """The MPI library that belongs to `mpirun`, for mpi4py (MPI4PY_LIBMPI): mpi4py otherwise loads the first libmpi
    it finds, e.g. the pip `mpich` wheel's under Open MPI's mpirun ('unsupported PMI version PMIx')."""
    if flavor == "openmpi":
        ompi_info = Path(mpirun).with_name("ompi_info")
        try:
            out = subprocess.run([str(ompi_info) if ompi_info.exists() else "ompi_info", "--parsable", "--path",
                                  "libdir"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 timeout=30).stdout
            dirs = [Path(line.split(":", 2)[2]) for line in out.splitlines() if line.startswith("path:libdir:")]
        except (OSError, subprocess.TimeoutExpired):
            dirs = []
        names: tuple[str, ...] = ("libmpi.so.40", "libmpi.so")
    else:
        prefix = Path(mpirun).resolve().parents[1]
        dirs, names = [prefix / "lib", prefix / "lib64"], ("libmpi.so.12", "libmpi.so")
    for d in dirs:
        for n in names:
            if (d / n).exists():
                return str(d / n)
    return ""


def mpi_setup(args, environ: Mapping[str, str]) -> dict:
    """The mpirun the launch will run (the first on PATH, which DeepSpeed's runners run too), its flavour, and its
    libmpi for the ranks' mpi4py. The openmpi/mpich launchers refuse an mpirun of the other flavour: the pip `mpich`
    wheel puts its mpirun into the venv, in front of a system Open MPI (`token slots not supported`)."""
    mpirun = shutil.which("mpirun", path=environ.get("PATH")) or ""
    want = args.launcher if args.launcher != "mpirun" else args.mpi_flavor
    if not mpirun:
        if args.dry_run:
            return {"mpirun": "", "flavor": want if want != "auto" else "mpich", "libmpi": ""}
        raise LaunchError(f"{args.launcher}: no `mpirun` on PATH")
    found = mpi_flavor_of(mpirun)
    if want not in ("auto", found):
        msg = (f"{args.launcher}: `mpirun` on PATH ({mpirun}) is {found}, not {want}. Put {want}'s bin directory "
               "first on PATH (the `mpich` extra installs MPICH's mpirun into the venv: leave it out on Open MPI "
               "clusters)")
        if not args.dry_run:
            raise LaunchError(msg)
        return {"mpirun": mpirun, "flavor": want, "libmpi": "", "warning": msg}
    return {"mpirun": mpirun, "flavor": found, "libmpi": libmpi_of(found, mpirun)}


def build_command(args, extra: Sequence[str], environ: Mapping[str, str] | None = None,
                  cwd: str | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, variables to add to the launcher's environment) for the chosen launcher."""
    environ = os.environ if environ is None else environ
    equal = args.launcher in EQUAL_SLOTS
    hosts: list[hf.Host] = []
    if args.launcher != "srun":
        # our parser first: DeepSpeed's own (runner._parse_hostfile) accepts `node2;touch x slots=1` and slots=0
        hosts = hf.read_hostfile(args.hostfile, equal_slots=equal, nodes=args.nodes)
    used = hosts[:args.nodes] if args.nodes else hosts
    port_value = args.master_port or DEFAULT_MASTER_PORT
    port = ["--master_port", str(port_value)]
    addr = ["--master_addr", args.master_addr] if args.master_addr else []
    nodes = ["--num_nodes", str(args.nodes)] if args.nodes else []
    guarded = ["--module", "launch.guard", *guard_args(args, extra), *train_args(args, extra)]
    added: dict[str, str] = {}
    check_port = not args.dry_run

    if args.launcher == "pdsh":
        check_deepspeed_env_has_profile(args, cwd)
        if check_port:
            check_master_port(args.master_addr or used[0].name, port_value)
        cmd = deepspeed_cmd() + ["--hostfile", args.hostfile, *port, *addr, *nodes, *guarded]
    elif args.launcher == "no_ssh":
        if not args.master_addr:
            raise LaunchError("no_ssh: --master_addr (or $MASTER_ADDR) is required: nodes cannot ask each other")
        if not 0 <= args.node_rank < len(used):
            raise LaunchError(f"no_ssh: --node_rank {args.node_rank} is outside 0..{len(used) - 1} "
                              f"({len(used)} hosts in {args.hostfile})")
        if check_port and args.node_rank == 0:  # node 0 serves the port; on other nodes it is node 0's own store
            check_master_port(args.master_addr, port_value)
        added = rank_env_additions(args, cwd)
        cmd = deepspeed_cmd() + ["--hostfile", args.hostfile, "--no_ssh", "--node_rank", str(args.node_rank),
                                 *addr, *port, *nodes, *guarded]
    elif args.launcher in ("openmpi", "mpich"):
        if args.nodes and args.nodes != len(hosts):
            raise LaunchError(f"{args.launcher}: DeepSpeed's MPI backends cannot limit nodes; write a hostfile with "
                              f"{args.nodes} hosts instead of --nodes")
        check_deepspeed_env_has_profile(args, cwd)
        mpi = mpi_setup(args, environ)
        if check_port and args.master_port:
            check_master_port(args.master_addr or used[0].name, args.master_port)
        # DeepSpeed shlex-splits --launcher_args; shlex.join is its exact inverse, so each ARG stays one argument.
        # One `--launcher_args=VALUE` token: as two tokens, a VALUE starting with '-' (--allow-run-as-root) is taken
        # by DeepSpeed's argparse for an option ("argument --launcher_args: expected one argument").
        largs = [f"--launcher_args={shlex.join(args.launcher_arg)}"] if args.launcher_arg else []
        # DeepSpeed's MPI runners use --master_addr only for their own variables (launch.guard replaces them);
        # naming the first host spares runner.main its `ssh HOST hostname -I`, which an MPI cluster need not allow
        ds_addr = ["--master_addr", args.master_addr or used[0].name]
        rank = [*guard_args(args, extra, mpi), *train_args(args, extra)]
        if args.launcher == "mpich":
            # DeepSpeed's MPICHRunner.get_cmd puts `-m` before the path of its launcher_helper.py when --module is
            # given (`No module named '/.../launcher_helper.py'`): run the guard by file path, without --module
            user = [str(Path(__file__).resolve().with_name("guard.py")), *rank]
        else:
            user = ["--module", "launch.guard", *rank]
        cmd = deepspeed_cmd() + ["--hostfile", args.hostfile, "--launcher", args.launcher, *largs, *port, *ds_addr,
                                 *user]
    elif args.launcher == "mpirun":
        mpi = mpi_setup(args, environ)
        if check_port and args.master_port:
            check_master_port(args.master_addr or used[0].name, args.master_port)
        ranks_env = rank_env_additions(args, cwd)
        if environ.get("PYTHONPATH"):  # DeepSpeed's runners forward PYTHON* variables; so do we
            ranks_env.setdefault("PYTHONPATH", environ["PYTHONPATH"])
        total, per_node = sum(h.slots for h in used), used[0].slots
        py = [sys.executable, "-u", "-m", "launch.guard", *guard_args(args, extra, mpi), *train_args(args, extra)]
        if mpi["flavor"] == "openmpi":
            cmd = [mpi["mpirun"] or "mpirun", "-n", str(total), "-H", ",".join(f"{h.name}:{h.slots}" for h in used),
                   "--map-by", f"ppr:{per_node}:node", *args.launcher_arg]
            for k, v in ranks_env.items():
                cmd += ["-x", f"{k}={v}"]
        else:
            cmd = [mpi["mpirun"] or "mpirun", "-n", str(total), "-ppn", str(per_node), "-hosts",
                   ",".join(h.name for h in used), *args.launcher_arg]
            for k, v in ranks_env.items():
                cmd += ["-genv", k, v]
        cmd += py
    else:  # srun
        if "SLURM_JOB_ID" not in environ and not args.dry_run:
            raise LaunchError("srun: not inside a Slurm allocation (SLURM_JOB_ID unset); use sbatch/salloc")
        node_flags = ["--nodes", str(args.nodes)] if args.nodes else []
        forwarded = ["--profile", args.profile] if args.profile else []
        forwarded += ["--module", args.module, "--preset", args.preset,
                      *(["--deepspeed_config", args.deepspeed_config] if args.deepspeed_config else []),
                      "--master_port", str(port_value), "--slots", str(args.slots),
                      "--dist_timeout_s", str(args.dist_timeout_s), "--stall_grace_s", str(args.stall_grace_s)]
        if args.master_addr:
            forwarded += ["--master_addr", args.master_addr]
        cmd = ["srun", *node_flags, "--ntasks-per-node=1", "--kill-on-bad-exit=1", *args.launcher_arg,
               sys.executable, "-u", "-m", "launch.slurm", *forwarded, "--", *extra]
    return cmd, added


def launch(args, extra: Sequence[str]) -> int:
    cmd, added = build_command(args, extra)
    if args.dry_run:
        print(json.dumps({"argv": cmd, "env_added": added}, indent=1))
        return 0
    env = dict(os.environ)
    env.update(added)
    exe = cmd[0] if os.path.sep in cmd[0] else shutil.which(cmd[0])
    if not exe:
        raise LaunchError(f"{args.launcher}: {cmd[0]} not found on PATH")
    sys.stdout.flush()
    sys.stderr.flush()
    # exec: the launcher takes this process's place, so signals (and kill) reach it directly
    os.execve(exe, cmd, env)
    return 0  # not reached


def main(argv: Sequence[str] | None = None) -> int:
    own, extra = split_extra(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    try:
        return launch(args, extra)
    except (LaunchError, hf.HostfileError, envmod.EnvFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
