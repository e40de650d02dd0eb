"""What a process on a shared machine leaves behind, and its clean-up: DeepSpeed's CPU all-reduce workspaces in
/dev/shm (released once every rank has mapped them) and the JIT build locks of torch extensions (warned about when
old: a build killed on the way leaves one that every later load waits for).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ds_core import log

SHM_DIR = Path("/dev/shm")


def cpu_shm_buffer_name(rank: int) -> str:
    """Name of the shared-memory workspace DeepSpeed's CPU allreduce op (ShareMemCommBuilder, shm.cpp) creates for a
    rank: deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>."""
    return (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def release_cpu_shm_buffer(rank: int) -> bool:
    """Unlink this rank's DeepSpeed CPU allreduce workspace from /dev/shm; True if it was there.

    DeepSpeed 0.19 creates one ~66 MB workspace per rank when all ranks share a host (LOCAL_SIZE == world size, a
    world of one under the deepspeed launcher included) and never unlinks it (shm.cpp has a shared_close that nothing
    calls), so every CPU run, finished or killed, leaves its workspaces in /dev/shm, which is RAM: a few hundred runs
    filled 20 GB of a 24 GB machine here.
    Once every rank has passed shm_initialize (which maps each peer's workspace before returning) the names are no
    longer needed: after a barrier each rank unlinks its own, the mappings stay valid until the processes exit, and
    the kernel frees the memory when the last one does, whichever way it ends."""
    torch.distributed.barrier()  # every rank has mapped every peer's workspace
    try:
        (SHM_DIR / cpu_shm_buffer_name(rank)).unlink()
    except FileNotFoundError:  # op not built / ranks on several hosts (no shm path), or a different layout
        return False
    return True


def stale_build_locks(max_age_s: float = 600) -> list[tuple[Path, float]]:
    """JIT build locks of torch extensions (DeepSpeed's ops: fused_adam, deepspeed_shm_comm, ...) older than max_age_s.

    torch.utils.cpp_extension serialises a build with a `lock` file in the op's build directory and removes it when
    the build ends; a build killed on the way (SIGKILL, OOM, a timed-out job) leaves it, and every later process that
    needs the op waits for it forever, silently, after DeepSpeed's "Loading extension module" line. A build takes
    about a minute here, so a lock much older than that is almost certainly stale."""
    import time

    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now, found = time.time(), []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:  # a build just finished
            continue
        if age > max_age_s:
            found.append((lock, age))
    return found


def warn_stale_build_locks() -> None:
    """One warning line per old build lock (stale_build_locks), on the rank that calls it."""
    for lock, age in stale_build_locks():
        log.warn(f"{lock} is {age / 60:.0f} min old: a torch extension build that held it was probably killed, and "
                 f"this run will wait for it forever when it needs that op. If no build is running on this machine, "
                 f"remove the file.", every_rank=True)


__all__ = ["SHM_DIR", "cpu_shm_buffer_name", "release_cpu_shm_buffer", "stale_build_locks", "warn_stale_build_locks"]
