"""Shared test helpers: run a real DeepSpeed job (CPU accelerator, gloo) on N local ranks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def dist_env(**extra: str) -> dict[str, str]:
    """Environment for launched ranks: CPU accelerator, few threads per rank (2 cores shared by 2 ranks)."""
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.update(extra)
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """Run cmd in a session of its own (stdout+stderr text); on timeout kill the whole session, ranks included (a
    killed launcher alone leaves its ranks running, holding ports, memory and JIT build locks), then fail the test."""
    import signal

    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                          **kw) as p:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            pytest.fail(f"timed out after {timeout:.0f} s, process group killed: {' '.join(cmd)}\n{out[-8000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, None)


def run_deepspeed(args: list[str], num_ranks: int = 2, timeout: float = 600, env: dict | None = None,
                  check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N <args>` with the venv's launcher; returns the finished process (stdout+stderr text)."""
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(num_ranks), "--master_port", str(free_port()), *args]
    proc = run_group(cmd, cwd=cwd or REPO, env=env or dist_env(), timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"deepspeed run failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-8000:]}")
    return proc


@pytest.fixture
def ds_run():
    return run_deepspeed
