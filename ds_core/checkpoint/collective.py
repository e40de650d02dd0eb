"""The collectives a checkpoint save, load or conversion needs, each a no-op in a world of one.

Public and in one module because both the save/load half (ds_core.checkpoint) and the conversion half
(ds_core.checkpoint.resize) run them: a rank that fails a write or a conversion must not leave the others waiting at a
barrier, so every such verdict goes through any_rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if _initialized() else 1


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    if _initialized():
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on at least one: the one verdict all ranks act on."""
    if not _initialized():
        return flag
    from deepspeed.accelerator import get_accelerator

    # on the accelerator: NCCL/HCCL groups reduce device tensors only
    t = torch.tensor([1.0 if flag else 0.0], device=get_accelerator().current_device_name())
    dist.all_reduce(t)
    return bool(t.item() > 0)
