"""Start N local ranks, or N simulated nodes on loopback; wait with a timeout that kills every process started.

One owner for what the demo, benchmarks, tests and `ds-study` all need: a free port, the ranks' environment, the
command lines, and a process group per start so that a dead or hung job can be taken down whole (a killed launcher
alone leaves its ranks running, holding ports, memory and JIT build locks).

Two ways to start ranks on this machine:
- direct (`rank_commands`, `python -m launch.local_ranks -n 2 -m bert_ref.train ...`): this process spawns the ranks
  itself with the variables DeepSpeed's launch.py gives each rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE,
  CROSS_RANK, CROSS_SIZE, MASTER_ADDR, MASTER_PORT, --local_rank=N). It imports neither torch nor deepspeed: the
  `deepspeed` runner and its launch.py each import both (~3.5 s apiece on a 2-core CPU, one after the other) before
  any rank starts: most of the gap to a plain torchrun script (bench/startup.py). The documented local path.
- through DeepSpeed's launcher (`local_command`, `node_commands`): `deepspeed --num_gpus N` and the `--no_ssh`
  per-node form that AWS Batch or Kubernetes use; what the launch tests and multi-node studies exercise.

    cmds = rank_commands(2, ["-m", "bert_ref.train", "--preset", "debug", ...], master_port=free_port(), env=rank_env())
    result = run_ranks(cmds, cwd=".", log_path=Path("run/log.txt"), timeout_s=600)
    cmds = [local_command(2, ["--module", "bert_ref.train", ...], master_port=free_port())]
    result = run_launchers(cmds, env=rank_env(), cwd=".", log_path=Path("run/log.txt"), timeout_s=600)
    cmds = node_commands(2, 1, target, master_port=free_port(), hostfile=write_loopback_hostfile(p, 2, 1))
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ds_core.rank.parent_watch import pdeathsig_preexec
from ds_core.rank.rendezvous import LOOPBACK, free_port, rank_env, rank_variables
from launch import log


def deepspeed_launcher() -> list[str]:
    """DeepSpeed's launcher run by this interpreter, through launch.ds_runner (its MPI exports as given). Never a
    `deepspeed` found on PATH: on a Gaudi image that is the image's script, whose interpreter is the image's Python,
    not this venv's (which sees the image's DeepSpeed and the toolkit): DeepSpeed starts every rank with the
    launcher's own interpreter, which could not import the toolkit."""
    return [sys.executable, "-u", "-m", "launch.ds_runner"]


def local_command(num_ranks: int, target: Sequence[str], *, master_port: int) -> list[str]:
    """`deepspeed --num_gpus N --master_port P TARGET...`; TARGET is a script path or `--module M`, then its args."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks = {num_ranks}: expected >= 1")
    return [*deepspeed_launcher(), "--num_gpus", str(num_ranks), "--master_port", str(master_port), *target]


def rank_commands(num_ranks: int, target: Sequence[str], *, master_port: int, env: Mapping[str, str],
                  master_addr: str = LOOPBACK, local_rank_arg: bool = True) -> list[tuple[list[str], dict[str, str]]]:
    """(command, environment) per rank for starting `num_ranks` ranks on this host directly.

    TARGET is a script path, or `-m`/`--module` M, then its arguments. Each rank gets what DeepSpeed's
    deepspeed/launcher/launch.py sets for a one-node world (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, CROSS_RANK=0,
    CROSS_SIZE=1, LOCAL_SIZE, RANK, LOCAL_RANK, and `--local_rank=N` after the target unless `local_rank_arg` is
    false) and runs unbuffered (`python -u`), as there. launch.py also narrows CUDA_VISIBLE_DEVICES to the ranks'
    devices; each rank here picks device LOCAL_RANK itself (ds_core.rank.dist.init_distributed), which is the same.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks = {num_ranks}: expected >= 1")
    target = list(target)
    if not target:
        raise ValueError("no target: expected a script path or -m MODULE, then its arguments")
    if target[0] in ("-m", "--module"):
        if len(target) < 2:
            raise ValueError(f"{target[0]} without a module name")
        head, rest = ["-m", target[1]], target[2:]
    else:
        head, rest = [target[0]], target[1:]
    out = []
    for rank in range(num_ranks):
        cmd = [sys.executable, "-u", *head, *([f"--local_rank={rank}"] if local_rank_arg else []), *rest]
        out.append((cmd, {**env, **rank_variables(rank, num_ranks, master_port=master_port, master_addr=master_addr)}))
    return out


def write_loopback_hostfile(path: str | os.PathLike, nodes: int, slots: int) -> Path:
    """A hostfile of `nodes` simulated hosts (node0, node1, ...) with `slots` ranks each. With --no_ssh the names are
    only labels: every launcher is told the master address (loopback) directly."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(loopback_hostfile_text(nodes, slots))
    return path


def loopback_hostfile_text(nodes: int, slots: int) -> str:
    """The text of write_loopback_hostfile's hostfile (a plan holds it before anything is written)."""
    return "".join(f"node{i} slots={slots}\n" for i in range(nodes))


def node_commands(nodes: int, ranks_per_node: int, target: Sequence[str], *, master_port: int,
                  hostfile: str | os.PathLike, master_addr: str = LOOPBACK) -> list[list[str]]:
    """One `deepspeed --hostfile H --no_ssh --node_rank I --master_addr A` launcher per simulated node: what AWS Batch
    or Kubernetes start on each real node. `ranks_per_node` must match the hostfile's slots."""
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"nodes = {nodes}, ranks_per_node = {ranks_per_node}: expected >= 1")
    return [[*deepspeed_launcher(), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(i),
             "--master_addr", master_addr, "--master_port", str(master_port), *target] for i in range(nodes)]


@dataclass
class LaunchResult:
    codes: list[int]          # exit code per process (negative: killed by that signal)
    timed_out: bool
    seconds: float
    log_path: Path | None = None
    extra: dict = field(default_factory=dict)
    killed: list[bool] = field(default_factory=list)  # still running when the group was killed

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.codes)

    @property
    def exit_code(self) -> int:
        """The first non-zero exit code of a process that ended on its own (0 when all succeeded), else of any (a
        peer killed after another failed reads -9, which is not why the job failed); 124 on a timeout, as coreutils'
        timeout."""
        if self.timed_out:
            return 124
        own = [c for c, k in zip(self.codes, self.killed or [False] * len(self.codes)) if not k]
        return next((c for c in own if c != 0), next((c for c in self.codes if c != 0), 0))


def _kill_session(sid: int) -> None:
    """SIGKILL every process left in session `sid` (procfs; no-op where there is none). A killed rank's compiler
    children would otherwise finish a build nobody waits for while its lock file blocks every later run."""
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == sid and int(entry.name) != os.getpid():
                os.kill(int(entry.name), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass


class LauncherGroup:
    """Processes (launchers or ranks) started in sessions of their own, so that each can be killed with all its
    children. With `new_session=False` they stay in the caller's process group instead (the foreground CLI: a
    Ctrl-C or a test's kill of the CLI's group reaches the ranks too)."""

    def __init__(self, cmds: Sequence[Sequence[str]], *, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike, log_path: str | os.PathLike | None = None,
                 envs: Sequence[Mapping[str, str]] | None = None, new_session: bool = True,
                 inherit_output: bool = False):
        if (env is None) == (envs is None) or (envs is not None and len(envs) != len(cmds)):
            raise ValueError("give either env (one for all) or envs (one per command)")
        self.log_path = Path(log_path) if log_path else None
        self._log = open(self.log_path, "ab") if self.log_path else (None if inherit_output else subprocess.DEVNULL)
        self.new_session = new_session
        self.procs: list[subprocess.Popen] = []
        try:
            for i, cmd in enumerate(cmds):
                self.procs.append(subprocess.Popen(list(cmd), cwd=cwd, env=dict(env if envs is None else envs[i]),
                                                   stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
                                                   start_new_session=new_session,
                                                   # no orphans: a child gets SIGTERM when this process dies
                                                   preexec_fn=pdeathsig_preexec()))
        except BaseException:
            self.kill()
            raise

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def signal(self, sig: int) -> None:
        """Send `sig` to every process still running (to its group when it has a session of its own)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig) if self.new_session else p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        """SIGKILL every process (with its whole process group when it has a session of its own), then reap."""
        self.signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        # ranks whose launcher already exited are still in that launcher's group; processes that made groups of
        # their own (ninja runs each compiler in one: a rank JIT-building an op) are still in the session
        for p in self.procs if self.new_session else ():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            _kill_session(p.pid)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = subprocess.DEVNULL

    def wait(self, timeout_s: float, on_poll: Callable[[], None] | None = None, poll_s: float = 1.0,
             fail_fast: bool = True, grace_s: float = 0.0, peer_exit_s: float | None = None) -> LaunchResult:
        """Wait for every process; after `timeout_s` kill them all. With `fail_fast`, one process failing ends the
        others (a simulated node or rank whose peer died would otherwise wait for its collective timeout): SIGTERM
        and up to `grace_s` to finish (a rank in the middle of a checkpoint write finishes it, as DeepSpeed's
        launch.py allows 30 s), then SIGKILL. With `peer_exit_s`, one process ending well while its peers run is
        bounded too: ranks of one job end together (every entry point's last collective is the barrier of
        ds_core.rank.dist.shutdown_distributed), so a peer still running `peer_exit_s` after one ended is waiting
        for a rank that is gone, and is ended the same way (result.extra["peer_exit"]: which ended, which were
        ended)."""
        t0 = time.monotonic()
        timed_out = False
        codes: list[int | None] = [None] * len(self.procs)
        first_end: tuple[int, float] | None = None  # (index, when) of the first process that ended with status 0
        extra: dict = {}
        try:
            while True:
                codes = self.poll()
                if all(c is not None for c in codes):
                    break
                if first_end is None and 0 in codes:
                    first_end = (codes.index(0), time.monotonic())
                failed = fail_fast and any(c not in (None, 0) for c in codes)
                stranded = peer_exit_s is not None and first_end is not None and \
                    time.monotonic() - first_end[1] > peer_exit_s
                if failed or stranded:
                    if stranded and not failed:
                        extra["peer_exit"] = {"ended": first_end[0], "after_s": peer_exit_s,
                                              "running": [i for i, c in enumerate(codes) if c is None]}
                    if grace_s > 0:
                        self.signal(signal.SIGTERM)
                        end = time.monotonic() + grace_s
                        while time.monotonic() < end and any(c is None for c in self.poll()):
                            time.sleep(min(poll_s, 0.2))
                    break
                if time.monotonic() - t0 > timeout_s:
                    timed_out = True
                    break
                if on_poll is not None:
                    on_poll()
                time.sleep(poll_s)
        finally:
            if not (grace_s > 0 and (extra or (fail_fast and any(c not in (None, 0) for c in codes)))):
                codes = self.poll()
            self.kill()
        return LaunchResult([p.returncode for p in self.procs], timed_out, time.monotonic() - t0, self.log_path,
                            extra=extra, killed=[c is None for c in codes])


def run_launchers(cmds: Sequence[Sequence[str]], *, env: Mapping[str, str], cwd: str | os.PathLike,
                  timeout_s: float, log_path: str | os.PathLike | None = None,
                  on_poll: Callable[[], None] | None = None, poll_s: float = 1.0) -> LaunchResult:
    """Start the launchers, wait up to `timeout_s`, kill whatever is left; stdout+stderr of all go to `log_path`."""
    return LauncherGroup(cmds, env=env, cwd=cwd, log_path=log_path).wait(timeout_s, on_poll=on_poll, poll_s=poll_s)


# How long the ranks of one job may outlive a rank that ended well (launch.local_ranks, run_ranks): every entry point
# ends with a barrier (ds_core.rank.dist.shutdown_distributed), after which a rank only leaves its process: seconds
# on an idle host, but once over 120 s on a 2-core host at load 12 (joining its data threads, atexit writers). One
# still running after this is waiting for a peer that is gone; the bound is 5 minutes rather than torch's 30-minute
# collective timeout.
PEER_EXIT_S = 300.0


def run_ranks(cmds: Sequence[tuple[Sequence[str], Mapping[str, str]]], *, cwd: str | os.PathLike, timeout_s: float,
              log_path: str | os.PathLike | None = None, on_poll: Callable[[], None] | None = None,
              poll_s: float = 1.0, grace_s: float = 30.0) -> LaunchResult:
    """Start ranks made by `rank_commands`, wait up to `timeout_s`; one failing rank ends the others after `grace_s`
    (a peer left alone would wait for its collective timeout), as DeepSpeed's launch.py does."""
    group = LauncherGroup([c for c, _ in cmds], envs=[e for _, e in cmds], cwd=cwd, log_path=log_path)
    return group.wait(timeout_s, on_poll=on_poll, poll_s=poll_s, grace_s=grace_s, peer_exit_s=PEER_EXIT_S)


_CLI_FLAGS = {"--no_local_rank", "-h", "--help"}


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Our options come first; the target starts at -m/--module or at the first word that is not an option (an
    argparse REMAINDER would take the target's own --flags for ours)."""
    i = 0
    while i < len(argv) and argv[i] not in ("-m", "--module") and argv[i].startswith("-"):
        i += 1 if (argv[i] in _CLI_FLAGS or "=" in argv[i]) else 2
    return list(argv[:i]), list(argv[i:])


def _ds_json_arg(target: Sequence[str]) -> str:
    from ds_core.config.ds_json import ds_config_in

    return ds_config_in(target)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m launch.local_ranks -n 2 -m bert_ref.train ARGS` (or a script path instead of -m M): the
    toolkit's local launcher. Ranks run in this process's group (Ctrl-C reaches them); SIGTERM/SIGUSR1 sent to this
    process are passed on (a preempted run checkpoints and exits 75); exit status: the first failing rank's."""
    import argparse

    argv = sys.argv[1:] if argv is None else list(argv)
    ours, target = _split_argv(argv)
    ap = argparse.ArgumentParser(prog="python -m launch.local_ranks", description=main.__doc__,
                                 usage="%(prog)s [-n N] [--master_port P] [--timeout_s S] (-m MODULE | SCRIPT) ARGS",
                                 allow_abbrev=False)
    ap.add_argument("-n", "--num_ranks", "--num_gpus", type=int, default=1, help="ranks on this host (default 1)")
    ap.add_argument("--master_addr", default=LOOPBACK)
    ap.add_argument("--master_port", type=int, default=0, help="rendezvous port (default: a free one)")
    ap.add_argument("--timeout_s", type=float, default=0, help="kill every rank after this long (default: never)")
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS per rank (default: inherited)")
    ap.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the target")
    ap.add_argument("--peer_exit_s", type=float, default=PEER_EXIT_S,
                    help=f"end the other ranks this long after one ended with status 0 while they still run (they "
                         f"wait for a rank that is gone), exit status 1 (default {PEER_EXIT_S:.0f})")
    a = ap.parse_args(ours)
    if not target:
        ap.error("no target: expected -m MODULE or a script path, then its arguments")
    try:
        cmds = rank_commands(a.num_ranks, target, master_port=a.master_port or free_port(a.master_addr),
                             master_addr=a.master_addr, env=rank_env(threads=a.threads or None),
                             local_rank_arg=not a.no_local_rank)
    except ValueError as e:
        ap.error(str(e))
    ds_json = _ds_json_arg(target)
    if ds_json:  # the whole DeepSpeed JSON, before any rank is spawned (the ranks would find it after init)
        from ds_core.config.ds_json import check_before_spawn
        from ds_core.errors import ConfigError

        try:
            check_before_spawn(ds_json, a.num_ranks)
        except ConfigError as e:
            ap.exit(2, f"{ap.prog}: error: {e}\n")
    group = LauncherGroup([c for c, _ in cmds], envs=[e for _, e in cmds], cwd=os.getcwd(), new_session=False,
                          inherit_output=True)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: group.signal(signum))
    res = group.wait(a.timeout_s or float("inf"), poll_s=0.1, grace_s=30.0, peer_exit_s=a.peer_exit_s)
    if res.timed_out:
        log.say(f"local_ranks: timed out after {a.timeout_s:.0f} s: every rank killed", stderr=True)
    code = res.exit_code
    failed = next((i for i, (c, k) in enumerate(zip(res.codes, res.killed)) if c != 0 and not k), None)
    if "peer_exit" in res.extra:
        gone = res.extra["peer_exit"]
        log.say(f"local_ranks: rank {gone['ended']} ended (status 0) and rank(s) "
                f"{', '.join(map(str, gone['running']))} still ran {a.peer_exit_s:.0f} s later, waiting for it: "
                "ended them; exit status 1", stderr=True)
        return 1
    if failed is not None and any(res.killed):
        log.say(f"local_ranks: rank {failed} failed (exit status {res.codes[failed]}): the other ranks were ended",
                stderr=True)
    return 128 - code if code < 0 else code  # a rank killed by signal S: the shell's 128 + S


if __name__ == "__main__":
    sys.exit(main())
