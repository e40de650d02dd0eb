"""ds_core.outputs.profile on the CPU: the profiled window is the steps asked for, and the per-step counts are exact
(aten ops and `.item()` syncs counted from the profiler's events, no timing asserted)."""
from __future__ import annotations

import pytest
import torch

from ds_core.outputs.profile import StepProfile


def _step(w: torch.Tensor, items: int) -> None:
    x = torch.mm(w, w)
    for _ in range(items):
        x.sum().item()


def test_counts_per_step_over_the_profiled_window_only():
    w = torch.ones(4, 4)
    prof = StepProfile(start_after=2, steps=3)
    for i in range(7):
        _step(w, items=2 if 2 <= i < 5 else 9)  # steps 3-5 (after the end of step 2) are profiled: 2 items each
        prof.step_end()
    s = prof.summary
    assert s["profiled_steps"] == 3 and s["syncs_per_step"]["aten::item"] == 2
    assert s["syncs_per_step"]["cudaStreamSynchronize"] == 0 and s["device_idle_share"] is None
    # per step: mm, then 2 x (sum, item, and item's _local_scalar_dense): at least these 7 aten events
    assert s["aten_ops_per_step"] >= 7
    names = [n for n, _ in s["top10_us_per_step"]]
    assert "aten::mm" in names and s["top10"].startswith("aten ops")


def test_a_window_that_cannot_start_is_refused():
    with pytest.raises(ValueError, match="start_after"):
        StepProfile(start_after=0, steps=2)


@pytest.mark.stack  # torch 2.6 (Gaudi 1.21) has no HPU activity
@pytest.mark.each_gaudi
def test_the_profiler_records_the_device_it_runs_on():
    """CUDA activity on CUDA, HPU activity on a Gaudi where torch's profiler has one (ProfilerActivity.HPU: torch 2.9
    has it, 2.6 not), the host's always."""
    from torch.profiler import ProfilerActivity

    from ds_core.outputs.profile import profiler_activities

    A = ProfilerActivity
    assert profiler_activities(False, False, A) == [A.CPU]
    assert profiler_activities(True, False, A) == [A.CPU, A.CUDA]
    # the installed torch's own activities: a Gaudi gets HPU events exactly where this torch can record them
    assert profiler_activities(False, True, A) == [A.CPU] + ([A.HPU] if hasattr(A, "HPU") else [])

    class WithHpu:
        CPU, CUDA, HPU = "cpu", "cuda", "hpu"

    assert profiler_activities(False, True, WithHpu) == ["cpu", "hpu"]

    class NoHpu:  # a torch whose profiler has no HPU activity: the host's only, not an error
        CPU, CUDA = A.CPU, A.CUDA

    assert profiler_activities(False, True, NoHpu) == [A.CPU]
