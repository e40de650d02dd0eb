"""Start N local ranks, or N simulated nodes on loopback, through DeepSpeed's own launcher; wait with a timeout that
kills every process started (launchers AND their ranks).

One owner for what the demo, benchmarks, tests and `ds-study` all need: a free port, the ranks' environment, the
`deepspeed` command line, and a process group per launcher so that a dead or hung job can be taken down whole (a
killed launcher alone leaves its ranks running, holding ports, memory and JIT build locks).

    cmds = [local_command(2, ["--module", "bert_ref.train", "--preset", "debug", ...], master_port=free_port())]
    result = run_launchers(cmds, env=rank_env(), cwd=".", log_path=Path("run/log.txt"), timeout_s=600)
    cmds = node_commands(2, 1, target, master_port=free_port(), hostfile=write_loopback_hostfile(p, 2, 1))
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free right now on `host` (the kernel picks it; another process may still take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _accelerator_present() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    import importlib.util

    return importlib.util.find_spec("habana_frameworks") is not None


def rank_env(base: Mapping[str, str] | None = None, *, threads: int | None = None,
             pythonpath: Sequence[str | os.PathLike] = (), extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for launched ranks: `base` (default os.environ) plus

    - DS_ACCELERATOR=cpu where neither CUDA nor Habana is present and the caller set none (DeepSpeed's own probe
      would otherwise try CUDA first and fail on a CPU-only host);
    - OMP_NUM_THREADS=threads when given (ranks sharing few cores must not each start one thread per core);
    - `pythonpath` entries in front of PYTHONPATH (a checkout that is not the installed one);
    - `extra` last, so a caller's explicit value always wins.
    """
    env = dict(os.environ if base is None else base)
    if "DS_ACCELERATOR" not in env and not (extra and "DS_ACCELERATOR" in extra) and not _accelerator_present():
        env["DS_ACCELERATOR"] = "cpu"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *filter(None, [env.get("PYTHONPATH", "")])])
    env.update(extra or {})
    return env


def deepspeed_launcher() -> list[str]:
    """DeepSpeed's launcher of this interpreter's environment (the `deepspeed` script beside it, else its module)."""
    exe = Path(sys.executable).parent / "deepspeed"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("deepspeed")
    return [found] if found else [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]


def local_command(num_ranks: int, target: Sequence[str], *, master_port: int) -> list[str]:
    """`deepspeed --num_gpus N --master_port P TARGET...`; TARGET is a script path or `--module M`, then its args."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks = {num_ranks}: expected >= 1")
    return [*deepspeed_launcher(), "--num_gpus", str(num_ranks), "--master_port", str(master_port), *target]


def write_loopback_hostfile(path: str | os.PathLike, nodes: int, slots: int) -> Path:
    """A hostfile of `nodes` simulated hosts (node0, node1, ...) with `slots` ranks each. With --no_ssh the names are
    only labels: every launcher is told the master address (loopback) directly."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"node{i} slots={slots}\n" for i in range(nodes)))
    return path


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
    codes: list[int]          # exit code per launcher (negative: killed by that signal)
    timed_out: bool
    seconds: float
    log_path: Path | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.codes)

    @property
    def exit_code(self) -> int:
        """The first non-zero exit code (0 when all succeeded); 124 on a timeout, as coreutils' timeout."""
        if self.timed_out:
            return 124
        return next((c for c in self.codes if c != 0), 0)


class LauncherGroup:
    """Launchers started in sessions of their own, so that each can be killed with all its ranks."""

    def __init__(self, cmds: Sequence[Sequence[str]], *, env: Mapping[str, str], cwd: str | os.PathLike,
                 log_path: str | os.PathLike | None = None):
        self.log_path = Path(log_path) if log_path else None
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.procs: list[subprocess.Popen] = []
        try:
            for cmd in cmds:
                self.procs.append(subprocess.Popen(list(cmd), cwd=cwd, env=dict(env), stdout=self._log,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
        except BaseException:
            self.kill()
            raise

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def kill(self) -> None:
        """SIGKILL every launcher's whole process group (its ranks included), then reap."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()
        # ranks whose launcher already exited are still in that launcher's group
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log is not subprocess.DEVNULL:
            self._log.close()
            self._log = subprocess.DEVNULL

    def wait(self, timeout_s: float, on_poll: Callable[[], None] | None = None, poll_s: float = 1.0,
             fail_fast: bool = True) -> LaunchResult:
        """Wait for every launcher; after `timeout_s` kill them all. With `fail_fast`, one launcher failing kills the
        others (a simulated node whose peer died would otherwise wait for its collective timeout)."""
        t0 = time.monotonic()
        timed_out = False
        try:
            while True:
                codes = self.poll()
                if all(c is not None for c in codes):
                    break
                if fail_fast and any(c not in (None, 0) for c in codes):
                    break
                if time.monotonic() - t0 > timeout_s:
                    timed_out = True
                    break
                if on_poll is not None:
                    on_poll()
                time.sleep(poll_s)
        finally:
            self.kill()
        return LaunchResult([p.returncode for p in self.procs], timed_out, time.monotonic() - t0, self.log_path)


def run_launchers(cmds: Sequence[Sequence[str]], *, env: Mapping[str, str], cwd: str | os.PathLike,
                  timeout_s: float, log_path: str | os.PathLike | None = None,
                  on_poll: Callable[[], None] | None = None, poll_s: float = 1.0) -> LaunchResult:
    """Start the launchers, wait up to `timeout_s`, kill whatever is left; stdout+stderr of all go to `log_path`."""
    return LauncherGroup(cmds, env=env, cwd=cwd, log_path=log_path).wait(timeout_s, on_poll=on_poll, poll_s=poll_s)
