"""ZeRO-1/2's gradient buckets by dtype, so that no gradient is left out of the all-reduce on any device.

A fork-on-CPU-only fix (fork_cpu_only in ds_core.compat.changes): it exists because Habana's fork misbehaves on
DeepSpeed's CPU accelerator, where this toolkit's tests run; on a Gaudi (and on CUDA) the fork's type strings match
its tensors, so no Gaudi user meets the fault, and there the replacement forms the same buckets as the fork's own.

DeepSpeedZeroOptimizer without contiguous gradients (`"contiguous_gradients": false`, the single-all-reduce study
configurations) reduces its gradient bucket through buffered_reduce_fallback, which groups the gradients with
split_half_float_double. In DeepSpeed 0.16 (Habana's fork) that compares each tensor's legacy type string with
"torch.<device>.FloatTensor": on the CPU accelerator the string is "torch.FloatTensor", nothing matches, no bucket is
made and the gradients are not all-reduced at all, silently (every rank steps on its own gradient). 0.19 compares
dtypes. Where the installed function is the fork's (its gate: the body's fingerprint; the fault it stands for is
probed by ds_core.compat.deepspeed_behaviour.zero_buckets_drop_cpu), its name in deepspeed.runtime.zero.stage_1_and_2
is replaced by split_by_dtype, 0.19's grouping (same buckets, same order: half, float, double, bfloat16; strided
tensors only).
"""
from __future__ import annotations

from typing import Any

import torch

from ds_core.compat.gates import APPLIED, Outcome
from ds_core.compat.marks import replace

DTYPES = (torch.half, torch.float, torch.double, torch.bfloat16)


def split_by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by dtype (half, float, double, bfloat16), strided ones only, on any device."""
    buckets = []
    for dtype in DTYPES:
        bucket = [t for t in tensors if t.dtype == dtype and t.layout == torch.strided]
        if bucket:
            buckets.append(bucket)
    return buckets


def apply(ctx: Any) -> Outcome:
    """Change cpu_gradient_buckets: ZeRO-1/2's buffered reduction through split_by_dtype (its gate found the
    fork's grouping, which drops CPU tensors)."""
    from deepspeed.runtime.zero import stage_1_and_2

    def make(deepspeeds: Any) -> Any:
        def split_half_float_double(tensors):
            return split_by_dtype(tensors)
        return split_half_float_double

    replace(stage_1_and_2, "split_half_float_double", make, "cpu_gradient_buckets")
    return APPLIED


__all__ = ["split_by_dtype", "apply", "DTYPES"]
