"""One live run per run_dir (ds_core.rank.run_lock) and no orphaned ranks (ds_core.rank.parent_watch): lock holders and
launchers are real processes, killed with SIGKILL; the end-to-end case runs the real DeepSpeed launcher on 2 ranks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, dist_env
from ds_core.config import TrainConfig
from ds_core.rank import run_lock
from ds_core.run.run_dir import prepare_run_dir
from launch.local_ranks import LauncherGroup, free_port, local_command


def gone(pid: int) -> bool:
    """The process no longer runs (exited, or a zombie waiting for a reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def wait_for(cond, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.1)


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process holding run_dir's lock, as rank 0 of a live run does."""
    code = ("import sys, time; from ds_core.rank import run_lock; run_lock.acquire(sys.argv[1]); "
            "print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_live_run_refuses_a_second_with_or_without_resume_then_its_death_frees_the_lock(tmp_path):
    run = tmp_path / "run"
    holder = hold_lock(run)
    try:
        (run / "config.json").write_text('{"first": true}')
        for how in ({}, {"resume": True}, {"overwrite_run_dir": True}):
            with pytest.raises(run_lock.RunDirLocked) as e:
                prepare_run_dir(TrainConfig(run_dir=str(run), **how), rank=0)
            msg = str(e.value)
            assert f"run_dir {run} is in use by a live run" in msg and f"pid {holder.pid}" in msg, msg
        assert (run / "config.json").read_text() == '{"first": true}'
        prepare_run_dir(TrainConfig(run_dir=str(run), resume=True), rank=1)  # only rank 0 takes the lock
    finally:
        holder.kill()
        holder.wait()
    # kill -9 left the file; the same host sees the pid is dead and takes over, keeping the old file aside
    assert (run / run_lock.LOCK_NAME).exists()
    prepare_run_dir(TrainConfig(run_dir=str(run), resume=True), rank=0)
    assert json.loads((run / run_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
    assert len(list(run.glob(f"{run_lock.LOCK_NAME}.stale-{holder.pid}-*"))) == 1
    run_lock.release_all()
    assert not (run / run_lock.LOCK_NAME).exists()


def test_another_hosts_lock_is_stale_only_when_its_heartbeat_stops(tmp_path):
    """A lock from another host cannot be checked by pid: its heartbeat counter is watched (never a clock)."""
    path = tmp_path / run_lock.LOCK_NAME
    owner = {"host": "node-elsewhere", "pid": 4242, "token": "t", "beat": 0, "started": "then", "argv": "train"}
    path.write_text(json.dumps(owner))
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            owner["beat"] += 1
            path.write_text(json.dumps(owner))

    t = threading.Thread(target=beat)
    t.start()
    try:
        with pytest.raises(run_lock.RunDirLocked, match="live run on host node-elsewhere .pid 4242"):
            run_lock.acquire(tmp_path, stale_after_s=1.0, heartbeat=False)
    finally:
        stop.set()
        t.join()
    lock = run_lock.acquire(tmp_path, stale_after_s=1.0, heartbeat=False)  # the heartbeat stopped: dead
    assert json.loads(path.read_text())["token"] == lock.token
    lock.release()
    assert not path.exists() and len(list(tmp_path.glob("*.stale-4242-*"))) == 1


def test_local_starter_killed_takes_its_ranks_down(tmp_path):
    """kill -9 of `python -m launch.local_ranks`: its ranks get SIGTERM from the kernel (PR_SET_PDEATHSIG)."""
    script = tmp_path / "rank.py"
    script.write_text("import os, sys, time\n"
                      f"open(os.path.join({str(tmp_path)!r}, 'pid' + os.environ['RANK']), 'w')"
                      ".write(str(os.getpid()))\n"
                      "time.sleep(600)\n")
    starter = subprocess.Popen([sys.executable, "-m", "launch.local_ranks", "-n", "2", str(script)], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        wait_for(lambda: all((tmp_path / f"pid{r}").exists() and (tmp_path / f"pid{r}").read_text()
                             for r in range(2)), 60, "both ranks started")
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        starter.kill()
        starter.wait()
        wait_for(lambda: all(map(gone, pids)), 10, f"ranks {pids} gone after their starter was killed")
    finally:
        try:
            os.killpg(starter.pid, signal.SIGKILL)  # the ranks stay in the starter's group: none is left on failure
        except ProcessLookupError:
            pass


def test_rank_started_by_a_launcher_ends_when_the_launcher_dies(tmp_path):
    """A launcher we did not write (here a shell) is killed: the rank notices its new parent and stops itself."""
    child = ("import os, sys, time; from ds_core.rank import parent_watch; assert parent_watch.watch_parent();"
             f" open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid())); time.sleep(600)")
    launcher = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "{child}" & wait'], cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO), "OMPI_COMM_WORLD_RANK": "0"},
                                start_new_session=True)
    try:
        wait_for(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(), 60, "the rank started")
        pid = int((tmp_path / "pid").read_text())
        launcher.kill()
        launcher.wait()
        wait_for(lambda: gone(pid), 10, "the rank gone after its launcher was killed")
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_hand_started_process_is_not_watched(monkeypatch):
    """`nohup python -m bert_ref.train &` must outlive its shell: no launcher variable, no watch."""
    from ds_core.rank import parent_watch

    for var in parent_watch.LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not parent_watch.launched()


@pytest.mark.slow
def test_deepspeed_runner_killed_mid_run_leaves_no_rank_and_a_live_run_refuses_a_resume(tmp_path):
    """2 ranks under `deepspeed --num_gpus 2` train; a second run with --resume is refused before it writes
    anything; kill -9 of the runner (launch.py and the ranks survive it on their own) takes both ranks down."""
    from test_ds_core_train import SCRIPT, ds_json

    run = tmp_path / "run"
    args = [SCRIPT, "--run_dir", str(run), "--deepspeed_config", ds_json(tmp_path, 1), "--max_steps", "100000",
            "--num_steps_per_checkpoint", "0", "--progress_bar", "false", "--num_samples", "100000"]
    # in a session of its own, so that the finally below takes down everything it started (JIT compilers included)
    group = LauncherGroup([local_command(2, args, master_port=free_port())], env=dist_env(), cwd=REPO,
                          log_path=tmp_path / "first.log")
    runner = group.procs[0]
    try:
        metrics = run / "metrics.jsonl"
        # generous: the first start on a machine may JIT-build DeepSpeed's CPU shm op
        wait_for(lambda: metrics.exists() and metrics.read_text().count('"type": "step"') >= 2, 900,
                 "the first run trained 2 steps")
        config = (run / "run_config.json").read_bytes(), (run / "run_config.json").stat().st_mtime_ns
        second = subprocess.run([sys.executable, "-m", "launch.local_ranks", "-n", "2", *args, "--resume", "true"],
                                cwd=REPO, env=dist_env(), capture_output=True, text=True, timeout=600)
        assert second.returncode != 0
        assert f"run_dir {run} is in use by a live run" in second.stderr, second.stderr[-3000:]
        assert ((run / "run_config.json").read_bytes(), (run / "run_config.json").stat().st_mtime_ns) == config
        ranks = [int(p) for p in subprocess.run(["pgrep", "-f", "-s", str(runner.pid), "tiny_train.py"],
                                                capture_output=True, text=True).stdout.split()]
        ranks = [p for p in ranks if "--local_rank" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        assert len(ranks) == 2, ranks
        runner.kill()  # the deepspeed runner only: its launch.py and the ranks used to train on
        runner.wait()
        wait_for(lambda: all(map(gone, ranks)), 120, f"ranks {ranks} gone after the runner was killed")
    finally:
        group.kill()
    log = (tmp_path / "first.log").read_text(errors="replace")
    assert "the DeepSpeed runner" in log and "died; stopping this rank" in log, log[-3000:]
