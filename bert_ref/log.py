"""bert_ref's console lines, "[bert_ref] message" (bert-prep's say which step speaks: "[bert_ref] vocab: ..."): the
package's logger of ds_core.log (rank 0's unless a line is about its rank; stdout unless `stderr=True`)."""
from __future__ import annotations

from ds_core.log import Console

CONSOLE = Console("bert_ref")
say, warn = CONSOLE.say, CONSOLE.warn

__all__ = ["CONSOLE", "say", "warn"]
