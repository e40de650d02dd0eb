"""tools/wheelhouse.py without a network: pip downloads from a local --find-links directory of small wheels made here.

The toolkit's requirements are all in the base list except pysbd, which (in this made-up world) needs `fakedep>=1`
(two versions offered, 0.5 and 1.0) and, only with an extra nobody asks for, `neverwanted`; a pinned base version
that does not satisfy a requirement (h5py==1.0 against h5py>=3.8) is downloaded anyway. The build requirements
(setuptools, wheel) and their own requirements (here wheel's packaging>=24) always go in, even when the base has
them: pip's isolated build environment sees only the wheelhouse."""
from __future__ import annotations

import json
import subprocess
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.9 / 3.10 (e.g. Gaudi images): the same parser as a package
    import tomli as tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from conftest import REPO, make_dry_run


def fake_wheel(d: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(d / f"{dist}-py3-none-any.whl", "w") as z:
        meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                *(f"Requires-Dist: {r}" for r in requires)]
        z.writestr(f"{dist}.dist-info/METADATA", "\n".join(meta) + "\n")
        z.writestr(f"{dist}.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")


def test_wheelhouse_stops_at_the_base_and_follows_markers(tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    fake_wheel(links, "pysbd", "0.3.4", ("fakedep>=1", 'neverwanted; extra == "never"'))
    fake_wheel(links, "fakedep", "0.5")
    fake_wheel(links, "fakedep", "1.0")
    fake_wheel(links, "fakedep", "1.1")  # the newest: taken unless the stack's constraints pin 1.0
    fake_wheel(links, "h5py", "99.0")  # above the toolkit's floor
    fake_wheel(links, "setuptools", "99.0")
    fake_wheel(links, "wheel", "0.99", ("packaging>=24",))
    fake_wheel(links, "packaging", "24.0")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = [Requirement(r).name for r in project["dependencies"]]
    base = tmp_path / "base.txt"
    base.write_text("# the target\ntorch==2.11.0\nsetuptools\nwheel\npackaging\nh5py==1.0\n" +
                    "".join(f"{n}\n" for n in deps if n not in ("pysbd", "h5py")))
    out = tmp_path / "wh"
    # the stack's pins (what set-up installs with, stacks/*.txt) hold here too: the wheelhouse has what set-up asks for
    constraints = tmp_path / "stack.txt"
    constraints.write_text("fakedep==1.0\n")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "wheelhouse.py"), "--out", str(out), "--python", "3.12",
                           "--platform", "manylinux_2_28_x86_64", "--base", str(base), "--pip_arg=--no-index",
                           f"--pip_arg=--find-links={links}", "--constraints", str(constraints)], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    m = json.loads((out / "MANIFEST.json").read_text())
    got = {f["wheel"]: f["for"] for f in m["files"]}
    assert got == {"pysbd-0.3.4-py3-none-any.whl": "ds-scale-toolkit", "fakedep-1.0-py3-none-any.whl": "pysbd",
                   "h5py-99.0-py3-none-any.whl": "ds-scale-toolkit",
                   "setuptools-99.0-py3-none-any.whl": "build-system.requires",
                   "wheel-0.99-py3-none-any.whl": "build-system.requires",
                   "packaging-24.0-py3-none-any.whl": "build-system.requires (wheel)",
                   "ds_scale_toolkit-0.1.0-py3-none-any.whl": "the toolkit"}, got
    assert "transformers" in m["from_base"] and "deepspeed" in m["from_base"] and "h5py" not in m["from_base"]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["files"] == 7



def test_make_wheelhouse_has_no_size_cap_unless_the_user_sets_one():
    """A size cap is the user's option (WHEELHOUSE_MAX_MB), not a default that refuses a legitimate wheelhouse: a
    target image holding only torch needs far more than a fixed cap allowed."""
    def command(*make_args: str) -> str:
        out = make_dry_run("wheelhouse", *make_args).stdout.replace("\\\n", " ")
        (line,) = [x for x in out.splitlines() if "tools/wheelhouse.py" in x]
        return line

    assert "--max_mb 0" in command()
    assert "--constraints stacks/latest.txt" in command()
    assert "--constraints stacks/gaudi-1.21.txt" in command("STACK=gaudi-1.21")
    assert "--max_mb 200" in command("WHEELHOUSE_MAX_MB=200")


def test_wheelhouse_records_sha256_and_the_offline_install_checks_them(tmp_path):
    """MANIFEST.json holds each wheel's sha256 and requirements.txt pins every wheel but the toolkit's with it; the
    offline set-up installs through `pip --require-hashes` from that file, which refuses a wheel changed on the way."""
    import hashlib

    sys.path.insert(0, str(REPO / "tools"))
    try:
        import wheelhouse
    finally:
        sys.path.remove(str(REPO / "tools"))
    wh = tmp_path / "wh"
    wh.mkdir()
    fake_wheel(wh, "fakedep", "1.0")
    fake_wheel(wh, "ds-scale-toolkit", "0.1.0")
    m = wheelhouse.write_manifest(wh, "3.12", "manylinux_2_28_x86_64", [], {"fakedep": "pysbd"}, {})
    digests = {f["wheel"]: f["sha256"] for f in m["files"]}
    for name, digest in digests.items():
        assert digest == hashlib.sha256((wh / name).read_bytes()).hexdigest(), name
    reqs = (wh / "requirements.txt").read_text()
    assert reqs == f"fakedep==1.0 --hash=sha256:{digests['fakedep-1.0-py3-none-any.whl']}\n", reqs

    def install(target: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "--no-index",
                               "--find-links", str(wh), "--require-hashes", "-r", str(wh / "requirements.txt"),
                               "--target", str(target)], capture_output=True, text=True, timeout=300)

    ok = install(tmp_path / "t1")
    assert ok.returncode == 0, ok.stderr[-2000:]
    with open(wh / "fakedep-1.0-py3-none-any.whl", "ab") as f:
        f.write(b"\0")  # a wheel changed after the wheelhouse was built (a zip still reads with trailing bytes)
    bad = install(tmp_path / "t2")
    assert bad.returncode != 0 and "DO NOT MATCH THE HASHES" in bad.stderr, bad.stderr[-2000:]
    # and the offline set-up (tools/setup_venv.py, what `make setup WHEELHOUSE=` runs) is that install, then the
    # toolkit editable without dependencies
    made = make_dry_run("setup", "WHEELHOUSE=wh").stdout
    assert "tools/setup_venv.py" in made and "--wheelhouse wh" in made, made
    ran = offline_setup_commands(tmp_path / "venv", wh)
    assert f"--require-hashes -r {wh}/requirements.txt" in ran[0], ran
    editable = [c for c in ran if " -e .[" in c]
    assert editable and all("--no-index" in c and "--no-deps" in c for c in editable), ran


def offline_setup_commands(venv: Path, wheels: Path) -> list[str]:
    """The pip installs tools/setup_venv.py runs offline into an existing venv with torch, its probes answered
    (torch importable, habana_frameworks too, no build backend) and nothing run."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import setup_venv
    finally:
        sys.path.remove(str(REPO / "tools"))

    class Recorder(setup_venv.Shell):
        def __init__(self):
            self.cmds: list[str] = []

        def run(self, cmd) -> None:
            self.cmds.append(" ".join(map(str, cmd)))

        def succeeds(self, cmd) -> bool:
            return str(cmd[-1]) in ("import torch", "import habana_frameworks")

        def output(self, cmd) -> str:
            return ""

        def say(self, line: str, err: bool = False) -> None:
            pass

    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "bin" / "python").chmod(0o755)
    sh = Recorder()
    setup_venv.setup(venv, "auto", "test", wheelhouse=str(wheels), build_ops=False, sh=sh)
    return [c for c in sh.cmds if " -m pip install" in c]
