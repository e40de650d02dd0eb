"""Step time of a ZeRO configuration for ds-tune: compute plus the communication `ds-scaling-report predict` models.

Per optimizer step and rank, B = micro batch x accumulation sequences:

    step = compute + comm
    compute = 6 x parameters x tokens x B (x 4/3 with activation checkpointing: the forward runs twice)
              / (the accelerator's dense peak x MFU)
    comm    = ds_tools.predict.collectives(stage, ...) costed by ds_tools.fabrics for the named fabric: ZeRO-1 one
              gradient all-reduce and one parameter all-gather per optimizer step, whatever the accumulation;
              ZeRO-3 two parameter all-gathers and a gradient reduce-scatter every micro step, so under
              accumulation it pays them accumulation times.

Communication is not overlapped with compute, predict's assumption for a run without phase timing (ZeRO-0/1 reduce
after backward). A configuration whose communication alone exceeds another's whole step is slower whatever overlap
it reaches; the reasons ds-tune prints say so where it holds.

Compute per sequence is the same for every row but the checkpointed ones, so the MFU (--mfu, an assumption the output
prints) scales every row's compute alike and decides only how checkpointing weighs against communication. A model
of several towers (BridgeTower: text and image tokens) has no single token count: its rows are ranked on
communication alone, with the checkpointed ones last.
"""
from __future__ import annotations

from dataclasses import dataclass

from ds_core.device import accelerators
from ds_tools import fabrics, predict
from ds_tools.zero_memory_model import ModelShape, TuningError

# 6 FLOPs per parameter and token for forward + backward (Kaplan et al. 2020, "Scaling Laws for Neural Language
# Models", C = 6 N per token); a checkpointed run repeats the forward, 2 of the 6
RECOMPUTE = 4 / 3
# rows whose step times differ by less than this are equally fast: the model is not finer than that
SAME_SPEED = 0.005


@dataclass(frozen=True)
class StepTime:
    compute_s: float | None      # None: no compute figure (no peak for the precision, or a model of several towers)
    comm_s: float

    @property
    def total_s(self) -> float:
        return (self.compute_s or 0.0) + self.comm_s


@dataclass(frozen=True)
class TimeModel:
    """What step times are computed from: the fabric (None: no fabric for this accelerator, no step times), the
    accelerator's dense peak for the precision (None: not published) and the assumed MFU."""
    fabric: fabrics.Fabric | None
    peak_tflops: float | None
    mfu: float
    ranks_per_node: int
    nodes: int

    def describe(self, shape: ModelShape) -> str:
        if self.fabric is None:
            return ("Step time: not modelled (no fabric for this accelerator; give --fabric): rows ranked by memory "
                    "and stage only.")
        f = self.fabric
        if not self.peak_tflops:
            comp = ("compute not modelled (no published peak for this precision): rows ranked on communication, "
                    "checkpointed rows last")
        elif len(shape.towers) > 1:
            comp = (f"compute not modelled ({shape.name} has {len(shape.towers)} towers of different token counts): "
                    "rows ranked on communication, checkpointed rows last")
        else:
            comp = (f"compute = 6 x parameters x tokens per sequence (x 4/3 with activation checkpointing) at "
                    f"{100 * self.mfu:.0f} % of the {self.peak_tflops:g} TFLOPs dense peak (--mfu, assumed)")
        return (f"Step time = compute + communication, not overlapped: {comp}; communication = the collectives "
                f"DeepSpeed issues for the stage, as `ds-scaling-report predict` models them, on fabric {f.name} "
                f"(efficiency factor {f.efficiency}, {f.calibrated_on or 'not calibrated: line rate'}).")


def time_model(accelerator: str, ranks_per_node: int, nodes: int, precision: str, fabric: str | None,
               mfu: float) -> TimeModel:
    """The fabric named by --fabric, else the one the accelerator's system is (dl1 for gaudi); none for cpu or an
    accelerator no modelled system is built from."""
    if not 0 < mfu <= 1:
        raise TuningError(f"--mfu {mfu}: expected a fraction in (0, 1]")
    fab = None
    if fabric:
        try:
            fab = fabrics.lookup(fabric)
        except ValueError as e:
            raise TuningError(str(e)) from None
    else:
        try:
            fab = fabrics.lookup(accelerator)
        except ValueError:
            fab = None
    try:
        peak = accelerators.get(accelerator).peak_tflops(precision)
    except accelerators.UnknownAcceleratorError:
        peak = None
    return TimeModel(fab, peak, mfu, ranks_per_node, nodes)


def step_time(tm: TimeModel, shape: ModelShape, stage: int, micro: int, accum: int, checkpointing: bool,
              precision: str) -> StepTime | None:
    if tm.fabric is None:
        return None
    comm = predict.comm_seconds(predict.collectives(stage, precision, shape.params, accum), tm.fabric,
                                tm.ranks_per_node, tm.nodes)
    compute = None
    if tm.peak_tflops and len(shape.towers) == 1:
        flops = 6 * shape.params * shape.towers[0].seq * micro * accum * (RECOMPUTE if checkpointing else 1.0)
        compute = flops / (tm.peak_tflops * 1e12 * tm.mfu)
    return StepTime(compute, comm)
