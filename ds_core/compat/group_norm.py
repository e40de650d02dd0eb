"""ZeRO-1/2's global gradient norm made inf where a parameter group's norm is non-finite, as DeepSpeed 0.19 makes it.

DeepSpeedZeroOptimizer.scaled_global_norm combines the norms of its parameter groups (each from
get_grad_norm_direct, which masks a non-finite norm as -1). Before 0.19's combine_grad_norm_groups (Habana's fork,
0.16.1) it takes a plain vector norm of them: a group whose norm is non-finite yields a finite global norm (sqrt of
the others' squares plus 1), so the update is applied with NaN gradients and a norm that looks healthy, and a
checkpoint of NaN weights is saved. On every device, Gaudi's included. Change nonfinite_group_norm (stage
after_initialize; its gate: the fork's body of the method, by fingerprint; 0.19's body has the fix) replaces the
method on the engine's optimizer instance: the combined norm is the float32 vector norm of the groups' float32 norms,
as DeepSpeed's, replaced by inf when any group's is non-finite or negative, as 0.19 returns it; the divergence guard
then stops the run at that step (ds_core.run.divergence). CPU offload and MoE keep DeepSpeed's own method.
"""
from __future__ import annotations

from typing import Any

import torch

from ds_core.compat.gates import APPLIED, Outcome, not_needed
from ds_core.compat.marks import replace


def apply(ctx: Any) -> Outcome:
    """Change nonfinite_group_norm on the engine's DeepSpeedZeroOptimizer (ds_core.compat.changes.apply_stage)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = getattr(ctx.engine, "optimizer", None)
    if not isinstance(opt, DeepSpeedZeroOptimizer) or opt.cpu_offload or opt.has_moe_layers:
        return not_needed(f"this run's optimizer wrapper is {type(opt).__name__} without the combined group norm "
                          f"(DeepSpeedZeroOptimizer without CPU offload or MoE)")

    def make(deepspeeds):
        def scaled_global_norm(norm_type=2):
            assert norm_type == 2, "only L2 norm supported"
            norms = torch.stack([opt.get_grad_norm_direct(opt.averaged_gradients[i], opt.params_in_partition[i])
                                 for i in range(len(opt.bit16_groups))])
            combined = torch.linalg.vector_norm(norms, ord=norm_type)
            invalid = (~torch.isfinite(norms) | (norms < 0)).any()
            return torch.where(invalid, torch.full_like(combined, float("inf")), combined)
        return scaled_global_norm

    replace(opt, "scaled_global_norm", make, "nonfinite_group_norm")
    return APPLIED


__all__ = ["apply"]
