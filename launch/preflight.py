"""Check every host of a hostfile before a run; print a pass/fail table; exit 1 on any failure.

    python -m launch.preflight --hostfile hostfile --profile efa --data_dir /fsx/bert_h5 \\
        --deepspeed_config ds_configs/zero1_bf16.json --master_port 29500

Per host: reachable (ssh, only for hosts that are not this machine), the same Python and the same torch / deepspeed /
toolkit versions as this machine, accelerators >= slots, the profile's variables present in what the ranks will see
(the host's environment plus the .deepspeed_env DeepSpeed exports from here), the data directory readable. On the
master host: the master port free. For the job: the DeepSpeed config valid for the world size the hostfile gives.
Hosts named localhost, 127.x.x.x, ::1, or this machine's host name or addresses are checked in this process, no ssh.

The fabric (launch.fabric), per host: the Gaudi cards' external NIC ports (hl-smi) where there are Gaudi cards,
libfabric's version and providers (fi_info) where it is installed or the profile scales out through it, and on a
Gaudi host the scale-out mode HCCL will pick from those, the kernel and the variables its ranks see (with settings
that contradict each other). Across the hosts: a short all-reduce, one process per host, on the ranks' collective
backend (launch.allreduce), its bus bandwidth printed next to what the profile's fabric gives.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from ds_core.cli import cli_main
from launch import allreduce, env as envmod, fabric, hostfile as hf

PASS, FAIL, SKIP = "PASS", "FAIL", "-"
PACKAGES = ("torch", "deepspeed", "ds-scale-toolkit")


# ------------------------------------------------------------------------------------------------ probe (per host)
def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        if dist == "ds-scale-toolkit":  # a source checkout on PYTHONPATH, not pip-installed
            return "source:" + str(Path(__file__).resolve().parents[1])
        return "missing"


def _accelerator() -> str:
    forced = os.environ.get("DS_ACCELERATOR", "")
    if forced:
        return forced
    if importlib.util.find_spec("habana_frameworks") is not None:
        return "hpu"
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    except ImportError:
        pass
    return "cpu"


def _accelerator_count(kind: str) -> int:
    if kind == "hpu":
        import habana_frameworks.torch.hpu as hthpu

        return int(hthpu.device_count())
    if kind == "cuda":
        import torch

        return torch.cuda.device_count()
    # CPU "accelerators" are processes: DeepSpeed's CPU backend runs one rank per slot on any core count
    return os.cpu_count() or 1


def port_free(port: int) -> tuple[bool, str]:
    """Whether the rendezvous could listen on `port`. SO_REUSEADDR, as torch's TCPStore server sets it: a port with
    only TIME_WAIT sockets left (a run that just ended) is free to it, and a plain bind would call it in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            s.listen(1)
        except OSError as e:
            return False, f"port {port} in use ({e.strerror})"
    return True, f"port {port} free"


def _data_dir(path: str) -> tuple[bool, str]:
    p = Path(path)
    if not p.is_dir():
        return False, f"{path}: not a directory"
    if not os.access(p, os.R_OK | os.X_OK):
        return False, f"{path}: not readable"
    try:
        n = sum(1 for _ in p.iterdir())
    except OSError as e:
        return False, f"{path}: {e.strerror}"
    return (n > 0), f"{path}: {n} entries" if n else f"{path}: empty"


def probe(names: Sequence[str] = (), port: int = 0, data_dir: str = "", fabric_facts: bool = True) -> dict:
    """What one host reports about itself (JSON-able); fabric_facts: also its fabric (launch.fabric.probe_fabric)."""
    kind = _accelerator()
    try:
        count, count_err = _accelerator_count(kind), ""
    except Exception as e:  # noqa: BLE001 - a broken driver stack is a finding, not a crash
        count, count_err = 0, f"{type(e).__name__}: {e}"
    out = {"hostname": socket.gethostname(), "python": platform.python_version(), "executable": sys.executable,
           "versions": {d: _version(d) for d in PACKAGES}, "accelerator": kind, "accelerators": count,
           "accelerator_error": count_err, "env": {n: os.environ[n] for n in names if n in os.environ},
           "fabric": fabric.probe_fabric() if fabric_facts else None}
    if port:
        out["port"] = port_free(port)
    if data_dir:
        out["data_dir"] = _data_dir(data_dir)
    return out


# ------------------------------------------------------------------------------------------------ orchestration
def local_names() -> set[str]:
    names = {"localhost", "::1", socket.gethostname(), socket.getfqdn()}
    try:
        names |= {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    return names


def is_local(host: str) -> bool:
    return host.startswith("127.") or host in local_names()


def probe_remote(host: str, args, names: Sequence[str], port: int) -> tuple[dict | None, str]:
    """Run the probe on `host` over ssh with the same interpreter path and working directory as here (what
    DeepSpeed's pdsh launch assumes too)."""
    inner = [sys.executable, "-m", "launch.preflight", "--probe", "--probe_names", ",".join(names),
             "--probe_port", str(port), "--probe_data_dir", args.data_dir]
    # ssh hands the remote side one command string for its shell; quoting every argument with shlex.quote (via
    # shlex.join) is the only way to keep them as separate, literal arguments there.
    import shlex

    remote = f"cd {shlex.quote(os.getcwd())} && PYTHONPATH={shlex.quote(os.environ.get('PYTHONPATH', ''))} " \
             f"{shlex.join(inner)}"
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(args.ssh_timeout)}"]
    if args.ssh_port:
        cmd += ["-p", str(args.ssh_port)]
    cmd += [host, remote]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=args.ssh_timeout + 60)
    except subprocess.TimeoutExpired:
        return None, f"ssh {host}: no answer within {args.ssh_timeout + 60:g} s"
    except OSError as e:
        return None, f"ssh: {e}"
    if proc.returncode != 0:
        return None, f"ssh {host} exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}"
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1]), "ssh ok"
    except (json.JSONDecodeError, IndexError):
        return None, f"ssh {host}: unreadable probe output {proc.stdout[-200:]!r}"


def ds_config_check(path: str, world: int) -> tuple[bool, str]:
    try:
        from ds_core.config import load_ds_config
        from ds_core.errors import ConfigError
    except ImportError as e:
        return False, f"cannot import ds_core.config ({e})"
    try:
        cfg = load_ds_config(path, world)
    except ConfigError as e:
        return False, str(e)
    except (OSError, ValueError) as e:
        return False, f"{path}: {e}"
    return True, (f"{path}: world {world}: train_batch {cfg['train_batch_size']} = micro "
                  f"{cfg['train_micro_batch_size_per_gpu']} x accum {cfg['gradient_accumulation_steps']} x {world}")


def run_checks(args) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    try:
        hosts = hf.read_hostfile(args.hostfile, nodes=args.nodes)
    except hf.HostfileError as e:
        return [("(hostfile)", "hostfile", FAIL, str(e))]
    hosts = hosts[:args.nodes] if args.nodes else hosts
    rows.append(("(hostfile)", "hostfile", PASS, f"{args.hostfile}: {len(hosts)} hosts"))
    profile_raw: list[tuple[str, str, str]] = []
    if args.profile:
        try:
            # raw entries: a `+=` path list only has to be contained in the host's value
            profile_raw = envmod.profile_entries(args.profile)
        except envmod.EnvFileError as e:
            rows.append(("(job)", "profile", FAIL, str(e)))
    try:
        exported = envmod.load_deepspeed_env()  # DeepSpeed exports these from here to every node (pdsh / MPI)
    except envmod.EnvFileError as e:
        exported = {}
        rows.append(("(job)", ".deepspeed_env", FAIL, str(e)))
    names = list(dict.fromkeys([n for n, _, _ in profile_raw] + list(fabric.FABRIC_VARS)))
    master = args.master_addr or hosts[0].name
    here = probe(names, fabric_facts=False)  # this machine's software, the reference for every host's
    infos: list[dict | None] = []
    for h in hosts:
        port = args.master_port if (h.name == master or (is_local(h.name) and is_local(master))) else 0
        if is_local(h.name):
            info, how = probe(names, port, args.data_dir), "local (no ssh)"
        else:
            info, how = probe_remote(h.name, args, names, port)
        rows.append((h.name, "reachable", PASS if info else FAIL, how))
        infos.append(info)
        if info:
            seen = dict(info["env"])
            seen.update(exported)
            rows += host_rows(h, info, here, args, profile_raw, seen, port)
    if args.deepspeed_config:
        world = sum(h.slots for h in hosts)
        ok, detail = ds_config_check(args.deepspeed_config, world)
        rows.append(("(job)", "deepspeed_config", PASS if ok else FAIL, detail))
    if len(hosts) > 1 and args.allreduce_mb > 0:
        rows.append(allreduce_row(hosts, infos, args, exported, master, rows))
    return rows


def host_rows(h: hf.Host, info: dict, here: dict, args, profile_raw: list, seen: dict, port: int) -> list:
    """The rows of one reachable host: its software against this machine's, accelerators, port, profile, data, and
    its fabric."""
    rows = [(h.name, "python", PASS if info["python"] == here["python"] else FAIL,
             f"{info['python']} {info['executable']}" +
             ("" if info["python"] == here["python"] else f" (here {here['python']})"))]
    for dist in PACKAGES:
        v, mine = info["versions"][dist], here["versions"][dist]
        ok = v == mine and v != "missing"
        rows.append((h.name, dist, PASS if ok else FAIL, v + ("" if v == mine else f" (here {mine})")))
    ok = info["accelerators"] >= h.slots
    rows.append((h.name, "accelerators", PASS if ok else FAIL,
                 f"{info['accelerator']}: {info['accelerators']} >= slots {h.slots}" if ok else
                 f"{info['accelerator']}: {info['accelerators']} < slots {h.slots} {info['accelerator_error']}"))
    if port:
        ok, detail = info["port"]
        rows.append((h.name, "master_port", PASS if ok else FAIL, detail))
    if args.profile and profile_raw:
        ok, detail = envmod.compare_with_profile(profile_raw, seen)
        rows.append((h.name, f"profile {args.profile}", PASS if ok else FAIL, detail))
    if args.data_dir:
        ok, detail = info["data_dir"]
        rows.append((h.name, "data_dir", PASS if ok else FAIL, detail))
    return rows + fabric_rows(h.name, info, seen, args.profile)


def fabric_rows(host: str, info: dict, env: dict, profile: str) -> list[tuple[str, str, str, str]]:
    """Gaudi NIC ports, libfabric and HCCL's scale-out mode for one host (launch.fabric); only the rows that apply:
    a CPU host without hl-smi or fi_info and a profile that needs neither gets none."""
    facts, rows = info.get("fabric") or {}, []
    cards, gaudi = facts.get("cards"), facts.get("cards") is not None or info["accelerator"] == "hpu"
    if cards is not None:
        ok, detail = fabric.port_summary(cards)
        rows.append((host, "gaudi nics", PASS if ok else FAIL if profile == "roce" else SKIP,
                     detail + ("" if ok or profile == "roce" else " (not used by this profile)")))
    elif profile == "roce":
        rows.append((host, "gaudi nics", FAIL, "no hl-smi here: the Gaudi NICs the profile scales out through "
                                               "cannot be checked"))
    over_host_nic = profile in ("efa", "hostnic")  # profiles whose scale-out goes through libfabric
    if facts.get("libfabric") or over_host_nic:
        providers = facts.get("providers") or []
        wanted = [p for p in (env.get("FI_PROVIDER") or ("efa" if profile == "efa" else "")).split(",") if p]
        missing = [p for p in wanted if p not in providers]
        if facts.get("libfabric"):
            detail = f"libfabric {facts['libfabric']}; providers with a device: {', '.join(providers) or 'none'}"
        else:
            detail = "no fi_info: libfabric not found"
        ok = bool(facts.get("libfabric")) and bool(providers) and not missing
        rows.append((host, "libfabric", PASS if ok else FAIL if over_host_nic else SKIP,
                     detail + (f"; FI_PROVIDER / the profile wants {', '.join(missing)}" if missing else "")))
    if gaudi:
        mode, why = fabric.hccl_scaleout(facts, env)
        problems = fabric.conflicts(env)
        meant = fabric.PROFILE_MODES.get(profile)
        if meant and mode not in meant:
            problems.append(f"profile {profile} is for {' or '.join(meant)}")
        rows.append((host, "hccl scale-out", FAIL if problems else PASS,
                     f"{mode}: {why}" + "".join(f"; {p}" for p in problems)))
    return rows


def allreduce_row(hosts: list, infos: list, args, exported: dict, master: str, rows: list) -> tuple:
    """The job's all-reduce across the hosts (launch.allreduce), or why it was not run."""
    name = "all_reduce"
    if not all(infos):
        return ("(job)", name, SKIP, "not run: a host is unreachable")
    if any(r[1] == "master_port" and r[2] == FAIL for r in rows):
        return ("(job)", name, SKIP, f"not run: master port {args.master_port} is in use")
    world, nbytes = len(hosts), int(args.allreduce_mb * (1 << 20))
    cmds = []
    for rank, h in enumerate(hosts):
        inner = allreduce.member_command(rank, world, master, args.master_port, nbytes, 5, args.allreduce_timeout)
        if is_local(h.name):
            cmds.append((inner, {**os.environ, **exported}))
        else:
            cmds.append((allreduce.remote_command(h.name, inner, exported, args.ssh_port, args.ssh_timeout), None))
    results = allreduce.run_all(cmds, args.allreduce_timeout + args.ssh_timeout)
    bad = [f"{h.name}: {r}" if isinstance(r, str) else f"{h.name}: wrong sum" for h, r in zip(hosts, results)
           if isinstance(r, str) or not r.get("ok")]
    if bad:
        return ("(job)", name, FAIL, "; ".join(bad)[:600])
    first = results[0]
    gbit = allreduce.bus_gbit(first["bytes"], first["seconds"], world)
    gens = {fabric.generation_of(c["name"]) for i in infos for c in ((i.get("fabric") or {}).get("cards") or [])}
    want, source = fabric.expected_gbit(args.profile, gens.pop() if len(gens) == 1 else None)
    want = args.expect_gbit or want
    expect = (f"the fabric gives up to {want:g} Gbit/s ({'--expect_gbit' if args.expect_gbit else source})"
              if want else f"no expected figure ({source})")
    return ("(job)", name, PASS, f"{world} hosts x 1 process, {first['bytes'] / (1 << 20):g} MiB float32 over "
                                 f"{first['backend']}: {first['seconds'] * 1e3:.1f} ms per all-reduce, bus bandwidth "
                                 f"{gbit:.3g} Gbit/s; profile {args.profile or '(none)'}: {expect}")


def format_table(rows: Sequence[tuple[str, str, str, str]]) -> str:
    head = ("host", "check", "result", "detail")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    lines = ["  ".join(head[i].ljust(widths[i]) for i in range(3)) + "  " + head[3]]
    for r in rows:
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.preflight", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--hostfile", default=os.environ.get("LAUNCH_HOSTFILE", "hostfile"),
                   help="DeepSpeed hostfile to check (`host slots=N`); $LAUNCH_HOSTFILE, default ./hostfile")
    p.add_argument("--nodes", type=int, default=int(os.environ.get("LAUNCH_NODES", "0")),
                   help="check only the first N hosts, as the run will use them (0: all); $LAUNCH_NODES")
    p.add_argument("--profile", default=os.environ.get("LAUNCH_PROFILE", ""),
                   help="fabric env profile whose variables must reach every rank (" +
                        ", ".join(envmod.profile_names()) + "); $LAUNCH_PROFILE, default: no check")
    p.add_argument("--data_dir", default="", help="directory every host must be able to read (default: no check)")
    p.add_argument("--deepspeed_config", default=os.environ.get("LAUNCH_DS_CONFIG", ""),
                   help="DeepSpeed JSON to validate for the hostfile's world size (sum of slots); "
                        "$LAUNCH_DS_CONFIG, default: no check")
    p.add_argument("--master_addr", default=os.environ.get("MASTER_ADDR", ""),
                   help="host whose master port is checked (default: the first host); $MASTER_ADDR")
    p.add_argument("--master_port", type=int, default=int(os.environ.get("MASTER_PORT") or "29500"),
                   help="port that must be free on the master host; $MASTER_PORT, default 29500")
    p.add_argument("--ssh_port", type=int, default=0, help="ssh port for remote hosts (default: ssh's own)")
    p.add_argument("--ssh_timeout", type=float, default=10,
                   help="seconds to wait for an ssh connection to a remote host (default 10)")
    p.add_argument("--allreduce_mb", type=float, default=64,
                   help="MiB of float32 all-reduced across the hosts, one process per host on the ranks' backend, "
                        "to measure the fabric (default 64; 0: not run; one host: not run)")
    p.add_argument("--allreduce_timeout", type=float, default=120,
                   help="seconds the all-reduce's processes may take, start-up included (default 120)")
    p.add_argument("--expect_gbit", type=float, default=0,
                   help="the fabric's rate per host in Gbit/s, printed next to the measured one (default: the "
                        "profile's published figure, where it has one)")
    p.add_argument("--json", action="store_true", help="also print the rows as one JSON object on the last line")
    g = p.add_argument_group("internal (what preflight runs on a remote host over ssh)")
    g.add_argument("--probe", action="store_true",
                   help="print this host's facts (versions, accelerators, env, port, data dir) as JSON and exit")
    g.add_argument("--probe_names", default="", help="with --probe: comma-separated variables to report")
    g.add_argument("--probe_port", type=int, default=0, help="with --probe: port to test (0: none)")
    g.add_argument("--probe_data_dir", default="", help="with --probe: directory to test (empty: none)")
    g.add_argument("--allreduce_member", default="", metavar="RANK,WORLD,ADDR:PORT",
                   help="run one host's part of the all-reduce and print its result as JSON")
    g.add_argument("--allreduce_bytes", type=int, default=1 << 26, help="with --allreduce_member: buffer size")
    g.add_argument("--allreduce_iters", type=int, default=5, help="with --allreduce_member: timed all-reduces")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(argv, build_parser, _run)


def _run(args: argparse.Namespace) -> int:
    if args.probe:
        names = [n for n in args.probe_names.split(",") if n]
        print(json.dumps(probe(names, args.probe_port, args.probe_data_dir)))
        return 0
    if args.allreduce_member:
        rank, world, where = args.allreduce_member.split(",")
        addr, _, port = where.rpartition(":")
        print(json.dumps(allreduce.member(int(rank), int(world), addr, int(port), args.allreduce_bytes,
                                          args.allreduce_iters, args.allreduce_timeout, _accelerator())))
        # its process group is released, not freed (ds_core.compat.torch_releases): the process ends as a rank does,
        # without the interpreter's finalisation that gloo's live threads do not survive (ds_core.rank.process_end)
        from ds_core.rank.process_end import end_process

        end_process(0)
    rows = run_checks(args)
    print(format_table(rows))
    failed = [r for r in rows if r[2] == FAIL]
    print(f"preflight: {len(failed)} of {len(rows)} checks failed" if failed else f"preflight: all {len(rows)} "
          "checks passed")
    if args.json:
        print(json.dumps({"ok": not failed, "rows": [dict(zip(("host", "check", "result", "detail"), r))
                                                       for r in rows]}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
