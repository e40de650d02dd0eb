"""launch.env: profiles, .deepspeed_env merge, and injection attempts (a value must never run as a command)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import dist_env
from launch import env as envmod


def cli(*args: str, cwd: Path, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.env", *args], cwd=cwd, env=env or dist_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)


def test_profiles_exist_and_resolve():
    assert set(envmod.profile_names()) >= {"roce", "efa", "hostnic", "nccl-efa", "tcp"}
    efa = envmod.resolve_profile("efa", {"LD_LIBRARY_PATH": "/usr/lib:/opt/amazon/efa/lib"})
    for name in ("HCCL_SOCKET_IFNAME", "FI_EFA_USE_DEVICE_RDMA", "RDMAV_FORK_SAFE"):
        assert name in efa
    # `+=` prepends to the writing shell's value without repeating entries
    assert efa["LD_LIBRARY_PATH"] == "/opt/habanalabs/hccl_ofi_wrapper:/opt/amazon/efa/lib:/usr/lib"
    assert envmod.resolve_profile("tcp", {})["DS_ACCELERATOR"] == "cpu"
    for name in envmod.profile_names():
        # every shipped value reaches each DeepSpeed backend unquoted (pdsh, openmpi -x, mpich -genv, srun)
        assert all(envmod.plain_warning(k, v) is None for k, v in envmod.resolve_profile(name, {}).items()), name
    with pytest.raises(envmod.EnvFileError, match="unknown profile 'nope'"):
        envmod.resolve_profile("nope")


def test_write_merges_with_existing_entries(tmp_path):
    (tmp_path / ".deepspeed_env").write_text("KEEP=1\nHCCL_SOCKET_IFNAME=old\n")
    proc = cli("write", "--profile", "efa", "--set", "HCCL_SOCKET_IFNAME=ens32", "--set", "EXTRA=a,b",
               cwd=tmp_path, env=dist_env(LD_LIBRARY_PATH="", PT_HPU_LAZY_MODE="1"))
    assert proc.returncode == 0, proc.stderr
    written = envmod.read_env_file(tmp_path / ".deepspeed_env")
    assert list(written)[:2] == ["KEEP", "HCCL_SOCKET_IFNAME"]
    assert written["KEEP"] == "1" and written["HCCL_SOCKET_IFNAME"] == "ens32" and written["RDMAV_FORK_SAFE"] == "1"
    assert written["EXTRA"] == "a,b"
    # --forward copies this shell's variables (upstream's HPU accelerator forwards no PT_HPU_ / HCCL_ ones)
    proc = cli("write", "--forward", "PT_HPU_", cwd=tmp_path, env=dist_env(PT_HPU_LAZY_MODE="1"))
    assert proc.returncode == 0, proc.stderr
    assert envmod.read_env_file(tmp_path / ".deepspeed_env")["PT_HPU_LAZY_MODE"] == "1"
    # what we write is exactly what DeepSpeed's runner can read: NAME=VALUE lines, no blanks, no comments
    for line in (tmp_path / ".deepspeed_env").read_text().splitlines():
        key, val = line.split("=", maxsplit=1)
        assert envmod.NAME_RE.match(key) and val == val.strip()
    # a DS_ENV_FILE name is honoured, as DeepSpeed's runner does
    proc = cli("write", "--profile", "tcp", cwd=tmp_path, env=dist_env(DS_ENV_FILE="ds.env"))
    assert proc.returncode == 0 and (tmp_path / "ds.env").is_file()


@pytest.mark.parametrize("assignment, message", [
    ("X=$(touch {marker})", "contains $"),
    ("X=`touch {marker}`", "contains `"),
    ('X=a"; touch {marker}; echo "', 'contains "'),
    ("X=a\\", "contains \\"),
    ("X=100%n", "contains %"),
    ("X=line1\ntouch {marker}", "newline"),
    ("X=a\rb", "newline"),
    ("1X=a", "invalid variable name '1X'"),
    ("X-Y=a", "invalid variable name 'X-Y'"),
    ("$(touch {marker})=a", "invalid variable name"),
    ("X= padded", "leading or trailing whitespace"),
])
def test_injection_attempts_are_refused(tmp_path, assignment, message):
    marker = tmp_path / "pwned"
    target = tmp_path / ".deepspeed_env"
    target.write_text("KEEP=1\n")
    proc = cli("write", "--set", assignment.format(marker=marker), cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert target.read_text() == "KEEP=1\n"  # untouched
    assert not marker.exists()


@pytest.mark.parametrize("content, message", [
    ("A=1\nX=$(touch {marker})\n", "line 2: value of X contains $"),
    ("A=1\n\nB=2\n", "line 2: blank line"),
    ("# fabric\nA=1\n", "line 1: comment line"),
    ("A=1\nA=2\n", "line 2: A is set twice"),
    ("A=1\nB\n", "line 2: expected NAME=VALUE"),
    ("A=1\r\n", "line 1: carriage return"),
])
def test_consumers_refuse_a_bad_deepspeed_env(tmp_path, content, message):
    """A hand-edited .deepspeed_env is checked by every path that consumes it: `launch.env check`, merging
    (`write`), and the run wrapper (no_ssh puts the entries into the launcher's environment; pdsh lets DeepSpeed
    paste them into a remote shell line)."""
    marker = tmp_path / "pwned"
    (tmp_path / ".deepspeed_env").write_text(content.format(marker=marker))
    (tmp_path / "hostfile").write_text("node0 slots=1\nnode1 slots=1\n")
    check = cli("check", cwd=tmp_path)
    assert check.returncode == 2 and message in check.stderr
    merge = cli("write", "--set", "B=3", cwd=tmp_path)
    assert merge.returncode == 2 and message in merge.stderr
    no_ssh = ["--launcher", "no_ssh", "--node_rank", "0", "--master_addr", "127.0.0.1"]
    for launcher in (no_ssh, ["--launcher", "pdsh"]):
        run = subprocess.run([sys.executable, "-m", "launch.run", *launcher, "--hostfile", "hostfile",
                              "--module", "launch.preflight", "--deepspeed_config", "", "--", "--help"],
                             cwd=tmp_path, env=dist_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, timeout=120)
        assert run.returncode == 2, run.stdout + run.stderr
        assert message in run.stderr
    assert not marker.exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to replay DeepSpeed's pdsh export line")
def test_accepted_values_survive_deepspeeds_pdsh_export_literally(tmp_path):
    """Replay what DeepSpeed's pdsh backend runs on a remote node for our file: `export K="V"; ...` in a shell.
    Every value we accept must arrive byte for byte and run nothing."""
    from deepspeed.launcher.multinode_runner import MultiNodeRunner

    marker = tmp_path / "pwned"
    values = {"A": "plain/path:x", "B": "has space; touch " + str(marker), "C": "it's & | > < * ? ( ) { } ~ !",
              "D": "^lo,docker0", "E": "#not-a-comment"}
    envmod.write_env_file(tmp_path / ".deepspeed_env", values)
    read_back = envmod.read_env_file(tmp_path / ".deepspeed_env")
    exports = {}

    class Capture:  # DeepSpeed's own quoting, without building a whole runner
        add_export = MultiNodeRunner.add_export

    cap = Capture()
    cap.exports = exports
    for line in (tmp_path / ".deepspeed_env").read_text().splitlines(keepends=True):
        key, val = line.split("=", maxsplit=1)  # exactly runner.main's parsing
        cap.add_export(key, val)
    script = "".join(f"export {k}={v}; " for k, v in exports.items())
    script += "".join(f'printf "%s\\0" "${k}"; ' for k in values)
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, stdout=subprocess.PIPE, timeout=30).stdout
    assert out.decode().split("\0")[:-1] == list(values.values()) == list(read_back.values())
    assert not marker.exists()


def test_rank_env_helpers(tmp_path, monkeypatch):
    """What launch.run hands to the ranks: the profile, then .deepspeed_env (which wins, as over pdsh); mpirun adds
    PYTHONPATH; pdsh/openmpi/mpich only check that the file holds the profile."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    (tmp_path / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=eth9\nFOO=1\n")
    added = envmod.rank_env_additions("tcp", tmp_path, {})
    assert added["GLOO_SOCKET_IFNAME"] == "eth9" and added["DS_ACCELERATOR"] == "cpu" and added["FOO"] == "1"
    assert envmod.rank_env_additions("", tmp_path, {}) == {"GLOO_SOCKET_IFNAME": "eth9", "FOO": "1"}
    ranks = envmod.mpirun_rank_env("tcp", tmp_path, {"PYTHONPATH": "/src"})
    assert ranks["PYTHONPATH"] == "/src" and "PYTHONPATH" not in envmod.mpirun_rank_env("tcp", tmp_path, {})
    with pytest.raises(envmod.EnvFileError, match="profile efa: .deepspeed_env missing HCCL_SOCKET_IFNAME"):
        envmod.require_profile_in_deepspeed_env("efa", tmp_path)
    envmod.require_profile_in_deepspeed_env("", tmp_path)
    (tmp_path / ".deepspeed_env").write_text("# a comment\n")
    with pytest.raises(envmod.EnvFileError, match="comment line"):  # checked even without a profile
        envmod.require_profile_in_deepspeed_env("", tmp_path)
