"""Out-of-sample validation of ds_tools.calibration, and the margins it gives predictions.

Cases, none predicted by a fit that saw it:
  * leave-one-table-out: each published table of a fabric with two or more, predicted from its own 1-node figure by
    the fit on the fabric's other tables;
  * leave-one-node-count-out: each node count of a table, predicted by the fit on that table's other node counts;
    a node count above every one fitted is an extrapolation by d = log2(N / the largest fitted) doublings;
  * extrapolation: each table fitted on its node counts up to M only, every larger one predicted (d = log2(N / M)).

  * across models and schedules: each published point (ds_tools.published.POINTS: one efficiency, no 1-node
    figure readable here) predicted by the fit on its fabric's tables, its 1-node step over the range its compute
    can have (another table's 1-node compute per sequence scaled by 6 x parameters x tokens, at that table's MFU or
    any in the range the published 1-node figures imply, ds_tools.compute_rate.mfu_range).

A table whose record says its loss is mostly not its collectives' (`unexplained`, checked by
ds_tools.calibration.siblings) is left out of every fit of other tables; its own leave-one-table-out cases are
printed with their error and no range: it is not predictable from the others, and the range printed for a
prediction of its kind says so (ds_tools.ranges). Its leave-one-node-count-out and extrapolation cases (fits on
itself) are judged like any other.

For each case: the published efficiency, the central prediction and its error (points), and the prediction's
parameter range (the split of w the fit leaves open: ds_tools.calibration). The margin of a fabric is
margin(d) = m0 + m1 d (points): m0 the largest |error| of the cases inside their fit's node range (d = 0), m1 the
largest (|error| - m0) / d of the extrapolated ones, both from that fabric's cases with a range. A printed range
is the parameter range widened by the margin of the other cases; it covers a case when the published value lies
inside it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ds_tools import calibration as cal_, fabrics, published as pub, validation_points as points


@dataclass(frozen=True)
class Case:
    kind: str                 # leave-one-table-out | leave-one-node-count-out | extrapolation
    table: str
    nodes: int
    fitted_on: str
    doublings: float          # 0: inside the fitted node range
    published: float          # efficiency, fraction
    central: float
    low: float                # the parameter range (every split of w, every plausible setting)
    high: float
    no_range: str = ""        # why the case carries no range (a table not predictable from the others)
    note: str = ""            # what else the range spans (a point's 1-node range)

    @property
    def error_points(self) -> float:
        return 100 * (self.central - self.published)


def evaluate(t: pub.PublishedTable, n: int, c: cal_.Calibration) -> tuple:
    """(central, low, high) efficiency of table t at n nodes from its 1-node figure: central at the calibration's
    central w and split (the mean over t's plausible variants), low/high over every corner and variant."""
    fab = fabrics.FABRICS[t.fabric]
    vs = cal_.variants(t)
    mid = c.central()
    central = [cal_.table_rows(t, cal_.fabric_at(fab, mid.y, mid.x), v, [1, n])[1]["efficiency"] for v in vs]
    every = [cal_.table_rows(t, cal_.fabric_at(fab, sp.y, sp.x), v, [1, n])[1]["efficiency"]
             for sp in c.corners() for v in vs]
    return sum(central) / len(central), min(every + central), max(every + central)


def _predict_case(kind: str, t: pub.PublishedTable, n: int, c: cal_.Calibration, fitted_on: str) -> Case:
    central, low, high = evaluate(t, n, c)
    d = c.doublings(n)
    return Case(kind, t.key, n, fitted_on, d, cal_.efficiency_of(t, n), central, low, high)


def _point_case(p: pub.PublishedPoint, c: cal_.Calibration) -> Case:
    central, low, high, note = points.evaluate(p, c)
    return Case("across models and schedules", p.key, p.nodes, "; ".join(c.tables), c.doublings(p.nodes), p.efficiency,
                central, low, high, note=note)


@lru_cache(maxsize=None)
def cases(fabric: str) -> tuple:
    tables = pub.on_fabric(fabric)
    out = []
    if len(tables) > 1:
        for t in tables:
            c = cal_.fit(fabric, cal_.modelled([o for o in tables if o.key != t.key]))
            if c is None:
                continue
            on = "; ".join(c.tables)
            cs = [_predict_case("leave-one-table-out", t, n, c, on) for n in t.nodes if n != 1]
            if t.unexplained is not None:
                why = next((x.text() for x in cal_.siblings(fabric) if x.table == t.key), t.key)
                cs = [replace(x, no_range=f"not predictable from the others: {why}") for x in cs]
            out += cs
    for t in tables:
        multi = [n for n in t.nodes if n != 1]
        for n in multi[:-1]:          # the largest: an extrapolation, below
            rest = [1] + [m for m in multi if m != n]
            c = cal_.fit(fabric, [t], {t.key: rest})
            if c is not None:
                out.append(_predict_case("leave-one-node-count-out", t, n, c,
                                         f"{t.key} at {'/'.join(map(str, rest))} nodes"))
        for top in multi[:-1]:
            fitted = [1] + [m for m in multi if m <= top]
            c = cal_.fit(fabric, [t], {t.key: fitted})
            if c is None:
                continue
            out += [_predict_case("extrapolation", t, n, c, f"{t.key} at {'/'.join(map(str, fitted))} nodes")
                    for n in multi if n > top]
    cal = cal_.calibration(fabric)
    if cal is not None:
        out += [_point_case(p, cal) for p in pub.POINTS if p.fabric == fabric]
    return tuple(out)


@dataclass(frozen=True)
class Margin:
    """Points of efficiency: inside[N] the largest |error| of the cases inside their fit's node range at N nodes or
    fewer (the envelope over node counts), per_doubling the largest |error| / d of the extrapolated cases, and
    `floor`, what the published figures themselves reproduce to (`reproducibility`), added to both: a case's own
    figures carry it whatever the other cases' errors were."""
    fabric: str
    inside: tuple             # ((nodes, points), ...), envelope, rising
    per_doubling: float
    n_inside: int
    n_beyond: int
    floor: float = 0.0
    floor_from: str = ""

    def at(self, nodes: int, doublings: float = 0.0) -> float:
        env = [p for n, p in self.inside if n <= nodes] or [self.inside[0][1] if self.inside else 0.0]
        return self.floor + env[-1] + self.per_doubling * max(0.0, doublings)

    def text(self) -> str:
        env = ", ".join(f"{p:.2f} to {n}" for n, p in self.inside)
        return (f"margin (points of efficiency) from the out-of-sample errors on {self.fabric} ({self.n_inside} "
                f"cases inside their fit's node counts, {self.n_beyond} beyond; ds_tools.validation): {env} nodes, "
                f"+ {self.per_doubling:.2f} per doubling beyond the calibrated node counts, + {self.floor:.2f} "
                f"({self.floor_from})")


def reproducibility(fabric: str) -> tuple:
    """(points, why): the largest difference between two published measurements of the same figure on the fabric
    (a table's 1-node figure and the `one_node` its source prints for the same configuration elsewhere), in points
    of efficiency; 0 where the sources print no figure twice."""
    got = [(100 * abs(t.setting("one_node").value / t.table[1] - 1), t.key) for t in pub.on_fabric(fabric)
           if "one_node" in t.settings and t.setting("one_node").stated]
    if not got:
        return 0.0, "no figure on this fabric is published twice: the figures' own reproducibility is not known"
    pts, key = max(got)
    return pts, (f"the published figures' reproducibility: the source prints each 1-node figure twice, up to "
                 f"{pts:.2f} % apart ({key})")


@lru_cache(maxsize=None)
def margin(fabric: str, exclude: tuple | None = None) -> Margin | None:
    """The fabric's margin from its cases; exclude=(table, nodes) leaves out every case that predicts that node count
    of that table, so that a case is never judged by a margin its own error set."""
    cs = [c for c in cases(fabric) if not c.no_range and (exclude is None or (c.table, c.nodes) != tuple(exclude))]
    if not cs:
        return None
    inside = [c for c in cs if c.doublings == 0]
    env, top = [], 0.0
    for n in sorted({c.nodes for c in inside}):
        top = max([top] + [abs(c.error_points) for c in inside if c.nodes == n])
        env.append((n, top))
    beyond = [c for c in cs if c.doublings > 0]
    per = max((abs(c.error_points) / c.doublings for c in beyond), default=0.0)
    floor, why = reproducibility(fabric)
    return Margin(fabric, tuple(env), per, len(inside), len(beyond), floor, why)


def judged_margin(c: Case) -> Margin | None:
    """The margin a case is judged by: its fabric's, from every other case (not the ones predicting this node count
    of this table)."""
    return margin(c.table.split("/")[0], (c.table, c.nodes))


def printed_range(c: Case) -> tuple | None:
    """(low, high) efficiency printed for the case: the parameter range +- the margin of the other cases (no other
    case: the parameter range alone); None for a case that carries no range."""
    if c.no_range:
        return None
    m = judged_margin(c)
    h = m.at(c.nodes, c.doublings) / 100 if m else 0.0
    return c.low - h, c.high + h


def covered(c: Case) -> bool | None:
    """Whether the range printed for the case holds the published value (None: the case carries no range)."""
    r = printed_range(c)
    return None if r is None else r[0] <= c.published <= r[1]


def table_md(fabric: str) -> str:
    """The cases as a markdown table (docs/studies.md)."""
    out = ["| case | table | nodes | fitted on | doublings beyond | published % | predicted % | error points | "
           "printed range % | inside |", "|:---|:---|---:|:---|---:|---:|---:|---:|---:|:---:|"]
    notes = []
    for c in cases(fabric):
        r = printed_range(c)
        cell = "none" if r is None else f"{100 * r[0]:.2f}-{100 * r[1]:.2f}"
        inside = {None: "-", True: "yes", False: "NO"}[covered(c)]
        out.append(f"| {c.kind} | {c.table} | {c.nodes} | {c.fitted_on} | {c.doublings:.0f} | {100 * c.published:.2f} "
                   f"| {100 * c.central:.2f} | {c.error_points:+.2f} | {cell} | {inside} |")
        for n in (c.no_range, c.note):
            if n and f"{c.table}: {n}" not in notes:
                notes.append(f"{c.table}: {n}")
    return "\n".join(out + [""] + [f"* {n}" for n in notes]) if notes else "\n".join(out)


def checks_md(fabric: str) -> str:
    """What the tables say of themselves, computed (docs/studies.md): each pair of the same collectives with its
    per-step losses, and what each pair of different gradient bytes says of a fixed per-step term."""
    out = [f"* {s.text()}: " + ("most of its loss is not its collectives' (more than "
                                  f"{cal_.UNEXPLAINED_RATIO:g}x): left out of every fit, no range across tables"
                                  if s.unexplained else f"within {cal_.UNEXPLAINED_RATIO:g}x: modelled")
           for s in cal_.siblings(fabric)]
    for p in cal_.fixed_term_pairs(fabric):
        a, b = p["tables"]
        alike = ("the same model, sequence length, pattern and schedule" if p["same_but_bytes"]
                 else "so do sequence length and schedule")
        out.append(f"* {a} with {b} (gradient bytes differ, {alike}): w {p['w']:.3e} s/B and a fixed "
                   f"{1000 * p['fixed_s']:.1f} ms per step"
                   + ("" if p["w_carried"] else f", w below the line rates' {p['w_line']:.3e}: no link carries it"))
    return "\n".join(out)


if __name__ == "__main__":
    # the tables docs/studies.md carries (tests/test_predict_validation.py keeps them equal)
    for name in ("dgx-a100", "dl1"):
        print(f"\n{name}: {margin(name).text()}\n\n{table_md(name)}")
        if checks_md(name):
            print(f"\n{name}, what the tables say of themselves:\n\n{checks_md(name)}")
