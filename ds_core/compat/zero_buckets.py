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

from typing import Any

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


def apply(ctx: Any) -> str | None:
    """Change cpu_gradient_buckets: ZeRO-1/2's buffered reduction through split_by_dtype (the installed DeepSpeed's
    grouping drops CPU tensors: ds_core.compat.changes decided it needs the fix)."""
    from deepspeed.runtime.zero import stage_1_and_2

    from ds_core.compat.marks import replace

    def make(deepspeeds: Any) -> Any:
        def split_half_float_double(tensors):
            return split_by_dtype(tensors)
        return split_half_float_double

    replace(stage_1_and_2, "split_half_float_double", make, "cpu_gradient_buckets")
    return None


__all__ = ["split_by_dtype", "apply", "DTYPES"]
