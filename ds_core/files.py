"""Files written whole or not at all: a reader (a resumed run, a tool, a crash's survivor) never sees a partial one.

Written under a temporary name in the same directory, flushed to disk, then renamed over the target: the rename is
atomic on one filesystem, so the target holds either the old content or the new (principle 10: a partial file is never
taken as good).
"""
from __future__ import annotations

import os
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """atomic_write_bytes of the text in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary name in the same directory, fsync, then rename: readers never see a partial file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


__all__ = ["atomic_write_text", "atomic_write_bytes"]
