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

    @property
    def mean(self) -> float | None:
        return mean(self.samples) if self.samples else None

    @property
    def per_accelerator(self) -> float | None:
        return self.mean / self.accelerators if self.mean and self.accelerators else None

    @property
    def spread_pct(self) -> float | None:
        return 100 * (max(self.samples) / min(self.samples) - 1) if len(self.samples) > 1 else None


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
    """One row per cell of the study (planned order): status, throughput, comms, memory."""
    rows = []
    for cell in study.cells():
        d = cell_dir(out, cell)
        st = read_status(d)
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
    names = [n for n in study.axes if n != "nodes"] + (["nodes"] if "nodes" in study.axes else [])
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
    """Speedup of each combination against the baseline combination (same values on every non-node axis)."""
    def match(c: Combo) -> bool:
        return all(str(c.values.get(k)) == str(v) for k, v in baseline.items() if k in c.values)

    base = next((c for c in combos if match(c) and c.mean), None)
    if base is None:
        base = next((c for c in combos if c.mean), None)
    for c in combos:
        c.speedup = c.mean / base.mean if (base and c.mean) else None
        c.extra["baseline"] = c is base


# The columns report.csv writes besides the axes (report()), and those a table may carry that are not axes either.
REPORT_COLUMNS = ("samples_per_s", "throughput", "accelerators", "source", "note", "per_accelerator", "speedup",
                  "spread_pct", "runs", "failed", "repeats_samples_per_s", "baseline", "other_collectives")
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
    if not axes:
        raise StudyError(f"{path}: no axis column besides {value_col} (expected e.g. dataloader_num_workers)")
    by: dict = {}
    for i, row in enumerate(reader, 2):
        row = {k.strip(): (v or "").strip() for k, v in row.items() if k}
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


def combos_md(combos: list[Combo], axes: list[str], title: str) -> str:
    show_comms = any("grad_collectives_per_step" in c.extra for c in combos)
    show_mem = any("peak_memory_bytes" in c.extra for c in combos)
    head = [*axes, "samples/s", "samples/s per accelerator", "speedup", "spread over repeats %", "runs"]
    if show_comms:
        head += ["gradient collectives / step", "gradient MiB / step", "step time s"]
    if show_mem:
        kinds = {c.extra.get("peak_memory_kind") for c in combos} - {None}
        head += [f"peak memory MiB per rank ({', '.join(sorted(kinds))})"]
    out = [f"#### {title}", "", "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for c in combos:
        runs = f"{len(c.samples)}" + (f" (+{c.failed} failed)" if c.failed else "") + \
            (" (not run)" if not c.samples and not c.failed else "")
        cells = [str(c.values.get(a, "")) for a in axes] + [
            _fmt(c.mean), _fmt(c.per_accelerator), (_fmt(c.speedup) + (" (baseline)" if c.extra.get("baseline")
                                                                        else "")) if c.speedup else "",
            _fmt(c.spread_pct, ".1f"), runs]
        if show_comms:
            cells += [_fmt(c.extra.get("grad_collectives_per_step"), ".1f"), _mb(c.extra.get("grad_bytes_per_step")),
                      _fmt(c.extra.get("step_time_s"), ".3f")]
        if show_mem:
            cells += [_mb(c.extra.get("peak_memory_bytes"))]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot_bars(sources: list[tuple[str, list[Combo]]], axes: list[str], path: Path) -> None:
    """Grouped bars: x = combinations of all axes but the last, one bar per value of the last axis; whiskers span
    the repeats' min..max. One panel per source (our study, each table)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width_in = max(6.0, 1.1 * max(len(c) for _, c in sources) / 2 + 3)
    fig, panels = plt.subplots(1, len(sources), figsize=(width_in * len(sources), 4.4), squeeze=False)
    for ax, (title, combos) in zip(panels[0], sources):
        ax_axes = [a for a in axes if any(a in c.values for c in combos)]
        hue = ax_axes[-1] if ax_axes else None
        groups = list(dict.fromkeys(tuple(str(c.values[a]) for a in ax_axes[:-1]) for c in combos))
        hues = list(dict.fromkeys(str(c.values[hue]) for c in combos)) if hue else [""]
        width = 0.8 / max(1, len(hues))
        for j, h in enumerate(hues):
            xs, ys, lo, hi = [], [], [], []
            for c in combos:
                if hue and str(c.values[hue]) != h or not c.mean:
                    continue
                g = tuple(str(c.values[a]) for a in ax_axes[:-1])
                xs.append(groups.index(g) + (j - (len(hues) - 1) / 2) * width)
                ys.append(c.mean)
                lo.append(c.mean - min(c.samples))
                hi.append(max(c.samples) - c.mean)
            bars = ax.bar(xs, ys, width, yerr=[lo, hi] if any(lo + hi) else None, capsize=3,
                          label=f"{hue}={h}" if hue else None, color=f"C{j % 10}")
            for b, c_y in zip(bars, ys):
                ax.annotate(f"{c_y:.1f}", (b.get_x() + b.get_width() / 2, c_y), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(groups)))
        # tick labels carry values only (the axis names go to the x label) so that six groups still fit
        ax.set_xticklabels(["\n".join(g) if g else "all" for g in groups], fontsize=8)
        ax.set_xlabel(" / ".join(ax_axes[:-1]), fontsize=8)
        ax.set_ylabel("samples/s (whole job)")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        if hue:
            ax.legend(fontsize=7)
    fig.tight_layout()
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

    axes = [n for n in study.axes if n != "nodes"] if study else []
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
        if axes:
            combos = combos_of(study, rows)
            sources.append((f"this study ({study.name})", combos))
            base = study.baseline_values()
            md.append(combos_md(combos, axes + (["nodes"] if "nodes" in study.axes else []),
                                "Throughput by cell (speedup against " +
                                ", ".join(f"{k}={v}" for k, v in base.items()) + ")"))
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
            data["combos"].append({"source": title, **c.values, "samples_per_s": c.mean,
                                   "per_accelerator": c.per_accelerator, "speedup": c.speedup,
                                   "spread_pct": c.spread_pct, "runs": len(c.samples), "failed": c.failed,
                                   "repeats_samples_per_s": c.samples, **c.extra})
    files = []
    if sources:
        png = out_dir / "throughput.png"
        plot_bars(sources, axes or [a for a in sources[0][1][0].values], png)
        files.append(png)
        md.append(f"![throughput]({png.name})")
        md.append("")

    runs = []
    if study and "nodes" in study.axes:
        runs = scaling.read_runs([cell_dir(study_dir, c) for c in study.cells()
                                  if read_status(cell_dir(study_dir, c)) and
                                  read_status(cell_dir(study_dir, c)).get("status") == "ok"])
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
