"""ZeRO-3's coalesced parameter all-gather, made to wait for every parameter's collective on the CPU accelerator.

A fork-on-CPU-only fix (fork_cpu_only in ds_core.compat.changes): it exists because Habana's fork misbehaves on
DeepSpeed's CPU accelerator (gloo), where this toolkit's tests run; on a Gaudi the collectives run in stream order,
no Gaudi user meets the fault, and the change is not applied there.

`Init._allgather_params_coalesced` is how ZeRO-3 gathers several whole parameters at once: the persistent (small)
parameters after every optimizer step, and `GatheredParameters` for saves and exports. It launches one async
all-gather per parameter. DeepSpeed 0.16 (Habana's fork) then waits for the last handle only ("Wait ensures the
operation is enqueued"): on a device whose collectives run in stream order (HPU, CUDA) the earlier ones are done by
then too, but gloo's handles on the CPU accelerator are independent, so an earlier parameter can be read before its
data arrived: uninitialized memory in a gathered weight (seen in one 2-rank ZeRO-3 run in three: a 128-element
parameter saved as garbage). 0.19 waits for every handle. Where the installed function waits for the last one only,
and only on the CPU accelerator, each parameter is gathered by a call of its own, whose one handle is the one waited
for. DeepSpeed has no setting for it. Its gate is the body's fingerprint (the fork's applies it, 0.19.8's has the
fix); that the fork's waits for the last handle only is probed by calling it on stand-in parameters whose
collectives record their waits (ds_core.compat.deepspeed_behaviour.zero3_gather_waits_last_only).
"""
from __future__ import annotations

from typing import Any, Callable

from ds_core.compat.gates import APPLIED, Outcome, not_needed
from ds_core.compat.marks import replace


def gather_per_param(deepspeeds: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed's coalesced all-gather called once per parameter (its last handle is then its only one)."""

    def _allgather_params_coalesced(self, param_list, hierarchy=0, quantize=False):
        for param in param_list:
            deepspeeds(self, [param], hierarchy, quantize)

    return _allgather_params_coalesced


def apply(ctx: Any) -> Outcome:
    """Change zero3_gather_waits: on the CPU accelerator, ZeRO-3's coalesced all-gather per parameter (its gate found
    the fork's body, which waits for its last handle only)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    if ctx.device_type != "cpu":
        return not_needed(f"{ctx.device_type} runs collectives in stream order: the last handle's wait covers all")
    replace(Init, "_allgather_params_coalesced", gather_per_param, "zero3_gather_waits")
    return APPLIED


__all__ = ["gather_per_param", "apply"]
