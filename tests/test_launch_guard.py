"""launch.guard on its own (no DeepSpeed): exit status passed on, arguments intact, a stopped rank killed after the
stall timeout and a busy one left alone; under a local mpirun, the rendezvous variables come from mpi4py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import dist_env

RECORD = '''import json, os, sys, time
with open(os.path.join({out!r}, "rec%s.json" % os.environ.get("RANK", "")), "w") as f:
    json.dump({{"argv": sys.argv[1:], "pid": os.getpid(), "env": {{k: os.environ.get(k) for k in
               ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "MPI4PY_LIBMPI")}}}}, f)
mode = sys.argv[-1]
if mode == "stop":
    import signal
    os.kill(os.getpid(), signal.SIGSTOP)
elif mode == "busy":
    time.sleep(4)  # longer than the stall timeout: the heartbeat thread keeps beating meanwhile
sys.exit(7 if mode == "fail" else 0)
'''


def guard(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    (tmp_path / "rec_mod.py").write_text(RECORD.format(out=str(tmp_path)))
    env = dist_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    return subprocess.run([sys.executable, "-m", "launch.guard", *args], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)


def record(tmp_path: Path, rank: str = "") -> dict:
    return json.loads((tmp_path / f"rec{rank}.json").read_text())


def test_exit_status_and_arguments_pass_through(tmp_path):
    proc = guard(tmp_path, "--local_rank=1", "--stall_timeout_s", "30", "rec_mod", "--x", "a b", "fail")
    assert proc.returncode == 7, proc.stderr
    # DeepSpeed's launcher puts --local_rank before the module's arguments; the module gets it first
    assert record(tmp_path)["argv"] == ["--local_rank=1", "--x", "a b", "fail"]
    assert guard(tmp_path, "--stall_timeout_s", "30", "rec_mod", "ok").returncode == 0


def test_a_stopped_rank_is_killed_after_the_stall_timeout(tmp_path):
    proc = guard(tmp_path, "--stall_timeout_s", "3", "rec_mod", "stop")
    assert proc.returncode == 1
    assert "no heartbeat from the training process for 3 s" in proc.stderr
    pid = record(tmp_path)["pid"]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_busy_rank_keeps_beating(tmp_path):
    """The main thread asleep (or in a long collective) for longer than the stall timeout is not a stall."""
    proc = guard(tmp_path, "--stall_timeout_s", "2", "rec_mod", "busy")
    assert proc.returncode == 0, proc.stderr


def test_mpi_rendezvous_under_a_local_mpirun(tmp_path):
    """Two ranks under the mpirun on PATH, with the library launch.run matches to it: rank variables from mpi4py,
    our port (given) and rank 0's address (not given: one host, so loopback)."""
    pytest.importorskip("mpi4py", reason="mpi4py not installed (the `mpi` extra)")
    from launch import run as runmod

    if not shutil.which("mpirun"):
        pytest.skip("no mpirun on PATH")
    args = runmod.build_parser().parse_args(["--launcher", "mpirun"])
    mpi = runmod.mpi_setup(args, os.environ)
    (tmp_path / "rec_mod.py").write_text(RECORD.format(out=str(tmp_path)))
    env = dist_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    flags = ["--allow-run-as-root", "--oversubscribe"] if mpi["flavor"] == "openmpi" and os.geteuid() == 0 else []
    cmd = [mpi["mpirun"], *flags, "-n", "2", sys.executable, "-m", "launch.guard", "--mpi", "--master_port", "29123",
           "--mpi_lib", mpi["libmpi"], "rec_mod", "ok"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout
    for rank in range(2):
        e = record(tmp_path, str(rank))["env"]
        assert (e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_SIZE"]) == (str(rank), "2", str(rank), "2")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("127.0.0.1", "29123")
        assert e["MPI4PY_LIBMPI"] == mpi["libmpi"] != ""
