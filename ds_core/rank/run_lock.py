"""One live run per run_dir: a lock file that global rank 0 holds for the run's life.

Two runs in one run_dir write the same checkpoint directories and metrics.jsonl; a second run (with or without
--resume) is refused here, before it writes anything (ds_core.run.run_dir.prepare_run_dir takes the lock first).

Mechanism: `run_dir/.run.lock` created with O_CREAT|O_EXCL, holding the owner's host, pid, process start time and a
heartbeat counter that a daemon thread bumps every HEARTBEAT_S seconds. Why not fcntl/lockf or flock: POSIX locks are
honoured by local disks and NFSv4, but on Lustre only with the `flock` mount option (`localflock` makes them
node-local, so two nodes would both "hold" the lock; the default `noflock` fails the call), on NFSv3 only where lockd
runs, and not by some FUSE/object-store mounts; a lock that silently does nothing is worse than none. Exclusive create
is atomic on all of these (NFSv3+ and Lustre included). Its cost is that a killed owner leaves the file behind, so a
newcomer decides whether the owner is alive:
  - same host: the recorded pid exists with the recorded start time (a recycled pid does not match) -> alive;
  - another host: the heartbeat counter is read again over STALE_AFTER_S; unchanged -> dead. The counter is compared
    with itself, never with a clock, so clock skew between nodes does not matter; the file is re-opened for each read,
    which NFS's close-to-open consistency makes see the owner's last write.
A dead owner's file is renamed aside (kept, never deleted: `.run.lock.stale-<pid>`) and the lock taken; the owner's
heartbeat notices a lock that is no longer its own and says so loudly. Released (unlinked, only if still ours) at exit.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ds_core import log
from ds_core.errors import ConfigError
from ds_core.redact import redact_argv

LOCK_NAME = ".run.lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 3 * HEARTBEAT_S  # another host's owner whose counter did not move for this long is dead


class RunDirLocked(ConfigError):
    """Another live run holds run_dir."""


def proc_stat_field(pid: int, index: int) -> int | None:
    """A numeric field of /proc/PID/stat, counted from the one after the command name (0: state, 1: ppid, 19: start
    time; proc_pid_stat(5) fields 3, 4, 22); None where unknown (no such process, no procfs)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[index])


def _start_ticks(pid: int) -> int | None:
    """Process start time (clock ticks since boot); None where unknown."""
    return proc_stat_field(pid, 19)


def _pid_alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process exists
        pass
    if start is None:
        return True
    now = _start_ticks(pid)
    return now is None or now == start  # a different start time: the pid was recycled


def _read(path: Path) -> dict | None:
    """The lock's content; None while it is being written (created, not yet filled) or unreadable."""
    try:
        with open(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


@dataclass
class RunLock:
    path: Path
    token: str
    owner: dict
    _stop: threading.Event | None = None

    def release(self) -> None:
        """Unlink the lock file if it is still ours (idempotent)."""
        if self._stop is not None:
            self._stop.set()
        held = _read(self.path)
        if held is not None and held.get("token") == self.token:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        _HELD.discard(self)

    def __hash__(self) -> int:
        return hash(self.token)

    def moved_to(self, run_dir: str | os.PathLike) -> None:
        """The directory holding the lock was renamed (--overwrite_run_dir): follow it."""
        self.path = Path(run_dir) / LOCK_NAME

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S):
            held = _read(self.path)
            if held is None or held.get("token") != self.token:
                if held is None and not self.path.exists():
                    continue  # renamed with its directory a moment ago (moved_to follows)
                log.warn(f"lost the run_dir lock {self.path}: another run took it over ({held and held.get('host')}, "
                         f"pid {held and held.get('pid')}) after this run's heartbeat stalled for {STALE_AFTER_S:.0f} "
                         f"s; two runs may now write this run_dir", every_rank=True, stderr=True)
                return
            self.owner["beat"] += 1
            try:  # rewritten in place (not replaced): a replace could clobber a newcomer's lock
                with open(self.path, "r+") as f:
                    f.write(json.dumps(self.owner))
                    f.truncate()
            except OSError:
                pass


_HELD: set[RunLock] = set()


@atexit.register
def release_all() -> None:
    """Release every lock this process holds (at exit, or from ds_core.rank.parent_watch before it ends the process)."""
    for lock in list(_HELD):
        lock.release()


def describe(owner: dict | None, path: Path) -> str:
    if owner is None:
        return f"a run starting right now (lock file {path} is still being written)"
    return (f"a live run on host {owner.get('host')} (pid {owner.get('pid')}, started {owner.get('started')}, "
            f"command: {owner.get('argv')}; lock file {path})")


def _owner_dead(path: Path, owner: dict | None, stale_after_s: float) -> bool:
    if owner is not None and owner.get("host") == socket.gethostname():
        return not _pid_alive(int(owner.get("pid", -1)), owner.get("start_ticks"))
    # another host, or a file not yet filled: dead only if nothing changes over stale_after_s
    end = time.monotonic() + stale_after_s
    while time.monotonic() < end:
        time.sleep(min(1.0, stale_after_s))
        now = _read(path)
        if not path.exists() or now != owner:
            return False
    return True


def acquire(run_dir: str | os.PathLike, stale_after_s: float | None = None, heartbeat: bool = True) -> RunLock:
    """Take run_dir's lock (creating run_dir) or raise RunDirLocked naming the owner. Held until exit or release()."""
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    for lock in _HELD:  # this process is the run that holds it (an entry point called twice, tests)
        if lock.path.resolve() == path.resolve():
            return lock
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()),
             "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "argv": " ".join(redact_argv(sys.argv))[:500],  # a secret-looking flag's value as <redacted>
             "token": uuid.uuid4().hex, "beat": 0}
    for _ in range(3):  # a takeover race with another newcomer is retried, then refused
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            held = _read(path)
            if not _owner_dead(path, held, STALE_AFTER_S if stale_after_s is None else stale_after_s):
                raise RunDirLocked(f"run_dir {root} is in use by {describe(_read(path) or held, path)}: two runs in "
                                   f"one run_dir would write the same checkpoints. Wait for it to end or stop it; "
                                   f"if you know it is dead (its node is gone), remove {path}") from None
            aside = path.with_name(f"{LOCK_NAME}.stale-{(held or {}).get('pid', 'unknown')}-{uuid.uuid4().hex[:6]}")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            moved = _read(aside)
            if held is not None and (moved or {}).get("token") != held.get("token"):
                # another newcomer took the dead lock over between our look and our rename: give its lock back
                try:
                    os.link(aside, path)
                    os.unlink(aside)
                except OSError:
                    pass
                raise RunDirLocked(f"run_dir {root} is in use by {describe(moved, path)} (it took over a dead "
                                   f"run's lock just now)")
            log.say(f"run_dir lock {path} was left by a dead run ({describe(held, path)}); taken over (the old file "
                    f"is kept as {aside.name})", every_rank=True, stderr=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(owner))
            f.flush()
            os.fsync(f.fileno())
        lock = RunLock(path, owner["token"], owner)
        if heartbeat:
            lock._stop = threading.Event()
            threading.Thread(target=lock._beat, args=(lock._stop,), name="run_dir-lock-heartbeat",
                             daemon=True).start()
        _HELD.add(lock)
        return lock
    raise RunDirLocked(f"run_dir {root}: could not take the lock {path} (other runs were taking it at the same time)")
