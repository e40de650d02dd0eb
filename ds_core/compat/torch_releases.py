"""The differences between the PyTorch releases of the support matrix (stacks/: 2.6 on Gaudi 1.21's image, 2.9 on
1.23's, the newest upstream), each decided by a feature of the installed torch, not by its version number.

- meta_device: `torch.device("meta")` as the default device, for counting a model's parameters without allocating
  them. torch 2.6 builds tensors and calls `.item()` on them the first time `torch._dynamo` is imported (its
  torch-function builtin map); under a meta default device that raises, and the half-imported `torch._dynamo` then
  breaks every later import of it in the process, DeepSpeed's among them. transformers' model classes import
  `torch._dynamo` on first access (through flex_attention), so building one on meta in a fresh process was that
  first import: ds-tune fell back to its formula and then could not import DeepSpeed. Importing `torch._dynamo`
  before entering the device is harmless on every torch (the model's import does it anyway).
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


def profiler_activities(cuda: bool, hpu: bool, activity: Any) -> list:
    """The profiler's activities: the host's, and the device's where there is one: CUDA, or an HPU where torch's
    profiler knows it (Habana's "Profiling with PyTorch" page profiles Gaudi with torch.profiler as a GPU is
    profiled)."""
    acts = [activity.CPU] + ([activity.CUDA] if cuda else [])
    if hpu and hasattr(activity, "HPU"):
        acts.append(activity.HPU)
    return acts
