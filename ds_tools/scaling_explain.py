"""Where the scaling efficiency went: per larger run, the points of efficiency lost to each phase of the step.

Reads the sampled phase timing each run writes into its metrics.jsonl summary (ds_core.outputs.phases: ``phase_data_s``,
``phase_forward_s``, ``phase_backward_s``, ``phase_comm_s``, ``phase_step_s``, ``phase_wait_s``). The split is exact,
not a fit: with t the time one accelerator spends per sample (accelerators / sequences per second) and t_k its part in
phase k (t times phase k's share of the sampled step),

    efficiency  e = t_base / t_run            (per-accelerator throughput ratio, as in the efficiency table)
    1 - e        = (t_run - t_base) / t_run = sum_k (t_run,k - t_base,k) / t_run

so 100 (t_run,k - t_base,k) / t_run is the points of efficiency phase k cost, and the parts add up to the points
lost. A negative part is a phase that shrank (e.g. less data wait with more readers). Buckets:

    comm   exposed gradient/parameter communication (phase_comm_s)
    wait   waiting for the slowest rank (phase_wait_s)
    data   waiting for the input pipeline (phase_data_s)
    other  forward + backward + optimizer step (phase_forward_s + phase_backward_s + phase_step_s); for a run, or a
           baseline, without phase timing the whole loss is here and the row says ``phase timing: no``
"""
from __future__ import annotations

from typing import Any

PHASE_KEYS = ("phase_data_s", "phase_forward_s", "phase_backward_s", "phase_comm_s", "phase_step_s", "phase_wait_s")
BUCKETS = ("comm", "wait", "data", "other")
BUCKET_TITLES = {"comm": "communication", "wait": "slowest rank", "data": "data", "other": "anything else"}


def phases_of(summary: dict) -> dict | None:
    """The phase seconds of a summary record, or None when the run has no (usable) phase timing."""
    vals = {}
    for k in PHASE_KEYS:
        v = summary.get(k)
        if not isinstance(v, (int, float)) or v < 0:
            return None
        vals[k] = float(v)
    return vals if sum(vals.values()) > 0 else None


def _split(time_per_sample: float, phases: dict | None) -> dict:
    """time per sample per accelerator split into the buckets by the sampled phase shares."""
    if phases is None:
        return {"comm": 0.0, "wait": 0.0, "data": 0.0, "other": time_per_sample}
    total = sum(phases.values())
    share = {"comm": phases["phase_comm_s"], "wait": phases["phase_wait_s"], "data": phases["phase_data_s"],
             "other": phases["phase_forward_s"] + phases["phase_backward_s"] + phases["phase_step_s"]}
    return {k: time_per_sample * v / total for k, v in share.items()}


def lost_points(base_acc: int, base_thr: float, base_phases: dict | None,
                run_acc: int, run_thr: float, run_phases: dict | None) -> dict[str, Any]:
    """Points of efficiency lost per bucket between the baseline and a run (they add up to 100 (1 - efficiency))."""
    t_base, t_run = base_acc / base_thr, run_acc / run_thr
    timed = base_phases is not None and run_phases is not None
    b = _split(t_base, base_phases if timed else None)
    r = _split(t_run, run_phases if timed else None)
    out: dict[str, Any] = {k: 100.0 * (r[k] - b[k]) / t_run for k in BUCKETS}
    out["total"] = 100.0 * (t_run - t_base) / t_run
    out["timed"] = timed
    return out
