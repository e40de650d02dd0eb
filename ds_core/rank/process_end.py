"""How a rank's process ends: without interpreter finalisation, after what Python's exit does first; and how a user's
mistake ends it: one line `<command>: error: <message>` from rank 0, exit status 2, on every rank.

Standard library and ds_core.errors only, so that an entry can import it before anything heavy (bench/bert_step.py
re-executes itself first).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

from ds_core.errors import ConfigError, RunVerdict

USAGE_ERROR = 2  # ds_core.cli.USAGE_ERROR: argparse's status for a bad command line

# the status end_process is ending this process with, for atexit handlers that record how a run ended (None: not
# ending through end_process)
exit_status: int | None = None


def end_process(status: int = 0, failed: bool = False) -> NoReturn:
    """End this process now with `status`, after doing what Python's own exit does while the interpreter is whole
    (Py_FinalizeEx's first steps, in its order), and without the finalisation that follows.

    Why: a torch C++ thread that needs the GIL after finalisation has begun (gloo's work thread dropping the last
    reference to a collective's tensors, or running a future's Python callback: these threads live until the engine
    dies, see ds_core.rank.dist.shutdown_distributed) is ended by CPython 3.11 with pthread_exit, which unwinds
    through a noexcept C++ frame: "terminate called without an active exception", SIGABRT, exit 134, and the launcher
    reports a failed run after a complete one. It failed about one 2-rank run per full test suite (a few hundred such
    runs) on a loaded 2-core CI machine, in a different test each time; tests/test_process_end.py makes it happen
    every time. Skipping finalisation removes the window instead of narrowing it. What is kept: non-daemon threads
    are joined (threading._shutdown, the call Python makes first: there is no public one; it also shuts
    concurrent.futures pools down), atexit handlers run (the run_dir lock, logging, multiprocessing's children,
    tensorboard writers), stdout/stderr are flushed, MPI is finalised (aborted where `failed`: a failed rank's
    peers may be waiting for it). What is skipped: module teardown and
    garbage collection, i.e. flushing files that nobody closed (ours are closed explicitly)."""
    global exit_status
    exit_status = status
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced by something without flush
            pass
    # mpi4py finalises MPI from a C-level exit hook (Py_AtExit) that runs at the very end of finalisation: skipped
    # here, so called here. Without it, under `mpirun` the first rank to leave is taken as a crash and the launcher
    # kills the others (rank 0 lost its summary record that way, with exit status 0). MPI_Finalize waits for every
    # rank, as at a normal exit.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        if failed:  # a failed rank: MPI_Finalize would wait for peers that may wait in a collective for this rank
            mpi.COMM_WORLD.Abort(status)
        mpi.Finalize()
    os._exit(status)


# How long a rank other than 0 waits before saying a mistake itself (see run_main): rank 0 meets the same mistake at
# about the same moment; a few seconds cover ranks that start unevenly on a loaded host.
MISTAKE_LINGER_S = 10.0
# launchers' names for a rank's index on its node
_LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                    "SLURM_LOCALID")


def say_mistake(mistake: BaseException) -> None:
    """Print `<command>: error: <mistake>` once per job (run_main says how); returns when this rank should exit."""
    import time

    from ds_core.rank.rendezvous import env_rank

    rank = env_rank()
    local = next((int(v) for v in map(os.environ.get, _LOCAL_RANK_VARS) if v and v.isdigit()), 0)
    if rank != 0:
        time.sleep(MISTAKE_LINGER_S + (0 if local == 0 else 2))  # the node's first rank speaks before the others go
        if local != 0:
            return
    sys.stdout.flush()
    print(f"{command_name()}: error: {'' if rank == 0 else f'(rank {rank}) '}{mistake}", file=sys.stderr, flush=True)


def command_name() -> str:
    """How this process was started, as a user types it: `python -m bert_ref.train`, or `python FILE` for a script."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return f"python -m {spec.name}" if spec is not None and spec.name else f"python {sys.argv[0]}"


def run_main(main: Callable[[], object]) -> NoReturn:
    """A rank's `if __name__ == "__main__":` body: run main() as the whole process and leave through end_process,
    with main's SystemExit status (0 when it returns).

    A ConfigError (a setting, flag, path or file the user gave; its message names it) ends the process with status
    2, said once: every rank parses the same command line and reads the same files, so the same mistake would
    otherwise print once per rank, each with its traceback. Rank 0 says it at once. Another rank waits
    MISTAKE_LINGER_S first: when rank 0 made the same mistake, rank 0's exit ends this rank through the launcher
    (DeepSpeed's, launch.local_ranks, mpirun) before it says anything, and a rank that exits first would get rank 0
    killed before it spoke. A rank still alive after the wait made a mistake rank 0 did not (a path missing on its
    node): the first rank of its node says it, naming the rank. A RunVerdict (a diverged run: every rank reads the same
    all-reduced values) is said the same way and ends with its status (1). Any other exception escaping main is a
    failure of the run: its traceback is printed as Python prints it (sys.excepthook: torch's, with its [rankN]
    prefix, once a process group exists) and the process ends with status 1 through end_process too. Python's own
    path would finalise the interpreter with gloo's threads alive, the hazard end_process exists for: after the
    traceback the rank aborted (exit 134, "terminate called without an active exception") or, when the race went
    the other way, never exited, and a launcher waiting for it waited for good."""
    try:
        main()
    except ConfigError as mistake:
        say_mistake(mistake)
        end_process(USAGE_ERROR)
    except RunVerdict as verdict:  # the same verdict on every rank (a diverged run), said once as a mistake is
        say_mistake(verdict)
        end_process(verdict.status)
    except SystemExit as stop:
        code = stop.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)  # what Python prints for sys.exit("message")
        end_process(0 if code is None else code if isinstance(code, int) else 1)
    except Exception:  # noqa: BLE001 - every failure: its traceback, then the same end as a run that went well
        sys.excepthook(*sys.exc_info())
        end_process(1, failed=True)
    end_process(0)
