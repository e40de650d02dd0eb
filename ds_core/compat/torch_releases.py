"""The differences between the PyTorch releases of the support matrix (stacks/: 2.6 on Gaudi 1.21's image, 2.9 on
1.23's, the newest upstream), each decided by a feature of the installed torch, not by its version number.

- meta_device: `torch.device("meta")` as the default device, for counting a model's parameters without allocating
  them. torch 2.6 builds tensors and calls `.item()` on them the first time `torch._dynamo` is imported (its
  torch-function builtin map); under a meta default device that raises, and the half-imported `torch._dynamo` then
  breaks every later import of it in the process, DeepSpeed's among them. transformers' model classes import
  `torch._dynamo` on first access (through flex_attention), so building one on meta in a fresh process was that
  first import: ds-tune fell back to its formula and then could not import DeepSpeed. Importing `torch._dynamo`
  before entering the device is harmless on every torch (the model's import does it anyway).
- release_process_groups: `torch.distributed.destroy_process_group()`, with the groups' objects kept until the
  process ends. torch 2.6's `~ProcessGroupGloo` joins gloo's work threads while the thread that dropped the group's
  last reference holds the GIL, and a work thread still freeing a finished collective's tensors (their Python
  objects) waits for the GIL: both wait for good. A rank that leaves right after its last collective (a run's final
  barrier, an all-gather of summary counts) hung so after a run that went well, its peer long gone (2 of a full
  suite's 2-rank runs on torch 2.6). Twenty groups released right after an all-gather on 2 ranks: 6 of 6 runs hung
  on torch 2.6, 0 of 4 on 2.9 and on 2.13 (tests/test_process_end.py releases 40). Kept, a group's threads live on
  until the process ends, as they already do where DeepSpeed's engine holds the groups; `is_initialized()` is False
  as after any destroy. So a process that calls it must end through ds_core.rank.process_end (end_process, run_main:
  no interpreter finalisation), as every caller does: gloo's live threads do not survive finalisation (a SIGABRT,
  "terminate called without an active exception", seen once in a full suite from the preflight's all-reduce member
  while it still ended through Python's own exit).
- profiler_activities: torch 2.9's profiler names an HPU activity (`ProfilerActivity.HPU`), 2.6's does not; where
  the installed torch has none, a Gaudi's run is profiled with the host's events only.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    import torch
    import torch._dynamo  # noqa: F401  (see the module's docstring: never first imported under the meta device)

    with torch.device("meta"):
        yield


# the process groups release_process_groups took out of torch's registry: never freed before the process ends
_RELEASED: list = []


def release_process_groups() -> None:
    """Destroy every process group as torch.distributed.destroy_process_group() does, but without freeing the group
    objects (see the module's docstring); a no-op when none is initialised."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return
    world = getattr(c10d, "_world", None)  # torch's registry of live groups (the default group's and every new_group)
    _RELEASED.extend(list(getattr(world, "pg_map", None) or {}) or [c10d._get_default_group()])
    dist.destroy_process_group()


def profiler_activities(cuda: bool, hpu: bool, activity: Any) -> list:
    """The profiler's activities: the host's, and the device's where there is one: CUDA, or an HPU where torch's
    profiler knows it (Habana's "Profiling with PyTorch" page profiles Gaudi with torch.profiler as a GPU is
    profiled)."""
    acts = [activity.CPU] + ([activity.CUDA] if cuda else [])
    if hpu and hasattr(activity, "HPU"):
        acts.append(activity.HPU)
    return acts
