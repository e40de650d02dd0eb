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
from pathlib import Path
from typing import Any, Callable

import torch

# Dense bf16 peak TFLOPs per accelerator (vendor figures; sparsity excluded). Override with DS_CORE_PEAK_TFLOPS.
PEAK_TFLOPS: dict[str, float] = {
    # First-generation Gaudi (HL-205, AWS DL1): Habana publishes no dense bf16 MME figure; this is the community
    # estimate used for MFU on DL1. Set DS_CORE_PEAK_TFLOPS for your own number.
    "gaudi": 200.0,
    "gaudi2": 432.0,  # HL-225, bf16 MME
    "gaudi3": 1835.0,
    "a100": 312.0,
    "h100": 989.0,  # SXM; PCIe is 756
    "h200": 989.0,
}


def cpu_peak_tflops(dtype: torch.dtype = torch.bfloat16, n: int = 1024, seconds: float = 0.5) -> float:
    """Measured matmul peak of this process on the CPU (its current torch thread count): best of a short probe."""
    g = torch.Generator().manual_seed(0)  # private stream: the probe must not shift the run's RNG (exact resume)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    torch.mm(a, b)  # warm-up (allocations, kernels)
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best = max(best, 2 * n**3 / dt / 1e12)
    return best


def accelerator_kind(accelerator: str, device: torch.device | None = None) -> str:
    """Key of PEAK_TFLOPS for the running device ("cpu" when unknown)."""
    if accelerator == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device).lower()
        return next((k for k in ("h200", "h100", "a100") if k in name), "cuda")
    if accelerator == "hpu":
        try:
            import habana_frameworks.torch.hpu as hthpu  # noqa: PLC0415

            name = hthpu.get_device_name().lower()
        except Exception:  # pragma: no cover - HPU only
            name = ""
        return "gaudi3" if "gaudi3" in name else "gaudi2" if "gaudi2" in name else "gaudi"
    return accelerator


def peak_tflops_for(kind: str) -> float | None:
    if os.environ.get("DS_CORE_PEAK_TFLOPS"):
        return float(os.environ["DS_CORE_PEAK_TFLOPS"])
    if kind == "cpu":
        return cpu_peak_tflops()
    return PEAK_TFLOPS.get(kind)


def peak_probe_for(kind: str) -> Callable[[], float] | None:
    """The re-probe used at the end of a run where the peak is measured (CPU without an override), else None."""
    return cpu_peak_tflops if kind == "cpu" and not os.environ.get("DS_CORE_PEAK_TFLOPS") else None


def _num(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class Metrics:
    """Counts optimizer steps and their samples; turns them into rates over the post-warm-up window.

    `clock` is injectable so tests can drive time. Only rank 0 writes files, feeds the monitor and shows progress;
    every rank keeps the same counts (the loop passes global counts).
    """

    def __init__(self, run_dir: str | os.PathLike, *, rank: int, world_size: int, nodes: int,
                 accelerators_per_node: int, accelerator: str, model_name: str, micro_batch: int, grad_accum: int,
                 zero_stage: int, precision: str, flops_per_sample: float, seq_len: int = 0,
                 warmup_steps: int = 3, log_every: int = 1, total_steps: int | None = None,
                 peak_tflops: float | None = None, monitor: Any = None, progress_bar: bool = True,
                 clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None,
                 start_step: int = 0, peak_probe: Callable[[], float] | None = None):
        self.rank, self.world_size = rank, world_size
        self.static = dict(model=model_name, world_size=world_size, nodes=nodes,
                           accelerators_per_node=accelerators_per_node, accelerator=accelerator,
                           micro_batch=micro_batch, grad_accum=grad_accum,
                           global_batch=micro_batch * grad_accum * world_size, zero_stage=zero_stage,
                           precision=precision, seq_len=seq_len, warmup_steps_excluded=warmup_steps,
                           flops_per_sample=flops_per_sample, peak_tflops_per_accelerator=peak_tflops)
        self.flops_per_sample = flops_per_sample
        self.peak = peak_tflops
        # A measured peak (CPU) is probed again at the end and the better probe kept: a probe that landed in a busy
        # moment would otherwise read low and inflate MFU.
        self.peak_probe = peak_probe
        self.warmup = warmup_steps
        self.log_every = log_every
        self.clock, self.sync = clock, sync or (lambda: None)
        self.monitor = monitor if rank == 0 else None
        self.start_step = start_step  # steps done before this process (resume): warm-up counts from here
        self.steps = 0  # optimizer steps seen by this process
        self.t_window = None  # clock at the end of the last warm-up step
        self.window_samples = self.window_tokens = 0
        self.last_log = None  # (clock, samples, tokens) at the previous log, inside the window
        self.last_loss = None
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = None
        self._bar = None
        if rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")
            if progress_bar:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total_steps, initial=start_step, desc=model_name, unit="step",
                                 dynamic_ncols=True)

    # -- rates ---------------------------------------------------------------------------------------------------
    def rates(self, samples: float, tokens: float, seconds: float) -> dict:
        if seconds <= 0 or samples <= 0:
            return dict(samples_per_s=None, seqs_per_s_per_accelerator=None, tokens_per_s=None,
                        tflops_per_accelerator=None, mfu=None)
        sps = samples / seconds
        tflops = sps * self.flops_per_sample / self.world_size / 1e12
        return dict(samples_per_s=sps, seqs_per_s_per_accelerator=sps / self.world_size,
                    tokens_per_s=(tokens / seconds) if tokens else None, tflops_per_accelerator=tflops,
                    mfu=(tflops / self.peak) if self.peak else None)

    # -- events --------------------------------------------------------------------------------------------------
    def step(self, step: int, samples: int, tokens: int = 0, loss: float | None = None, lr: float | None = None,
             logs: dict | None = None) -> dict | None:
        """Record one optimizer step with its GLOBAL sample and token counts; returns the record when logged."""
        self.steps += 1
        self.last_loss = _num(loss)
        in_window = self.t_window is not None
        if in_window:
            self.window_samples += samples
            self.window_tokens += tokens
        if self.t_window is None and self.steps == self.warmup:
            # The window opens at the end of the last warm-up step (with no warm-up, begin() opened it already).
            self.sync()
            self.t_window = self.clock()
            self.last_log = (self.t_window, 0, 0)
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                self._bar.set_postfix(loss=f"{self.last_loss:.4f}" if self.last_loss is not None else "nan")
        if step % self.log_every:
            return None
        rec: dict[str, Any] = dict(type="step", step=step, loss=self.last_loss, lr=_num(lr), warmup=not in_window)
        if in_window:
            self.sync()
            now = self.clock()
            t0, s0, k0 = self.last_log
            rec.update(self.rates(self.window_samples - s0, self.window_tokens - k0, now - t0))
            self.last_log = (now, self.window_samples, self.window_tokens)
        else:
            rec.update(self.rates(0, 0, 0))
        rec.update({k: _num(v) for k, v in (logs or {}).items()})
        self._write(rec)
        self._monitor(step, rec)
        return rec

    def begin(self) -> None:
        """Called by the loop before the first step: with zero warm-up steps the window opens here."""
        if self.warmup == 0 and self.t_window is None:
            self.sync()
            self.t_window = self.clock()
            self.last_log = (self.t_window, 0, 0)

    def eval(self, step: int, logs: dict) -> dict:
        rec = dict(type="eval", step=step, **{k: _num(v) for k, v in logs.items()})
        self._write(rec)
        self._monitor(step, rec, prefix="Eval")
        return rec

    def summary(self, extra: dict | None = None) -> dict:
        """The final record: run description plus throughput over the post-warm-up window."""
        self.sync()
        now = self.clock()
        if self.peak_probe is not None and self.peak:
            self.peak = max(self.peak, self.peak_probe())
            self.static["peak_tflops_per_accelerator"] = self.peak
        measured = max(0, self.steps - self.warmup) if self.t_window is not None else 0
        seconds = (now - self.t_window) if self.t_window is not None else 0.0
        rec = dict(type="summary", **self.static, steps=self.start_step + self.steps, measured_steps=measured,
                   measured_seconds=seconds, final_loss=self.last_loss)
        rec.update(self.rates(self.window_samples, self.window_tokens, seconds))
        rec.update({k: (_num(v) if not isinstance(v, (list, dict)) else v) for k, v in (extra or {}).items()})
        self._write(rec)
        return rec

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- sinks ---------------------------------------------------------------------------------------------------
    def _write(self, rec: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()

    def _monitor(self, step: int, rec: dict, prefix: str = "Train") -> None:
        """DeepSpeed's MonitorMaster (tensorboard / csv / wandb as enabled in the DeepSpeed JSON)."""
        if self.monitor is None or not getattr(self.monitor, "enabled", False):
            return
        events = [(f"{prefix}/{k}", float(v), step) for k, v in rec.items()
                  if k not in ("type", "step", "warmup") and isinstance(v, (int, float)) and v is not None]
        if events:
            self.monitor.write_events(events)
