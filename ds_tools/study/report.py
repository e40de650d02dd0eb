"""`ds-study report`: the tables people publish, from a study directory and/or tables of already-measured cells.

Reads only machine-readable outputs: each cell's cell.json (status), metrics.jsonl summary (ds_core.outputs.metrics owns
the throughput figures) and cell_stats/rank<R>.json (DeepSpeed comms-logger records, peak memory). For the `nodes` axis
the scaling-efficiency table and chart are ds_tools.scaling's own (this module only hands it the runs).

Writes report.md, report.csv, report.json and PNG charts (throughput.png: grouped bars over the categorical axes;
scaling.png: ds_tools.scaling's throughput and efficiency lines) into the report directory.

A `--from_table` CSV holds already-measured cells: one column per axis plus `samples_per_s` (or `throughput`), an
optional `accelerators` (for per-accelerator figures) and an optional `source` (rows with different sources are
separate tables). A study's own report.csv reads back the same way: its measurement columns (REPORT_COLUMNS) are not
axes, and its repeats, step time and peak memory are kept. A CSV with `nodes,accelerators,throughput` columns goes to
the scaling table instead.
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Sequence

from ds_tools import scaling
from ds_tools.intervals import Estimate, mean_interval, ratio_interval
from ds_tools.study.runner import cell_dir, read_status, read_summary
from ds_tools.study.spec import Study, StudyError, load_study

# Reduction collectives that carry gradients. The logger also records scalar reductions (gradient norm for clipping,
# overflow flags: 1 to 8 bytes) that are not gradient traffic; anything at or under SCALAR_BYTES is counted apart.
# Larger non-gradient reductions of our own carry a log_name of their own (bert_ref.layerwise's per-tensor norms for
# LAMB/LANS trust ratios under ZeRO: 4 bytes per parameter tensor, 144 on the BERT debug model), so they land among
# the other collectives by name, whatever their size.
REDUCTION_OPS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn",
                 "all_reduce_coalesced", "inference_all_reduce")
SCALAR_BYTES = 64


@dataclass
class Combo:
    """One combination of axis values (over its repeats) of one source: our study or a table."""
    source: str
    values: dict
    samples: list                  # samples/s of each successful repeat
    accelerators: int | None = None
    extra: dict = field(default_factory=dict)
    speedup: float | None = None
    failed: int = 0

    speedup_half: float | None = None

    @property
    def estimate(self) -> Estimate | None:
        """The mean samples/s with its 95 % interval and the number of runs (ds_tools.intervals)."""
        return mean_interval(self.samples) if self.samples else None

    @property
    def mean(self) -> float | None:
        return mean(self.samples) if self.samples else None

    @property
    def half(self) -> float | None:
        return self.estimate.half if self.samples else None

    @property
    def per_accelerator(self) -> float | None:
        return self.mean / self.accelerators if self.mean and self.accelerators else None

    def label(self) -> str:
        """The combination as a name: `nodes=2 fabric=slow` (`all` where the study has no axis)."""
        return " ".join(f"{k}={v}" for k, v in self.values.items()) or "all"


# ------------------------------------------------------------------------------------------------- reading

def comms_per_step(stats: dict, steps: int) -> dict:
    """Gradient collectives and bytes per optimizer step from one rank's comms-logger records."""
    grad_n = grad_b = scalar_n = 0
    other = {}
    for op, rec in stats.get("comms", {}).items():
        if op in REDUCTION_OPS:
            for size, n in rec["sizes"].items():
                if int(size) > SCALAR_BYTES:
                    grad_n, grad_b = grad_n + n, grad_b + n * int(size)
                else:
                    scalar_n += n
        else:
            other[op] = rec["count"]
    if not stats.get("comms") or steps <= 0:
        return {}
    return {"grad_collectives_per_step": grad_n / steps, "grad_bytes_per_step": grad_b / steps,
            "scalar_reductions_per_step": scalar_n / steps, "other_collectives": other}


def cell_rows(study: Study, out: Path) -> list[dict]:
    """One row per cell of the study (measuring order): the first `repeats` rounds, and the later rounds' cells that
    ran; status, throughput, comms, memory."""
    rows = []
    for cell in study.all_cells():
        d = cell_dir(out, cell)
        st = read_status(d)
        if cell.repeat >= study.repeats and st is None:
            continue    # a round the precision did not need
        row = {"cell": cell.key, **{f"axis:{k}": v for k, v in cell.values.items()}, "repeat": cell.repeat,
               "status": st["status"] if st else "not run", "exit_code": st.get("exit_code") if st else None}
        summary = read_summary(d) if st and st.get("status") == "ok" else None
        if summary:
            steps = int(summary.get("steps") or 0)
            row.update(samples_per_s=summary["samples_per_s"], world_size=summary["world_size"],
                       nodes=summary.get("nodes", 1), per_accelerator=summary["samples_per_s"] / summary["world_size"],
                       step_time_s=(summary["measured_seconds"] / summary["measured_steps"]
                                    if summary.get("measured_steps") else None),
                       model=summary.get("model"), zero_stage=summary.get("zero_stage"),
                       micro_batch=summary.get("micro_batch"))
            stats = [json.loads(p.read_text()) for p in sorted((d / "cell_stats").glob("rank*.json"))]
            if stats:
                rank0 = next((s for s in stats if s.get("rank") == 0), stats[0])
                row.update(comms_per_step(rank0, steps))
                mem = [s["memory"].get("device_peak_allocated_bytes", s["memory"]["host_peak_rss_bytes"])
                       for s in stats]
                row["peak_memory_bytes"] = max(mem)
                row["peak_memory_kind"] = "device" if "device_peak_allocated_bytes" in stats[0]["memory"] else \
                    "host RSS"
        elif st:
            row["log_tail"] = st.get("log_tail", "")[-1500:]
        rows.append(row)
    return rows


def combos_of(study: Study, rows: list[dict]) -> list[Combo]:
    names = list(study.axes)
    by: dict = {}
    for r in rows:
        values = {n: r[f"axis:{n}"] for n in names}
        c = by.setdefault(tuple(map(str, values.values())), Combo("ours", values, []))
        if r["status"] == "ok":
            c.samples.append(r["samples_per_s"])
            c.accelerators = r["world_size"]
            for k in ("grad_collectives_per_step", "grad_bytes_per_step", "step_time_s", "peak_memory_bytes"):
                if r.get(k) is not None:
                    c.extra.setdefault(k, []).append(r[k])
            if r.get("peak_memory_kind"):
                c.values.setdefault("_memory_kind", r["peak_memory_kind"])
        elif r["status"] in ("failed", "timeout"):
            c.failed += 1
    combos = list(by.values())
    for c in combos:
        c.extra = {k: mean(v) for k, v in c.extra.items()}
        kind = c.values.pop("_memory_kind", None)
        if kind:
            c.extra["peak_memory_kind"] = kind
    _speedups(combos, study.baseline_values())
    return combos


def _speedups(combos: list[Combo], baseline: dict) -> None:
    """Speedup of each combination against the baseline combination (the baseline's values on every non-node axis,
    the fewest nodes), with its 95 % interval from both means' (ds_tools.intervals.ratio_interval)."""
    def match(c: Combo) -> bool:
        return all(str(c.values.get(k)) == str(v) for k, v in baseline.items() if k in c.values)

    measured = sorted((c for c in combos if c.mean), key=lambda c: int(c.values.get("nodes", 1)))
    base = next((c for c in measured if match(c)), measured[0] if measured else None)
    for c in combos:
        r = ratio_interval(c.estimate, base.estimate) if (base and c.mean) else None
        c.speedup, c.speedup_half = (r.value, r.half) if r else (None, None)
        c.extra["baseline"] = c is base


# The columns report.csv writes besides the axes (report()), and those a table may carry that are not axes either.
REPORT_COLUMNS = ("samples_per_s", "throughput", "accelerators", "source", "note", "per_accelerator", "speedup",
                  "spread_pct", "runs", "failed", "repeats_samples_per_s", "baseline", "other_collectives", "cell",
                  "samples_per_s_half", "speedup_half", "n")
_MEASURED = ("grad_collectives_per_step", "grad_bytes_per_step", "step_time_s", "peak_memory_bytes")


def _repeats(row: dict, value: float) -> list[float]:
    """A report.csv row's repeats (a JSON list), else the row's one value."""
    try:
        got = json.loads(row.get("repeats_samples_per_s") or "[]")
    except json.JSONDecodeError:
        return [value]
    return [float(v) for v in got] if isinstance(got, list) and got else [value]


def read_cells_table(path: str | Path, axes_hint: Sequence[str] = ()) -> list[Combo]:
    """A CSV of already-measured cells (see the module doc). Speedups are against each source's first row unless
    its axis values match the study's baseline (set later by the caller)."""
    path = Path(path)
    try:
        reader = csv.DictReader(io.StringIO(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise StudyError(f"--from_table {path}: file not found") from None
    cols = [c.strip() for c in reader.fieldnames or []]
    value_col = "samples_per_s" if "samples_per_s" in cols else "throughput" if "throughput" in cols else None
    if value_col is None:
        raise StudyError(f"{path}: columns {cols}; expected a samples_per_s (or throughput) column")
    axes = [c for c in cols if c not in REPORT_COLUMNS + _MEASURED + ("peak_memory_kind",)]
    if not axes and "cell" in cols:
        axes = ["cell"]     # a report.csv of a study without axes: its one combination is named `all`
    if not axes:
        raise StudyError(f"{path}: no axis column besides {value_col} (expected e.g. dataloader_num_workers)")
    by: dict = {}
    for i, row in enumerate(reader, 2):
        row = {k.strip(): (v or "").strip() for k, v in row.items() if k}
        if not row[value_col] and row.get("runs") == "0":
            continue    # a report.csv's combination that has not run (its failures are in the study's report)
        try:
            value = float(row[value_col])
            acc = int(row["accelerators"]) if row.get("accelerators") else \
                round(value / float(row["per_accelerator"])) if row.get("per_accelerator") else None
        except (ValueError, ZeroDivisionError):
            raise StudyError(f"{path}:{i}: {value_col}={row[value_col]!r} accelerators={row.get('accelerators')!r}: "
                             "expected a number and an integer") from None
        if not (math.isfinite(value) and value > 0):
            raise StudyError(f"{path}:{i}: {value_col} = {value}: expected a positive number")
        source = row.get("source") or path.stem
        values = {a: _num(row[a]) for a in axes}
        c = by.setdefault((source, tuple(map(str, values.values()))), Combo(source, values, [], acc))
        c.samples += _repeats(row, value)
        c.extra.update({k: float(row[k]) for k in _MEASURED if row.get(k)})
        if row.get("peak_memory_kind"):
            c.extra["peak_memory_kind"] = row["peak_memory_kind"]
    if not by:
        raise StudyError(f"{path}: no rows")
    return list(by.values())


def _num(v: str):
    try:
        f = float(v)
        return int(f) if f.is_integer() and "." not in v else f
    except ValueError:
        return v


def _is_scaling_table(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        head = {c.strip() for c in next(csv.reader(f), [])}
    return {"nodes", "accelerators", "throughput"} <= head


# ---------------------------------------------------------------------------------------------- formatting

def _fmt(v, spec: str = ".2f") -> str:
    return "" if v is None else format(v, spec)


def _mb(v) -> str:
    return "" if v is None else f"{v / 2**20:.2f}"


def _pm(c: Combo, half) -> str:
    """The ± column: the interval's half-width, `one run` for one measurement, empty for none."""
    return "" if not c.samples else ("one run" if len(c.samples) == 1 else _fmt(half))


def combos_md(combos: list[Combo], axes: list[str], title: str) -> str:
    show_comms = any("grad_collectives_per_step" in c.extra for c in combos)
    show_mem = any("peak_memory_bytes" in c.extra for c in combos)
    axes = axes or ["cell"]
    head = [*axes, "samples/s", "± 95 %", "samples/s per accelerator", "speedup", "± 95 %", "n"]
    if show_comms:
        head += ["gradient collectives / step", "gradient MiB / step", "step time s"]
    if show_mem:
        kinds = {c.extra.get("peak_memory_kind") for c in combos} - {None}
        head += [f"peak memory MiB per rank ({', '.join(sorted(kinds))})"]
    out = [f"#### {title}", "", "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for c in combos:
        runs = f"{len(c.samples)}" + (f" (+{c.failed} failed)" if c.failed else "") + \
            (" (not run)" if not c.samples and not c.failed else "")
        base = c.extra.get("baseline")
        cells = [str(c.values.get(a, c.label() if a == "cell" else "")) for a in axes] + [
            _fmt(c.mean), _pm(c, c.half), _fmt(c.per_accelerator),
            (_fmt(c.speedup) + (" (baseline)" if base else "")) if c.speedup else "",
            "" if base else _pm(c, c.speedup_half), runs]
        if show_comms:
            cells += [_fmt(c.extra.get("grad_collectives_per_step"), ".1f"), _mb(c.extra.get("grad_bytes_per_step")),
                      _fmt(c.extra.get("step_time_s"), ".3f")]
        if show_mem:
            cells += [_mb(c.extra.get("peak_memory_bytes"))]
        out.append("| " + " | ".join(cells) + " |")
    out.append("\nsamples/s: the mean of n runs ± the half-width of its 95 % Student t interval; speedup ± from both "
               "means' intervals (ds_tools/intervals.py); one run has no interval.")
    return "\n".join(out)


BAR_IN = 0.36      # inches per bar: room for its rotated value label, whatever the number of cells


def bars_figure(sources: list[tuple[str, list[Combo]]], axes: list[str]):
    """Grouped bars: x = combinations of all axes but the last, one bar per value of the last axis (nodes last, so
    1- and 2-node cells stand side by side); whiskers: the 95 % interval; each bar's value and n written upright
    above it. One panel per source (our study, each table). The figure widens with the bars, so nothing overprints."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = [max(5.0, BAR_IN * len(c) * 1.25 + 2.0) for _, c in sources]
    fig, panels = plt.subplots(1, len(sources), figsize=(sum(widths), 4.8), squeeze=False,
                               gridspec_kw={"width_ratios": widths})
    for ax, (title, combos) in zip(panels[0], sources):
        ax_axes = [a for a in axes if any(a in c.values for c in combos)]
        hue = ax_axes[-1] if ax_axes else None
        groups = list(dict.fromkeys(tuple(str(c.values[a]) for a in ax_axes[:-1]) for c in combos))
        hues = list(dict.fromkeys(str(c.values[hue]) for c in combos)) if hue else [""]
        width = 0.8 / max(1, len(hues))
        top = max((c.mean + (c.half or 0) for c in combos if c.mean), default=1.0)
        for j, h in enumerate(hues):
            mine = [c for c in combos if (not hue or str(c.values[hue]) == h) and c.mean]
            xs = [groups.index(tuple(str(c.values[a]) for a in ax_axes[:-1])) + (j - (len(hues) - 1) / 2) * width
                  for c in mine]
            ax.bar(xs, [c.mean for c in mine], width, yerr=[c.half or 0 for c in mine], capsize=3,
                   label=f"{hue}={h}" if hue else None, color=f"C{j % 10}")
            for x, c in zip(xs, mine):
                ax.annotate(f"{c.mean:.1f} (n={len(c.samples)})", (x, c.mean + (c.half or 0) + 0.03 * top),
                            ha="center", va="bottom", rotation=90, fontsize=7)
        ax.set_ylim(0, top * 1.45)   # room for the upright labels
        ax.set_xticks(range(len(groups)))
        # tick labels carry values only (the axis names go to the x label); upright when many, so they never touch
        many = len(groups) > 4
        ax.set_xticklabels([(" / " if many else "\n").join(g) if g else "all" for g in groups], fontsize=8,
                           rotation=90 if many else 0)
        ax.set_xlabel(" / ".join(ax_axes[:-1]), fontsize=8)
        ax.set_ylabel("samples/s (whole job), 95 % interval")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        if hue:
            ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def plot_bars(sources: list[tuple[str, list[Combo]]], axes: list[str], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = bars_figure(sources, axes)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------- main

def report(study_dir: Path | None, tables: Sequence[str | Path] = (), out_dir: Path | None = None) -> dict:
    """Write report.md/.csv/.json and the charts; returns {"md": text, "files": [...], "json": data}."""
    study = load_study(study_dir / "study.toml") if study_dir else None
    out_dir = Path(out_dir or (study_dir / "report" if study_dir else Path("study_report")))
    out_dir.mkdir(parents=True, exist_ok=True)
    scaling_tables = [Path(t) for t in tables if _is_scaling_table(Path(t))]
    cell_tables = [Path(t) for t in tables if Path(t) not in scaling_tables]

    axes = list(study.axes) if study else []
    sources: list[tuple[str, list[Combo]]] = []
    data: dict = {"study": study.name if study else None, "cells": [], "combos": [], "scaling": []}
    md = [f"# Study report: {study.name if study else ', '.join(map(str, tables))}", ""]
    if study:
        rows = cell_rows(study, study_dir)
        data["cells"] = rows
        ok = [r for r in rows if r["status"] == "ok"]
        first = ok[0] if ok else {}
        md.append(f"Study `{study.path.name}` in `{study_dir}`: {len(ok)}/{len(rows)} cells ok; module "
                  f"`{study.module}`{f' preset `{study.preset}`' if study.preset else ''}, {study.steps} steps "
                  f"({study.warmup_steps} warm-up excluded), launcher {study.launcher}; model "
                  f"{first.get('model', '?')}, ZeRO {first.get('zero_stage', '?')}, micro batch "
                  f"{first.get('micro_batch', '?')}, {first.get('world_size', '?')} rank(s) per cell.")
        md.append("")
        combos = combos_of(study, rows)      # every study, a node-only one too: report.csv always has its cells
        sources.append((f"this study ({study.name})", combos))
        base = study.baseline_values()
        md.append(combos_md(combos, axes, "Throughput by cell (speedup against " +
                            (", ".join(f"{k}={v}" for k, v in base.items()) or "the fewest nodes") + ")"))
        md.append("")
        failed = [r for r in rows if r["status"] in ("failed", "timeout")]
        not_run = [r["cell"] for r in rows if r["status"] == "not run"]
        if not_run:
            md.append(f"_{len(not_run)} cell(s) not run yet (or running): {', '.join(not_run)}; "
                      "`ds-study run` resumes them._")
            md.append("")
        if failed:
            md.append("#### Cells that did not complete")
            md.append("")
            for r in failed:
                tail = [ln for ln in r.get("log_tail", "").splitlines() if ln.strip()][-1:] or [""]
                md.append(f"- `{r['cell']}`: {r['status']}" + (f", exit code {r['exit_code']}" if r["exit_code"]
                                                               is not None else "") + (f": `{tail[0][:160]}`"
                                                                                        if tail[0] else ""))
            md.append("")
    for t in cell_tables:
        combos = read_cells_table(t)
        for src in dict.fromkeys(c.source for c in combos):
            mine = [c for c in combos if c.source == src]
            _speedups(mine, study.baseline_values() if study else {})
            t_axes = list(dict.fromkeys(a for c in mine for a in c.values))
            sources.append((f"{src} (table)", mine))
            md.append(combos_md(mine, t_axes, f"Already measured: {src} ({t.name})"))
            md.append("")
            axes = axes or t_axes
    for title, combos in sources:
        for c in combos:
            data["combos"].append({"source": title, "cell": c.label(), **c.values, "samples_per_s": c.mean,
                                   "samples_per_s_half": c.half, "n": len(c.samples),
                                   "per_accelerator": c.per_accelerator, "speedup": c.speedup,
                                   "speedup_half": c.speedup_half, "runs": len(c.samples), "failed": c.failed,
                                   "repeats_samples_per_s": c.samples, **c.extra})
    files = []
    if any(c.mean for _, combos in sources for c in combos):
        png = out_dir / "throughput.png"
        plot_bars(sources, axes or [a for a in sources[0][1][0].values], png)
        files.append(png)
        md.append(f"![throughput]({png.name})")
        md.append("")

    runs = []
    if study and "nodes" in study.axes:
        runs = scaling.study_runs(study_dir)   # grouped by every other axis too (fabric, allreduce ...)
    for t in scaling_tables:
        runs += scaling.read_table(t)
    if runs:
        groups = scaling.group_runs(runs)
        md.append("#### Scaling over nodes (ds_tools.scaling)")
        md.append("")
        md.append(scaling.format_md(groups))
        png = out_dir / "scaling.png"
        scaling.plot(groups, png)
        files.append(png)
        md.append(f"![scaling]({png.name})")
        md.append("")
        data["scaling"] = json.loads(scaling.format_json(groups))
        (out_dir / "scaling.csv").write_text(scaling.format_csv(groups), encoding="utf-8")
        files.append(out_dir / "scaling.csv")

    text = "\n".join(md).rstrip() + "\n"
    (out_dir / "report.md").write_text(text, encoding="utf-8")
    (out_dir / "report.json").write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    buf = io.StringIO()
    keys = list(dict.fromkeys(k for row in data["combos"] for k in row if k != "other_collectives"))
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for row in data["combos"]:
        w.writerow({k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in row.items()})
    (out_dir / "report.csv").write_text(buf.getvalue(), encoding="utf-8")
    files = [out_dir / "report.md", out_dir / "report.csv", out_dir / "report.json", *files]
    return {"md": text, "files": files, "json": data}
