"""ZeRO memory model and config recommendation: which (ZeRO stage, micro batch, grad accumulation) fits a model.

Per rank, with Adam(W): every buffer DeepSpeed 0.19 allocates for the configuration, held between steps plus the
largest phase of a step (ds_tools.zero_memory_model.estimate; each component names its deepspeed/runtime/ file and
line; bench/zero_memory.py measures it), and activations per micro batch (zero_memory_model.activation_bytes).
Usable memory: the capacity (ds_core.device.accelerators' table; cpu: the node's RAM over its ranks) minus 8 % for
allocator fragmentation and runtime context.

Models: the presets' descriptions in ds_configs/models/ (written by the model packages, see MODEL_DIR) or any HF
config.json.

    ds-tune --model bert-1.5b --accelerator dl1 --accelerators_per_node 8 --nodes 8 --global_batch 12288
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from ds_core.cli import ArgumentParser, cli_main, error as cli_error, flag
from ds_core.config import DS_CONFIG_DIR
from ds_core.device import accelerators
from ds_tools.zero_memory_model import (
    DEFAULT_BUCKETS,
    STAGES,
    Estimate,
    ModelShape,
    Tower,
    TuningError,
    estimate,
    grad_accum_dtype_for,
)

GB = 1e9
# cpu is not in ds_core.device.accelerators (no vendor figure): its "memory" is the machine's RAM shared by the node's
# ranks.
CPU = "cpu"
USABLE_FRACTION = 0.92
# Tokens per micro batch beyond which a bigger micro batch buys little more accelerator efficiency; used only to
# rank configurations (see recommend()).
SATURATING_TOKENS = 4096
# Headroom (fraction of usable memory) a recommendation keeps when any option allows it.
SAFETY_MARGIN = 0.10
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

# Model descriptions (HF config.json form plus "seq_len") are written from the model packages' presets into
# ds_configs/models/ (ds_core imports no model package): `python -m bert_ref.configs --preset bert_1p5b --write_config
# PATH`, `python -m bridgetower_ds.configs --preset bridgetower_large --write_config PATH`; a test keeps the shipped
# files equal to the presets. Exact parameter counts come from building the matching transformers class on the meta
# device.
MODEL_DIR = DS_CONFIG_DIR / "models"
# the names ds-tune took before the descriptions came from the presets
MODEL_ALIASES = {"bert-large": "bert_large", "bert-1.5b": "bert_1p5b", "bridgetower-large": "bridgetower_large"}


def shipped_models() -> list[str]:
    """Names --model accepts besides a path: the files in ds_configs/models/ (and MODEL_ALIASES)."""
    return sorted(p.stem for p in MODEL_DIR.glob("*.json"))


# ----------------------------------------------------------------------------------------------- model shapes



def load_spec(model: str) -> tuple:
    """(name, HF-config-like dict) for a shipped model name (or its old alias) or a config.json path."""
    p = Path(model)
    if not p.is_file():
        shipped = MODEL_DIR / f"{MODEL_ALIASES.get(model, model)}.json"
        if p.parent != Path(".") or not shipped.is_file():
            raise TuningError(f"--model {model!r}: not one of {', '.join(shipped_models() + sorted(MODEL_ALIASES))} "
                              f"(ds_configs/models/) and not an HF config.json file")
        p = shipped
    try:
        spec = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TuningError(f"{p}: not JSON ({e})") from None
    if not isinstance(spec, dict) or "model_type" not in spec:
        raise TuningError(f"{p}: expected an HF config with a 'model_type' key")
    return p.stem, spec


def _hf_config(spec: dict):
    from transformers import AutoConfig

    kw = {k: v for k, v in spec.items() if k not in ("model_type", "seq_len", "architectures")}
    return AutoConfig.for_model(spec["model_type"], **kw)


def _count_on_meta(spec: dict) -> tuple:
    """(params, largest single-module params) of the real transformers class, built on the meta device."""
    import torch
    import transformers

    cfg = _hf_config(spec)
    arch = (spec.get("architectures") or [None])[0]
    with torch.device("meta"):
        if arch and hasattr(transformers, arch):
            model = getattr(transformers, arch)(cfg)
        else:
            model = transformers.AutoModel.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())           # tied weights counted once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return params, largest


def _get(cfg: dict, *names, default=None):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _analytic_params(h: int, i: int, layers: int, vocab: int, pos: int) -> int:
    per_layer = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h     # qkvo + biases, ffn, 2 layernorms
    return layers * per_layer + (vocab + pos + 2) * h + 2 * h


@lru_cache(maxsize=16)
def _shape_cached(model: str, seq_len: int) -> ModelShape:
    name, spec = load_spec(model)
    mt = spec["model_type"]
    if mt == "bridgetower":
        t, v = spec["text_config"], spec["vision_config"]
        s_txt = seq_len or spec.get("seq_len", 50)
        s_img = (v["image_size"] // v["patch_size"]) ** 2 + 1
        h, heads = spec["hidden_size"], spec["num_attention_heads"]
        towers = [Tower("text", t["num_hidden_layers"], t["hidden_size"], t["num_attention_heads"],
                        t.get("intermediate_size", 4 * t["hidden_size"]), s_txt),
                  Tower("vision", v["num_hidden_layers"], v["hidden_size"], v.get("num_attention_heads", 16),
                        v.get("intermediate_size", 4 * v["hidden_size"]), s_img),
                  Tower("cross-text", spec["num_hidden_layers"], h, heads, 4 * h, s_txt, cross_seq=s_img),
                  Tower("cross-image", spec["num_hidden_layers"], h, heads, 4 * h, s_img, cross_seq=s_txt)]
        vocab, head_seq = t["vocab_size"], s_txt
        approx = (_analytic_params(t["hidden_size"], 4 * t["hidden_size"], t["num_hidden_layers"], t["vocab_size"],
                                   514)
                  + _analytic_params(v["hidden_size"], 4 * v["hidden_size"], v["num_hidden_layers"], 0, s_img)
                  + 2 * spec["num_hidden_layers"] * (_analytic_params(h, 4 * h, 1, 0, 0) + 4 * h * h))
        approx_largest = max(t["vocab_size"] * t["hidden_size"], 4 * h * h)
        # only BridgeTowerForMaskedLM computes token logits; the contrastive/ITM heads are small
        if "MaskedLM" not in str(spec.get("architectures")):
            vocab = 0
    else:
        h = _get(spec, "hidden_size", "n_embd", "d_model")
        layers = _get(spec, "num_hidden_layers", "n_layer", "num_layers")
        heads = _get(spec, "num_attention_heads", "n_head")
        if not (h and layers and heads):
            raise TuningError(f"{model}: need hidden_size, num_hidden_layers and num_attention_heads in the config")
        i = _get(spec, "intermediate_size", "n_inner", "ffn_dim", default=4 * h) or 4 * h
        vocab = _get(spec, "vocab_size", default=0)
        pos = _get(spec, "max_position_embeddings", "n_positions", default=512)
        s = seq_len or spec.get("seq_len") or min(pos, 512)
        towers = [Tower("encoder" if mt in ("bert", "megatron-bert") else "layers", layers, h, heads, i, s)]
        head_seq = s
        approx = _analytic_params(h, i, layers, vocab, pos)
        approx_largest = max(vocab * h, h * i)
    try:
        params, largest = _count_on_meta(spec)
        exact = True
    except Exception:  # noqa: BLE001 - unknown model_type / no transformers: the formula is close
        params, largest, exact = approx, approx_largest, False
    return ModelShape(name=name, params=params, largest_layer_params=largest, towers=towers, vocab=vocab,
                      head_seq=head_seq, exact=exact)


def model_shape(model: str, seq_len: int = 0) -> ModelShape:
    return _shape_cached(model, int(seq_len or 0))


def capacity_bytes(accelerator: str, ranks_per_node: int) -> float:
    """Memory of one rank: the ds_core.device.accelerators row's capacity, or on cpu the node's RAM over its ranks."""
    if accelerator == CPU:
        import psutil

        return psutil.virtual_memory().total / max(1, ranks_per_node)   # ranks of a node share its RAM
    try:
        return accelerators.get(accelerator).memory_gb * GB
    except accelerators.UnknownAcceleratorError as e:
        raise TuningError(f"--accelerator: {e}; or {CPU}") from None


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

    @property
    def headroom(self) -> float:
        return self.usable - self.estimate.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0


def micro_batches(per_rank_batch: int, limit: int = 1024) -> list:
    return [m for m in range(1, min(per_rank_batch, limit) + 1) if per_rank_batch % m == 0]


def search(shape: ModelShape, accelerator: str, ranks_per_node: int, nodes: int, global_batch: int,
           checkpointing: str = "auto", stages: Sequence[int] = STAGES, precision: str = "bf16") -> list:
    """Every (stage, micro batch, grad accumulation, checkpointing) with its estimate; feasible or not."""
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
                            grad_accum_dtype=grad_accum_dtype_for(st, precision)), usable, precision)
            for ck in ckpts for st in stages for m in micro_batches(per_rank)]


_STAGE_PREFERENCE = {1: 0, 2: 1, 0: 2, 3: 3}


def rank_key(o: Option, seq: int) -> tuple:
    """Best first. (1) no activation checkpointing (recomputing costs about a third more compute); (2) a micro batch
    large enough to keep the accelerator busy (tokens capped at SATURATING_TOKENS); (3) the cheapest ZeRO stage in
    communication: ZeRO-1 moves the same bytes as ZeRO-0 with less memory, ZeRO-2 reduces gradients every micro
    step, ZeRO-3 adds parameter all-gathers (~1.5x traffic); (4) the larger micro batch."""
    return (o.checkpointing, -min(o.micro_batch * seq, SATURATING_TOKENS), _STAGE_PREFERENCE[o.stage],
            -o.micro_batch)


def recommend(options: Sequence[Option], seq: int) -> Option | None:
    """The best-ranked feasible option, preferring those with SAFETY_MARGIN headroom (the bench measures this model
    within a few per cent, not exactly)."""
    feasible = [o for o in options if o.fits]
    safe = [o for o in feasible if o.headroom >= SAFETY_MARGIN * o.usable]
    return min(safe or feasible, key=lambda o: rank_key(o, seq)) if feasible else None


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
                        f"{CHECKPOINTING_FLAG}): ZeRO-3, micro batch 1 then needs {e.total / GB:.1f} GB of "
                        f"{usable / GB:.1f} GB")
    for more in range(nodes + 1, max(nodes * 64, 1024) + 1):
        e = estimate(shape, 3, 1, ranks_per_node, more, checkpointing=checkpointing != "off", **z3)
        if e.total <= usable:
            tips.append(f"use at least {more} nodes with ZeRO-3 (micro batch 1: {e.total / GB:.1f} GB per rank); "
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

def _table(options: Sequence[Option], best: Option | None) -> str:
    lines = ["| ZeRO | micro batch | grad accum | act. ckpt | model states GB | activations GB | total GB "
             "| headroom GB | |", "|---:|---:|---:|:---:|---:|---:|---:|---:|:---|"]
    for o in options:
        e = o.estimate
        lines.append(f"| {o.stage} | {o.micro_batch} | {o.grad_accum} | {'on' if o.checkpointing else 'off'} | "
                     f"{e.model_states / GB:.2f} | {e.activations / GB:.2f} | {e.total / GB:.2f} | "
                     f"{o.headroom / GB:.2f} | {'**recommended**' if o is best else ''} |")
    return "\n".join(lines)


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
    p.add_argument("--out", default="ds_config_tuned.json",
                   help="where the recommended DeepSpeed JSON goes (default: %(default)s in the current directory); "
                        "'-' prints it to stdout after the report")
    p.add_argument("--all", action="store_true", help="also list configurations that do not fit")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of markdown")
    p.add_argument("--optimizer", choices=("adamw", "none"), default="adamw",
                   help="optimizer section of the JSON; none: the entry point builds its own (bert_ref.train: LAMB / "
                        "LANS, which clip themselves: gradient_clipping 0 at ZeRO 0-2, 1.0 at ZeRO-3, as the shipped "
                        "BERT configs)")
    p.add_argument("--top", type=int, default=0, help="list only the N best-ranked options (default: all)")
    return p


def _resolve(a: argparse.Namespace) -> tuple[ModelShape, list[Option]]:
    if a.accelerators_per_node <= 0 or a.nodes <= 0:
        raise TuningError("--accelerators_per_node and --nodes must be positive")
    stages = tuple(int(s) for s in a.stages.split(","))
    shape = model_shape(a.model, a.seq_len)
    return shape, search(shape, a.accelerator, a.accelerators_per_node, a.nodes, a.global_batch,
                         a.activation_checkpointing, stages, a.precision)


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(argv, build_parser, _run)


def _run(a: argparse.Namespace) -> int:
    try:
        shape, options = _resolve(a)
    except (TuningError, ValueError) as e:  # ValueError: --stages not numbers, a model config.json that is not one
        return cli_error("ds-tune", e)  # only here: a ValueError further down is a bug and keeps its traceback
    seq = shape.towers[0].seq
    best = recommend(options, seq)
    shown = sorted((o for o in options if a.all or o.fits), key=lambda o: rank_key(o, seq))
    if a.top:
        shown = shown[:a.top] + ([best] if best and best not in shown[:a.top] else [])
    n = a.accelerators_per_node * a.nodes
    cap = capacity_bytes(a.accelerator, a.accelerators_per_node)
    tips = [] if best else what_would_fit(shape, a.accelerator, a.accelerators_per_node, a.nodes,
                                          a.activation_checkpointing, a.precision)
    cfg = ds_config(best, a.global_batch, optimizer=a.optimizer) if best else None
    if cfg is not None and a.out != "-":
        Path(a.out).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    if a.json:
        print(json.dumps({
            "model": shape.name, "params": shape.params, "ranks": n, "capacity_gb": cap / GB,
            "usable_gb": cap * USABLE_FRACTION / GB,
            "feasible": [{"stage": o.stage, "micro_batch": o.micro_batch, "grad_accum": o.grad_accum,
                          "checkpointing": o.checkpointing, "predicted_gb": o.estimate.total / GB,
                          "headroom_gb": o.headroom / GB} for o in shown if o.fits],
            "recommended": None if not best else {"stage": best.stage, "micro_batch": best.micro_batch,
                                                  "grad_accum": best.grad_accum,
                                                  "checkpointing": best.checkpointing,
                                                  "predicted_gb": best.estimate.total / GB,
                                                  "optimizer": best.estimate.optimizer,
                                                  "resident_gb": {k: v / GB for k, v in best.estimate.parts.items()},
                                                  "peak_phase": best.estimate.peak_phase,
                                                  "peak_phase_gb": {k: v / GB for k, v in
                                                                    best.estimate.phases[best.estimate.peak_phase].items()},
                                                  "ds_config": cfg if a.out == "-" else a.out},
            "advice": tips}, indent=2))
        return 0 if best else 1
    print(f"## ds-tune: {shape.name} ({shape.params / 1e6:.1f} M parameters{'' if shape.exact else ', by formula'}), "
          f"seq {seq}, {a.nodes} node(s) x {a.accelerators_per_node} {a.accelerator} = {n} ranks, "
          f"global batch {a.global_batch}")
    print(f"Memory per rank: {cap / GB:.1f} GB, usable {cap * USABLE_FRACTION / GB:.1f} GB "
          f"({100 * (1 - USABLE_FRACTION):.0f} % kept for fragmentation and runtime).")
    print(f"Memory: every buffer DeepSpeed 0.19 allocates for the configuration ({a.precision}"
          f"{', fp32 gradient accumulation at ZeRO >= 1' if a.precision == 'bf16' else ''}; ds_tools.tuning.estimate), "
          f"peak = held between steps + the largest phase; activations by formula.\n")
    if shown:
        print(_table(shown, best))
    else:
        print("Nothing fits.")
    if best:
        e = best.estimate
        print(f"\nRecommended: ZeRO-{best.stage}, micro batch {best.micro_batch}, gradient accumulation "
              f"{best.grad_accum}, activation checkpointing {'on' if best.checkpointing else 'off'}: "
              f"{e.total / GB:.2f} GB predicted, {best.headroom / GB:.2f} GB headroom.")
        if best.headroom < SAFETY_MARGIN * best.usable:
            print(f"Warning: less than {100 * SAFETY_MARGIN:.0f} % headroom; nothing else fits with more.")
        print(f"  DeepSpeed optimizer: {e.optimizer}; held between steps {e.resident / GB:.2f} GB:")
        for k, v in e.parts.items():
            print(f"    {k}: {v / GB:.2f} GB")
        print(f"  peak during {e.peak_phase}, on top: {e.phase_totals()[e.peak_phase] / GB:.2f} GB:")
        for k, v in e.phases[e.peak_phase].items():
            print(f"    {k}: {v / GB:.2f} GB")
        if best.checkpointing:
            print(f"Note: the run must turn activation checkpointing on too: {CHECKPOINTING_FLAG}.")
        if a.out == "-":
            print(json.dumps(cfg, indent=2))
        else:
            print(f"DeepSpeed JSON written to {a.out}")
        return 0
    print("\nNothing fits. What would:")
    for t in tips:
        print(f"  - {t}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
