"""Where a training step's time goes: torch.profiler over a few optimizer steps, summarised per step.

A run's `--profile_steps N` (TrainConfig.profile_steps: the N warm-up steps before the throughput window, the summary
in the run's summary record under "profile") and the benches' Trainer baselines use it alike, so bench.gpu_check can
say per model: aten ops and host syncs per step (cudaStreamSynchronize, cudaDeviceSynchronize, `.item()`), the 10
kernels that take the most device time, and the share of the profiled wall time the device was idle (1 - summed
kernel time / wall time; kernels on several streams can overlap, so this is a lower bound of the idle share). On a
CPU the same code runs with CPU events only: the "kernels" are then the aten ops with the most self CPU time and the
idle share is None (there is no device to be idle).
"""
from __future__ import annotations

import time
from collections import Counter

from ds_core.compat.torch_releases import profiler_activities

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item")


class StepProfile:
    """Call `step_end()` at the end of every optimizer step; the profiler runs from the end of step `start_after` to
    the end of step `start_after + steps`. Place the window before a timed window with one untimed step after it:
    turning the profiler off (its event parsing) takes time that must not land in a measured step."""

    def __init__(self, start_after: int, steps: int):
        if start_after < 1 or steps < 1:
            raise ValueError(f"StepProfile: start_after ({start_after}) and steps ({steps}) must be >= 1")
        self.start_after, self.steps, self.seen = start_after, steps, 0
        self.prof = None
        self.wall = 0.0
        self.summary: dict | None = None

    def step_end(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.seen += 1
        if self.seen == self.start_after:
            self.prof = profile(activities=profiler_activities(torch.cuda.is_available(), _on_hpu(),
                                                              ProfilerActivity))
            self.prof.start()
            self.wall = time.perf_counter()
        elif self.seen == self.start_after + self.steps and self.prof is not None:
            self.wall = time.perf_counter() - self.wall
            self.prof.stop()
            self.summary = summarize(self.prof.events(), self.steps, self.wall)
            self.prof = None


def _on_hpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "hpu"


def summarize(events, steps: int, wall_s: float) -> dict:
    """Per-step counts and the top kernels from a profiler's FunctionEvents (see the module's docstring)."""
    from torch.autograd import DeviceType

    aten, syncs = 0, Counter()
    kernels: Counter = Counter()
    cpu_self: Counter = Counter()
    for e in events:
        if e.device_type in (DeviceType.CUDA, DeviceType.HPU):
            kernels[e.name] += e.time_range.elapsed_us()
            continue
        if e.name.startswith("aten::"):
            aten += 1
            cpu_self[e.name] += e.self_cpu_time_total
        if e.name in SYNC_EVENTS:
            syncs[e.name] += 1
    on_device = bool(kernels)
    top = kernels if on_device else cpu_self
    busy_us = sum(kernels.values())
    return {"profiled_steps": steps, "wall_s_per_step": wall_s / steps, "aten_ops_per_step": aten / steps,
            "syncs_per_step": {k: syncs[k] / steps for k in SYNC_EVENTS},
            "top10": "device kernels" if on_device else "aten ops (self CPU time)",
            "top10_us_per_step": [[name, us / steps] for name, us in top.most_common(10)],
            "device_idle_share": (max(0.0, 1 - busy_us / 1e6 / wall_s) if on_device and wall_s > 0 else None)}
