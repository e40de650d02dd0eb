"""launch.ds_runner: DeepSpeed's launcher with the variables it exports reaching MPI ranks as given. Where the
installed MultiNodeRunner.add_export quotes a plain value (Habana's fork: mpirun's `-x KEY="value"` hands the quotes
to every rank), it takes DeepSpeed 0.19's rule; 0.19 keeps its own. The runs over Open MPI and MPICH that check what
the ranks received are tests/test_launch_ssh.py's."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, deepspeed_release

pytestmark = pytest.mark.stack

# DeepSpeed release (stacks/) -> whether its add_export quotes a plain value
QUOTES = {(0, 19): False, (0, 16): True}


def release() -> tuple[int, int]:
    return deepspeed_release(QUOTES)


def test_exports_by_0_19s_rule():
    from ds_core.compat.mpi_exports import add_export

    runner = type("Runner", (), {"exports": {}})()
    for key, value in (("DS_ACCELERATOR", "cpu"), ("HCCL_SOCKET_IFNAME", " eth0\n"), ("LD_LIBRARY_PATH", "/a:/b"),
                       ("FLAGS", "--x 1"), ("ARGS", "a;b")):
        add_export(runner, key, value)
    assert runner.exports == {"DS_ACCELERATOR": "cpu", "HCCL_SOCKET_IFNAME": "eth0", "LD_LIBRARY_PATH": "/a:/b",
                              "FLAGS": '"--x 1"', "ARGS": '"a;b"'}


def test_the_runner_gets_it_where_the_installed_deepspeed_quotes_plain_values():
    """In a process of its own (it replaces a class attribute): DeepSpeed's MPI runner, as launch.ds_runner leaves
    it, exports a plain value as given on every release; DeepSpeed's own quoted it where QUOTES says so."""
    code = ("from ds_core.compat.deepspeed_behaviour import quotes_plain_exports as q; before = q(); "
            "from ds_core.compat.changes import apply_stage; "
            "installed = str(apply_stage('launcher', say=print)['mpi_exports_as_given']) == 'on'; "
            "from deepspeed.launcher.multinode_runner import MultiNodeRunner as M; "
            "r = type('R', (), {'exports': {}})(); M.add_export(r, 'K', 'cpu'); "
            "print(before, installed, r.exports['K'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    quotes = QUOTES[release()]
    assert out[-3:] == [str(quotes), str(quotes), "cpu"], out


def test_launches_go_through_it():
    from launch.local_ranks import deepspeed_launcher

    assert deepspeed_launcher() == [sys.executable, "-u", "-m", "launch.ds_runner"]
