"""CI, as `.ci/run` runs it on a fresh clone: one lane per stack of the support matrix (stacks/, docs/gaudi.md), each
the Makefile's own commands, each timed (docs/development.md, "CI").

1. As root, the system packages the multi-node launch tests need, where missing (`SYSTEM_PACKAGES`); when that fails
   those tests skip and say why.
2. Habana's DeepSpeed fork for the Gaudi lanes (not on PyPI): HABANA_DS, else the newest release archive in
   shared/third_party/ beside this checkout or beside the repository it was cloned from.
3. Lane latest: `make setup`, then `make test` and `make test-ds-unit` (DeepSpeed's own unit tests with the toolkit's
   changes on and off). Where the disk holds every lane's venvs at once (BACKGROUND_SETUP_MIN_GB, 25 GB), the Gaudi
   lanes' set-ups (`make gaudi-setup`, one after the other) run in the background meanwhile: lane latest's tests
   leave about a core of the two idle (ranks waiting on each other and on process starts).
4. A lane per Gaudi release, newest first: `make test-gaudi` (its set-up first where it was not done in the
   background), and on the oldest release DeepSpeed's unit tests on the fork. The venvs a lane built in this run are
   removed once it is done (an image venv holds torch's CUDA build with its nvidia wheels: 5.5-7.5 GB); a checkout's
   own, there before the run, are kept.

Every make command takes the CI's extras (`EXTRAS`: the `mpich` extra too, for the tests that run a bare `mpirun`
from the venv). A failing command ends CI with its exit status.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
EXTRAS = "EXTRAS=mpi,mpich,test"
# command(s) that must be found -> the Debian package that brings them: sshd, pdsh and Open MPI for the multi-node
# launch tests (tests/test_launch_ssh.py), ip and tc for the namespace and emulated-fabric tests
SYSTEM_PACKAGES = ((("sshd",), "openssh-server"), (("pdsh",), "pdsh"), (("ompi_info",), "openmpi-bin"),
                   (("ip", "tc"), "iproute2"))
BACKGROUND_SETUP_MIN_GB = 25
# the lines of the background set-ups' log that say what each set up (repeated after lane latest)
SETUP_SUMMARY = re.compile(r"^\[(image|setup|build_ops)\] (\.gaudi-image|Intel Gaudi|cpu|cuda)")


def say(line: str, err: bool = False) -> None:
    print(f"[ci] {line}", file=sys.stderr if err else sys.stdout, flush=True)


def run(cmd: Sequence[str], **kw) -> None:
    """A command of a lane; its failure ends CI with its exit status."""
    status = subprocess.run(list(cmd), cwd=REPO, check=False, **kw).returncode
    if status != 0:
        raise SystemExit(status)


def make(*args: str) -> list[str]:
    return ["make", *args, EXTRAS]


def minutes(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60} min {s % 60} s"


def free_gb() -> int:
    """Free space on the checkout's disk, in whole GB (what df reports as available)."""
    return shutil.disk_usage(REPO).free // 2**30


def missing_packages(which: Callable[[str], str | None] = shutil.which,
                     executable: Callable[[str], bool] = lambda p: os.access(p, os.X_OK)) -> list[str]:
    """The SYSTEM_PACKAGES whose commands are not all found (sshd also in /usr/sbin, off a user's PATH)."""
    out = []
    for commands, package in SYSTEM_PACKAGES:
        found = all(which(c) or (c == "sshd" and executable("/usr/sbin/sshd")) for c in commands)
        if not found:
            out.append(package)
    return out


def install_system_packages() -> None:
    """Step 1 of the module docstring: quietly, each apt step bounded in time."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    missing = missing_packages()
    if not missing:
        return
    say(f"installing {' '.join(missing)} for the multi-node launch tests")
    env, quiet = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, {"stdout": subprocess.DEVNULL,
                                                                       "stderr": subprocess.DEVNULL}
    for cmd in (["timeout", "300", "apt-get", "update", "-qq"],
                ["timeout", "600", "apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
        if subprocess.run(cmd, env=env, check=False, **quiet).returncode != 0:
            say(f"could not install {' '.join(missing)}: the multi-node launch tests will skip")
            return


def version_key(text: str) -> list:
    """Sort key of `sort -V`: digit runs compare as numbers."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part]


def find_fork() -> str:
    """Step 2 of the module docstring: the fork's absolute path, or CI ends saying what to set."""
    fork = os.environ.get("HABANA_DS", "")
    if not fork:
        origin = subprocess.run(["git", "config", "--get", "remote.origin.url"], cwd=REPO, capture_output=True,
                                text=True, check=False).stdout.strip()
        origin = origin[:-len("/.git")] if origin.endswith("/.git") else origin
        for where in (REPO / "..", Path(f"{origin}/..")):
            archives = [p for p in (where / "shared" / "third_party").glob("habana-deepspeed-*.tar.gz")
                        if not p.name.endswith("-tests.tar.gz")]  # the fork's releases, not its tests' archives
            if archives:
                fork = str(max(archives, key=lambda p: version_key(str(p))))
                break
    if not fork or not os.path.isdir(os.path.dirname(os.path.abspath(fork))):
        say(f"Gaudi lanes: Habana's DeepSpeed fork not found{f' ({fork})' if fork else ''}: set HABANA_DS to its "
            f"source tree or release archive", err=True)
        raise SystemExit(1)
    return os.path.abspath(fork)


def gaudi_releases() -> list[str]:
    """Every tested Gaudi release (a stacks/gaudi-<release>.txt), newest first."""
    names = [m.group(1) for p in (REPO / "stacks").iterdir() if (m := re.fullmatch(r"gaudi-(.*)\.txt", p.name))]
    return sorted(names, key=version_key, reverse=True)


@dataclass(frozen=True)
class GaudiLane:
    """A Gaudi release's lane: the venv playing the image, the venv set up from it, what CI runs there."""

    release: str
    fork: str
    unit_tests: bool  # DeepSpeed's own unit tests on the fork (the oldest release's lane)

    @property
    def venvs(self) -> tuple[str, str]:
        return f".gaudi-image-{self.release}", f".venv-gaudi-{self.release}"

    def setup(self) -> list[str]:
        return ["make", "--no-print-directory", "gaudi-setup", f"GAUDI={self.release}", f"HABANA_DS={self.fork}",
                EXTRAS]

    def commands(self) -> list[list[str]]:
        image, venv = (str(REPO / v) for v in self.venvs)
        out = [make("test-gaudi", f"GAUDI={self.release}", f"HABANA_DS={self.fork}")]
        if self.unit_tests:
            out.append(make("test-ds-unit", f"VENV={self.venvs[1]}", f"PYTHON={image}/bin/python",
                            f"STACK=gaudi-{self.release}", f"TORCH_EXTENSIONS_DIR={venv}/torch_extensions"))
        return out


class BackgroundSetups:
    """The Gaudi lanes' set-ups, one after the other, in a process group of their own each, logged to `log`; stop()
    ends the one under way (CI ending early)."""

    def __init__(self, lanes: Sequence[GaudiLane], log: Path):
        self.lanes, self.log = lanes, log
        self.status: int | None = None
        self.seconds = 0.0
        self._proc: subprocess.Popen | None = None
        self._stopped = False
        self._lock = threading.Lock()  # no set-up starts once stop() has run
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        t = time.monotonic()
        status = 0
        with open(self.log, "w") as out:
            for lane in self.lanes:
                with self._lock:
                    if self._stopped:
                        break
                    self._proc = subprocess.Popen(lane.setup(), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                                  start_new_session=True)
                status = self._proc.wait()
                if status != 0:
                    break
        self.seconds, self.status = time.monotonic() - t, status

    def wait(self) -> int:
        self._thread.join()
        return self.status or 0

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def summary(self) -> list[str]:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.is_file() else []
        return [ln for ln in lines if SETUP_SUMMARY.match(ln)]

    def tail(self, n: int = 60) -> str:
        return "\n".join(deque(self.log.read_text(errors="replace").splitlines(), maxlen=n))


def start_background_setups(lanes: Sequence[GaudiLane]) -> BackgroundSetups | None:
    """The Gaudi lanes' set-ups, started beside lane latest's tests where the disk holds every lane's venvs at once
    (BACKGROUND_SETUP_MIN_GB free, after lane latest's set-up); None: each lane sets up when it starts."""
    min_gb = int(os.environ.get("BACKGROUND_SETUP_MIN_GB", BACKGROUND_SETUP_MIN_GB))
    if free_gb() < min_gb:
        say(f"{free_gb()} GB free (under {min_gb}): each Gaudi lane sets up when it starts")
        return None
    background = BackgroundSetups(lanes, Path(tempfile.mkdtemp()) / "setup.log")
    background.start()
    say(f"{free_gb()} GB free: the Gaudi lanes' set-ups run in the background while lane latest runs "
        f"(log: {background.log})")
    return background


def gaudi_lane(lane: GaudiLane, set_up_before: bool, built: Sequence[str]) -> None:
    """One Gaudi lane; `built`, the venvs this run made for it, removed after it."""
    ta = time.monotonic()
    say(f"lane gaudi-{lane.release}: {free_gb()} GB free on the checkout's disk")
    for cmd in lane.commands():
        run(cmd)
    say(f"lane gaudi-{lane.release}: {minutes(time.monotonic() - ta)}, set-up "
        f"{'done beforehand, in the background' if set_up_before else 'included'}")
    if built:
        for v in built:
            shutil.rmtree(REPO / v, ignore_errors=True)
        say(f"lane gaudi-{lane.release}: removed the venvs this run built for it ({' '.join(built)}): {free_gb()} GB "
            f"free")


def main() -> int:
    install_system_packages()
    fork = find_fork()
    releases = gaudi_releases()
    lanes = [GaudiLane(r, fork, unit_tests=(r == releases[-1])) for r in releases]
    # the venvs this run builds, decided before any lane runs (a checkout's own are kept and reused)
    built = {lane.release: [v for v in lane.venvs if not (REPO / v).exists()] for lane in lanes}
    t0 = time.monotonic()
    # lane latest: its set-up first and on its own (the Gaudi lanes' set-ups install the same checkout, its egg-info)
    run(make("setup"))
    background = start_background_setups(lanes)
    try:
        run(make("test"))
        run(make("test-ds-unit"))  # on upstream's DeepSpeed here, on Habana's fork in the oldest Gaudi lane
        say(f"lane latest: {minutes(time.monotonic() - t0)}, set-up included")
        if background is not None:
            if background.wait() != 0:
                print(background.tail(), file=sys.stderr, flush=True)
                say(f"the Gaudi lanes' set-ups failed (above; log: {background.log})", err=True)
                return 1
            say(f"the Gaudi lanes' set-ups: {minutes(background.seconds)} in the background, during lane latest:")
            for line in background.summary():
                print(line, flush=True)
    finally:
        if background is not None:
            background.stop()  # CI ending early: the set-up under way ends with it
    for lane in lanes:
        gaudi_lane(lane, background is not None, built[lane.release])
    say(f"all lanes: {minutes(time.monotonic() - t0)}")
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the background set-up ends too
    sys.exit(main())
