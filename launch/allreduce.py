"""A short all-reduce across the hosts of a hostfile, one process per host, on the collective backend the ranks
will use (gloo on CPU hosts, NCCL on CUDA, HCCL on Gaudi): launch.preflight's check that the fabric carries data
between the hosts, and at what rate.

Each host runs `python -m launch.preflight --allreduce_member RANK,WORLD,ADDR:PORT` (over ssh for remote hosts, as
the probe): the processes meet at the master's address and port (the rendezvous the run will use), all-reduce a
float32 buffer of rank + 1 once to warm up and `iters` times timed, check that every element came back as the exact
sum 1 + ... + WORLD, and print one JSON line. The bandwidth is the bus bandwidth as nccl-tests defines it: bytes x
2 (n - 1) / n over the median time of one all-reduce (what each link carries in a ring), comparable across host
counts.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from datetime import timedelta
from typing import Mapping, Sequence

from ds_core.redact import is_secret

BACKENDS = {"hpu": ("hccl", "hpu"), "cuda": ("nccl", "cuda:0"), "cpu": ("gloo", "cpu")}


def member(rank: int, world: int, addr: str, port: int, nbytes: int, iters: int, timeout_s: float,
           accelerator: str) -> dict:
    """One host's part (JSON-able result): join, all-reduce, check, time."""
    import torch
    import torch.distributed as dist

    from ds_core.compat.torch_releases import release_process_groups

    backend, device = BACKENDS.get(accelerator, BACKENDS["cpu"])
    if accelerator == "hpu":
        import habana_frameworks.torch.distributed.hccl  # noqa: F401  # pragma: no cover - registers "hccl"
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    sync = getattr(getattr(torch, torch.device(device).type, None), "synchronize", None)
    x = torch.empty(max(1, nbytes // 4), dtype=torch.float32, device=device)
    times, ok = [], True
    for i in range(iters + 1):
        x.fill_(float(rank + 1))
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if sync is not None:
            sync()
        if i:
            times.append(time.perf_counter() - t0)
        ok = ok and bool((x == world * (world + 1) / 2).all())  # small integers: exact in float32
    release_process_groups()  # destroy_process_group without torch 2.6's deadlock
    return {"rank": rank, "ok": ok, "seconds": sorted(times)[len(times) // 2], "backend": backend,
            "bytes": x.numel() * 4}


def bus_gbit(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth of one all-reduce, in Gbit/s."""
    return nbytes * 2 * (world - 1) / world / seconds * 8 / 1e9 if seconds > 0 and world > 1 else 0.0


def member_command(rank: int, world: int, addr: str, port: int, nbytes: int, iters: int,
                   timeout_s: float) -> list[str]:
    return [sys.executable, "-m", "launch.preflight", "--allreduce_member", f"{rank},{world},{addr}:{port}",
            "--allreduce_bytes", str(nbytes), "--allreduce_iters", str(iters), "--allreduce_timeout",
            str(timeout_s)]


def remote_command(host: str, inner: list[str], env: Mapping[str, str], ssh_port: int, ssh_timeout: float) -> list:
    """ssh HOST 'cd CWD && env NAME=VALUE ... INNER': the same working directory and interpreter path as here, and
    the variables DeepSpeed's launch exports to every node (PYTHONPATH and .deepspeed_env), each argument quoted for
    the remote shell. Secret-looking ones (ds_core.redact) are left out: an all-reduce needs none, and an ssh command
    line is visible to `ps` on both hosts."""
    env = {**({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}),
           **{k: v for k, v in env.items() if not is_secret(k)}}
    assigned = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    remote = f"cd {shlex.quote(os.getcwd())} && env {assigned} {shlex.join(inner)}"
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(ssh_timeout)}"]
    return cmd + (["-p", str(ssh_port)] if ssh_port else []) + [host, remote]


def run_all(cmds: Sequence[tuple[list[str], dict | None]], timeout_s: float) -> list[dict | str]:
    """Start every host's member at once (they meet in the process group), wait up to timeout_s; per host its
    result or why there is none."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in cmds]
    deadline, out = time.monotonic() + timeout_s, []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            out.append(f"no result within {timeout_s:g} s: {text.strip()[-200:]!r}")
            continue
        try:
            out.append(json.loads(text.strip().splitlines()[-1]))
        except (json.JSONDecodeError, IndexError):
            out.append(f"exit {p.returncode}: {text.strip()[-300:]}")
    return out
