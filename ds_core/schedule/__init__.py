"""Learning-rate schedules (lr.py; NVIDIA's and Habana's BERT schedules: published.py) and weight-decay groups
(decay.py) shared by every model, as transformers' Trainer has them; this module gathers their names."""
from __future__ import annotations

from ds_core.schedule.decay import NO_DECAY_PATTERNS, decay_parameter_names, param_groups
from ds_core.schedule.lr import (
    HF_KINDS,
    KINDS,
    LRSchedule,
    hf_factor,
    lr_schedule,
    poly_warmup_factor,
    schedule_factor,
    total_optimizer_steps,
    warmup_steps_for,
)

__all__ = ["NO_DECAY_PATTERNS", "decay_parameter_names", "param_groups", "HF_KINDS", "KINDS", "warmup_steps_for",
           "total_optimizer_steps", "poly_warmup_factor", "hf_factor", "schedule_factor", "LRSchedule",
           "lr_schedule"]
