"""Per-rank guard: what every launcher of launch.run starts in place of the training module.

    python -m launch.guard [--stall_timeout_s S] [--mpi] [--master_addr A] [--master_port P] MODULE [ARGS...]

It runs `python -m MODULE ARGS` as its child and does two things no launcher does for us:

1. A frozen rank ends. The child runs a heartbeat thread that writes a byte to a pipe every second; the thread needs
   neither the main thread nor the network, so it keeps beating through long steps and collectives and stops only
   when the whole process stops (SIGSTOP, a hung or swapped-out host process, a C call holding the GIL). The guard kills
   the child (and everything it started) once no beat came for --stall_timeout_s, which launch.run sets to the
   collective timeout plus a grace: by then every healthy peer has failed its collective, so the kill only ends a run
   that is already lost. Without it, the node of a frozen rank waits forever (DeepSpeed's per-node launcher, pdsh,
   mpirun and srun all wait for their child). The guard exits with the child's status (128 + signal for a signal), so
   every launcher sees the failure.

2. Under MPI (--mpi: openmpi, mpich and mpirun launches) our rendezvous wins over DeepSpeed's. DeepSpeed's
   deepspeed.comm.comm.mpi_discovery sets MASTER_ADDR to rank 0's first `hostname -I` address and MASTER_PORT to
   29500 whatever was given, so two jobs on one node collide and --master_addr has no effect. The guard sets RANK,
   WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE, MASTER_ADDR and MASTER_PORT for the child from mpi4py itself: the address and
   port given here, or else rank 0's address and a port free on it, broadcast to every rank. With all five of
   DeepSpeed's required variables set, deepspeed.init_distributed skips mpi_discovery. When the child fails, the guard
   calls MPI_Abort so mpirun stops every rank and exits non-zero; DeepSpeed's MPICH helper
   (deepspeed/launcher/launcher_helper.py main) drops its child's exit status, so an exit code alone would be lost
   there.

Hand-written because no launcher we document has a per-rank liveness check: torch.distributed.elastic's agent
watches workers only under torchrun, which DeepSpeed's launchers do not use. Standard library plus psutil (mpi4py
only with --mpi) and launch's console (launch.log, standard library only), no package-relative imports: DeepSpeed's
MPICH backend runs this file by path, and then the repository it lies in is put first on sys.path, so that `launch`
imports as it does under `python -m launch.guard`.
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

if not __package__:  # run by path (DeepSpeed's MPICH backend): the repository's packages, as under -m
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import log  # noqa: E402 - importable once the path above is set

FD_VAR = "LAUNCH_GUARD_HEARTBEAT_FD"
BEAT_S = 1.0


def _heartbeat(fd: int) -> None:
    while True:
        try:
            os.write(fd, b".")
        except OSError:  # the guard is gone: nothing left to tell
            return
        time.sleep(BEAT_S)


def child_main(argv: Sequence[str]) -> None:
    """`python -m launch.guard --child MODULE ARGS`: start the heartbeat, then run MODULE as `python -m` would."""
    import runpy

    fd = int(os.environ.pop(FD_VAR))
    threading.Thread(target=_heartbeat, args=(fd,), daemon=True, name="launch.guard heartbeat").start()
    module, *args = argv
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


# ------------------------------------------------------------------------------------------------ MPI rendezvous
def _own_address(single_node: bool) -> str:
    """An address of this host the other nodes can reach (rank 0 only)."""
    if single_node:
        return "127.0.0.1"
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            if not info[4][0].startswith("127."):
                return info[4][0]
    except OSError:
        pass
    try:  # what mpi_discovery would use
        out = subprocess.run(["hostname", "-I"], stdout=subprocess.PIPE, text=True, timeout=10).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return socket.gethostbyname(socket.gethostname())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))  # free on every address of rank 0's host
        return s.getsockname()[1]


def mpi_rendezvous(master_addr: str, master_port: int) -> tuple[dict[str, str], object]:
    """The torch.distributed variables for this MPI rank, and the communicator (for Abort)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    node = world.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks sharing this host: local rank and size
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    plan = None
    if rank == 0:
        addr = master_addr or _own_address(single_node=local_size == size)
        port = master_port or _free_port()
        plan = (addr, port)
    addr, port = world.bcast(plan, root=0)
    env = {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(local_rank), "LOCAL_SIZE": str(local_size),
           "MASTER_ADDR": addr, "MASTER_PORT": str(port)}
    log.say(f"guard: MPI rendezvous: world {size}, master {addr}:{port} "
            f"({'given' if master_addr else 'rank 0 address'}, {'given' if master_port else 'free port'})", rank=rank)
    return env, world


# ------------------------------------------------------------------------------------------------ supervision
def _kill_tree(pid: int) -> None:
    import psutil  # a dependency of the toolkit and of DeepSpeed

    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()  # SIGKILL also ends a stopped process
        except psutil.NoSuchProcess:
            pass


def supervise(cmd: Sequence[str], env: dict[str, str], stall_timeout_s: float, label: str) -> int:
    """Run cmd with a heartbeat pipe; return its exit status, or 1 after killing it for a stall."""
    rfd, wfd = os.pipe()
    env = dict(env, **{FD_VAR: str(wfd)})
    child = subprocess.Popen(list(cmd), env=env, pass_fds=(wfd,))
    os.close(wfd)

    def forward(signum, _frame):  # a launcher stopping us stops the rank too
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    last = time.monotonic()
    stalled = False
    # the child's own exit is polled each second: forked data-loader workers hold the pipe open after it is gone
    while child.poll() is None:
        if stall_timeout_s > 0 and time.monotonic() - last > stall_timeout_s:
            stalled = True
            break
        try:
            ready, _, _ = select.select([rfd], [], [], 1.0)
        except InterruptedError:
            continue
        if ready:
            if os.read(rfd, 4096):
                last = time.monotonic()
            else:  # end of file: the child is exiting; poll() says so within a moment
                time.sleep(0.1)
    os.close(rfd)
    if stalled:
        log.say(f"guard: {label}: no heartbeat from the training process for {stall_timeout_s:.0f} s (stopped or "
                "frozen; its peers have failed their collectives by now): killing it", stderr=True)
        _kill_tree(child.pid)
        child.wait()
        return 1
    code = child.wait()
    return 128 - code if code < 0 else code


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.guard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--stall_timeout_s", type=float, default=0,
                   help="kill the training process after this many seconds without a heartbeat (0: never); "
                        "launch.run sets the collective timeout plus a grace")
    p.add_argument("--mpi", action="store_true",
                   help="started by mpirun: set the rank variables from mpi4py and call MPI_Abort on failure")
    p.add_argument("--master_addr", default="", help="with --mpi: rendezvous address (default: rank 0's address)")
    p.add_argument("--master_port", type=int, default=0,
                   help="with --mpi: rendezvous port (default: a port free on rank 0, broadcast to all)")
    p.add_argument("--mpi_lib", default="",
                   help="with --mpi: the MPI library of the mpirun that started the job, for mpi4py (MPI4PY_LIBMPI); "
                        "launch.run finds it")
    p.add_argument("--local_rank", default=None,
                   help="added by DeepSpeed's per-node launcher; passed on to the module")
    p.add_argument("module", help="training module, run as `python -m MODULE`")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the module")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        child_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    try:  # no orphans: this guard (hence, by SIGTERM forwarded, its rank) ends when its launcher dies
        from ds_core.rank.parent_watch import watch_parent

        watch_parent()
    except ImportError:  # run by path without the repository importable: the rank's own watch still runs
        pass
    env = dict(os.environ)
    comm = None
    if args.mpi:
        if args.mpi_lib:  # before mpi4py loads a library: the first libmpi it finds may be another MPI's
            os.environ["MPI4PY_LIBMPI"] = env["MPI4PY_LIBMPI"] = args.mpi_lib
        added, comm = mpi_rendezvous(args.master_addr, args.master_port)
        env.update(added)
    forwarded = ([f"--local_rank={args.local_rank}"] if args.local_rank is not None else []) + args.args
    # Slurm names the node as the cluster knows it (several slurmd may share one host); elsewhere the host name.
    label = f"rank {env.get('RANK', '?')} on {env.get('SLURMD_NODENAME') or socket.gethostname()}"
    # `-m launch.guard --child`: the child imports this module from the package, whichever way the guard started
    cmd = [sys.executable, "-u", "-m", "launch.guard", "--child", args.module, *forwarded]
    code = supervise(cmd, env, args.stall_timeout_s, label)
    if comm is not None and code != 0:
        log.say(f"guard: {label}: exit {code}: MPI_Abort so mpirun stops every rank", stderr=True)
        comm.Abort(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
