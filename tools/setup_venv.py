"""`make setup`: a checkout's venv, installed as the support matrix says (docs/install.md). Run by the Python that
makes the venv (the Makefile's $(PYTHON)), with the standard library only:

    python3 tools/setup_venv.py --venv .venv --stack auto --extras mpi,test [--wheelhouse DIR] [--build_ops 0]

The steps, in order (each command is printed before it runs, as make echoes a recipe's lines):
1. the venv, unless it exists: made with --system-site-packages where this Python imports torch (a Gaudi or GPU
   image: its torch is kept), and then given this Python's own site-packages where this Python is itself a venv
   (tools/parent_site.py), taking pip from it too (--without-pip) where it has one;
2. pip upgraded (not offline);
3. the stack's constraints written (tools/stacks.py constraints): the pins every install below takes;
4. torch, the stack's, only when the venv imports none (never from a wheelhouse: it carries no torch);
5. offline, every wheel of the wheelhouse first, each checked against its recorded sha256; then the toolkit,
   editable, with its extras; the `hpu` extra too where habana_frameworks is importable;
6. DeepSpeed's scripts given the venv's Python where DeepSpeed is the image's (tools/venv_scripts.py);
7. an import of every package; DeepSpeed's ops built into the venv's op cache (python -m ds_tools.build_ops) unless
   --build_ops 0;
8. the stamp (<venv>/.installed) that tells make the venv is done.

Offline (--wheelhouse DIR, built by `make wheelhouse`): pip takes --no-index --find-links DIR. Every wheel of DIR is
installed from its requirements.txt with --require-hashes (each checked against the sha256 recorded when the
wheelhouse was built), then the toolkit itself, editable, with --no-deps (its requirements are what that install put
there), built without pip's isolated build environment where the venv has the build backend (setuptools >= 68 with
PEP 660 editables, and wheel), which the hashed install puts there from the wheelhouse: an isolated build would take
them from the wheelhouse again, unchecked.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ds_core", "ds_tools", "bert_ref", "bridgetower_ds", "launch")
# the build backend an offline editable install can use without pip's isolated build environment
BUILD_BACKEND_OK = "import setuptools, wheel; assert int(setuptools.__version__.split('.')[0]) >= 68"


class SetupFailed(Exception):
    """A step failed or cannot be done; the message says which. `status` is the process's exit status."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def shown(arg: object) -> str:
    """An argument as printed: a path inside the checkout relative to it, as make echoes the recipe's lines."""
    text = str(arg)
    return text[len(str(REPO)) + 1:] if text.startswith(f"{REPO}/") else text


class Shell:
    """Runs the steps' commands in the checkout (printing each first) and answers the probes (`succeeds`: whether a
    command exits 0, its output hidden). Tests replace it with a recorder."""

    def run(self, cmd: Sequence[str]) -> None:
        print(" ".join(shlex.quote(shown(c)) for c in cmd), flush=True)
        status = subprocess.run([str(c) for c in cmd], cwd=REPO, check=False).returncode
        if status != 0:
            raise SetupFailed(f"[setup] failed (exit {status}): {' '.join(map(str, cmd))}", status)

    def succeeds(self, cmd: Sequence[str]) -> bool:
        return subprocess.run([str(c) for c in cmd], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              check=False).returncode == 0

    def output(self, cmd: Sequence[str]) -> str:
        return subprocess.run([str(c) for c in cmd], cwd=REPO, capture_output=True, text=True,
                              check=False).stdout.strip()

    def say(self, line: str, err: bool = False) -> None:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)


def is_venv_with_pip() -> bool:
    """This Python is a venv that has pip: the new venv takes pip, setuptools and wheel from it (through
    tools/parent_site.py) rather than from ensurepip, whose bundled setuptools (65 on Python 3.11) would shadow the
    env's newer one."""
    if sys.prefix == sys.base_prefix:
        return False
    try:
        import pip  # noqa: F401
    except ImportError:
        return False
    return True


def make_venv(sh: Shell, venv: Path, python: str) -> None:
    """Step 1: the venv, keeping an installed torch (see the module docstring)."""
    if not sh.succeeds([python, "-c", "import torch"]):
        sh.run([python, "-m", "venv", venv])
        return
    sh.say(f"[setup] torch found in {python}: creating {venv} with --system-site-packages to keep it")
    sh.run([python, "-m", "venv", "--system-site-packages", *(["--without-pip"] if is_venv_with_pip() else []), venv])
    sh.run([python, REPO / "tools" / "parent_site.py", venv])


def install_wheelhouse(sh: Shell, py: Path, wheelhouse: str) -> None:
    """Offline, before the toolkit: every wheel of the wheelhouse, each checked against its recorded sha256."""
    wheels = os.path.abspath(wheelhouse)
    sh.run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels, "--require-hashes", "-r",
            f"{wheels}/requirements.txt"])


def pip_source(sh: Shell, py: Path, wheelhouse: str | None) -> list[str]:
    """Where the toolkit's own install takes packages from: the index, or the wheelhouse alone with no dependencies
    (install_wheelhouse put them there; see the module docstring)."""
    if not wheelhouse:
        return []
    offline = ["--no-index", "--find-links", os.path.abspath(wheelhouse), "--no-deps"]
    return offline + (["--no-build-isolation"] if sh.succeeds([py, "-c", BUILD_BACKEND_OK]) else [])


def ensure_torch(sh: Shell, py: Path, constraints: Path, wheelhouse: str | None) -> None:
    """Step 4: the stack's torch where the venv imports none; an installed one is kept."""
    if sh.succeeds([py, "-c", "import torch"]):
        sh.say(f"[setup] keeping installed torch {sh.output([py, '-c', 'import torch; print(torch.__version__)'])}")
        return
    if wheelhouse:
        raise SetupFailed("[setup] no torch importable and a wheelhouse never carries torch: install the target's "
                          "torch build first")
    pin = next((ln for ln in constraints.read_text().splitlines() if ln.startswith("torch==")), "torch") \
        if constraints.is_file() else "torch"
    sh.say(f"[setup] no torch importable: installing {pin}")
    sh.run([py, "-m", "pip", "install", "-q", "-c", constraints, "torch"])


def setup(venv: Path, stack: str, extras: str, wheelhouse: str | None = None, build_ops: bool = True,
          sh: Shell | None = None, python: str = sys.executable) -> None:
    """Every step of the module docstring, in order."""
    sh = sh or Shell()
    py, constraints = venv / "bin" / "python", venv / "constraints.txt"
    if not os.access(py, os.X_OK):
        make_venv(sh, venv, python)
    if not wheelhouse:
        sh.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    sh.run([py, REPO / "tools" / "stacks.py", "constraints", "--stack", stack, "--out", constraints])
    ensure_torch(sh, py, constraints, wheelhouse)
    if wheelhouse:
        install_wheelhouse(sh, py, wheelhouse)
    sh.run([py, "-m", "pip", "install", "-q", *pip_source(sh, py, wheelhouse), "-c", constraints, "-e",
            f".[{extras}]"])
    if sh.succeeds([py, "-c", "import habana_frameworks"]):
        sh.run([py, "-m", "pip", "install", "-q", *pip_source(sh, py, wheelhouse), "-c", constraints, "-e", ".[hpu]"])
    sh.run([py, REPO / "tools" / "venv_scripts.py", venv])
    sh.run([py, "-c", f"import {', '.join(PACKAGES)}; print('[setup] ok')"])
    if build_ops:
        sh.run([py, "-m", "ds_tools.build_ops"])
    (venv / ".installed").touch()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/setup_venv.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default=".venv", help="the venv to make or complete (relative to the checkout)")
    ap.add_argument("--stack", default="auto", help="a stack of stacks/ (auto: the one the installed packages match)")
    ap.add_argument("--extras", default="mpi,test", help="the toolkit's extras (pyproject.toml)")
    ap.add_argument("--wheelhouse", default="", help="install offline from this directory of wheels")
    ap.add_argument("--build_ops", default="1", help="0: leave DeepSpeed's op builds to the first run; else build them")
    args = ap.parse_args(argv)
    venv = Path(args.venv) if Path(args.venv).is_absolute() else REPO / args.venv
    try:
        setup(venv, args.stack, args.extras, args.wheelhouse or None, args.build_ops != "0")
    except SetupFailed as e:
        print(e, file=sys.stderr, flush=True)
        return e.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
