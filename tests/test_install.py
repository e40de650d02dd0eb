"""`make setup` where torch lives in a venv: a GPU image whose python3 is itself a venv holding the CUDA torch.

An "image" venv is made here that holds this interpreter's torch (a .pth file pointing at the directory the imported
torch package lies in, so nothing is downloaded); a copy of the working tree then runs `make setup
PYTHON=<image>/bin/python3 WHEELHOUSE=<empty dir>`, with the network refused where `unshare -n` is allowed. Without
tools/parent_site.py `.venv` (made with --system-site-packages) sees the base interpreter's packages only: no torch,
and setup stops. With it, `.venv` must import the image's torch (no second copy in .venv) and DeepSpeed, and the
toolkit from the copy, and an active venv's `deepspeed` must be a script that runs .venv's Python."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from conftest import REPO

pytestmark = pytest.mark.slow


def image_venv(root: Path) -> Path:
    """A venv without pip whose site-packages holds (through a .pth line) the directory of the imported torch."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    (site / "image_torch.pth").write_text(str(Path(torch.__file__).resolve().parents[1]) + "\n")
    return root / "bin" / "python3"


def copy_tree(dst: Path) -> None:
    """The working tree as a fresh clone would have it (tracked and new files, nothing ignored such as .venv)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           stdout=subprocess.PIPE).stdout.decode().split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dst / f)


def no_network() -> list[str]:
    """`unshare -n` where this user may make a network namespace (the install must not need one); else nothing:
    --no-index keeps pip off the network anyway."""
    ok = shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True,
                                                    check=False).returncode == 0
    return ["unshare", "-n"] if ok else []


def test_setup_keeps_the_torch_of_a_venv_python(tmp_path):
    # the premise: the image holds the build backend the Makefile takes without a wheelhouse (its BUILD_OK); an image
    # with an older setuptools (Python 3.11's venv bundles 65) takes it from the wheelhouse, which this one leaves empty
    import setuptools

    if not (Path(setuptools.__file__).resolve().parents[1] == Path(torch.__file__).resolve().parents[1]
            and int(setuptools.__version__.split(".")[0]) >= 68):
        pytest.skip(f"torch's site-packages has no setuptools >= 68 (this one: {setuptools.__version__} at "
                    f"{Path(setuptools.__file__).parent}): an offline set-up there needs the wheelhouse's")
    py = image_venv(tmp_path / "image")
    clone = tmp_path / "clone"
    copy_tree(clone)
    wheels = tmp_path / "wheelhouse"  # empty: everything the toolkit needs is in the image already
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("")  # what `make wheelhouse` pins then: no wheel beyond the image's
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    proc = subprocess.run([*no_network(), "make", "setup", f"PYTHON={py}", f"WHEELHOUSE={wheels}", "EXTRAS=test",
                           "BUILD_OPS=0"],  # the ops' builds are tests/test_ops_check.py's
                          check=False, cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "is a venv" in proc.stdout, proc.stdout[-4000:]
    probe = ("import torch, deepspeed, ds_core, pathlib; "
             "print(pathlib.Path(torch.__file__).resolve()); print(pathlib.Path(ds_core.__file__).resolve())")
    out = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c", probe], cwd=tmp_path, env=env, check=True,
                         stdout=subprocess.PIPE, text=True, timeout=300).stdout.strip().splitlines()
    assert Path(out[-2]) == Path(torch.__file__).resolve(), out
    assert Path(out[-1]).is_relative_to(clone.resolve()), out
    venv_site = Path(sysconfig.get_path("purelib", vars={"base": str(clone / ".venv"),
                                                         "platbase": str(clone / ".venv")}))
    assert not (venv_site / "torch").exists(), "a second torch was installed into .venv"
    # DeepSpeed is the image's too: its launcher script in .venv/bin runs .venv's Python (tools/venv_scripts.py), so
    # an active venv's `deepspeed` starts ranks that import the toolkit
    launcher = clone / ".venv" / "bin" / "deepspeed"
    assert launcher.read_text().splitlines()[0] == f"#!{clone / '.venv' / 'bin' / 'python'}", launcher.read_text()
    probe = subprocess.run([str(launcher), "--help"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=300)
    assert probe.returncode == 0 and "--hostfile" in probe.stdout, probe.stdout[-2000:]
