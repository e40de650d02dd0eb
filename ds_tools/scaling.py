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


def run_from_summary(summary: dict, source: str) -> Run:
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
               phases=explain.phases_of(summary))


def read_runs(paths: Iterable[str | Path]) -> list:
    """Runs from run directories (``DIR/metrics.jsonl``, or one level of sub-runs) or metrics.jsonl files."""
    runs = []
    for p in map(Path, paths):
        if p.is_dir():
            files = [p / "metrics.jsonl"] if (p / "metrics.jsonl").is_file() else sorted(p.glob("*/metrics.jsonl"))
            if not files:
                raise ScalingError(f"{p}: no metrics.jsonl in it or in its sub-directories")
        elif p.is_file():
            files = [p]
        else:
            raise ScalingError(f"{p}: no such run directory or metrics.jsonl")
        runs += [run_from_summary(summary_of(f), str(f)) for f in files]
    return runs


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
        by_key.setdefault(tuple(_norm(r.config.get(k)) for k in GROUP_KEYS), []).append(r)
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
            first = dict(zip(GROUP_KEYS, groups[0].key))
            diffs = [f"{k} {v!r} vs {first[k]!r}" for k, v in zip(GROUP_KEYS, key) if v != first[k]]
            reason = "not comparable with the first group: different " + ", ".join(diffs)
        groups.append(Group(key=key, runs=members, baseline=base, reason=reason))
    return groups


def rows_of(group: Group) -> list:
    base = group.baseline
    base_per_acc = base.throughput / base.accelerators
    rows = []
    for r in group.runs:
        per_acc = r.throughput / r.accelerators
        rows.append({"nodes": r.nodes, "accelerators": r.accelerators, "throughput": r.throughput,
                     "per_accelerator": per_acc, "efficiency": per_acc / base_per_acc,
                     "speedup": r.throughput / base.throughput, "baseline": r is base,
                     "lost": explain.lost_points(base.accelerators, base.throughput, base.phases,
                                                 r.accelerators, r.throughput, r.phases),
                     "group": group.title, **{k: v for k, v in zip(GROUP_KEYS, group.key)},
                     **r.extra, "source": r.source})
    return rows


def repeat_notes(group: Group) -> list:
    """Runs repeated at one scale are listed, not averaged; their spread says how much to trust one efficiency."""
    notes = []
    by_scale: dict = {}
    for r in group.runs:
        by_scale.setdefault((r.nodes, r.accelerators), []).append(r.throughput / r.accelerators)
    for (nodes, acc), vals in sorted(by_scale.items()):
        if len(vals) > 1:
            notes.append(f"{len(vals)} runs at {nodes} node(s) / {acc} accelerator(s): {min(vals):.2f} to "
                         f"{max(vals):.2f} sequences/s per accelerator (spread {100 * (max(vals) / min(vals) - 1):.0f} "
                         "%); efficiencies are against the baseline run named above.")
    return notes


# ------------------------------------------------------------------------------------------------- formatting

_COLS = ("nodes", "accelerators", "throughput", "per_accelerator", "efficiency", "speedup")
_HEAD = ("nodes", "accelerators", "sequences/s", "sequences/s per accelerator", "scaling efficiency %",
         "speedup")


def _cells(row: dict) -> list:
    return [str(row["nodes"]), str(row["accelerators"]), f"{row['throughput']:.2f}",
            f"{row['per_accelerator']:.2f}", f"{100 * row['efficiency']:.2f}", f"{row['speedup']:.2f}"]


def _short(source: str) -> str:
    """runs/bert/n2/metrics.jsonl -> bert/n2: enough to tell repeated runs apart in a table."""
    p = Path(source)
    if p.name == "metrics.jsonl":
        p = p.parent
    return "/".join(p.parts[-2:])


def format_md(groups: Sequence[Group]) -> str:
    out = []
    for i, g in enumerate(groups, 1):
        b = g.baseline
        out.append(f"### Group {i}: {g.title}")
        if g.reason:
            out.append(f"\n_{g.reason}_")
        out.append(f"\nBaseline: {b.nodes} node(s), {b.accelerators} accelerator(s) ({_short(b.source)}).\n")
        out.append("| " + " | ".join(_HEAD) + " | run |")
        out.append("|" + "|".join("---:" for _ in _HEAD) + "|:---|")
        out += ["| " + " | ".join(_cells(r)) + f" | {_short(r['source'])} |" for r in rows_of(g)]
        out += [f"\n{note}" for note in repeat_notes(g)]
        out += _md_lost(g)
        out.append("")
    return "\n".join(out)


def _md_lost(g: Group) -> list:
    """The breakdown table: points of efficiency each phase cost, per run larger than the baseline. Left out where no
    run has phase timing (published numbers): every row would be zeros and the whole loss under "anything else"."""
    rows = [r for r in rows_of(g) if not r["baseline"]]
    if not any(r["lost"]["timed"] for r in rows):
        return []
    heads = [explain.BUCKET_TITLES[k] for k in explain.BUCKETS]
    out = ["\nWhat grew against the baseline: points of scaling efficiency lost to each part of the step "
           "(they add up to 100 - efficiency; negative: that part shrank).\n",
           "| nodes | accelerators | " + " | ".join(heads) + " | total lost | phase timing |",
           "|" + "|".join("---:" for _ in range(len(heads) + 3)) + "|:---|"]
    for r in rows:
        lost = r["lost"]
        out.append(f"| {r['nodes']} | {r['accelerators']} | "
                   + " | ".join(f"{round(lost[k], 2) + 0.0:.2f}" for k in explain.BUCKETS)
                   + f" | {round(lost['total'], 2) + 0.0:.2f}"
                   + f" | {'yes' if lost['timed'] else 'no: all in anything else'} |")
    return out


def format_csv(groups: Sequence[Group]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["group", *_COLS, "baseline", *(f"lost_{k}" for k in explain.BUCKETS), "lost_total",
                "phase_timing", "reason"])
    for i, g in enumerate(groups, 1):
        for r in rows_of(g):
            c = _cells(r)
            c[4] = f"{r['efficiency']:.4f}"    # csv keeps efficiency a fraction, like json
            lost = r["lost"]
            w.writerow([i, *c, int(r["baseline"]),
                        *(f"{round(lost[k], 4) + 0.0:.4f}" for k in (*explain.BUCKETS, "total")),
                        int(lost["timed"]), g.reason])
    return buf.getvalue()


def format_json(groups: Sequence[Group]) -> str:
    rows = []
    for i, g in enumerate(groups, 1):
        for r in rows_of(g):
            r = {k: (round(v, 4) if k in ("throughput", "per_accelerator", "speedup") else v) for k, v in r.items()}
            r["efficiency"] = round(r["efficiency"], 6)
            r["lost"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r["lost"].items()}
            rows.append({"group_index": i, "reason": g.reason, **r})
    return json.dumps(rows, indent=2)


def plot(groups: Sequence[Group], path: str | Path) -> None:
    """Throughput against accelerators with each group's ideal (linear from its baseline) line, and efficiency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = any(r["lost"]["timed"] for g in groups for r in rows_of(g) if not r["baseline"])
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(16 if timed else 11, 4.2))
    ax1, ax2 = axes[:2]
    for i, g in enumerate(groups):
        rows = rows_of(g)
        x = [r["accelerators"] for r in rows]
        color = f"C{i % 10}"
        base_per_acc = g.baseline.throughput / g.baseline.accelerators
        label = f"{i + 1}: {g.key[0]}" if len(groups) > 1 else str(g.key[0])
        ax1.plot(x, [r["throughput"] for r in rows], "o-", color=color, label=label)
        ax1.plot(x, [base_per_acc * a for a in x], "--", color=color, alpha=0.5, label=f"{label} ideal")
        ax2.plot(x, [100 * r["efficiency"] for r in rows], "o-", color=color, label=label)
    ax1.set_xlabel("accelerators")
    ax1.set_ylabel("sequences/s")
    ax1.set_title("Throughput (dashed: ideal linear scaling)")
    ax2.set_xlabel("accelerators")
    ax2.set_ylabel("scaling efficiency %")
    ax2.axhline(100, color="grey", lw=0.8, ls=":")
    ax2.set_ylim(bottom=0)
    ax2.set_title("Per-accelerator throughput vs baseline")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len({a for g in groups for a in (r.accelerators for r in g.runs)}) > 2:
            ax.set_xscale("log", base=2)
    ax1.legend(fontsize=7)
    if timed:  # without phase timing every bar would be "anything else": the panel says nothing
        _plot_lost(axes[2], groups)
    if len(groups) == 1:
        fig.suptitle(groups[0].title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_lost(ax, groups: Sequence[Group]) -> None:
    """Stacked bars: per larger run, the points of efficiency lost to each part of the step."""
    labels = []
    bars = []
    for i, g in enumerate(groups):
        for r in rows_of(g):
            if not r["baseline"]:
                labels.append(f"{i + 1}:{r['accelerators']}" if len(groups) > 1 else str(r["accelerators"]))
                bars.append(r["lost"])
    x = list(range(len(bars)))
    pos, neg = [0.0] * len(bars), [0.0] * len(bars)
    for j, k in enumerate(explain.BUCKETS):
        vals = [b[k] for b in bars]
        bottom = [pos[n] if v >= 0 else neg[n] for n, v in enumerate(vals)]
        ax.bar(x, vals, bottom=bottom, color=f"C{j}", label=explain.BUCKET_TITLES[k])
        for n, v in enumerate(vals):
            if v >= 0:
                pos[n] += v
            else:
                neg[n] += v
    ax.set_xticks(x, labels)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("accelerators")
    ax.set_ylabel("efficiency points lost vs baseline")
    ax.set_title("What grew (stacked: sum = 100 - efficiency)")
    ax.grid(alpha=0.3, axis="y")
    if bars:
        ax.legend(fontsize=7)


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
