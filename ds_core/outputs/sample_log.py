"""Sample log for audits and tests: which global sample indices each rank trained on, per micro batch.

Set `DS_CORE_SAMPLE_LOG=<dir>` and every training data source appends one JSON line per micro batch it yields to
`<dir>/rank{r}.jsonl`: {"epoch": e, "indices": [global sample indices]} (plus source-specific keys). The indices are
world-size independent (BERT: position in the sorted training files' concatenation; BridgeTower: dataset row), so
the logs of a run that was resumed on another number of ranks can be checked for "every sample of the epoch exactly
once". A line is written when the batch is handed to the loop, which trains on every batch it takes.

Off by default (no file, no cost). Each line is one append + flush: a killed rank leaves whole lines behind.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

ENV = "DS_CORE_SAMPLE_LOG"


class SampleLog:
    def __init__(self, rank: int, enabled: bool = True):
        """enabled=False: a source that is not trained on (evaluation) never writes."""
        d = os.environ.get(ENV) if enabled else None
        self.path: Path | None = Path(d) / f"rank{rank}.jsonl" if d else None

    def __bool__(self) -> bool:
        return self.path is not None

    def write(self, epoch: int, indices: Sequence[int], **extra) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"epoch": int(epoch), "indices": [int(i) for i in indices], **extra})
        with open(self.path, "a") as f:
            f.write(line + "\n")


def read_sample_log(path: str | os.PathLike) -> list[dict]:
    """The records of one rank's log, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
