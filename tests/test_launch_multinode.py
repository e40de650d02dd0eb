"""Two simulated nodes on one machine, each started the way AWS Batch / Kubernetes nodes are:
`python -m launch.run --launcher no_ssh --node_rank I` -> `deepspeed --hostfile H --no_ssh --node_rank I
--master_addr A`, training the BERT debug preset with ZeRO-1 bf16. Variants: loopback; one network namespace per
node joined by a veth pair (skipped, with the reason, where namespaces cannot be made); and a rank killed mid-run."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import REPO, dist_env, free_port
from ds_core.device.precision import resolve_precision

pytestmark = pytest.mark.slow

DS_JSON = str(REPO / "ds_configs" / "bert_debug_zero1_bf16.json")  # ZeRO-1, bf16, no optimizer section
LAUNCH_TIMEOUT = 420  # per run; a hang fails the test instead of stalling CI


def make_data(d: Path) -> Path:
    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    d.mkdir(parents=True, exist_ok=True)
    for i in range(2):  # debug preset phase 1: seq 128, 20 predictions, vocab 1024
        write_shard(d / f"bert_training_seq128_{i:05d}.hdf5", synthetic_arrays(32, 128, 20, vocab_size=1024, seed=i))
    return d


def node_cmd(rank: int, master: str, port: int, run_dir: Path, data: Path, *train: str,
             wrapper: tuple[str, ...] = (), profile: str = "tcp", run_opts: tuple[str, ...] = ()) -> list[str]:
    return [*wrapper, sys.executable, "-m", "launch.run", "--launcher", "no_ssh", "--hostfile", "hostfile", *run_opts,
            "--node_rank", str(rank), "--master_addr", master, "--master_port", str(port),
            *(["--profile", profile] if profile else []), "--preset", "debug", "--deepspeed_config", DS_JSON,
            "--", "--input_dir", str(data), "--run_dir", str(run_dir), "--progress_bar", "false", *train]


def start_nodes(cmds: list[list[str]], cwd: Path, env: dict) -> list[subprocess.Popen]:
    procs = []
    for i, cmd in enumerate(cmds):
        log = open(cwd / f"node{i}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def wait_all(procs: list[subprocess.Popen], cwd: Path, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        logs = "\n".join((cwd / f"node{i}.log").read_text()[-3000:] for i in range(len(procs)))
        pytest.fail(f"nodes still running after {timeout:.0f} s (hang):\n{logs}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # our own session: the node's launcher and its ranks
                p.wait()
    return codes


def logs(cwd: Path, n: int = 2) -> str:
    return "\n".join(f"--- node{i}\n" + (cwd / f"node{i}.log").read_text()[-4000:] for i in range(n))


def summary(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["type"] == "summary"][-1]


FAKE_SSH = ('#!/bin/bash\n# ssh to every host of the hostfile, on this machine: the remote command string run by bash, '
            'as sshd runs it\nwhile [[ "$1" == -* ]]; do shift 2; done\nshift\nexec bash -c "$*"\n')


def preflight_across_nodes(tmp_path: Path, port: int) -> dict:
    """launch.preflight over the hostfile's two nodes (ssh to each runs here), with its all-reduce across them on
    gloo; the rows by (host, check). Printed: the table, as a user sees it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    env = dist_env(PATH=f"{bin_dir}:{os.environ['PATH']}")
    wrote = subprocess.run([sys.executable, "-m", "launch.env", "write", "--profile", "tcp"], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert wrote.returncode == 0, wrote.stdout
    proc = subprocess.run([sys.executable, "-m", "launch.preflight", "--hostfile", "hostfile", "--profile", "tcp",
                           "--master_addr", "127.0.0.1", "--master_port", str(port), "--allreduce_mb", "16",
                           "--json"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=LAUNCH_TIMEOUT)
    print("\n".join(proc.stdout.splitlines()[:-1]))
    assert proc.returncode == 0, proc.stdout
    return {(r["host"], r["check"]): r for r in json.loads(proc.stdout.strip().splitlines()[-1])["rows"]}


@pytest.mark.stack  # two nodes through the installed DeepSpeed's pdsh runner
def test_two_nodes_on_loopback(tmp_path):
    (tmp_path / "hostfile").write_text("node0 slots=1\nnode1 slots=1\n")
    data, run_dir, port = make_data(tmp_path / "data"), tmp_path / "run", free_port()
    # preflight first, as the docs say: each node over ssh, and a short all-reduce across both on the run's port
    rows = preflight_across_nodes(tmp_path, port)
    assert rows[("node1", "reachable")]["detail"] == "ssh ok" and rows[("node1", "profile tcp")]["result"] == "PASS"
    allreduce = rows[("(job)", "all_reduce")]
    assert allreduce["result"] == "PASS" and "2 hosts x 1 process, 16 MiB float32 over gloo" in allreduce["detail"]
    assert "bus bandwidth" in allreduce["detail"] and "profile tcp: no expected figure" in allreduce["detail"]
    cmds = [node_cmd(i, "127.0.0.1", port, run_dir, data, "--max_steps", "3") for i in range(2)]
    codes = wait_all(start_nodes(cmds, tmp_path, dist_env()), tmp_path, LAUNCH_TIMEOUT)
    assert codes == [0, 0], logs(tmp_path)
    s = summary(run_dir)
    assert (s["world_size"], s["nodes"], s["accelerators_per_node"]) == (2, 2, 1), s
    assert s["zero_stage"] == 1 and s["precision"] == resolve_precision("auto", "cpu")[0] and s["steps"] == 3
    # each node really ran as its own DeepSpeed launcher with --no_ssh and its node rank
    for i in range(2):
        assert f"nnodes=2, num_local_procs=1, node_rank={i}" in (tmp_path / f"node{i}.log").read_text()


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=30)


@pytest.fixture
def two_namespaces():
    """Namespaces dsl<pid>0 / dsl<pid>1, each with an interface `dsnet0` (10.213.<k>.1 and .2/24) of one veth pair.
    Traffic stays between the two namespaces: nothing is routed to the host or beyond."""
    if shutil.which("ip") is None:
        pytest.skip("network namespace variant: the `ip` command (iproute2) is not installed")
    tag = f"dsl{os.getpid() % 100000}"
    names = [f"{tag}n0", f"{tag}n1"]
    made = []
    try:
        for ns in names:
            _ip("netns", "del", ns)  # a leftover of an earlier interrupted run of this test (same pid)
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"network namespace variant: `ip netns add` failed ({r.stderr.strip()}); needs root or "
                            "CAP_SYS_ADMIN, which this environment does not give")
            made.append(ns)
        subnet = f"10.213.{os.getpid() % 250}"
        steps = [("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b"),
                 ("link", "set", f"{tag}a", "netns", names[0]), ("link", "set", f"{tag}b", "netns", names[1])]
        for i, (ns, end) in enumerate(zip(names, ("a", "b"))):
            steps += [("-n", ns, "link", "set", f"{tag}{end}", "name", "dsnet0"),
                      ("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", "dsnet0"),
                      ("-n", ns, "link", "set", "dsnet0", "up"), ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                pytest.skip(f"network namespace variant: `ip {' '.join(step)}` failed: {r.stderr.strip()}")
        yield names, [f"{subnet}.1", f"{subnet}.2"]
    finally:
        for ns in made:
            _ip("netns", "del", ns)  # deletes the veth pair with it


def test_two_nodes_in_network_namespaces(tmp_path, two_namespaces):
    names, addrs = two_namespaces
    # every node names the same interface, so one .deepspeed_env serves both, as on a real cluster
    (tmp_path / "hostfile").write_text(f"{addrs[0]} slots=1\n{addrs[1]} slots=1\n")
    wrote = subprocess.run([sys.executable, "-m", "launch.env", "write", "--profile", "tcp", "--set",
                            "GLOO_SOCKET_IFNAME=dsnet0"], cwd=tmp_path, env=dist_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=60)
    assert wrote.returncode == 0, wrote.stdout
    data, run_dir, port = make_data(tmp_path / "data"), tmp_path / "run", free_port()
    cmds = [node_cmd(i, addrs[0], port, run_dir, data, "--max_steps", "3", profile="",
                     wrapper=("ip", "netns", "exec", names[i])) for i in range(2)]
    codes = wait_all(start_nodes(cmds, tmp_path, dist_env()), tmp_path, LAUNCH_TIMEOUT)
    assert codes == [0, 0], logs(tmp_path)
    s = summary(run_dir)
    assert (s["world_size"], s["nodes"]) == (2, 2), s


def start_long_two_node_run(tmp_path: Path, *train: str, run_opts: tuple[str, ...] = ()) -> tuple[list, Path]:
    """Two simulated nodes of one rank each on loopback, training far more steps than a test lets them run (with
    --dist_timeout_s in `train`, so no survivor can wait 30 minutes); returns the launchers and the run dir."""
    (tmp_path / "hostfile").write_text("node0 slots=1\nnode1 slots=1\n")
    data, run_dir, port = make_data(tmp_path / "data"), tmp_path / "run", free_port()
    train = ("--max_steps", "100000", "--save_final_checkpoint", "false", "--log_every", "50", *train)
    procs = start_nodes([node_cmd(i, "127.0.0.1", port, run_dir, data, *train, run_opts=run_opts) for i in range(2)],
                        tmp_path,
                        dist_env())
    return procs, run_dir


def wait_for(ready, procs: list, tmp_path: Path, what: str) -> None:
    """Poll until ready() while every launcher lives; fail naming `what` if one exits or LAUNCH_TIMEOUT passes."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while not ready():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            wait_all(procs, tmp_path, 1)
            pytest.fail(f"{what}:\n" + logs(tmp_path))
        time.sleep(0.2)


def node_rank_process(launcher) -> psutil.Process:
    """The rank itself (`python -u -m launch.guard --child bert_ref.train ...`, started by the rank's launch.guard)
    under a node's launcher, not DeepSpeed's per-node launcher or the guard, whose arguments also name the module."""
    guard = next(c for c in psutil.Process(launcher.pid).children(recursive=True)
                 if c.cmdline()[2:4] == ["-m", "launch.guard"] and "--child" not in c.cmdline())
    # the guard's own child: the rank's data-loader workers are forked from it and carry the same command line
    return next(c for c in guard.children() if "--child" in c.cmdline())


def test_a_rank_dies_the_other_exits_and_the_checkpoint_is_intact(tmp_path):
    procs, run_dir = start_long_two_node_run(tmp_path, "--num_steps_per_checkpoint", "3", "--dist_timeout_s", "30")
    latest = run_dir / "checkpoints" / "latest"
    wait_for(latest.exists, procs, tmp_path, "no checkpoint before the kill")
    victim = node_rank_process(procs[1])
    victim.send_signal(signal.SIGKILL)  # node 1's only rank, mid-run
    codes = wait_all(procs, tmp_path, 240)  # bounded: a survivor hanging in a collective fails here
    assert codes[0] != 0 and codes[1] != 0, logs(tmp_path)

    # the checkpoint "latest" names is complete: every rank's part is there and loads
    root = run_dir / "checkpoints"
    tag = latest.read_text().strip()
    done = json.loads((root / tag / "COMPLETE").read_text())
    assert tag == f"global_step{done['step']}"
    for r in range(2):
        assert torch.load(root / tag / f"client_rank{r}.pt", weights_only=False)["step"] == done["step"]
    optim = sorted((root / tag).glob("*optim_states.pt"))
    assert len(optim) == 2, sorted(p.name for p in (root / tag).iterdir())
    for f in [*optim, *(root / tag).glob("mp_rank_*_model_states.pt")]:
        torch.load(f, weights_only=False, map_location="cpu")


def test_a_hung_rank_is_cut_off_by_the_collective_timeout(tmp_path):
    """A rank that stops answering but keeps its sockets open (SIGSTOP: a hung driver, a swapped-out host) is only
    noticed through the collective timeout: the survivor must fail after --dist_timeout_s instead of waiting, and the
    stopped rank's own node must not wait for it forever: launch.guard kills it after the timeout plus the grace."""
    # 45 s: init collectives on a loaded 2-core machine can take 20 s; grace 5 s (launch.run's default is 60): the
    # stopped rank's heartbeat has stopped, so the guard's timer only has to outlast the survivor's collective timeout
    procs, run_dir = start_long_two_node_run(tmp_path, "--num_steps_per_checkpoint", "0", "--dist_timeout_s", "45",
                                             run_opts=("--stall_grace_s", "5"))
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and '"type": "step"' in metrics.read_text(), procs, tmp_path,
             "training never started")
    victim = node_rank_process(procs[1])
    victim.suspend()  # SIGSTOP: alive, sockets open, silent
    try:
        # both launchers on their own; bounded: 45 s timeout + 5 s grace + slack for a loaded machine
        codes = wait_all(procs, tmp_path, 240)
    finally:
        if victim.is_running():
            victim.kill()
    assert codes[0] != 0 and codes[1] != 0, logs(tmp_path)
    node0, node1 = ((tmp_path / f"node{i}.log").read_text() for i in range(2))
    assert "timed out" in node0.lower() or "timeout" in node0.lower(), logs(tmp_path)
    assert "no heartbeat from the training process for 50 s" in node1, logs(tmp_path)
