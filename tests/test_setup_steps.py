"""`make setup`'s steps (tools/setup_venv.py) on the machines it meets, with a recorder in place of the shell: what
is run, in which order and with which pip arguments, decided from what the probes answer (does this Python import
torch, does the venv, is habana_frameworks there, has the venv the build backend). A real set-up is
tests/test_install.py's (slow)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import REPO, make_dry_run

_spec = importlib.util.spec_from_file_location("setup_venv_tool", REPO / "tools" / "setup_venv.py")
sv = sys.modules["setup_venv_tool"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sv)


class Recorder(sv.Shell):
    """The commands set-up runs (as strings), and probes answered from `has`: "python torch" (the Python that makes
    the venv imports torch), "venv torch", "habana", "backend" (setuptools >= 68 and wheel in the venv)."""

    def __init__(self, has: set[str]):
        self.has, self.cmds, self.said = has, [], []

    def run(self, cmd) -> None:
        self.cmds.append(" ".join(map(str, cmd)))
        if list(map(str, cmd[1:3])) == ["-m", "venv"]:
            Path(cmd[-1]).mkdir(parents=True)  # what `python -m venv` leaves for the stamp

    def succeeds(self, cmd) -> bool:
        who = "venv" if str(cmd[0]).endswith("/bin/python") else "python"
        code = str(cmd[-1])
        if code == "import torch":
            return f"{who} torch" in self.has
        if code == "import habana_frameworks":
            return "habana" in self.has
        if code == sv.BUILD_BACKEND_OK:
            return "backend" in self.has
        raise AssertionError(f"unexpected probe {cmd}")

    def output(self, cmd) -> str:
        return "2.9.1"

    def say(self, line: str, err: bool = False) -> None:
        self.said.append(line)


def set_up(tmp_path: Path, has: set[str], **kw) -> Recorder:
    sh = Recorder(has)
    sv.setup(tmp_path / "v", kw.pop("stack", "auto"), kw.pop("extras", "mpi,test"), sh=sh, python="python3", **kw)
    return sh


def pip_installs(sh: Recorder) -> list[str]:
    return [c for c in sh.cmds if " -m pip install" in c and "--upgrade pip" not in c]


def test_a_fresh_machine_gets_the_stacks_torch_and_every_step_in_order(tmp_path):
    sh = set_up(tmp_path, set())
    v = tmp_path / "v"
    assert sh.cmds[0] == f"python3 -m venv {v}"  # no torch to keep: a plain venv
    assert sh.cmds[1] == f"{v}/bin/python -m pip install -q --upgrade pip"
    assert sh.cmds[2] == f"{v}/bin/python {REPO}/tools/stacks.py constraints --stack auto --out {v}/constraints.txt"
    # every install of torch and of the toolkit takes the stack's constraints, written before them
    assert pip_installs(sh) == [f"{v}/bin/python -m pip install -q -c {v}/constraints.txt torch",
                                f"{v}/bin/python -m pip install -q -c {v}/constraints.txt -e .[mpi,test]"]
    assert sh.cmds[-3:] == [f"{v}/bin/python {REPO}/tools/venv_scripts.py {v}",
                            f"{v}/bin/python -c import ds_core, ds_tools, bert_ref, bridgetower_ds, launch; "
                            f"print('[setup] ok')",
                            f"{v}/bin/python -m ds_tools.build_ops"]  # the op builds last
    assert (v / ".installed").is_file()  # the stamp, after every step


def test_an_images_torch_is_kept_and_a_venv_python_lends_its_site_packages(tmp_path, monkeypatch):
    monkeypatch.setattr(sv, "is_venv_with_pip", lambda: True)
    sh = set_up(tmp_path, {"python torch", "venv torch"})
    v = tmp_path / "v"
    assert sh.cmds[:2] == [f"python3 -m venv --system-site-packages --without-pip {v}",
                           f"python3 {REPO}/tools/parent_site.py {v}"]
    assert not [c for c in pip_installs(sh) if c.endswith(" torch")]
    assert "[setup] keeping installed torch 2.9.1" in sh.said
    monkeypatch.setattr(sv, "is_venv_with_pip", lambda: False)  # a base or conda Python: ensurepip's pip
    assert set_up(tmp_path / "b", {"python torch", "venv torch"}).cmds[0].startswith(
        "python3 -m venv --system-site-packages /")


def test_an_existing_venv_is_completed_not_made_again(tmp_path):
    py = tmp_path / "v" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    sh = set_up(tmp_path, {"venv torch"})
    assert not [c for c in sh.cmds if " -m venv " in c] and len(pip_installs(sh)) == 1


@pytest.mark.parametrize("backend", [True, False])
def test_offline_every_install_takes_the_wheelhouse_alone(tmp_path, backend):
    wheels = tmp_path / "wh"
    sh = set_up(tmp_path, {"venv torch", "habana"} | ({"backend"} if backend else set()), wheelhouse=str(wheels))
    assert not [c for c in sh.cmds if "--upgrade pip" in c]  # pip is not upgraded offline
    src = f"--no-index --find-links {wheels} --no-deps" + (" --no-build-isolation" if backend else "")
    v = tmp_path / "v"
    # every wheel first, checked against the sha256 the wheelhouse recorded; then the toolkit without dependencies
    assert pip_installs(sh) == [f"{v}/bin/python -m pip install -q --no-index --find-links {wheels} --require-hashes "
                                f"-r {wheels}/requirements.txt",
                                f"{v}/bin/python -m pip install -q {src} -c {v}/constraints.txt -e .[mpi,test]",
                                f"{v}/bin/python -m pip install -q {src} -c {v}/constraints.txt -e .[hpu]"]


def test_offline_without_torch_stops_before_installing(tmp_path):
    with pytest.raises(sv.SetupFailed, match="a wheelhouse never carries torch"):
        set_up(tmp_path, set(), wheelhouse=str(tmp_path / "wh"))


def test_build_ops_0_leaves_the_builds_to_the_first_run(tmp_path):
    sh = set_up(tmp_path, {"venv torch"}, build_ops=False)
    assert not [c for c in sh.cmds if c.endswith("-m ds_tools.build_ops")] and (tmp_path / "v" / ".installed").is_file()


def test_the_makefile_hands_its_variables_to_the_setup_program(tmp_path):
    out = make_dry_run("setup", f"VENV={tmp_path / 'v'}", "STACK=gaudi-1.21", "EXTRAS=a,b", "BUILD_OPS=0",
                       "WHEELHOUSE=wh", "PYTHON=/opt/py").stdout.split()
    assert out == ["/opt/py", "tools/setup_venv.py", "--venv", str(tmp_path / "v"), "--stack", "gaudi-1.21",
                   "--extras", "a,b", "--build_ops", "0", "--wheelhouse", "wh"], out
    default = make_dry_run("setup").stdout.split()
    assert default[default.index("--build_ops") + 1] == "1" and "--wheelhouse" not in default
