"""Run a study: round by round, each open combination's next cell: its plan built once (ds_tools.study.plan), the
plan run through a real launcher in the cell's own run directory, its result collected (`run`, read top to bottom).

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
"repeat", "index", "master_port", "command", "log_tail"}. A cell is complete when its status is ok and its
metrics.jsonl has a summary record.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, TextIO

import ds_core
from ds_core.files import atomic_write_text
from ds_core.outputs.metrics import last_summary
from ds_core.rank.rendezvous import free_port, rank_env
from ds_tools.intervals import mean_interval
from ds_tools.study import netns, plan as cell_plan
from ds_tools.study.plan import cell_dir, fabric_key, max_nodes, twin_dir
from ds_tools.study.spec import Cell, Study, StudyError, dump_json
from launch import local_ranks

__all__ = ["cell_dir", "fabric_key", "max_nodes", "twin_dir", "plan", "run", "read_summary", "read_status"]

REPO_ROOT = Path(ds_core.__file__).resolve().parents[1]  # ranks import the same checkout as this process
LOG_TAIL_CHARS = 4000


def default_out(study: Study) -> Path:
    return Path("runs") / "studies" / study.name


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


def throughput_of(run_dir: Path) -> float | None:
    """A complete cell's measurement: its summary's samples/s (warm-up excluded); None otherwise."""
    summary = read_summary(run_dir) if is_complete(run_dir) else None
    return summary.get("samples_per_s") if summary else None


# ------------------------------------------------------------------------------------------------ planning

def plan(study: Study, out: Path, stream: TextIO | None = None) -> None:
    """`ds-study plan`: the measuring rule, then every cell of the first rounds with what it writes and runs."""
    stream = stream or sys.stdout
    cells = study.cells()
    axes = ' x '.join(f'{k} {len(v)}' for k, v in study.axes.items()) or 'no axes'
    print(f"study {study.name}: {len(cells)} cell(s) ({axes}, repeats {study.repeats}), launcher {study.launcher}, "
          f"study directory {out}", file=stream)
    print(measuring_rule(study), file=stream)
    for cell in cells:
        d = cell_dir(out, cell)
        state = "complete" if is_complete(d) else ("failed" if read_status(d) else "to run")
        print(f"\n[{cell.index + 1}/{len(cells)}] {cell.label()} -> {d} ({state})", file=stream)
        cell_plan.describe(cell_plan.build(study, cell, out), study, stream)


def measuring_rule(study: Study) -> str:
    n = len(study.combos())
    rule = (f"measuring: {study.repeats} run(s) of each of {n} combination(s), interleaved round by round "
            f"(cell numbers say the order)")
    if study.precision and study.max_repeats > study.repeats:
        rule += (f"; then further rounds for each combination whose samples/s 95 % interval is wider than "
                 f"+-{100 * study.precision:g} % of its mean, up to {study.max_repeats} runs each, no new round "
                 f"after {study.budget_s:g} s (ports: 2 more per later cell)")
    return rule


def open_combos(study: Study, samples: dict, failures: dict, rnd: int, elapsed_s: float) -> tuple[list, str]:
    """The combinations round `rnd` measures (0-based), and why the others are left out: every one for the first
    `repeats` rounds; after that those whose throughput's interval is wider than the study's precision, while the
    time budget lasts. A combination that failed twice is not tried again."""
    every = list(range(len(study.combos())))
    if rnd < study.repeats:
        return every, ""
    if not study.precision or rnd >= study.max_repeats:
        return [], f"{study.max_repeats} run(s) per combination"
    if elapsed_s >= study.budget_s:
        return [], f"time budget {study.budget_s:g} s spent ({elapsed_s:.0f} s)"
    todo = []
    for i in every:
        if failures.get(i, 0) >= 2:
            continue
        got = samples.get(i, [])
        rel = mean_interval(got).rel_half if len(got) >= 2 else None
        if rel is None or rel > study.precision:
            todo.append(i)
    return todo, "" if todo else f"every interval within +-{100 * study.precision:g} %"


# ----------------------------------------------------------------------------------------------------- run

def run(study: Study, out: Path, *, rerun: bool = False, stream: TextIO | None = None,
        cwd: Path | None = None) -> dict:
    """Run the study: prepare its data, then round by round each open combination's next cell (plan it, run the plan,
    collect its result), until every combination's throughput is known to the study's precision or its bounds are
    reached. Returns {"ok": n, "failed": n, "skipped": n}. Never raises for a failed cell."""
    stream = stream or sys.stdout

    def say(msg: str) -> None:
        print(f"[ds-study] {msg}", file=stream, flush=True)

    cwd = Path(cwd or Path.cwd())
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(study.path, out / "study.toml")
    env = rank_env(pythonpath=[REPO_ROOT], extra=study.env)
    _prepare(study, out, env, cwd, say)
    if rerun:   # every earlier cell aside first: a later round this run does not reach must not count in its report
        for cell in study.all_cells():
            for old, name in ((cell_dir(out, cell), cell.key), (out / "twins" / cell.key, f"twins-{cell.key}")):
                if old.exists():
                    _move_aside(out, old, say, name)
    say(measuring_rule(study))
    counts = {"ok": 0, "failed": 0, "skipped": 0}
    samples: dict = {}
    failures: dict = {}
    t0 = time.monotonic()
    for rnd in range(study.max_repeats + 1):    # the last turn only says why measuring stopped
        todo, why = open_combos(study, samples, failures, rnd, time.monotonic() - t0)
        if not todo:
            say(f"measuring done after {rnd} round(s): {why}")
            break
        # interleaved, and each round starts one combination later: none always runs first after a pause
        for i in todo[rnd % len(todo):] + todo[:rnd % len(todo)]:
            cell = study.cell(i, rnd)
            planned = len(study.cells())
            head = (f"cell {cell.index + 1}" + (f"/{planned}" if cell.index < planned else " (a round for precision)")
                    + f" ({counts['ok'] + counts['skipped']} done, {counts['failed']} failed)")
            thr = _cell(study, cell, out, env, cwd, rerun, counts, head, say)
            if thr is None:
                failures[i] = failures.get(i, 0) + 1
            else:
                samples.setdefault(i, []).append(thr)
    for i, combo in enumerate(study.combos()):
        if samples.get(i):
            label = " ".join(f"{k}={v}" for k, v in combo.items()) or "the study"
            say(f"{label}: {mean_interval(samples[i]).text()} samples/s")
    say(f"finished: {counts['ok']} ran, {counts['skipped']} skipped (complete), {counts['failed']} failed; "
        f"report: python -m ds_tools.study report {out}")
    return counts


def _cell(study: Study, cell: Cell, out: Path, env, cwd: Path, rerun: bool, counts: dict, head: str,
          say: Callable[[str], None]) -> float | None:
    """One cell: skip it when complete (its command must be the plan's), else plan, run, collect; its samples/s."""
    p = cell_plan.build(study, cell, out)
    d = p.run_dir
    if d.exists() and not rerun and is_complete(d):
        st = read_status(d)
        if _comparable(st.get("command")) != _comparable(p.commands):
            raise StudyError(f"{d}: this cell was run with another command than {study.path} now gives; rerun it "
                             f"with --rerun or give another --out. Was: {' '.join(st['command'][0])}")
        counts["skipped"] += 1
        thr = throughput_of(d)
        say(f"{head}: {cell.label()}: complete, skipped ({thr:.2f} samples/s)")
        return thr
    say(f"{head}: {cell.label()}")
    for old, name in ((d, d.name), (out / "twins" / cell.key, f"twins-{cell.key}")):
        if old.exists():    # an earlier attempt (a twin must train afresh, not resume its finished earlier run)
            _move_aside(out, old, say, name)
    if p.port_checked_here and not _port_free(p.port):
        port = free_port()
        say(f"  master port {p.port} (planned) is taken: using {port}")
        p = cell_plan.build(study, cell, out, port=port)
    res = _launch(p, study, out, env, cwd, say)
    return _collect(p, study, res, counts, say)


def _launch(p, study: Study, out: Path, env, cwd: Path, say) -> local_ranks.LaunchResult:
    """Write the plan's files, set up its fabric, probe the link, run its commands."""
    for path, text in p.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    fab_ctx = nullcontext() if p.fabric is None else netns.emulated_fabric(
        len(p.fabric["namespaces"]), mbit=p.fabric["mbit"], delay_ms=p.fabric["delay_ms"], key=p.fabric["key"])
    with fab_ctx as fab:
        if fab is not None:
            say(f"  emulated fabric {p.fabric['name']}: {fab.mbit:g} Mbit/s, {fab.delay_ms:g} ms "
                + ("" if fab.latency_emulated else "(latency NOT emulated: no sch_netem in this kernel) ")
                + f"between {len(fab.namespaces)} namespace(s)")
            fabric = {k: p.fabric[k] for k in ("name", "mbit", "delay_ms")}
            atomic_write_text(p.run_dir / "fabric.json", dump_json({**fabric, "latency_emulated":
                                                                     fab.latency_emulated, "twins": p.twins}))
            if p.twins:
                say(f"  beside {p.twins} independent twin(s) in the other namespace(s), so that every cell loads "
                    "the host's CPUs alike")
            if p.probe:
                _probe_link(p, env, cwd, say)
        return local_ranks.run_launchers(p.commands, env=env, cwd=cwd, timeout_s=study.timeout_s,
                                         log_path=p.run_dir / "log.txt", on_poll=_Progress(p.run_dir, say),
                                         poll_s=2.0)


def _collect(p, study: Study, res, counts: dict, say) -> float | None:
    """cell.json (written last, atomically) from the launch's result and the run's summary; the cell's samples/s."""
    d, log = p.run_dir, p.run_dir / "log.txt"
    summary = read_summary(d)
    status = "timeout" if res.timed_out else ("ok" if res.ok and summary is not None else "failed")
    rec = {"status": status, "exit_code": res.exit_code if not (res.ok and summary is None) else 1,
           "seconds": round(res.seconds, 1), "values": p.cell.values, "repeat": p.cell.repeat,
           "index": p.cell.index, "master_port": p.port, "command": p.commands,
           "log_tail": "" if status == "ok" else _log_tail(log)}
    if res.ok and summary is None:
        rec["log_tail"] = "exit code 0 but no summary record in metrics.jsonl\n" + _log_tail(log)
    atomic_write_text(d / "cell.json", dump_json(rec))
    if status == "ok":
        counts["ok"] += 1
        say(f"  done in {res.seconds:.0f} s: {summary['samples_per_s']:.2f} samples/s")
        return summary["samples_per_s"]
    counts["failed"] += 1
    why = f"timed out after {study.timeout_s:.0f} s (process groups killed)" if res.timed_out else \
        f"exit code {rec['exit_code']}"
    last = [ln for ln in rec["log_tail"].splitlines() if ln.strip()][-1:] or ["(empty log)"]
    say(f"  FAILED: {why}; log {log}; last line: {last[0][:200]}")
    return None


def _prepare(study: Study, out: Path, env, cwd: Path, say) -> None:
    """The study's `prepare` command, once, where what it creates is missing."""
    if not study.prepare or (cwd / study.prepare_creates).exists():
        return
    cmd = [sys.executable if study.prepare[0] == "python" else study.prepare[0], *study.prepare[1:]]
    say(f"preparing: {' '.join(cmd)}")
    res = local_ranks.run_launchers([cmd], env=env, cwd=cwd, timeout_s=study.timeout_s, log_path=out / "prepare.log")
    if not res.ok or not (cwd / study.prepare_creates).exists():
        raise StudyError(f"{study.path}: [study] prepare failed (exit {res.exit_code}) or did not create "
                         f"{study.prepare_creates}; see {out / 'prepare.log'}")


def _port_free(port: int) -> bool:
    """Whether a rendezvous could listen on `port` now (SO_REUSEADDR, as torch's TCPStore: a socket of an earlier
    run lingering in TIME_WAIT does not block it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


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
    """Polls the running cell's metrics.jsonl and prints its latest throughput figure (rank 0 writes it)."""

    def __init__(self, run_dir: Path, say: Callable[[str], None]):
        self.path, self.say, self.seen = run_dir / "metrics.jsonl", say, 0

    def __call__(self) -> None:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return
        latest = None
        for line in lines[self.seen:]:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a line being written: read it next time
            self.seen += 1
            if rec.get("type") == "step" and rec.get("samples_per_s"):
                latest = rec
        if latest is not None:   # one line per poll, however many steps were logged since
            self.say(f"  step {latest['step']}: {latest['samples_per_s']:.2f} samples/s")


def _probe_link(p, env, cwd: Path, say) -> None:
    """ds_tools.study.linkprobe between the cell's nodes, before it trains: the link's per-call cost, measured, in
    link_probe.json (a failed probe is said and left out: the comparison then says the cost was not measured)."""
    d = p.run_dir
    res = local_ranks.run_launchers(p.probe, env=env, cwd=cwd, timeout_s=180, log_path=d / "link_probe.log")
    try:
        r = json.loads((d / "link_probe.json").read_text())
        say(f"  link probe: a tiny all_reduce takes {1e3 * r['alpha_all_reduce_s']:.3f} ms, an all_gather "
            f"{1e3 * r['alpha_all_gather_s']:.3f} ms (median of {r['calls']}); a {r['big_nbytes'] / 1e6:.2f} MB "
            f"all_reduce {1e3 * r['big_all_reduce_s']:.1f} ms: bus bandwidth {r['busbw_Bps'] * 8 / 1e6:.1f} Mbit/s")
    except (OSError, ValueError, KeyError):
        say(f"  link probe FAILED (exit {res.exit_code}); see {d / 'link_probe.log'}")


def _comparable(cmds) -> list:
    """A command with its master port blanked (a port taken by something else is not a different cell)."""
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
