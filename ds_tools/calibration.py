"""What the published tables (ds_tools.published) identify of a fabric's two bandwidth terms, and how well that
predicts what the fit never saw.

The communication model (ds_tools.fabrics, ds_tools.predict) gives a step of B sequences per accelerator on N nodes
of a accelerators, with C the bus bytes its collectives move (2 S per all-reduce of S bytes, S per all-gather or
reduce-scatter), y = 1 / B_intra and x = 1 / B_inter (seconds per byte):

    step(N) = t B(N) + C [(a-1)/a y + (N-1)/N x] + latency(N)

From a table's 1-node figure (step(1) = t B(1) + C (a-1)/a y) the rest follows as

    step(N) = r step(1) + C [(1 - r)(a-1)/a y + (N-1)/N x] + latency(N) - r latency(1),   r = B(N) / B(1)

so a table whose global batch is kept (r = 1/N) identifies only w = (a-1)/a y + x, the two terms' sum, and one whose
per-accelerator batch is kept (r = 1) only x, the inter-node term. The fit is of what the table identifies, nothing
else: on tables of the first kind, w (least squares on the efficiencies, one parameter); the split of w between the
terms stays open, bounded only by the line rates (y >= 1/intra line rate, x >= 1/inter line rate). A prediction of
another schedule is evaluated over that whole interval; its central figure is the split at which both terms reach the
same fraction of their line rates (the single-factor model), and the output says so.

What is not fitted, and why: a per-step cost F that does not scale with bytes and that strong scaling does not divide
(the optimizer step on the whole model under DDP, a per-step sync) adds F (1 - 1/N), the bytes term's own shape, so a
table identifies w C + F only; two tables that differ in gradient bytes and in nothing else the model sees separate
them (`fixed_term_pairs` prints what each pair of different bytes says). On the tables here the pairs disagree (one
gives a w below the line rates), so the model keeps the one term w. A table that loses per step more than
UNEXPLAINED_RATIO times what its sibling of the same collectives loses (`siblings`) is one whose loss is mostly not
its collectives'; its record says so (ds_tools.published `unexplained`) and the fabric's calibration leaves it out.

Validation, out of sample, never on the table or node count predicted, is ds_tools.validation's: its errors give the
margin printed wherever a prediction is not the calibration's own case.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Sequence

from ds_tools import fabrics, published as pub
from ds_tools.comm_model import Collective, Measured, predict
from ds_tools.intervals import t975


@dataclass(frozen=True)
class Variant:
    """One combination of the plausible values of a table's settings."""
    pattern: str
    grad_bytes: int
    overlap: float
    schedule: tuple


def variants(t: pub.PublishedTable) -> list:
    s = t.settings
    return [Variant(p, g, o, sch) for p in s["pattern"].values for g in s["grad_bytes"].values
            for o in s["overlap"].values for sch in s["schedule"].values]


def pattern_collectives(pattern: str, params: int, grad_bytes: int, why: str):
    """collectives_of(grad_accum) for predict(): one optimizer step of the pattern (parameters gathered in 16 bit)."""
    colls = [Collective(kind, params * (grad_bytes if what == "grad" else 2), 1, 1, why)
             for kind, what in pub.COMM_PATTERNS[pattern]]
    return lambda _g: colls


@lru_cache(maxsize=None)
def params_of(model: str, seq_len: int) -> int:
    from ds_tools.model_shapes import model_shape

    return model_shape(model, seq_len).params


def line_terms(fab: fabrics.Fabric) -> tuple:
    """(y, x) at line rate, seconds per byte."""
    return 8 / (fab.intra_gbps * 1e9), 8 / (fab.inter_gbps * 1e9)


def fabric_at(fab: fabrics.Fabric, y: float, x: float, on: str = "") -> fabrics.Fabric:
    """The fabric whose terms are y and x seconds per byte."""
    yl, xl = line_terms(fab)
    return fab.with_factors(yl / y, xl / x, on)


@dataclass(frozen=True)
class Split:
    """How w divides between the terms: phi = (a-1)/a y / w, at per_node a."""
    w: float
    per_node: int
    phi: float

    @property
    def y(self) -> float:
        a = self.per_node
        return self.phi * self.w * a / (a - 1)

    @property
    def x(self) -> float:
        return (1 - self.phi) * self.w


def phi_bounds(fab: fabrics.Fabric, w: float, a: int) -> tuple:
    """(low, central, high) split of w: at the intra line rate, at equal factors, at the inter line rate."""
    yl, xl = line_terms(fab)
    intra = (a - 1) / a * yl
    lo, hi = intra / w, 1 - xl / w
    central = intra / (intra + xl)
    if hi < lo:      # w below the line rates' sum: the fit asks for more than the links carry
        return central, central, central
    return lo, min(max(central, lo), hi), hi


def table_rows(t: pub.PublishedTable, fab: fabrics.Fabric, v: Variant, nodes: Sequence[int] | None = None) -> list:
    """The table's node counts predicted from its 1-node figure on the fabric, variant v of its settings."""
    params = params_of(t.model, t.seq_len)
    kind, batch = v.schedule
    a = t.per_node
    if kind == "global":
        m = Measured(nodes=1, per_node=a, seq_per_s=t.table[1], grad_accum=batch // a)
        gb = batch
    else:
        m, gb = Measured(nodes=1, per_node=a, seq_per_s=t.table[1], grad_accum=batch), None
    of = pattern_collectives(v.pattern, params, v.grad_bytes, t.key)
    # an exposed share 1 - overlap of the communication: the same as bandwidths 1 / (1 - overlap) times higher
    f = fab if not v.overlap else fab.with_factors(fab.eta_intra / (1 - v.overlap), fab.eta_inter / (1 - v.overlap),
                                                  fab.calibrated_on)
    return predict(m, f, params=params, stage=1, precision="bf16", micro=1, nodes=list(nodes or t.nodes),
                   global_batch=gb, collectives_of=of)["rows"]


def efficiency_of(t: pub.PublishedTable, n: int) -> float:
    return t.table[n] / n / t.table[1]


def _errors(t: pub.PublishedTable, v: Variant, fab: fabrics.Fabric, split: Split, nodes: Sequence[int]) -> list:
    """(table key, nodes, predicted - published efficiency in points) at the node counts given (1 left out)."""
    rows = table_rows(t, fabric_at(fab, split.y, split.x), v, [1, *[n for n in nodes if n != 1]])
    return [(t.key, r["nodes"], 100 * (r["efficiency"] - efficiency_of(t, r["nodes"]))) for r in rows[1:]]


@dataclass(frozen=True)
class Calibration:
    """What a fabric's published tables identify: w per table and plausible variant of its settings (`fits`), the
    central w (their median) and the range they span; the split of w between the terms is not identified."""
    fabric: str
    per_node: int
    nodes: dict                   # key -> node counts fitted on
    fits: tuple                   # (key, pattern, w)
    w: float                      # central
    w_range: tuple                # (lowest, highest) w of the fits
    residuals: tuple              # (key, nodes, points), each table and variant at its own w: in sample
    notes: tuple = field(default=())

    @property
    def tables(self) -> tuple:
        return tuple(self.nodes)

    @property
    def max_nodes(self) -> int:
        return max(max(v) for v in self.nodes.values())

    @property
    def min_nodes(self) -> int:
        """The fewest nodes fitted beyond the 1-node figure every prediction starts from."""
        return min(n for v in self.nodes.values() for n in v if n != 1)

    def doublings(self, nodes: int) -> float:
        """How far a node count lies outside the fitted ones, in doublings (0 inside, or at 1 node)."""
        if nodes == 1:
            return 0.0
        return max(0.0, math.log2(nodes / self.max_nodes), math.log2(self.min_nodes / nodes))

    def central(self) -> Split:
        fab = fabrics.FABRICS[self.fabric]
        return Split(self.w, self.per_node, phi_bounds(fab, self.w, self.per_node)[1])

    def corners(self) -> list:
        """Every extreme of what the fit leaves open: the lowest, central and highest w, each split at both line
        rates and at equal factors."""
        fab = fabrics.FABRICS[self.fabric]
        return [Split(w, self.per_node, phi) for w in sorted({self.w_range[0], self.w, self.w_range[1]})
                for phi in phi_bounds(fab, w, self.per_node)]

    def describe(self) -> str:
        fab = fabrics.FABRICS[self.fabric]
        yl, xl = line_terms(fab)
        mid = self.central()
        lo, _, hi = (Split(self.w, self.per_node, p) for p in phi_bounds(fab, self.w, self.per_node))
        each = "; ".join(f"{k} ({'/'.join(map(str, self.nodes[k]))} nodes, {p}) {w:.3e}" for k, p, w in self.fits)
        return (f"fitted: w = (a-1)/a y + x, the sum of the intra- and inter-node terms (seconds per bus byte, a = "
                f"{self.per_node}; every table here keeps its global batch, which identifies that sum and nothing "
                f"else): {self.w:.3e} s/B, the median of {len(self.fits)} fits ({each}), spanning "
                f"{self.w_range[0]:.3e}-{self.w_range[1]:.3e}; not fitted: how w splits between the terms, from "
                f"the intra-node term at line rate (intra factor 1, inter {xl / lo.x:.3f}) to the inter-node term "
                f"at line rate (intra {yl / hi.y:.3f}, inter 1); central figures at equal factors "
                f"({yl / mid.y:.3f} of both line rates)" + "".join(f"; {n}" for n in self.notes))


def _golden(f, lo: float, hi: float, iters: int = 60) -> float:
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def _fit_one(t: pub.PublishedTable, v: Variant, fab: fabrics.Fabric, nodes: list) -> float:
    """w by least squares on one table's efficiencies at the given node counts, variant v of its settings."""
    a = t.per_node
    yl, xl = line_terms(fab)
    central = phi_bounds(fab, 1.0, a)[1]          # the equal-factor split does not depend on w

    def sse(logw: float) -> float:
        return sum(e * e for *_k, e in _errors(t, v, fab, Split(math.exp(logw), a, central), nodes))

    w_line = (a - 1) / a * yl + xl
    return math.exp(_golden(sse, math.log(w_line / 4), math.log(w_line * 1e4)))


def _median(xs: Sequence[float]) -> float:
    ws, k = sorted(xs), len(xs)
    return ws[k // 2] if k % 2 else (ws[k // 2 - 1] + ws[k // 2]) / 2


def fit(fabric: str, tables: Sequence[pub.PublishedTable], keep: dict | None = None) -> Calibration | None:
    """w of each table and plausible variant by least squares on its efficiencies (node counts keep[key], default
    all); the central w is their median (a table that scales unlike the others moves it little). Only a table that
    keeps its global batch in every variant identifies w; None without one."""
    keep = keep or {}
    tables = [t for t in tables if all(v.schedule[0] == "global" for v in variants(t))
              and len([n for n in keep.get(t.key, t.nodes) if n != 1]) > 0]
    if not tables:
        return None
    fab = fabrics.FABRICS[fabric]
    a = tables[0].per_node
    if any(t.per_node != a for t in tables):
        raise ValueError(f"{fabric}: tables of different accelerators per node fitted together")
    nodes = {t.key: list(keep.get(t.key, t.nodes)) for t in tables}
    fits = tuple((t.key, v.pattern, _fit_one(t, v, fab, nodes[t.key])) for t in tables for v in variants(t))
    ws = [w for *_k, w in fits]
    w = _median(ws)
    yl, xl = line_terms(fab)
    w_line = (a - 1) / a * yl + xl
    own = {(k, p): wv for k, p, wv in fits}
    resid = tuple(e for t in tables for v in variants(t)
                  for e in _errors(t, v, fab, Split(own[t.key, v.pattern], a, phi_bounds(fab, 1.0, a)[1]),
                                   nodes[t.key]))
    notes = () if w >= w_line else (f"w {w:.3e} s/B is below the line rates' {w_line:.3e}: the tables scale better "
                                    "than the links could carry what the model counts",)
    return Calibration(fabric, a, nodes, fits, w, (min(ws), max(ws)), resid, notes)


def modelled(tables: Sequence[pub.PublishedTable]) -> list:
    """The tables the model accounts for: all but those whose record says their loss is mostly something else
    (`unexplained`, checked on the figures by `siblings`)."""
    return [t for t in tables if t.unexplained is None]


@lru_cache(maxsize=None)
def calibration(fabric: str) -> Calibration | None:
    """The fit on every modelled published table of the fabric (None: none identifies anything); the tables left
    out are named in its notes, with the evidence."""
    c = fit(fabric, modelled(pub.on_fabric(fabric)))
    out = [t for t in pub.on_fabric(fabric) if t.unexplained is not None]
    if c is None or not out:
        return c
    why = {s.table: s for s in siblings(fabric)}
    left = tuple(f"left out of the fit: {why[t.key].text() if t.key in why else t.key}: most of its loss is not its "
                 "collectives'" for t in out)
    return replace(c, notes=c.notes + left)


# A table loses per step more than this many times what its sibling (the same collectives) loses: most of its loss
# is not its collectives', whatever they cost
UNEXPLAINED_RATIO = 2.0


@lru_cache(maxsize=None)
def own_loss(key: str) -> float:
    """Seconds per optimizer step a table loses beyond its ideal at many nodes, as its own fit has it: w C, with w
    fitted on the table alone (its first variant) and C its collectives' bus bytes; what a kept global batch
    identifies of a table (step(N) = step(1)/N + w C (1 - 1/N))."""
    t = pub.BY_KEY[key]
    v = variants(t)[0]
    fab = fabrics.FABRICS[t.fabric]
    w = _fit_one(t, v, fab, t.nodes)
    return w * bus_bytes(t, v)


def bus_bytes(t: pub.PublishedTable, v: Variant) -> float:
    """C: bus bytes of one optimizer step's collectives (2 S per all-reduce, S per all-gather or reduce-scatter)."""
    params = params_of(t.model, t.seq_len)
    return sum((2 if kind == "all_reduce" else 1) * params * (v.grad_bytes if what == "grad" else 2)
               for kind, what in pub.COMM_PATTERNS[v.pattern])


def same_collectives(a: pub.PublishedTable, b: pub.PublishedTable) -> bool:
    """Whether two tables issue the same collectives per optimizer step on the same system, by their records."""
    s, o = a.settings, b.settings
    return (a.fabric == b.fabric and a.model == b.model and a.per_node == b.per_node
            and s["pattern"].values == o["pattern"].values and s["grad_bytes"].values == o["grad_bytes"].values
            and {k for k, _b in s["schedule"].values} == {k for k, _b in o["schedule"].values})


@dataclass(frozen=True)
class Sibling:
    table: str
    sibling: str
    loss_s: float             # own_loss of table
    sibling_loss_s: float

    @property
    def ratio(self) -> float:
        return self.loss_s / self.sibling_loss_s

    @property
    def unexplained(self) -> bool:
        return self.ratio > UNEXPLAINED_RATIO

    def text(self) -> str:
        return (f"{self.table} loses {self.loss_s:.3f} s per step, {self.ratio:.1f}x what {self.sibling} (the same "
                f"collectives) loses ({self.sibling_loss_s:.3f} s)")


def siblings(fabric: str) -> list:
    """Every ordered pair of the fabric's tables with the same collectives, the first losing more: the evidence
    a table's `unexplained` record must have (ratio above UNEXPLAINED_RATIO), and that no other table has."""
    ts = pub.on_fabric(fabric)
    out = []
    for a in ts:
        for b in ts:
            if a.key != b.key and same_collectives(a, b) and own_loss(a.key) >= own_loss(b.key):
                out.append(Sibling(a.key, b.key, own_loss(a.key), own_loss(b.key)))
    return out


def fixed_term_pairs(fabric: str) -> list:
    """What two modelled tables of different gradient bytes say of a per-step cost that does not scale with bytes
    (strong scaling does not divide it: the optimizer step under DDP, a per-step sync): their own losses
    L = w C + F solved for (w, F), with whether the two share everything else the records state (model, sequence
    length, pattern, schedule) and whether w is one the links can carry (at least the line rates' w)."""
    fab = fabrics.FABRICS[fabric]
    yl, xl = line_terms(fab)
    ts = modelled(pub.on_fabric(fabric))
    out = []
    for i, a in enumerate(ts):
        for b in ts[i + 1:]:
            ca, cb = bus_bytes(a, variants(a)[0]), bus_bytes(b, variants(b)[0])
            if ca == cb or len(variants(a)) > 1 or len(variants(b)) > 1:
                continue
            la, lb = own_loss(a.key), own_loss(b.key)
            w = (la - lb) / (ca - cb)
            clean = (a.model, a.seq_len, a.settings["pattern"].value, a.settings["schedule"].value) == \
                (b.model, b.seq_len, b.settings["pattern"].value, b.settings["schedule"].value)
            w_line = (a.per_node - 1) / a.per_node * yl + xl
            out.append({"tables": (a.key, b.key), "w": w, "fixed_s": la - w * ca, "same_but_bytes": clean,
                        "w_carried": w >= w_line, "w_line": w_line})
    return out


def in_sample_half(cal: Calibration) -> float:
    """Half-width (points) of the in-sample 95 % prediction interval from the fit's residuals."""
    r = [e for *_k, e in cal.residuals]
    n = len(r)
    dof = max(1, n - len(cal.fits))
    s = math.sqrt(sum(e * e for e in r) / dof)
    return t975(dof) * s * math.sqrt(1 + 1 / n)
