"""A one-machine Slurm cluster for tests and for trying launch/slurm_job.sh by hand: one slurmctld and two slurmd
(`slurmd -N node-a`, `slurmd -N node-b`, each on its own loopback address and port) with a private munged, all
started inside one private mount namespace whose /etc/hosts names node-a -> 127.0.0.1 and node-b -> 127.0.0.2.
Everything (munge key, slurm.conf, spool, state, logs, sockets) lives in one directory; nothing system-wide is
changed, and stopping the namespace's first process ends every daemon in it.

    python tests/slurm_cluster.py DIR      # start, print `export SLURM_CONF=...`, wait for Ctrl-C, stop
    SLURM_CONF=DIR/slurm.conf sbatch --nodes=2 launch/slurm_job.sh ...

Jobs run under slurmd, so inside the namespace: `node-a` resolves there exactly as a cluster's DNS would resolve
a node name, which launch.slurm takes as the master address. Clients (sbatch, squeue) run outside it and reach
slurmctld at 127.0.0.1 through SLURM_CONF. Needs root (slurmd starts jobs as their user), `unshare`, munged,
slurmctld, slurmd: `available()` says what is missing. Hand-written because no package ships a throwaway cluster;
the settings are the minimal ones of Slurm's own quickstart (proctrack/pgid, no cgroups, no accounting).
"""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

NODES = {"node-a": "127.0.0.1", "node-b": "127.0.0.2"}
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "unshare")


def _tool(name: str) -> str:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin") or ""


def available() -> str:
    """'' when a cluster can start here, else why not."""
    missing = [t for t in TOOLS if not _tool(t)]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "not root: slurmd must start jobs as their user, and the private /etc/hosts needs a mount namespace"
    return ""


def _free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def write_config(d: Path) -> Path:
    """munge key, hosts file, slurm.conf in d; returns slurm.conf's path."""
    for sub in ("state", "munge", *(f"spool/{n}" for n in NODES)):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "munge").chmod(0o700)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))  # what `mungekey` writes: random bytes, owner-only
    key.chmod(0o400)
    hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
    (d / "hosts").write_text(hosts + "".join(f"{a} {n}\n" for n, a in NODES.items()))
    (d / "plugstack.conf").write_text("")
    ctl_port = _free_port()
    cpus = os.cpu_count() or 1
    lines = [
        "ClusterName=onebox", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={ctl_port}",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={d / 'munge' / 'munged.sock'}",
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}/%n",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d}/slurmd.%n.pid",
        f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d}/slurmd.%n.log",
        f"PlugStackConfig={d / 'plugstack.conf'}",
        "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "MpiDefault=none", "SwitchType=switch/none", "ReturnToService=2",
        "SlurmctldTimeout=30", "SlurmdTimeout=60", "InactiveLimit=0", "KillWait=5", "MinJobAge=300",
        "SchedulerType=sched/builtin",
        # two slurmd on one host: each its own Port (Debian's slurmd is built with --enable-multiple-slurmd)
        *(f"NodeName={n} NodeAddr={a} NodeHostname={n} Port={_free_port(a)} CPUs={cpus} State=UNKNOWN"
          for n, a in NODES.items()),
        f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
    ]
    conf = d / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def _namespace_script(d: Path, conf: Path) -> str:
    """sh run by `unshare --mount`: private /etc/hosts, then munged, slurmctld and both slurmd in the foreground;
    it waits, and on TERM stops them all."""
    m = d / "munge"
    daemons = [
        f"{_tool('munged')} -F --force --socket={m / 'munged.sock'} --key-file={m / 'munge.key'} "
        f"--pid-file={m / 'munged.pid'} --log-file={m / 'munged.log'} --seed-file={m / 'munged.seed'}",
        f"{_tool('slurmctld')} -D -i -f {conf}",
        *(f"{_tool('slurmd')} -D -f {conf} -N {n}" for n in NODES),
    ]
    body = ["set -e", f"mount --bind {d / 'hosts'} /etc/hosts", "pids="]
    for i, cmd in enumerate(daemons):
        body.append(f"{cmd} >{d}/daemon{i}.out 2>&1 & pids=\"$pids $!\"")
        if i == 0:  # slurm daemons need munged's socket
            body.append(f"for _ in $(seq 100); do [ -S {m / 'munged.sock'} ] && break; sleep 0.1; done")
    body += ["trap 'kill $pids 2>/dev/null; wait; exit 0' TERM INT", "wait"]
    return "\n".join(body)


def _wait_nodes_idle(env: dict, timeout_s: float, proc: subprocess.Popen, d: Path) -> None:
    deadline = time.monotonic() + timeout_s
    out = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        r = subprocess.run([_tool("sinfo") or "sinfo", "-h", "-N", "-o", "%N %t"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=30)
        out = r.stdout
        states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
        if all(states.get(n) == "idle" for n in NODES):
            return
        time.sleep(0.5)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(d.glob("*.log")) + sorted(
        d.glob("daemon*.out")) if p.is_file())
    raise RuntimeError(f"one-machine Slurm cluster in {d} did not come up (sinfo: {out.strip()!r})\n{logs}")


@contextmanager
def cluster(d: Path, timeout_s: float = 60) -> Iterator[dict]:
    """Start the cluster in d; yields the environment (SLURM_CONF set) for sbatch/srun/squeue; stops it at the end."""
    why = available()
    if why:
        raise RuntimeError(f"one-machine Slurm cluster: {why}")
    d.mkdir(parents=True, exist_ok=True)
    conf = write_config(d)
    script = _namespace_script(d, conf)
    proc = subprocess.Popen([_tool("unshare"), "--mount", "--propagation", "private", "sh", "-c", script],
                            stdout=open(d / "namespace.out", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    env = dict(os.environ, SLURM_CONF=str(conf))
    try:
        _wait_nodes_idle(env, timeout_s, proc, d)
        yield env
    finally:
        # jobs first: slurmstepd and the job's processes are not in the daemons' process group
        if proc.poll() is None:
            subprocess.run([_tool("scancel") or "scancel", "--full", "--signal=KILL", f"--user={getpass.getuser()}"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
            time.sleep(1)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left in the daemons' process group goes too
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    d = Path(argv[0]).resolve()
    try:
        with cluster(d) as env:
            print(f"export SLURM_CONF={env['SLURM_CONF']}   # nodes {', '.join(NODES)} are idle; Ctrl-C stops them",
                  flush=True)
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
