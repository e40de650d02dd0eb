"""Names on disk under run_dir/checkpoints/: step tags, the COMPLETE marker and the `latest` pointer.

Its own module because both ds_core.checkpoint (save, load, prune) and ds_core.checkpoint.resize (the universal
conversion) read them; neither imports the other's module for them, so the package has no import circle.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

COMPLETE = "COMPLETE"
LATEST = "latest"
_TAG_RE = re.compile(r"global_step\d+")


def tag_for(step: int) -> str:
    return f"global_step{step}"


def is_complete(ckpt_root: Path, tag: str) -> bool:
    return (Path(ckpt_root) / tag / COMPLETE).is_file()


def step_tags(ckpt_root: str | os.PathLike) -> list[str]:
    """Tags global_step{N} under ckpt_root, complete or not, newest first (not the _universal conversions)."""
    tags = [p.name for p in Path(ckpt_root).glob("global_step*") if _TAG_RE.fullmatch(p.name) and p.is_dir()]
    return sorted(tags, key=lambda t: int(t[len("global_step"):]), reverse=True)


def latest_tag(ckpt_root: str | os.PathLike) -> str | None:
    """The tag named by `latest` if complete; otherwise the newest complete tag (or None)."""
    root = Path(ckpt_root)
    f = root / LATEST
    if f.is_file():
        tag = f.read_text().strip()
        if is_complete(root, tag):
            return tag
    return next((t for t in step_tags(root) if is_complete(root, t)), None)
