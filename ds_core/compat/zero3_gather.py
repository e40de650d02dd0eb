"""ZeRO-3's coalesced parameter all-gather, made to wait for every parameter's collective on the CPU accelerator.

`Init._allgather_params_coalesced` is how ZeRO-3 gathers several whole parameters at once: the persistent (small)
parameters after every optimizer step, and `GatheredParameters` for saves and exports. It launches one async
all-gather per parameter. DeepSpeed 0.16 (Habana's fork) then waits for the last handle only ("Wait ensures the
operation is enqueued"): on a device whose collectives run in stream order (HPU, CUDA) the earlier ones are done by
then too, but gloo's handles on the CPU accelerator are independent, so an earlier parameter can be read before its
data arrived: uninitialized memory in a gathered weight (seen in one 2-rank ZeRO-3 run in three: a 128-element
parameter saved as garbage). 0.19 waits for every handle. Where the installed function waits for the last one only,
and only on the CPU accelerator, each parameter is gathered by a call of its own, whose one handle is the one waited
for. DeepSpeed has no setting for it. Whether the installed function waits for the last handle only is probed by calling
it on stand-in parameters whose collectives record their waits (ds_core.compat.deepspeed_behaviour.
zero3_gather_waits_last_only); the change is on only where its body is the one verified (its fingerprint).
"""
from __future__ import annotations

from typing import Any, Callable


def gather_per_param(deepspeeds: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed's coalesced all-gather called once per parameter (its last handle is then its only one)."""

    def _allgather_params_coalesced(self, param_list, hierarchy=0, quantize=False):
        for param in param_list:
            deepspeeds(self, [param], hierarchy, quantize)

    return _allgather_params_coalesced


def apply(ctx: Any) -> str | None:
    """Change zero3_gather_waits: on the CPU accelerator, ZeRO-3's coalesced all-gather per parameter (the installed
    DeepSpeed waits for its last handle only: ds_core.compat.changes decided it needs the fix)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    from ds_core.compat.marks import NotNeeded, replace

    if ctx.device_type != "cpu":
        return NotNeeded(f"{ctx.device_type} runs collectives in stream order: the last handle's wait covers all")
    replace(Init, "_allgather_params_coalesced", gather_per_param, "zero3_gather_waits")
    return None


__all__ = ["gather_per_param", "apply"]
