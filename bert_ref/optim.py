"""Optimizers (NVLAMB, LANS, AdamW) with the published recipes' defaults per preset, weight-decay groups, LR scaling
with the global batch, and the warm-up / constant / polynomial-decay LR schedule.

`lamb` is NVIDIA's FusedLAMB update and `lans` Habana's LANS (bert_ref.layerwise: per-tensor trust ratios, also
under ZeRO once attach_zero_layout(engine, optimizer) has run). Without --optimizer / --learning_rate a preset runs
the recipe it is named after (PUBLISHED).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ds_core.config import ConfigError, arg
from ds_core.schedule import LRSchedule, poly_warmup_factor

from .layerwise import LANS, NVLAMB

OPTIMIZERS = ("lamb", "lans", "adamw")


@dataclass(frozen=True)
class Recipe:
    """A published recipe's optimizer and peak LR, and the global batch (sequences per optimizer step) it used."""

    optimizer: str
    learning_rate: float
    global_batch: int
    source: str


# NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT scripts/run_pretraining.sh (h5 era): FusedLAMB, phase 1
# 6e-3 at train_batch_size 8192 per GPU x 8 GPUs (= 64 x 1024 sequences), phase 2 4e-3 at 4096 x 8.
# Habana Model-References deepspeed-bert: LANS, 0.0015; the published 1.5B runs scaled it linearly with the global
# batch from 8 nodes x 8 accelerators x 384 sequences (0.003 on 16 nodes). Note: the repository's own
# run_bert_1.5b_8x.sh runs 0.0015 on ONE 8-card node at train_batch_size 12288. Habana publishes phase 1 only; its
# numbers are used for phase 2 too.
PUBLISHED: dict[str, dict[int, Recipe]] = {
    "bert_large": {1: Recipe("lamb", 6e-3, 65536, "NVIDIA DeepLearningExamples BERT phase 1"),
                   2: Recipe("lamb", 4e-3, 32768, "NVIDIA DeepLearningExamples BERT phase 2")},
    "bert_1p5b": {p: Recipe("lans", 0.0015, 8 * 8 * 384, "Habana Model-References deepspeed-bert BERT-1.5B")
                  for p in (1, 2)},
}
PUBLISHED["debug"] = PUBLISHED["bert_large"]  # the debug presets follow the model they shrink
PUBLISHED["debug_pre_ln"] = PUBLISHED["bert_1p5b"]


@dataclass(frozen=True)
class OptimArgs:
    """Optimizer and learning-rate schedule of bert_ref.train (DeepSpeed JSON has no optimizer section for BERT)."""

    optimizer: str = arg("lamb (NVIDIA's FusedLAMB update), lans (Habana's LANS) or adamw; '' = the preset's "
                         "published recipe (bert_large: lamb, bert_1p5b: lans).", default="")
    learning_rate: float = arg("Peak learning rate at --base_global_batch; 0 = the preset's published LR (bert_large "
                               "phase 1: 6e-3, phase 2: 4e-3; bert_1p5b: 0.0015).", default=0.0)
    weight_decay: float = arg("Weight decay for all weights except biases and LayerNorm.", default=0.01)
    beta1: float = arg("Adam beta1.", default=0.9)
    beta2: float = arg("Adam beta2.", default=0.999)
    eps: float = arg("Adam epsilon (FusedLAMB's and Habana's LANS's 1e-6).", default=1e-6)
    max_grad_norm: float = arg("lamb only: FusedLAMB's global gradient-norm pre-normalization threshold (NVIDIA: 1.0; "
                               "0 = off). Under ZeRO / bf16 the DeepSpeed JSON's gradient_clipping must equal it.",
                               default=1.0)
    bias_correction_lag: bool = arg("lamb / lans: bias-correct with step t-1 from step 2 on, as Habana's "
                                    "run_pretraining.py does whenever ZeRO is on (adjust_step=True).", default=False)
    warmup_proportion: float = arg("Fraction of max_steps with linear warm-up from 0 to the peak LR.", default=0.05)
    constant_proportion: float = arg("Fraction of max_steps held at the peak LR after warm-up.", default=0.0)
    poly_degree: float = arg("Degree of the polynomial decay to 0 over the remaining steps (1 = linear).",
                             default=1.0)
    scale_lr_with_global_batch: bool = arg("Peak LR = learning_rate * train_batch_size / base_global_batch (linear "
                                           "scaling: the published 1.5B runs, 0.0015 at 8 x 8 x 384 = 24576 "
                                           "sequences, 0.003 at twice that).", default=False)
    base_global_batch: int = arg("Global batch that learning_rate was tuned for; 0 = the preset's published one "
                                 "(bert_large phase 1: 65536, phase 2: 32768; bert_1p5b: 24576).", default=0)

    def validate(self) -> None:
        if self.optimizer not in OPTIMIZERS + ("",):
            raise ConfigError(f"--optimizer {self.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
        checks = [("learning_rate", self.learning_rate >= 0, ">= 0 (0 = the preset's)"),
                  ("weight_decay", self.weight_decay >= 0, ">= 0"), ("max_grad_norm", self.max_grad_norm >= 0, ">= 0"),
                  ("warmup_proportion", 0 <= self.warmup_proportion <= 1, "in [0, 1]"),
                  ("constant_proportion", 0 <= self.constant_proportion <= 1, "in [0, 1]"),
                  ("poly_degree", self.poly_degree > 0, "> 0"),
                  ("base_global_batch", self.base_global_batch >= 0, ">= 0 (0 = the preset's)")]
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"OptimArgs.{name} = {getattr(self, name)!r}: expected {expected}")
        if self.warmup_proportion + self.constant_proportion > 1:
            raise ConfigError(f"warmup_proportion {self.warmup_proportion} + constant_proportion "
                              f"{self.constant_proportion} > 1")

    def for_preset(self, preset_name: str, phase: int = 1) -> "OptimArgs":
        """These args with '' / 0 fields filled from the preset's published recipe (PUBLISHED); a preset without
        one needs --optimizer and --learning_rate."""
        recipe = PUBLISHED.get(preset_name, {}).get(phase)
        missing = [f"--{k}" for k, v in (("optimizer", self.optimizer), ("learning_rate", self.learning_rate),
                                         ("base_global_batch", self.base_global_batch or
                                          not self.scale_lr_with_global_batch)) if not v]
        if recipe is None and missing:
            raise ConfigError(f"preset {preset_name!r} phase {phase} has no published recipe: set {', '.join(missing)}")
        if recipe is None:
            return replace(self)
        return replace(self, optimizer=self.optimizer or recipe.optimizer,
                       learning_rate=self.learning_rate or recipe.learning_rate,
                       base_global_batch=self.base_global_batch or recipe.global_batch)


def peak_lr(args: OptimArgs, global_batch: int) -> float:
    """The peak LR a run uses: learning_rate, or with --scale_lr_with_global_batch learning_rate * global_batch /
    base_global_batch (Goyal et al.'s linear rule, as the published 1.5B runs: 0.0015 at 24576 -> 0.003 at 49152)."""
    if not args.scale_lr_with_global_batch:
        return args.learning_rate
    if args.base_global_batch <= 0 or global_batch <= 0:
        raise ConfigError(f"--scale_lr_with_global_batch: base_global_batch {args.base_global_batch} and "
                          f"train_batch_size {global_batch} must be > 0")
    return args.learning_rate * global_batch / args.base_global_batch


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and LayerNorm weights get no weight decay (BERT's original recipe; NVIDIA's and Habana's no_decay list
    'bias', 'gamma', 'beta', 'LayerNorm'; MegatronBert names its pre-sublayer LayerNorms `ln`)."""
    leaf = name.rsplit(".", 1)
    owner = leaf[0].rsplit(".", 1)[-1] if len(leaf) == 2 else ""
    return (name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name.lower() or owner == "ln")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, skip = [], []
    for name, p in model.named_parameters():  # tied weights are yielded once
        if p.requires_grad:
            (skip if no_decay(name, p) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": skip, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, args: OptimArgs, global_batch: int = 0) -> torch.optim.Optimizer:
    """The client optimizer handed to DeepSpeed, with weight-decay groups and the peak LR (peak_lr). args must be
    resolved (OptimArgs.for_preset). Under DeepSpeed call bert_ref.layerwise.attach_zero_layout(engine, optimizer)
    after deepspeed.initialize."""
    if not args.optimizer or not args.learning_rate:
        raise ConfigError("build_optimizer: optimizer and learning_rate unset; resolve the args with "
                          "OptimArgs.for_preset(preset) first")
    lr = peak_lr(args, global_batch)
    groups = param_groups(model, args.weight_decay)
    betas = (args.beta1, args.beta2)
    if args.optimizer == "lamb":  # NVIDIA: FusedLAMB(groups, lr) with apex's defaults
        return NVLAMB(groups, lr=lr, betas=betas, eps=args.eps, max_grad_norm=args.max_grad_norm,
                      adjust_step=args.bias_correction_lag)
    if args.optimizer == "lans":  # Habana: LANS(max_grad_norm=0., eps=1e-6, adjust_step=<ZeRO on>, ...)
        return LANS(groups, lr=lr, betas=betas, eps=args.eps, max_grad_norm=0.0, adjust_step=args.bias_correction_lag)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=args.eps)
    raise ConfigError(f"--optimizer {args.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")


# NVIDIA's schedule (linear warm-up, constant phase, polynomial decay; DeepLearningExamples' PolyWarmUpScheduler) lives
# in ds_core.schedule with the Trainer kinds, so BERT and BridgeTower share one schedule class. Step is 0-based.
lr_factor = poly_warmup_factor


def schedule_for(args: OptimArgs, total_steps: int):
    """callable(optimizer) -> ds_core.schedule.LRSchedule, the form DeepSpeed's `lr_scheduler=` argument accepts."""
    lr_factor(0, total_steps, args.warmup_proportion, args.constant_proportion, args.poly_degree)  # validate early

    def make(optimizer: Any) -> LRSchedule:
        return LRSchedule(optimizer, lambda step: lr_factor(step, total_steps, args.warmup_proportion,
                                                            args.constant_proportion, args.poly_degree),
                          f"poly_warmup, warm-up {args.warmup_proportion} of {total_steps} steps")
    return make


__all__ = ["OptimArgs", "Recipe", "PUBLISHED", "NVLAMB", "LANS", "build_optimizer", "param_groups", "no_decay",
           "peak_lr", "lr_factor", "schedule_for", "OPTIMIZERS"]
