"""ds-tune's measured compute: `--measured SEQ_PER_S --measured_nodes N` with the measured run's layout, or
`--from RUN_DIR` (its metrics.jsonl summary, phase timing included), as `ds-scaling-report predict` takes them. The
run's compute per sequence, per-micro-step fixed cost and optimizer step become the tuned rows' (ds_tools.tuning_time
.measured_compute); a measured 1-node run that timed its own communication also sets the fabric's intra-node term
(ds_tools.ranges)."""
from __future__ import annotations

import argparse
import dataclasses

from ds_core.cli import flag
from ds_tools import predict, ranges
from ds_tools.model_shapes import model_shape
from ds_tools.tuning_time import TimeModel, measured_compute
from ds_tools.zero_memory_model import ModelShape, TuningError


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(*flag("--from"), dest="from_run", metavar="RUN_DIR",
                   help="a measured run (its metrics.jsonl): compute per sequence, fixed costs, its model and layout")
    p.add_argument(*flag("--measured"), type=float, metavar="SEQ_PER_S",
                   help="a measured whole-job sequences/s (with --measured_nodes and the run's layout below)")
    p.add_argument(*flag("--measured_nodes"), type=int, help="node count of --measured")
    p.add_argument(*flag("--measured_model"), help="the model --measured ran (default: --model); another model's "
                   "compute is scaled by 6 x parameters x tokens (the same MFU, assumed and said so)")
    p.add_argument(*flag("--measured_micro_batch"), type=int, help="micro batch of --measured")
    p.add_argument(*flag("--measured_grad_accum"), type=int, help="accumulation of --measured")
    p.add_argument(*flag("--measured_global_batch"), type=int, help="global batch of --measured (instead of "
                   "--measured_grad_accum)")
    p.add_argument(*flag("--measured_stage"), type=int, default=1, help="ZeRO stage of --measured (default "
                   "%(default)s): its communication is taken out of the measured step")
    p.add_argument(*flag("--micro_step_ms"), type=float,
                   help="per-micro-step fixed cost, milliseconds, stated (default: the measured run's data wait per "
                        "micro-step with phase timing, else 0, said so)")


def _from_run(a: argparse.Namespace) -> tuple:
    m, s = predict.measured_from_run(a.from_run)
    for k in ("model", "micro_batch", "zero_stage"):
        if s.get(k) is None:
            raise TuningError(f"--from {a.from_run}: the summary lacks {k}")
    if m.per_node != a.accelerators_per_node:
        raise TuningError(f"--from {a.from_run}: it ran {m.per_node} accelerators per node, --accelerators_per_node "
                          f"is {a.accelerators_per_node}: measure the layout you tune")
    return m, str(s["model"]), int(s["micro_batch"]), int(s["zero_stage"]), f"the run {a.from_run}"


def _from_flags(a: argparse.Namespace) -> tuple:
    if not a.measured_nodes:
        raise TuningError("--measured: give --measured_nodes too")
    if not a.measured_micro_batch:
        raise TuningError("--measured: give --measured_micro_batch (the micro batch it ran at: its compute per "
                          "sequence holds from that micro-step's work up)")
    if bool(a.measured_grad_accum) == bool(a.measured_global_batch):
        raise TuningError("--measured: give one of --measured_grad_accum and --measured_global_batch (its step, and so "
                          "the share of communication in it, depends on the accumulation)")
    per = a.measured_micro_batch * a.accelerators_per_node * a.measured_nodes
    accum = a.measured_grad_accum or a.measured_global_batch // per
    if a.measured_global_batch and a.measured_global_batch % per:
        raise TuningError(f"--measured_global_batch {a.measured_global_batch} is not a multiple of micro batch x "
                          f"accelerators = {per}")
    m = predict.Measured(nodes=a.measured_nodes, per_node=a.accelerators_per_node, seq_per_s=a.measured,
                         grad_accum=accum)
    model = a.measured_model or a.model
    return m, model, a.measured_micro_batch, a.measured_stage, (
        f"{a.measured:g} seq/s measured on {a.measured_nodes} node(s) x {a.accelerators_per_node} ({model}, ZeRO-"
        f"{a.measured_stage}, micro batch {a.measured_micro_batch}, accumulation {accum})")


def apply(a: argparse.Namespace, shape: ModelShape, times: TimeModel) -> TimeModel:
    """The time model with the measured compute, where one is given; unchanged otherwise."""
    if not (a.from_run or a.measured):
        return times
    if a.from_run and a.measured:
        raise TuningError("give --from RUN_DIR or --measured SEQ_PER_S, not both")
    if times.fabric is None:
        raise TuningError("--measured / --from: the measured step's communication is taken out of it on a fabric; "
                          "this accelerator has none (give --fabric)")
    m, model, micro, stage, label = _from_run(a) if a.from_run else _from_flags(a)
    mshape = model_shape(model, a.seq_len if model == a.model else 0)
    fab, corners, how = times.fabric, times.corners, times.terms_from
    if m.phases and m.nodes == 1 and stage in (0, 1):
        colls = predict.collectives(stage, a.precision, mshape.params, m.grad_accum)
        tr = ranges.terms(fabrics_of(fab), m, colls, micro * m.grad_accum * m.per_node / m.seq_per_s)
        fab, corners, how = tr.central, tr.corners, tr.intra_from
    known = measured_compute(m, shape=shape, measured_shape=mshape, stage=stage, micro=micro, precision=a.precision,
                             fab=fab, corners=corners, fixed_ms=a.micro_step_ms, label=label)
    return dataclasses.replace(times, fabric=fab, corners=corners, measured=known, terms_from=how)


def fabrics_of(central):
    """The published fabric a central one was built from (ranges.terms takes the line-rate one)."""
    from ds_tools import fabrics

    return fabrics.FABRICS.get(central.name, central)
