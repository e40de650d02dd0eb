"""ZeRO config recommendation: the fastest (ZeRO stage, micro batch, grad accumulation) that fits a model.

Memory per rank, with Adam(W): every buffer DeepSpeed 0.19 allocates for the configuration, held between steps plus
the largest phase of a step (ds_tools.zero_memory_model.estimate; each component names its deepspeed/runtime/ file
and line; bench/zero_memory.py measures it), and activations per micro batch (zero_memory_model.activation_bytes),
against the accelerator's capacity in GiB (ds_core.device.accelerators: the vendor's HBM as the device has it; cpu:
the node's RAM over its ranks) less 8 % for allocator fragmentation and runtime context. Headroom rule (printed):
recommended rows keep 10 % of their own predicted peak free, the memory model's accuracy target.

Step time per row (ds_tools.tuning_time): compute plus the communication `ds-scaling-report predict` models for the
fabric (ZeRO-3's parameter gathers every micro step included); the recommendation is the fastest row that keeps the
headroom rule, and every other row says why it is not the one.

Models: the presets' descriptions in ds_configs/models/ (written by the model packages, see MODEL_DIR) or any HF
config.json.

    ds-tune --model bert-1.5b --accelerator dl1 --accelerators_per_node 8 --nodes 8 --global_batch 12288
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ds_core.cli import ArgumentParser, cli_main, error as cli_error, flag, json_stdout
from ds_core.device import accelerators

# MODEL_DIR and load_spec are re-exported: ds-tune's model names and files are read through this module too
from ds_tools.model_shapes import MODEL_ALIASES, MODEL_DIR, load_spec, model_shape, shipped_models  # noqa: F401
from ds_tools.tuning_time import SAME_SPEED, StepTime, TimeModel, step_time, time_model
from ds_tools.zero_memory_model import (
    DEFAULT_BUCKETS,
    STAGES,
    Estimate,
    ModelShape,
    TuningError,
    estimate,
    grad_accum_dtype_for,
)

GIB = 2 ** 30   # memory is weighed in GiB, the unit HBM capacity comes in (ds_core.device.accelerators)
# cpu is not in ds_core.device.accelerators (no vendor figure): its "memory" is the machine's RAM shared by the node's
# ranks.
CPU = "cpu"
USABLE_FRACTION = 0.92
# Tokens per micro batch beyond which a bigger micro batch buys little more accelerator efficiency; used only to
# rank configurations (see recommend()).
SATURATING_TOKENS = 4096
# Headroom a recommendation keeps, as a fraction of its own predicted peak, when any option allows it: the memory
# model's accuracy target (bench/zero_memory.py, docs/benchmarks.md: every case within 10 %; worst 7.9 %), so a
# measured peak up to 10 % above the prediction still fits. Relative to the prediction because its error is.
SAFETY_MARGIN = 0.10
# Model FLOPs utilisation assumed for the compute part of a step time (--mfu); see ds_tools.tuning_time.
DEFAULT_MFU = 0.4
# The ZeRO stages considered unless --stages says otherwise: those the model packages ship JSONs for and their docs
# describe (docs/bert_pretraining.md, docs/bridgetower.md: ZeRO-1 or ZeRO-3). ZeRO-0 never fits where ZeRO-1 does
# not; ZeRO-2 runs (--zero_stage 2) but nothing here ships or documents it, so it is listed only when asked for.
DEFAULT_STAGES = (1, 3)
# Clipping of a JSON without an optimizer section (--optimizer none), the rule of the shipped BERT JSONs
# (ds_configs/README.md): the entry point's LAMB / LANS clips at its --max_grad_norm (1.0) where DeepSpeed's
# gradient_clipping is 0, and leaves it to DeepSpeed where they are equal; 0 at ZeRO 0-2 (DeepSpeed's clip reads the
# norm on the host every step there), 1.0 at ZeRO-3 (DeepSpeed's clip stays on the device).
CODE_OPTIMIZER_CLIPPING = {0: 0.0, 1: 0.0, 2: 0.0, 3: 1.0}
# How the entry points turn on activation checkpointing when a recommendation needs it.
CHECKPOINTING_FLAG = ("bert_ref.train --activation_checkpointing true (transformers' BridgeTower has none: use "
                      "ZeRO-3 or a smaller micro batch there)")


def capacity_bytes(accelerator: str, ranks_per_node: int) -> float:
    """Memory of one rank: the ds_core.device.accelerators row's capacity (GiB, the vendor's HBM as the device has it),
    or on cpu the node's RAM over its ranks."""
    if accelerator == CPU:
        import psutil

        return psutil.virtual_memory().total / max(1, ranks_per_node)   # ranks of a node share its RAM
    try:
        return accelerators.get(accelerator).memory_gib * GIB
    except accelerators.UnknownAcceleratorError as e:
        raise TuningError(f"--accelerator: {e}; or {CPU}") from None


HEADROOM_RULE = (f"a row fits when its predicted peak is at most the usable memory (capacity minus "
                 f"{100 * (1 - USABLE_FRACTION):.0f} % for fragmentation and runtime); it is recommended only with "
                 f"headroom of at least {100 * SAFETY_MARGIN:.0f} % of its own peak (the memory model's accuracy "
                 f"target, docs/benchmarks.md zero_memory), unless no row that fits has it")


# ------------------------------------------------------------------------------------------- search + advice

@dataclass
class Option:
    stage: int
    micro_batch: int
    grad_accum: int
    checkpointing: bool
    estimate: Estimate
    usable: float
    precision: str = "bf16"
    step: StepTime | None = None     # None: no fabric, no step time

    @property
    def headroom(self) -> float:
        return self.usable - self.estimate.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    @property
    def margin(self) -> float:
        """Headroom the recommendation rule asks of this row (HEADROOM_RULE)."""
        return SAFETY_MARGIN * self.estimate.total

    @property
    def safe(self) -> bool:
        return self.fits and self.headroom >= self.margin


def micro_batches(per_rank_batch: int, limit: int = 1024) -> list:
    return [m for m in range(1, min(per_rank_batch, limit) + 1) if per_rank_batch % m == 0]


def search(shape: ModelShape, accelerator: str, ranks_per_node: int, nodes: int, global_batch: int,
           checkpointing: str = "auto", stages: Sequence[int] = STAGES, precision: str = "bf16",
           times: TimeModel | None = None) -> list:
    """Every (stage, micro batch, grad accumulation, checkpointing) with its estimate and, given a time model, its
    step time; feasible or not."""
    n = ranks_per_node * nodes
    if global_batch <= 0 or global_batch % n:
        raise TuningError(f"--global_batch {global_batch} is not a positive multiple of {n} ranks "
                          f"({nodes} nodes x {ranks_per_node}); train_batch_size = micro x accum x ranks")
    if checkpointing not in ("auto", "on", "off"):
        raise TuningError(f"--activation_checkpointing {checkpointing!r}: expected auto, on or off")
    usable = capacity_bytes(accelerator, ranks_per_node) * USABLE_FRACTION
    ckpts = {"auto": (False, True), "on": (True,), "off": (False,)}[checkpointing]
    fused = accelerator != CPU
    per_rank = global_batch // n
    return [Option(st, m, per_rank // m, ck,
                   estimate(shape, st, m, ranks_per_node, nodes, checkpointing=ck, fused_adam=fused,
                            precision=precision, grad_accum=per_rank // m,
                            grad_accum_dtype=grad_accum_dtype_for(st, precision)), usable, precision,
                   step_time(times, shape, st, m, per_rank // m, ck, precision) if times else None)
            for ck in ckpts for st in stages for m in micro_batches(per_rank)]


_STAGE_PREFERENCE = {1: 0, 2: 1, 0: 2, 3: 3}


def rank_key(o: Option, seq: int, fastest: float | None = None) -> tuple:
    """Best first. With step times (fastest: the smallest step time among the rows compared): (1) the step time,
    rows within SAME_SPEED of the fastest counted as equally fast; without a compute figure, no activation
    checkpointing first (recomputing costs about a third more compute). Then (2) a micro batch large enough to keep
    the accelerator busy (tokens capped at SATURATING_TOKENS), (3) the stage that communicates least (ZeRO-1 moves
    ZeRO-0's bytes with less memory; ZeRO-2 reduces every micro step; ZeRO-3 gathers parameters twice per micro
    step), (4) the larger micro batch."""
    busy = (-min(o.micro_batch * seq, SATURATING_TOKENS), _STAGE_PREFERENCE[o.stage], -o.micro_batch)
    if o.step is None or fastest is None:
        return (o.checkpointing, 0.0, *busy)
    t = o.step.total_s
    speed = fastest if t <= fastest * (1 + SAME_SPEED) else t
    return (o.checkpointing and o.step.compute_s is None, speed, *busy)


def ranked(options: Sequence[Option], seq: int) -> list[tuple[Option, str | None]]:
    """Every option best first, each with the reason it is not the recommendation (None: the recommended one).
    The recommendation is the fastest of the rows that keep the headroom rule's margin (or, when none does, of the
    rows that fit); ties of speed go to the larger micro batch, then the cheaper stage."""
    fits = [o for o in options if o.fits]
    pool = [o for o in fits if o.safe] or fits
    fastest = min((o.step.total_s for o in pool if o.step), default=None)
    pool = sorted(pool, key=lambda o: rank_key(o, seq, fastest))
    ids = {id(o) for o in pool}
    rest = sorted((o for o in options if id(o) not in ids), key=lambda o: (not o.fits, rank_key(o, seq, fastest)))
    if not pool:
        return [(o, _reason(o, None, seq)) for o in rest]
    best = pool[0]
    return [(best, None)] + [(o, _reason(o, best, seq)) for o in pool[1:] + rest]


def _reason(o: Option, best: Option | None, seq: int) -> str:
    gib = o.estimate.total / GIB
    if not o.fits:
        return f"does not fit: {gib:.2f} GiB predicted, {o.usable / GIB:.2f} GiB usable"
    if best is None:
        return "nothing recommended"
    step = f"; step {o.step.total_s:.2f} s" if o.step else ""
    if best.safe and not o.safe:
        return (f"headroom {o.headroom / GIB:.2f} GiB, below the rule's {o.margin / GIB:.2f} GiB "
                f"({100 * SAFETY_MARGIN:.0f} % of its {gib:.2f} GiB peak){step}")
    timed = o.step is not None and best.step is not None
    full = timed and o.step.compute_s is not None and best.step.compute_s is not None   # compute in the step too
    unit = "s per step" if full else "s of communication per step"
    if timed:
        t, tb = o.step.total_s, best.step.total_s
        if t > tb * (1 + SAME_SPEED):
            why = f"slower: {t:.2f} {unit} against {tb:.2f} s (+{100 * (t / tb - 1):.0f} %)"
            if full and o.step.comm_s > tb:
                why += (f"; its communication alone ({o.step.comm_s:.2f} s) exceeds that step, so no overlap with "
                        f"compute makes it faster")
            return why
    if o.checkpointing and not best.checkpointing and not full:
        return "ranked below: recomputes the forward (activation checkpointing)"
    same = f"as fast ({o.step.total_s:.2f} {unit})" if timed else "ranked below"
    if min(o.micro_batch * seq, SATURATING_TOKENS) < min(best.micro_batch * seq, SATURATING_TOKENS):
        return (f"{same}, with a smaller micro batch: {o.micro_batch * seq} tokens against "
                f"{best.micro_batch * seq} keep the accelerator less busy")
    if _STAGE_PREFERENCE[o.stage] > _STAGE_PREFERENCE[best.stage]:
        return f"{same}; ZeRO-{best.stage} communicates less"
    return f"{same}; the recommended row has the larger micro batch"


def recommend(options: Sequence[Option], seq: int) -> Option | None:
    """The first of ranked(): the fastest feasible option that keeps the headroom rule's margin (HEADROOM_RULE;
    the memory model is within a few per cent of measured memory, not exact)."""
    order = ranked(options, seq)
    return order[0][0] if order and order[0][1] is None else None


def what_would_fit(shape: ModelShape, accelerator: str, ranks_per_node: int, nodes: int, checkpointing: str,
                   precision: str = "bf16") -> list:
    """Advice when nothing fits at micro batch 1."""
    usable = capacity_bytes(accelerator, ranks_per_node) * USABLE_FRACTION
    fused = accelerator != CPU
    z3 = dict(fused_adam=fused, precision=precision, grad_accum_dtype=grad_accum_dtype_for(3, precision))
    tips = []
    if checkpointing == "off":
        e = estimate(shape, 3, 1, ranks_per_node, nodes, checkpointing=True, **z3)
        if e.total <= usable:
            tips.append("turn on activation checkpointing (ds-tune --activation_checkpointing on, and in the run "
                        f"{CHECKPOINTING_FLAG}): ZeRO-3, micro batch 1 then needs {e.total / GIB:.1f} GiB of "
                        f"{usable / GIB:.1f} GiB")
    for more in range(nodes + 1, max(nodes * 64, 1024) + 1):
        e = estimate(shape, 3, 1, ranks_per_node, more, checkpointing=checkpointing != "off", **z3)
        if e.total <= usable:
            tips.append(f"use at least {more} nodes with ZeRO-3 (micro batch 1: {e.total / GIB:.1f} GiB per rank); "
                        "the global batch must stay a multiple of the rank count")
            break
    if not tips:
        tips.append("no data-parallel ZeRO configuration fits: model states alone exceed one accelerator even "
                    "fully partitioned; use ZeRO-Offload (not modelled here) or tensor/pipeline parallelism")
    return tips


def ds_config(o: Option, global_batch: int, *, lr: float = 1e-4, optimizer: str = "adamw") -> dict:
    """The DeepSpeed JSON for an option (DeepSpeed settings only; validates with ds_core.config.load_ds_config).
    It states every field the memory model depends on or that changes the numerics, with the value estimate()
    assumed, so DeepSpeed's defaults cannot differ: precision, data_types.grad_accum_dtype, the buckets,
    overlap_comm, contiguous_gradients, reduce_scatter. optimizer="none": no optimizer section, for entry points that
    build their own (bert_ref.train's LAMB / LANS), and the shipped configs' clipping (CODE_OPTIMIZER_CLIPPING); the
    model holds for any optimizer with two fp32 states per parameter."""
    zero: dict = {"stage": o.stage, "reduce_bucket_size": DEFAULT_BUCKETS["reduce_bucket_size"],
                  "allgather_bucket_size": DEFAULT_BUCKETS["allgather_bucket_size"], "overlap_comm": False,
                  "contiguous_gradients": True, "reduce_scatter": True}
    if o.stage == 3:
        zero.update(stage3_prefetch_bucket_size=DEFAULT_BUCKETS["stage3_prefetch_bucket_size"],
                    stage3_max_live_parameters=DEFAULT_BUCKETS["stage3_max_live_parameters"],
                    stage3_param_persistence_threshold=100_000, stage3_gather_16bit_weights_on_model_save=True)
    cfg = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": o.micro_batch,
           "gradient_accumulation_steps": o.grad_accum,
           "gradient_clipping": 1.0 if optimizer == "adamw" else CODE_OPTIMIZER_CLIPPING[o.stage],
           "bf16": {"enabled": o.precision == "bf16"}, "zero_optimization": zero, "steps_per_print": 1_000_000,
           "wall_clock_breakdown": False}
    acc = grad_accum_dtype_for(o.stage, o.precision)
    if acc:
        cfg["data_types"] = {"grad_accum_dtype": acc}
    if optimizer == "adamw":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                        "weight_decay": 0.01}}
    else:
        cfg["zero_allow_untested_optimizer"] = True     # a client optimizer such as LAMB
    if o.checkpointing:
        # the entry point must also turn it on (CHECKPOINTING_FLAG); these are DeepSpeed's knobs
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                           "cpu_checkpointing": False}
    return cfg


# ------------------------------------------------------------------------------------------------------- CLI

def _table(rows: Sequence[tuple[Option, str | None]]) -> str:
    lines = ["| ZeRO | micro batch | grad accum | act. ckpt | model states GiB | activations GiB | total GiB "
             "| headroom GiB | comm s/step | step s | |", "|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|:---|"]
    for o, why in rows:
        e, s = o.estimate, o.step
        comm = f"{s.comm_s:.2f}" if s else "-"
        step = f"{s.total_s:.2f}" if s and s.compute_s is not None else "-"
        lines.append(f"| {o.stage} | {o.micro_batch} | {o.grad_accum} | {'on' if o.checkpointing else 'off'} | "
                     f"{e.model_states / GIB:.2f} | {e.activations / GIB:.2f} | {e.total / GIB:.2f} | "
                     f"{o.headroom / GIB:.2f} | {comm} | {step} | {why or '**recommended**'} |")
    return "\n".join(lines)


def _row_json(o: Option, why: str | None) -> dict:
    return {"stage": o.stage, "micro_batch": o.micro_batch, "grad_accum": o.grad_accum,
            "checkpointing": o.checkpointing, "predicted_gib": o.estimate.total / GIB,
            "headroom_gib": o.headroom / GIB, "fits": o.fits, "keeps_margin": o.safe,
            "comm_s": o.step.comm_s if o.step else None,
            "compute_s": o.step.compute_s if o.step else None,
            "step_s": o.step.total_s if o.step and o.step.compute_s is not None else None,
            "recommended": why is None, "reason": why}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="ds-tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    p.add_argument("--model", required=True,
                   help=f"{' | '.join(shipped_models())} (ds_configs/models/, written from the presets; also "
                        f"{', '.join(MODEL_ALIASES)}) | PATH_TO_HF_CONFIG.json")
    p.add_argument("--accelerator", required=True,
                   help=f"{' | '.join(a.name for a in accelerators.ACCELERATORS)} (ds_core.device.accelerators; "
                        f"aliases {', '.join(x for a in accelerators.ACCELERATORS for x in a.aliases)}; the same "
                        f"names as `ds-scaling-report predict --fabric`) | {CPU}")
    p.add_argument(*flag("--accelerators_per_node"), type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument(*flag("--global_batch"), type=int, required=True,
                   help="sequences per optimizer step (train_batch_size)")
    p.add_argument(*flag("--seq_len"), type=int, default=0,
                   help="tokens per sequence (default: the model's preset; BridgeTower: text tokens)")
    p.add_argument(*flag("--activation_checkpointing"), choices=("auto", "on", "off"), default="auto")
    p.add_argument("--stages", default=",".join(map(str, DEFAULT_STAGES)),
                   help="ZeRO stages to consider, comma separated (default: %(default)s, the stages the shipped "
                        "configs and the docs cover; add 0 or 2 to list them too)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: mixed precision, gradients accumulated in fp32 at ZeRO >= 1 (data_types."
                        "grad_accum_dtype, as the shipped configs); fp32: everything fp32")
    p.add_argument("--fabric", metavar="NAME",
                   help="the fabric whose communication the step times use, by `ds-scaling-report predict "
                        "--fabric`'s names (default: the system the accelerator is, e.g. dl1 for gaudi; none for an "
                        "accelerator no modelled system is built from: no step times then)")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                   help="model FLOPs utilisation assumed for the compute part of the step time (default "
                        "%(default)s); the same for every row, so it decides only how activation checkpointing's "
                        "recompute weighs against communication")
    p.add_argument("--out", default="ds_config_tuned.json",
                   help="where the recommended DeepSpeed JSON goes (default: %(default)s in the current directory); "
                        "'-': stdout, which then holds that JSON only (the report goes to stderr)")
    p.add_argument("--all", action="store_true", help="also list configurations that do not fit")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of markdown (stdout: the JSON "
                   "only)")
    p.add_argument("--optimizer", choices=("adamw", "none"), default="adamw",
                   help="optimizer section of the JSON; none: the entry point builds its own (bert_ref.train: LAMB / "
                        "LANS, which clip themselves: gradient_clipping 0 at ZeRO 0-2, 1.0 at ZeRO-3, as the shipped "
                        "BERT configs)")
    p.add_argument("--top", type=int, default=0, help="list only the N best-ranked rows (default: all)")
    return p


def _resolve(a: argparse.Namespace) -> tuple[ModelShape, TimeModel, list[Option]]:
    if a.accelerators_per_node <= 0 or a.nodes <= 0:
        raise TuningError("--accelerators_per_node and --nodes must be positive")
    if a.top < 0:
        raise TuningError(f"--top {a.top}: expected a number of rows >= 0 (0: all)")
    stages = tuple(int(s) for s in a.stages.split(","))
    shape = model_shape(a.model, a.seq_len)
    times = time_model(a.accelerator, a.accelerators_per_node, a.nodes, a.precision, a.fabric, a.mfu)
    return shape, times, search(shape, a.accelerator, a.accelerators_per_node, a.nodes, a.global_batch,
                                a.activation_checkpointing, stages, a.precision, times)


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(argv, build_parser, _run)


def _run(a: argparse.Namespace) -> int:
    if a.json or a.out == "-":
        with json_stdout() as out:
            return _report(a, out)
    return _report(a, sys.stdout)


def _report(a: argparse.Namespace, out) -> int:
    try:
        shape, times, options = _resolve(a)
    except (TuningError, ValueError) as e:  # ValueError: --stages not numbers, a model config.json that is not one
        return cli_error("ds-tune", e)  # only here: a ValueError further down is a bug and keeps its traceback
    seq = shape.towers[0].seq
    order = ranked(options, seq)
    best = order[0][0] if order and order[0][1] is None else None
    shown = [(o, why) for o, why in order if a.all or o.fits][:a.top or None]
    n = a.accelerators_per_node * a.nodes
    cap = capacity_bytes(a.accelerator, a.accelerators_per_node)
    tips = [] if best else what_would_fit(shape, a.accelerator, a.accelerators_per_node, a.nodes,
                                          a.activation_checkpointing, a.precision)
    cfg = ds_config(best, a.global_batch, optimizer=a.optimizer) if best else None
    if cfg is not None and a.out != "-":
        Path(a.out).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    if a.json:
        rec = None if not best else {
            **_row_json(best, None), "optimizer": best.estimate.optimizer,
            "resident_gib": {k: v / GIB for k, v in best.estimate.parts.items()},
            "peak_phase": best.estimate.peak_phase,
            "peak_phase_gib": {k: v / GIB for k, v in best.estimate.phases[best.estimate.peak_phase].items()},
            "ds_config": cfg if a.out == "-" else a.out}
        print(json.dumps({"model": shape.name, "params": shape.params,
                          "params_by": "count" if shape.exact else "formula", "ranks": n, "capacity_gib": cap / GIB,
                          "usable_gib": cap * USABLE_FRACTION / GIB, "headroom_rule": HEADROOM_RULE,
                          "step_time": times.describe(shape), "rows": [_row_json(o, why) for o, why in shown],
                          "feasible": [_row_json(o, why) for o, why in shown if o.fits],
                          "recommended": rec, "advice": tips}, indent=2), file=out)
        return 0 if best else 1
    _print_report(a, shape, times, shown, best, cap, tips)
    if best and a.out == "-":
        print(json.dumps(cfg, indent=2), file=out)
    return 0 if best else 1


def _print_report(a: argparse.Namespace, shape: ModelShape, times: TimeModel, shown: list, best: Option | None,
                  cap: float, tips: list) -> None:
    n = a.accelerators_per_node * a.nodes
    print(f"## ds-tune: {shape.name} ({shape.params / 1e6:.1f} M parameters{'' if shape.exact else ', by formula'}), "
          f"seq {shape.towers[0].seq}, {a.nodes} node(s) x {a.accelerators_per_node} {a.accelerator} = {n} ranks, "
          f"global batch {a.global_batch}")
    print(f"Memory per rank: {cap / GIB:.2f} GiB ({'RAM over the node' if a.accelerator == CPU else 'HBM'}, "
          f"ds_core.device.accelerators), usable {cap * USABLE_FRACTION / GIB:.2f} GiB. Headroom rule: "
          f"{HEADROOM_RULE}.")
    print(f"Memory: every buffer DeepSpeed 0.19 allocates for the configuration ({a.precision}"
          f"{', fp32 gradient accumulation at ZeRO >= 1' if a.precision == 'bf16' else ''}; ds_tools.tuning.estimate), "
          f"peak = held between steps + the largest phase; activations by formula.")
    print(times.describe(shape) + "\n")
    print(_table(shown) if shown else "Nothing fits.")
    if not best:
        print("\nNothing fits. What would:")
        for t in tips:
            print(f"  - {t}")
        return
    e = best.estimate
    speed = (f", step {best.step.total_s:.2f} s ({best.step.comm_s:.2f} s of it communication)"
             if best.step and best.step.compute_s is not None else "")
    print(f"\nRecommended: ZeRO-{best.stage}, micro batch {best.micro_batch}, gradient accumulation "
          f"{best.grad_accum}, activation checkpointing {'on' if best.checkpointing else 'off'}: "
          f"{e.total / GIB:.2f} GiB predicted, {best.headroom / GIB:.2f} GiB headroom{speed}.")
    if not best.safe:
        print(f"Warning: headroom below the rule's {best.margin / GIB:.2f} GiB; no row that fits keeps it.")
    print(f"  DeepSpeed optimizer: {e.optimizer}; held between steps {e.resident / GIB:.2f} GiB:")
    for k, v in e.parts.items():
        print(f"    {k}: {v / GIB:.2f} GiB")
    print(f"  peak during {e.peak_phase}, on top: {e.phase_totals()[e.peak_phase] / GIB:.2f} GiB:")
    for k, v in e.phases[e.peak_phase].items():
        print(f"    {k}: {v / GIB:.2f} GiB")
    if best.checkpointing:
        print(f"Note: the run must turn activation checkpointing on too: {CHECKPOINTING_FLAG}.")
    if a.out != "-":
        print(f"DeepSpeed JSON written to {a.out}")


if __name__ == "__main__":
    sys.exit(main())
