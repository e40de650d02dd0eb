"""DeepSpeed's global gradient norm over its flat fp32 gradient buffer, not one norm per parameter tensor.

Both of DeepSpeed 0.19's ZeRO-1 optimizers for bf16 weights keep the fp32 gradients in flat buffers and then, at every
optimizer step, compute the global norm one tensor at a time: ~20 host ops and 3-5 kernel launches per tensor (~8,000
host ops per BERT-Large step on the CPU proxy), work that grows with the number of tensors and bounds a GPU's step.
- BF16_Optimizer (ZeRO-1 with "data_types": {"grad_accum_dtype": "fp32"}, the BERT JSONs): every rank holds the
  full reduced gradient in fp32_groups_gradients_flat; get_grads_for_norm returns a view per parameter, which
  get_global_norm_of_tensors norms one by one (float32 norms of float32 views), then sums their squares in float32.
  Here get_grads_for_norm returns one small float64 tensor instead: the L2 norms of the flat buffers' 2**26-element
  chunks, each accumulated in float64 (DeepSpeed's norm dtype, ds_core.compat.flat_norm.norm_dtype); DeepSpeed's
  get_global_norm_of_tensors then rounds those to float32 and norms them in float32. The result is the float64
  norm of the same numbers (padding and tensors without a gradient are zeros: the buffer is zeroed after every
  step) rounded to float32, with one float32 rounding per chunk (one chunk below 67M elements); DeepSpeed's own
  differs from it by its float32 accumulation (~1e-6 relative for 1e5-element tensors, tests/test_flat_norm.py).
  For clipping the flat buffers themselves are returned: the same in-place scale of the same memory.
- DeepSpeedZeroOptimizer (ZeRO-1/2 otherwise, e.g. BridgeTower's JSON): get_grad_norm_direct takes the L2 norm of
  each of the partition's gradient views in float64 (0.19: its get_norm_dtype, float32 on a device without float64),
  sums their squares in float64, rounds the sum to float32, all-reduces it (float32) and takes the square root. Here
  the same, with other float64 terms: with fp32 accumulation of bf16 gradients the views lie in one
  GradPartitionBufferGroup.flat_partition, whose norm is taken in float64 chunks (no float64 copy of the whole
  partition); without it (bf16 accumulation) the views' float64 norms come from one torch._foreach_norm (a fused
  multi-tensor kernel on CUDA). Only the float64 summation order differs, then the same float32 rounding, all-reduce
  and mask of a non-finite norm as -1 (relative difference within a few float32 ulps: rel 3e-7 in the test).
DeepSpeed has no setting for either (zero_optimization.compute_grad_norm=false drops the norm, which NVLAMB / LANS
clip by and the metrics log), so the methods are replaced on the engine's optimizer instance.
BF16_Optimizer then clips by that norm (the JSON's gradient_clipping, BridgeTower's 1.0) with DeepSpeed's
clip_tensors_by_global_norm, whose `if clip_coef < 1` reads the norm on the host: a device sync every step. Its name in
deepspeed.runtime.bf16_optimizer is replaced by device_clip: the coefficient max_norm / (norm + eps) computed as
DeepSpeed computes it (float32), clamped to 1 on the device and multiplied in place into the fp32 views in one
multi-tensor call (the same bits: a gradient under the threshold is multiplied by exactly 1). Where DeepSpeed's norm
has more to do (model or pipeline parallelism, MoE, CPU offload, another norm type, no flat buffer, HPU graph capture)
its own method stays.
Each replacement is applied by ds_core.compat.changes (stage after_initialize), gated by the fingerprint of the body
it replaces. Habana's fork (0.16.1) has the same methods; it norms ZeRO's tensors in float64 without a get_norm_dtype
and its clip takes `use_graph` (HPU graph capture), which goes to DeepSpeed's own clip.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ds_core.compat.gates import APPLIED, Outcome, not_needed, refused
from ds_core.compat.marks import replace

CHUNK = 1 << 26  # elements per float64 temporary (512 MB): a few chunks for a BERT-Large partition


def _engine_wrapper(ctx: Any) -> tuple[Any, str | None]:
    """The engine's optimizer wrapper, and why the flat norms do not serve it (None: they may)."""
    if ctx.engine is None:
        return None, "no engine given"
    opt = ctx.engine.optimizer
    if getattr(opt, "has_moe_layers", False) or getattr(opt, "mpu", None) is not None:
        return opt, "MoE or model parallelism: DeepSpeed's own norm, which skips replicated tensors"
    return opt, None


def apply_bf16(ctx: Any) -> Outcome:
    """Change flat_grad_norm_bf16 on the engine's BF16_Optimizer (ds_core.compat.changes.apply_stage)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.constants import PIPE_REPLICATED

    opt, why = _engine_wrapper(ctx)
    if why or not isinstance(opt, BF16_Optimizer):
        return not_needed(why or f"this run's optimizer wrapper is {type(opt).__name__}, not BF16_Optimizer")
    if not hasattr(opt, "fp32_groups_gradients_flat"):
        return refused("BF16_Optimizer has no fp32_groups_gradients_flat")
    if getattr(opt, "graph_harvesting", False):  # HPU graphs replay DeepSpeed's own norm ops as captured
        return not_needed("HPU graph capture replays DeepSpeed's own norm")
    if any(getattr(p, PIPE_REPLICATED, False) for g in opt.bf16_groups for p in g):
        return not_needed("pipeline-replicated parameters: DeepSpeed's own norm skips them")
    replace(opt, "get_grads_for_norm", lambda per_tensor: _bf16_norm(opt, per_tensor), "flat_grad_norm_bf16")
    return APPLIED


def apply_zero(ctx: Any) -> Outcome:
    """Change flat_grad_norm_zero on the engine's DeepSpeedZeroOptimizer (ds_core.compat.changes.apply_stage)."""
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt, why = _engine_wrapper(ctx)
    if why or not isinstance(opt, DeepSpeedZeroOptimizer) or opt.cpu_offload:
        return not_needed(why or ("CPU offload: DeepSpeed's own norm" if isinstance(opt, DeepSpeedZeroOptimizer) else
                                  f"this run's optimizer wrapper is {type(opt).__name__}, not DeepSpeedZeroOptimizer"))
    # model parallelism (a group set from an mpu): DeepSpeed's norm, which skips replicated tensors
    if getattr(opt, "model_parallel_group", None) is not None or any(
            getattr(p, PIPE_REPLICATED, False) for g in opt.params_in_partition for p in g):
        return not_needed("model or pipeline parallelism: DeepSpeed's own norm skips replicated tensors")
    replace(opt, "get_grad_norm_direct", lambda per_tensor: _zero_norm(opt, per_tensor), "flat_grad_norm_zero")
    return APPLIED


def _bf16_norm(opt: Any, per_tensor: Callable) -> Callable:
    def get_grads_for_norm(for_clipping=False):
        if getattr(opt, "_uses_muon", False):
            return per_tensor(for_clipping)
        flats = list(opt.fp32_groups_gradients_flat)
        if for_clipping:  # scaled in place: the same memory as the per-parameter views
            return flats
        # one small tensor whose norm is the global norm: the chunks' norms (float64 sums of squares), which
        # get_global_norm_of_tensors then norms in float32 as it norms each tensor
        return [torch.cat([chunk_norms(f.view(-1)) for f in flats])], {}

    return get_grads_for_norm


def _zero_norm(opt: Any, per_tensor_direct: Callable) -> Callable:
    # per_tensor_direct: DeepSpeed's, for every case this does not cover
    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return per_tensor_direct(gradients, params, norm_type)
        flat = getattr(gradients, "flat_partition", None)
        if flat is not None:
            return global_norm(chunk_norms(flat.view(-1)), opt.dp_process_group, opt.device)
        grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        if not grads:
            return per_tensor_direct(gradients, params, norm_type)
        # no flat buffer (bf16 gradient accumulation): the per-tensor norms in one multi-tensor call
        return global_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=norm_dtype())), opt.dp_process_group,
                           opt.device)

    return get_grad_norm_direct


def device_clip(host_clip: Callable) -> Callable:
    """deepspeed.runtime.utils.clip_tensors_by_global_norm without its host read where the norm is a tensor:
    tensors *= min(1, max_norm / (norm + eps)), the coefficient computed as DeepSpeed computes it and kept on the
    device. A norm given as a number, or none, goes to DeepSpeed's `host_clip`."""

    def clip_tensors_by_global_norm(input_tensors, max_norm=1.0, global_norm=None, mpu=None, eps=1e-6,
                                    use_graph=False):
        tensors = list(input_tensors)
        if not torch.is_tensor(global_norm) or not tensors or use_graph:  # use_graph: HPU graph capture (the fork)
            graph = {"use_graph": use_graph} if use_graph else {}
            return host_clip(input_tensors, max_norm=max_norm, global_norm=global_norm, mpu=mpu, eps=eps, **graph)
        with torch.no_grad():  # DeepSpeed's tensor.detach().mul_(), without one detach per tensor
            coef = (max_norm / (global_norm + eps)).clamp_(max=1.0)
            torch._foreach_mul_(tensors, coef)
        return global_norm

    return clip_tensors_by_global_norm


def apply_device_clip(ctx: Any) -> Outcome:
    """Change device_clip: BF16_Optimizer.step's clip through device_clip (every BF16_Optimizer of the process: the
    same result as DeepSpeed's, without the sync); applied where the engine's wrapper is a BF16_Optimizer. Its gate
    reads the body of deepspeed.runtime.utils' function, the one bf16_optimizer imports under the name replaced."""
    from deepspeed.runtime import bf16_optimizer

    opt = getattr(ctx.engine, "optimizer", None)
    if not isinstance(opt, bf16_optimizer.BF16_Optimizer):
        return not_needed(f"this run's optimizer wrapper is {type(opt).__name__}; the clip replaced is "
                          f"BF16_Optimizer's")
    if not hasattr(bf16_optimizer, "clip_tensors_by_global_norm"):
        return refused("this DeepSpeed's bf16_optimizer has no clip_tensors_by_global_norm of its own to replace")
    replace(bf16_optimizer, "clip_tensors_by_global_norm", device_clip, "device_clip")
    return APPLIED


def norm_dtype() -> torch.dtype:
    """The dtype DeepSpeed accumulates gradient norms in: its get_norm_dtype (float64, float32 on a device without
    float64) where it has one; float64 before that (DeepSpeed 0.16's get_grad_norm_direct: `g.data.double()`)."""
    try:
        from deepspeed.runtime.zero.utils import get_norm_dtype
    except ImportError:
        return torch.float64
    return get_norm_dtype()


def chunk_norms(flat: torch.Tensor) -> torch.Tensor:
    """The L2 norms of the flat tensor's CHUNK-element pieces, each accumulated in DeepSpeed's norm dtype (float64
    where the device has it), as a 1-D tensor of that dtype: sqrt(sum(result**2)) is the norm of the whole."""
    dtype = norm_dtype()
    return torch.stack([torch.linalg.vector_norm(c.to(dtype)) for c in flat.split(CHUNK)])


def global_norm(norms: torch.Tensor, group: Any, device: Any) -> torch.Tensor:
    """sqrt(sum over ranks of sum(norms**2)) as DeepSpeed's get_grad_norm_direct returns it: a float32 0-d tensor on
    the device, -1 where it is not finite (deepspeed.runtime.utils.mask_nan_or_inf_with_val_inplace)."""
    from deepspeed import comm as dist

    total = norms.pow(2).sum().float()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    total = total.pow(0.5)
    # DeepSpeed's -1 for a non-finite norm, as every version masks it (0.19 names it mask_nan_or_inf_with_val_inplace;
    # 0.16 writes the same mask inline): one masked_fill, no DeepSpeed helper needed
    return total.masked_fill_(total.isinf().logical_or(total.isnan()), -1.0)


__all__ = ["apply_bf16", "apply_zero", "apply_device_clip", "device_clip", "chunk_norms",
           "global_norm", "norm_dtype", "CHUNK"]
