"""Names on disk under run_dir/checkpoints/: step tags, the COMPLETE marker and the `latest` pointer.

Its own module because both ds_core.checkpoint (save, load, prune) and ds_core.checkpoint.resize (the universal
conversion) read them; neither imports the other's module for them, so the package has no import circle.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ds_core.errors import ConfigError

COMPLETE = "COMPLETE"
LATEST = "latest"
_TAG_RE = re.compile(r"global_step\d+")


def tag_for(step: int) -> str:
    return f"global_step{step}"


def is_complete(ckpt_root: Path, tag: str) -> bool:
    return (Path(ckpt_root) / tag / COMPLETE).is_file()


def read_marker(ckpt_root: str | os.PathLike, tag: str) -> dict:
    """The COMPLETE marker of `tag`: a JSON object with the step (an integer) and the fingerprint (an object), and the
    batch numbers where written (an object). Anything else (an empty file, other JSON) raises ConfigError naming the
    file: a marker that does not say what was saved is not taken as one."""
    path = Path(ckpt_root) / tag / COMPLETE
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the marker ({e.strerror})") from None
    try:
        meta = json.loads(data)
    except ValueError as e:  # json's decode error and UnicodeDecodeError
        what = "empty" if not data.strip() else f"not JSON ({e})"
        raise ConfigError(f"{path}: {what}; a COMPLETE marker is the JSON object the save wrote (step, fingerprint, "
                          f"batch), so this checkpoint is not taken as complete") from None
    problems = [] if isinstance(meta, dict) else [f"a JSON {type(meta).__name__}, not an object"]
    if not problems:
        if not isinstance(meta.get("step"), int) or isinstance(meta.get("step"), bool):
            problems.append(f"step {meta.get('step')!r} is not an integer")
        if not isinstance(meta.get("fingerprint"), dict):
            problems.append("no fingerprint object")
        if not isinstance(meta.get("batch", {}), dict):
            problems.append("batch is not an object")
    if problems:
        raise ConfigError(f"{path}: {'; '.join(problems)}; a COMPLETE marker is the JSON object the save wrote "
                          f"(step, fingerprint, batch), so this checkpoint is not taken as complete")
    return meta


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
