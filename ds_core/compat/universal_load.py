"""After DeepSpeed loads a universal checkpoint (a resize, ds_core.checkpoint.resize), each parameter's view of its
fp32 master weights is that of the fp32 partition again, where the installed DeepSpeed leaves it elsewhere.

DeepSpeed 0.16's map_to_flat_opt_states (deepspeed/utils/tensor_fragment.py, called by the ZeRO-1/2 and bf16
optimizers' universal load) builds one flat buffer per optimizer state and, for each, points every parameter's
`_hp_mapping.hp_fragment` (its fp32 master weights) at that buffer: after the loop the fp32 view of every parameter
is its exp_avg_sq. Training is unaffected (the optimizer steps the flat fp32 partition, loaded right), but whatever
reads a parameter's fp32 value through the mapping reads the second moment: safe_get_full_fp32_param, so the fp32
export of the model (ds_core.outputs.results.save_model) and every check of the weights after a resize. 0.19 keeps
hp_fragment and points the state fragments at the buffers instead. The change's gate is the fingerprint of the
installed map_to_flat_opt_states (the fork's: applied; 0.19.8's: not needed; the fault itself is probed on a
two-element stand-in by ds_core.compat.deepspeed_behaviour.universal_load_repoints_fp32); where it applies,
`apply` links the mappings again the way the optimizer links them after its first step (its own
_link_all_hp_params and _lazy_init_hp_params_optimizer_state).
"""
from __future__ import annotations

from typing import Any

from ds_core.compat.gates import APPLIED, Outcome, not_needed, refused

LINKS = ("_link_all_hp_params", "_lazy_init_hp_params_optimizer_state")  # the optimizer's own, called as it calls them


def apply(ctx: Any) -> Outcome:
    """Change universal_load_links, after a checkpoint load: where the load went through the universal format, link
    every parameter's fp32 and optimizer-state fragments to the optimizer's flat partition and state again."""
    if not ctx.universal:
        return not_needed("this load was not from the universal format")
    opt = getattr(ctx.engine, "optimizer", None)
    if not hasattr(opt, "_hp_optimizer_states_linked"):  # ZeRO-3 / no wrapper: not loaded through that function
        return not_needed(f"{type(opt).__name__} is not loaded through map_to_flat_opt_states")
    if lacks := [n for n in LINKS if not callable(getattr(opt, n, None))]:
        return refused(f"{type(opt).__name__} of this DeepSpeed has no {', '.join(lacks)}")
    opt._link_all_hp_params()
    opt._hp_optimizer_states_linked = False
    opt._lazy_init_hp_params_optimizer_state()
    return APPLIED


__all__ = ["apply", "LINKS"]
