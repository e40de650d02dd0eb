"""Run a study: every cell, one after another, each through a real launcher in its own run directory.

Study directory layout (`--out`, default runs/studies/<name>):

    study.toml                 the study file as last run
    cells/<key>/               one run directory per cell: metrics.jsonl, config.json, ds_config.json (resolved),
                               study_ds_config.json (the cell's input), log.txt, cell_stats/rank<R>.json, cell.json
    previous/<key>.<n>/        an unfinished or failed attempt, moved aside (never deleted) before the cell reruns
    twins/<key>/node<i>/       launcher = "emulated_fabric": the independent twin runs that kept every emulated node
                               busy beside a cell with fewer nodes than the study's largest (not cells)

An emulated multi-node cell also has link_probe.json (ds_tools.study.linkprobe, run over its link before it trains)
and fabric.json (the link, whether its latency was emulated, the number of twins).

`cell.json` is written last and atomically: {"status": "ok" | "failed" | "timeout", "exit_code", "seconds", "values",
"repeat", "command", "log_tail"}. A cell is complete when its status is ok and its metrics.jsonl has a summary record.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import zlib
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, TextIO

import ds_core
from ds_core.config import atomic_write_text
from ds_core.outputs.metrics import last_summary
from ds_core.rank.rendezvous import free_port, rank_env
from ds_tools.study import netns
from ds_tools.study.spec import Cell, Study, StudyError, dump_json
from launch import local_ranks

REPO_ROOT = Path(ds_core.__file__).resolve().parents[1]  # ranks import the same checkout as this process
LOG_TAIL_CHARS = 4000


def default_out(study: Study) -> Path:
    return Path("runs") / "studies" / study.name


def cell_dir(out: Path, cell: Cell) -> Path:
    return out / "cells" / cell.key


def read_summary(run_dir: Path) -> dict | None:
    """The last summary record of run_dir/metrics.jsonl, or None (missing, unfinished, torn)."""
    return last_summary(run_dir / "metrics.jsonl")


def read_status(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "cell.json").read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_complete(run_dir: Path) -> bool:
    st = read_status(run_dir)
    return bool(st and st.get("status") == "ok" and read_summary(run_dir) is not None)


# ------------------------------------------------------------------------------------------------ commands

def _hostfile_slice(study: Study, nodes: int, dest: Path) -> Path:
    """The first `nodes` host lines of the study's hostfile, written for this cell (comments and blanks skipped)."""
    src = Path(study.hostfile)
    try:
        lines = [ln for ln in src.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    except FileNotFoundError:
        raise StudyError(f"{study.path}: [study] hostfile {src}: file not found") from None
    if len(lines) < nodes:
        raise StudyError(f"{study.path}: a cell needs {nodes} node(s) but hostfile {src} lists {len(lines)}")
    dest.write_text("\n".join(lines[:nodes]) + "\n")
    return dest


def commands_for(study: Study, cell: Cell, out: Path, *, write: bool) -> list[list[str]]:
    """The launcher command(s) of a cell; with `write` the cell's DeepSpeed JSON and hostfile are written too."""
    run_dir = cell_dir(out, cell).resolve()
    ds_cfg = study.ds_config_for(cell)
    ds_json = run_dir / "study_ds_config.json" if ds_cfg is not None else None
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
        if ds_cfg is not None:
            atomic_write_text(ds_json, dump_json(ds_cfg))
    args = study.train_args(cell, run_dir, ds_json)
    nodes = study.nodes_of(cell)
    port = free_port() if write else 29500
    if study.launcher == "local":
        return [local_ranks.local_command(study.ranks_per_node, ["--module", "ds_tools.study.cell", *args],
                                          master_port=port)]
    if study.launcher == "simulated_nodes":
        hostfile = run_dir / "hostfile"
        if write:
            local_ranks.write_loopback_hostfile(hostfile, nodes, study.ranks_per_node)
        return local_ranks.node_commands(nodes, study.ranks_per_node, ["--module", "ds_tools.study.cell", *args],
                                         master_port=port, hostfile=hostfile)
    if study.launcher == "emulated_fabric":
        # one namespace per node (ds_tools.study.netns), each node's DeepSpeed launcher inside its namespace
        spaces, addrs = netns.names(max_nodes(study), fabric_key(out))
        hostfile = run_dir / "hostfile"
        if write:
            hostfile.write_text("".join(f"{a} slots={study.ranks_per_node}\n" for a in addrs[:nodes]))
        cmds = local_ranks.node_commands(nodes, study.ranks_per_node, ["--module", "ds_tools.study.cell", *args],
                                         master_port=port, hostfile=hostfile, master_addr=addrs[0])
        # The emulated nodes share this host's CPUs: a 1-node cell would compute faster than each node of a 2-node
        # cell and the comparison would charge the difference to the network. So every cell keeps max_nodes nodes
        # busy: its own, plus independent one-node twins of itself (same training, own run directory, no traffic
        # between them) in the remaining namespaces: each node's CPU share is the same in every cell.
        for i in range(nodes, len(spaces)):
            tdir = twin_dir(out, cell, i)
            thost = tdir / "hostfile"
            if write:
                tdir.mkdir(parents=True, exist_ok=True)
                thost.write_text(f"{addrs[i]} slots={study.ranks_per_node}\n")
            targs = study.train_args(cell, tdir.resolve(), ds_json)
            cmds += local_ranks.node_commands(1, study.ranks_per_node, ["--module", "ds_tools.study.cell", *targs],
                                              master_port=free_port() if write else 29500 + i, hostfile=thost,
                                              master_addr=addrs[i])
        return [["ip", "netns", "exec", ns, *c] for ns, c in zip(spaces, cmds)]
    # hostfile: launch.run (pdsh by default) on the first N hosts; it passes --deepspeed_config and --preset itself
    hostfile = _hostfile_slice(study, nodes, run_dir / "hostfile") if write else run_dir / "hostfile"
    if ds_json is None:
        raise StudyError(f"{study.path}: launcher = \"hostfile\" needs [study] deepspeed_config")
    i = args.index("--deepspeed_config")
    module_args = args[:i] + args[i + 2:]
    return [[sys.executable, "-m", "launch.run", "--hostfile", str(hostfile), "--module", "ds_tools.study.cell",
             "--deepspeed_config", str(ds_json), "--master_port", str(port), *study.launch_args, "--",
             *module_args]]


def plan(study: Study, out: Path, stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    cells = study.cells()
    axes = ' x '.join(f'{k} {len(v)}' for k, v in study.axes.items()) or 'no axes'
    print(f"study {study.name}: {len(cells)} cell(s) ({axes}"
          f", repeats {study.repeats}), launcher {study.launcher}, study directory {out}", file=stream)
    for cell in cells:
        d = cell_dir(out, cell)
        state = "complete" if is_complete(d) else ("failed" if read_status(d) else "to run")
        print(f"\n[{cell.index + 1}/{len(cells)}] {cell.label()} -> {d} ({state})", file=stream)
        cfg = study.ds_config_for(cell)
        if cfg is not None:
            print(f"  DeepSpeed JSON: zero_optimization = {json.dumps(cfg.get('zero_optimization', {}))}, "
                  f"JSON micro batch {cfg.get('train_micro_batch_size_per_gpu')} "
                  f"(a --micro_batch_size flag overrides it)", file=stream)
        for cmd in commands_for(study, cell, out, write=False):
            print("  " + " ".join(cmd), file=stream)


# ----------------------------------------------------------------------------------------------------- run

def _log_tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - LOG_TAIL_CHARS))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _move_aside(out: Path, d: Path, say: Callable[[str], None], name: str = "") -> None:
    prev = out / "previous"
    prev.mkdir(parents=True, exist_ok=True)
    name = name or d.name
    n = 0
    while (prev / f"{name}.{n}").exists():
        n += 1
    shutil.move(str(d), prev / f"{name}.{n}")
    say(f"  earlier attempt moved to {prev / f'{name}.{n}'}")


class _Progress:
    """Polls the running cell's metrics.jsonl and prints each new throughput figure (rank 0 writes it)."""

    def __init__(self, run_dir: Path, say: Callable[[str], None]):
        self.path, self.say, self.seen = run_dir / "metrics.jsonl", say, 0

    def __call__(self) -> None:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return
        for line in lines[self.seen:]:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                return  # a line being written: read it next time
            self.seen += 1
            if rec.get("type") == "step" and rec.get("samples_per_s"):
                self.say(f"  step {rec['step']}: {rec['samples_per_s']:.2f} samples/s")


def max_nodes(study: Study) -> int:
    return max(study.nodes_of(c) for c in study.cells())


def twin_dir(out: Path, cell: Cell, node: int) -> Path:
    """Run directory of an emulated cell's independent twin in namespace `node` (outside cells/: not a cell)."""
    return out / "twins" / cell.key / f"node{node}"


def fabric_key(out: Path) -> int:
    """Namespace names and subnet of an emulated-fabric study: stable per output directory (a rerun's commands
    compare equal), distinct between studies run side by side."""
    return zlib.crc32(str(Path(out).resolve()).encode())


def _fabric(study: Study, cell: Cell, out: Path):
    if study.launcher != "emulated_fabric":
        return nullcontext()
    f = study.fabric_of(cell)
    return netns.emulated_fabric(max_nodes(study), mbit=f["mbit"], delay_ms=f["delay_ms"], key=fabric_key(out))


def _probe_bytes(mbit: float) -> int:
    """The probe's bandwidth message: ~40 ms of the link at its rate (bandwidth-bound, not latency-bound),
    at least 256 KiB."""
    return max(1 << 18, int(mbit * 1e6 / 8 * 0.04))


def _probe_link(study: Study, cell: Cell, fab, d: Path, env, cwd, say) -> None:
    """ds_tools.study.linkprobe between the cell's nodes, before it trains: the link's per-call cost, measured, in
    d/link_probe.json (a failed probe is said and left out: the comparison then says the cost was not measured)."""
    nodes, port = study.nodes_of(cell), free_port()
    cmds = [fab.wrap(i, [sys.executable, "-u", "-m", "ds_tools.study.linkprobe", "--rank", str(i), "--world_size",
                         str(nodes), "--master_addr", fab.addresses[0], "--master_port", str(port), "--out",
                         str((d / "link_probe.json").resolve()), "--nbytes", str(_probe_bytes(fab.mbit))])
            for i in range(nodes)]
    res = local_ranks.run_launchers(cmds, env=env, cwd=cwd or Path.cwd(), timeout_s=180,
                                    log_path=d / "link_probe.log")
    try:
        r = json.loads((d / "link_probe.json").read_text())
        say(f"  link probe: a tiny all_reduce takes {1e3 * r['alpha_all_reduce_s']:.3f} ms, an all_gather "
            f"{1e3 * r['alpha_all_gather_s']:.3f} ms (median of {r['calls']}); a {r['big_nbytes'] / 1e6:.2f} MB "
            f"all_reduce {1e3 * r['big_all_reduce_s']:.1f} ms: bus bandwidth {r['busbw_Bps'] * 8 / 1e6:.1f} Mbit/s")
    except (OSError, ValueError, KeyError):
        say(f"  link probe FAILED (exit {res.exit_code}); see {d / 'link_probe.log'}")


def run(study: Study, out: Path, *, rerun: bool = False, stream: TextIO | None = None,
        cwd: Path | None = None) -> dict:
    """Run every cell not yet complete; returns {"ok": n, "failed": n, "skipped": n}. Never raises for a failed cell."""
    stream = stream or sys.stdout

    def say(msg: str) -> None:
        print(f"[ds-study] {msg}", file=stream, flush=True)

    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(study.path, out / "study.toml")
    cells = study.cells()
    counts = {"ok": 0, "failed": 0, "skipped": 0}
    env = rank_env(pythonpath=[REPO_ROOT], extra=study.env)
    if study.prepare and not (Path(cwd or Path.cwd()) / study.prepare_creates).exists():
        cmd = [sys.executable if study.prepare[0] == "python" else study.prepare[0], *study.prepare[1:]]
        say(f"preparing: {' '.join(cmd)}")
        res = local_ranks.run_launchers([cmd], env=env, cwd=cwd or Path.cwd(), timeout_s=study.timeout_s,
                                        log_path=out / "prepare.log")
        if not res.ok or not (Path(cwd or Path.cwd()) / study.prepare_creates).exists():
            raise StudyError(f"{study.path}: [study] prepare failed (exit {res.exit_code}) or did not create "
                             f"{study.prepare_creates}; see {out / 'prepare.log'}")
    for cell in cells:
        d = cell_dir(out, cell)
        head = (f"cell {cell.index + 1}/{len(cells)} ({counts['ok'] + counts['skipped']} done, "
                f"{counts['failed']} failed)")
        if d.exists() and not rerun and is_complete(d):
            st = read_status(d)
            planned = commands_for(study, cell, out, write=False)
            if _comparable(st.get("command")) != _comparable(planned):
                raise StudyError(f"{d}: this cell was run with another command than {study.path} now gives; rerun it "
                                 f"with --rerun or give another --out. Was: {' '.join(st['command'][0])}")
            counts["skipped"] += 1
            say(f"{head}: {cell.label()}: complete, skipped ({read_summary(d)['samples_per_s']:.2f} samples/s)")
            continue
        say(f"{head}: {cell.label()}")
        if d.exists():
            _move_aside(out, d, say)
        if (out / "twins" / cell.key).exists():   # a twin must train afresh, not resume its finished earlier run
            _move_aside(out, out / "twins" / cell.key, say, name=f"twins-{cell.key}")
        cmds = commands_for(study, cell, out, write=True)
        log = d / "log.txt"
        with _fabric(study, cell, out) as fab:
            if fab is not None:
                say(f"  emulated fabric {study.fabric_of(cell)['name']}: {fab.mbit:g} Mbit/s, {fab.delay_ms:g} ms "
                    + ("" if fab.latency_emulated else "(latency NOT emulated: no sch_netem in this kernel) ")
                    + f"between {len(fab.namespaces)} namespace(s)")
                atomic_write_text(d / "fabric.json", dump_json({**study.fabric_of(cell),
                                                                "latency_emulated": fab.latency_emulated,
                                                                "twins": len(cmds) - study.nodes_of(cell)}))
                if len(cmds) > study.nodes_of(cell):
                    say(f"  beside {len(cmds) - study.nodes_of(cell)} independent twin(s) in the other namespace(s), "
                        "so that every cell loads the host's CPUs alike")
                if study.nodes_of(cell) > 1:
                    _probe_link(study, cell, fab, d, env, cwd, say)
            res = local_ranks.run_launchers(cmds, env=env, cwd=cwd or Path.cwd(), timeout_s=study.timeout_s,
                                            log_path=log, on_poll=_Progress(d, say), poll_s=2.0)
        summary = read_summary(d)
        status = "timeout" if res.timed_out else ("ok" if res.ok and summary is not None else "failed")
        rec = {"status": status, "exit_code": res.exit_code if not (res.ok and summary is None) else 1,
               "seconds": round(res.seconds, 1), "values": cell.values, "repeat": cell.repeat, "command": cmds,
               "log_tail": "" if status == "ok" else _log_tail(log)}
        if res.ok and summary is None:
            rec["log_tail"] = "exit code 0 but no summary record in metrics.jsonl\n" + _log_tail(log)
        atomic_write_text(d / "cell.json", dump_json(rec))
        if status == "ok":
            counts["ok"] += 1
            say(f"  done in {res.seconds:.0f} s: {summary['samples_per_s']:.2f} samples/s")
        else:
            counts["failed"] += 1
            why = f"timed out after {study.timeout_s:.0f} s (process groups killed)" if res.timed_out else \
                f"exit code {rec['exit_code']}"
            last = [ln for ln in rec["log_tail"].splitlines() if ln.strip()][-1:] or ["(empty log)"]
            say(f"  FAILED: {why}; log {log}; last line: {last[0][:200]}")
    say(f"finished: {counts['ok']} ran, {counts['skipped']} skipped (complete), {counts['failed']} failed; "
        f"report: python -m ds_tools.study report {out}")
    return counts


def _comparable(cmds) -> list:
    """A command with its master port blanked (a fresh free port per attempt is not a different cell)."""
    if not cmds:
        return []
    out = []
    for cmd in cmds:
        cmd = list(cmd)
        for i, a in enumerate(cmd[:-1]):
            if a == "--master_port":
                cmd[i + 1] = "*"
        out.append(cmd)
    return out
