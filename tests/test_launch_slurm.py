"""The documented Slurm launch for real, on a one-machine cluster (tests/slurm_cluster.py: slurmctld, two slurmd
node-a and node-b, a private munged; nothing system-wide changed, all stopped at the end): `sbatch --nodes=2
launch/slurm_job.sh` trains the BERT debug preset with one rank per node, and a rank frozen with SIGSTOP makes the
whole job end non-zero within the collective timeout plus the guard's grace, with a message naming the node.
Skips with the reason when Slurm, munge or root are missing (`.ci/run` installs slurm-wlm and munge as root)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurm_cluster
from conftest import REPO, dist_env, free_port
from test_launch_multinode import DS_JSON, make_data, summary
from test_launch_ssh import GRACE_S, HOLD_TIMEOUT_S, MARKER, RDV_PROBE

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

JOB_TIMEOUT = 420  # a hang fails the test instead of stalling CI


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment (SLURM_CONF) for sbatch against a running one-machine cluster."""
    why = slurm_cluster.available()
    if why:
        pytest.skip(f"slurm launch test: {why}")
    with slurm_cluster.cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def _job_env(slurm_env: dict, tmp_path: Path, **settings: str) -> dict:
    """What a user exports before `sbatch launch/slurm_job.sh` (sbatch passes the environment on)."""
    env = dist_env(**{"SLURM_CONF": slurm_env["SLURM_CONF"], "REPO": str(REPO), "PYTHON": sys.executable,
                      "LAUNCH_PROFILE": "tcp", "LAUNCH_PRESET": "debug", "LAUNCH_SLOTS": "1",
                      "LAUNCH_DS_CONFIG": DS_JSON, "MASTER_PORT": str(free_port()), **settings})
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    return env


def _sbatch(env: dict, tmp_path: Path, *extra: str) -> subprocess.Popen:
    """`sbatch --wait` (its exit status is the job's) of the shipped batch script, output in tmp_path/job.out."""
    cmd = ["sbatch", "--wait", "--nodes=2", f"--output={tmp_path / 'job.out'}", "--chdir", str(tmp_path),
           str(REPO / "launch" / "slurm_job.sh"), *extra]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, tmp_path: Path, env: dict, timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    if code is None:  # scancel ends the job's processes on both "nodes"; then sbatch returns
        subprocess.run(["scancel", "--full", "--signal=KILL", "--jobname=bert-ds"], env=env, timeout=60)
        out, _ = proc.communicate(timeout=60)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    text = f"{out}\n--- job.out\n{log}"
    if code is None:
        pytest.fail(f"Slurm job still running after {timeout:.0f} s:\n{text[-5000:]}")
    return code, text


def test_sbatch_slurm_job_trains_on_two_nodes(tmp_path, slurm):
    """The README's `sbatch --nodes=N launch/slurm_job.sh -- ...`: srun starts launch.slurm once per node, each
    builds the hostfile from SLURM_JOB_NODELIST and takes SLURM_NODEID as its node rank; 2 nodes x 1 rank train."""
    env = _job_env(slurm, tmp_path)
    make_data(tmp_path / "data")
    proc = _sbatch(env, tmp_path, "--", "--input_dir", str(tmp_path / "data"), "--run_dir", str(tmp_path / "run"),
                   "--max_steps", "3", "--progress_bar", "false", "--save_final_checkpoint", "false",
                   "--export_hf", "false")
    code, log = _finish(proc, tmp_path, env, JOB_TIMEOUT)
    assert code == 0, log[-5000:]
    s = summary(tmp_path / "run")
    assert (s["world_size"], s["nodes"], s["steps"]) == (2, 2, 3), s


def test_sbatch_a_frozen_rank_ends_the_job(tmp_path, slurm):
    """Rank 1 (node-b) stopped with SIGSTOP after the ranks met: node-a's rank fails its collective after the
    timeout, srun (--kill-on-bad-exit) ends node-b's task, and launch.guard kills a stopped rank that outlives it;
    the job ends non-zero, and srun names the failed node."""
    (tmp_path / "rdv_probe.py").write_text(RDV_PROBE.format(marker=MARKER))
    env = _job_env(slurm, tmp_path, LAUNCH_MODULE="rdv_probe", LAUNCH_DS_CONFIG="",
                   LAUNCH_DIST_TIMEOUT_S=str(HOLD_TIMEOUT_S), LAUNCH_STALL_GRACE_S=str(GRACE_S))
    proc = _sbatch(env, tmp_path, "--", "--out", str(tmp_path), "--hold")
    files = [tmp_path / f"rdv{r}.json" for r in range(2)]
    deadline = time.monotonic() + JOB_TIMEOUT
    while not all(f.exists() for f in files):
        if proc.poll() is not None or time.monotonic() > deadline:
            _, log = _finish(proc, tmp_path, env, 1)
            pytest.fail(f"ranks did not meet:\n{log[-5000:]}")
        time.sleep(0.3)
    time.sleep(0.3)  # the second file's writer has closed it
    recs = [json.loads(f.read_text()) for f in files]
    assert [(r["world"], r["nodes"], r["sum"]) for r in recs] == [(2, 2, 3.0)] * 2, recs
    os.kill(recs[1]["pid"], signal.SIGSTOP)
    start = time.monotonic()
    try:
        # bounded: the peers' collective timeout, the guard's grace, and slack for a loaded machine
        code, log = _finish(proc, tmp_path, env, HOLD_TIMEOUT_S + GRACE_S + 150)
    finally:
        try:
            os.kill(recs[1]["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"job ended {time.monotonic() - start:.0f} s after the freeze, exit {code}")
    assert code != 0, log[-5000:]
    assert "node-a" in log or "node-b" in log, log[-5000:]  # srun names the node whose task failed


def _job_id(env: dict, proc: subprocess.Popen, tmp_path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "--name=bert-ds", "-o", "%i"], env=env, capture_output=True, text=True,
                             timeout=30).stdout.split()
        if out:
            return out[0]
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    _, log = _finish(proc, tmp_path, env, 1)
    pytest.fail(f"no job in the queue:\n{log[-5000:]}")


def _start_when_requeued(env: dict, job: str, proc: subprocess.Popen, deadline: float) -> None:
    """slurmctld holds a requeued job pending on a begin time about two minutes ahead (reason BeginTime), a wait
    that says nothing about the script: once the job is back in the queue on that reason, it is made eligible now
    (`scontrol update StartTime=now`, what an administrator does). Returns once that is done, or when sbatch ended
    or the deadline passed (then _finish reports)."""
    while proc.poll() is None and time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=env, capture_output=True, text=True,
                               timeout=30).stdout.split()
        if state[:2] == ["PENDING", "BeginTime"]:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True, timeout=30)
            return
        time.sleep(0.3)


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(x) for x in lines if x.strip()]


def test_sbatch_job_signalled_before_its_time_limit_saves_requeues_and_resumes(tmp_path, slurm):
    """The shipped script's `--signal=USR1@N` and `--requeue`: USR1 delivered to every process of the job's step (what
    Slurm does N seconds before the time limit; sent here with `scancel --signal=USR1`, the same delivery) stops
    the ranks after a step with a checkpoint (exit 75, the launchers between srun and the ranks ignore USR1); the
    script requeues the job, whose next run (SLURM_RESTART_COUNT 1) resumes with --resume and trains to the end."""
    script = (REPO / "launch" / "slurm_job.sh").read_text()
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=USR1@" in script
    env = _job_env(slurm, tmp_path)
    make_data(tmp_path / "data")
    run, steps = tmp_path / "run", 60
    proc = _sbatch(env, tmp_path, "--", "--input_dir", str(tmp_path / "data"), "--run_dir", str(run),
                   "--max_steps", str(steps), "--progress_bar", "false", "--export_hf", "false")
    job = _job_id(env, proc, tmp_path, JOB_TIMEOUT)
    deadline = time.monotonic() + JOB_TIMEOUT
    while len([r for r in _steps(run) if r["type"] == "step"]) < 3:
        if proc.poll() is not None or time.monotonic() > deadline:
            _, log = _finish(proc, tmp_path, env, 1)
            pytest.fail(f"the job did not start training:\n{log[-5000:]}")
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True, timeout=30)
    _start_when_requeued(env, job, proc, deadline)
    code, log = _finish(proc, tmp_path, env, 2 * JOB_TIMEOUT)
    assert code == 0, log[-5000:]
    records = _steps(run)
    summaries = [r for r in records if r["type"] == "summary"]
    # the first run stopped with its checkpoint, the requeued one resumed from it and finished
    assert summaries[0].get("stopped") and summaries[0]["exit_status"] == 75, summaries
    stopped_at = summaries[0]["steps"]
    assert 3 <= stopped_at < steps and summaries[-1]["steps"] == steps and not summaries[-1].get("stopped")
    assert [r["step"] for r in records if r["type"] == "step"] == list(range(1, steps + 1))  # each step once
    assert "requeueing job" in log, log[-5000:]
