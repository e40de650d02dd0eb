"""Scaling-efficiency reporter: how well did throughput scale from the smallest run to N nodes.

Reads only machine-readable outputs: the final ``{"type": "summary"}`` record of each run's ``metrics.jsonl``
(written by ``ds_core.outputs.metrics`` through the loop), or a CSV of published numbers (``--from_table``, columns
``nodes,accelerators,throughput``). Runs are grouped by everything that changes what one sample costs (model,
accelerator type, micro batch, sequence length, precision, ZeRO stage); groups are never merged or averaged, and
every group after the first says how it differs.

    ds-scaling-report runs/n1 runs/n2 --format md --plot scaling.png
    ds-scaling-report predict --from runs/n1 --fabric dgx-a100 --nodes 2 4 8     (ds_tools/predict.py)
    python -m ds_tools.scaling --from_table studies/published/bert_large_dl1.csv --format json
    python -m ds_tools.scaling predict ...                                       (the same commands)
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from ds_core.cli import ArgumentParser, cli_main, flag
from ds_tools import scaling_explain as explain
from ds_tools.intervals import Estimate, mean_interval, ratio_interval

# Keys that make two runs incomparable: a different value changes the work per sample or per accelerator.
# grad_accum / global_batch are deliberately not here: they legitimately change in strong-scaling studies and are
# shown per row instead.
GROUP_KEYS = ("model", "accelerator", "micro_batch", "seq_len", "precision", "zero_stage")


class ScalingError(ValueError):
    """A run or table that cannot be read; the message names the file and what was expected."""


@dataclass
class Run:
    nodes: int
    accelerators: int
    throughput: float            # sequences (samples) per second, whole job, warm-up excluded
    source: str
    config: dict = field(default_factory=dict)   # GROUP_KEYS values (None when unknown)
    extra: dict = field(default_factory=dict)    # shown, not grouped on: grad_accum, global_batch, mfu ...
    phases: dict | None = None                   # sampled phase seconds (ds_core.outputs.phases), None without them
    factors: dict = field(default_factory=dict)  # what else a study varied (fabric, allreduce ...): grouped on too


@dataclass
class Group:
    key: tuple
    runs: list
    baseline: Run
    reason: str = ""             # why this group is separate from the first one ("" for the first)

    @property
    def title(self) -> str:
        c = dict(zip(GROUP_KEYS, self.key))
        parts = [f"{k.replace('_', ' ')} {c[k]}" for k in GROUP_KEYS[1:] if c[k] is not None]
        parts += [f"{k} {v}" for k, v in self.key[len(GROUP_KEYS):]]
        return f"{c['model'] or 'unknown model'}" + (f" ({', '.join(parts)})" if parts else "")


# ---------------------------------------------------------------------------------------------------- reading

def summary_of(path: Path) -> dict:
    """The last summary record of a metrics.jsonl that measured a throughput; a run without one (crashed, still
    running) is an error. A summary without samples_per_s is passed over when an earlier one has it: a resume from
    the final checkpoint used to append such a record (one with no step measured)."""
    summary = measured = None
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines):    # a torn last line: the run died mid-write; the summary (if any) decides
                break
            raise ScalingError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        if isinstance(rec, dict) and rec.get("type") == "summary":
            summary = rec
            if rec.get("samples_per_s") is not None:
                measured = rec
    summary = measured or summary
    if summary is None:
        raise ScalingError(f"{path}: no {{\"type\": \"summary\"}} record (run unfinished or crashed?)")
    return summary


def _canonical_accelerator(name):
    """Runs written before ds_core.device.accelerators named devices by alias (`a100`, `h100`): group them with the runs
    that write the table's name. A name the table does not know (cpu, a new device) is kept as written."""
    from ds_core.device import accelerators

    if not isinstance(name, str):
        return name
    try:
        return accelerators.get(name).name
    except accelerators.UnknownAcceleratorError:
        return name


def run_from_summary(summary: dict, source: str, factors: dict | None = None) -> Run:
    try:
        world = int(summary["world_size"])
        throughput = float(summary["samples_per_s"])
    except (KeyError, TypeError, ValueError) as e:
        raise ScalingError(f"{source}: summary record lacks a usable {e} (need world_size, samples_per_s)") from None
    nodes = int(summary.get("nodes") or 1)
    if world <= 0 or not math.isfinite(throughput) or throughput <= 0:
        raise ScalingError(f"{source}: world_size={world}, samples_per_s={throughput}: expected positive numbers")
    config = {k: summary.get(k) for k in GROUP_KEYS}
    config["accelerator"] = _canonical_accelerator(config["accelerator"])
    extra = {k: summary[k] for k in ("grad_accum", "global_batch", "mfu", "tflops_per_accelerator")
             if summary.get(k) is not None}
    return Run(nodes=nodes, accelerators=world, throughput=throughput, source=source, config=config, extra=extra,
               phases=explain.phases_of(summary), factors=dict(factors or {}))


def read_runs(paths: Iterable[str | Path]) -> list:
    """Runs from run directories (``DIR/metrics.jsonl``, sub-runs one or two levels down), study directories
    (``ds-study run``'s: each complete cell, with the axis values it varied besides nodes) or metrics.jsonl files."""
    runs = []
    for p in map(Path, paths):
        if p.is_dir():
            found = _runs_under(p)
            if not found:
                raise ScalingError(f"{p}: no metrics.jsonl in it, in its sub-directories or two levels down, and no "
                                   "complete cell if it is a study directory")
            runs += found
        elif p.is_file():
            runs.append(run_from_summary(summary_of(p), str(p)))
        else:
            raise ScalingError(f"{p}: no such run directory or metrics.jsonl")
    return runs


# study axes already among GROUP_KEYS (through the run's summary) under another name
_AXIS_KEYS = {"nodes", "zero_stage", "micro_batch_size"}


def study_runs(study_dir: Path) -> list:
    """The complete cells of a study directory (STUDY/study.toml, STUDY/cells/<key>/cell.json says ok), each with the
    values of the axes it varied besides those its summary already holds; failed, unfinished, earlier (previous/)
    and twin runs are not cells of the study and are left out."""
    runs = []
    for d in sorted(p for p in (study_dir / "cells").iterdir() if p.is_dir()):
        try:
            cell = json.loads((d / "cell.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if cell.get("status") != "ok" or not (d / "metrics.jsonl").is_file():
            continue
        factors = {k: v for k, v in (cell.get("values") or {}).items() if k not in _AXIS_KEYS}
        runs.append(run_from_summary(summary_of(d / "metrics.jsonl"), str(d / "metrics.jsonl"), factors))
    return runs


def _is_study(d: Path) -> bool:
    return (d / "study.toml").is_file() and (d / "cells").is_dir()


def _runs_under(p: Path, depth: int = 0) -> list:
    if (p / "metrics.jsonl").is_file():
        return [run_from_summary(summary_of(p / "metrics.jsonl"), str(p / "metrics.jsonl"))]
    if _is_study(p):
        return study_runs(p)
    if depth >= 2:
        return []
    return [r for d in sorted(x for x in p.iterdir() if x.is_dir()) for r in _runs_under(d, depth + 1)]


def read_table(path: str | Path) -> list:
    """Published/external numbers: CSV with ``nodes,accelerators,throughput`` (+ optional ``model`` and the other
    grouping columns, e.g. ``micro_batch``)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    reader = csv.DictReader(io.StringIO(text))
    need = {"nodes", "accelerators", "throughput"}
    have = {c.strip() for c in reader.fieldnames or []}
    if not need <= have:
        raise ScalingError(f"{path}: columns {sorted(have)}; expected at least {sorted(need)}")
    runs = []
    for i, row in enumerate(reader, 2):
        row = {k.strip(): (v or "").strip() for k, v in row.items() if k}
        try:
            nodes, acc, thr = int(row["nodes"]), int(row["accelerators"]), float(row["throughput"])
        except ValueError:
            raise ScalingError(f"{path}:{i}: nodes={row['nodes']!r} accelerators={row['accelerators']!r} "
                               f"throughput={row['throughput']!r}: expected int, int, number") from None
        if nodes <= 0 or acc <= 0 or not thr > 0:
            raise ScalingError(f"{path}:{i}: nodes, accelerators and throughput must be positive")
        config = {k: (row.get(k) or None) for k in GROUP_KEYS}
        config["model"] = config["model"] or path.stem
        runs.append(Run(nodes=nodes, accelerators=acc, throughput=thr, source=f"{path}:{i}", config=config))
    if not runs:
        raise ScalingError(f"{path}: no rows")
    return runs


# --------------------------------------------------------------------------------------------------- grouping

def _norm(v):
    # "8" from a CSV and 8 from JSON are the same micro batch
    if isinstance(v, str):
        try:
            f = float(v)
            return int(f) if f.is_integer() else f
        except ValueError:
            return v
    return v


def group_runs(runs: Sequence[Run], baseline_nodes: int | None = None) -> list:
    """Comparable runs together; the first group is the one with the most runs. Each later group records why it
    is separate (the keys where it differs from the first group)."""
    if not runs:
        raise ScalingError("no runs given")
    by_key: dict = {}
    for r in runs:
        key = tuple(_norm(r.config.get(k)) for k in GROUP_KEYS) + tuple(sorted((k, str(v)) for k, v in
                                                                             r.factors.items()))
        by_key.setdefault(key, []).append(r)
    keys = sorted(by_key, key=lambda k: (-len(by_key[k]), str(k)))
    groups = []
    for key in keys:
        members = sorted(by_key[key], key=lambda r: (r.accelerators, r.nodes, r.source))
        if baseline_nodes is None:
            base = members[0]
        else:
            cands = [r for r in members if r.nodes == baseline_nodes]
            if not cands:
                nodes = ", ".join(map(str, sorted({r.nodes for r in members})))
                raise ScalingError(f"--baseline_nodes {baseline_nodes}: group {Group(key, members, members[0]).title} "
                                   f"has runs at {nodes} node(s) only")
            base = cands[0]
        reason = ""
        if groups:
            first, mine = _key_dict(groups[0].key), _key_dict(key)
            diffs = [f"{k} {mine.get(k)!r} vs {first.get(k)!r}" for k in dict.fromkeys([*first, *mine])
                     if mine.get(k) != first.get(k)]
            reason = "not comparable with the first group: different " + ", ".join(diffs)
        groups.append(Group(key=key, runs=members, baseline=base, reason=reason))
    return groups


def _key_dict(key: tuple) -> dict:
    return {**dict(zip(GROUP_KEYS, key)), **dict(key[len(GROUP_KEYS):])}


def _mean_phases(runs: Sequence[Run]) -> dict | None:
    """The runs' mean phase seconds; None unless every run has phase timing."""
    if not runs or any(r.phases is None for r in runs):
        return None
    return {k: sum(r.phases[k] for r in runs) / len(runs) for k in runs[0].phases}


def rows_of(group: Group) -> list:
    """One row per scale (nodes, accelerators): the mean throughput of the runs at that scale with its 95 % interval
    and their number, the efficiency and speedup against the baseline's scale with theirs (ds_tools.intervals), and
    what grew, from the means."""
    by_scale: dict = {}
    for r in group.runs:
        by_scale.setdefault((r.nodes, r.accelerators), []).append(r)
    b_runs = by_scale[(group.baseline.nodes, group.baseline.accelerators)]
    b_thr = mean_interval([r.throughput for r in b_runs])
    b_acc, b_phases = group.baseline.accelerators, _mean_phases(b_runs)
    rows = []
    for (nodes, acc), runs in by_scale.items():
        thr = mean_interval([r.throughput for r in runs])
        is_base = runs is b_runs
        eff = Estimate(1.0, None, thr.n) if is_base else ratio_interval(thr.scaled(b_acc / acc), b_thr)
        speed = Estimate(1.0, None, thr.n) if is_base else ratio_interval(thr, b_thr)
        rows.append({"nodes": nodes, "accelerators": acc, "throughput": thr.value, "throughput_half": thr.half,
                     "n": thr.n, "per_accelerator": thr.value / acc, "efficiency": eff.value,
                     "efficiency_half": eff.half, "speedup": speed.value, "speedup_half": speed.half,
                     "baseline": is_base, "estimate": thr, "efficiency_estimate": eff,
                     "lost": explain.lost_points(b_acc, b_thr.value, b_phases, acc, thr.value, _mean_phases(runs)),
                     "group": group.title, **_key_dict(group.key), **runs[0].extra,
                     "source": runs[0].source, "runs": [r.source for r in runs]})
    return rows


METHOD_NOTE = ("sequences/s: the mean of the n runs at that scale, ± the half-width of its 95 % Student t interval; "
               "efficiency and speedup: ± from both means' intervals (relative standard errors combined, "
               "Welch-Satterthwaite degrees of freedom); one run has no interval and says so (ds_tools/intervals.py).")


# ------------------------------------------------------------------------------------------------- formatting

_COLS = ("nodes", "accelerators", "throughput", "throughput_half", "per_accelerator", "efficiency",
         "efficiency_half", "speedup", "speedup_half", "n")
_HEAD = ("nodes", "accelerators", "sequences/s", "± 95 %", "sequences/s per accelerator", "scaling efficiency %",
         "± 95 %", "speedup", "n")


def _pm(half, row: dict, scale: float = 1.0) -> str:
    if row["baseline"] and scale == 100.0:
        return "baseline"
    return "one run" if row["n"] == 1 else ("n/a" if half is None else f"{scale * half:.2f}")


def _cells(row: dict) -> list:
    return [str(row["nodes"]), str(row["accelerators"]), f"{row['throughput']:.2f}",
            _pm(row["throughput_half"], row), f"{row['per_accelerator']:.2f}", f"{100 * row['efficiency']:.2f}",
            _pm(row["efficiency_half"], row, 100.0), f"{row['speedup']:.2f}", str(row["n"])]


def run_labels(groups: Sequence[Group]) -> dict:
    """source -> the shortest tail of its path that no other run shares (`a/cells/nodes-1__rep0` and
    `b/cells/nodes-1__rep0` stay apart): each row names its own runs."""
    def parts(src: str) -> tuple:
        p = Path(src)
        return (p.parent if p.name == "metrics.jsonl" else p).parts

    sources = list(dict.fromkeys(r.source for g in groups for r in g.runs))
    out = {}
    for src in sources:
        mine = parts(src)
        for k in range(min(2, len(mine)), len(mine) + 1):
            if all(parts(o)[-k:] != mine[-k:] for o in sources if o != src):
                break
        out[src] = "/".join(mine[-k:]) if mine else src
    return out


def _runs_text(row: dict, labels: dict) -> str:
    names = [labels.get(s, s) for s in row["runs"]]
    return ", ".join(names) if len(names) <= 3 else f"{names[0]}, ... {names[-1]} ({len(names)} runs)"


def format_md(groups: Sequence[Group]) -> str:
    out = []
    labels = run_labels(groups)
    for i, g in enumerate(groups, 1):
        b = g.baseline
        out.append(f"### Group {i}: {g.title}")
        if g.reason:
            out.append(f"\n_{g.reason}_")
        out.append(f"\nBaseline: {b.nodes} node(s), {b.accelerators} accelerator(s).\n")
        out.append("| " + " | ".join(_HEAD) + " | runs |")
        out.append("|" + "|".join("---:" for _ in _HEAD) + "|:---|")
        out += ["| " + " | ".join(_cells(r)) + f" | {_runs_text(r, labels)} |" for r in rows_of(g)]
        out.append(f"\n{METHOD_NOTE}")
        out += _md_lost(g)
        out.append("")
    return "\n".join(out)


def _md_lost(g: Group) -> list:
    """The breakdown table: points of efficiency each phase cost, per scale larger than the baseline. Left out where
    no run has phase timing (published numbers): every row would be zeros and the whole loss under "anything else"."""
    rows = [r for r in rows_of(g) if not r["baseline"]]
    if not any(r["lost"]["timed"] for r in rows):
        return []
    heads = [explain.BUCKET_TITLES[k] for k in explain.BUCKETS]
    out = ["\nWhat grew against the baseline: points of scaling efficiency lost to each part of the step, from the "
           "mean throughputs and phase times (they add up to 100 - efficiency; negative: that part shrank).\n",
           "| nodes | accelerators | " + " | ".join(heads) + " | total lost | n | phase timing |",
           "|" + "|".join("---:" for _ in range(len(heads) + 4)) + "|:---|"]
    for r in rows:
        lost = r["lost"]
        out.append(f"| {r['nodes']} | {r['accelerators']} | "
                   + " | ".join(f"{round(lost[k], 2) + 0.0:.2f}" for k in explain.BUCKETS)
                   + f" | {round(lost['total'], 2) + 0.0:.2f} | {r['n']}"
                   + f" | {'yes' if lost['timed'] else 'no: all in anything else'} |")
    return out


def _num(v, digits: int) -> str:
    return "" if v is None else f"{round(v, digits) + 0.0:.{digits}f}"


def format_csv(groups: Sequence[Group]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["group", *_COLS, "baseline", *(f"lost_{k}" for k in explain.BUCKETS), "lost_total",
                "phase_timing", "reason", "runs"])
    labels = run_labels(groups)
    for i, g in enumerate(groups, 1):
        for r in rows_of(g):
            lost = r["lost"]
            w.writerow([i, r["nodes"], r["accelerators"], _num(r["throughput"], 2), _num(r["throughput_half"], 2),
                        _num(r["per_accelerator"], 2), _num(r["efficiency"], 4), _num(r["efficiency_half"], 4),
                        _num(r["speedup"], 2), _num(r["speedup_half"], 2), r["n"], int(r["baseline"]),
                        *(_num(lost[k], 4) for k in (*explain.BUCKETS, "total")), int(lost["timed"]), g.reason,
                        " ".join(labels[s] for s in r["runs"])])
    return buf.getvalue()


def format_json(groups: Sequence[Group]) -> str:
    rows = []
    labels = run_labels(groups)
    for i, g in enumerate(groups, 1):
        for r in rows_of(g):
            r = {k: (round(v, 4) if k in ("throughput", "throughput_half", "per_accelerator", "speedup",
                                          "speedup_half") and v is not None else v)
                 for k, v in r.items() if k not in ("estimate", "efficiency_estimate")}
            r["efficiency"] = round(r["efficiency"], 6)
            r["efficiency_half"] = None if r["efficiency_half"] is None else round(r["efficiency_half"], 6)
            r["lost"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r["lost"].items()}
            r["runs"] = [labels[s] for s in r["runs"]]
            rows.append({"group_index": i, "reason": g.reason, **r})
    return json.dumps(rows, indent=2)


def short_titles(groups: Sequence[Group]) -> list:
    """Each group named by what sets it apart from the others (`fabric slow`), its whole title where nothing does."""
    keys = [_key_dict(g.key) for g in groups]
    differ = [k for k in dict.fromkeys(k for d in keys for k in d) if len({str(d.get(k)) for d in keys}) > 1]
    return [", ".join(f"{k.replace('_', ' ')} {d.get(k)}" for k in differ) or g.title for d, g in zip(keys, groups)]


def plot(groups: Sequence[Group], path: str | Path) -> None:
    """Throughput against accelerators with each group's ideal (linear from its baseline) line, and efficiency, both
    with their 95 % intervals as error bars; with phase timing, what grew (ds_tools.scaling_explain.plot_lost)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    timed = any(r["lost"]["timed"] for g in groups for r in rows_of(g) if not r["baseline"])
    short = short_titles(groups)
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(16 if timed else 11, 4.6))
    ax1, ax2 = axes[:2]
    for i, g in enumerate(groups):
        rows = rows_of(g)
        x = [r["accelerators"] for r in rows]
        color = f"C{i % 10}"
        base_per_acc = rows[[r["baseline"] for r in rows].index(True)]["per_accelerator"]
        label = f"{i + 1}: {short[i]}" if len(groups) > 1 else str(g.key[0])
        ax1.errorbar(x, [r["throughput"] for r in rows], yerr=[r["throughput_half"] or 0 for r in rows], fmt="o-",
                     color=color, capsize=3, label=label)
        ax1.plot(x, [base_per_acc * a for a in x], "--", color=color, alpha=0.5)
        ax2.errorbar(x, [100 * r["efficiency"] for r in rows], yerr=[100 * (r["efficiency_half"] or 0) for r in rows],
                     fmt="o-", color=color, capsize=3, label=label)
    ax1.set(xlabel="accelerators", ylabel="sequences/s", title="Throughput, 95 % intervals (dashed: ideal)")
    ax2.set(xlabel="accelerators", ylabel="scaling efficiency %", title="Per-accelerator throughput vs baseline")
    ax2.axhline(100, color="grey", lw=0.8, ls=":")
    ax2.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len({a for g in groups for a in (r.accelerators for r in g.runs)}) > 2:
            ax.set_xscale("log", base=2)
    ax1.legend(fontsize=6)
    if timed:  # without phase timing every bar would be "anything else": the panel says nothing
        bars = [(f"{short[i]}\n{r['accelerators']}" if len(groups) > 1 else str(r["accelerators"]), r["lost"])
                for i, g in enumerate(groups) for r in rows_of(g) if not r["baseline"]]
        explain.plot_lost(axes[2], bars)
    if len(groups) == 1:
        fig.suptitle(groups[0].title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="ds-scaling-report", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("runs", nargs="*", help="run directories (containing metrics.jsonl) or metrics.jsonl files")
    p.add_argument(*flag("--from_table"), action="append", default=[], metavar="FILE.csv",
                   help="CSV with columns nodes,accelerators,throughput (published or external numbers)")
    p.add_argument(*flag("--baseline_nodes"), type=int, default=None,
                   help="node count of the baseline run (default: the smallest run of each group)")
    p.add_argument("--format", choices=("md", "csv", "json"), default="md", help="output format (default md)")
    p.add_argument("--plot", metavar="FILE.png", help="write throughput and efficiency against accelerators (and, for "
                                                      "runs with phase timing, what grew)")
    p.add_argument("--out", metavar="FILE", help="write the report here instead of stdout")
    return p


def _main(args: argparse.Namespace) -> int:
    runs = read_runs(args.runs)
    for t in args.from_table:
        runs += read_table(t)
    if not runs:
        raise ScalingError("nothing to report: give run directories, metrics.jsonl files or --from_table")
    groups = group_runs(runs, args.baseline_nodes)
    text = {"md": format_md, "csv": format_csv, "json": format_json}[args.format](groups)
    if args.out:
        Path(args.out).write_text(text + ("\n" if not text.endswith("\n") else ""), encoding="utf-8")
    else:
        print(text)
    if args.plot:
        plot(groups, args.plot)
        print(f"[ds-scaling-report] plot written to {args.plot}", file=sys.stderr)
    if len(groups) > 1:
        print(f"[ds-scaling-report] {len(groups)} groups of incomparable runs; see each group's reason",
              file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # OSError: a run directory, table or output path the user named
    return cli_main(argv, build_parser, _main, (ScalingError, OSError))


if __name__ == "__main__":
    # `python -m ds_tools.scaling` is the console script `ds-scaling-report`, `predict` included: its dispatcher
    # (ds_tools.scaling_cli) runs as the program. Run, not imported: it imports this module (and predict does).
    import runpy

    runpy.run_module("ds_tools.scaling_cli", run_name="__main__", alter_sys=True)
