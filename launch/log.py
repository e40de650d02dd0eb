"""launch's console lines, "[launch] message", each saying which command speaks where a run's log mixes them
("[launch] guard: rank 3 on node7: ..."): the package's logger of ds_core.log. A launcher is no rank, so its lines
are written whatever RANK its environment holds (that is its training process's), but one that names the rank it
speaks for (`rank=`: an MPI rank the guard has read), written by rank 0's alone. Standard library only: a launcher
imports no torch to speak."""
from __future__ import annotations

from ds_core.log import Console

CONSOLE = Console("launch", ranks=False)
say, warn = CONSOLE.say, CONSOLE.warn

__all__ = ["CONSOLE", "say", "warn"]
