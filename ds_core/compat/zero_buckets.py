"""ZeRO-1/2's gradient buckets by dtype, so that no gradient is left out of the all-reduce on any device.

DeepSpeedZeroOptimizer without contiguous gradients (`"contiguous_gradients": false`, the single-all-reduce study
configurations) reduces its gradient bucket through buffered_reduce_fallback, which groups the gradients with
split_half_float_double. In DeepSpeed 0.16 (Habana's fork) that compares each tensor's legacy type string with
"torch.<device>.FloatTensor": on the CPU accelerator the string is "torch.FloatTensor", nothing matches, no bucket is
made and the gradients are not all-reduced at all, silently (every rank steps on its own gradient). 0.19 compares
dtypes. Where the installed function drops a CPU float tensor (ds_core.compat.deepspeed_behaviour.
zero_buckets_drop_cpu), its name in deepspeed.runtime.zero.stage_1_and_2 is replaced by split_by_dtype, 0.19's
grouping (same buckets, same order: half, float, double, bfloat16; strided tensors only).
"""
from __future__ import annotations

from typing import Callable

import torch

DTYPES = (torch.half, torch.float, torch.double, torch.bfloat16)


def split_by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by dtype (half, float, double, bfloat16), strided ones only, on any device."""
    buckets = []
    for dtype in DTYPES:
        bucket = [t for t in tensors if t.dtype == dtype and t.layout == torch.strided]
        if bucket:
            buckets.append(bucket)
    return buckets


def use_dtype_buckets(say: Callable[[str], None] | None = None) -> bool:
    """ZeRO-1/2's buffered reduction through split_by_dtype where the installed DeepSpeed's grouping drops CPU
    tensors (ds_core.compat.changes: cpu_gradient_buckets); True if it is installed (idempotent)."""
    from deepspeed.runtime.zero import stage_1_and_2

    from ds_core.compat.changes import BY_NAME, missing, say_off

    if getattr(stage_1_and_2.split_half_float_double, "deepspeeds", None) is not None:
        return True
    if BY_NAME["cpu_gradient_buckets"].not_needed() is not None:
        return False
    if why := missing("cpu_gradient_buckets"):
        say_off("cpu_gradient_buckets", why, say)
        return False
    deepspeeds = stage_1_and_2.split_half_float_double

    def split_half_float_double(tensors):
        return split_by_dtype(tensors)

    split_half_float_double.deepspeeds = deepspeeds  # DeepSpeed's own, for the probe (deepspeed_behaviour)
    stage_1_and_2.split_half_float_double = split_half_float_double
    return True


__all__ = ["split_by_dtype", "use_dtype_buckets", "DTYPES"]
