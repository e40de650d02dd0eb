"""Change comm_phase_timing: each of deepspeed.comm's collectives goes through a wrapper that a listener (the phase
timer of ds_core.outputs.phases) can time; with no listener, or outside its sampled steps, the wrapper is one test and
DeepSpeed's own call.

deepspeed.comm's functions call the methods of its backend object `cdb` (deepspeed.comm.comm.cdb, set by
init_distributed); DeepSpeed has no hook around them (its comms logger times calls only where its own config turns it
on, and synchronizes the device to do so), so each method of COLLECTIVES is wrapped once on the backend object.
"""
from __future__ import annotations

from typing import Any, Callable

from ds_core.compat.gates import APPLIED, Outcome, not_needed
from ds_core.compat.marks import replace

# deepspeed.comm backend methods that move data between ranks (comm/comm.py calls cdb.<name>)
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "inference_all_reduce", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "broadcast",
               "all_to_all_single", "gather", "scatter")
# the one listener: around(fn, args, kwargs) -> fn's result; None: no timing
_listener: list[Callable[[Callable, tuple, dict], Any] | None] = [None]


def listen(around: Callable[[Callable, tuple, dict], Any] | None) -> None:
    """Route every wrapped collective through `around(fn, args, kwargs)` (None: straight to DeepSpeed's)."""
    _listener[0] = around


def timed(fn: Callable) -> Callable:
    def collective(*args: Any, **kwargs: Any) -> Any:
        around = _listener[0]
        if around is None:
            return fn(*args, **kwargs)
        return around(fn, args, kwargs)

    return collective


def apply(ctx: Any) -> Outcome:
    import deepspeed.comm.comm as dcomm

    cdb = getattr(dcomm, "cdb", None)
    if cdb is None:
        return not_needed("deepspeed.comm has no backend yet (init_distributed not called)")
    for name in COLLECTIVES:
        if getattr(cdb, name, None) is not None:
            replace(cdb, name, timed, "comm_phase_timing")
    return APPLIED


__all__ = ["COLLECTIVES", "listen", "timed", "apply"]
