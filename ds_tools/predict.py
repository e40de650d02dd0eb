"""`ds-scaling-report predict`: throughput and scaling efficiency at N nodes, from one measured run and a fabric.

    ds-scaling-report predict --from runs/bert_n1 --fabric dgx-a100 --nodes 1 2 4 8 16 32
    ds-scaling-report predict --measured 4553 --measured_nodes 1 --model bert-large --precision fp16 \\
        --zero_stage 0 --micro_batch 64 --global_batch 65536 --fabric dgx-a100 --nodes 2 4 8 --format json

The model, per optimizer step and rank (B = micro_batch x grad_accum sequences):

    T(N)       = compute(N) + wait(N) + exposed(N)
    exposed(N) = exposed(measured) + (1 - overlap) (comm(N) - comm(measured))

  * compute, wait: the measured step minus its exposed communication (and, with phase timing, the measured wait for
    the slowest rank), per sequence, times B(N). With --global_batch, grad_accum follows N (strong scaling of the
    accumulation, as NVIDIA's and Habana's BERT recipes do); without it, B stays the measured one.
  * comm(N): the collectives DeepSpeed 0.19 issues for the stage (`collectives`, file:line cited), costed by
    ds_tools.fabrics (hierarchical ring, NCCL bus bandwidth, one efficiency factor per fabric).
  * overlap: from the measured run's phase timing (ds_core.outputs.phases: phase_comm_s is the exposed part of the
    modelled comm at the measured scale); without phase timing, 0 (stage 0/1 reduce after backward, at the
    accumulation boundary: engine.py:3089, nothing to hide behind) and the output says it was assumed. Exposed
    communication is (1 - overlap) comm(N), never more than comm(N): a measured exposed part beyond the modelled
    comm is not communication the model knows of, and stays in the step as compute (the output says how much).
  * interval: from the calibration's residuals (`calibration`): the published table's node counts predicted from its
    1-node figure with the fitted factor, their relative errors r_i (n of them, one parameter fitted), and the 95 %
    prediction interval  +- t(0.975, n-1) s sqrt(1 + 1/n),  s = sqrt(sum r_i^2 / (n-1)), on the predicted
    throughput and efficiency. None for a fabric fitted to nothing. The output says when a node count lies beyond
    the calibrated ones, or the model is not the one the factor was fitted on: the interval is the calibration's
    spread there, not a bound.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ds_core.cli import ArgumentParser, cli_main, flag, json_stdout
from ds_tools import fabrics, scaling_explain as explain
from ds_tools.intervals import t975
from ds_tools.scaling import ScalingError, summary_of

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


def _accum(micro: int, per_node: int, nodes: int, grad_accum: int, global_batch: int | None) -> int:
    if not global_batch:
        return grad_accum
    per = micro * per_node * nodes
    if global_batch % per:
        raise PredictError(f"--global_batch {global_batch} is not a multiple of micro_batch x accelerators "
                           f"= {micro} x {per_node * nodes}")
    return global_batch // per


def predict(m: Measured, fab: fabrics.Fabric, *, params: int, stage: int, precision: str, micro: int,
            nodes: Sequence[int], global_batch: int | None = None, param_groups: int = 1,
            small_calls: int = 0) -> dict:
    """Rows per node count plus the model's assumptions (overlap, collectives, factor, per-call cost)."""
    calls = dict(param_groups=param_groups, small_calls=small_calls)
    a = m.per_node
    b0 = micro * m.grad_accum
    t0 = b0 * m.nodes * a / m.seq_per_s                       # measured optimizer step, seconds
    comm0 = comm_seconds(collectives(stage, precision, params, m.grad_accum, **calls), fab, a, m.nodes)
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
        g = _accum(micro, a, n, m.grad_accum, global_batch)
        b = micro * g
        comm = comm_seconds(collectives(stage, precision, params, g, **calls), fab, a, n)
        # (1 - overlap) comm(N): at the measured scale the measured exposed part (exposed0), so the measured point
        # is reproduced exactly; never above comm(N)
        exposed = (1 - overlap) * comm
        step = (per_seq + wait_seq) * b + exposed
        per_acc = b / step
        rows.append({"nodes": n, "accelerators": n * a, "grad_accum": g, "seq_per_s": per_acc * n * a,
                     "per_accelerator": per_acc, "efficiency": per_acc / base_per_acc, "step_s": step,
                     "comm_s": comm, "exposed_comm_s": exposed})
    return {"fabric": fab.name, "efficiency_factor": fab.efficiency, "calibrated_on": fab.calibrated_on or
            "not calibrated (1.0 = line rate)", "fabric_source": fab.source, "call_us": fab.call_us, "overlap": overlap,
            "overlap_source": overlap_src, "params": params, "zero_stage": stage, "precision": precision,
            "measured_nodes": m.nodes, "measured_seq_per_s": m.seq_per_s, "deepspeed": DS,
            "collectives": [c.__dict__ for c in collectives(stage, precision, params, m.grad_accum, **calls)],
            "rows": rows}


# ---------------------------------------------------------------------------------------- published tables

# (fabric, per node, model, precision, stage, micro, global batch, {nodes: seq/s}, source)
PUBLISHED = {
    "dgx-a100": dict(per_node=8, model="bert-large", precision="fp16", stage=0, micro=64, global_batch=65536,
                     table={1: 4553, 2: 9191, 4: 18119, 8: 35774, 16: 70555, 32: 138294},
                     source="NVIDIA DeepLearningExamples PyTorch BERT README, DGX A100 80GB multi-node, phase 1, "
                            "mixed precision, seq 128"),
    "dl1": dict(per_node=8, model="bert-large", precision="bf16", stage=0, micro=64, global_batch=65536,
                table={1: 1379.76, 2: 2705.57, 4: 5291.58, 8: 9977.54},
                source="Habana BERT-Large on 1/2/4/8 dl1.24xlarge (8 Gaudi each), phase 1, seq 128"),
}


def published_prediction(name: str, efficiency: float | None = None, params: int | None = None) -> dict:
    spec = PUBLISHED[name]
    fab = fabrics.FABRICS[name]
    if efficiency is not None:
        fab = fabrics.Fabric(**{**fab.__dict__, "efficiency": efficiency})
    if params is None:
        from ds_tools.model_shapes import model_shape

        params = model_shape(spec["model"], 128).params
    t = spec["table"]
    m = Measured(nodes=1, per_node=spec["per_node"], seq_per_s=t[1],
                 grad_accum=spec["global_batch"] // (spec["micro"] * spec["per_node"]))
    return predict(m, fab, params=params, stage=spec["stage"], precision=spec["precision"], micro=spec["micro"],
                   nodes=sorted(t), global_batch=spec["global_batch"])


def calibrate(name: str, params: int | None = None) -> float:
    """The efficiency factor that minimises the squared efficiency error over the published table (log grid)."""
    t = PUBLISHED[name]["table"]
    base = t[1] / PUBLISHED[name]["per_node"]

    def err(eta: float) -> float:
        rows = published_prediction(name, eta, params)["rows"]
        return sum((r["efficiency"] - t[r["nodes"]] / (r["accelerators"]) / base) ** 2 for r in rows)

    grid = [10 ** (-3 + 3.2 * i / 640) for i in range(641)]      # 0.001 .. ~1.6
    return round(min(grid, key=err), 3)


def _model_key(name: str) -> str:
    """One spelling per model: the preset name a run's summary records (bert_1p5b), whatever alias or path named it."""
    from ds_tools.model_shapes import MODEL_ALIASES

    return MODEL_ALIASES.get(name, Path(name).stem if name.endswith(".json") else name)


def calibration(fab: fabrics.Fabric) -> dict | None:
    """The fit of the fabric's factor on its published table: the relative errors of the node counts predicted from
    the 1-node figure, and the 95 % prediction interval they give (relative half-width). None where the fabric, as
    given, was fitted on nothing (no published table, or its factor or per-call cost changed on the command line)."""
    if fab.name not in PUBLISHED or fab != fabrics.FABRICS.get(fab.name):
        return None
    spec = PUBLISHED[fab.name]
    from ds_tools.model_shapes import model_shape

    params = model_shape(spec["model"], 128).params
    rows = published_prediction(fab.name, params=params)["rows"]
    resid = {r["nodes"]: r["seq_per_s"] / spec["table"][r["nodes"]] - 1 for r in rows if r["nodes"] != 1}
    n = len(resid)
    s = math.sqrt(sum(x * x for x in resid.values()) / (n - 1))       # one parameter (the factor) fitted
    return {"fabric": fab.name, "model": _model_key(spec["model"]), "params": params, "nodes": sorted(spec["table"]),
            "residuals": resid, "df": n - 1, "rel_half": t975(n - 1) * s * math.sqrt(1 + 1 / n)}


def with_interval(res: dict, fab: fabrics.Fabric, *, model: str | None, kept_accum: bool) -> dict:
    """The rows' 95 % intervals from the calibration's residuals, and the notes a reader needs to weigh them:
    node counts beyond the calibrated ones, a model other than the one the factor was fitted on, an accumulation
    kept at the measured one. model: the predicted model's name (None: given by --params)."""
    cal = calibration(fab)
    notes = []
    for r in res["rows"]:
        h = None if cal is None or r["nodes"] == res["measured_nodes"] else cal["rel_half"]
        r["interval_rel"] = h
        for k in ("seq_per_s", "efficiency"):
            r[f"{k}_low"] = None if h is None else r[k] * (1 - h)
            r[f"{k}_high"] = None if h is None else r[k] * (1 + h)
        r["extrapolated"] = cal is not None and r["nodes"] > max(cal["nodes"])
    if cal is None:
        notes.append(f"No interval: fabric {fab.name}'s factor {fab.efficiency} is fitted to no measurement "
                     f"({fab.calibrated_on or 'line rate'}); the rows are the model's figures alone.")
        res.update(calibration=None, notes=notes)
        return res
    resid = ", ".join(f"{n} nodes {100 * x:+.2f} %" for n, x in cal["residuals"].items())
    notes.append(f"Interval: 95 % prediction interval +-{100 * cal['rel_half']:.1f} % of the predicted throughput "
                 f"and efficiency, from the calibration's residuals ({cal['model']} on {fab.name}: {resid}; "
                 f"t(0.975, {cal['df']}) s sqrt(1 + 1/{len(cal['residuals'])})); the measured node count carries "
                 f"its measurement's own uncertainty only.")
    beyond = [r["nodes"] for r in res["rows"] if r["extrapolated"]]
    if beyond:
        notes.append(f"Extrapolated: {', '.join(map(str, beyond))} node(s) lie beyond the calibrated "
                     f"{min(cal['nodes'])}-{max(cal['nodes'])} nodes; the interval there is the calibration's "
                     "spread carried over, not a bound.")
    if (model is None and res["params"] != cal["params"]) or (model is not None and _model_key(model) != cal["model"]):
        what = f"{_model_key(model)} ({res['params'] / 1e6:.1f} M parameters)" if model else \
            f"a model of {res['params'] / 1e6:.1f} M parameters (--params)"
        notes.append(f"Across models: the factor was fitted on {cal['model']} ({cal['params'] / 1e6:.1f} M "
                     f"parameters); this predicts {what}, {res['params'] / cal['params']:.2f}x the bytes per "
                     "collective, with the same factor assumed.")
    if kept_accum:
        notes.append(f"Accumulation kept at the measured {res['rows'][0]['grad_accum']} at every node count (no "
                     "--global_batch): the global batch grows with the nodes.")
    res.update(calibration={**cal, "residuals": {str(k): v for k, v in cal["residuals"].items()}}, notes=notes)
    return res


# ------------------------------------------------------------------------------------------------- output

_COLS = ("nodes", "accelerators", "grad_accum", "seq_per_s", "seq_per_s_low", "seq_per_s_high", "per_accelerator",
         "efficiency", "efficiency_low", "efficiency_high", "comm_s", "exposed_comm_s", "extrapolated")


def _interval_cell(r: dict, res: dict, key: str, scale: float) -> str:
    if r["nodes"] == res["measured_nodes"]:
        return "measured"
    if r.get(f"{key}_low") is None:
        return "none"
    return f"{scale * r[f'{key}_low']:.2f}-{scale * r[f'{key}_high']:.2f}"


def format_md(res: dict) -> str:
    out = [f"Fabric {res['fabric']}: efficiency factor {res['efficiency_factor']} ({res['calibrated_on']}); "
           + (f"per-call cost {res['call_us']:.1f} us; " if res.get("call_us") else "") +
           f"overlap {res['overlap']:.2f} ({res['overlap_source']}); {res['params'] / 1e6:.1f} M parameters, "
           f"ZeRO-{res['zero_stage']}, {res['precision']}; measured {res['measured_seq_per_s']:.2f} seq/s at "
           f"{res['measured_nodes']} node(s); collectives of {res['deepspeed']}:"]
    out += [f"  * {c['kind']} {c['nbytes'] / 1e6:.1f} MB in {c['calls']} call(s) x {c['per_step']} per step "
            f"({c['why']})"
            for c in res["collectives"]]
    out += ["", "| nodes | accelerators | grad accum | predicted sequences/s | 95 % interval | per accelerator | "
                "efficiency % | 95 % interval | comm s/step | exposed comm s/step |", "|" + "---:|" * 10]
    for r in res["rows"]:
        nodes = f"{r['nodes']} (extrapolated)" if r.get("extrapolated") else str(r["nodes"])
        out.append(f"| {nodes} | {r['accelerators']} | {r['grad_accum']} | {r['seq_per_s']:.2f} | "
                   f"{_interval_cell(r, res, 'seq_per_s', 1)} | {r['per_accelerator']:.2f} | "
                   f"{100 * r['efficiency']:.2f} | "
                   f"{_interval_cell(r, res, 'efficiency', 100)} | {r['comm_s']:.4f} | {r['exposed_comm_s']:.4f} |")
    return "\n".join(out + [""] + res.get("notes", []))


def format_csv(res: dict) -> str:
    lines = [",".join(_COLS) + ",fabric,efficiency_factor,overlap"]
    for r in res["rows"]:
        lines.append(",".join(f"{r.get(k):.6g}" if isinstance(r.get(k), float) else
                              "" if r.get(k) is None else str(r[k]) for k in _COLS)
                     + f",{res['fabric']},{res['efficiency_factor']},{res['overlap']:.4f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- CLI

def _measured_from_run(path: str) -> tuple[Measured, dict]:
    p = Path(path)
    f = p / "metrics.jsonl" if p.is_dir() else p
    try:
        s = summary_of(f)
    except (ScalingError, OSError) as e:
        raise PredictError(f"--from {path}: {e}") from None
    try:
        m = Measured(nodes=int(s.get("nodes") or 1), per_node=int(s["accelerators_per_node"]),
                     seq_per_s=float(s["samples_per_s"]), grad_accum=int(s["grad_accum"]),
                     phases=explain.phases_of(s))
    except (KeyError, TypeError, ValueError) as e:
        raise PredictError(f"--from {f}: summary lacks a usable {e} (need accelerators_per_node, samples_per_s, "
                           "grad_accum)") from None
    return m, s


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(allow_abbrev=False, prog="ds-scaling-report predict", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(*flag("--from"), dest="from_run", metavar="RUN_DIR", help="measured run (its metrics.jsonl)")
    p.add_argument(*flag("--measured"), type=float, metavar="SEQ_PER_S", help="measured whole-job sequences/s")
    p.add_argument(*flag("--measured_nodes"), type=int, help="node count of --measured")
    p.add_argument("--model", help="bert-large | bert-1.5b | bridgetower-large | an HF config.json")
    p.add_argument("--params", type=int, help="parameter count instead of --model")
    p.add_argument(*flag("--seq_len"), type=int, default=0)
    p.add_argument(*flag("--micro_batch"), type=int)
    p.add_argument(*flag("--grad_accum"), type=int)
    p.add_argument(*flag("--global_batch"), type=int, help="keep this global batch: grad_accum follows the nodes")
    p.add_argument(*flag("--zero_stage"), type=int)
    p.add_argument("--precision", choices=sorted(BYTES))
    p.add_argument(*flag("--accelerators_per_node"), type=int)
    p.add_argument("--fabric", metavar="NAME",
                   help=f"{' | '.join(sorted(fabrics.FABRICS))}, or an accelerator one of them is built from, by the "
                        "names ds-tune --accelerator takes ("
                        + ", ".join(f"{x} -> {f.name}" for f in fabrics.FABRICS.values() for x in f.accelerators)
                        + "; aliases too)")
    p.add_argument(*flag("--intra_gbps"), type=float, help="custom fabric: per-accelerator intra-node Gbit/s")
    p.add_argument(*flag("--inter_gbps"), type=float, help="custom fabric: per-node scale-out Gbit/s")
    p.add_argument(*flag("--latency_us"), type=float, default=5.0, help="custom fabric: per inter-node step")
    p.add_argument(*flag("--call_us"), type=float, default=0.0,
                   help="custom fabric: the library's own cost per collective call, microseconds (measure it, e.g. "
                        "python -m ds_tools.study.linkprobe)")
    p.add_argument(*flag("--param_groups"), type=int, default=1, help="optimizer parameter groups (ZeRO 1/2: one "
                   "all-gather call each)")
    p.add_argument(*flag("--small_calls"), type=int, default=0, help="scalar collectives per optimizer step besides "
                   "the gradients' and parameters' (latency only)")
    p.add_argument("--efficiency", type=float, help="override the fabric's efficiency factor")
    p.add_argument("--nodes", type=int, nargs="+", required=True)
    p.add_argument("--format", choices=("md", "csv", "json"), default="md")
    return p


# flag -> the measured run's summary key it would override: given both, they must agree
_RUN_FIELDS = (("--accelerators_per_node", "accelerators_per_node"), ("--grad_accum", "grad_accum"),
               ("--zero_stage", "zero_stage"), ("--precision", "precision"), ("--micro_batch", "micro_batch"))


def _measured(a: argparse.Namespace) -> tuple[Measured, dict]:
    """The measured point, from --from RUN_DIR or --measured; refuses flags that contradict the run, and a
    --measured figure without the accumulation it ran at."""
    if a.from_run:
        m, summary = _measured_from_run(a.from_run)
        for name, key in _RUN_FIELDS:
            given = getattr(a, name[2:])
            if given is not None and summary.get(key) is not None and str(given) != str(summary[key]):
                raise PredictError(f"{name} {given} contradicts the measured run's {key} {summary[key]} (--from "
                                   f"{a.from_run}): drop the flag, or measure the configuration you mean")
        ran, named = summary.get("model"), a.model
        if ran and named and _model_key(named) != _model_key(str(ran)):
            raise PredictError(f"--model {named}: the measured run (--from {a.from_run}) is of model {ran}; its "
                               f"throughput says nothing about {_model_key(named)}'s compute: measure "
                               f"{_model_key(named)}, or drop --model to predict {ran}")
        return m, summary
    if not (a.measured and a.measured_nodes):
        raise PredictError("give --from RUN_DIR, or --measured SEQ_PER_S with --measured_nodes")
    if not a.accelerators_per_node:
        raise PredictError("--accelerators_per_node: needed with --measured")
    if not a.grad_accum and not a.global_batch:
        raise PredictError("--global_batch (kept at every node count, the accumulation following) or --grad_accum "
                           "(the measured run's, kept at every node count): needed with --measured, whose step, "
                           "and so the share of communication in it, depends on the accumulation")
    return Measured(nodes=a.measured_nodes, per_node=a.accelerators_per_node, seq_per_s=a.measured,
                    grad_accum=a.grad_accum or 1), {}


def _fabric(a: argparse.Namespace) -> fabrics.Fabric:
    if a.fabric:
        try:
            fab = fabrics.lookup(a.fabric)
        except ValueError as e:
            raise PredictError(str(e)) from None
        if a.efficiency is not None:
            fab = fabrics.Fabric(**{**fab.__dict__, "efficiency": a.efficiency, "calibrated_on": "--efficiency"})
        if a.call_us:
            if a.call_us < 0:
                raise PredictError(f"--call_us {a.call_us}: expected >= 0")
            fab = fabrics.Fabric(**{**fab.__dict__, "call_us": a.call_us})
        return fab
    if a.intra_gbps and a.inter_gbps:
        try:
            return fabrics.custom(a.intra_gbps, a.inter_gbps, a.latency_us, a.efficiency or 1.0, a.call_us)
        except ValueError as e:
            raise PredictError(str(e)) from None
    raise PredictError("give --fabric NAME or --intra_gbps and --inter_gbps")


def _main(a: argparse.Namespace) -> int:
    if a.format == "json":
        with json_stdout() as out:
            print(json.dumps(_predict(a), indent=2), file=out)
        return 0
    res = _predict(a)
    print({"md": format_md, "csv": format_csv}[a.format](res))
    return 0


def _predict(a: argparse.Namespace) -> dict:
    m, summary = _measured(a)
    stage = a.zero_stage if a.zero_stage is not None else summary.get("zero_stage")
    precision = a.precision or summary.get("precision")
    micro = a.micro_batch or summary.get("micro_batch")
    for name, v in (("--zero_stage", stage), ("--precision", precision), ("--micro_batch", micro)):
        if v is None:
            raise PredictError(f"{name}: not given and not in the measured run")
    if a.global_batch and not a.grad_accum and not a.from_run:
        m.grad_accum = _accum(int(micro), m.per_node, m.nodes, 1, a.global_batch)
    model = None
    if a.params:
        params = a.params
    else:
        from ds_tools.model_shapes import model_shape
        from ds_tools.zero_memory_model import TuningError

        model = a.model or summary.get("model")
        if not model:
            raise PredictError("--model or --params: needed to size the gradients")
        try:
            params = model_shape(model, a.seq_len).params
        except TuningError as e:
            raise PredictError(str(e)) from None
    fab = _fabric(a)
    res = predict(m, fab, params=params, stage=int(stage), precision=str(precision), micro=int(micro),
                  nodes=a.nodes, global_batch=a.global_batch, param_groups=a.param_groups,
                  small_calls=a.small_calls)
    return with_interval(res, fab, model=model, kept_accum=not a.global_batch)


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(argv, build_parser, _main, (PredictError, OSError))


if __name__ == "__main__":
    sys.exit(main())
