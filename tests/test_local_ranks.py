"""launch.local_ranks' direct starter (`python -m launch.local_ranks -n N ...`): each rank sees what DeepSpeed's own
launcher (deepspeed/launcher/launch.py) would give it, one failing rank ends the others with its exit status, the
preemption signals reach the ranks, and a timeout takes every rank down."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, dist_env, free_port
from launch import local_ranks

# What launch.py sets per rank (and the argv it adds): the engine and the loop read these.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
               "MASTER_PORT")

PROBE = """
import json, os, sys
out = sys.argv[sys.argv.index('--out') + 1]
rec = {k: os.environ.get(k) for k in %r}
rec['argv'] = [a for a in sys.argv[1:] if a.startswith('--local_rank')]
rec['extra_args'] = sys.argv[sys.argv.index('--out') + 2:]
open(os.path.join(out, 'rank%%s.json' %% os.environ['RANK']), 'w').write(json.dumps(rec))
""" % (LAUNCH_VARS,)


def _probe_records(out: Path) -> dict[int, dict]:
    return {int(f.stem[4:]): json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))}


def test_ranks_see_what_deepspeeds_launcher_gives_them(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    got = {}
    for how in ("deepspeed", "local"):
        out = tmp_path / how
        out.mkdir()
        port = free_port()
        if how == "deepspeed":
            cmd = local_ranks.local_command(2, [str(script), "--out", str(out), "--x", "1"], master_port=port)
        else:
            cmd = [sys.executable, "-m", "launch.local_ranks", "-n", "2", "--master_port", str(port), str(script),
                   "--out", str(out), "--x", "1"]
        proc = subprocess.run(cmd, cwd=tmp_path, env=dist_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:]
        recs = _probe_records(out)
        assert sorted(recs) == [0, 1], proc.stdout[-3000:]
        for r in recs.values():
            assert r.pop("MASTER_PORT") == str(port)  # each launch its own port; the rest must be equal
        got[how] = recs
    assert got["local"] == got["deepspeed"]
    assert got["local"][1]["argv"] == ["--local_rank=1"] and got["local"][1]["extra_args"] == ["--x", "1"]


def test_rank_commands_module_target_and_bad_targets():
    cmds = local_ranks.rank_commands(2, ["-m", "bert_ref.train", "--preset", "debug"], master_port=1234, env={})
    assert [c for c, _ in cmds] == [[sys.executable, "-u", "-m", "bert_ref.train", f"--local_rank={r}", "--preset",
                                     "debug"] for r in (0, 1)]
    assert [e["RANK"] for _, e in cmds] == ["0", "1"] and cmds[1][1]["WORLD_SIZE"] == "2"
    with pytest.raises(ValueError, match="num_ranks = 0"):
        local_ranks.rank_commands(0, ["x.py"], master_port=1, env={})
    with pytest.raises(ValueError, match="without a module name"):
        local_ranks.rank_commands(1, ["--module"], master_port=1, env={})
    proc = subprocess.run([sys.executable, "-m", "launch.local_ranks", "-n", "2"], cwd=REPO, env=dist_env(),
                          stderr=subprocess.PIPE, text=True, timeout=60)
    assert proc.returncode == 2 and "no target" in proc.stderr


def test_first_failing_rank_sets_the_status_and_ends_its_peer(tmp_path):
    """Rank 1 fails at once; rank 0 would sleep 600 s: it is ended (SIGTERM) and the status is rank 1's."""
    marker = tmp_path / "rank0_finished"
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1': sys.exit(3)\n"
                      f"time.sleep(600); open({str(marker)!r}, 'w').write('x')\n")
    proc = subprocess.run([sys.executable, "-m", "launch.local_ranks", "-n", "2", str(script)], cwd=tmp_path,
                          env=dist_env(), timeout=300)
    assert proc.returncode == 3 and not marker.exists()


def test_sigterm_reaches_every_rank_and_their_status_is_kept(tmp_path):
    """What a preempted job sees: SIGTERM to the starter; each rank handles it (here: writes a file, exits 75)."""
    script = tmp_path / "term.py"
    script.write_text("import os, signal, sys, time\n"
                      "d = sys.argv[sys.argv.index('--dir') + 1]\n"
                      "def stop(*_):\n"
                      "    open(os.path.join(d, 'stopped' + os.environ['RANK']), 'w').write('x'); sys.exit(75)\n"
                      "signal.signal(signal.SIGTERM, stop)\n"
                      "open(os.path.join(d, 'ready' + os.environ['RANK']), 'w').write('x')\n"
                      "time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-m", "launch.local_ranks", "-n", "2", str(script), "--dir",
                          str(tmp_path)], cwd=tmp_path, env=dist_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert p.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 75
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert (tmp_path / "stopped0").exists() and (tmp_path / "stopped1").exists()


def test_timeout_kills_every_rank(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(f"import os, time\nopen(os.path.join({str(tmp_path)!r}, 'pid' + os.environ['RANK']), 'w')"
                      ".write(str(os.getpid()))\ntime.sleep(600)\n")
    cmds = local_ranks.rank_commands(2, [str(script)], master_port=free_port(), env=dist_env())
    deadline = time.monotonic() + 120
    group = local_ranks.LauncherGroup([c for c, _ in cmds], envs=[e for _, e in cmds], cwd=tmp_path)
    while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    res = group.wait(timeout_s=0, poll_s=0.1)
    assert res.timed_out and res.exit_code == 124 and res.killed == [True, True]
    for r in (0, 1):
        pid = int((tmp_path / f"pid{r}").read_text())
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_kill_reaches_processes_that_left_the_process_group(tmp_path):
    """As ninja does with each compiler: a child in a process group of its own, same session. A timeout must end it
    too (a JIT build left running keeps its lock file and blocks every later run). preexec_fn, not Popen's
    process_group (Python 3.11+): the suite runs on 3.10 too."""
    pidfile = tmp_path / "child.pid"
    script = ("import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(600)'], preexec_fn=os.setpgrp); open({str(pidfile)!r} + '.tmp', 'w').write(str(p.pid)); "
              f"os.replace({str(pidfile)!r} + '.tmp', {str(pidfile)!r}); time.sleep(600)")  # whole or absent
    group = local_ranks.LauncherGroup([[sys.executable, "-c", script]], env=dist_env(), cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not pidfile.exists() and group.procs[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pidfile.exists(), f"the script ended (exit {group.procs[0].poll()}) before it started its child"
    child = int(pidfile.read_text())
    assert os.getpgid(child) != group.procs[0].pid  # really outside the launcher's group
    res = group.wait(timeout_s=0, poll_s=0.1)
    assert res.timed_out
    for _ in range(50):
        if not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
