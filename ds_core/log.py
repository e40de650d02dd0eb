"""The one way ds_core speaks to the console: the `logging` logger "ds_core", whose lines read "[ds_core] message".

Every rank of a run runs the same code, so a line meant once per run is written by rank 0 only: the logger's filter
drops a record on every other rank unless the call says `every_rank=True` (a line about this rank: its lock, its
checkpoint verification). The rank is torch.distributed's where a process group is up, else the launcher's RANK
variable (0 for a process started by hand). Lines go to the process's current stdout (stderr with `stderr=True`),
read at each line so that a test's captured stream gets them, and are flushed at once (a killed rank's last line
reaches its launcher's log). Handlers a user adds to the "ds_core" logger get the same records.
"""
from __future__ import annotations

import logging
import os
import sys

LOGGER = logging.getLogger("ds_core")
PREFIX = "[ds_core] "


def rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    value = os.environ.get("RANK", "0")
    return int(value) if value.isdigit() else 0


class RankZero(logging.Filter):
    """Rank 0's records, and every rank's where the call asked for it (extra={"every_rank": True})."""

    def filter(self, record: logging.LogRecord) -> bool:
        return bool(getattr(record, "every_rank", False)) or rank() == 0


class ConsoleHandler(logging.Handler):
    """Writes "[ds_core] message" to the stream sys.stdout (or sys.stderr) is when the line is written."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if getattr(record, "stderr", False) else sys.stdout
        try:
            stream.write(PREFIX + record.getMessage() + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (the reader gone): nothing to tell
            pass


if not any(isinstance(h, ConsoleHandler) for h in LOGGER.handlers):
    LOGGER.addHandler(ConsoleHandler())
    LOGGER.addFilter(RankZero())
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False  # the root logger's handlers (a library's basicConfig) would print each line twice


def say(message: str, *, every_rank: bool = False, stderr: bool = False) -> None:
    """One console line of ds_core: rank 0's unless `every_rank`; to stderr with `stderr`."""
    LOGGER.info(message, extra={"every_rank": every_rank, "stderr": stderr})


def warn(message: str, *, every_rank: bool = False, stderr: bool = False) -> None:
    """A warning line ("[ds_core] warning: ...")."""
    LOGGER.warning("warning: " + message, extra={"every_rank": every_rank, "stderr": stderr})


__all__ = ["LOGGER", "PREFIX", "say", "warn", "rank", "RankZero", "ConsoleHandler"]
