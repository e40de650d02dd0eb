"""The step-time model behind `ds-scaling-report predict` and ds-tune: the collectives DeepSpeed issues per
optimizer step for a ZeRO stage, their alpha-beta cost on a fabric (ds_tools.fabrics), and a step at N nodes from
one measured run.

Per optimizer step and rank (B = micro_batch x grad_accum sequences):

    T(N)       = compute(N) + wait(N) + exposed(N)
    exposed(N) = exposed(measured) + (1 - overlap) (comm(N) - comm(measured))

  * compute, wait: the measured step minus its exposed communication (and, with phase timing, the measured wait for
    the slowest rank), per sequence, times B(N). With a global batch, grad_accum follows N (strong scaling of the
    accumulation, as NVIDIA's and Habana's BERT recipes do); without it, B stays the measured one.
  * comm(N): the collectives DeepSpeed 0.19 issues for the stage (`collectives`, file:line cited), or those a
    published run of another framework issued (`predict(collectives_of=...)`), costed by ds_tools.fabrics.
  * overlap: from the measured run's phase timing (ds_core.outputs.phases: phase_comm_s is the exposed part of the
    modelled comm at the measured scale); without phase timing, 0 (stage 0/1 reduce after backward, at the
    accumulation boundary: engine.py:3089, nothing to hide behind) and the output says it was assumed. Exposed
    communication is (1 - overlap) comm(N), never more than comm(N): a measured exposed part beyond the modelled
    comm is not communication the model knows of, and stays in the step as compute (the output says how much).

What the fabric's two bandwidth terms are is fitted on published tables by ds_tools.calibration, and the range a
prediction carries comes from ds_tools.validation; ds_tools.predict is the command line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ds_tools import fabrics

DS = "deepspeed 0.19.8"
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
AR_BUCKET = 500_000_000        # engine.py:151 MEMORY_OPT_ALLREDUCE_SIZE; zero/config.py:113 reduce_bucket_size 5e8
PREFETCH_BUCKET = 50_000_000   # zero/config.py:222 stage3_prefetch_bucket_size 5e7


class PredictError(ValueError):
    """Bad input to predict; the message names the flag or file."""


@dataclass
class Collective:
    kind: str          # all_reduce | all_gather | reduce_scatter
    nbytes: float      # full buffer
    calls: int         # buckets (latency terms)
    per_step: int      # times per optimizer step
    why: str           # the DeepSpeed code that issues it


def collectives(stage: int, precision: str, params: int, grad_accum: int, *, param_groups: int = 1,
                small_calls: int = 0) -> list[Collective]:
    """What DeepSpeed 0.19 moves per optimizer step for data parallelism with this stage and precision.

    Gradients travel in communication_data_type (engine.py:1719: fp16/bf16 when enabled, else fp32); parameters in
    their 16-bit (or fp32) dtype. `param_groups`: the optimizer's parameter groups (ZeRO 1/2 gather each group's
    partitions in its own call). `small_calls`: scalar collectives per optimizer step besides these (overflow check,
    gradient norm, a model's own, e.g. LAMB's per-layer norms), counted in a measured run: latency only."""
    if precision not in BYTES:
        raise PredictError(f"--precision {precision!r}: expected one of {sorted(BYTES)}")
    small = [Collective("all_reduce", 0, small_calls, 1, "scalar all-reduces per step, counted in the measured run "
                        "(runtime/utils.py:258-267 overflow check, :418 gradient norm, ...)")] \
        if small_calls > 0 else []
    c = p = BYTES[precision]
    g = params * c
    ar_calls = max(1, math.ceil(params / AR_BUCKET))
    if stage == 0:
        return [Collective("all_reduce", g, ar_calls, 1,
                           "engine.py:3089-3097 at the accumulation boundary: buffered_allreduce_fallback "
                           "(engine.py:3921) -> allreduce_bucket (engine.py:3795), 5e8-element buckets"), *small]
    gather = Collective("all_gather", params * p, max(1, param_groups), 1,
                        "updated 16-bit partitions: all_gather_dp_groups (stage_1_and_2.py:3155, "
                        "bf16_optimizer.py:599) -> all_gather_into_tensor (utils.py:1021), one call per group")
    if stage == 1:
        # ZeRO optimizer: average_tensor buckets to all-reduce (use_multi_rank_bucket_allreduce=True,
        # zero/config.py:119; stage_1_and_2.py:1695); bf16 + fp32 accumulation = BF16_Optimizer (engine.py:2305),
        # reduced by buffered_allreduce_fallback: an all-reduce of the full gradient either way
        return [Collective("all_reduce", g, ar_calls, 1,
                           "engine.py:3089-3092 reduce_gradients at the boundary (stage_1_and_2.py:958, :1695 "
                           "multi-rank bucket all-reduce) or BF16_Optimizer's buffered_allreduce_fallback"), gather,
                *small]
    if stage == 2:
        return [Collective("all_reduce", g, ar_calls, grad_accum,
                           "engine.py:3084-3085: stage 2 reduces every micro-step (ipg buckets of "
                           "reduce_bucket_size, stage_1_and_2.py:2205 -> average_tensor :1695)"), gather, *small]
    if stage == 3:
        calls = max(1, math.ceil(params / PREFETCH_BUCKET))
        return [Collective("all_gather", params * p, calls, 2 * grad_accum,
                           "parameters gathered in forward and again in backward, every micro-step "
                           "(partitioned_param_coordinator.py:609 all_gather_coalesced)"),
                Collective("reduce_scatter", g, ar_calls, grad_accum,
                           "gradients reduce-scattered every micro-step (stage3.py:1931 reduce_scatter_coalesced)"),
                *small]
    raise PredictError(f"--zero_stage {stage}: expected 0, 1, 2 or 3")


def comm_seconds(colls: Sequence[Collective], fab: fabrics.Fabric, per_node: int, nodes: int) -> float:
    t = 0.0
    for c in colls:
        f = fabrics.all_reduce_s if c.kind == "all_reduce" else fabrics.gather_s
        t += c.per_step * f(fab, c.nbytes, per_node, nodes, c.calls)
    return t


@dataclass
class Measured:
    nodes: int
    per_node: int
    seq_per_s: float                 # whole job
    grad_accum: int
    phases: dict | None = None       # ds_core.outputs.phases summary seconds


def accumulation(micro: int, per_node: int, nodes: int, grad_accum: int, global_batch: int | None) -> int:
    if not global_batch:
        return grad_accum
    per = micro * per_node * nodes
    if global_batch % per:
        raise PredictError(f"--global_batch {global_batch} is not a multiple of micro_batch x accelerators "
                           f"= {micro} x {per_node * nodes}")
    return global_batch // per


def predict(m: Measured, fab: fabrics.Fabric, *, params: int, stage: int, precision: str, micro: int,
            nodes: Sequence[int], global_batch: int | None = None, param_groups: int = 1,
            small_calls: int = 0, collectives_of: Callable[[int], list] | None = None) -> dict:
    """Rows per node count plus the model's assumptions (overlap, collectives, factor, per-call cost).
    collectives_of(grad_accum): the collectives of one optimizer step, where they are not DeepSpeed 0.19's for the
    stage (a published run of another framework or release: ds_tools.calibration)."""
    calls = dict(param_groups=param_groups, small_calls=small_calls)
    colls_of = collectives_of or (lambda g: collectives(stage, precision, params, g, **calls))
    a = m.per_node
    b0 = micro * m.grad_accum
    t0 = b0 * m.nodes * a / m.seq_per_s                       # measured optimizer step, seconds
    comm0 = comm_seconds(colls_of(m.grad_accum), fab, a, m.nodes)
    wait0, excess = 0.0, 0.0
    if m.phases:
        total = sum(m.phases.values())
        measured_exposed = t0 * m.phases["phase_comm_s"] / total
        wait0 = t0 * m.phases["phase_wait_s"] / total
        # exposed comm is at most the modelled comm; what the run exposed beyond it stays in the step as compute
        exposed0 = min(measured_exposed, comm0)
        excess = measured_exposed - exposed0
        overlap = 1 - exposed0 / comm0 if comm0 > 0 else 0.0
        overlap_src = ("measured: exposed comm %.4f s of modelled %.4f s" % (measured_exposed, comm0) if comm0 > 0
                       else "assumed 0: the measured run has no communication to compare with")
        if excess > 0:
            overlap_src += ("; the %.4f s exposed beyond the modelled comm is not communication the model knows of "
                            "and is kept in the step as compute" % excess)
    else:
        overlap, exposed0 = 0.0, comm0
        overlap_src = "assumed 0 (no phase timing in the measured run)"
    per_seq = (t0 - exposed0 - wait0) / b0
    if per_seq <= 0:
        raise PredictError(f"the modelled communication at {m.nodes} node(s) ({comm0:.3f} s) exceeds the measured "
                           f"step ({t0:.3f} s): the fabric ({fab.name}) is slower than the measured run's")
    wait_seq = wait0 / b0
    base_per_acc = m.seq_per_s / (m.nodes * a)
    rows = []
    for n in nodes:
        g = accumulation(micro, a, n, m.grad_accum, global_batch)
        b = micro * g
        comm = comm_seconds(colls_of(g), fab, a, n)
        # (1 - overlap) comm(N): at the measured scale the measured exposed part (exposed0), so the measured point
        # is reproduced exactly; never above comm(N)
        exposed = (1 - overlap) * comm
        step = (per_seq + wait_seq) * b + exposed
        per_acc = b / step
        rows.append({"nodes": n, "accelerators": n * a, "grad_accum": g, "seq_per_s": per_acc * n * a,
                     "per_accelerator": per_acc, "efficiency": per_acc / base_per_acc, "step_s": step,
                     "comm_s": comm, "exposed_comm_s": exposed})
    return {"fabric": fab.name, "intra_efficiency": fab.eta_intra, "inter_efficiency": fab.eta_inter,
            "calibrated_on": fab.calibrated_on, "fabric_source": fab.source, "call_us": fab.call_us, "overlap": overlap,
            "overlap_source": overlap_src, "params": params, "zero_stage": stage, "precision": precision,
            "measured_nodes": m.nodes, "measured_seq_per_s": m.seq_per_s, "deepspeed": DS,
            "collectives": [c.__dict__ for c in colls_of(m.grad_accum)],
            "rows": rows}
