"""The two changes that read DeepSpeed internals and replace nothing: their instance checks, at after_initialize.

- engine_grad_norm: ds_core.run.step.global_grad_norm reads the engine's _global_grad_norm (a device tensor) where
  this change is on, not get_global_grad_norm() (Habana's fork's reads it on the host).
- zero_partition_layout: bert_ref.layerwise reads the partition layout of the engine's optimizer wrapper
  (ds_core.compat.zero_layout.READS); on only where the wrapper the run got has every attribute read.
"""
from __future__ import annotations

from typing import Any

from ds_core.compat.gates import APPLIED, Outcome, not_needed, refused
from ds_core.compat.zero_layout import READS, missing_attributes


def apply_engine_norm(ctx: Any) -> Outcome:
    return not_needed("no engine given") if ctx.engine is None else APPLIED


def apply_zero_layout(ctx: Any) -> Outcome:
    opt = getattr(ctx.engine, "optimizer", None)
    if opt is None or not any(hasattr(opt, attrs[0]) for attrs in READS.values()):
        return not_needed(f"this run's optimizer wrapper ({type(opt).__name__}) has no partition layout")
    why = missing_attributes(opt)
    return refused(why) if why else APPLIED


__all__ = ["apply_engine_norm", "apply_zero_layout"]
