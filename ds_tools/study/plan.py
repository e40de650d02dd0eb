"""One cell's plan, built once: the files written into its run directory, its launcher commands, its master port
and, for an emulated fabric, its link, namespaces, twins and link probe. `ds-study plan` prints it, `ds-study run`
writes its files and runs its commands: what the plan says is what runs.

Building a plan writes nothing and starts nothing (a `hostfile` study's hostfile is read, to take its first N hosts).
"""
from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ds_tools.study import netns
from ds_tools.study.spec import Cell, Study, StudyError, dump_json
from launch import env as envmod, local_ranks, remote_shell

# Master ports are taken from here, two per cell (the training's and the link probe's), below Linux's ephemeral
# range (32768-60999: a port the kernel hands out to outgoing connections could be taken at any moment).
PORT_LOW, PORT_SPAN = 20000, 12000
CELL_TARGET = ("--module", "ds_tools.study.cell")


@dataclass
class CellPlan:
    cell: Cell
    run_dir: Path                          # absolute
    port: int                              # MASTER_PORT of the cell's rendezvous
    files: dict = field(default_factory=dict)      # path -> text, written before the launch
    commands: list = field(default_factory=list)   # one command per launcher (per node, twins after the cell's own)
    fabric: dict | None = None             # emulated: {"name", "mbit", "delay_ms", "key", "namespaces", "addresses"}
    probe: list = field(default_factory=list)      # emulated multi-node: the link probe's commands (one per node)
    port_checked_here: bool = True         # False where the port lives in namespaces or on a cluster's first host

    twins: int = 0                         # emulated: independent one-node twins after the cell's own launchers


def cell_dir(out: Path, cell: Cell) -> Path:
    return out / "cells" / cell.key


def twin_dir(out: Path, cell: Cell, node: int) -> Path:
    """Run directory of an emulated cell's independent twin in namespace `node` (outside cells/: not a cell)."""
    return out / "twins" / cell.key / f"node{node}"


def fabric_key(out: Path) -> int:
    """Namespace names and subnet of an emulated-fabric study: stable per output directory (a rerun's commands
    compare equal), distinct between studies run side by side."""
    return zlib.crc32(str(Path(out).resolve()).encode())


def planned_port(study: Study, out: Path, cell: Cell) -> int:
    """The cell's master port: [study] master_port, else a start derived from the study directory (two studies run
    side by side do not collide), plus two per cell index (a cell never reuses the port of the one before it, whose
    sockets may linger in TIME_WAIT)."""
    if study.master_port:
        return study.master_port + 2 * cell.index
    return PORT_LOW + (fabric_key(out) + 2 * cell.index) % PORT_SPAN


def max_nodes(study: Study) -> int:
    return max(study.nodes_of(c) for c in study.cells())


def _hostfile_slice(study: Study, nodes: int) -> str:
    """The first `nodes` host lines of the study's hostfile (comments and blanks skipped)."""
    src = Path(study.hostfile)
    try:
        lines = [ln for ln in src.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    except FileNotFoundError:
        raise StudyError(f"{study.path}: [study] hostfile {src}: file not found") from None
    if len(lines) < nodes:
        raise StudyError(f"{study.path}: a cell needs {nodes} node(s) but hostfile {src} lists {len(lines)}")
    return "\n".join(lines[:nodes]) + "\n"


def probe_bytes(mbit: float) -> int:
    """The probe's bandwidth message: ~40 ms of the link at its rate (bandwidth-bound, not latency-bound),
    at least 256 KiB."""
    return max(1 << 18, int(mbit * 1e6 / 8 * 0.04))


def build(study: Study, cell: Cell, out: Path, port: int | None = None) -> CellPlan:
    """The cell's plan; `port` replaces the planned master port (the run's fallback when that one is taken)."""
    run_dir = cell_dir(out, cell).resolve()
    p = CellPlan(cell, run_dir, planned_port(study, out, cell) if port is None else port)
    ds_cfg = study.ds_config_for(cell)
    ds_json = run_dir / "study_ds_config.json" if ds_cfg is not None else None
    if ds_cfg is not None:
        p.files[ds_json] = dump_json(ds_cfg)
    target = [*CELL_TARGET, *study.train_args(cell, run_dir, ds_json)]
    nodes, slots, hostfile = study.nodes_of(cell), study.ranks_per_node, run_dir / "hostfile"
    if study.launcher == "local":
        p.commands = [local_ranks.local_command(slots, target, master_port=p.port)]
    elif study.launcher == "simulated_nodes":
        p.files[hostfile] = local_ranks.loopback_hostfile_text(nodes, slots)
        p.commands = local_ranks.node_commands(nodes, slots, target, master_port=p.port, hostfile=hostfile)
    elif study.launcher == "emulated_fabric":
        _emulated(study, cell, out, p, target)
    else:
        # hostfile: launch.run (pdsh by default) on the first N hosts; it passes --deepspeed_config and --preset
        if ds_json is None:
            raise StudyError(f"{study.path}: launcher = \"hostfile\" needs [study] deepspeed_config")
        p.files[hostfile] = _hostfile_slice(study, nodes)
        p.port_checked_here = False
        module_args = target[2:]
        _check_remote_words(study, nodes, [*CELL_TARGET[1:], *module_args])
        i = module_args.index("--deepspeed_config")
        p.commands = [[sys.executable, "-m", "launch.run", "--hostfile", str(hostfile), *CELL_TARGET,
                       "--deepspeed_config", str(ds_json), "--master_port", str(p.port), *study.launch_args, "--",
                       *module_args[:i], *module_args[i + 2:]]]
    return p


def _flag_of(args: list, flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return str(args[i + 1])
        if str(a).startswith(flag + "="):
            return str(a).partition("=")[2]
    return None


def _check_remote_words(study: Study, nodes: int, words: list) -> None:
    """launch.run's check of what reaches the nodes' shell under pdsh (launch.remote_shell), when the cell is planned:
    a study file's values are data, refused here (naming the study file) before any cell starts."""
    launcher = _flag_of(study.launch_args, "--launcher") or os.environ.get("LAUNCH_LAUNCHER") or "pdsh"
    if nodes < 2 or launcher != "pdsh":
        return
    addr = _flag_of(study.launch_args, "--master_addr") or os.environ.get("MASTER_ADDR", "")
    try:
        remote_shell.check_launch([("argument", str(w)) for w in words], addr, None, {**os.environ, **study.env},
                                  envmod.load_deepspeed_env())
    except (remote_shell.RemoteShellError, envmod.EnvFileError) as e:
        raise StudyError(f"{study.path}: {e}") from None


def _emulated(study: Study, cell: Cell, out: Path, p: CellPlan, target: list) -> None:
    """One namespace per node (ds_tools.study.netns), each node's DeepSpeed launcher inside its namespace.

    The emulated nodes share this host's CPUs: a 1-node cell would compute faster than each node of a 2-node cell and
    the comparison would charge the difference to the network. So every cell keeps max_nodes nodes busy: its own,
    plus independent one-node twins of itself (same training, own run directory, no traffic between them) in the
    remaining namespaces: each node's CPU share is the same in every cell. Every namespace has its own network
    stack, so all of them use the cell's one port."""
    nodes, slots, key = study.nodes_of(cell), study.ranks_per_node, fabric_key(out)
    spaces, addrs = netns.names(max_nodes(study), key)
    p.fabric = {**study.fabric_of(cell), "key": key, "namespaces": spaces, "addresses": addrs}
    p.port_checked_here = False
    hostfile = p.run_dir / "hostfile"
    p.files[hostfile] = "".join(f"{a} slots={slots}\n" for a in addrs[:nodes])
    cmds = local_ranks.node_commands(nodes, slots, target, master_port=p.port, hostfile=hostfile,
                                     master_addr=addrs[0])
    ds_json = Path(target[target.index("--deepspeed_config") + 1]) if "--deepspeed_config" in target else None
    for i in range(nodes, len(spaces)):
        tdir = twin_dir(out, cell, i).resolve()
        p.files[tdir / "hostfile"] = f"{addrs[i]} slots={slots}\n"
        targs = study.train_args(cell, tdir, ds_json)
        cmds += local_ranks.node_commands(1, slots, [*CELL_TARGET, *targs], master_port=p.port,
                                          hostfile=tdir / "hostfile", master_addr=addrs[i])
    p.commands = [["ip", "netns", "exec", ns, *c] for ns, c in zip(spaces, cmds)]
    p.twins = len(spaces) - nodes
    if nodes > 1:   # ds_tools.study.linkprobe between the cell's nodes, before it trains
        p.probe = [["ip", "netns", "exec", spaces[i], sys.executable, "-u", "-m", "ds_tools.study.linkprobe",
                    "--rank", str(i), "--world_size", str(nodes), "--master_addr", addrs[0], "--master_port",
                    str(p.port + 1), "--out", str(p.run_dir / "link_probe.json"), "--nbytes",
                    str(probe_bytes(p.fabric["mbit"]))] for i in range(nodes)]


def describe(p: CellPlan, study: Study, stream: TextIO) -> None:
    """The plan as `ds-study plan` prints it (and `ds-study run` before the cell starts)."""
    cfg = study.ds_config_for(p.cell)
    where = "" if p.port_checked_here else " (not checked here: it lives in the cell's namespaces or first host)"
    print(f"  master port {p.port}{where}", file=stream)
    if cfg is not None:
        print(f"  DeepSpeed JSON: zero_optimization = {json.dumps(cfg.get('zero_optimization', {}))}, "
              f"JSON micro batch {cfg.get('train_micro_batch_size_per_gpu')} "
              f"(a --micro_batch_size flag overrides it)", file=stream)
    if p.fabric:
        print(f"  emulated fabric {p.fabric['name']}: {p.fabric['mbit']:g} Mbit/s, {p.fabric['delay_ms']:g} ms, "
              f"namespaces {', '.join(p.fabric['namespaces'])}; {p.twins} twin(s)", file=stream)
    for path, text in p.files.items():
        if path.name == "hostfile":
            print(f"  {path}: " + "; ".join(text.splitlines()), file=stream)
    for cmd in p.probe:
        print("  probe: " + " ".join(cmd), file=stream)
    for cmd in p.commands:
        print("  " + " ".join(cmd), file=stream)
