"""Every process ends: a rank whose peer has gone is ended by its launcher within a bound, and a test that starts
processes cannot outlive the per-test time limit (pytest-timeout, pyproject.toml), which fails it with the output of
the processes it started."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, dist_env, run_group

# rank 1 leaves at once with status 0; rank 0 waits for it (here a sleep; in a real run a collective with a peer that
# has gone, which torch's 30-minute default timeout would end only after half an hour)
STRANDED = """
import os, sys, time
rank = int(os.environ["RANK"])
Path = __import__("pathlib").Path
Path(sys.argv[1], f"pid{rank}").write_text(str(os.getpid()))
if rank == 1:
    print("rank 1: done", flush=True)
    sys.exit(0)
print("rank 0: waiting for rank 1", flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


@pytest.mark.stack
def test_the_launcher_ends_ranks_stranded_by_a_peer_that_ended(tmp_path):
    script = tmp_path / "stranded.py"
    script.write_text(STRANDED)
    proc = run_group([sys.executable, "-m", "launch.local_ranks", "-n", "2", "--peer_exit_s", "3", "--no_local_rank",
                      str(script), str(tmp_path)], timeout=120, env=dist_env())
    assert proc.returncode == 1, proc.stdout
    assert "rank 1 ended (status 0) and rank(s) 0 still ran 3 s later" in proc.stdout, proc.stdout
    assert not alive(int((tmp_path / "pid0").read_text()))


def test_a_test_past_its_time_limit_fails_with_the_output_of_its_processes(tmp_path):
    """A test whose processes never end fails at the per-test limit with their last lines, and they are killed."""
    (tmp_path / "test_forever.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / "tests")!r})
        from conftest import run_group

        def test_forever(tmp_path):
            run_group([sys.executable, "-c", "import os, time; open({str(tmp_path / 'pid')!r}, 'w').write("
                       "str(os.getpid())); print('still here', flush=True); time.sleep(600)"], timeout=600)
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           "--timeout", "5", str(tmp_path / "test_forever.py")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Timeout" in proc.stdout and "its last lines:" in proc.stdout and "still here" in proc.stdout, proc.stdout
    assert not alive(int((tmp_path / "pid").read_text()))
