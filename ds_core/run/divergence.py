"""When a run has diverged: a verdict per optimizer step, the same on every rank (it reads only values every rank
shares: the all-reduced loss, DeepSpeed's skipped-step counter and global gradient norm).

A NaN/inf loss already stops the loop before the update. What this adds (each seen in real runs: LR 1e3 with LAMB or
AdamW gave a finite loss of ~1e9 and a non-finite gradient norm from step 3 on, every later update skipped silently
and the run exited 0 with the diverged model as `latest`):
- consecutive skipped steps: DeepSpeed skips an update whose gradient norm is inf/NaN (ZeRO 1-3, BF16_Optimizer) and
  counts it in engine.skipped_steps. A few in a row are fp16 loss-scale search; more than `max_skipped` in a row is a
  run that no longer learns.
- an update applied with a non-finite gradient norm (ZeRO-0 fp32 has no overflow check; ZeRO-1/2 with bf16 and no
  overflow check, and Habana's fork's ZeRO-1/2 outside fp16, apply it with DeepSpeed's -1 for a non-finite norm: a
  negative norm counts as non-finite): the weights are now NaN.
- (Habana's fork's BF16_Optimizer neither skips nor applies: it asserts on the norm; ds_core.run.step.step_or_stop
  turns that into the same stop, at once.)
- a loss spike: a finite loss above `spike_factor` times the median of the recent finite losses (once `min_history`
  losses are known), the usual sign that the LR is far too high before anything becomes non-finite.

On a skipped step the toolkit keeps the LR schedule on the step counter (ds_core.run.step.Update advances it,
DeepSpeed does not): optimizer step k always uses schedule(k), so the schedule still ends on the loop's last step;
every skip is printed and recorded in metrics.jsonl (`skipped`, `skipped_steps`).
"""
from __future__ import annotations

import math
import statistics
from collections import deque

from ds_core.errors import RunVerdict


class TrainingDiverged(RunVerdict):
    """The run diverged (a NaN/inf loss, DivergenceGuard's verdict, a non-finite gradient norm DeepSpeed stops on);
    no checkpoint holds the diverged state. Said in one line by ds_core.rank.process_end.run_main, status 1."""


class DivergenceGuard:
    def __init__(self, max_skipped: int = 5, spike_factor: float = 10.0, window: int = 20, min_history: int = 5):
        self.max_skipped = max_skipped
        self.spike_factor = spike_factor
        self.min_history = min_history
        self.history: deque[float] = deque(maxlen=window)
        self.consecutive = 0  # skipped steps in a row up to now
        self.total = 0  # skipped steps in this process

    def observe(self, step: int, loss: float, skipped: bool, grad_norm: float | None) -> str | None:
        """The reason to stop after optimizer step `step`, or None. Call once per optimizer step, on every rank."""
        if skipped:
            self.consecutive += 1
            self.total += 1
            if self.consecutive > self.max_skipped:
                return (f"{self.consecutive} consecutive optimizer steps were skipped (steps "
                        f"{step - self.consecutive + 1}-{step}: non-finite gradient norm), more than "
                        f"--max_skipped_steps {self.max_skipped}")
            return None
        self.consecutive = 0
        if grad_norm is not None and not (math.isfinite(grad_norm) and grad_norm >= 0):
            mark = " (DeepSpeed's mark of a non-finite norm)" if grad_norm < 0 else ""
            return (f"the update of step {step} was applied with gradient norm {grad_norm:g}{mark}: the weights are "
                    f"not finite")
        if self.spike_factor > 0 and len(self.history) >= self.min_history:
            median = statistics.median(self.history)
            if median > 0 and loss > self.spike_factor * median:
                return (f"loss {loss:.6g} at step {step} is {loss / median:.3g}x the median {median:.6g} of the last "
                        f"{len(self.history)} steps, above --loss_spike_factor {self.spike_factor:g}")
        self.history.append(loss)
        return None


__all__ = ["DivergenceGuard", "TrainingDiverged"]
