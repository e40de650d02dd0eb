"""nvidia_poly / habana_poly equal NVIDIA's and Habana's own PolyWarmUpScheduler at every step of the published runs
(tests/data/lr_reference.npz, produced by the references' code: tests/data/README.md says from which commit)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bert_ref.optim import for_preset
from ds_core.config.optim import OptimArgs, schedule_for
from ds_core.errors import ConfigError

REF = Path(__file__).parent / "data" / "lr_reference.npz"

# name in the npz -> (peak LR, OptimArgs of the same run)
RUNS = {"nvidia_large_p1": (6e-3, OptimArgs(lr_scheduler_type="nvidia_poly", warmup_ratio=0.2843, poly_degree=0.5)),
        "nvidia_large_p2": (4e-3, OptimArgs(lr_scheduler_type="nvidia_poly", warmup_ratio=0.128, poly_degree=0.5)),
        "habana_1p5b": (0.0015, OptimArgs(lr_scheduler_type="habana_poly", warmup_ratio=0.05,
                                          constant_proportion=0.25, poly_degree=1.0))}


@pytest.mark.parametrize("name", list(RUNS))
def test_every_step_equals_the_reference(name):
    expected = np.load(REF)[name]
    lr, args = RUNS[name]
    # through the object DeepSpeed steps (LRSchedule on an optimizer), as bert_ref.train builds it
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = schedule_for(args, len(expected))(opt)
    ours = np.empty_like(expected)
    for step in range(len(expected)):
        ours[step] = opt.param_groups[0]["lr"]
        sched.step()
    np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=0)
    assert opt.param_groups[0]["lr"] == 0.0  # past the end: 0, where NVIDIA's formula would turn complex


def test_the_schedules_differ_where_the_issue_says():
    """The project's earlier poly_warmup is not NVIDIA's: at step 2000 of phase 1 it is still at the peak."""
    p1 = np.load(REF)["nvidia_large_p1"]
    assert p1[2000] == pytest.approx(5.076e-3, rel=1e-3)  # already decaying on overall progress
    old = OptimArgs(lr_scheduler_type="poly_warmup", warmup_ratio=0.2843, poly_degree=0.5)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=6e-3)
    sched = schedule_for(old, 7038)(opt)
    for _ in range(2000):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(6e-3)


def test_bad_settings_name_the_schedule():
    with pytest.raises(ConfigError, match="nvidia_poly .*constant phase"):
        schedule_for(OptimArgs(lr_scheduler_type="nvidia_poly", constant_proportion=0.25), 100)
    with pytest.raises(ConfigError, match="--lr_scheduler_type 'nvidia'"):
        OptimArgs(lr_scheduler_type="nvidia").validate()
    with pytest.raises(ConfigError, match="total_steps = 0"):
        schedule_for(OptimArgs(lr_scheduler_type="habana_poly"), 0)
    # the presets' published recipes pick the kind of their source
    assert for_preset(OptimArgs(), "bert_large", 2).lr_scheduler_type == "nvidia_poly"
    assert for_preset(OptimArgs(), "bert_1p5b").lr_scheduler_type == "habana_poly"
    # --lr_schedule is the same setting as --lr_scheduler_type
    from ds_core.config import parse_args
    (opt,) = parse_args([OptimArgs], ["--lr_schedule", "habana_poly"])
    assert opt.lr_scheduler_type == "habana_poly"
