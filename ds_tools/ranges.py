"""The figures a prediction prints and the range each carries, for `ds-scaling-report predict` and ds-tune.

A prediction on a fabric that published tables calibrate (ds_tools.calibration) is evaluated

  * at the central terms: the fitted sum w of the intra- and inter-node terms split at equal factors of their line
    rates, or, where the measured 1-node run timed its own communication (phase timing, a stage that reduces after
    the backward: ZeRO-0/1), the intra-node term from that timing and the inter-node term as w less it;
  * at every corner of what the fit leaves open (the lowest and highest w of the tables' and plausible settings'
    fits, each split at either line rate), which gives the parameter range;

and the range printed is, by case:

  * in-sample: the query is a calibration table's own case (model, ZeRO stage, gradient bytes, batch schedule, at a
    node count it was fitted on): the parameter range widened by the 95 % prediction interval of the fit's
    residuals, labelled in-sample;
  * otherwise: the parameter range widened by the margin of the fabric's out-of-sample errors at that node count,
    growing per doubling beyond the calibrated node counts (ds_tools.validation), labelled a margin;
  * a fabric no published table calibrates (a system given by line rates, a custom one, factors given on the command
    line): no range, and the output says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ds_tools import calibration as cal_, fabrics, published as pub, validation
from ds_tools.comm_model import BYTES, Measured, comm_seconds, predict


@dataclass(frozen=True)
class Terms:
    central: fabrics.Fabric
    corners: tuple
    cal: cal_.Calibration | None
    intra_from: str
    notes: tuple = field(default=())


def _intra_from_timing(m: Measured, fab: fabrics.Fabric, colls) -> tuple | None:
    """(the exposed share of the measured 1-node step, (its collectives' seconds with the intra term at line rate,
    at twice that, y at line rate)): what the run's own timing says of the intra-node term; None where it has none
    to give (no phase timing, more than one node, one accelerator per node)."""
    if not m.phases or m.nodes != 1 or m.per_node < 2:
        return None
    total = sum(m.phases.values())
    if total <= 0 or m.phases["phase_comm_s"] <= 0:
        return None
    yl, xl = cal_.line_terms(fab)
    c_line = comm_seconds(colls, cal_.fabric_at(fab, yl, xl), m.per_node, 1)
    c_two = comm_seconds(colls, cal_.fabric_at(fab, 2 * yl, xl), m.per_node, 1)
    if c_two <= c_line:
        return None
    return m.phases["phase_comm_s"] / total, (c_line, c_two, yl)


def terms(fab: fabrics.Fabric, m: Measured | None = None, colls=None, step_s: float | None = None,
          timed: bool = True) -> Terms:
    """The central and corner fabrics of a query on fab (no corners: uncalibrated). With the measured run (m, its
    collectives, its step): its own exposed communication sets the intra-node term where `timed` (a stage that
    reduces after the backward), and no corner communicates longer than its step."""
    cal = cal_.calibration(fab.name) if fabrics.FABRICS.get(fab.name) == fab else None
    if cal is None:
        return Terms(fab, (), None, "")
    mid = cal.central()
    corners = cal.corners()
    how = (f"central: w split at equal factors of the line rates (intra {cal_.line_terms(fab)[0] / mid.y:.3f}, "
           f"inter {cal_.line_terms(fab)[1] / mid.x:.3f})")
    timing = _intra_from_timing(m, fab, colls) if (timed and m is not None and colls is not None and step_s) else None
    notes = []
    if timing:
        share, (c_line, c_two, yl) = timing
        exposed = share * step_s
        y = yl * (1 + (exposed - c_line) / (c_two - c_line))
        if y < yl:
            notes.append(f"the run's exposed communication ({exposed:.4f} s) is below the intra-node line rate's "
                         f"({c_line:.4f} s): the intra-node term is taken at line rate")
            y = yl
        xl = cal_.line_terms(fab)[1]
        a = cal.per_node
        corners = [cal_.Split(w, a, min(1 - xl / w, (a - 1) / a * y / w)) for w in sorted(set((*cal.w_range, cal.w)))]
        mid = cal_.Split(cal.w, a, min(1 - xl / cal.w, (a - 1) / a * y / cal.w))
        how = (f"intra-node term from the measured run's own communication timing ({exposed:.4f} s exposed at 1 "
               f"node: intra factor {yl / y:.3f}); inter-node term w less it")
    if m is not None and colls is not None and step_s:
        corners, clipped = _bounded(corners, mid, fab, m, colls, step_s)
        if clipped:
            notes.append(f"{clipped} corner(s) of the range bounded by the measured step: a split whose modelled "
                         f"communication at the measured scale would exceed the measured {step_s:.3f} s step is "
                         "not one the run can have had")
    central = cal_.fabric_at(fab, mid.y, mid.x, on=cal.fabric)
    return Terms(central, tuple(cal_.fabric_at(fab, s.y, s.x, on=cal.fabric) for s in corners), cal, how,
                 tuple(notes))


def _bounded(corners: list, mid: cal_.Split, fab: fabrics.Fabric, m: Measured, colls, step_s: float) -> tuple:
    """Corners moved toward the central split until their communication at the measured scale fits in 99 % of the
    measured step (bisection on the split), and how many had to move."""
    def comm(sp: cal_.Split) -> float:
        return comm_seconds(colls, cal_.fabric_at(fab, sp.y, sp.x), m.per_node, m.nodes)

    out, moved = [], 0
    for sp in corners:
        if comm(sp) <= 0.99 * step_s or comm(mid) > 0.99 * step_s:
            out.append(sp)
            continue
        lo, hi = mid.phi, sp.phi           # lo fits, hi does not
        for _ in range(40):
            half = (lo + hi) / 2
            lo, hi = (half, hi) if comm(cal_.Split(sp.w, sp.per_node, half)) <= 0.99 * step_s else (lo, half)
        out.append(cal_.Split(sp.w, sp.per_node, lo))
        moved += 1
    return out, moved


def _in_sample(cal: cal_.Calibration, *, model: str | None, stage: int, precision: str, global_batch: int | None,
               grad_accum: int, micro: int, per_node: int, nodes: int) -> bool:
    """Whether the query is one of the calibration's own cases."""
    for key in cal.tables:
        t = pub.BY_KEY[key]
        st = t.setting("stage").value
        schedules = t.setting("schedule").values
        same_sched = any((k == "global" and global_batch == b) or (k == "per_accelerator" and not global_batch
                                                                    and micro * grad_accum == b)
                         for k, b in schedules)
        if (model == t.model and (st == stage or (st == "no ZeRO (DDP)" and stage == 0))
                and BYTES.get(precision) in t.setting("grad_bytes").values and same_sched
                and per_node == t.per_node and nodes in cal.nodes[key]):
            return True
    return False


def unpredictable(fab: fabrics.Fabric, *, model: str | None, precision: str, seq_len: int | None) -> str:
    """Why a query is of the kind of a published table the model does not account for (ds_tools.published
    `unexplained`: the same fabric, model, gradient bytes and sequence length), or "" where it is not."""
    if model is None or fabrics.FABRICS.get(fab.name) != fab:
        return ""
    for t in pub.on_fabric(fab.name):
        if (t.unexplained is not None and t.model == model and seq_len == t.seq_len
                and BYTES.get(precision) in t.setting("grad_bytes").values):
            why = next((x.text() for x in cal_.siblings(fab.name) if x.table == t.key), t.key)
            return (f"a run like {t.key} ({t.model}, sequence length {t.seq_len}, {BYTES[precision]}-byte gradients "
                    f"on {fab.name}) is not predictable from the published tables: {why}; "
                    f"{t.unexplained.differs}")
    return ""


def ranged(m: Measured, fab: fabrics.Fabric, *, params: int, stage: int, precision: str, micro: int,
           nodes: Sequence[int], global_batch: int | None = None, model: str | None = None,
           seq_len: int | None = None, **calls) -> dict:
    """predict() at the central terms, each row with its range (`range_kind`: in-sample, margin, none, or not
    predictable: a query of the kind of a published table the model does not account for)."""
    from ds_tools.comm_model import collectives

    colls = collectives(stage, precision, params, m.grad_accum, **calls)
    step0 = micro * m.grad_accum * m.nodes * m.per_node / m.seq_per_s
    tm = terms(fab, m, colls, step0, timed=stage in (0, 1))   # the run's timing is the intra term at ZeRO-0/1 only
    kw = dict(params=params, stage=stage, precision=precision, micro=micro, nodes=list(nodes),
              global_batch=global_batch, **calls)
    res = predict(m, tm.central, **kw)
    res["intra_from"] = tm.intra_from
    res["calibration"] = None if tm.cal is None else tm.cal.describe()
    res["terms_notes"] = list(tm.notes)
    corner_rows = [predict(m, f, **kw)["rows"] for f in tm.corners]
    margin = validation.margin(fab.name) if tm.cal else None
    half_in = cal_.in_sample_half(tm.cal) if tm.cal else None
    res["unpredictable"] = unpredictable(fab, model=model, precision=precision, seq_len=seq_len) if tm.cal else ""
    for i, r in enumerate(res["rows"]):
        effs = [r["efficiency"]] + [rows[i]["efficiency"] for rows in corner_rows]
        r["param_low"], r["param_high"] = min(effs), max(effs)
        r["doublings"] = tm.cal.doublings(r["nodes"]) if tm.cal else None
        if tm.cal is None or r["nodes"] == m.nodes:
            r["range_kind"], r["range_points"] = ("measured" if tm.cal else "none"), None
            lo = hi = None
        elif res["unpredictable"]:
            r["range_kind"], r["range_points"] = "not predictable", None
            lo = hi = None
        elif _in_sample(tm.cal, model=model, stage=stage, precision=precision, global_batch=global_batch,
                        grad_accum=m.grad_accum, micro=micro, per_node=m.per_node, nodes=r["nodes"]):
            r["range_kind"], r["range_points"] = "in-sample 95 % interval", half_in
            lo, hi = r["param_low"] - half_in / 100, r["param_high"] + half_in / 100
        else:
            h = margin.at(r["nodes"], r["doublings"]) if margin else 0.0
            r["range_kind"], r["range_points"] = "margin", h
            lo, hi = r["param_low"] - h / 100, r["param_high"] + h / 100
        r["efficiency_low"], r["efficiency_high"] = lo, hi
        scale = r["seq_per_s"] / r["efficiency"]
        r["seq_per_s_low"] = None if lo is None else max(0.0, lo) * scale
        r["seq_per_s_high"] = None if hi is None else hi * scale
        r["extrapolated"] = bool(r["doublings"])
    res["margin"] = margin.text() if margin else None
    return res
