"""Start a training run on one or many nodes. Every setting is a named option whose default comes from an
environment variable (shown in --help), so a cluster script sets a few variables and calls `launch/run.sh`.

    python -m launch.run --hostfile hostfile --profile efa --preset bert_large -- --input_dir /data/h5
    python -m launch.run --launcher no_ssh --node_rank 1 --master_addr 10.0.0.5 --hostfile hostfile ...
    python -m launch.run --launcher mpirun --hostfile hostfile --profile roce ...
    python -m launch.run --dry_run ...          # print the command, one argument per line, the DeepSpeed JSON the
                                                # run will use, and exit

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
mpi_discovery. Arguments after `--` go to the training module unchanged. This wrapper starts every process with an
argument list, never through a shell. One launch does go through a shell: under pdsh, DeepSpeed's runner joins the
exported variables, `cd` into this directory, the interpreter, the master address and the module's arguments into
ONE command string that each node's login shell runs. There every word is quoted by the change pdsh_remote_quoted
(ds_core.compat.pdsh_quoting); where that change is off, any value that shell would act on is refused before launch,
naming it (launch.remote_shell).

Secrets (secret-looking names, ds_core.redact): --dry_run shows their values as <redacted>; mpirun gets them by name
(`-x NAME`, `-genvlist NAME`) with the values in its environment, and DeepSpeed's openmpi/mpich runners the same way
(their .deepspeed_env is handed over without them, through DS_ENV_FILE); pdsh has no channel but the remote command
line, so a launch that would export one says so in one line (docs/cluster.md "Security").

How: the flags (launch.settings.add_run_arguments) become one launch.settings.LaunchSettings, resolved once
(launch.slurm and launch.aws_batch fill in hostfile, node rank and master from their cluster's variables); its
hostfile is read and checked; then one small builder per launcher (BUILDERS) turns it into the command. What the
ranks' environment gets (profile, .deepspeed_env) comes from launch.env.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

import ds_configs
from ds_core.cli import cli_main
from ds_core.rank.venv import torch_extensions_env
from ds_core.redact import is_secret, redact_argv, redact_mapping
from launch import env as envmod, hostfile as hf, log, preflight, remote_shell
from launch.local_ranks import deepspeed_launcher
from launch.settings import DEFAULT_DIST_TIMEOUT_S, LaunchError, LaunchSettings, add_run_arguments

# what a launch can fail on with a message for the user (exit status 2, ds_core.cli)
LAUNCH_ERRORS: tuple[type[BaseException], ...] = (LaunchError, hf.HostfileError, envmod.EnvFileError,
                                                  remote_shell.RemoteShellError)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_run_arguments(p)
    return p




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


# sonames of each flavour's libmpi: Open MPI 1.10+ is libmpi.so.40 (ABI 40), MPICH and its ABI family (Intel MPI,
# MVAPICH, Cray MPICH) libmpi.so.12. The unversioned libmpi.so link exists only with the -dev package installed.
LIBMPI_NAMES = {"openmpi": ("libmpi.so.40", "libmpi.so"), "mpich": ("libmpi.so.12", "libmpi.so")}
# programs beside mpirun that link libmpi (or the libraries installed beside it): ldd names where they come from
_MPI_PROGRAMS = {"openmpi": ("ompi_info", "orted", "prted", "mpirun"), "mpich": ("mpichversion", "mpivars", "mpirun")}


def ldd_libraries(binary: str | os.PathLike) -> dict[str, str]:
    """soname -> resolved path of the shared libraries `binary` loads, as the dynamic linker resolves them (ldd)."""
    try:
        out = subprocess.run(["ldd", str(binary)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in out.splitlines():  # "\tlibmpi.so.40 => /usr/lib/x86_64-linux-gnu/libmpi.so.40 (0x...)"
        name, arrow, rest = line.strip().partition(" => ")
        if arrow and rest.startswith("/"):
            found[name] = rest.split(" (", 1)[0]
    return found


def ldconfig_libraries() -> dict[str, list[str]]:
    """soname -> paths in the dynamic linker's cache (`ldconfig -p`), in the cache's order."""
    ldconfig = shutil.which("ldconfig") or ("/sbin/ldconfig" if Path("/sbin/ldconfig").exists() else "ldconfig")
    try:
        out = subprocess.run([ldconfig, "-p"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[str, list[str]] = {}
    for line in out.splitlines()[1:]:  # "\tlibmpi.so.40 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libmpi.so.40"
        name, arrow, path = line.strip().partition(" => ")
        if arrow:
            found.setdefault(name.split(" (", 1)[0], []).append(path.strip())
    return found


def libmpi_of(flavor: str, mpirun: str) -> str:
    """The MPI library that belongs to `mpirun`, for mpi4py (MPI4PY_LIBMPI): mpi4py otherwise loads the first libmpi
    it finds, e.g. the pip `mpich` wheel's under Open MPI's mpirun ('unsupported PMI version PMIx').

    Looked for, first found wins: (1) the library directories the MPI itself names (Open MPI: `ompi_info --path
    libdir`; MPICH: <prefix>/lib, lib64 of mpirun's install prefix); (2) what the dynamic linker resolves for the MPI's
    own programs beside mpirun (ompi_info links libmpi; orted/mpirun link libopen-rte/libopen-pal, which a
    distribution installs beside libmpi): libmpi itself, else libmpi in those libraries' directories; (3) the
    linker cache (`ldconfig -p`) by the flavour's soname. (1) alone missed Debian's Open MPI: with `openmpi-bin`
    and without libopenmpi-dev, libdir is .../openmpi/lib, which holds no libmpi.so*; libmpi.so.40 lies in the
    multiarch directory."""
    names = LIBMPI_NAMES["openmpi" if flavor == "openmpi" else "mpich"]
    bindir = Path(mpirun).resolve().parent if mpirun else None
    dirs: list[Path] = []
    if flavor == "openmpi":
        ompi_info = bindir / "ompi_info" if bindir else None
        try:
            out = subprocess.run([str(ompi_info) if ompi_info and ompi_info.exists() else "ompi_info", "--parsable",
                                  "--path", "libdir"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 timeout=30).stdout
            dirs = [Path(line.split(":", 2)[2]) for line in out.splitlines() if line.startswith("path:libdir:")]
        except (OSError, subprocess.TimeoutExpired):
            pass
    elif bindir is not None:
        dirs = [bindir.parent / "lib", bindir.parent / "lib64"]
    for d in dirs:
        for n in names:
            if (d / n).exists():
                return str(d / n)
    for prog in _MPI_PROGRAMS["openmpi" if flavor == "openmpi" else "mpich"]:
        path = (bindir / prog) if bindir else None
        if path is None or not path.exists():
            continue
        libs = ldd_libraries(path)
        for n in names:
            if n in libs and Path(libs[n]).exists():
                return libs[n]
        for lib in libs.values():  # libopen-pal / libopen-rte / libmpich... sit beside libmpi
            if Path(lib).name.startswith(("libopen-", "libmpi", "libprrte", "libpmix")):
                for n in names:
                    if (Path(lib).parent / n).exists():
                        return str(Path(lib).parent / n)
    cache = ldconfig_libraries()
    for n in names[:1]:  # the versioned soname only: an unversioned libmpi.so could be either flavour's
        for path in cache.get(n, []):
            if Path(path).exists():
                return path
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


# ------------------------------------------------------------------------------- one builder per launcher
# Each takes the resolved settings (hosts read: LaunchSettings.with_hosts) and returns (argv, variables to add to
# the launcher's environment). Checks run in the order a user fixes them: settings, env files, ports.
Built = tuple[list[str], dict[str, str]]


def _guarded(s: LaunchSettings) -> list[str]:
    """DeepSpeed's user-script part: launch.guard as a module, wrapping the training module."""
    return ["--module", "launch.guard", *guard_args(s, s.module_args), *train_args(s, s.module_args)]


def _nodes_flag(s: LaunchSettings) -> list[str]:
    return ["--num_nodes", str(s.nodes)] if s.nodes else []


def _addr_flag(s: LaunchSettings) -> list[str]:
    return ["--master_addr", s.master_addr] if s.master_addr else []


def build_pdsh(s: LaunchSettings, environ: Mapping[str, str], cwd: str | None) -> Built:
    """`deepspeed --hostfile H` on the first node; DeepSpeed reaches the others over pdsh with .deepspeed_env. What
    reaches the nodes' shell is checked first (launch.remote_shell)."""
    envmod.require_profile_in_deepspeed_env(s.profile, cwd)
    user = _guarded(s)
    if len(s.used_hosts) > 1:  # one host: DeepSpeed's local launch, an argument list
        secrets = remote_shell.check_launch([("argument", a) for a in user[1:]], s.master_addr, cwd, environ,
                                            envmod.load_deepspeed_env(cwd, environ))
        if secrets:
            log.say(f"run: pdsh will put {', '.join(secrets)} on every node's command line (DeepSpeed's pdsh launch "
                    f"has no other channel; `ps` shows it there): docs/cluster.md \"Security\"", stderr=True)
    if not s.dry_run:
        check_master_port(s.master_addr or s.used_hosts[0].name, s.port)
    return deepspeed_launcher() + ["--hostfile", s.hostfile, "--master_port", str(s.port), *_addr_flag(s),
                                   *_nodes_flag(s), *user], {}


def build_no_ssh(s: LaunchSettings, environ: Mapping[str, str], cwd: str | None) -> Built:
    """One DeepSpeed launcher per node; DeepSpeed does not read .deepspeed_env here, so its entries and the profile
    go into the launcher's environment."""
    used = s.used_hosts
    if not s.master_addr:
        raise LaunchError("no_ssh: --master_addr (or $MASTER_ADDR) is required: nodes cannot ask each other")
    if not 0 <= s.node_rank < len(used):
        raise LaunchError(f"no_ssh: --node_rank {s.node_rank} is outside 0..{len(used) - 1} "
                          f"({len(used)} hosts in {s.hostfile})")
    if not s.dry_run and s.node_rank == 0:  # node 0 serves the port; on other nodes it is node 0's own store
        check_master_port(s.master_addr, s.port)
    added = envmod.rank_env_additions(s.profile, cwd, environ)
    return deepspeed_launcher() + ["--hostfile", s.hostfile, "--no_ssh", "--node_rank", str(s.node_rank),
                                   *_addr_flag(s), "--master_port", str(s.port), *_nodes_flag(s), *_guarded(s)], added


def build_deepspeed_mpi(s: LaunchSettings, environ: Mapping[str, str], cwd: str | None) -> Built:
    """`deepspeed --launcher openmpi|mpich`: DeepSpeed builds the mpirun command."""
    if s.nodes and s.nodes != len(s.hosts):
        raise LaunchError(f"{s.launcher}: DeepSpeed's MPI backends cannot limit nodes; write a hostfile with "
                          f"{s.nodes} hosts instead of --nodes")
    envmod.require_profile_in_deepspeed_env(s.profile, cwd)
    mpi = mpi_setup(s, environ)
    if not s.dry_run and s.master_port:
        check_master_port(s.master_addr or s.used_hosts[0].name, s.master_port)
    # DeepSpeed shlex-splits --launcher_args; shlex.join is its exact inverse, so each ARG stays one argument.
    # One `--launcher_args=VALUE` token: as two tokens, a VALUE starting with '-' (--allow-run-as-root) is taken
    # by DeepSpeed's argparse for an option ("argument --launcher_args: expected one argument").
    by_name, added = _secrets_by_name(s, cwd, environ)
    launcher_args = [*s.launcher_arg, *by_name]
    largs = [f"--launcher_args={shlex.join(launcher_args)}"] if launcher_args else []
    # DeepSpeed's MPI runners use --master_addr only for their own variables (launch.guard replaces them);
    # naming the first host spares runner.main its `ssh HOST hostname -I`, which an MPI cluster need not allow
    ds_addr = ["--master_addr", s.master_addr or s.used_hosts[0].name]
    rank = [*guard_args(s, s.module_args, mpi), *train_args(s, s.module_args)]
    if s.launcher == "mpich":
        # DeepSpeed's MPICHRunner.get_cmd puts `-m` before the path of its launcher_helper.py when --module is
        # given (`No module named '/.../launcher_helper.py'`): run the guard by file path, without --module
        user = [str(Path(__file__).resolve().with_name("guard.py")), *rank]
    else:
        user = ["--module", "launch.guard", *rank]
    return deepspeed_launcher() + ["--hostfile", s.hostfile, "--launcher", s.launcher, *largs,
                                   "--master_port", str(s.port), *ds_addr, *user], added


def _secrets_by_name(s: LaunchSettings, cwd: str | None, environ: Mapping[str, str]) -> tuple[list[str], dict]:
    """DeepSpeed's MPI runners put every .deepspeed_env entry on mpirun's command line (`-x K=V`, `-genv K V`).
    Where entries are secret-looking: DeepSpeed gets a copy of the merged file without them (0600, this user's
    private directory, named by DS_ENV_FILE, which DeepSpeed joins with ~ and . and an absolute path survives), and
    mpirun forwards them by name from its environment (Open MPI `-x NAME`, Hydra `-genvlist A,B`). Returns
    (launcher arguments, variables for the launcher's environment)."""
    from ds_core.files import atomic_write_text, private_dir
    from ds_core.redact import secret_names

    entries = envmod.load_deepspeed_env(cwd, environ)
    secrets = secret_names(entries)
    if not secrets:
        return [], {}
    kept = {k: v for k, v in entries.items() if k not in secrets}
    path = private_dir("ds_launch") / f"deepspeed_env.{os.getpid()}"
    atomic_write_text(path, envmod.format_env(kept), secret=True)
    flags = [a for n in secrets for a in ("-x", n)] if s.launcher == "openmpi" else ["-genvlist", ",".join(secrets)]
    return flags, {"DS_ENV_FILE": str(path), **{n: entries[n] for n in secrets}}


def build_mpirun(s: LaunchSettings, environ: Mapping[str, str], cwd: str | None) -> Built:
    """mpirun (MPICH/Hydra or Open MPI) starts every rank; ranks find each other through mpi4py (launch.guard)."""
    mpi = mpi_setup(s, environ)
    used = s.used_hosts
    if not s.dry_run and s.master_port:
        check_master_port(s.master_addr or used[0].name, s.master_port)
    ranks_env = envmod.mpirun_rank_env(s.profile, cwd, environ)
    total, per_node = sum(h.slots for h in used), used[0].slots
    py = [sys.executable, "-u", "-m", "launch.guard", *guard_args(s, s.module_args, mpi),
          *train_args(s, s.module_args)]
    # secret-looking variables go by name, their values in mpirun's environment: never on its command line
    secrets = {k: v for k, v in ranks_env.items() if is_secret(k)}
    if mpi["flavor"] == "openmpi":
        cmd = [mpi["mpirun"] or "mpirun", "-n", str(total), "-H", ",".join(f"{h.name}:{h.slots}" for h in used),
               "--map-by", f"ppr:{per_node}:node", *s.launcher_arg]
        for k, v in ranks_env.items():
            cmd += ["-x", k if k in secrets else f"{k}={v}"]
    else:
        cmd = [mpi["mpirun"] or "mpirun", "-n", str(total), "-ppn", str(per_node), "-hosts",
               ",".join(h.name for h in used), *s.launcher_arg]
        for k, v in ranks_env.items():
            if k not in secrets:
                cmd += ["-genv", k, v]
        if secrets:
            cmd += ["-genvlist", ",".join(secrets)]
    return cmd + py, secrets


def build_srun(s: LaunchSettings, environ: Mapping[str, str], cwd: str | None) -> Built:
    """Inside a Slurm allocation: one launch.slurm per node, which resolves its node's settings there."""
    if "SLURM_JOB_ID" not in environ and not s.dry_run:
        raise LaunchError("srun: not inside a Slurm allocation (SLURM_JOB_ID unset); use sbatch/salloc")
    node_flags = ["--nodes", str(s.nodes)] if s.nodes else []
    # Not forwarded: the launcher, hostfile and node rank (launch.slurm resolves them on each node), --nodes and
    # --launcher_arg (srun's own), --mpi_flavor and --dry_run (nothing of them reaches a node).
    forwarded = s.replace(master_port=s.port).to_argv(
        ["profile", "module", "preset", "deepspeed_config", "master_addr", "master_port", "slots", "dist_timeout_s",
         "stall_grace_s"])
    return ["srun", *node_flags, "--ntasks-per-node=1", "--kill-on-bad-exit=1", *s.launcher_arg,
            sys.executable, "-u", "-m", "launch.slurm", *forwarded, "--", *s.module_args], {}


BUILDERS: dict[str, Callable[[LaunchSettings, Mapping[str, str], str | None], Built]] = {
    "pdsh": build_pdsh, "no_ssh": build_no_ssh, "openmpi": build_deepspeed_mpi, "mpich": build_deepspeed_mpi,
    "mpirun": build_mpirun, "srun": build_srun}


def build_command(s: LaunchSettings, environ: Mapping[str, str] | None = None, cwd: str | None = None) -> Built:
    """(argv, variables to add to the launcher's environment) for the settings' launcher; the hosts must have been
    read (LaunchSettings.with_hosts) for every launcher but srun."""
    if s.launcher != "srun" and not s.hosts:
        raise LaunchError(f"{s.launcher}: no hosts resolved from {s.hostfile} (call LaunchSettings.with_hosts)")
    return BUILDERS[s.launcher](s, os.environ if environ is None else environ, cwd)


def ds_config_of(s: LaunchSettings) -> tuple[str, str]:
    """(file, why) of the DeepSpeed JSON the run will use: the one its command names, else the recipe's or the
    preset's (ds_configs.DEFAULT_JSON); file '' where the module chooses its own or its preset has none."""
    return ds_configs.json_for_args(s.module, train_args(s, s.module_args))


def shown_path(file: str) -> str:
    """A JSON as the module will open it: a bare name that is not a file here is looked up in ds_configs/."""
    if file and not Path(file).exists() and (Path(ds_configs.__file__).parent / Path(file).name).is_file() \
            and len(Path(file).parts) <= 2:
        return str(Path(ds_configs.__file__).parent / Path(file).name)
    return file


def check_ds_json_before_spawn(s: LaunchSettings) -> None:
    """The whole DeepSpeed JSON the run will use (nested keys, by DeepSpeed's own classes) and its batch arithmetic
    for this world, before any node starts a rank (ds_core.config.ds_json); deepspeed is imported here only when the
    JSON has not passed before."""
    from ds_core.config.ds_json import check_before_spawn
    from ds_core.errors import ConfigError

    path, why = ds_config_of(s)
    if not path:
        if "give --deepspeed_config" in why:
            raise LaunchError(why)
        return
    try:
        check_before_spawn(path, sum(h.slots for h in s.used_hosts) if s.launcher != "srun" else None)
    except ConfigError as e:
        raise LaunchError(str(e)) from None


def launch(s: LaunchSettings) -> int:
    """Read the hosts, build the command, and print it (dry run) or exec it."""
    # stdout carries the dry run's JSON alone: DeepSpeed's logger, made when DeepSpeed is first imported (here, for
    # what its runner exports), writes to the stdout of that moment, and some releases log there on import
    with contextlib.redirect_stdout(sys.stderr):
        s = s.with_hosts()
        cmd, added = build_command(s)
    added = {**torch_extensions_env({**os.environ, **added}), **added}  # one JIT op cache per venv
    if s.dry_run:
        path, why = ds_config_of(s)
        print(json.dumps({"argv": redact_argv(cmd), "env_added": redact_mapping(added),
                          "deepspeed_config": {"file": shown_path(path) or None, "chosen_by": why}}, indent=1))
        return 0
    check_ds_json_before_spawn(s)
    env = dict(os.environ)
    env.update(added)
    exe = cmd[0] if os.path.sep in cmd[0] else shutil.which(cmd[0])
    if not exe:
        raise LaunchError(f"{s.launcher}: {cmd[0]} not found on PATH")
    sys.stdout.flush()
    sys.stderr.flush()
    # exec: the launcher takes this process's place, so signals (and kill) reach it directly
    os.execve(exe, cmd, env)
    return 0  # not reached


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(argv, build_parser, lambda args, rest: launch(LaunchSettings.from_args(args, rest)), LAUNCH_ERRORS,
                    passthrough=True)


if __name__ == "__main__":
    sys.exit(main())
