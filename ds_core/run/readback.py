"""The delayed read-back: each optimizer step's values (loss, logs, counts, stop flag, gradient norm: one vector,
reduced over ranks on the device) on their way to the host, read one optimizer step late, or at once where the loop
needs them (a logging step, a save, an evaluation, the end: ds_core.run.trainer.Trainer decides which).

On an accelerator the vector is copied into pinned host memory behind an event (non_blocking): reading it waits for
that step's work only, so the loop reads step k while step k+1 is already queued and the device never idles for a
read. On the CPU the vector is the host's already. The loop's one read per step is PendingStep.read (its .tolist());
tests/test_step_syncs.py counts it."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ds_core.device import hpu
from ds_core.run.step import Update


@dataclass
class StepResult:
    """One optimizer step, reduced over ranks: the same on every rank; with what the loop noted at the step."""

    loss: float
    samples: int
    tokens: int
    logs: dict
    lr: float | None  # the LR this update used
    grad_norm: float | None
    stop: bool  # some rank was asked to stop (signal): every rank stops after this step
    skipped: bool = False  # DeepSpeed skipped the update (non-finite gradient norm): see ds_core.run.divergence
    step: int = 0  # the optimizer step these values belong to
    epoch: int = 0  # the epoch it was taken in
    phase: dict = field(default_factory=dict)  # the step-time record fields known at the step (phase timing)
    extra: dict = field(default_factory=dict)  # the callbacks' keys for the step's record (on_step_end)


class PendingStep:
    """One optimizer step's vector on its way to the host (see the module docstring); `phase` and `extra` are filled
    by the loop at the step, before the values are read."""

    def __init__(self, vec: torch.Tensor, keys: list[str], lr: float | None, skipped: bool, has_norm: bool,
                 step: int = 0, epoch: int = 0):
        self.keys, self.lr, self.skipped, self.has_norm = keys, lr, skipped, has_norm
        self.step, self.epoch = step, epoch
        self.phase: dict = {}
        self.extra: dict = {}
        self._event = None
        if vec.device.type == "cpu":
            self._host = vec
        else:
            from deepspeed.accelerator import get_accelerator

            acc = get_accelerator()
            self._host = acc.pin_memory(torch.empty(vec.shape, dtype=vec.dtype))
            self._host.copy_(vec, non_blocking=True)
            self._event = acc.Event()
            self._event.record()

    def read(self) -> StepResult:
        if self._event is not None:
            self._event.synchronize()
        vals = self._host.tolist()  # a host tensor: no device sync
        n_logs, width = len(self.keys), hpu.count_width(self._host.dtype)
        end = 1 + n_logs + 4 * width
        micro, samples, tokens, stop = hpu.counts_from_parts(vals[1 + n_logs:end], self._host.dtype)
        micro = max(micro, 1)
        logs = dict(sorted((k, vals[1 + i] / micro) for i, k in enumerate(self.keys)))
        norm = vals[end] if self.has_norm else None
        return StepResult(vals[0] / micro, samples, tokens, logs, self.lr, norm, stop > 0, self.skipped, self.step,
                          self.epoch, self.phase, self.extra)


class ReadBack:
    """The steps whose values are still on their way to the host, oldest first: `send` starts a step's copy, `take`
    reads the due ones."""

    def __init__(self) -> None:
        self._unread: deque[PendingStep] = deque()

    def send(self, update: Update, *, step: int, epoch: int) -> PendingStep:
        """Start the copy of optimizer step `step`'s values (after engine.step(): Update.after_step); the loop adds
        its record fields to the returned step's `phase` and `extra` before taking it."""
        pending = PendingStep(update.vec, update.keys, update.lr, update.skipped, update.has_norm, step, epoch)
        self._unread.append(pending)
        return pending

    def take(self, keep: int = 0) -> Iterator[StepResult]:
        """Read the unread steps, oldest first, leaving the newest `keep` on their way."""
        while len(self._unread) > keep:
            yield self._unread.popleft().read()


__all__ = ["PendingStep", "ReadBack", "StepResult"]
