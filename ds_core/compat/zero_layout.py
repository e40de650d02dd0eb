"""Where each parameter tensor lies in the flat tensors DeepSpeed's optimizer wrappers hand the optimizer.

DeepSpeed's bf16 / ZeRO wrappers give the optimizer one flat fp32 tensor per parameter group and rank (ZeRO-1/2, bf16
ZeRO-1) or per sub-group (ZeRO-3), holding slices of many parameters. An optimizer with per-tensor trust ratios
(NVLAMB, LANS: bert_ref.layerwise) needs to know which slice belongs to which parameter: zero_layouts reads it from
the wrapper's attributes after deepspeed.initialize. DeepSpeed has no API for it, so this reads internals (READS),
one of the changes listed in ds_core.compat.changes; missing_attributes is its feature check on the wrapper a run
got. DeepSpeed >= 0.18 aligns each parameter's start in ZeRO-1/2's buffer (round_robin_bit16_offsets); Habana's fork
(0.16.1) packs them back to back; both are read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class FlatLayout:
    """Where parameter tensors lie in one flat tensor the optimizer is handed.

    segments: (key, start, length) in the flat tensor; key is the parameter's index within its (sub-)group, the same
    on every rank; key -1 marks alignment padding (left out of every norm). n_keys: tensors in the (sub-)group."""

    segments: list[tuple[int, int, int]]
    n_keys: int


def partition_segments(numels: list[int], offsets: list[int], start: int, size: int) -> list[tuple[int, int, int]]:
    """Segments of the partition [start, start + size) of a flat buffer whose tensor k lies at offsets[k]."""
    segs, end, pos = [], start + size, start
    for key, (off, n) in enumerate(zip(offsets, numels)):
        lo, hi = max(off, start), min(off + n, end)
        if lo < hi:
            if lo > pos:
                segs.append((-1, pos - start, lo - pos))
            segs.append((key, lo - start, hi - lo))
            pos = hi
    if pos < end:
        segs.append((-1, pos - start, end - pos))
    return segs


# per wrapper (told apart by the attribute first in each list): the attributes zero_layouts reads
READS = {"ZeRO-3 (DeepSpeedZeroOptimizer_Stage3)": ("fp32_partitioned_groups_flat", "fp16_groups", "dp_process_group"),
         "BF16_Optimizer": ("fp32_groups_flat_partition", "bf16_groups", "real_dp_process_group"),
         "ZeRO-1/2 (DeepSpeedZeroOptimizer)": ("single_partition_of_fp32_groups", "round_robin_bit16_groups",
                                               "real_dp_process_group", "partition_size"),
         "ZeRO-0 fp16/bf16 (FP16_UnfusedOptimizer)": ("fp32_groups",)}


def missing_attributes(ds_optimizer: Any) -> str | None:
    """What zero_layouts would read and this wrapper lacks (in words), or None: the feature check of the
    zero_partition_layout change (ds_core.compat.changes) on the wrapper instance a run got."""
    for wrapper, attrs in READS.items():
        if hasattr(ds_optimizer, attrs[0]):
            lacks = [a for a in attrs if not hasattr(ds_optimizer, a)]
            return f"{wrapper} of this DeepSpeed has no {', '.join(lacks)}" if lacks else None
    return None


def zero_layouts(ds_optimizer: Any) -> tuple[dict[int, FlatLayout], Any]:
    """{id(tensor handed to the optimizer): FlatLayout} of a DeepSpeed optimizer wrapper, and its data-parallel
    process group (None where nothing is partitioned); ({}, None) where the optimizer gets the model's own
    parameters (fp32 ZeRO-0) or the wrapper is none of READS's."""
    import deepspeed.comm as dist

    if hasattr(ds_optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3 (stage3.py): one flat per sub-group
        rank = dist.get_rank(group=ds_optimizer.dp_process_group)
        layouts = {}
        for sub, flat in zip(ds_optimizer.fp16_groups, ds_optimizer.fp32_partitioned_groups_flat):
            segs, pos = [], 0
            for key, p in enumerate(sub):
                part = p.partition_numel()  # every rank holds `part` elements of every parameter, zero-padded last
                real = max(0, min(part, p.ds_numel - rank * part))
                if real:
                    segs.append((key, pos, real))
                if part > real:
                    segs.append((-1, pos + real, part - real))
                pos += part
            layouts[id(flat)] = FlatLayout(segs, len(sub))
        return layouts, ds_optimizer.dp_process_group
    if hasattr(ds_optimizer, "fp32_groups_flat_partition"):  # bf16 ZeRO-1 (bf16_optimizer.py): tensors back to back
        layouts, group = {}, None
        for i, (params, flat) in enumerate(zip(ds_optimizer.bf16_groups, ds_optimizer.fp32_groups_flat_partition)):
            group = ds_optimizer.real_dp_process_group[i]
            numels = [p.numel() for p in params]
            offsets = [sum(numels[:k]) for k in range(len(numels))]
            start = dist.get_rank(group=group) * flat.numel()
            layouts[id(flat)] = FlatLayout(partition_segments(numels, offsets, start, flat.numel()), len(params))
        return layouts, group
    if hasattr(ds_optimizer, "single_partition_of_fp32_groups"):  # ZeRO-1/2 (stage_1_and_2.py)
        layouts, group = {}, None
        for i, flat in enumerate(ds_optimizer.single_partition_of_fp32_groups):
            group = ds_optimizer.real_dp_process_group[i]
            params = ds_optimizer.round_robin_bit16_groups[i]  # the flat buffer's order
            numels = [p.numel() for p in ds_optimizer.round_robin_bit16_meta[i]] \
                if hasattr(ds_optimizer, "round_robin_bit16_meta") else [p.numel() for p in params]
            # DeepSpeed >= 0.18 aligns each parameter's start (round_robin_bit16_offsets); older ones pack them
            offsets = list(getattr(ds_optimizer, "round_robin_bit16_offsets", [None] * (i + 1))[i] or
                           [sum(numels[:k]) for k in range(len(numels))])
            size = ds_optimizer.partition_size[i]
            if flat.numel() != size:
                raise RuntimeError(f"ZeRO group {i}: flat fp32 partition has {flat.numel()} elements, partition_size "
                                   f"{size}: unknown DeepSpeed layout")
            start = dist.get_rank(group=group) * size
            layouts[id(flat)] = FlatLayout(partition_segments(numels, offsets, start, size), len(params))
        return layouts, group
    if hasattr(ds_optimizer, "fp32_groups"):  # (DeepSpeed's fused fp16 wrapper serves only FusedAdam)
        # bf16 / fp16 ZeRO-0 with a non-fused optimizer (fp16/unfused_optimizer.py): one fp32 master copy per
        # parameter, nothing partitioned; registered so that step() knows them from a foreign flat tensor
        return {id(p): FlatLayout([(0, 0, p.numel())], 1) for g in ds_optimizer.fp32_groups for p in g}, None
    return {}, None


__all__ = ["FlatLayout", "partition_segments", "zero_layouts", "missing_attributes", "READS"]
