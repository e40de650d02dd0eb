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


def stack_segments(lost: dict) -> list[tuple[str, float, float]]:
    """(bucket, bottom, height) of one stacked bar whose parts sum to its total: the parts that grew stacked up from
    zero, then the parts that shrank stacked down from that top, so the bar ends at the total (a shrinking part is
    drawn inside the bar it takes back from, never below zero where the total is positive)."""
    segs, top = [], 0.0
    for k in BUCKETS:
        if lost[k] > 0:
            segs.append((k, top, lost[k]))
            top += lost[k]
    for k in BUCKETS:
        if lost[k] < 0:
            segs.append((k, top, lost[k]))
            top += lost[k]
    return segs


def plot_lost(ax, bars: list[tuple[str, dict]]) -> None:
    """Stacked bars, one per (label, lost_points result): the points of efficiency lost to each part of the step;
    a shrinking part hatched, a black tick and the number at the total."""
    seen = set()
    for x, (label, lost) in enumerate(bars):
        for k, bottom, height in stack_segments(lost):
            j = BUCKETS.index(k)
            ax.bar(x, height, bottom=bottom, color=f"C{j}", hatch="//" if height < 0 else None,
                   edgecolor="black" if height < 0 else None, linewidth=0.5,
                   label=None if k in seen else BUCKET_TITLES[k])
            seen.add(k)
        ax.plot([x - 0.45, x + 0.45], [lost["total"]] * 2, color="black", lw=1.5)
        ax.annotate(f"{lost['total']:.1f}", (x + 0.46, lost["total"]), ha="left", va="center", fontsize=7)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_xlim(-0.6, len(bars) - 0.2)     # room for the totals written right of their bars
    tops = [max([0.0] + [max(b, b + h) for _, b, h in stack_segments(lost)]) for _, lost in bars]
    lows = [min([0.0] + [min(b, b + h) for _, b, h in stack_segments(lost)]) for _, lost in bars]
    if bars:
        ax.set_ylim(min(lows) * 1.1, max(tops) * 1.25 + 1)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("accelerators")
    ax.set_ylabel("efficiency points lost vs baseline")
    ax.set_title("What grew (hatched: shrank; black line: total = 100 - efficiency)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    if bars:
        ax.legend(fontsize=7)
