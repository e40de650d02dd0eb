"""No orphaned ranks: a rank ends when the process that started it dies.

A rank whose launcher is killed (kill -9 of DeepSpeed's runner or of its per-node launch.py, of mpirun, of our local
starter) used to keep training: nobody reads its output or exit status, it holds the run_dir, ports and accelerator
memory, and it keeps writing checkpoints that a restarted job races with. Two mechanisms, because the starters differ:

- where we spawn ranks (launch.local_ranks) each child asks the kernel for SIGTERM when its parent dies
  (`pdeathsig_preexec`, PR_SET_PDEATHSIG): immediate, and it reaches a rank that never runs Python again;
- in every rank started by a launcher (any of LAUNCHER_VARS set), a daemon thread (`watch_parent`) polls getppid()
  every POLL_S: a changed parent means the launcher died and the rank was re-parented (to init or a subreaper).
  Under DeepSpeed's launch.py it also watches launch.py's own parent (the `deepspeed` runner, or the ssh session of a
  multi-node launch): killing the runner leaves launch.py alive and its ranks training, which is what was seen.

On a dead parent the rank sends itself SIGTERM: the training loop's handler makes every rank finish the step, save
and exit 75, as on a preemption (all ranks see the parent die within POLL_S of each other). If the rank is still
alive GRACE_S later (stuck in a collective whose peer is gone, or before the loop installed its handler and SIGTERM was
ignored), it releases the run_dir lock and ends with os._exit(EXIT_ORPHANED). A process started by hand (no launcher
variables) is never watched: `nohup python -m bert_ref.train &` must outlive its shell.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from ds_core import log
from ds_core.rank import run_lock

# Variables a launcher sets in each rank: DeepSpeed's launch.py / torchrun / launch.local_ranks (LOCAL_RANK), Open MPI,
# MPICH / Intel MPI (PMI_RANK), PMIx, MVAPICH, Slurm's srun (SLURM_STEP_ID is set for srun steps).
LAUNCHER_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_STEP_ID")
POLL_S = 1.0
GRACE_S = 60.0
EXIT_ORPHANED = 129  # 128 + SIGHUP, what a shell reports for a job whose terminal went away

_PR_SET_PDEATHSIG = 1
_started = False


def pdeathsig_preexec(sig: int = signal.SIGTERM):
    """A subprocess.Popen preexec_fn (Linux; None elsewhere) that makes the child receive `sig` when its parent dies.
    The parent must spawn from a thread that lives as long as the child (the kernel ties it to the spawning thread)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return preexec


def _ppid_of(pid: int) -> int | None:
    return run_lock.proc_stat_field(pid, 1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def launched() -> bool:
    """Whether a launcher started this process (one of LAUNCHER_VARS set)."""
    return any(os.environ.get(v) for v in LAUNCHER_VARS)


def watch_parent(force: bool = False) -> bool:
    """Start the parent watch in this rank (once per process) when a launcher started it, or with `force`.
    Returns whether a watch runs. Call early: before distributed init, which may wait for a peer forever."""
    global _started
    if _started or not (force or launched()):
        return _started
    parent = os.getppid()
    if parent == 1:  # already orphaned (or started by init): nothing to watch
        return False
    grand = _ppid_of(parent) if "deepspeed.launcher.launch" in _cmdline(parent) else None
    _started = True
    threading.Thread(target=_watch, args=(parent, grand), name="parent-watch", daemon=True).start()
    return True


def _watch(parent: int, grand: int | None) -> None:
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:
            who = f"its parent (pid {parent})"
        elif grand is not None and _ppid_of(parent) not in (grand, None):
            who = f"the DeepSpeed runner (pid {grand}) that started its launch.py (pid {parent})"
        else:
            continue
        break
    log.say(f"rank pid {os.getpid()}: {who} died; stopping this rank (SIGTERM: a checkpoint at the end of the step "
            f"if training, then exit; forced exit in {GRACE_S:.0f} s)", every_rank=True, stderr=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    run_lock.release_all()
    log.say(f"rank pid {os.getpid()}: still running {GRACE_S:.0f} s after its launcher died; exiting",
            every_rank=True, stderr=True)
    os._exit(EXIT_ORPHANED)
