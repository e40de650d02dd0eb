"""Shared test helpers: run a real DeepSpeed job (CPU accelerator, gloo) on N local ranks.

Starting ranks belongs to launch.local_ranks (the project's one starter), their environment and free ports to
ds_core.rank.rendezvous; these helpers only add what a test needs on top: captured text output and a failed test, with
the output, on a timeout.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import NoReturn

import pytest

from ds_core.rank.rendezvous import free_port, rank_env  # noqa: F401 - tests import free_port from here
from launch import local_ranks

REPO = Path(__file__).resolve().parents[1]
# What a process started by a test inherits across exec besides its environment: an ignored signal stays ignored.
INHERITED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


@pytest.fixture(autouse=True)
def process_as_it_was():
    """What a test changes in this process that every later test and every process it starts would inherit is put
    back after it: the signal dispositions (launch.slurm's main, called in this process, ignores SIGTERM and SIGUSR1
    for the runner it becomes: an ignored SIGTERM passes across exec, and PR_SET_PDEATHSIG and the stop-on-SIGTERM
    paths of later tests' processes would do nothing) and the environment (transformers 4.x's
    TrainingArguments(deepspeed=...) sets ACCELERATE_USE_DEEPSPEED=true, which then reads as an `accelerate launch`
    of every later run)."""
    before = {s: signal.getsignal(s) for s in INHERITED_SIGNALS}
    env = dict(os.environ)
    yield
    for s, handler in before.items():
        if signal.getsignal(s) is not handler and handler is not None:
            signal.signal(s, handler)
    if os.environ != env:
        for k in set(os.environ) - set(env):
            del os.environ[k]
        os.environ.update(env)


@contextlib.contextmanager
def environment_kept():
    """The environment as it was after the block: for a library call that writes os.environ (transformers 4.x's
    TrainingArguments(deepspeed=...) sets ACCELERATE_USE_DEEPSPEED) inside a test that then parses or starts a run."""
    env = dict(os.environ)
    try:
        yield
    finally:
        for k in set(os.environ) - set(env):
            del os.environ[k]
        os.environ.update(env)


def make_dry_run(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`make -n -B ARGS` in the checkout, as a user's shell runs it: not the MAKEFLAGS/MAKELEVEL of a `make test` this
    suite may run under (its command-line variables, EXTRAS included, would pass into this make and override the
    defaults under test; MAKELEVEL adds "Entering directory" lines)."""
    base = {k: v for k, v in (os.environ if env is None else env).items()
            if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    return subprocess.run(["make", "-n", "-B", "--no-print-directory", *args], cwd=REPO, env=base,
                          capture_output=True, text=True, timeout=timeout, check=True)


def deepspeed_release(*tables) -> tuple[int, int]:
    """The installed DeepSpeed's (major, minor); each per-release table of a test must name it (stacks/: the support
    matrix), else the test says which release it does not know."""
    import deepspeed

    got = tuple(int(x) for x in deepspeed.__version__.split(".")[:2])
    for table in tables:
        assert got in table, f"DeepSpeed {deepspeed.__version__} is not a release of the support matrix (stacks/)"
    return got


def dist_env(**extra: str) -> dict[str, str]:
    """Environment for launched ranks: CPU accelerator, one thread per rank (2 cores shared by 2 ranks), this
    checkout first on PYTHONPATH, offline."""
    return rank_env(threads=1, pythonpath=[REPO], extra={
        "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        **extra})  # a caller's value wins (e.g. DS_ACCELERATOR spelled out by a launch test)


def run_group(cmd: list[str], timeout: float, cwd: Path | None = None,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """Run cmd in a session of its own (stdout+stderr as text); on timeout the whole session, ranks included, is
    killed (launch.local_ranks.LauncherGroup) and the test fails with the output."""
    with tempfile.TemporaryDirectory(prefix="run_group_") as d:
        log = Path(d) / "out.txt"
        group = local_ranks.LauncherGroup([cmd], env=env or dict(os.environ), cwd=cwd or REPO, log_path=log)
        try:
            res = group.wait(timeout, poll_s=0.2, fail_fast=False)
        except pytest.fail.Exception as limit:  # the per-test time limit (pytest-timeout) ended the test meanwhile
            group.kill()
            pytest.fail(f"{str(limit).splitlines()[0]}; process group killed: {' '.join(cmd)}\nits last lines:\n"
                        f"{log.read_text(errors='replace')[-8000:]}", pytrace=False)
        out = log.read_text(errors="replace")
    if res.timed_out:
        pytest.fail(f"timed out after {timeout:.0f} s, process group killed: {' '.join(cmd)}\n{out[-8000:]}")
    return subprocess.CompletedProcess(cmd, res.codes[0], out, None)


def end_rank() -> NoReturn:
    """The end of a rank spawned through multiprocessing, in its `finally:`: the process group released (not freed:
    ds_core.compat.torch_releases), then the process ended as a rank is (ds_core.rank.process_end: no interpreter
    finalisation, which gloo's live threads do not survive), status 1 with the traceback when the rank failed."""
    from ds_core.compat.torch_releases import release_process_groups
    from ds_core.rank.process_end import end_process

    failed = sys.exc_info()[1] is not None
    if failed:
        traceback.print_exc()
    release_process_groups()
    end_process(1 if failed else 0, failed=failed)


@contextlib.contextmanager
def spawned(ctx, target, rank_args: list[tuple]):
    """One multiprocessing process per rank (target(*args)), started; on the way out, however the test ends, each is
    joined for up to 60 s and killed if still alive. A rank left running would otherwise keep pytest from ever
    exiting: multiprocessing joins its children at interpreter exit."""
    procs = [ctx.Process(target=target, args=args) for args in rank_args]
    for p in procs:
        p.start()
    try:
        yield procs
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def run_deepspeed(args: list[str], num_ranks: int = 2, timeout: float = 600, env: dict | None = None,
                  check: bool = True, cwd: Path | None = None, launcher: str = "local") -> subprocess.CompletedProcess:
    """A DeepSpeed program (`--module M ARGS` or `SCRIPT ARGS`) on `num_ranks` local ranks; returns the finished
    process (stdout+stderr text). launcher "local": the toolkit's documented starter (`python -m
    launch.local_ranks -n N ...`, what `make demo` runs); "deepspeed": `deepspeed --num_gpus N ...`."""
    if launcher == "local":
        cmd = [sys.executable, "-m", "launch.local_ranks", "-n", str(num_ranks), *args]
    elif launcher == "deepspeed":
        cmd = local_ranks.local_command(num_ranks, args, master_port=free_port())
    else:
        raise ValueError(f"launcher = {launcher!r}: expected 'local' or 'deepspeed'")
    proc = run_group(cmd, cwd=cwd or REPO, env=env or dist_env(), timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{launcher} run failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-8000:]}")
    return proc


# A C++ compiler (g++) that rejects the Adam ops' sources: a real JIT build of the optimizer's op that fails to
# compile, while DeepSpeed's CPU communication op (built at init_distributed) still compiles.
FAILING_CXX = """#!/bin/sh
for a in "$@"; do case "$a" in *adam*.cpp|*adam*.cu)
  echo "$a:1:1: error: this compiler rejects the Adam sources" >&2; exit 1;; esac; done
exec g++ "$@"
"""


def seed_shm_op(built_in: Path, op_cache: Path) -> None:
    """Copy DeepSpeed's CPU communication op, when an earlier run built it in `built_in` (the venv's op cache), into
    the otherwise empty `op_cache`, times kept: ninja finds it up to date and the ranks load it (3 s) instead of
    compiling it again (~55 s on 2 cores). Only the optimizer's op stays unbuilt, which is what a FAILING_CXX start
    is about."""
    import shutil

    src = built_in / "deepspeed_shm_comm"
    if (src / "deepspeed_shm_comm.so").is_file():
        shutil.copytree(src, op_cache / src.name, ignore=shutil.ignore_patterns("lock"))


@pytest.fixture(scope="session")
def bt_engine_starts(tmp_path_factory) -> tuple[Path, str]:
    """The debug BridgeTower's engine starts (tests/bt_engine_start.py), one after the other in one 2-rank launch whose
    fused_adam JIT build fails (FAILING_CXX, an empty op cache), as (out_dir, the launch's output); each start's rank
    records are out_dir/NAME/rank<R>.json:

    fallback  the shipped BridgeTower JSON (AdamW, DeepSpeed's FusedAdam), logit_scale as bridgetower_ds.train makes
              it ([1]): its optimizer's op fails to build, torch's AdamW takes over (tests/test_ops_check.py), and it
              trains in bf16 (tests/test_bt_logit_scale_ds.py)
    0d_bf16, 0d_fp32  transformers' 0-dim logit_scale (torch_adam: no op needed), the controls DeepSpeed refuses
    """
    import json

    tmp = tmp_path_factory.mktemp("bt_engine_starts")
    # the compiler torch's JIT build calls when CXX is unset (`c++`), found first on PATH: the build commands stay the
    # ones the venv's op cache was built with, so the copied CPU communication op is up to date (seed_shm_op)
    cxx = tmp / "bin" / "c++"
    cxx.parent.mkdir()
    cxx.write_text(FAILING_CXX)
    cxx.chmod(0o755)
    shipped = json.loads((REPO / "ds_configs" / "bridgetower_zero1_bf16.json").read_text())
    runs = []
    for name, logit_scale, bf16, torch_adam in (("fallback", "1d", True, False), ("0d_bf16", "0d", True, True),
                                                ("0d_fp32", "0d", False, True)):
        cfg = json.loads(json.dumps(shipped))
        cfg["bf16"]["enabled"] = bf16
        cfg["optimizer"]["params"]["lr"] = 1e-3
        if torch_adam:
            cfg["optimizer"]["params"]["torch_adam"] = True
        (tmp / f"{name}.json").write_text(json.dumps(cfg))
        runs += ["--run", f"{name}:{logit_scale}:{tmp / f'{name}.json'}"]
    env = {k: v for k, v in dist_env().items() if k != "CXX"}
    seed_shm_op(Path(env["TORCH_EXTENSIONS_DIR"]), tmp / "ext")  # from the venv's op cache
    env.update(TORCH_EXTENSIONS_DIR=str(tmp / "ext"), PATH=f"{cxx.parent}{os.pathsep}{env.get('PATH', os.defpath)}")
    out = run_deepspeed(["tests/bt_engine_start.py", "--out_dir", str(tmp / "out"), *runs], env=env,
                        timeout=600).stdout
    return tmp / "out", out
