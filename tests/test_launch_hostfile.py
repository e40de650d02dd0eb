"""launch.hostfile: strict parsing with line numbers, Slurm nodelists, AWS Batch and MPI sources, CLI exit codes."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, dist_env
from launch import hostfile as hf


def cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.hostfile", *args], cwd=REPO, env=env or dist_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)


@pytest.mark.parametrize("text, message", [
    ("a slots=8\nb slots=8\na slots=8\n", "line 3: duplicate host a (first on line 1)"),
    ("a slots=8\n\n# c\nb slots=0\n", "line 4: host b has slots=0"),
    ("a slots=8\nb 8\n", "line 2: expected 'HOST slots=N'"),
    ("a slots=8\nb slots=x\n", "line 2: slots must be a whole number"),
    ("a slots=8\nb slots=8 max_slots=8\n", "line 2: expected 'HOST slots=N'"),
    ("a:0 slots=8\n", "line 1: bad host name 'a:0'"),
    ("$(id) slots=1\n", "line 1: bad host name"),
    ("# only a comment\n", "no hosts"),
])
def test_bad_hostfile_names_the_line(tmp_path, text, message):
    path = tmp_path / "hostfile"
    path.write_text(text)
    with pytest.raises(hf.HostfileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hf.read_hostfile(path)
    proc = cli("validate", str(path))
    assert proc.returncode == 2
    assert message in proc.stderr and str(path) in proc.stderr


def test_unequal_slots_when_the_run_needs_equal(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# rack 1\na slots=8\nb slots=4\n")
    hf.read_hostfile(path)  # fine for pdsh
    proc = cli("validate", str(path), "--equal-slots")
    assert proc.returncode == 2
    assert "line 3: host b has slots=4 but a (line 2) has slots=8" in proc.stderr
    assert cli("validate", str(path), "--nodes", "3").returncode == 2
    ok = cli("validate", str(path), "--nodes", "1", "--equal-slots")
    assert ok.returncode == 0, ok.stderr


def test_good_hostfile_matches_deepspeeds_own_parser(tmp_path):
    from deepspeed.launcher.runner import _parse_hostfile

    out = tmp_path / "hostfile"
    proc = cli("build", "--hosts", "worker-0,worker-1:4,10.0.0.7", "--slots", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "worker-0 slots=8\nworker-1 slots=4\n10.0.0.7 slots=8\n"
    assert dict(_parse_hostfile(out.read_text().splitlines())) == {h.name: h.slots for h in hf.read_hostfile(out)}
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("single", ["single"]),
    ("a,b[2],c", ["a", "b2", "c"]),
])
def test_slurm_nodelist_expansion(nodelist, hosts):
    assert hf.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node]1[", "node[3-1]", "node[a-b]"])
def test_slurm_nodelist_errors(bad):
    with pytest.raises(hf.HostfileError, match="nodelist"):
        hf.expand_nodelist(bad)


def test_build_from_slurm_env(tmp_path):
    out = tmp_path / "hostfile"
    proc = cli("build", "--slurm", "--slots", "8", "--out", str(out),
               env=dist_env(SLURM_JOB_NODELIST="node[01-03,07],gpu-a[1-2]"))
    assert proc.returncode == 0, proc.stderr
    assert [h.name for h in hf.read_hostfile(out, equal_slots=True)] == \
        ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]
    assert cli("expand-nodelist", "node[1-2]").stdout.split() == ["node1", "node2"]
    env = dist_env()
    env.pop("SLURM_JOB_NODELIST", None)
    env.pop("SLURM_NODELIST", None)
    missing = cli("build", "--slurm", "--out", str(out), env=env)
    assert missing.returncode == 2 and "SLURM_JOB_NODELIST is not set" in missing.stderr


def test_build_from_aws_batch_env():
    child = {"AWS_BATCH_JOB_NUM_NODES": "3", "AWS_BATCH_JOB_NODE_INDEX": "2", "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0",
             "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS": "10.0.0.5"}
    # every node builds the same placeholder hostfile from its own environment (enough for --no_ssh launches)
    assert [h.name for h in hf.hosts_from_aws_batch(child, 8)] == [f"aws-batch-node-{i}" for i in range(3)]
    hosts = hf.hosts_from_aws_batch(child, 8, ["10.0.0.5", "10.0.0.6", "10.0.0.7"])
    assert hf.format_hostfile(hosts) == "10.0.0.5 slots=8\n10.0.0.6 slots=8\n10.0.0.7 slots=8\n"
    with pytest.raises(hf.HostfileError, match="2 addresses given for AWS_BATCH_JOB_NUM_NODES=3"):
        hf.hosts_from_aws_batch(child, 8, ["10.0.0.5", "10.0.0.6"])
    with pytest.raises(hf.HostfileError, match="node index 3 is outside 0..2"):
        hf.hosts_from_aws_batch({**child, "AWS_BATCH_JOB_NODE_INDEX": "3"}, 8)
    with pytest.raises(hf.HostfileError, match="MAIN_NODE_PRIVATE_IPV4_ADDRESS is not set on a child"):
        hf.aws_batch_info({k: v for k, v in child.items() if "PRIVATE" not in k})
    with pytest.raises(hf.HostfileError, match="AWS_BATCH_JOB_NUM_NODES"):
        hf.aws_batch_info({})


def test_build_from_mpi_hostfile(tmp_path):
    src = tmp_path / "mpi_hosts"
    src.write_text("# openmpi and mpich styles\nnode1 slots=8 max_slots=8\nnode2:8\nnode3\nnode3\n")
    out = tmp_path / "hostfile"
    proc = cli("build", "--mpi-hostfile", str(src), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "node1 slots=8\nnode2 slots=8\nnode3 slots=2\n"
    proc = cli("build", "--mpi-hostfile", str(src), "--slots", "4", "--equal-slots", "--out", str(out))
    assert proc.returncode == 0 and out.read_text().count("slots=4") == 3
    src.write_text("node1 slots=8\nnode2 cores=8\n")
    bad = cli("build", "--mpi-hostfile", str(src), "--out", str(out))
    assert bad.returncode == 2 and "line 2: unknown field 'cores=8'" in bad.stderr
