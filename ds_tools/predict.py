"""`ds-scaling-report predict`: throughput and scaling efficiency at N nodes, from one measured run and a fabric.

    ds-scaling-report predict --from runs/bert_n1 --fabric dgx-a100 --nodes 1 2 4 8 16 32
    ds-scaling-report predict --measured 4553 --measured_nodes 1 --model bert-large --precision fp16 \\
        --zero_stage 0 --micro_batch 256 --global_batch 65536 --fabric dgx-a100 --nodes 2 4 8 --format json

The step-time model is ds_tools.comm_model (compute and wait from the measured run, the collectives DeepSpeed issues
for the stage, their cost on the fabric). What the fabric's intra- and inter-node terms are comes from the published
tables (ds_tools.published) as ds_tools.calibration fits them, fitting only what a table identifies and saying what
it fitted on; each row's range (in-sample interval, margin from out-of-sample errors, or none) is ds_tools.ranges'.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from ds_core.cli import ArgumentParser, cli_main, flag, json_stdout
from ds_tools import fabrics, scaling_explain as explain

# the model's names, read through this module by ds-tune, the emulated-fabric study and the tests
from ds_tools.comm_model import (  # noqa: F401
    BYTES,
    DS,
    Collective,
    Measured,
    PredictError,
    accumulation,
    collectives,
    comm_seconds,
    predict,
)
from ds_tools.scaling import ScalingError, summary_of


def _model_key(name: str) -> str:
    """One spelling per model: the preset name a run's summary records (bert_1p5b), whatever alias or path named it."""
    from ds_tools.model_shapes import MODEL_ALIASES

    return MODEL_ALIASES.get(name, Path(name).stem if name.endswith(".json") else name)


def kept_accum_note(res: dict) -> str:
    return (f"Accumulation kept at the measured {res['rows'][0]['grad_accum']} at every node count (no "
            "--global_batch): the global batch grows with the nodes.")


# ------------------------------------------------------------------------------------------------- output

_COLS = ("nodes", "accelerators", "grad_accum", "seq_per_s", "seq_per_s_low", "seq_per_s_high", "per_accelerator",
         "efficiency", "efficiency_low", "efficiency_high", "range_kind", "range_points", "param_low", "param_high",
         "comm_s", "exposed_comm_s", "extrapolated")


def _range_cell(r: dict, key: str, scale: float) -> str:
    if r["range_kind"] == "measured":
        return "measured"
    if r.get(f"{key}_low") is None:
        return "none"
    return f"{scale * r[f'{key}_low']:.2f}-{scale * r[f'{key}_high']:.2f}"


def _kind_cell(r: dict) -> str:
    if r["range_kind"] == "margin":
        return f"margin +-{r['range_points']:.2f}" + (f", {r['doublings']:.0f} doubling(s) out" if r["doublings"]
                                                      else "")
    if r["range_kind"].startswith("in-sample"):
        return f"in-sample +-{r['range_points']:.2f}"
    return r["range_kind"]


def format_md(res: dict) -> str:
    f = res["fabric"]
    out = [f"Fabric {f}: intra factor {res['intra_efficiency']:.3f}, inter factor {res['inter_efficiency']:.3f} of "
           f"the line rates ({'calibrated: see below' if res['calibrated_on'] else 'not calibrated'}); "
           + (f"per-call cost {res['call_us']:.1f} us; " if res.get("call_us") else "") +
           f"overlap {res['overlap']:.2f} ({res['overlap_source']}); {res['params'] / 1e6:.1f} M parameters, "
           f"ZeRO-{res['zero_stage']}, {res['precision']}; measured {res['measured_seq_per_s']:.2f} seq/s at "
           f"{res['measured_nodes']} node(s); collectives of {res['deepspeed']}:"]
    out += [f"  * {c['kind']} {c['nbytes'] / 1e6:.1f} MB in {c['calls']} call(s) x {c['per_step']} per step "
            f"({c['why']})"
            for c in res["collectives"]]
    out += ["", "| nodes | accelerators | grad accum | predicted sequences/s | range | per accelerator | "
                "efficiency % | range | range is | comm s/step | exposed comm s/step |", "|" + "---:|" * 8 + ":---|"
            + "---:|" * 2]
    for r in res["rows"]:
        nodes = f"{r['nodes']} (extrapolated)" if r.get("extrapolated") else str(r["nodes"])
        out.append(f"| {nodes} | {r['accelerators']} | {r['grad_accum']} | {r['seq_per_s']:.2f} | "
                   f"{_range_cell(r, 'seq_per_s', 1)} | {r['per_accelerator']:.2f} | {100 * r['efficiency']:.2f} | "
                   f"{_range_cell(r, 'efficiency', 100)} | {_kind_cell(r)} | {r['comm_s']:.4f} | "
                   f"{r['exposed_comm_s']:.4f} |")
    return "\n".join(out + [""] + res.get("notes", []))


def format_csv(res: dict) -> str:
    lines = [",".join(_COLS) + ",fabric,intra_efficiency,inter_efficiency,overlap"]
    for r in res["rows"]:
        lines.append(",".join(f"{r.get(k):.6g}" if isinstance(r.get(k), float) else
                              "" if r.get(k) is None else str(r[k]) for k in _COLS)
                     + f",{res['fabric']},{res['intra_efficiency']:.6g},{res['inter_efficiency']:.6g},"
                       f"{res['overlap']:.4f}")
    return "\n".join(lines)


def notes_of(res: dict, fab: fabrics.Fabric, model: str | None, kept_accum: bool) -> list:
    """What a reader needs to weigh the rows: what was fitted on what, how the intra-node term was decided, what
    the range is, and where a row lies outside what the calibration saw."""
    notes = []
    if res.get("calibration") is None:
        notes.append(f"No range: fabric {fab.name} is calibrated on no published table here (its factors: intra "
                     f"{fab.eta_intra:g}, inter {fab.eta_inter:g} of the line rates, "
                     f"{fab.calibrated_on or 'given, not fitted'}); the rows are the model's figures alone.")
    else:
        notes.append("Calibration: " + res["calibration"] + ".")
        notes.append("Intra-node term: " + res["intra_from"] + "; " + "; ".join(res["terms_notes"] or ["-"]) + ".")
        notes.append("Range: " + (res["margin"] or "no out-of-sample case on this fabric: the parameter range alone")
                     + "; the parameter range is every corner of what the fit leaves open (the tables' w, the "
                       "split of w between the terms); an in-sample 95 % interval only for a calibration table's "
                       "own model, stage, gradient bytes, schedule and node counts.")
        if res.get("unpredictable"):
            notes.append("No range: " + res["unpredictable"] + ".")
        beyond = [str(r["nodes"]) for r in res["rows"] if r.get("extrapolated")]
        if beyond:
            notes.append(f"Extrapolated: {', '.join(beyond)} node(s) lie outside the calibrated node counts; the "
                         "margin grows with each doubling beyond them.")
    if kept_accum:
        notes.append(kept_accum_note(res))
    return notes


# ---------------------------------------------------------------------------------------------------- CLI

def measured_from_run(path: str) -> tuple[Measured, dict]:
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
    p.add_argument("--efficiency", type=float, help="both terms' factor of the line rates, instead of the calibration "
                   "(no range then: fitted to nothing)")
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
        m, summary = measured_from_run(a.from_run)
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
        elif a.call_us:
            raise PredictError("--call_us on a calibrated fabric: its fit absorbs the per-call cost; give --efficiency "
                               "too (a fabric of your own, no range) or a custom fabric (--intra_gbps, --inter_gbps)")
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
        m.grad_accum = accumulation(int(micro), m.per_node, m.nodes, 1, a.global_batch)
    model, seq = None, None
    if a.params:
        params = a.params
    else:
        from ds_tools.model_shapes import model_shape
        from ds_tools.zero_memory_model import TuningError

        model = a.model or summary.get("model")
        if not model:
            raise PredictError("--model or --params: needed to size the gradients")
        try:
            shape = model_shape(model, a.seq_len)
        except TuningError as e:
            raise PredictError(str(e)) from None
        params, seq = shape.params, shape.towers[0].seq
    fab = _fabric(a)
    from ds_tools.ranges import ranged

    res = ranged(m, fab, params=params, stage=int(stage), precision=str(precision), micro=int(micro), nodes=a.nodes,
                 global_batch=a.global_batch, model=_model_key(model) if model else None, seq_len=seq,
                 param_groups=a.param_groups, small_calls=a.small_calls)
    res["notes"] = notes_of(res, fab, model, kept_accum=not a.global_batch)
    return res


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(argv, build_parser, _main, (PredictError, OSError))


if __name__ == "__main__":
    sys.exit(main())
