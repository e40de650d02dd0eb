"""A published point (ds_tools.published.POINTS: one efficiency at one node count, its 1-node figure not readable
here) predicted by its fabric's calibration: the case ds_tools.validation judges as "across models and schedules".

Its 1-node step is not measured, so it is evaluated over the range its compute can have: the compute per sequence
of the table named by `compute_from` (its 1-node step less its modelled communication, per sequence and
accelerator), scaled to the point's model by 6 x parameters x tokens (ds_tools.compute_rate.flops_per_seq), at that
table's own MFU (the central figure: the same MFU, as ds-tune assumes for another model) or at any MFU in the range
the published 1-node figures imply (ds_tools.compute_rate.mfu_range). With its schedule, its collectives (each
plausible pattern with the w fitted under that pattern: the point and the table ran the same unstated collectives)
and every split of w the fit leaves open, that gives the central efficiency and the parameter range.
"""
from __future__ import annotations

from ds_tools import calibration as cal_, fabrics, published as pub
from ds_tools.comm_model import Measured, comm_seconds, predict
from ds_tools.compute_rate import flops_per_seq, mfu_range, table_mfu
from ds_tools.model_shapes import model_shape


def _per_seq(t: pub.PublishedTable, fab: fabrics.Fabric, pattern: str) -> float:
    """Seconds of compute per sequence and accelerator in table t's 1-node step on fab (its communication out)."""
    kind, batch = t.setting("schedule").values[0]
    per_acc = batch // t.per_node if kind == "global" else batch
    step = per_acc * t.per_node / t.table[1]
    colls = cal_.pattern_collectives(pattern, cal_.params_of(t.model, t.seq_len), t.setting("grad_bytes").values[0],
                                     t.key)(0)
    return (step - comm_seconds(colls, fab, t.per_node, 1)) / per_acc


def _efficiency(p: pub.PublishedPoint, fab: fabrics.Fabric, pattern: str, per_seq: float) -> float:
    """The point's efficiency at its node count on fab, its 1-node step = its batch x per_seq + its collectives."""
    kind, batch = p.setting("schedule").value
    if kind != "per_accelerator":
        raise ValueError(f"{p.key}: a published point is evaluated at a kept per-accelerator batch, not {kind}")
    params = cal_.params_of(p.model, p.seq_len)
    of = cal_.pattern_collectives(pattern, params, p.setting("grad_bytes").value, p.key)
    step1 = batch * per_seq + comm_seconds(of(batch), fab, p.per_node, 1)
    m = Measured(nodes=1, per_node=p.per_node, seq_per_s=p.per_node * batch / step1, grad_accum=batch)
    rows = predict(m, fab, params=params, stage=1, precision="bf16", micro=1, nodes=[1, p.nodes], collectives_of=of)
    return rows["rows"][1]["efficiency"]


def mfus(p: pub.PublishedPoint) -> tuple:
    """(the compute table's own MFU, the lowest, the highest) the published 1-node figures imply."""
    lo, hi, _keys = mfu_range()
    own = table_mfu(pub.BY_KEY[p.compute_from])
    if own is None:
        raise ValueError(f"{p.key}: {p.compute_from} implies no MFU (not 16-bit, or no published peak)")
    return own, min(lo, own), max(hi, own)


def evaluate(p: pub.PublishedPoint, c: cal_.Calibration) -> tuple:
    """(central, low, high, note) efficiency of the point: central at the compute table's MFU, each plausible
    pattern at the w fitted under it, split at equal factors (the mean over patterns); low/high over every MFU end,
    pattern and split the fit leaves open."""
    fab = fabrics.FABRICS[p.fabric]
    src = pub.BY_KEY[p.compute_from]
    scale = flops_per_seq(model_shape(p.model, p.seq_len)) / flops_per_seq(model_shape(src.model, src.seq_len))
    own, lo, hi = mfus(p)
    fits = [(pat, w) for key, pat, w in c.fits if key == src.key and pat in p.setting("pattern").values]
    if not fits:
        raise ValueError(f"{p.key}: the calibration of {p.fabric} has no fit of {src.key} under its patterns")
    central, every, steps = [], [], []
    for pat, w in fits:
        for i, phi in enumerate(cal_.phi_bounds(fab, w, c.per_node)):
            sp = cal_.Split(w, c.per_node, phi)
            f = cal_.fabric_at(fab, sp.y, sp.x)
            t0 = _per_seq(src, f, pat) * scale
            for mfu in (own, lo, hi):
                e = _efficiency(p, f, pat, t0 * own / mfu)
                every.append(e)
                if i == 1 and mfu == own:
                    central.append(e)
                if i == 1:
                    steps.append(p.setting("schedule").value[1] * t0 * own / mfu)
    note = (f"1-node figure not published: compute per sequence from {src.key}'s 1-node figure scaled by 6 x "
            f"parameters x tokens ({scale:.2f}x), at its MFU ({100 * own:.0f} %, central) down to "
            f"{100 * lo:.0f} % (the published 1-node figures' range): a 1-node compute step of "
            f"{min(steps):.2f}-{max(steps):.2f} s; each pattern the fork may have issued at the w fitted under it")
    return sum(central) / len(central), min(every), max(every), note
