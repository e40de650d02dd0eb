"""ZeRO config recommendation: the fastest (ZeRO stage, micro batch, grad accumulation) that fits a model.

Memory per rank, with Adam(W): every buffer DeepSpeed 0.19 allocates for the configuration, held between steps plus
the largest phase of a step (ds_tools.zero_memory_model.estimate; each component names its deepspeed/runtime/ file
and line; bench/zero_memory.py measures it), and activations per micro batch (zero_memory_model.activation_bytes),
against the accelerator's capacity in GiB (ds_core.device.accelerators: the vendor's HBM as the device has it; cpu:
the node's RAM over its ranks) less 8 % for allocator fragmentation and runtime context. Headroom rule (printed):
recommended rows keep 10 % of their own predicted peak free, the memory model's accuracy target.

Step time per row (ds_tools.tuning_time): compute per sequence from a measured run (--measured with its layout, or
--from RUN_DIR) or, without one, the accelerator's peak at an assumed MFU (stated with the range the published 1-node
figures imply), plus per-micro-step fixed costs (measured or stated) and the communication `ds-scaling-report
predict` models for the fabric (ZeRO-3's parameter gathers every micro step included), each with its range. Rows
within the model's error of the fastest are equally fast; among them the recommendation keeps the fp32 gradient
accumulation where it can (numerics) and then the most headroom; every other row says why it is not the one.

Gradient paths, both listed at ZeRO >= 1 with bf16: `data_types.grad_accum_dtype: fp32` (DeepSpeed 0.19 builds
BF16_Optimizer for ZeRO-1: an unpartitioned fp32 gradient buffer, 4 B/param on every rank) and bf16 gradients
(DeepSpeedZeroOptimizer, stage_1_and_2); which wrapper each gets is asked of the installed DeepSpeed
(ds_tools.zero_memory_model.deepspeed_optimizer), never assumed.

Models: the presets' descriptions in ds_configs/models/ (written by the model packages, see MODEL_DIR) or any HF
config.json.

    ds-tune --model bert-1.5b --accelerator dl1 --accelerators_per_node 8 --nodes 8 --global_batch 12288
    ds-tune --model bert-1.5b --accelerator dl1 --nodes 8 --global_batch 24576 --measured 1379.76 \\
        --measured_nodes 1 --measured_model bert-large --measured_micro_batch 32 --measured_global_batch 65536
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from ds_core.cli import ArgumentParser, cli_main, error as cli_error, flag, json_stdout
from ds_core.device import accelerators
from ds_tools import fabrics, tuning_measured

# MODEL_DIR and load_spec are re-exported: ds-tune's model names and files are read through this module too
from ds_tools.model_shapes import MODEL_ALIASES, MODEL_DIR, load_spec, model_shape, shipped_models  # noqa: F401
from ds_tools.tuning_time import SATURATING_TOKENS, StepTime, TimeModel, step_time, time_model  # noqa: F401
from ds_tools.zero_memory_model import (
    DEFAULT_BUCKETS,
    STAGES,
    Estimate,
    ModelShape,
    TuningError,
    deepspeed_optimizer,
    estimate,
    grad_accum_dtype_for,
)

GIB = 2 ** 30   # memory is weighed in GiB, the unit HBM capacity comes in (ds_core.device.accelerators)
# cpu is not in ds_core.device.accelerators (no vendor figure): its "memory" is the machine's RAM shared by the node's
# ranks.
CPU = "cpu"
USABLE_FRACTION = 0.92
# Headroom a recommendation keeps, as a fraction of its own predicted peak, when any option allows it: the memory
# model's accuracy target (bench/zero_memory.py, docs/benchmarks.md: every case within 10 %; worst 7.9 %), so a
# measured peak up to 10 % above the prediction still fits. Relative to the prediction because its error is.
SAFETY_MARGIN = 0.10
# Model FLOPs utilisation assumed for the compute part of a step time without a measurement (--mfu); None: the middle
# of the range the published 1-node figures imply (ds_tools.compute_rate.mfu_range)
DEFAULT_MFU = None
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
    grad_path: str | None = None     # data_types.grad_accum_dtype: "fp32", "bf16", None (the model's dtype, fp32 runs)

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

    @property
    def path_text(self) -> str:
        acc = {"fp32": "fp32 accumulation", "bf16": "bf16 gradients", None: self.precision}[self.grad_path]
        return f"{acc} ({self.estimate.optimizer})"


def micro_batches(per_rank_batch: int, limit: int = 1024) -> list:
    return [m for m in range(1, min(per_rank_batch, limit) + 1) if per_rank_batch % m == 0]


def grad_paths(stage: int, precision: str) -> list:
    """The gradient accumulation dtypes a bf16 run of this stage can take on the installed DeepSpeed: fp32 (the
    shipped configs) and bf16, each where DeepSpeed accepts it; fp32 runs: the model's own."""
    if precision != "bf16":
        return [None]
    out = []
    for acc in ("fp32", "bf16"):
        try:
            deepspeed_optimizer(stage, precision, acc, True)
        except TuningError:
            continue
        out.append(acc)
    return out


def search(shape: ModelShape, accelerator: str, ranks_per_node: int, nodes: int, global_batch: int,
           checkpointing: str = "auto", stages: Sequence[int] = STAGES, precision: str = "bf16",
           times: TimeModel | None = None) -> list:
    """Every (stage, gradient path, micro batch, grad accumulation, checkpointing) with its estimate and, given a
    time model, its step time; feasible or not."""
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
                            precision=precision, grad_accum=per_rank // m, grad_accum_dtype=path), usable, precision,
                   step_time(times, shape, st, m, per_rank // m, ck, precision) if times else None, path)
            for ck in ckpts for st in stages for path in grad_paths(st, precision) for m in micro_batches(per_rank)]


_STAGE_PREFERENCE = {1: 0, 2: 1, 0: 2, 3: 3}


def _faster(o: Option, than: Option, tol: float) -> bool:
    """o's modelled step is shorter than than's by more than the model's error (tol, relative)."""
    return o.step.total_s * (1 + tol) < than.step.total_s


def rank_key(o: Option, seq: int, fastest: Option | None = None, tol: float = 0.0) -> tuple:
    """Best first. With a compute figure: rows whose compute figure holds at their micro-step (`StepTime.known`)
    first; then those as fast as the fastest (within tol, the model's error) before the slower by step time; among
    the equally fast, fp32 gradient accumulation before bf16 (numerics: the micro-steps' gradients summed in fp32,
    the shipped recipes'), then the most headroom. Without one (no compute figure, or no fabric): no activation
    checkpointing first, then the stage that communicates least, then the larger micro batch."""
    path = 0 if o.grad_path in ("fp32", None) else 1
    if o.step is None or fastest is None or o.step.compute_s is None:
        comm = o.step.total_s if o.step is not None else 0.0
        return (o.checkpointing, comm, path, _STAGE_PREFERENCE[o.stage], -o.micro_batch)
    equal = not _faster(fastest, o, tol)
    return (not o.step.known, 0.0 if equal else o.step.total_s, path, -o.headroom, _STAGE_PREFERENCE[o.stage])


def ranked(options: Sequence[Option], seq: int, tol: float = 0.0) -> list[tuple[Option, str | None]]:
    """Every option best first, each with the reason it is not the recommendation (None: the recommended one).
    The recommendation is taken from the rows that keep the headroom rule's margin (or, when none does, from the
    rows that fit): rank_key's order."""
    fits = [o for o in options if o.fits]
    pool = [o for o in fits if o.safe] or fits
    timed = [o for o in pool if o.step is not None and o.step.compute_s is not None]
    known = [o for o in timed if o.step.known] or timed
    fastest = min(known, key=lambda o: o.step.total_s, default=None)
    pool = sorted(pool, key=lambda o: rank_key(o, seq, fastest, tol))
    ids = {id(o) for o in pool}
    rest = sorted((o for o in options if id(o) not in ids), key=lambda o: (not o.fits, rank_key(o, seq, fastest, tol)))
    if not pool:
        return [(o, _reason(o, None, seq, tol)) for o in rest]
    best = pool[0]
    return [(best, None)] + [(o, _reason(o, best, seq, tol)) for o in pool[1:] + rest]


def _reason(o: Option, best: Option | None, seq: int, tol: float = 0.0) -> str:
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
    if full and not o.step.known and best.step.known:
        return (f"its micro-step ({o.micro_batch * seq} tokens) is below the work the compute figure was measured "
                f"or assumed at: its compute per sequence is not known to be as fast{step}")
    if timed:
        t, tb = o.step.total_s, best.step.total_s
        if (full and _faster(best, o, tol)) or (not full and t > tb * (1 + tol)):
            why = f"slower: {t:.2f} {unit} against {tb:.2f} s (+{100 * (t / tb - 1):.1f} %, beyond the model's " \
                  f"{100 * tol:.1f} %)"
            if full and o.step.comm_s > tb:
                why += (f"; its communication alone ({o.step.comm_s:.2f} s) exceeds that step, so no overlap with "
                        f"compute makes it faster")
            return why
    if o.checkpointing and not best.checkpointing and not full:
        return "ranked below: recomputes the forward (activation checkpointing)"
    same = f"as fast ({o.step.total_s:.2f} {unit}, within the model's {100 * tol:.1f} %)" if timed else \
        "ranked below"
    if o.grad_path == "bf16" and best.grad_path == "fp32":
        return (f"{same}; bf16 gradients: the micro-steps' gradients summed in bf16; the recommended row "
                "accumulates in fp32 and keeps the headroom rule")
    if full:
        return f"{same}, with less headroom ({o.headroom / GIB:.2f} GiB against {best.headroom / GIB:.2f})"
    if _STAGE_PREFERENCE[o.stage] > _STAGE_PREFERENCE[best.stage]:
        return f"{same}; ZeRO-{best.stage} communicates less"
    return f"{same}; the recommended row has the larger micro batch"


def recommend(options: Sequence[Option], seq: int, tol: float = 0.0) -> Option | None:
    """The first of ranked(): the fastest feasible option that keeps the headroom rule's margin (HEADROOM_RULE;
    the memory model is within a few per cent of measured memory, not exact)."""
    order = ranked(options, seq, tol)
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
    if o.grad_path:
        cfg["data_types"] = {"grad_accum_dtype": o.grad_path}
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

def _secs(s: StepTime | None, full: bool) -> str:
    if s is None or (full and s.compute_s is None):
        return "-"
    t = s.total_s if full else s.comm_s
    return f"{t:.2f}" + (f" ({s.low_s:.2f}-{s.high_s:.2f})" if full and s.low_s is not None else "")


def _table(rows: Sequence[tuple[Option, str | None]]) -> str:
    lines = ["| ZeRO | gradients | micro batch | grad accum | act. ckpt | model states GiB | activations GiB | "
             "total GiB | headroom GiB | comm s/step | step s (range) | |",
             "|---:|:---|---:|---:|:---:|---:|---:|---:|---:|---:|---:|:---|"]
    for o, why in rows:
        e = o.estimate
        lines.append(f"| {o.stage} | {o.path_text} | {o.micro_batch} | {o.grad_accum} | "
                     f"{'on' if o.checkpointing else 'off'} | {e.model_states / GIB:.2f} | {e.activations / GIB:.2f} | "
                     f"{e.total / GIB:.2f} | {o.headroom / GIB:.2f} | {_secs(o.step, False)} | {_secs(o.step, True)} | "
                     f"{why or '**recommended**'} |")
    return "\n".join(lines)


def _row_json(o: Option, why: str | None) -> dict:
    s = o.step
    full = s is not None and s.compute_s is not None
    return {"stage": o.stage, "grad_accum_dtype": o.grad_path, "optimizer": o.estimate.optimizer,
            "micro_batch": o.micro_batch, "grad_accum": o.grad_accum,
            "checkpointing": o.checkpointing, "predicted_gib": o.estimate.total / GIB,
            "headroom_gib": o.headroom / GIB, "fits": o.fits, "keeps_margin": o.safe,
            "comm_s": s.comm_s if s else None, "compute_s": s.compute_s if s else None,
            "fixed_s": s.fixed_s if s else None,
            "step_s": s.total_s if full else None, "step_low_s": s.low_s if full else None,
            "step_high_s": s.high_s if full else None, "compute_known": s.known if s else None,
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
                   help="bf16: mixed precision; at ZeRO >= 1 both gradient paths are listed (data_types."
                        "grad_accum_dtype fp32, as the shipped configs, and bf16); fp32: everything fp32")
    p.add_argument("--fabric", metavar="NAME",
                   help="the fabric whose communication the step times use, by `ds-scaling-report predict "
                        "--fabric`'s names (default: the system the accelerator is, e.g. dl1 for gaudi; none for an "
                        "accelerator no modelled system is built from: no step times then)")
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                   help="model FLOPs utilisation assumed for the compute part of the step time without a measurement "
                        "(default: the middle of the range the published 1-node figures imply, printed)")
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
    tuning_measured.add_flags(p)
    return p


def _resolve(a: argparse.Namespace) -> tuple[ModelShape, TimeModel, list[Option]]:
    if a.accelerators_per_node <= 0 or a.nodes <= 0:
        raise TuningError("--accelerators_per_node and --nodes must be positive")
    if a.top < 0:
        raise TuningError(f"--top {a.top}: expected a number of rows >= 0 (0: all)")
    stages = tuple(int(s) for s in a.stages.split(","))
    shape = model_shape(a.model, a.seq_len)
    times = time_model(a.accelerator, a.accelerators_per_node, a.nodes, a.precision, a.fabric, a.mfu, a.micro_step_ms)
    times = tuning_measured.apply(a, shape, times)
    named = fabrics.FABRICS.get(times.fabric.name) if times.fabric is not None else None  # before calibration
    if named is not None:  # a run of the kind of a published table the model does not account for
        from ds_tools import ranges

        times = replace(times, unpredictable=ranges.unpredictable(named, model=shape.name, precision=a.precision,
                                                                  seq_len=shape.towers[0].seq))
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
    order = ranked(options, seq, times.tolerance)
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


def _why(best: Option, shown: list, tol: float) -> str:
    """Why the recommended row: its step against the fastest, its gradient path, its headroom among the equals."""
    if best.step is None or best.step.compute_s is None:
        return "no compute figure: the row with the least communication, no recomputation, the larger micro batch"
    equal = [o for o, why in shown if o.fits and o.step and o.step.compute_s is not None
             and "as fast" in (why or "as fast")]
    other = [o for o in equal if o.grad_path != best.grad_path and o.stage == best.stage]
    path = ("fp32 gradient accumulation (the micro-steps' gradients summed in fp32, as the shipped configs do)"
            if best.grad_path == "fp32" else f"{best.path_text}")
    alt = (f"; the bf16-gradient path of the same layout holds {min(o.estimate.total for o in other) / GIB:.2f} "
           "GiB at best, listed with its step time" if other and best.grad_path == "fp32" else "")
    return (f"the fastest modelled step, or within the model's {100 * tol:.1f} % of it ({len(equal)} row(s) as fast); "
            f"among those, {path}, then the most headroom{alt}.")


def _print_report(a: argparse.Namespace, shape: ModelShape, times: TimeModel, shown: list, best: Option | None,
                  cap: float, tips: list) -> None:
    n = a.accelerators_per_node * a.nodes
    print(f"## ds-tune: {shape.name} ({shape.params / 1e6:.1f} M parameters{'' if shape.exact else ', by formula'}), "
          f"seq {shape.towers[0].seq}, {a.nodes} node(s) x {a.accelerators_per_node} {a.accelerator} = {n} ranks, "
          f"global batch {a.global_batch}")
    print(f"Memory per rank: {cap / GIB:.2f} GiB ({'RAM over the node' if a.accelerator == CPU else 'HBM'}, "
          f"ds_core.device.accelerators), usable {cap * USABLE_FRACTION / GIB:.2f} GiB. Headroom rule: "
          f"{HEADROOM_RULE}.")
    paths = ("; at ZeRO >= 1 both gradient paths, fp32 accumulation and bf16, each with the wrapper the installed "
             "DeepSpeed builds for it") if a.precision == "bf16" else ""
    print(f"Memory: every buffer DeepSpeed allocates for the configuration ({a.precision}{paths}; "
          "ds_tools.tuning.estimate), peak = held between steps + the largest phase; activations by formula.")
    print(times.describe(shape) + "\n")
    print(_table(shown) if shown else "Nothing fits.")
    if not best:
        print("\nNothing fits. What would:")
        for t in tips:
            print(f"  - {t}")
        return
    e = best.estimate
    st = best.step
    span = (f"range {st.low_s:.2f}-{st.high_s:.2f}" if st and st.low_s is not None else
            "no range: not predictable")
    speed = (f", step {st.total_s:.2f} s ({span}; {st.comm_s:.2f} s of it communication)"
             if st and st.compute_s is not None else "")
    print(f"\nRecommended: ZeRO-{best.stage}, {best.path_text}, micro batch {best.micro_batch}, gradient "
          f"accumulation {best.grad_accum}, activation checkpointing {'on' if best.checkpointing else 'off'}: "
          f"{e.total / GIB:.2f} GiB predicted, {best.headroom / GIB:.2f} GiB headroom{speed}.")
    print("Why: " + _why(best, shown, times.tolerance))
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
