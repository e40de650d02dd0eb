"""After DeepSpeed loads a universal checkpoint (a resize, ds_core.checkpoint.resize), each parameter's view of its
fp32 master weights is that of the fp32 partition again, where the installed DeepSpeed leaves it elsewhere.

DeepSpeed 0.16's map_to_flat_opt_states (deepspeed/utils/tensor_fragment.py, called by the ZeRO-1/2 and bf16
optimizers' universal load) builds one flat buffer per optimizer state and, for each, points every parameter's
`_hp_mapping.hp_fragment` (its fp32 master weights) at that buffer: after the loop the fp32 view of every parameter
is its exp_avg_sq. Training is unaffected (the optimizer steps the flat fp32 partition, loaded right), but whatever
reads a parameter's fp32 value through the mapping reads the second moment: safe_get_full_fp32_param, so the fp32
export of the model (ds_core.outputs.results.save_model) and every check of the weights after a resize. 0.19 keeps
hp_fragment and points the state fragments at the buffers instead. Whether the installed DeepSpeed has the fault is
probed on a two-element stand-in (ds_core.compat.deepspeed_behaviour.universal_load_repoints_fp32); where it has,
`apply` links the mappings again the way the optimizer links them after its first step (its own
_link_all_hp_params and _lazy_init_hp_params_optimizer_state).
"""
from __future__ import annotations

from typing import Any


def apply(ctx: Any) -> str | None:
    """Change universal_load_links, after a checkpoint load: where the load went through the universal format, link
    every parameter's fp32 and optimizer-state fragments to the optimizer's flat partition and state again."""
    from ds_core.compat.marks import NotNeeded

    if not ctx.universal:
        return NotNeeded("this load was not from the universal format")
    opt = getattr(ctx.engine, "optimizer", None)
    if not hasattr(opt, "_hp_optimizer_states_linked"):  # ZeRO-3 / no wrapper: not loaded through that function
        return NotNeeded(f"{type(opt).__name__} is not loaded through map_to_flat_opt_states")
    opt._link_all_hp_params()
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()
    return None


__all__ = ["apply"]
