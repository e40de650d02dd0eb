"""CI's orchestration (`.ci/run`, tools/ci.py) with stand-in commands: a `make` that records its arguments (and makes
the venvs a Gaudi set-up would) and an `apt-get` that records its own, on a PATH of their own, in a copy of the files
CI reads (.ci/run, tools/ci.py, stacks/). What is checked is the order of the lanes and of their set-ups, the
arguments each make command gets, the per-lane time lines, the removal of the venvs a run built, and how a failure
ends CI; nothing is installed or tested for real."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

_spec = importlib.util.spec_from_file_location("ci_tool", REPO / "tools" / "ci.py")
ci = sys.modules["ci_tool"] = importlib.util.module_from_spec(_spec)  # registered: its dataclasses look it up
_spec.loader.exec_module(ci)

FAKE_MAKE = """#!/bin/sh
echo "$*" >> "$FAKE_LOG"
target=""; gaudi=""
for a in "$@"; do case "$a" in GAUDI=*) gaudi="${a#GAUDI=}";; -*|*=*) ;; *) target="$a";; esac; done
case "$target" in gaudi-setup|test-gaudi)
  mkdir -p ".gaudi-image-$gaudi" ".venv-gaudi-$gaudi"; echo "[setup] .gaudi-image-$gaudi: stand-in set-up";; esac
echo "$target $(nice)" >> "$FAKE_LOG.nice"
if [ "$target" = "${FAKE_FAIL:-}" ]; then echo "stand-in $target failed"; exit 3; fi
"""
FAKE_APT = """#!/bin/sh
echo "$*" >> "$FAKE_APT_LOG"
"""
# what .ci/run and the stand-ins need from the system (no make, apt-get, sshd, pdsh, ompi_info, ip or tc)
SYSTEM_TOOLS = ("bash", "sh", "env", "python3", "dirname", "basename", "mkdir", "rm", "timeout", "git", "cat", "sed",
                "grep", "awk", "ls", "sort", "tail", "date", "df", "id", "mktemp", "setsid", "tr", "printf", "kill",
                "nice")


@pytest.fixture()
def sandbox(tmp_path) -> Path:
    """A checkout of CI's own files beside an empty shared/third_party, with the stand-ins on PATH."""
    root = tmp_path / "checkout"
    for rel in (".ci/run", "tools/ci.py", *(f"stacks/{p.name}" for p in (REPO / "stacks").glob("*.txt"))):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, root / rel)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in SYSTEM_TOOLS:
        real = shutil.which(name)
        if real:
            (bin_dir / name).symlink_to(real)
    for name, text in (("make", FAKE_MAKE), ("apt-get", FAKE_APT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "shared" / "third_party").mkdir(parents=True)
    return root


def run_ci(root: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = root.parent / "make.log"
    full = {"PATH": str(root.parent / "bin"), "HOME": str(root.parent), "FAKE_LOG": str(log),
            "FAKE_APT_LOG": str(root.parent / "apt.log"), "HABANA_DS": str(root.parent / "fork.tar.gz"), **env}
    full = {k: v for k, v in full.items() if v is not None}
    proc = subprocess.run([str(root / ".ci" / "run")], cwd=root.parent, env=full, capture_output=True, text=True,
                          timeout=120)
    return proc, log.read_text().splitlines() if log.exists() else []


def releases() -> list[str]:
    return sorted((p.stem.split("-", 1)[1] for p in (REPO / "stacks").glob("gaudi-*.txt")),
                  key=lambda r: [int(x) for x in r.split(".")], reverse=True)


def index(calls: list[str], *words: str) -> int:
    return next(i for i, c in enumerate(calls) if all(w in c.split() for w in words))


def test_lanes_in_order_with_the_gaudi_lanes_side_by_side_beside_lane_latest(sandbox):
    proc, calls = run_ci(sandbox, BACKGROUND_SETUP_MIN_GB="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls and all("EXTRAS=mpi,mpich,test" in c.split() for c in calls), calls
    newest, oldest = releases()[0], releases()[-1]
    setup, test, unit = index(calls, "setup"), index(calls, "test"), index(calls, "test-ds-unit")
    gaudi_setups = [index(calls, "gaudi-setup", f"GAUDI={r}") for r in releases()]
    lanes = [index(calls, "test-gaudi", f"GAUDI={r}") for r in releases()]
    # lane latest's set-up alone first; then, beside lane latest, the Gaudi lanes side by side, each its set-up and
    # then its tests, the set-ups one at a time and the fork's own lane (the oldest release's) first
    assert setup == 0 and test < unit and min(gaudi_setups) > setup
    assert all(s < t for s, t in zip(gaudi_setups, lanes)) and gaudi_setups == sorted(gaudi_setups, reverse=True)
    fork = str(sandbox.parent / "fork.tar.gz")
    assert all(f"HABANA_DS={fork}" in calls[i].split() for i in gaudi_setups + lanes)
    # the fork's own lane (the oldest release's) runs every stack test; the others the `each_gaudi` ones
    for r, i in zip(releases(), lanes):
        assert ("STACK_TESTS=stack and each_gaudi" in calls[i]) == (r != oldest), calls[i]
    # DeepSpeed's unit tests on the fork: in the oldest release's lane only, with that lane's venvs
    units = [c for c in calls if "test-ds-unit" in c.split()]
    fork_units = [c for c in units if f"STACK=gaudi-{oldest}" in c.split()]
    assert len(units) == 2 and len(fork_units) == 1 and set(fork_units[0].split()) == {
        "test-ds-unit", f"VENV=.venv-gaudi-{oldest}", f"PYTHON={sandbox}/.gaudi-image-{oldest}/bin/python",
        f"STACK=gaudi-{oldest}", f"TORCH_EXTENSIONS_DIR={sandbox}/.venv-gaudi-{oldest}/torch_extensions",
        "EXTRAS=mpi,mpich,test"}
    assert index(calls, "test-ds-unit", f"STACK=gaudi-{oldest}") > index(calls, "test-gaudi", f"GAUDI={oldest}")
    out = proc.stdout
    assert "[ci] lane latest: " in out and " s, set-up included" in out
    assert "(set-up, then tests) run in the background while lane latest runs" in out
    assert f"[setup] .gaudi-image-{newest}: stand-in set-up" in out  # the set-ups' summary lines, after lane latest
    assert out.index("[ci] lane latest: ") < out.index(f"[ci] lane gaudi-{newest}: ") < out.index(
        f"[ci] lane gaudi-{oldest}: ")  # reported newest first
    for r in releases():
        assert f"[ci] lane gaudi-{r}: " in out and f"lane gaudi-{r}: removed the venvs this run built for it " \
               f"(.gaudi-image-{r} .venv-gaudi-{r})" in out
        assert not (sandbox / f".gaudi-image-{r}").exists() and not (sandbox / f".venv-gaudi-{r}").exists()
    assert out.count("set-up included, in the background beside lane latest") == len(releases())
    # the set-ups at the lowest CPU priority, every test at the priority CI has
    niceness = [ln.split() for ln in (sandbox.parent / "make.log.nice").read_text().splitlines()]
    own = os.nice(0)
    assert {int(n) for t, n in niceness if t == "gaudi-setup"} == {min(19, own + 19)}
    assert {int(n) for t, n in niceness if t != "gaudi-setup"} == {own}
    assert "[ci] all lanes: " in out


def test_where_the_disk_is_short_each_gaudi_lane_sets_up_itself(sandbox):
    proc, calls = run_ci(sandbox, BACKGROUND_SETUP_MIN_GB="1000000")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [c for c in calls if "gaudi-setup" in c.split()]
    assert "(under 1000000): each Gaudi lane sets up and runs after lane latest" in proc.stdout
    assert proc.stdout.count(", set-up included") == 1 + len(releases())


def test_a_checkouts_own_venvs_are_kept(sandbox):
    newest = releases()[0]
    (sandbox / f".gaudi-image-{newest}").mkdir()
    proc, _ = run_ci(sandbox, BACKGROUND_SETUP_MIN_GB="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (sandbox / f".gaudi-image-{newest}").is_dir() and not (sandbox / f".venv-gaudi-{newest}").exists()
    assert f"removed the venvs this run built for it (.venv-gaudi-{newest})" in proc.stdout


def test_a_failing_command_ends_ci_with_its_status(sandbox):
    proc, calls = run_ci(sandbox, BACKGROUND_SETUP_MIN_GB="1000000", FAKE_FAIL="test")
    assert proc.returncode == 3 and not [c for c in calls if "test-gaudi" in c.split()], calls
    assert "lane latest:" not in proc.stdout


@pytest.mark.parametrize("failing", ["gaudi-setup", "test-gaudi"])
def test_a_failing_background_lane_ends_ci_with_its_status_and_output(sandbox, failing):
    proc, calls = run_ci(sandbox, BACKGROUND_SETUP_MIN_GB="0", FAKE_FAIL=failing)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"stand-in {failing} failed" in proc.stdout and "a Gaudi lane failed" in proc.stderr
    # the failing lane ends there, the other runs to its end; CI ends with the status once both have ended
    n = len(releases())
    assert len([c for c in calls if "gaudi-setup" in c.split()]) == n
    assert len([c for c in calls if "test-gaudi" in c.split()]) == n - (failing == "gaudi-setup") * n
    assert "[ci] all lanes: " not in proc.stdout


def test_the_fork_is_the_newest_release_archive_beside_the_checkout(sandbox):
    third_party = sandbox.parent / "shared" / "third_party"
    for name in ("habana-deepspeed-1.9.0.tar.gz", "habana-deepspeed-1.21.0.tar.gz",
                 "habana-deepspeed-1.22.0-tests.tar.gz"):
        (third_party / name).write_text("")
    proc, calls = run_ci(sandbox, HABANA_DS=None, BACKGROUND_SETUP_MIN_GB="1000000")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lane = calls[index(calls, "test-gaudi")].split()
    assert f"HABANA_DS={third_party.resolve() / 'habana-deepspeed-1.21.0.tar.gz'}" in lane, lane


def test_without_a_fork_ci_says_what_to_set(sandbox):
    proc, calls = run_ci(sandbox, HABANA_DS=None)
    assert proc.returncode == 1 and "set HABANA_DS" in proc.stderr and not calls


def test_missing_system_packages_are_installed_as_root(sandbox):
    proc, _ = run_ci(sandbox, BACKGROUND_SETUP_MIN_GB="1000000")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    apt = sandbox.parent / "apt.log"
    which = {name: None for name in ("sshd", "pdsh", "ompi_info", "ip", "tc")}
    missing = ci.missing_packages(which.get)  # the stand-in PATH has none of them; sshd may still be in /usr/sbin
    if os.geteuid() != 0:
        assert not apt.exists()
        return
    assert apt.read_text().splitlines() == ["update -qq", f"install -y -qq --no-install-recommends {' '.join(missing)}"]
    assert f"[ci] installing {' '.join(missing)} for the multi-node launch tests" in proc.stdout


def test_missing_packages_names_each_package_whose_commands_are_not_all_found():
    have = {"sshd", "pdsh", "ompi_info", "ip"}
    assert ci.missing_packages(lambda c: c if c in have else None) == ["iproute2"]  # tc missing
    assert ci.missing_packages(lambda c: None, lambda p: p == "/usr/sbin/sshd") == ["pdsh", "openmpi-bin", "iproute2"]
    assert ci.version_key("1.21.0") > ci.version_key("1.9.0") and sys.version_info >= (3, 9)
