"""bridgetower_ds's console lines, "[bridgetower_ds] message": the package's logger of ds_core.log (rank 0's unless a
line is about its rank or names the rank it speaks for; stdout unless `stderr=True`)."""
from __future__ import annotations

from ds_core.log import Console

CONSOLE = Console("bridgetower_ds")
say, warn = CONSOLE.say, CONSOLE.warn

__all__ = ["CONSOLE", "say", "warn"]
