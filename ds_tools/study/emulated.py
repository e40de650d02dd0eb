"""Predicted vs measured on emulated fabrics: for every fabric of a finished `launcher = "emulated_fabric"` study,
the fastest 1-node cell (of any fabric: it sends nothing over its link) is the measured run `ds-scaling-report predict`
starts from, and each larger cell is compared with its prediction: exposed communication per optimizer step and
scaling efficiency, side by side.

    python -m ds_tools.study.emulated runs/studies/emulated_fabrics [--format md|json]

The model's inputs are measured, none fitted to the runs it predicts: the link's bus bandwidth (its one efficiency
factor = bandwidth / tbf rate) and per-call cost from the link probe that ran over that link just before the cell
(ds_tools.study.linkprobe, link_probe.json), the collective calls per step from DeepSpeed's code and the 1-node run
(parameter groups, scalar all-reduces counted by DeepSpeed's comms logger), the compute from the 1-node run.

Measured exposed communication: the run's sampled phase timing (`phase_comm_s`, ds_core.outputs.phases) where the run
has it; otherwise DeepSpeed's comms logger, or the growth of the step over the 1-node cell; the table says which. Of
repeated cells the fastest is compared (the least disturbed on a shared machine); the last column gives the
efficiency of the means of all repeats with its 95 % interval and n (ds_tools.intervals). Beside the raw efficiency, a
compute-matched one: the emulated nodes share the host's CPUs (with each other and any other load), so compute per
rank differs between cells, which no network model predicts; it takes the baseline's compute plus the cell's
measured non-compute time. Targets: efficiency within 5 points, communication within 25 %.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

from ds_core.cli import ArgumentParser, cli_main
from ds_tools import fabrics, predict, scaling_explain as explain
from ds_tools.intervals import Estimate, mean_interval, ratio_interval
from ds_tools.study.runner import read_summary
from ds_tools.study.spec import StudyError, load_study

EFFICIENCY_POINTS, COMM_REL = 5.0, 0.25
VETH_LATENCY_US = 30.0     # a veth + bridge hop without netem: tens of microseconds (kernel forwarding)


def _cells(out: Path) -> list[dict]:
    res = []
    root = out / "cells" if (out / "cells").is_dir() else out     # runner.cell_dir: OUT/cells/<cell key>
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        cell, summary = d / "cell.json", read_summary(d)
        if not cell.is_file() or summary is None:
            continue
        rec = json.loads(cell.read_text())
        if rec.get("status") != "ok":
            continue
        stats = d / "cell_stats" / "rank0.json"
        st = json.loads(stats.read_text()) if stats.is_file() else {}
        params = st.get("params")
        fab = json.loads((d / "fabric.json").read_text()) if (d / "fabric.json").is_file() else {}
        probe = json.loads((d / "link_probe.json").read_text()) if (d / "link_probe.json").is_file() else {}
        res.append({"dir": d, "values": rec["values"], "summary": summary, "params": params, "fabric": fab,
                    "comms": st.get("comms") or {}, "param_groups": st.get("param_groups"), "probe": probe})
    return res


def small_calls(cell: dict, grad_bytes: float) -> int:
    """Scalar all-reduces per optimizer step besides the gradient's, counted by DeepSpeed's comms logger in a run
    (the 1-node baseline issues them too: DeepSpeed calls its collectives at world size 1)."""
    steps = max(1, int(cell["summary"].get("steps") or 1))
    n = 0
    for kind, rec in cell["comms"].items():
        if "all_reduce" in kind:
            n += sum(c for size, c in rec.get("sizes", {}).items() if float(size) != grad_bytes)
    return round(n / steps)


def call_cost_us(probe: dict, lat_us: float) -> float | None:
    """The per-call cost the model adds to each collective: the probe's tiny all-reduce, less the ring latency the
    model already charges for it (2 steps of lat_us between 2 nodes); None without a probe."""
    if "alpha_all_reduce_s" not in probe:
        return None
    return max(0.0, probe["alpha_all_reduce_s"] * 1e6 - 2 * lat_us)


def _compute(s: dict) -> float:
    """Forward + backward + optimizer step per sampled step (phase timing), 0 without it."""
    return sum(float(s.get(f"phase_{k}_s") or 0) for k in ("forward", "backward", "step"))


def _compute_frac(s: dict) -> float:
    """Share of the sampled step in data, forward, backward and the optimizer step (phase timing)."""
    ph = explain.phases_of(s) or {}
    total = sum(ph.values())
    return sum(ph.get(f"phase_{k}_s", 0.0) for k in ("data", "forward", "backward", "step")) / total if total else 1.0


def step_s(s: dict) -> float:
    return s["micro_batch"] * s["grad_accum"] * s["world_size"] / s["samples_per_s"]


def compare(out: str | Path, efficiency: float | None = None) -> list[dict]:
    """Predicted vs measured per fabric and node count. `efficiency` is the emulated fabric's one factor (achieved
    bus bandwidth / tbf rate); None: measured by the cell's link probe (its bus bandwidth / the tbf rate), 1.0 where
    the cell has no probe; a number: that factor for every cell (1.0 = the line rate)."""
    out = Path(out)
    study = load_study(out / "study.toml")
    if study.launcher != "emulated_fabric":
        raise StudyError(f"{out}: study launcher is {study.launcher!r}, not \"emulated_fabric\"")
    rows = []
    cells = _cells(out)
    # A 1-node cell sends nothing over its link, so every fabric's 1-node cells are repeats of one run: the fastest
    # of them all is the baseline (the least slowed by other work on a shared machine).
    ones = [c for c in cells if int(c["summary"].get("nodes") or 1) == 1]
    if not ones:
        raise StudyError(f"{out}: no finished 1-node cell to predict from")
    b = max(ones, key=lambda c: c["summary"]["samples_per_s"])
    for name, link in study.fabrics.items():
        # repeats: the fastest of each node count, i.e. the one least slowed by other work on a shared machine
        best: dict = {}
        for c in cells:
            if str(c["values"].get("fabric", name)) != name:
                continue
            n = int(c["summary"].get("nodes") or 1)
            if n not in best or c["summary"]["samples_per_s"] > best[n]["summary"]["samples_per_s"]:
                best[n] = c
        mine = [best[n] for n in sorted(best) if n > 1]
        s0 = b["summary"]
        if not b["params"]:
            raise StudyError(f"{b['dir']}: cell_stats/rank0.json has no parameter count (cell run before it was "
                             "recorded?); rerun the cell")
        latency_ok = all(c["fabric"].get("latency_emulated", True) for c in mine)
        lat_us = link["delay_ms"] * 1000 if latency_ok else VETH_LATENCY_US
        m = predict.Measured(nodes=1, per_node=int(s0["accelerators_per_node"]), seq_per_s=s0["samples_per_s"],
                             grad_accum=int(s0["grad_accum"]), phases=explain.phases_of(s0))
        for c in mine:
            s = c["summary"]
            n = int(s.get("nodes") or 1)
            if n == 1:
                continue
            prec = str(s0["precision"])
            grad = predict.collectives(int(s0["zero_stage"]), prec, int(b["params"]), 1)[0]
            nsmall = small_calls(b, grad.nbytes)
            groups = int(b["param_groups"] or 1)
            call_us = call_cost_us(c["probe"], lat_us)
            eff, eff_from = efficiency, "given"
            if eff is None:
                eff, eff_from = 1.0, "line rate (no link probe)"
                if c["probe"].get("busbw_Bps"):
                    eff = c["probe"]["busbw_Bps"] / (link["mbit"] * 1e6 / 8)
                    eff_from = (f"link probe: {c['probe']['big_nbytes'] / 1e6:.2f} MB all_reduce bus bandwidth "
                                f"{c['probe']['busbw_Bps'] * 8 / 1e6:.1f} Mbit/s / tbf rate")
            # one rank per node: the intra-node term is empty; the link's bandwidth and per-call cost as the link
            # probe measured them over this very link just before the cell trained
            fab = fabrics.custom(intra_gbps=1e6, inter_gbps=link["mbit"] / 1000, latency_us=lat_us,
                                 efficiency=eff, call_us=call_us or 0.0)
            p = predict.predict(m, fab, params=int(b["params"]), stage=int(s0["zero_stage"]), precision=prec,
                                micro=int(s0["micro_batch"]), nodes=[n], param_groups=groups,
                                small_calls=nsmall)["rows"][0]
            ph = explain.phases_of(s)
            if ph:
                meas_comm = step_s(s) * ph["phase_comm_s"] / sum(ph.values())
                how = "phase timing"
            elif c["comms"]:
                # DeepSpeed's comms logger (study comms_logger = true): wall time of every collective of the
                # training loop on rank 0, per optimizer step (on CPU the collectives are synchronous)
                meas_comm = sum(v["latency_ms"] for v in c["comms"].values()) / 1000 / max(1, int(s["steps"]))
                how = "DeepSpeed comms logger"
            else:
                meas_comm = step_s(s) - step_s(s0)
                how = "step growth over 1 node"
            meas_eff = (s["samples_per_s"] / s["world_size"]) / (s0["samples_per_s"] / s0["world_size"])
            mean_eff = _mean_efficiency(cells, ones, name, n)
            # the same, had this cell's ranks computed as fast as the baseline's (the emulated nodes share the host's
            # CPUs with any other load: compute per rank varies between cells, which no network model predicts): the
            # baseline's compute plus this cell's measured non-compute time (exposed comm, wait, timing overhead)
            matched = None
            if ph and explain.phases_of(s0):
                c0, cn = step_s(s0) * _compute_frac(s0), step_s(s) * _compute_frac(s)
                matched = step_s(s0) / (c0 + step_s(s) - cn)
            rows.append({"fabric": name, "efficiency_factor": eff, "efficiency_factor_from": eff_from,
                         "mbit": link["mbit"], "delay_ms": link["delay_ms"],
                         "latency_emulated": latency_ok, "nodes": n, "params": b["params"],
                         "call_us": call_us, "call_us_from": "link probe (ds_tools.study.linkprobe): median tiny "
                         "all_reduce %.3f ms less 2 x %.0f us ring latency" % (1e3 * c["probe"]["alpha_all_reduce_s"],
                                                                               lat_us) if call_us is not None
                         else "not measured (no link_probe.json): 0", "small_calls": nsmall, "param_groups": groups,
                         "compute_growth": _compute(s) / _compute(s0) if _compute(s0) else None,
                         "measured_step_s": step_s(s), "predicted_step_s": p["step_s"],
                         "measured_comm_s": meas_comm, "predicted_comm_s": p["exposed_comm_s"], "comm_from": how,
                         "measured_efficiency": meas_eff, "predicted_efficiency": p["efficiency"],
                         "measured_efficiency_mean": mean_eff.value, "measured_efficiency_half": mean_eff.half,
                         "measured_efficiency_n": mean_eff.n, "baseline_n": len(ones),
                         "efficiency_error_points": 100 * (p["efficiency"] - meas_eff),
                         "measured_efficiency_matched": matched,
                         "matched_error_points": None if matched is None else 100 * (p["efficiency"] - matched),
                         "comm_error_rel": (p["exposed_comm_s"] - meas_comm) / meas_comm if meas_comm > 0 else None})
    return rows


def _mean_efficiency(cells: list, ones: list, fabric: str, nodes: int) -> Estimate:
    """Efficiency of the mean of every repeat of (fabric, nodes) against the mean of every 1-node cell, with its 95 %
    interval (ds_tools.intervals): beside the fastest-run comparison, how far repeats of the study agree."""
    def per_acc(c: dict) -> float:
        return c["summary"]["samples_per_s"] / c["summary"]["world_size"]

    mine = [per_acc(c) for c in cells if str(c["values"].get("fabric", fabric)) == fabric
            and int(c["summary"].get("nodes") or 1) == nodes]
    eff = ratio_interval(mean_interval(mine), mean_interval([per_acc(c) for c in ones]))
    return Estimate(eff.value, eff.half, len(mine), eff.df, eff.se)


def calibrate(out: str | Path, fabric: str) -> float:
    """The one factor of the emulated fabric, from one of its links: modelled (at line rate) / measured exposed
    communication of that link's largest run. Check it on the other links, never on the one it came from."""
    rows = [r for r in compare(out, 1.0) if r["fabric"] == fabric]
    if not rows or not rows[-1]["measured_comm_s"] > 0:
        raise StudyError(f"{out}: no multi-node cell with measured communication for fabric {fabric!r}")
    return round(rows[-1]["predicted_comm_s"] / rows[-1]["measured_comm_s"], 3)


def format_md(rows: Sequence[dict]) -> str:
    out = ["| fabric | link | nodes | exposed comm s/step measured | predicted | error % | efficiency % measured | "
           "predicted | error points | efficiency % measured, compute-matched | error points | compute x 1-node | "
           "per-call cost us | bandwidth factor | collective calls/step | efficiency % of the means ± 95 % (n) |",
           "|:---|:---|" + "---:|" * 14]
    for r in rows:
        link = f"{r['mbit']:g} Mbit/s, {r['delay_ms']:g} ms" + ("" if r["latency_emulated"] else " (no netem)")
        err = "n/a" if r["comm_error_rel"] is None else f"{100 * r['comm_error_rel']:+.1f}"
        call = "n/a" if r["call_us"] is None else f"{r['call_us']:.0f}"
        growth = "n/a" if not r.get("compute_growth") else f"{r['compute_growth']:.2f}"
        m = r.get("measured_efficiency_matched")
        matched = "n/a | n/a" if m is None else f"{100 * m:.2f} | {r['matched_error_points']:+.2f}"
        out.append(f"| {r['fabric']} | {link} | {r['nodes']} | {r['measured_comm_s']:.4f} | "
                   f"{r['predicted_comm_s']:.4f} | {err} | {100 * r['measured_efficiency']:.2f} | "
                   f"{100 * r['predicted_efficiency']:.2f} | {r['efficiency_error_points']:+.2f} | {matched} | "
                   f"{growth} | {call} | {r['efficiency_factor']:.3f} | {1 + r['small_calls'] + r['param_groups']} | "
                   f"{_eff_text(r)} |")
    out.append(f"\nTargets: efficiency within {EFFICIENCY_POINTS:g} points, exposed communication within "
               f"{100 * COMM_REL:g} %. Model: ds_tools.predict (DeepSpeed's collectives for the stage, ring "
               "alpha-beta); exposed communication measured by " + ", ".join(sorted({r["comm_from"] for r in rows}))
               + ". Link inputs, measured by ds_tools.study.linkprobe over each cell's link just before it trained: "
               + "; ".join(f"{r['fabric']}: per-call cost = {r['call_us_from']}; bandwidth factor = "
                           f"{r['efficiency_factor_from']}" for r in rows)
               + ". Collective calls per step: the gradient all-reduce, one parameter all-gather per optimizer "
               "parameter group, and the scalar all-reduces counted in the 1-node run. Compute x 1-node: data + "
               "forward + backward + optimizer step of the cell over the baseline's (phase timing; the model "
               "assumes 1.00, as on real nodes); compute-matched efficiency: the baseline's compute plus the cell's "
               "measured non-compute time (exposed comm, slowest-rank wait, phase-timing overhead).")
    return "\n".join(out)


def _eff_text(r: dict) -> str:
    half = r.get("measured_efficiency_half")
    return (f"{100 * r['measured_efficiency_mean']:.2f} " + ("(one run)" if half is None else f"± {100 * half:.2f}")
            + f" (n={r['measured_efficiency_n']}; 1 node n={r['baseline_n']})")


def main(argv: Sequence[str] | None = None) -> int:
    def build_parser() -> ArgumentParser:
        p = ArgumentParser(allow_abbrev=False, prog="python -m ds_tools.study.emulated",
                           description=__doc__.split("\n\n")[0])
        p.add_argument("out", help="the study's output directory")
        p.add_argument("--format", choices=("md", "json"), default="md")
        p.add_argument("--efficiency", type=float, help="the emulated fabric's factor (default: measured by each "
                       "cell's link probe)")
        p.add_argument("--calibrate_on", metavar="FABRIC", help="fit the factor on this fabric's run, then compare all")
        return p

    def body(a) -> int:
        eff = a.efficiency
        if a.calibrate_on:
            eff = calibrate(a.out, a.calibrate_on)
            print(f"efficiency factor {eff} calibrated on fabric {a.calibrate_on!r} (check it on the others)")
        rows = compare(a.out, eff)
        print(format_md(rows) if a.format == "md" else json.dumps(rows, indent=2))
        return 0

    return cli_main(argv, build_parser, body, (StudyError, OSError, predict.PredictError))


if __name__ == "__main__":
    sys.exit(main())
