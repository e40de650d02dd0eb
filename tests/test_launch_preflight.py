"""launch.preflight on localhost: a passing table, and each failure shown per host with a non-zero exit."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

from conftest import REPO, dist_env, free_port
from launch import preflight


def run_preflight(cwd, *args, env=None) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-m", "launch.preflight", "--json", *args], cwd=cwd,
                          env=env or dist_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=120)
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    return proc.returncode, {(r["host"], r["check"]): r for r in rows}, proc.stdout


def test_localhost_passes(tmp_path):
    (tmp_path / "hostfile").write_text("localhost slots=2\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard_0.h5").write_bytes(b"x")
    (tmp_path / ".deepspeed_env").write_text("GLOO_SOCKET_IFNAME=lo\n")
    env = dist_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")  # the rest of the tcp profile
    code, rows, out = run_preflight(tmp_path, "--hostfile", "hostfile", "--data_dir", "data", "--profile", "tcp",
                                    "--deepspeed_config", str(REPO / "ds_configs" / "zero1_bf16.json"),
                                    "--master_port", str(free_port()), env=env)
    assert code == 0, out
    for check in ("reachable", "python", "torch", "deepspeed", "ds-scale-toolkit", "accelerators", "master_port",
                  "profile tcp", "data_dir"):
        assert rows[("localhost", check)]["result"] == "PASS", out
    assert rows[("localhost", "reachable")]["detail"] == "local (no ssh)"
    assert "world 2: train_batch 16 = micro 8 x accum 1 x 2" in rows[("(job)", "deepspeed_config")]["detail"]
    assert "host" in out.splitlines()[0] and "result" in out.splitlines()[0]


def test_failures_are_reported_per_host(tmp_path):
    (tmp_path / "hostfile").write_text(f"127.0.0.1 slots={(__import__('os').cpu_count() or 1) + 1}\n")
    (tmp_path / "bad_ds.json").write_text(json.dumps({"train_batch_size": 5, "train_micro_batch_size_per_gpu": 2,
                                                      "gradient_accumulation_steps": 1}))
    env = dist_env(DS_ACCELERATOR="cpu")
    env.pop("GLOO_SOCKET_IFNAME", None)
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, rows, out = run_preflight(tmp_path, "--hostfile", "hostfile", "--data_dir", "nowhere", "--profile",
                                        "tcp", "--deepspeed_config", "bad_ds.json", "--master_port", str(port),
                                        env=env)
    assert code == 1, out
    host = "127.0.0.1"
    assert rows[(host, "reachable")]["result"] == "PASS"
    assert rows[(host, "accelerators")]["result"] == "FAIL" and "< slots" in rows[(host, "accelerators")]["detail"]
    assert rows[(host, "master_port")]["result"] == "FAIL" and "in use" in rows[(host, "master_port")]["detail"]
    assert rows[(host, "data_dir")]["result"] == "FAIL" and "nowhere" in rows[(host, "data_dir")]["detail"]
    assert rows[(host, "profile tcp")]["result"] == "FAIL" and "GLOO_SOCKET_IFNAME" in rows[(host, "profile tcp")][
        "detail"]
    assert rows[("(job)", "deepspeed_config")]["result"] == "FAIL"
    assert "checks failed" in out


def test_bad_hostfile_fails_preflight(tmp_path):
    (tmp_path / "hostfile").write_text("localhost slots=1\nlocalhost slots=1\n")
    code, rows, out = run_preflight(tmp_path, "--hostfile", "hostfile")
    assert code == 1 and "line 2: duplicate host localhost" in rows[("(hostfile)", "hostfile")]["detail"]


def test_only_remote_hosts_use_ssh():
    assert preflight.is_local("localhost") and preflight.is_local("127.0.0.1")
    assert preflight.is_local(socket.gethostname())
    assert not preflight.is_local("node-that-does-not-exist.invalid")


def test_remote_hosts_are_probed_over_ssh_with_quoted_arguments(tmp_path):
    """A stand-in `ssh` runs the remote command string with bash, as sshd would: the probe's arguments must arrive
    whole (a data dir named like a shell command runs nothing) and an unreachable host is a FAIL row."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ssh"
    fake.write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift 2; done\nhost=$1; shift\n'
                    'if [[ "$host" == down* ]]; then echo "ssh: connect to host $host: refused" >&2; exit 255; fi\n'
                    'exec bash -c "$*"\n')
    fake.chmod(0o755)
    marker = tmp_path / "pwned"
    (tmp_path / "hostfile").write_text("remote-a slots=1\ndown-b slots=1\n")
    env = dist_env(DS_ACCELERATOR="cpu", PATH=f"{bin_dir}:{__import__('os').environ['PATH']}")
    code, rows, out = run_preflight(tmp_path, "--hostfile", "hostfile", "--data_dir", f"x'; touch {marker}; '",
                                    "--master_port", str(free_port()), env=env)
    assert code == 1, out
    assert rows[("remote-a", "reachable")] == {"host": "remote-a", "check": "reachable", "result": "PASS",
                                                "detail": "ssh ok"}
    assert rows[("remote-a", "python")]["result"] == "PASS" and rows[("remote-a", "master_port")]["result"] == "PASS"
    assert rows[("remote-a", "data_dir")]["result"] == "FAIL"
    assert rows[("down-b", "reachable")]["result"] == "FAIL" and "refused" in rows[("down-b", "reachable")]["detail"]
    assert not marker.exists()


def test_the_documented_interface_override_passes_preflight_and_launch(tmp_path):
    """README: `launch.env write --profile efa --set HCCL_SOCKET_IFNAME=ens32` for a NIC not named like the profile's
    default. Interface names are `?=` site values: any value passes; an `=` value that differs still fails."""
    (tmp_path / "hostfile").write_text("localhost slots=1\n")
    wrote = subprocess.run([sys.executable, "-m", "launch.env", "write", "--profile", "efa", "--set",
                            "HCCL_SOCKET_IFNAME=ens32"], cwd=tmp_path, env=dist_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=60)
    assert wrote.returncode == 0, wrote.stdout
    assert "HCCL_SOCKET_IFNAME=ens32\n" in (tmp_path / ".deepspeed_env").read_text()
    code, rows, out = run_preflight(tmp_path, "--hostfile", "hostfile", "--profile", "efa",
                                    "--master_port", str(free_port()))
    assert rows[("localhost", "profile efa")]["result"] == "PASS", out
    launch = subprocess.run([sys.executable, "-m", "launch.run", "--dry_run", "--profile", "efa"], cwd=tmp_path,
                            env=dist_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    assert launch.returncode == 0, launch.stderr
    # a value the profile fixes is still checked: Gaudi Direct switched off is not efa's
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_text(env_file.read_text().replace("FI_EFA_USE_DEVICE_RDMA=1", "FI_EFA_USE_DEVICE_RDMA=0"))
    code, rows, out = run_preflight(tmp_path, "--hostfile", "hostfile", "--profile", "efa",
                                    "--master_port", str(free_port()))
    assert rows[("localhost", "profile efa")]["result"] == "FAIL" and "FI_EFA_USE_DEVICE_RDMA=0" in out, out


def _time_wait_port(reuse: bool) -> int:
    """A port whose only socket left is in TIME_WAIT (the side that closes first keeps it), as a finished run's
    rendezvous server leaves it; `reuse`: the server had SO_REUSEADDR, as torch's TCPStore sets it."""
    srv = socket.socket()
    if reuse:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()
    srv.close()
    client.recv(1)  # the server's FIN has arrived: closing now leaves TIME_WAIT on the server's side
    client.close()
    return port


def test_port_check_agrees_with_torchs_store():
    """Free exactly when torch's TCPStore server can listen there: TIME_WAIT left by a store does not block it (a
    plain bind would say 'in use'); a listening socket does."""
    from datetime import timedelta

    import torch.distributed as dist

    port = _time_wait_port(reuse=True)
    with socket.socket() as plain:
        try:
            plain.bind(("0.0.0.0", port))
            plain_ok = True
        except OSError:
            plain_ok = False
    ok, detail = preflight.port_free(port)
    assert ok, detail
    store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10))  # the reference: it binds
    del store
    assert not plain_ok  # what the old check did: Linux refuses a plain bind over TIME_WAIT
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        ok, detail = preflight.port_free(busy.getsockname()[1])
        assert not ok and f"port {busy.getsockname()[1]} in use" in detail
