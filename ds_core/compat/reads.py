"""The two changes that read DeepSpeed internals and replace nothing: their instance checks, at after_initialize.

- engine_grad_norm: ds_core.run.loop.global_grad_norm reads the engine's _global_grad_norm (a device tensor) where
  this change is on, not get_global_grad_norm() (Habana's fork's reads it on the host).
- zero_partition_layout: bert_ref.layerwise reads the partition layout of the engine's optimizer wrapper
  (ds_core.compat.zero_layout.READS); on only where the wrapper the run got has every attribute read.
"""
from __future__ import annotations

from typing import Any


def apply_engine_norm(ctx: Any) -> str | None:
    from ds_core.compat.marks import NotNeeded

    if ctx.engine is None:
        return NotNeeded("no engine given")
    return None


def apply_zero_layout(ctx: Any) -> str | None:
    from ds_core.compat.marks import NotNeeded
    from ds_core.compat.zero_layout import READS, missing_attributes

    opt = getattr(ctx.engine, "optimizer", None)
    if opt is None or not any(hasattr(opt, attrs[0]) for attrs in READS.values()):
        return NotNeeded(f"this run's optimizer wrapper ({type(opt).__name__}) has no partition layout")
    return missing_attributes(opt)


__all__ = ["apply_engine_norm", "apply_zero_layout"]
