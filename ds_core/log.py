"""The one way the toolkit speaks to the console: a `logging` logger per package ("ds_core", "bert_ref",
"bridgetower_ds", "launch"), whose lines read "[package] message". ds_core's is this module's `say` and `warn`; each
other package has its `log` module (`from bridgetower_ds import log; log.say(...)`).

Every rank of a run runs the same code, so a line meant once per run is written by rank 0 only: the logger's filter
drops a record on every other rank unless the call says `every_rank=True` (a line about this rank: its lock, its
checkpoint verification) or names the rank it speaks for with `rank=` (the MPI rank a launcher's guard has just read,
the rank a data source is built for): then rank 0's alone. The rank is torch.distributed's where a process group is
up, else the launcher's RANK variable (0 for a process started by hand). A launcher is no rank (`ranks=False`): a
RANK variable in its environment is that of the training process it starts, so its every line is written but one
that names another rank than 0. Lines go to the process's current stdout (stderr with `stderr=True`), read at each
line so that a test's captured stream gets them, and are flushed at once (a killed rank's last line reaches its
launcher's log). Handlers a user adds to a package's logger get the same records.

What a command answers (a JSON document, a table, the line it was asked for) is its result, not a message: it is
printed to stdout, and nothing here is needed for it.
"""
from __future__ import annotations

import logging
import os
import sys


def rank() -> int:
    # torch.distributed not imported: no process group can be up, and a launcher's line need not import torch
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    value = os.environ.get("RANK", "0")
    return int(value) if value.isdigit() else 0


class RankZero(logging.Filter):
    """Rank 0's records, and every rank's where the call asked for it (extra={"every_rank": True}). A record naming
    the rank it speaks for (extra={"rank": r}) passes where r is 0; `ranks=False` (a launcher's logger) passes every
    other record."""

    def __init__(self, ranks: bool = True):
        super().__init__()
        self.ranks = ranks

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "every_rank", False):
            return True
        speaks_for = getattr(record, "rank", None)
        if speaks_for is not None:
            return speaks_for == 0
        return not self.ranks or rank() == 0


class ConsoleHandler(logging.Handler):
    """Writes "[package] message" to the stream sys.stdout (or sys.stderr) is when the line is written."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if getattr(record, "stderr", False) else sys.stdout
        try:
            stream.write(self.prefix + record.getMessage() + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (the reader gone): nothing to tell
            pass


class Console:
    """The console of the package `name`: the logger of that name, its lines "[name] message"; `ranks=False` for a
    launcher, which is no rank. Made once per name: a second Console of a name is the same logger."""

    def __init__(self, name: str, *, ranks: bool = True):
        self.prefix = f"[{name}] "
        self.logger = logging.getLogger(name)
        if not any(isinstance(h, ConsoleHandler) for h in self.logger.handlers):
            self.logger.addHandler(ConsoleHandler(self.prefix))
            self.logger.addFilter(RankZero(ranks))
            self.logger.setLevel(logging.INFO)
            self.logger.propagate = False  # the root logger's handlers (a library's basicConfig) would print it twice

    def say(self, message: str, *, every_rank: bool = False, stderr: bool = False, rank: int | None = None) -> None:
        """One console line: rank 0's unless `every_rank` (or, with `rank`, where that rank is 0); to stderr with
        `stderr`."""
        self.logger.info(message, extra={"every_rank": every_rank, "stderr": stderr, "rank": rank})

    def warn(self, message: str, *, every_rank: bool = False, stderr: bool = False, rank: int | None = None) -> None:
        """A warning line ("[package] warning: ...")."""
        self.logger.warning("warning: " + message, extra={"every_rank": every_rank, "stderr": stderr, "rank": rank})


DS_CORE = Console("ds_core")
LOGGER = DS_CORE.logger
PREFIX = DS_CORE.prefix
say, warn = DS_CORE.say, DS_CORE.warn


__all__ = ["Console", "DS_CORE", "LOGGER", "PREFIX", "say", "warn", "rank", "RankZero", "ConsoleHandler"]
