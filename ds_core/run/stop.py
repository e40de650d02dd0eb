"""Stopping a run early on purpose: the signals a job scheduler sends before it ends a job (StopRequest), and the
exit status that tells a job script to run again with --resume (EXIT_STOPPED)."""
from __future__ import annotations

import signal
import threading
from typing import Any

# Exit status of a run stopped early on purpose (SIGTERM / SIGUSR1, or --max_steps_this_run) after saving a
# checkpoint: "run me again with --resume". 75 is EX_TEMPFAIL of sysexits.h ("temporary failure, retry"); a job
# script loops while the status is 75. 0 means training finished; anything else is a failure.
EXIT_STOPPED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Remembers a SIGTERM / SIGUSR1 (Slurm preemption, spot/Batch termination) instead of dying mid-step.

    The handler only sets a flag; the loop folds it into the step's one all-reduce, so every rank stops after the
    same optimizer step even when only some ranks got the signal (DeepSpeed's launcher signals its ranks one after
    another, waiting up to 30 s for each). The verdict is read with the step's other values: at once on a logging
    step (every step with the default --log_every 1), else one step late, so a signal in step k stops the run after
    step k or k + 1, the same step on every rank."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():  # Python delivers signals to the main thread
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


__all__ = ["EXIT_STOPPED", "STOP_SIGNALS", "StopRequest"]
