"""The one clock: throughput, TFLOPs and MFU, with warm-up steps excluded (optimum-habana's throughput_warmup_steps).

Model packages report counts (samples, tokens) and their training FLOPs per sample; only this module turns them into
rates. Rank 0 writes run_dir/metrics.jsonl: a "step" record per log step, "eval" records, and one final "summary"
record that scaling reports read.
"""
from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ds_core import log
from ds_core.device import accelerators, hpu
from ds_core.device.accelerators import from_device_name
from ds_core.device.precision import cached_cpu_peak, cpu_peak_tflops, update_cpu_peak

# The end-of-run CPU peak re-probe takes ~0.5 s in fp32 and several seconds in emulated bf16: worth it only for a run
# whose timed window is long against that (under 1-5 % of it); a shorter run keeps the cached start-up figure.
REPROBE_MIN_S = 60.0


def accelerator_kind(accelerator: str, device: torch.device | None = None) -> str:
    """Row of ds_core.device.accelerators for the running device; otherwise the accelerator type ("cuda", "hpu", "cpu"),
    which has no peak, so MFU is null rather than taken against another device's figure."""
    if accelerator == "cuda" and torch.cuda.is_available():
        return from_device_name(torch.cuda.get_device_name(device)) or "cuda"
    if accelerator == "hpu":
        # the generation the bridge names (ds_core.device.hpu, where the media pipe decision reads it too)
        return hpu.device_generation() or "gaudi"
    return accelerator


def peak_tflops_for(kind: str, dtype: str = "bf16") -> float | None:
    """The dense peak MFU is taken against: DS_CORE_PEAK_TFLOPS, ds_core.device.accelerators' row for `kind` in the
    dtype the run computes in, or on CPU the cached probe in `dtype`. None (no MFU) for a device or dtype without a
    published figure."""
    if os.environ.get("DS_CORE_PEAK_TFLOPS"):
        return float(os.environ["DS_CORE_PEAK_TFLOPS"])
    if kind == "cpu":
        return cached_cpu_peak(dtype)
    try:
        return accelerators.get(kind).peak_tflops(dtype)
    except accelerators.UnknownAcceleratorError:
        return None


def peak_probe_for(kind: str, dtype: str = "bf16") -> Callable[[], float] | None:
    """The re-probe used at the end of a run where the peak is measured (CPU without an override), else None.
    The better probe also goes into the per-machine cache, so a start-up probe that read low is not kept."""
    if kind != "cpu" or os.environ.get("DS_CORE_PEAK_TFLOPS"):
        return None

    def probe() -> float:
        value = cpu_peak_tflops(dtype)
        update_cpu_peak(dtype, value)
        return value

    return probe


def peak_memory_bytes(accelerator: str) -> int:
    """Peak memory of this rank: the accelerator allocator's peak (CUDA/HPU, through DeepSpeed's accelerator API), or
    the process's peak RSS on CPU (ru_maxrss: the kernel's high-water mark, not a sample)."""
    if accelerator != "cpu":
        from deepspeed.accelerator import get_accelerator

        return int(get_accelerator().max_memory_allocated())
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def _num(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


@dataclass(frozen=True)
class RunInfo:
    """What a run's metrics records say about the run (the static part of every record and the summary)."""

    model: str
    world_size: int
    nodes: int
    accelerators_per_node: int
    accelerator: str  # a row of ds_core.device.accelerators, or "cpu" / "cuda" / "hpu"
    micro_batch: int
    grad_accum: int
    zero_stage: int
    precision: str
    flops_per_sample: float
    seq_len: int = 0
    warmup_steps: int = 3  # optimizer steps excluded from throughput
    log_every: int = 1
    total_steps: int | None = None  # the progress bar's end
    peak_tflops: float | None = None
    precision_note: str | None = None



def last_summary(path: str | os.PathLike) -> dict | None:
    """The last {"type": "summary"} record of a metrics.jsonl, or None (missing, unfinished; a torn line is skipped)."""
    path = Path(path)
    summary = None
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("type") == "summary":
                summary = rec
    return summary

class Metrics:
    """Counts optimizer steps and their samples; turns them into rates over the post-warm-up window.

    The window holds training steps only: time inside `timed("checkpoint")` / `timed("eval")` is subtracted from it
    and reported as `checkpoint_s` / `eval_s` (in the step record of the step where it happened, and summed in the
    summary), and the window closes at the end of the last step (`end_training`), before the final save, eval or
    export (optimum-habana subtracts eval and save time from its throughput the same way).
    `clock` is injectable so tests can drive time. Only rank 0 writes files, feeds the monitor and prints; every rank
    keeps the same counts (the loop passes global counts).
    """

    def __init__(self, run_dir: str | os.PathLike, info: RunInfo, *, rank: int, start_step: int = 0,
                 clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None,
                 monitor: Any = None, progress_bar: bool = True, peak_probe: Callable[[], float] | None = None,
                 console: bool = True):
        world_size, warmup_steps, peak_tflops = info.world_size, info.warmup_steps, info.peak_tflops
        flops_per_sample, log_every = info.flops_per_sample, info.log_every
        self.rank, self.world_size = rank, world_size
        self.static = dict(model=info.model, world_size=world_size, nodes=info.nodes,
                           accelerators_per_node=info.accelerators_per_node, accelerator=info.accelerator,
                           micro_batch=info.micro_batch, grad_accum=info.grad_accum,
                           global_batch=info.micro_batch * info.grad_accum * world_size, zero_stage=info.zero_stage,
                           precision=info.precision, seq_len=info.seq_len, warmup_steps_excluded=warmup_steps,
                           flops_per_sample=flops_per_sample, peak_tflops_per_accelerator=peak_tflops)
        if info.precision_note:
            self.static["precision_note"] = info.precision_note
        self.flops_per_sample = flops_per_sample
        self.peak = peak_tflops
        # A measured peak (CPU) is probed again at the end of a run whose timed window lasted REPROBE_MIN_S or more,
        # and the better probe kept: a probe that landed in a busy moment would otherwise read low and inflate MFU.
        self.peak_probe = peak_probe
        self.warmup = warmup_steps
        self.log_every = log_every
        self.clock, self.sync = clock, sync or (lambda: None)
        self.monitor = monitor if rank == 0 else None
        self.console = console and rank == 0
        self.start_step = start_step  # steps done before this process (resume): warm-up counts from here
        self.steps = 0  # optimizer steps seen by this process
        self.t_window = None  # training time at the end of the last warm-up step
        self.t_close = None  # training time at the end of the last step (end_training)
        self.window_samples = self.window_tokens = 0
        self.last_log = None  # (training time, samples, tokens) at the previous log, inside the window
        self.last_loss = None
        self.last_step = 0
        # Trainer's figures (ds_core.outputs.hf_trainer): samples and the loss sum of every step, and the loop's
        # wall span
        self.samples_total, self.loss_sum, self.loss_steps = 0, 0.0, 0
        self.t_begin, self.runtime = None, 0.0
        self.excluded = 0.0  # seconds spent in timed() sections: not training time
        self.section_totals: dict[str, float] = {}  # checkpoint_s, eval_s over the whole run
        self._since_log: dict[str, float] = {}  # timed sections since the previous step record
        self._data_wait = 0.0  # seconds waiting for data since the previous step record
        self._t_prev_log = None  # training time of the previous step record (or begin)
        self._unlogged: tuple | None = None  # the last step's arguments when it was not logged (see end_training)
        self._pending: dict | None = None  # a step record waiting for the saves/evals of its step
        self._pending_evals: list[dict] = []
        self._section: list | None = None  # the timed() section in progress
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = None
        self._bar = None
        if rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")
            if progress_bar:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=info.total_steps, initial=start_step, desc=info.model, unit="step",
                                 dynamic_ncols=True)

    # -- clock ---------------------------------------------------------------------------------------------------
    def train_time(self) -> float:
        """The clock minus every timed() section so far: the time axis the throughput window lives on."""
        return self.clock() - self.excluded

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Time a non-training section ("checkpoint", "eval", "export"): reported as `<kind>_s`, kept out of the
        throughput window. The accelerator is synchronised on both sides so queued step work is not billed here."""
        self.sync()
        t0 = self.clock()
        self._section = [kind, t0]  # [kind, start of the part not yet written into a record] (see persist)
        try:
            yield
        finally:
            self.sync()
            now = self.clock()
            dt = now - t0
            self.excluded += dt
            key = f"{kind}_s"
            self.section_totals[key] = self.section_totals.get(key, 0.0) + dt
            part = now - self._section[1]
            self._section = None
            target = self._pending if self._pending is not None else self._since_log
            target[key] = target.get(key, 0.0) + part

    def persist(self) -> None:
        """Write the pending step record now and fsync the file (rank 0; a no-op elsewhere). A checkpoint calls it
        before its COMPLETE marker, so a step that counts as saved always has its record; the time of the open
        section so far goes into that record, the rest of the section into the next one."""
        if self._pending is not None and self._section is not None:
            now = self.clock()
            key = f"{self._section[0]}_s"
            self._pending[key] = self._pending.get(key, 0.0) + now - self._section[1]
            self._section[1] = now
        self._flush()
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def data_wait(self, seconds: float) -> None:
        """The loop reports time spent waiting for the data source (next(batch))."""
        self._data_wait += seconds

    # -- rates ---------------------------------------------------------------------------------------------------
    def rates(self, samples: float, tokens: float, seconds: float) -> dict:
        if seconds <= 0 or samples <= 0:
            return dict(samples_per_s=None, seqs_per_s_per_accelerator=None, tokens_per_s=None,
                        tflops_per_accelerator=None, mfu=None)
        sps = samples / seconds
        tflops = sps * self.flops_per_sample / self.world_size / 1e12
        out = dict(samples_per_s=sps, seqs_per_s_per_accelerator=sps / self.world_size,
                   tokens_per_s=(tokens / seconds) if tokens else None, tflops_per_accelerator=tflops, mfu=None)
        if not self.peak:
            out["mfu_note"] = (f"no {self.static['precision']} peak known for accelerator "
                               f"{self.static['accelerator']!r}: set DS_CORE_PEAK_TFLOPS")
        elif tflops > self.peak:
            # Above the peak means the peak is wrong (a probe that read low, a table entry for another dtype or
            # part): a figure that cannot be true is not written.
            out["mfu_note"] = (f"not written: {tflops:.4g} TFLOPs per accelerator is above the "
                               f"{self.static['precision']} peak {self.peak:.4g} TFLOPs, so that peak is wrong for "
                               f"this machine; set DS_CORE_PEAK_TFLOPS")
        else:
            out["mfu"] = tflops / self.peak
        return out

    # -- events --------------------------------------------------------------------------------------------------
    def step(self, step: int, samples: int, tokens: int = 0, loss: float | None = None, lr: float | None = None,
             logs: dict | None = None, grad_norm: float | None = None) -> dict | None:
        """Record one optimizer step with its GLOBAL sample and token counts; returns the record when logged.

        The record is written when the next event comes (a step, end_training, summary), so that checkpoint and
        eval time spent right after this step is reported in it."""
        self._flush()
        self.steps += 1
        self.last_step = step
        self.last_loss = _num(loss)
        self.samples_total += samples
        if self.last_loss is not None and math.isfinite(self.last_loss):
            self.loss_sum, self.loss_steps = self.loss_sum + self.last_loss, self.loss_steps + 1
        in_window = self.t_window is not None
        if in_window:
            self.window_samples += samples
            self.window_tokens += tokens
        if self.t_window is None and self.steps == self.warmup:
            # The window opens at the end of the last warm-up step (with no warm-up, begin() opened it already).
            self.sync()
            self.t_window = self.train_time()
            self.last_log = (self.t_window, 0, 0)
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                self._bar.set_postfix(loss=f"{self.last_loss:.4f}" if self.last_loss is not None else "nan")
        if step % self.log_every:
            self._unlogged = (step, in_window, lr, logs, grad_norm)
            return None
        self._unlogged = None
        return self._record(step, in_window, lr, logs, grad_norm)

    def _record(self, step: int, in_window: bool, lr: Any, logs: dict | None, grad_norm: Any) -> dict:
        self.sync()
        now = self.train_time()
        rec: dict[str, Any] = dict(type="step", step=step, loss=self.last_loss, lr=_num(lr),
                                   grad_norm=_num(grad_norm), warmup=not in_window)
        if in_window:
            t0, s0, k0 = self.last_log
            rec.update(self.rates(self.window_samples - s0, self.window_tokens - k0, now - t0))
            self.last_log = (now, self.window_samples, self.window_tokens)
        else:
            rec.update(self.rates(0, 0, 0))
        interval = now - self._t_prev_log if self._t_prev_log is not None else 0.0
        rec["data_wait_frac"] = min(1.0, self._data_wait / interval) if interval > 0 else None
        self._data_wait, self._t_prev_log = 0.0, now
        rec.update({k: _num(v) for k, v in (logs or {}).items()})
        rec.update(self._since_log)  # sections that ran before this step's record was opened (a resume's eval...)
        self._since_log = {}
        rec["time"] = time.time()  # wall time of the step's end: bench/startup.py measures launch-to-first-step
        self._pending = rec
        return rec

    def begin(self) -> None:
        """Called by the loop before the first step: with zero warm-up steps the window opens here."""
        self.sync()
        self.t_begin = self.clock()
        self._t_prev_log = self.train_time()
        if self.warmup == 0 and self.t_window is None:
            self.t_window = self._t_prev_log
            self.last_log = (self.t_window, 0, 0)

    def eval(self, step: int, logs: dict) -> dict:
        rec = dict(type="eval", step=step, **{k: _num(v) for k, v in logs.items()})
        if self._pending is not None:
            self._pending_evals.append(rec)  # written after the step record it follows
        else:
            self._write(rec)
            self._monitor(step, rec)
            self._print(rec)
        return rec

    def end_training(self) -> None:
        """The last optimizer step is done: log it if log_every skipped it, and close the throughput window here,
        before the final checkpoint, eval and export."""
        if self.t_close is not None:
            return
        if self._unlogged is not None:
            self._flush()
            self._record(*self._unlogged)
            self._unlogged = None
        self._flush()
        self.sync()
        self.t_close = self.train_time()
        self.runtime = (self.clock() - self.t_begin) if self.t_begin is not None else 0.0

    def summary(self, extra: dict | None = None) -> dict:
        """The final record: run description plus throughput over the post-warm-up window."""
        self.end_training()
        measured = max(0, self.steps - self.warmup) if self.t_window is not None else 0
        seconds = (self.t_close - self.t_window) if self.t_window is not None else 0.0
        if self.peak_probe is not None and self.peak and seconds >= REPROBE_MIN_S:
            self.peak = max(self.peak, self.peak_probe())
            self.static["peak_tflops_per_accelerator"] = self.peak
        rec = dict(type="summary", **self.static, steps=self.start_step + self.steps, measured_steps=measured,
                   measured_seconds=seconds, final_loss=self.last_loss, runtime_s=self.runtime,
                   steps_this_run=self.steps, samples_this_run=self.samples_total,
                   mean_loss=self.loss_sum / self.loss_steps if self.loss_steps else None,
                   checkpoint_s=self.section_totals.get("checkpoint_s", 0.0),
                   eval_s=self.section_totals.get("eval_s", 0.0))
        rec.update({k: v for k, v in self.section_totals.items() if k not in rec})
        rec.update(self.rates(self.window_samples, self.window_tokens, seconds))
        rec.update({k: (_num(v) if not isinstance(v, (list, dict)) else v) for k, v in (extra or {}).items()})
        self._write(rec)
        return rec

    def close(self) -> None:
        self._flush()
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- sinks ---------------------------------------------------------------------------------------------------
    def _flush(self) -> None:
        """Write the pending step record (with the sections of its step), its console line, then its eval records."""
        rec, self._pending = self._pending, None
        if rec is None:
            return
        self._write(rec)
        self._monitor(rec["step"], rec)
        self._print(rec)
        evals, self._pending_evals = self._pending_evals, []
        for ev in evals:
            self._write(ev)
            self._monitor(ev["step"], ev)
            self._print(ev)

    def _print(self, rec: dict) -> None:
        """One console line per step or eval record, rank 0, with the numbers of the file (%.4g). A step outside the
        throughput window says "not timed" (not "warm-up": that reads like LR warm-up, and it follows a resume too)."""
        if not self.console:
            return
        skip = {"type", "time", "warmup"}
        parts = [("eval at " if rec.get("type") == "eval" else "") + f"step {rec['step']}"]
        parts += [f"{k} {_fmt(v)}" for k, v in rec.items() if k not in skip and k != "step" and v is not None]
        line = " | ".join(parts) + (" (not timed)" if rec.get("warmup") else "")
        if self._bar is not None:
            self._bar.write(log.PREFIX + line)  # above the bar, which a plain write would break
        else:
            log.say(line, every_rank=True)  # self.console: rank 0's console already

    def _write(self, rec: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def _monitor(self, step: int, rec: dict) -> None:
        """DeepSpeed's MonitorMaster (tensorboard / csv / wandb as enabled in the DeepSpeed JSON), under Trainer's tags
        (transformers.integrations' rewrite_logs): eval_x -> eval/x, test_x -> test/x, anything else train/x, and
        our lr is Trainer's learning_rate."""
        if self.monitor is None or not getattr(self.monitor, "enabled", False):
            return
        events = [(_trainer_tag(k, rec.get("type")), float(v), step) for k, v in rec.items()
                  if k not in ("type", "step", "warmup", "time") and isinstance(v, (int, float)) and v is not None]
        if events:
            self.monitor.write_events(events)


def _trainer_tag(key: str, kind: str | None) -> str:
    if kind == "eval":  # an eval record's keys carry their split's prefix (eval_loss, test_loss)
        for prefix in ("eval_", "test_"):
            if key.startswith(prefix):
                return f"{prefix[:-1]}/{key[len(prefix):]}"
    return f"train/{'learning_rate' if key == 'lr' else key}"


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
