"""The settings sections shared by every model, defined once: the training loop and checkpoints
(ds_core.config.TrainConfig) and the optimizer + LR schedule (OptimArgs, here). A model package adds its own sections
and fills the values left to it (None / '') with its defaults in its RunSpec.resolve, before any rank starts: BERT
its published recipes (bert_ref.optim.for_preset), BridgeTower transformers' Trainer defaults and the DeepSpeed JSON's
optimizer section (bridgetower_ds.optim).

One schedule vocabulary for both models: --lr_scheduler_type names a kind of ds_core.schedule.KINDS (transformers'
kinds, NVIDIA's nvidia_poly, Habana's habana_poly and the earlier poly_warmup; a kind added there is
accepted here), warm-up is --warmup_steps (>= 1 a count, < 1 a
share of all steps) or --warmup_ratio (a share; BERT's --warmup_proportion is the same setting).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ds_core.config.settings import arg
from ds_core.errors import ConfigError
from ds_core.schedule import KINDS, LRSchedule, lr_schedule, warmup_steps_for
from ds_core.schedule.published import REF_KINDS

# Optimizers a model may build from OptimArgs.optimizer (bert_ref.optim builds all three; BridgeTower AdamW only).
OPTIMIZERS = ("lamb", "lans", "adamw")


@dataclass(frozen=True)
class OptimArgs:
    """Optimizer and learning-rate schedule (transformers' TrainingArguments names where they exist). None / '':
    the model's default (its RunSpec.resolve fills it)."""

    optimizer: str = arg("lamb (NVIDIA's FusedLAMB update), lans (Habana's LANS) or adamw; '' = the model's (BERT: "
                         "the preset's published recipe; BridgeTower: AdamW, or the DeepSpeed JSON's optimizer).",
                         default="")
    learning_rate: Optional[float] = arg("Peak learning rate; default: the model's (BERT: the preset's published LR at "
                                         "--base_global_batch; BridgeTower: the DeepSpeed JSON's optimizer.params.lr, "
                                         "else 5e-5, Trainer's).", default=None)
    weight_decay: Optional[float] = arg("Weight decay, not on biases and LayerNorm weights; default: the model's (BERT "
                                        "0.01; BridgeTower: the DeepSpeed JSON's, else 0.0, Trainer's).", default=None)
    beta1: float = arg("Adam beta1.", default=0.9, aliases=["--adam_beta1"])  # TrainingArguments' names
    beta2: float = arg("Adam beta2.", default=0.999, aliases=["--adam_beta2"])
    eps: Optional[float] = arg("Adam epsilon; default: the model's (BERT 1e-6, FusedLAMB's and Habana's LANS's; "
                               "BridgeTower 1e-8, Trainer's).", default=None, aliases=["--adam_epsilon"])
    max_grad_norm: Optional[float] = arg("Gradient-norm limit; default: the model's. BERT (lamb, lans): the "
                                         "global clip of FusedLAMB / Habana (1.0; 0 = off), done by the optimizer on "
                                         "the device; the DeepSpeed JSON's gradient_clipping must be 0 (the BERT "
                                         "configs) or the same value (DeepSpeed clips instead). BridgeTower: "
                                         "Trainer's clipping = DeepSpeed's gradient_clipping (default: the JSON's).",
                                         default=None)
    bias_correction_lag: bool = arg("lamb / lans: bias-correct with step t-1 from step 2 on, as Habana's "
                                    "run_pretraining.py does whenever ZeRO is on (adjust_step=True).", default=False)
    lr_scheduler_type: str = arg(f"LR schedule, one of {' | '.join(KINDS)} (transformers' kinds; nvidia_poly: NVIDIA's "
                                 "BERT PolyWarmUpScheduler, habana_poly: Habana's, with a constant phase; poly_warmup: "
                                 "this project's earlier Habana-like one); '' = the model's (BERT: the preset's "
                                 "recipe, bert_large nvidia_poly, bert_1p5b habana_poly; BridgeTower linear).",
                                 default="", aliases=["--lr_schedule"])
    warmup_steps: float = arg("Linear warm-up: >= 1 a number of optimizer steps, < 1 a share of all steps "
                              "(transformers 5).", default=0)
    warmup_ratio: Optional[float] = arg("Warm-up as a share of all optimizer steps (transformers 4, optimum-habana; "
                                        "BERT's --warmup_proportion); give this or --warmup_steps; default: the "
                                        "model's (BERT 0.05, BridgeTower 0).", default=None,
                                        aliases=["--warmup_proportion"])
    constant_proportion: float = arg("poly_warmup / habana_poly: share of all steps held at the peak LR after warm-up.",
                                     default=0.0)
    poly_degree: float = arg("poly_warmup / nvidia_poly / habana_poly: degree of the polynomial decay to 0 over the "
                             "remaining steps (1 = linear).", default=1.0)
    scale_lr_with_global_batch: bool = arg("Peak LR = learning_rate * train_batch_size / base_global_batch (linear "
                                           "scaling: bert_1p5b's 0.0015 at 12288 sequences, 0.003 at twice that). "
                                           "The published recipes do not scale: they keep their global batch.",
                                           default=False)
    base_global_batch: int = arg("Global batch that learning_rate was tuned for; 0 = the model's (BERT: the preset's "
                                 "published one).", default=0)

    def validate(self) -> None:
        if self.optimizer not in OPTIMIZERS + ("",):
            raise ConfigError(f"--optimizer {self.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
        if self.lr_scheduler_type not in KINDS + ("",):
            raise ConfigError(f"--lr_scheduler_type {self.lr_scheduler_type!r}: expected one of {', '.join(KINDS)}")
        ratio = self.warmup_ratio or 0.0
        # each number finite as well as in range: `--learning_rate inf` passes `> 0` and trained, and `--beta1 nan`
        # or `--beta2 7` failed only inside the optimizer, after distributed init and the model build
        checks = [("learning_rate", self.learning_rate is None or _finite(self.learning_rate, 0, None), "> 0, finite"),
                  ("weight_decay", self.weight_decay is None or _finite(self.weight_decay, 0, None, closed=True),
                   ">= 0, finite"),
                  ("beta1", _finite(self.beta1, 0, 1, closed=True), "in [0, 1)"),
                  ("beta2", _finite(self.beta2, 0, 1, closed=True), "in [0, 1)"),
                  ("eps", self.eps is None or _finite(self.eps, 0, None), "> 0, finite"),
                  ("max_grad_norm", self.max_grad_norm is None or _finite(self.max_grad_norm, 0, None, closed=True),
                   ">= 0, finite"),
                  ("warmup_steps", _finite(self.warmup_steps, 0, None, closed=True), ">= 0, finite"),
                  ("warmup_ratio", _finite(ratio, 0, None, closed=True) and ratio <= 1, "in [0, 1]"),
                  ("constant_proportion", _finite(self.constant_proportion, 0, None, closed=True)
                   and self.constant_proportion <= 1, "in [0, 1]"),
                  ("poly_degree", _finite(self.poly_degree, 0, None), "> 0, finite"),
                  ("base_global_batch", self.base_global_batch >= 0, ">= 0")]
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"OptimArgs.{name} = {getattr(self, name)!r} (--{name}): expected {expected}")
        if self.warmup_steps and ratio:
            raise ConfigError(f"--warmup_steps {self.warmup_steps} / --warmup_ratio {ratio}: expected one of them")
        if ratio + self.constant_proportion > 1:
            raise ConfigError(f"warmup_ratio {ratio} + constant_proportion {self.constant_proportion} > 1")


def _finite(v: float, low: float, high: float | None, closed: bool = False) -> bool:
    """v is a finite number above `low` (at `low` too where closed) and below `high` (None: no bound)."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and (v >= low if closed else v > low) and (high is None or v < high))


def warmup_for(args: OptimArgs, total_steps: int) -> int:
    """Warm-up length in optimizer steps. poly_warmup rounds a share to the nearest step, as NVIDIA's
    PolyWarmUpScheduler does; transformers' kinds round it up, as Trainer does (ds_core.schedule.warmup_steps_for)."""
    ratio = args.warmup_ratio or 0.0
    if args.lr_scheduler_type in ("poly_warmup",) + REF_KINDS and args.warmup_steps < 1:
        return int(round((args.warmup_steps or ratio) * total_steps))
    return warmup_steps_for(total_steps, args.warmup_steps, ratio)


def schedule_for(args: OptimArgs, total_steps: int) -> Callable[[Any], LRSchedule]:
    """callable(optimizer) -> ds_core.schedule.LRSchedule over total_steps (the run's, ds_core.run.setup), the form
    DeepSpeed's `lr_scheduler=` argument accepts. args.lr_scheduler_type must be resolved (not '')."""
    if not args.lr_scheduler_type:
        raise ConfigError("schedule_for: lr_scheduler_type unset; the model's RunSpec.resolve fills it")
    kw: dict = dict(constant_proportion=args.constant_proportion, degree=args.poly_degree)
    if args.lr_scheduler_type in REF_KINDS and args.warmup_steps < 1:  # the references take the share itself
        kw["warmup_proportion"] = args.warmup_steps or args.warmup_ratio or 0.0
    return lr_schedule(args.lr_scheduler_type, total_steps, warmup_for(args, total_steps), **kw)


__all__ = ["OptimArgs", "OPTIMIZERS", "schedule_for", "warmup_for"]
