"""A rank's process group: torch.distributed started through DeepSpeed on the accelerator DeepSpeed finds (HPU:
hccl, CUDA: nccl, CPU: gloo), its end, and the rank's random streams.

The accelerator is whatever DeepSpeed's `get_accelerator()` finds (DS_ACCELERATOR forces one). Rank discovery works
under the deepspeed launcher, torchrun-style variables, and mpirun (mpi4py discovery, done by deepspeed itself), and a
plain `python -m ...` becomes a world of one.
"""
from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from ds_core import log
from ds_core.compat import changes
from ds_core.compat.torch_releases import release_process_groups
from ds_core.rank.parent_watch import watch_parent
from ds_core.rank.rendezvous import free_port, rank_variables
from ds_core.rank.shm import release_cpu_shm_buffer, warn_stale_build_locks
from ds_core.rank.venv import torch_extensions_env

# Per-launcher names of "how many ranks share this node". DeepSpeed's launcher also sets CROSS_SIZE (= nodes).
_LOCAL_SIZE_VARS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                    "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    nodes: int
    accelerator: str  # "cpu" | "cuda" | "hpu"
    device: torch.device
    backend: str


def _in_mpi() -> bool:
    return any(v in os.environ for v in _MPI_RANK_VARS)


def shutdown_distributed() -> None:
    """Destroy the process groups at the end of a run that went well; a no-op when none is initialised.

    Every entry point calls this before it returns (NCCL asks for it: torch warns at exit without it). It is not
    called on the error path, where a dead peer could make a collective-style shutdown wait. For gloo it does NOT
    stop the group's threads: ProcessGroupGloo.shutdown() is a no-op, its work and transport threads live until the
    C++ object dies, which is never before the process ends (DeepSpeed's engine holds the groups, and
    ds_core.compat.torch_releases.release_process_groups keeps them: freeing one deadlocks on torch 2.6). That is
    why a rank ends through ds_core.rank.process_end.run_main, not through interpreter finalisation.

    A barrier comes first: the ranks of a run that went well leave together, after rank 0's last writes, so a
    launcher can take a rank still running well after a peer ended for one waiting on a peer that is gone
    (launch.local_ranks.PEER_EXIT_S)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        release_process_groups()  # destroy_process_group without torch 2.6's deadlock (its docstring)


def init_distributed(timeout_s: int = 1800) -> DistInfo:
    """Initialise torch.distributed through deepspeed on the accelerator deepspeed finds; idempotent."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    watch_parent()  # a rank started by a launcher ends when the launcher dies (ds_core.rank.parent_watch)
    if "RANK" not in os.environ and not _in_mpi():
        # A single process started by hand: a world of one, on a free local port.
        os.environ.update(rank_variables(0, 1, master_port=int(os.environ.get("MASTER_PORT") or free_port())))
    # this venv's own JIT op cache, whichever launcher started the rank (DeepSpeed's pdsh runner, mpirun and srun do
    # not pass the starter's TORCH_EXTENSIONS_DIR to other nodes); a value set by the user wins
    os.environ.update(torch_extensions_env(os.environ))
    accel = get_accelerator()
    # the changes inside DeepSpeed of this stage (ds_core.compat.changes): the op build lock that names its holder,
    # py-cpuinfo's answer cached for DeepSpeed's op loads
    local_zero = os.environ.get("LOCAL_RANK", "0") == "0"  # one line per node: the op cache is the node's
    changes.apply_stage("process_start", device_type=accel.device_name(),
                        say=(lambda line: log.say(line, every_rank=True)) if local_zero else None)
    if local_zero:
        warn_stale_build_locks()
    # The timeout given to init_process_group covers the world group only; DeepSpeed's ZeRO groups come from
    # torch.distributed.new_group(), which reads torch's module-level defaults (30 min). Set those too, so a dead or
    # hung rank fails every collective after timeout_s.
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timedelta(seconds=timeout_s)
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), auto_mpi_discovery=True,
                               timeout=timedelta(seconds=timeout_s), verbose=False)
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    name = accel.device_name()
    if name != "cpu":
        accel.set_device(local_rank)
        device = torch.device(accel.device_name(local_rank))
    else:
        release_cpu_shm_buffer(rank)
        device = torch.device("cpu")
    local_world = next((int(os.environ[v]) for v in _LOCAL_SIZE_VARS if os.environ.get(v, "").isdigit()), 0)
    if not local_world:
        # No launcher told us: count ranks that share this host name.
        names: list = [None] * world
        torch.distributed.all_gather_object(names, socket.gethostname())
        local_world = names.count(socket.gethostname())
    cross_size = os.environ.get("CROSS_SIZE", "")
    nodes = int(cross_size) if cross_size.isdigit() else max(1, world // local_world)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world, nodes=nodes,
                    accelerator=name, device=device, backend=accel.communication_backend_name())


def set_seed(seed: int, rank: int = 0) -> None:
    """Seed python, numpy, torch and the accelerator with seed + rank.

    ds_core.run.setup.start_run calls set_seed(seed) before the model is built, so every rank builds the same initial
    weights. ds_core.run.checkpointing.Checkpointing.start then calls set_seed(seed, rank) for a fresh run, so dropout
    and other model randomness differ per data-parallel rank, as NVIDIA's and Habana's BERT recipes do (seed + rank):
    with one seed everywhere the ranks draw identical dropout masks. Data order never comes from these streams (the data
    modules use their own generators built from the global seed), and a resume restores each rank's own streams from its
    checkpoint."""
    seed = seed + rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    from deepspeed.accelerator import get_accelerator

    get_accelerator().manual_seed_all(seed)


__all__ = ["DistInfo", "init_distributed", "shutdown_distributed", "set_seed"]
