"""Out-of-sample validation of ds_tools.calibration, and the margins it gives predictions.

Cases, none predicted by a fit that saw it:
  * leave-one-table-out: each published table of a fabric with two or more, predicted from its own 1-node figure by
    the fit on the fabric's other tables;
  * leave-one-node-count-out: each node count of a table, predicted by the fit on that table's other node counts;
    a node count above every one fitted is an extrapolation by d = log2(N / the largest fitted) doublings;
  * extrapolation: each table fitted on its node counts up to M only, every larger one predicted (d = log2(N / M)).

For each case: the published efficiency, the central prediction and its error (points), and the prediction's
parameter range (the split of w the fit leaves open: ds_tools.calibration). The margin of a fabric is
margin(d) = m0 + m1 d (points): m0 the largest |error| of the cases inside their fit's node range (d = 0), m1 the
largest (|error| - m0) / d of the extrapolated ones, both from that fabric's cases. A printed range is the parameter
range widened by the margin; it covers a case when the published value lies inside it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ds_tools import calibration as cal_, fabrics, published as pub


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


@lru_cache(maxsize=None)
def cases(fabric: str) -> tuple:
    tables = pub.on_fabric(fabric)
    out = []
    if len(tables) > 1:
        for t in tables:
            others = [o for o in tables if o.key != t.key]
            c = cal_.fit(fabric, others)
            if c is None:
                continue
            on = "; ".join(c.tables)
            out += [_predict_case("leave-one-table-out", t, n, c, on) for n in t.nodes if n != 1]
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
    return tuple(out)


@dataclass(frozen=True)
class Margin:
    """Points of efficiency: inside[N] the largest |error| of the cases inside their fit's node range at N nodes or
    fewer (the envelope over node counts), per_doubling the largest |error| / d of the extrapolated cases."""
    fabric: str
    inside: tuple             # ((nodes, points), ...), envelope, rising
    per_doubling: float
    n_inside: int
    n_beyond: int

    def at(self, nodes: int, doublings: float = 0.0) -> float:
        env = [p for n, p in self.inside if n <= nodes] or [self.inside[0][1] if self.inside else 0.0]
        return env[-1] + self.per_doubling * max(0.0, doublings)

    def text(self) -> str:
        env = ", ".join(f"{p:.2f} to {n}" for n, p in self.inside)
        return (f"margin (points of efficiency) from the out-of-sample errors on {self.fabric} ({self.n_inside} "
                f"cases inside their fit's node counts, {self.n_beyond} beyond; ds_tools.validation): {env} nodes, "
                f"+ {self.per_doubling:.2f} per doubling beyond the calibrated node counts")


@lru_cache(maxsize=None)
def margin(fabric: str, exclude: tuple | None = None) -> Margin | None:
    """The fabric's margin from its cases; exclude=(table, nodes) leaves out every case that predicts that node count
    of that table, so that a case is never judged by a margin its own error set."""
    cs = [c for c in cases(fabric) if exclude is None or (c.table, c.nodes) != tuple(exclude)]
    if not cs:
        return None
    inside = [c for c in cs if c.doublings == 0]
    env, top = [], 0.0
    for n in sorted({c.nodes for c in inside}):
        top = max([top] + [abs(c.error_points) for c in inside if c.nodes == n])
        env.append((n, top))
    beyond = [c for c in cs if c.doublings > 0]
    per = max((abs(c.error_points) / c.doublings for c in beyond), default=0.0)
    return Margin(fabric, tuple(env), per, len(inside), len(beyond))


def judged_margin(c: Case) -> Margin | None:
    """The margin a case is judged by: its fabric's, from every other case (not the ones predicting this node count
    of this table)."""
    return margin(c.table.split("/")[0], (c.table, c.nodes))


def covered(c: Case) -> bool:
    """Whether the range printed for the case (parameter range +- the margin of the other cases) holds the published
    value; no margin (no other case): the parameter range alone."""
    m = judged_margin(c)
    h = m.at(c.nodes, c.doublings) / 100 if m else 0.0
    return c.low - h <= c.published <= c.high + h


def table_md(fabric: str) -> str:
    """The cases as a markdown table (docs/studies.md)."""
    out = ["| case | table | nodes | fitted on | doublings beyond | published % | predicted % | error points | "
           "printed range % | inside |", "|:---|:---|---:|:---|---:|---:|---:|---:|---:|:---:|"]
    for c in cases(fabric):
        m = judged_margin(c)
        h = m.at(c.nodes, c.doublings) if m else 0.0
        out.append(f"| {c.kind} | {c.table} | {c.nodes} | {c.fitted_on} | {c.doublings:.0f} | {100 * c.published:.2f} "
                   f"| {100 * c.central:.2f} | {c.error_points:+.2f} | {100 * c.low - h:.2f}-{100 * c.high + h:.2f} | "
                   f"{'yes' if covered(c) else 'NO'} |")
    return "\n".join(out)


if __name__ == "__main__":
    # the tables docs/studies.md carries (tests/test_predict_validation.py keeps them equal)
    for name in ("dgx-a100", "dl1"):
        print(f"\n{name}: {margin(name).text()}\n\n{table_md(name)}")
