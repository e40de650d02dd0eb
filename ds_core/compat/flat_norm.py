"""DeepSpeed's global gradient norm over its flat fp32 gradient buffer, not one norm per parameter tensor.

Both of DeepSpeed 0.19's ZeRO-1 optimizers for bf16 weights keep the fp32 gradients in flat buffers and then, at every
optimizer step, compute the global norm one tensor at a time: ~20 host ops and 3-5 kernel launches per tensor (~8,000
host ops per BERT-Large step on the CPU proxy), work that grows with the number of tensors and bounds a GPU's step.
- BF16_Optimizer (ZeRO-1 with "data_types": {"grad_accum_dtype": "fp32"}, the BERT JSONs): every rank holds the
  full reduced gradient in fp32_groups_gradients_flat; get_grads_for_norm returns a view per parameter, which
  get_global_norm_of_tensors norms one by one in float32 and stacks. Here it returns the group's flat buffer instead:
  the same float32 norm over the same numbers (padding is zeros, and a tensor without a gradient has zeros there:
  the buffer is zeroed after every step), and for clipping the same in-place scale of the same memory.
- DeepSpeedZeroOptimizer (ZeRO-1/2 otherwise, e.g. BridgeTower's JSON): get_grad_norm_direct norms the partition's
  gradient views one by one in float64. With fp32 accumulation of bf16 gradients they are views into one
  GradPartitionBufferGroup.flat_partition, whose sum of squares is taken here in a few float64 chunks (no float64
  copy of the whole partition); without it (bf16 accumulation) the views' norms come from one torch._foreach_norm
  (float64 results: a fused multi-tensor kernel on CUDA). Either way all-reduced over the data-parallel group and
  masked as DeepSpeed masks a non-finite norm.
DeepSpeed has no setting for either (zero_optimization.compute_grad_norm=false drops the norm, which NVLAMB / LANS
clip by and the metrics log), so the methods are replaced on the engine's optimizer instance.
BF16_Optimizer then clips by that norm (the JSON's gradient_clipping, BridgeTower's 1.0) with DeepSpeed's
clip_tensors_by_global_norm, whose `if clip_coef < 1` reads the norm on the host: a device sync every step. Its name in
deepspeed.runtime.bf16_optimizer is replaced by device_clip: the same coefficient, clamped to 1 on the device and
multiplied into the flat buffers in one multi-tensor call (the same bits: a gradient under the threshold is
multiplied by exactly 1). Where DeepSpeed's norm has more to do (model or pipeline parallelism, MoE, CPU offload,
another norm type, no flat buffer, HPU graph capture) its own method stays.
Each replacement is applied by feature (ds_core.compat.changes): on a DeepSpeed whose methods take other parameters it
stays off with one line. Habana's fork (0.16.1) has the same methods; it norms ZeRO's tensors in float64 without a
get_norm_dtype and its clip takes `use_graph` (HPU graph capture), which goes to DeepSpeed's own clip.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

CHUNK = 1 << 26  # elements per float64 temporary (512 MB): a few chunks for a BERT-Large partition


def use_flat_grad_norm(engine: Any, say: Callable[[str], None] | None = None) -> bool:
    """Install the flat-buffer norm on the engine's ZeRO-1/2 or bf16 optimizer where it applies; True if it did.
    Where the installed DeepSpeed lacks what it replaces (ds_core.compat.changes), `say` gets the one line."""
    from ds_core.compat.changes import missing, say_off

    try:
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.constants import PIPE_REPLICATED
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return False
    opt = engine.optimizer
    if getattr(opt, "has_moe_layers", False) or getattr(opt, "mpu", None) is not None:
        return False
    if isinstance(opt, BF16_Optimizer):
        if (why := missing("flat_grad_norm_bf16")) or not hasattr(opt, "fp32_groups_gradients_flat"):
            say_off("flat_grad_norm_bf16", why or "BF16_Optimizer has no fp32_groups_gradients_flat", say)
            return False
        if getattr(opt, "graph_harvesting", False):  # HPU graphs replay DeepSpeed's own norm ops as captured
            return False
        if any(getattr(p, PIPE_REPLICATED, False) for g in opt.bf16_groups for p in g):
            return False
        _install_bf16(opt)
        use_device_clip(say)
        return True
    if not isinstance(opt, DeepSpeedZeroOptimizer) or opt.cpu_offload:
        return False
    use_group_norm_sentinel(opt, say)  # a fix of older DeepSpeed's combined norm, whether or not the flat norm applies
    if why := missing("flat_grad_norm_zero"):
        say_off("flat_grad_norm_zero", why, say)
        return False
    # model parallelism (a group set from an mpu): DeepSpeed's norm, which skips replicated tensors
    if getattr(opt, "model_parallel_group", None) is not None:
        return False
    if any(getattr(p, PIPE_REPLICATED, False) for g in opt.params_in_partition for p in g):
        return False
    _install_zero(opt)
    return True


def use_group_norm_sentinel(opt: Any, say: Callable[[str], None] | None = None) -> bool:
    """Where DeepSpeed's ZeRO-1/2 combines its groups' norms with a plain vector norm (before 0.19's
    combine_grad_norm_groups), a group whose norm is non-finite (masked as -1) yields a finite global norm (sqrt of
    the others' squares plus 1): the update is applied with NaN gradients and a norm that looks healthy, and a
    checkpoint of NaN weights is saved. Here the combined norm is inf when any group's is non-finite or negative, as
    0.19 returns it; the divergence guard then stops the run at that step (ds_core.run.divergence). Not needed where
    DeepSpeed has the fix; CPU offload and MoE keep DeepSpeed's own method."""
    from ds_core.compat.changes import BY_NAME, missing, say_off

    if BY_NAME["nonfinite_group_norm"].not_needed() is not None or opt.cpu_offload or opt.has_moe_layers:
        return False
    if why := missing("nonfinite_group_norm"):
        say_off("nonfinite_group_norm", why, say)
        return False

    def scaled_global_norm(norm_type=2):
        assert norm_type == 2, "only L2 norm supported"
        norms = torch.stack([opt.get_grad_norm_direct(opt.averaged_gradients[i], opt.params_in_partition[i])
                             for i in range(len(opt.bit16_groups))])
        combined = torch.linalg.vector_norm(norms, ord=norm_type)
        invalid = (~torch.isfinite(norms) | (norms < 0)).any()
        return torch.where(invalid, torch.full_like(combined, float("inf")), combined)

    opt.scaled_global_norm = scaled_global_norm
    return True


def _install_bf16(opt: Any) -> None:
    per_tensor = opt.get_grads_for_norm

    def get_grads_for_norm(for_clipping=False):
        if getattr(opt, "_uses_muon", False):
            return per_tensor(for_clipping)
        flats = list(opt.fp32_groups_gradients_flat)
        if for_clipping:  # scaled in place: the same memory as the per-parameter views
            return flats
        # one small tensor whose norm is the global norm: the chunks' norms (float64 sums of squares), which
        # get_global_norm_of_tensors then norms in float32 as it norms each tensor
        return [torch.cat([chunk_norms(f.view(-1)) for f in flats])], {}

    opt.get_grads_for_norm = get_grads_for_norm


def _install_zero(opt: Any) -> None:
    per_tensor_direct = opt.get_grad_norm_direct  # DeepSpeed's, for every case this does not cover

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

    opt.get_grad_norm_direct = get_grad_norm_direct


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

    clip_tensors_by_global_norm.ds_core_device_clip = True
    return clip_tensors_by_global_norm


def use_device_clip(say: Callable[[str], None] | None = None) -> bool:
    """BF16_Optimizer.step's clip through device_clip (idempotent; every BF16_Optimizer of the process: the same
    result as DeepSpeed's, without the sync); True if it is installed. Off, with `say`'s line, where the installed
    DeepSpeed's function takes parameters device_clip does not know."""
    from deepspeed.runtime import bf16_optimizer

    from ds_core.compat.changes import replace_attr

    return replace_attr("device_clip", bf16_optimizer, "clip_tensors_by_global_norm", "ds_core_device_clip",
                        device_clip, say)


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


__all__ = ["use_flat_grad_norm", "use_group_norm_sentinel", "use_device_clip", "device_clip", "chunk_norms",
           "global_norm", "norm_dtype", "CHUNK"]
