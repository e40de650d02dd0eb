"""Files written whole or not at all: a reader (a resumed run, a tool, a crash's survivor) never sees a partial one.

Written under a temporary name in the same directory, flushed to disk, then renamed over the target: the rename is
atomic on one filesystem, so the target holds either the old content or the new (principle 10: a partial file is never
taken as good).

Permissions: run directories, checkpoints and what else a run writes follow the user's umask, as every tool of the
field does (a team that shares runs sets a group-readable umask). A file that holds a secret (a forwarded token in
.deepspeed_env) is written with mode 0600 whatever the umask (secret=True). Scratch files that other accounts on a
shared machine must not touch (the HPU media cache, a node's hostfile) go into private_dir(): one directory per user
under the system temp directory, mode 0700, used only when this user owns it, it is a real directory (not a symlink)
and nobody else can write to it.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str, secret: bool = False) -> None:
    """atomic_write_bytes of the text in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"), secret=secret)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, secret: bool = False) -> None:
    """Write to a temporary name in the same directory, fsync, then rename: readers never see a partial file.
    The temporary file is created anew (O_EXCL, a symlink in its place is not followed); secret: mode 0600, else
    0666 less the umask."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        tmp.unlink()  # a leftover of this pid's earlier attempt
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600 if secret else 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class UnsafeDirectory(OSError):
    """A shared-machine scratch directory that another account could have made or can write to; the message names
    it and its owner."""


def check_private_dir(path: Path) -> Path:
    """path, when it is a real directory (not a symlink) owned by this user that no one else can write to; raises
    UnsafeDirectory otherwise."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path}: not a directory of its own (a symlink or another file); refusing to use it")
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path}: owned by uid {st.st_uid}, not this user ({os.getuid()}): another account made "
                              f"it, so its contents cannot be trusted; remove it or choose another directory")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(f"{path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                              f"`chmod 700 {path}` or choose another directory")
    return path


def private_dir(name: str, root: str | os.PathLike | None = None) -> Path:
    """<root or the system temp dir>/<name>-<uid>: this user's scratch directory (mode 0700), made when missing and
    checked (check_private_dir) whether made now or found."""
    path = Path(root or tempfile.gettempdir()) / f"{name}-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    return check_private_dir(path)


OUTPUT_MARK = ".made_by"  # in a directory a tool made for its whole output (the demos' --out): which tool


def claim_output_dir(out: str | os.PathLike, maker: str) -> str:
    """Make `out` the empty output directory of `maker` (a demo: its --out holds nothing else): made when missing,
    used when empty, replaced when it holds `maker`'s mark (what an earlier run of it made). Any other non-empty
    directory is the user's: refused (FileExistsError naming it), never deleted. Returns the line to print ("" when
    nothing was there)."""
    import shutil

    path = Path(out)
    said = ""
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"--out {path}: exists and is not a directory; choose another --out")
    if path.is_dir() and any(path.iterdir()):
        mark = path / OUTPUT_MARK
        if not (mark.is_file() and not mark.is_symlink() and mark.read_text().strip() == maker):
            raise FileExistsError(f"--out {path}: exists, is not empty and was not made by {maker} (no {OUTPUT_MARK} "
                                  f"naming it): not touching it; choose another --out, or move or remove it yourself")
        shutil.rmtree(path)
        said = f"{maker}: replacing {path} (made by an earlier {maker})"
    path.mkdir(parents=True, exist_ok=True)
    (path / OUTPUT_MARK).write_text(maker + "\n")
    return said


__all__ = ["atomic_write_text", "atomic_write_bytes", "private_dir", "check_private_dir", "UnsafeDirectory",
           "claim_output_dir", "OUTPUT_MARK"]
