"""BF16_Optimizer's per-parameter gradient hook as one in-place add: two aten ops instead of five.

DeepSpeed 0.19's BF16_Optimizer (bf16 ZeRO-1 with "data_types": {"grad_accum_dtype": "fp32"}: the BERT and
BridgeTower JSONs) adds each parameter's bf16 gradient into its fp32 view of the flat gradient buffer the moment
autograd produces it (`immediate_grad_update`, a hook per parameter, every micro batch):
`hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype).view(hp_grad.shape))` dispatches five aten ops (two `.data`
detaches, an fp32 copy of the gradient, a view, the add) and runs two kernels on an accelerator, the copy with an
allocation of its own. `hp_grad.add_(lp.grad.view(hp_grad.shape))` is the same sum: an in-place add promotes the
bf16 operand to the fp32 destination's dtype element by element (exact), then adds in fp32, as the copy did; two
ops, one kernel, no temporary. Per micro batch that is ~3,100 host ops fewer for BridgeTower-Large's 1,036 tensors
and ~1,200 for BERT-Large's 398. DeepSpeed has no setting for it, so the method is replaced on the optimizer
instance; where the hook has more to do (the AutoEP folding correction) DeepSpeed's own method stays. Only on CUDA
and the CPU, where the in-place mixed-dtype add is tested against DeepSpeed's copy-then-add bit for bit
(tests/test_flat_norm.py on the real engine; tests/test_gpu_train.py on CUDA); HPU keeps DeepSpeed's hook.
Applied by ds_core.compat.changes (stage after_initialize) only where DeepSpeed's _update_hp_grad is a body it was
verified against (its fingerprint, per tested release: 0.19.8 and Habana's fork 0.16.1); any other body keeps
DeepSpeed's own hook, with one line.
"""
from __future__ import annotations

from typing import Any

from ds_core.compat.gates import APPLIED, Outcome, not_needed, refused
from ds_core.compat.marks import replace

DEVICES = ("cuda", "cpu")


def apply(ctx: Any) -> Outcome:
    """Change one_op_grad_hook on the engine's BF16_Optimizer (ds_core.compat.changes.apply_stage)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    opt = getattr(ctx.engine, "optimizer", None)
    if not isinstance(opt, BF16_Optimizer):
        return not_needed(f"this run's optimizer wrapper is {type(opt).__name__}, not BF16_Optimizer")
    if ctx.device_type not in DEVICES:
        return not_needed(f"on {ctx.device_type} DeepSpeed's own hook runs (tested bit for bit on "
                          f"{', '.join(DEVICES)})")
    if getattr(opt, "autoep_folding_tp_group", None) is not None:
        return not_needed("the AutoEP folding correction: DeepSpeed's own hook")
    lacks = [a for a in ("fp32_groups_gradients", "fp32_groups_has_gradients") if not hasattr(opt, a)]
    if lacks:
        return refused(f"BF16_Optimizer has no {', '.join(lacks)}")

    def make(deepspeeds: Any) -> Any:
        def _update_hp_grad(lp, group_idx, param_idx, clear_lp_grads):
            if lp.grad is None:
                return
            hp_grad = opt.fp32_groups_gradients[group_idx][param_idx]  # a 1-D view of the flat fp32 buffer
            hp_grad.add_(lp.grad.view(hp_grad.shape))
            lp._hp_grad = hp_grad
            opt.fp32_groups_has_gradients[group_idx][param_idx] = True
            if clear_lp_grads:
                lp.grad.zero_()
        return _update_hp_grad

    replace(opt, "_update_hp_grad", make, "one_op_grad_hook")
    return APPLIED


__all__ = ["apply", "DEVICES"]
