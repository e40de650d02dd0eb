"""Step time of a ZeRO configuration for ds-tune, per optimizer step and rank (B = micro batch x accumulation):

    step = compute per sequence x B (x 4/3 with activation checkpointing: the forward runs twice)
           + accumulation x per-micro-step fixed cost + optimizer step + communication

  * compute per sequence, from a measurement (`--measured SEQ_PER_S --measured_nodes N` with the measured run's
    layout, or `--from RUN_DIR`): the measured step less its modelled communication (its exposed part, with phase
    timing), its wait for the slowest rank, its optimizer step and its per-micro-step fixed costs, per sequence; of
    another model than the measured one, scaled by the two models' 6 x parameters x tokens (the same MFU, said so).
    Without one: 6 x parameters x tokens at the accelerator's dense peak (ds_core.device.accelerators, its source
    cited there) times an assumed MFU, stated with the range the published 1-node figures imply (`mfu_range`).
    The measured rate holds for micro-steps of at least the measured run's work (FLOPs per micro-step): a row of
    less work is not claimed to run at it (`KnownCompute.covers`); without a measurement, at least
    SATURATING_TOKENS tokens per micro batch.
  * per-micro-step fixed cost: what a micro-step costs whatever its size; measured (the run's data wait per
    micro-step, ds_core.outputs.phases) or stated (`--micro_step_ms`); 0 otherwise, and the output says so. The
    optimizer step (phase_step_s) is per optimizer step.
  * communication: the collectives `ds-scaling-report predict` models for the stage, on the fabric's central terms
    (ds_tools.ranges), not overlapped (ZeRO-0/1 reduce after the backward); the step's range evaluates every corner
    of what the fabric's calibration leaves open (and the MFU range without a measurement).
"""
from __future__ import annotations

from dataclasses import dataclass

from ds_core.device import accelerators
from ds_tools import fabrics, predict
from ds_tools.compute_rate import flops_per_seq, mfu_range  # noqa: F401  (ds-tune's names for them)
from ds_tools.zero_memory_model import ModelShape, TuningError

# 6 FLOPs per parameter and token for forward + backward (Kaplan et al. 2020, "Scaling Laws for Neural Language
# Models", C = 6 N per token); a checkpointed run repeats the forward, 2 of the 6
RECOMPUTE = 4 / 3
# rows whose step times differ by less than this (or the fabric's margin, if larger) are equally fast
SAME_SPEED = 0.005
# Without a measurement: tokens per micro batch below which the peak x MFU figure is not taken to hold (a smaller
# micro batch keeps the accelerator less busy, by how much is not modelled)
SATURATING_TOKENS = 4096


@dataclass(frozen=True)
class KnownCompute:
    """Compute per sequence of the tuned model at each corner of the fabric's terms, from a measurement."""
    per_seq_s: tuple                 # per corner (index 0: central)
    opt_s: float                     # optimizer step, per optimizer step
    fixed_ms: float                  # per micro-step
    fixed_from: str
    flops_per_micro: float           # the measured run's work per micro-step
    source: str

    def covers(self, flops_per_micro: float) -> bool:
        return flops_per_micro >= self.flops_per_micro * (1 - 1e-9)


@dataclass(frozen=True)
class StepTime:
    compute_s: float | None      # None: no compute figure
    comm_s: float
    fixed_s: float = 0.0         # per-micro-step fixed costs and the optimizer step
    low_s: float | None = None
    high_s: float | None = None
    known: bool = True           # the compute figure holds at this row's micro-step size

    @property
    def total_s(self) -> float:
        return (self.compute_s or 0.0) + self.comm_s + self.fixed_s


@dataclass(frozen=True)
class TimeModel:
    """What step times are computed from: the fabric's central and corner terms (None: no fabric, no step times),
    the accelerator's dense peak (None: not published), the MFU assumed and its range, or a measured compute."""
    fabric: fabrics.Fabric | None
    corners: tuple
    peak_tflops: float | None
    mfu: float
    mfu_lo: float
    mfu_hi: float
    ranks_per_node: int
    nodes: int
    measured: KnownCompute | None = None
    fixed_ms: float = 0.0
    fixed_from: str = "not modelled (0): give --micro_step_ms, or --from a run with phase timing"
    terms_from: str = ""
    margin_points: float = 0.0
    unpredictable: str = ""      # why this run's communication is not predictable (ds_tools.ranges.unpredictable)

    @property
    def tolerance(self) -> float:
        """Relative step-time difference below which two rows are equally fast: the fabric's margin (points of
        efficiency at this node count, as a fraction) or SAME_SPEED, the larger."""
        return max(SAME_SPEED, self.margin_points / 100)

    def describe(self, shape: ModelShape) -> str:
        if self.fabric is None:
            return ("Step time: not modelled (no fabric for this accelerator; give --fabric): rows ranked by memory "
                    "and stage only.")
        f = self.fabric
        if self.measured is not None:
            comp = f"compute per sequence {self.measured.source}"
        elif not self.peak_tflops:
            comp = ("compute not modelled (no published peak for this precision): rows ranked on communication, "
                    "checkpointed rows last")
        elif len(shape.towers) > 1:
            comp = (f"compute not modelled ({shape.name} has {len(shape.towers)} towers of different token counts): "
                    "rows ranked on communication, checkpointed rows last")
        else:
            comp = (f"compute = 6 x parameters x tokens per sequence (x 4/3 with activation checkpointing) at "
                    f"{100 * self.mfu:.0f} % (assumed; --mfu) of the {self.peak_tflops:g} TFLOPs dense peak "
                    f"(ds_core.device.accelerators), range {100 * self.mfu_lo:.0f}-{100 * self.mfu_hi:.0f} %: the "
                    f"MFU the published 1-node figures imply (ds_tools.published), valid from {SATURATING_TOKENS} "
                    "tokens per micro batch")
        fixed = self.measured.fixed_from if self.measured else self.fixed_from
        fixed_ms = self.measured.fixed_ms if self.measured else self.fixed_ms
        return (f"Step time = compute + per-micro-step fixed cost x accumulation + communication, not overlapped: "
                f"{comp}; per-micro-step fixed cost {fixed_ms:g} ms ({fixed}); communication = the collectives "
                f"DeepSpeed issues for the stage, as `ds-scaling-report predict` models them, on fabric {f.name} "
                f"(intra factor {f.eta_intra:.3f}, inter factor {f.eta_inter:.3f} of the line rates: "
                f"{self.terms_from or 'not calibrated: no range'}); rows within {100 * self.tolerance:.1f} % of "
                f"each other are equally fast (the fabric's margin at {self.nodes} nodes)."
                + (f" Not predictable, so no step range is printed: {self.unpredictable}." if self.unpredictable
                   else ""))


def _comm(fab: fabrics.Fabric, colls, a: int, n: int) -> float:
    return predict.comm_seconds(colls, fab, a, n)


def step_time(tm: TimeModel, shape: ModelShape, stage: int, micro: int, accum: int, checkpointing: bool,
              precision: str) -> StepTime | None:
    if tm.fabric is None:
        return None
    colls = predict.collectives(stage, precision, shape.params, accum)
    comms = [_comm(f, colls, tm.ranks_per_node, tm.nodes) for f in (tm.fabric, *tm.corners)]
    fps = flops_per_seq(shape)
    ck = RECOMPUTE if checkpointing else 1.0
    b = micro * accum
    def bounds(totals: list[float]) -> tuple[float | None, float | None]:
        return (None, None) if tm.unpredictable else (min(totals), max(totals))

    if tm.measured is not None:
        k = tm.measured
        fixed = accum * k.fixed_ms / 1000 + k.opt_s
        totals = [p * b * ck + fixed + c for p, c in zip(k.per_seq_s, comms)]
        known = fps is not None and k.covers(fps * micro)
        return StepTime(k.per_seq_s[0] * b * ck, comms[0], fixed, *bounds(totals), known)
    fixed = accum * tm.fixed_ms / 1000
    if not tm.peak_tflops or fps is None:
        return StepTime(None, comms[0], fixed, *bounds([c + fixed for c in comms]))
    per = {m: fps / (tm.peak_tflops * 1e12 * m) for m in (tm.mfu, tm.mfu_lo, tm.mfu_hi)}
    compute = per[tm.mfu] * b * ck
    totals = [p * b * ck + fixed + c for p in per.values() for c in comms]
    return StepTime(compute, comms[0], fixed, *bounds(totals), micro * shape.towers[0].seq >= SATURATING_TOKENS)


def measured_compute(m: predict.Measured, *, shape: ModelShape, measured_shape: ModelShape, stage: int,
                     micro: int, precision: str, fab: fabrics.Fabric, corners: tuple, fixed_ms: float | None,
                     label: str) -> KnownCompute:
    """The tuned model's compute per sequence from a measured run (of it or of another model), per corner."""
    b0 = micro * m.grad_accum
    step0 = b0 * m.nodes * m.per_node / m.seq_per_s
    colls = predict.collectives(stage, precision, measured_shape.params, m.grad_accum)
    share = ({k: v / sum(m.phases.values()) for k, v in m.phases.items()} if m.phases else None)
    exposed = step0 * share["phase_comm_s"] if share else None
    wait = step0 * share["phase_wait_s"] if share else 0.0
    opt = step0 * share["phase_step_s"] if share else 0.0
    if fixed_ms is None:
        fixed_ms, fixed_from = ((1000 * step0 * share["phase_data_s"] / m.grad_accum, "measured: the run's data wait "
                                 "per micro-step (phase timing)") if share else
                                (0.0, "not modelled (0): give --micro_step_ms, or --from a run with phase timing"))
    else:
        fixed_from = "stated (--micro_step_ms)"
    f_meas, f_tgt = flops_per_seq(measured_shape), flops_per_seq(shape)
    if f_meas is None or f_tgt is None:
        raise TuningError("--measured / --from: compute per sequence needs a model of one token count (not "
                          f"{measured_shape.name if f_meas is None else shape.name})")
    per = []
    for f in (fab, *corners):
        comm0 = _comm(f, colls, m.per_node, m.nodes)
        ex = comm0 if exposed is None else min(exposed, comm0)
        left = step0 - ex - wait - opt - m.grad_accum * fixed_ms / 1000
        if left <= 0:
            raise TuningError(f"the measured step ({step0:.3f} s) is shorter than its modelled communication "
                              f"({ex:.3f} s) and fixed costs on fabric {fab.name}")
        per.append(left / b0 * f_tgt / f_meas)
    across = "" if shape.name == measured_shape.name else (
        f", scaled to {shape.name} by 6 x parameters x tokens ({f_tgt / f_meas:.2f}x: the same MFU, assumed)")
    tokens = micro * measured_shape.towers[0].seq
    return KnownCompute(tuple(per), opt, fixed_ms, fixed_from, f_meas * micro,
                        f"{1000 * per[0]:.2f} ms from {label}{across}; holds from the measured micro-step's work "
                        f"({tokens} tokens of {measured_shape.name}, {f_meas * micro / 1e12:.1f} TFLOP) up")


def time_model(accelerator: str, ranks_per_node: int, nodes: int, precision: str, fabric: str | None,
               mfu: float | None, fixed_ms: float | None = None) -> TimeModel:
    """The fabric named by --fabric, else the one the accelerator's system is (dl1 for gaudi); none for cpu or an
    accelerator no modelled system is built from. mfu None: the middle of the published range."""
    lo, hi, _keys = mfu_range()
    if mfu is None:
        mfu = (lo + hi) / 2
    if not 0 < mfu <= 1:
        raise TuningError(f"--mfu {mfu}: expected a fraction in (0, 1]")
    fab = None
    try:
        fab = fabrics.lookup(fabric or accelerator)
    except ValueError as e:
        if fabric:
            raise TuningError(str(e)) from None
    try:
        peak = accelerators.get(accelerator).peak_tflops(precision)
    except accelerators.UnknownAcceleratorError:
        peak = None
    if fab is None:
        return TimeModel(None, (), peak, mfu, min(lo, mfu), max(hi, mfu), ranks_per_node, nodes)
    from ds_tools import ranges, validation

    tr = ranges.terms(fab)
    margin = validation.margin(fab.name) if tr.cal else None
    d = tr.cal.doublings(nodes) if tr.cal else 0.0
    kw = {} if fixed_ms is None else {"fixed_ms": fixed_ms, "fixed_from": "stated (--micro_step_ms)"}
    return TimeModel(tr.central, tr.corners, peak, mfu, min(lo, mfu), max(hi, mfu), ranks_per_node, nodes,
                     terms_from=(tr.intra_from if tr.cal else ""),
                     margin_points=margin.at(nodes, d) if margin else 0.0, **kw)
