"""Where the step time goes: sampled phase timing of optimizer steps, measured in every run.

Every `every`-th optimizer step (TrainConfig.phase_timing_every) of a run is split into

  data_s      waiting for the data source (next(batch)), summed over the step's micro-steps
  forward_s   the model's step function (forward and loss) minus its exposed collectives (ZeRO-3 all-gathers)
  backward_s  engine.backward minus the exposed collectives it issued: backward compute, plus any reduction that
              overlapped with it (DeepSpeed's overlap_comm side stream is not on the compute stream, so it is not
              subtracted)
  comm_s      exposed communication: time of DeepSpeed's collectives (deepspeed.comm: gradient all-reduce /
              reduce-scatter, ZeRO parameter all-gather) issued inside forward, backward and step, on the compute
              stream, minus the part of it spent waiting for the slowest rank
  step_s      engine.step minus its exposed collectives (optimizer update, clipping, norm)
  wait_s      waiting for other ranks inside the collectives: per collective, this rank's duration minus the
              shortest over the ranks (the last to arrive waited for nobody), summed (`split_wait`); taken out of
              comm_s. Beyond MAX_COLLECTIVES per step (ZeRO-3) or unequal counts: max over ranks of their busy time
              (the step minus its collectives) minus this rank's own
  slowest_rank  the rank with the largest busy time

How it is measured, and why it costs little:
  * Boundaries are accelerator events (DeepSpeed's accelerator API: get_accelerator().Event(enable_timing=True),
    recorded on the current stream) on CUDA/HPU; on the CPU accelerator, whose Event is None and whose work is
    synchronous, the host clock. Events are only created on sampled steps.
  * No host sync on any step: a sampled step's events are read one optimizer step later (`collect` at the next
    boundary), when they have long completed; on CPU the values are ready at once.
  * Per-rank figures meet in ONE small all_gather (7 + MAX_COLLECTIVES float64 per rank, float32 on an HPU: the
    phases and each collective's duration) on the boundary where a sample is read,
    i.e. every `every`-th step only; every rank decides sampling from the step number alone, so all take part.
  * Collectives are timed through the wrappers change comm_phase_timing puts on deepspeed.comm's backend object
    (ds_core.compat.comm_timing); the wrapper is a flag test outside sampled steps.

Limits: past MAX_COLLECTIVES per step, per-rank totals approximate the wait (a rank ahead at one collective and
behind at the next counts only the difference of its totals); a collective on a side stream (overlap_comm on GPU)
is counted only where the compute stream waits for it.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ds_core.device import hpu

PHASES = ("data", "forward", "backward", "step")
FIELDS = ("data_s", "forward_s", "backward_s", "comm_s", "step_s", "wait_s")
MAX_COLLECTIVES = 64       # per sampled step, timed one by one (ZeRO-3 issues more: its wait falls back to totals)


class _Sample:
    """The marks of one sampled optimizer step: per phase a list of (start, end) marks, and the collectives'."""

    def __init__(self, step: int):
        self.step = step
        self.spans: dict[str, list] = {p: [] for p in PHASES}
        self.comm: dict[str, list] = {"forward": [], "backward": [], "step": []}   # ZeRO-3 gathers in forward


class PhaseTimer:
    """Times the phases of every `every`-th optimizer step (0: never). The loop calls, per micro-step:
    `begin(name)` / `end(name)` around next(batch) ("data"), the step function ("forward"), engine.backward
    ("backward") and engine.step ("step"), and `boundary(step)` once per optimizer step after engine.step; that
    returns the phase fields of the most recently read sample (or None). Every rank must call it on every step."""

    def __init__(self, every: int, *, rank: int = 0, world_size: int = 1, device: torch.device | None = None,
                 clock: Callable[[], float] = time.perf_counter, accelerator: Any = None):
        if every < 0:
            raise ValueError(f"phase timing: every = {every}: expected 0 (off) or a positive number of steps")
        self.every, self.rank, self.world_size = every, rank, world_size
        self.device = device or torch.device("cpu")
        self.dtype = hpu.sum_dtype(self.device.type)  # float64, or float32 on an HPU (no float64 there, nor in HCCL)
        self.clock = clock
        if accelerator is None:
            from deepspeed.accelerator import get_accelerator

            accelerator = get_accelerator()
        event = getattr(accelerator, "Event", None)
        # the CPU accelerator has no events (Event is None) and runs synchronously: the host clock is exact there
        self._event_cls = event if event is not None and accelerator.device_name() != "cpu" else None
        self.next_step = 1           # the optimizer step the coming micro-steps belong to
        self._cur: _Sample | None = None
        self._pending: _Sample | None = None
        self._open: dict[str, Any] = {}
        self._phase: str | None = None
        self.samples: list[dict] = []     # every read sample's fields (rank-local view + wait), in step order
        self.last: dict | None = None
        self._wrapped = False
        # host seconds spent in this timer's own code (marks, wrapper, reading, the all_gather): its overhead,
        # reported in the summary as phase_timing_overhead_s
        self.overhead_s = 0.0

    # -- marks ----------------------------------------------------------------------------------------------------
    def sampled(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def _mark(self) -> Any:
        if self._event_cls is None:
            return self.clock()
        ev = self._event_cls(enable_timing=True)
        ev.record()
        return ev

    def _elapsed(self, a: Any, b: Any) -> float:
        if self._event_cls is None:
            return b - a
        return a.elapsed_time(b) / 1000.0      # torch/hpu events: milliseconds

    def begin(self, phase: str) -> None:
        if self._cur is None:
            if not self.sampled(self.next_step):
                return
            self._cur = _Sample(self.next_step)
            self._install_comm_timing()
        t = time.perf_counter()
        self._open[phase] = self._mark()
        self._phase = phase
        self.overhead_s += time.perf_counter() - t

    def end(self, phase: str) -> None:
        if self._cur is None or phase not in self._open:
            return
        t = time.perf_counter()
        self._cur.spans[phase].append((self._open.pop(phase), self._mark()))
        self._phase = None
        self.overhead_s += time.perf_counter() - t

    def boundary(self, step: int) -> dict | None:
        """After engine.step() of optimizer step `step`: read the previous sample (all ranks gather), keep this one."""
        self.next_step = step + 1
        done, self._cur = self._cur, None
        if self._pending is not None:
            self._read(self._pending)
            self._pending = None
        if done is not None:
            if self._event_cls is None:
                self._read(done)             # host clock: ready now, no reason to wait a step
            else:
                self._pending = done         # events: read at the next boundary, when they have completed
        return self.last

    def finish(self) -> dict | None:
        """At the end of training (every rank): read a sample still pending."""
        if self._pending is not None:
            self._read(self._pending)
            self._pending = None
        return self.last

    # -- communication --------------------------------------------------------------------------------------------
    def _install_comm_timing(self) -> None:
        """Listen to deepspeed.comm's collectives where change comm_phase_timing wrapped them (ds_core.compat.
        changes, stage after_initialize); where it is off, no collective is timed (comm_s and wait_s stay 0)."""
        if self._wrapped:
            return
        from ds_core.compat import changes, comm_timing

        if changes.is_on("comm_phase_timing"):
            comm_timing.listen(self._around)
        self._wrapped = True

    def _around(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        cur, phase = self._cur, self._phase
        if cur is None or phase not in cur.comm:
            return fn(*args, **kwargs)
        t = time.perf_counter()
        t0 = self._mark()
        t1 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t2 = time.perf_counter()
            cur.comm[phase].append((t0, self._mark()))
            self.overhead_s += (t1 - t) + (time.perf_counter() - t2)

    # -- reading ---------------------------------------------------------------------------------------------------
    def _read(self, s: _Sample) -> None:
        t_read = time.perf_counter()
        try:
            self._read_sample(s)
        finally:
            self.overhead_s += time.perf_counter() - t_read

    def _read_sample(self, s: _Sample) -> None:
        if self._event_cls is not None:
            for spans in list(s.spans.values()) + list(s.comm.values()):
                if spans:
                    spans[-1][1].synchronize()     # completed a step ago: returns at once
        tot = {p: sum(self._elapsed(a, b) for a, b in s.spans[p]) for p in PHASES}
        comm = {p: sum(self._elapsed(a, b) for a, b in s.comm[p]) for p in s.comm}
        comm_all = sum(comm.values())
        busy = sum(tot.values()) - comm_all
        # each collective's own duration, in the order issued (the same on every rank: data parallelism)
        durs = [self._elapsed(a, b) for p in ("forward", "backward", "step") for a, b in s.comm[p]]
        mine = [tot["data"], tot["forward"] - comm["forward"], tot["backward"] - comm["backward"],
                tot["step"] - comm["step"], comm_all, busy, float(len(durs))]
        mine += durs[:MAX_COLLECTIVES] + [0.0] * (MAX_COLLECTIVES - min(len(durs), MAX_COLLECTIVES))
        rows = [mine]
        import torch.distributed as tdist

        if self.world_size > 1 and tdist.is_initialized():
            t = torch.tensor(mine, dtype=self.dtype, device=self.device)
            out = [torch.empty_like(t) for _ in range(self.world_size)]
            tdist.all_gather(out, t)           # the one extra small collective, on sampled steps only
            rows = [o.tolist() for o in out]
        wait, slowest, wait_max = split_wait(rows, self.rank if len(rows) > 1 else 0)
        rec = {"step": s.step, "data_s": mine[0], "forward_s": mine[1], "backward_s": mine[2],
               "comm_s": comm_all - wait, "step_s": mine[3], "wait_s": wait, "slowest_rank": slowest,
               "wait_max_s": wait_max}
        self.samples.append(rec)
        self.last = rec


def split_wait(rows: list[list[float]], me: int = 0) -> tuple[float, int, float]:
    """(this rank's wait, the slowest rank, the largest wait of any rank) from every rank's row
    [data, forward, backward, step, comm_all, busy, n, d_1 .. d_MAX_COLLECTIVES] (`me`: this rank's row; rows as
    all_gather orders them, so rank r is row r).

    Per collective: the rank that arrived last waited for nobody, so the shortest duration over the ranks is the
    collective's own time and each rank's excess over it is waiting; wait = comm_all minus the sum of those minima.
    This catches skew that alternates (a rank early at one collective and late at the next), which per-rank totals
    cancel out. Where the ranks issued different numbers of collectives, or more than MAX_COLLECTIVES (ZeRO-3's
    gathers), the totals: max busy minus own busy."""
    busies = [r[5] for r in rows]
    slowest = max(range(len(rows)), key=lambda i: busies[i])
    counts = {int(r[6]) for r in rows}
    if len(counts) == 1 and 0 < next(iter(counts)) <= MAX_COLLECTIVES:
        n = counts.pop()
        own = sum(min(r[7 + k] for r in rows) for k in range(n))
        waits = [min(max(0.0, r[4] - own), r[4]) for r in rows]
    else:
        waits = [min(max(0.0, busies[slowest] - r[5]), r[4]) for r in rows]
    return waits[me], slowest, max(waits)


def record_fields(sample: dict | None) -> dict:
    """The fields a step record carries: phase_<name>_s of the latest sample, its step and the slowest rank."""
    if not sample:
        return {}
    out = {f"phase_{k}": sample[k] for k in FIELDS}
    out.update(phase_step=sample["step"], phase_slowest_rank=sample["slowest_rank"])
    return out


def summary_fields(samples: list[dict], first_step: int = 0, overhead_s: float | None = None) -> dict:
    """Summary: the mean of each phase over the samples after `first_step` (warm-up excluded when possible), their
    count, and each phase's share of the sampled step time."""
    use = [s for s in samples if s["step"] > first_step] or list(samples)
    if not use:
        return {}
    mean = {k: sum(s[k] for s in use) / len(use) for k in FIELDS}
    total = sum(mean.values())
    out = {f"phase_{k}": v for k, v in mean.items()}
    out["phase_sampled_steps"] = len(use)
    if overhead_s is not None:
        out["phase_timing_overhead_s"] = overhead_s       # this rank's, over the whole run (warm-up included)
    out["phase_frac"] = {k[:-2]: (v / total if total > 0 else None) for k, v in mean.items()}
    return out


def console_line(fields: dict) -> str:
    """'data 1% | forward 30% | ...' from summary_fields, for the console summary line."""
    frac = fields.get("phase_frac") or {}
    return " | ".join(f"{k} {100 * v:.0f}%" for k, v in frac.items() if v is not None)
