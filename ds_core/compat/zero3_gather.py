"""ZeRO-3's coalesced parameter all-gather, made to wait for every parameter's collective on the CPU accelerator.

`Init._allgather_params_coalesced` is how ZeRO-3 gathers several whole parameters at once: the persistent (small)
parameters after every optimizer step, and `GatheredParameters` for saves and exports. It launches one async
all-gather per parameter. DeepSpeed 0.16 (Habana's fork) then waits for the last handle only ("Wait ensures the
operation is enqueued"): on a device whose collectives run in stream order (HPU, CUDA) the earlier ones are done by
then too, but gloo's handles on the CPU accelerator are independent, so an earlier parameter can be read before its
data arrived: uninitialized memory in a gathered weight (seen in one 2-rank ZeRO-3 run in three: a 128-element
parameter saved as garbage). 0.19 waits for every handle. Where the installed function waits for the last one only,
and only on the CPU accelerator, each parameter is gathered by a call of its own, whose one handle is the one waited
for. DeepSpeed has no setting for it, and a race has no cheap probe: the check reads the function's source
(ds_core.compat.deepspeed_behaviour.zero3_gather_waits_last_only).
"""
from __future__ import annotations

from typing import Any, Callable


def gather_per_param(deepspeeds: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed's coalesced all-gather called once per parameter (its last handle is then its only one)."""

    def _allgather_params_coalesced(self, param_list, hierarchy=0, quantize=False):
        for param in param_list:
            deepspeeds(self, [param], hierarchy, quantize)

    _allgather_params_coalesced.deepspeeds = deepspeeds
    return _allgather_params_coalesced


def use_gather_per_param(device_type: str, say: Callable[[str], None] | None = None) -> bool:
    """On the CPU accelerator, ZeRO-3's coalesced all-gather per parameter where the installed DeepSpeed waits for
    its last handle only (ds_core.compat.changes: zero3_gather_waits); True if it is installed (idempotent)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    from ds_core.compat.changes import BY_NAME, missing, say_off

    if getattr(Init._allgather_params_coalesced, "deepspeeds", None) is not None:
        return True
    if device_type != "cpu" or BY_NAME["zero3_gather_waits"].not_needed() is not None:
        return False
    if why := missing("zero3_gather_waits"):
        say_off("zero3_gather_waits", why, say)
        return False
    Init._allgather_params_coalesced = gather_per_param(Init._allgather_params_coalesced)
    return True


__all__ = ["gather_per_param", "use_gather_per_param"]
