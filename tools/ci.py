"""CI, as `.ci/run` runs it on a fresh clone: one lane per stack of the support matrix (stacks/, docs/gaudi.md), each
the Makefile's own commands, each timed (docs/development.md, "CI").

1. As root, the system packages the multi-node launch tests need, where missing (`SYSTEM_PACKAGES`); when that fails
   those tests skip and say why.
2. Habana's DeepSpeed fork for the Gaudi lanes (not on PyPI): HABANA_DS, else the newest release archive in
   shared/third_party/ beside this checkout or beside the repository it was cloned from.
3. Lane latest: `make setup`, then `make test` and `make test-ds-unit` (DeepSpeed's own unit tests with the toolkit's
   changes on and off).
4. A lane per Gaudi release, newest first: `make gaudi-setup`, then `make test-gaudi`. Every Gaudi lane installs the
   same fork, so the stack tests decided by DeepSpeed alone run once, in the fork's own lane (the oldest release's,
   which also runs DeepSpeed's unit tests on the fork); the other Gaudi lanes run the stack tests marked `each_gaudi`
   (decided by torch, transformers, accelerate, datasets or Python, which differ between releases). Where the disk
   holds every lane's venvs at once (BACKGROUND_SETUP_MIN_GB, 25 GB), the Gaudi lanes run side by side in the
   background while lane latest runs (their set-ups one at a time, at the lowest CPU priority), and their output is
   printed after it: a suite of multi-rank tests leaves a good part of two cores idle (ranks waiting on each other,
   on process starts and on the bounds the tests set). Elsewhere they run after lane latest, one after the other. The
   venvs a lane built in this run are removed once it is done (an image venv holds torch's CUDA build with its nvidia
   wheels: 5.5-7.5 GB); a checkout's own, there before the run, are kept.

Every make command takes the CI's extras (`EXTRAS`: the `mpich` extra too, for the tests that run a bare `mpirun`
from the venv). A failing command ends CI with its exit status (a failing Gaudi lane in the background: once lane
latest and the other Gaudi lanes have ended).
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
# what a Gaudi lane other than the fork's own runs (pyproject.toml's markers)
EACH_GAUDI = "stack and each_gaudi"
# the lines of a background set-up's log that say what it set up (repeated after lane latest)
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
    # the fork's own lane (the oldest release's): every stack test and DeepSpeed's unit tests on the fork; the other
    # Gaudi lanes install the same fork and run only the stack tests marked `each_gaudi` (what differs between them)
    fork_lane: bool

    @property
    def venvs(self) -> tuple[str, str]:
        return f".gaudi-image-{self.release}", f".venv-gaudi-{self.release}"

    def setup(self) -> list[str]:
        return ["make", "--no-print-directory", "gaudi-setup", f"GAUDI={self.release}", f"HABANA_DS={self.fork}",
                EXTRAS]

    def commands(self) -> list[list[str]]:
        image, venv = (str(REPO / v) for v in self.venvs)
        tests = [] if self.fork_lane else [f"STACK_TESTS={EACH_GAUDI}"]
        out = [make("test-gaudi", f"GAUDI={self.release}", f"HABANA_DS={self.fork}", *tests)]
        if self.fork_lane:
            out.append(make("test-ds-unit", f"VENV={self.venvs[1]}", f"PYTHON={image}/bin/python",
                            f"STACK=gaudi-{self.release}", f"TORCH_EXTENSIONS_DIR={venv}/torch_extensions"))
        return out


def remove_built(lane: GaudiLane, built: Sequence[str]) -> str | None:
    """The venvs this run built for a lane, removed once the lane is done (an image venv: 5.5-7.5 GB); the line that
    says so."""
    if not built:
        return None
    for v in built:
        shutil.rmtree(REPO / v, ignore_errors=True)
    return (f"lane gaudi-{lane.release}: removed the venvs this run built for it ({' '.join(built)}): {free_gb()} GB "
            f"free")


class BackgroundLanes:
    """The Gaudi lanes beside lane latest, each in a thread of its own: its set-up, then its commands, every command
    in a process group of its own, logged to setup-<release>.log and lane-<release>.log in `log_dir`. The set-ups
    run one at a time (they install the same checkout, its egg-info), the fork's own lane first (its tests are the
    longest), each at the lowest CPU priority, on what the tests leave idle: a set-up (pip, and compiling DeepSpeed's
    ops on both cores) has no time bound, and the tests beside it do. A lane's first failing command ends that lane;
    stop() ends every command under way and starts no other (CI ending early)."""

    def __init__(self, lanes: Sequence[GaudiLane], built: dict[str, list[str]], log_dir: Path):
        self.lanes = sorted(lanes, key=lambda lane: not lane.fork_lane)  # the order the set-ups take
        self.built, self.log_dir = built, log_dir
        self.status: dict[str, int] = {}  # per release, once its lane has ended
        self.failed: dict[str, Path] = {}  # per release, the log of the command that failed
        self.seconds: dict[str, float] = {}
        self.removed: dict[str, str] = {}  # the line each lane's removal of its venvs said, printed by report()
        self._procs: dict[str, subprocess.Popen] = {}
        self._stopped = False
        self._lock = threading.Lock()  # no command starts once stop() has run
        self._setups = [threading.Event() for _ in self.lanes]  # set-up i may start once event i is set
        self._setups[0].set()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(self.lanes))]

    def logs(self, lane: GaudiLane) -> tuple[Path, Path]:
        return self.log_dir / f"setup-{lane.release}.log", self.log_dir / f"lane-{lane.release}.log"

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _command(self, release: str, cmd: list[str], log: Path) -> int:
        with self._lock:
            if self._stopped:
                return 1
            with open(log, "a") as out:
                proc = self._procs[release] = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                                               start_new_session=True)
        return proc.wait()

    def _run(self, i: int) -> None:
        lane, t = self.lanes[i], time.monotonic()
        setup_log, lane_log = self.logs(lane)
        self._setups[i].wait()
        status = self._command(lane.release, ["nice", "-n", "19", *lane.setup()], setup_log)
        if i + 1 < len(self.lanes):
            self._setups[i + 1].set()  # the next lane's set-up, whether or not this one succeeded
        if status != 0:
            self.failed[lane.release] = setup_log
        for cmd in lane.commands() if status == 0 else []:
            status = self._command(lane.release, cmd, lane_log)
            if status != 0:
                self.failed[lane.release] = lane_log
                break
        self.seconds[lane.release] = time.monotonic() - t
        if status == 0:
            removed = remove_built(lane, self.built[lane.release])
            if removed:
                self.removed[lane.release] = removed
        self.status[lane.release] = status

    def wait(self) -> int:
        """The first failed lane's status (in the order of `self.lanes`), else 0."""
        for t in self._threads:
            t.join()
        return next((self.status[lane.release] for lane in self.lanes if self.status.get(lane.release)), 0)

    @property
    def done(self) -> bool:
        return len(self.status) == len(self.lanes)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            procs = list(self._procs.values())
        for event in self._setups:
            event.set()  # a lane waiting for its set-up's turn starts nothing and ends
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def report(self) -> None:
        """After lane latest, newest release first: each lane's set-up summary, its commands' whole output and its
        time (the whole set-up log, for a set-up that failed)."""
        for lane in sorted(self.lanes, key=lambda lane: version_key(lane.release), reverse=True):
            setup_log, lane_log = self.logs(lane)
            lines = setup_log.read_text(errors="replace").splitlines() if setup_log.is_file() else []
            failed = self.failed.get(lane.release) == setup_log
            for ln in (lines if failed else [ln for ln in lines if SETUP_SUMMARY.match(ln)]):
                print(ln, flush=True)
            if lane_log.is_file():
                print(lane_log.read_text(errors="replace"), end="", flush=True)
            if lane.release in self.seconds:
                say(f"lane gaudi-{lane.release}: {minutes(self.seconds[lane.release])}, set-up included, in the "
                    f"background beside lane latest{' (failed)' if self.status.get(lane.release) else ''}")
            if lane.release in self.removed:
                say(self.removed[lane.release])

    def tail(self, n: int = 60) -> str:
        """The last lines of every lane still under way (CI ending early)."""
        out = []
        for lane in self.lanes:
            if lane.release in self.status:
                continue
            text = "".join(p.read_text(errors="replace") for p in self.logs(lane) if p.is_file())
            out.append(f"lane gaudi-{lane.release}, under way:\n" + "\n".join(deque(text.splitlines(), maxlen=n)))
        return "\n".join(out)


def start_background_lanes(lanes: Sequence[GaudiLane], built: dict[str, list[str]]) -> BackgroundLanes | None:
    """The Gaudi lanes, started beside lane latest's tests where the disk holds every lane's venvs at once
    (BACKGROUND_SETUP_MIN_GB free, after lane latest's set-up); None: each runs after lane latest."""
    min_gb = int(os.environ.get("BACKGROUND_SETUP_MIN_GB", BACKGROUND_SETUP_MIN_GB))
    if free_gb() < min_gb:
        say(f"{free_gb()} GB free (under {min_gb}): each Gaudi lane sets up and runs after lane latest")
        return None
    background = BackgroundLanes(lanes, built, Path(tempfile.mkdtemp()))
    background.start()
    say(f"{free_gb()} GB free: the Gaudi lanes (set-up, then tests) run in the background while lane latest runs "
        f"(logs: {background.log_dir})")
    return background


def gaudi_lane(lane: GaudiLane, built: Sequence[str]) -> None:
    """One Gaudi lane after lane latest (set-up included); `built`, the venvs this run made for it, removed after."""
    ta = time.monotonic()
    say(f"lane gaudi-{lane.release}: {free_gb()} GB free on the checkout's disk")
    for cmd in lane.commands():
        run(cmd)
    say(f"lane gaudi-{lane.release}: {minutes(time.monotonic() - ta)}, set-up included")
    removed = remove_built(lane, built)
    if removed:
        say(removed)


def main() -> int:
    install_system_packages()
    fork = find_fork()
    releases = gaudi_releases()
    lanes = [GaudiLane(r, fork, fork_lane=(r == releases[-1])) for r in releases]
    # the venvs this run builds, decided before any lane runs (a checkout's own are kept and reused)
    built = {lane.release: [v for v in lane.venvs if not (REPO / v).exists()] for lane in lanes}
    t0 = time.monotonic()
    # lane latest: its set-up first and on its own (the Gaudi lanes' set-ups install the same checkout, its egg-info)
    run(make("setup"))
    background = start_background_lanes(lanes, built)
    try:
        run(make("test"))
        run(make("test-ds-unit"))  # on upstream's DeepSpeed here, on Habana's fork in the oldest Gaudi lane
        say(f"lane latest: {minutes(time.monotonic() - t0)}, set-up included")
        if background is not None:
            status = background.wait()
            background.report()
            if status != 0:
                say(f"a Gaudi lane failed (above; logs: {background.log_dir})", err=True)
                return status
    finally:
        if background is not None and not background.done:  # CI ending early: what was under way, ended
            background.stop()
            print(background.tail(), file=sys.stderr, flush=True)
    if background is None:
        for lane in lanes:
            gaudi_lane(lane, built[lane.release])
    say(f"all lanes: {minutes(time.monotonic() - t0)}")
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the background set-up ends too
    sys.exit(main())
