"""The lock of a JIT op build (DeepSpeed's ops load through torch.utils.cpp_extension) that names its holder, so
that a lock left by a killed process does not stop every later one.

torch serialises a JIT build with a FileBaton, a `lock` file in the op's build directory created at every load (the
ninja run is a no-op when the op is up to date) and removed at the end. A process killed in that window (a rank the
launcher stops because a sibling failed, kill -9, a timed-out job) leaves the file, and every later process that
loads the op waits for it forever, silently. HolderBaton writes `<host> <pid>` into the file it creates; a waiter
on the same host that finds the holder gone removes the lock (only if it still names that holder) and stops
waiting, as it would have after the holder's release. A lock without a holder (made by torch's own FileBaton) or held
on another host (a shared extensions directory) is waited for as before; ds_core.rank.shm warns about an old one.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any

from ds_core.compat.gates import APPLIED, Outcome
from ds_core.compat.marks import replace

HOST = socket.gethostname()


def holder_gone(text: str) -> bool:
    """Whether a lock file's `<host> <pid>` names a process of this host that is no longer there."""
    parts = text.split()
    if len(parts) != 2 or parts[0] != HOST or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def make_baton_class(base: type) -> type:
    """A subclass of torch's FileBaton `base` that names its holder and sees through a dead one's lock."""

    class HolderBaton(base):
        def try_acquire(self):
            try:
                self.fd = os.open(self.lock_file_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return False
            os.write(self.fd, f"{HOST} {os.getpid()}\n".encode())
            return True

        def wait(self):
            while os.path.exists(self.lock_file_path):
                try:
                    with open(self.lock_file_path) as f:
                        text = f.read()
                except FileNotFoundError:
                    return
                if holder_gone(text):
                    _remove_if_unchanged(self.lock_file_path, text)
                    return
                time.sleep(self.wait_seconds)

    return HolderBaton


def _remove_if_unchanged(path: str, text: str) -> None:
    try:
        with open(path) as f:
            if f.read() != text:  # another process took it meanwhile
                return
        os.remove(path)
    except FileNotFoundError:
        pass


def apply(ctx: Any) -> Outcome:
    """Change op_build_lock_holder: torch's JIT builds in this process take HolderBaton (ds_core.compat.changes)."""
    import torch.utils.cpp_extension as cpp

    replace(cpp, "FileBaton", make_baton_class, "op_build_lock_holder")
    return APPLIED


__all__ = ["holder_gone", "make_baton_class", "apply", "HOST"]
