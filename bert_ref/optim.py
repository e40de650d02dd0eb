"""Optimizers (NVLAMB, LANS, AdamW) with the published recipes' defaults per preset, weight-decay groups and LR scaling
with the global batch. The settings are ds_core.config.optim.OptimArgs (shared with BridgeTower); BERT's defaults and
the recipes fill it here (for_preset). The warm-up / constant / polynomial-decay LR schedule is ds_core.schedule's
poly_warmup kind.

`lamb` is NVIDIA's FusedLAMB update and `lans` Habana's LANS (bert_ref.layerwise: per-tensor trust ratios, also
under ZeRO once attach_zero_layout(engine, optimizer) has run). Without --optimizer / --learning_rate a preset runs
the recipe it is named after (PUBLISHED).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ds_core.config.optim import OPTIMIZERS, OptimArgs
from ds_core.errors import ConfigError
from ds_core.schedule import poly_warmup_factor

from .layerwise import LANS, NVLAMB


@dataclass(frozen=True)
class Recipe:
    """A published recipe's optimizer and peak LR, and the global batch (sequences per optimizer step) it used."""

    optimizer: str
    learning_rate: float
    global_batch: int
    source: str
    schedule: str = "nvidia_poly"  # ds_core.schedule.published kind (bert_ref.recipes has the full published recipes)


# NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT scripts/run_pretraining.sh (h5 era): FusedLAMB, phase 1
# 6e-3 at train_batch_size 8192 per GPU x 8 GPUs (= 64 x 1024 sequences), phase 2 4e-3 at 4096 x 8.
# Habana Model-References deepspeed-bert BERT-1.5B (scripts/run_bert_1.5b_8x.sh and deepspeed_config_bert_1.5b.json,
# bert_ref.recipes names the commit): LANS, 0.0015 at train_batch_size 12288 on any node count (the scripts do not
# scale it). Habana publishes phase 1 only; its numbers are used for phase 2 too.
PUBLISHED: dict[str, dict[int, Recipe]] = {
    "bert_large": {1: Recipe("lamb", 6e-3, 65536, "NVIDIA DeepLearningExamples BERT phase 1"),
                   2: Recipe("lamb", 4e-3, 32768, "NVIDIA DeepLearningExamples BERT phase 2")},
    "bert_1p5b": {p: Recipe("lans", 0.0015, 12288, "Habana Model-References deepspeed-bert BERT-1.5B",
                         "habana_poly") for p in (1, 2)},
}
PUBLISHED["debug"] = PUBLISHED["bert_large"]  # the debug presets follow the model they shrink
PUBLISHED["debug_pre_ln"] = PUBLISHED["bert_1p5b"]
PUBLISHED["bert_1p5b_habana"] = PUBLISHED["debug_habana"] = PUBLISHED["bert_1p5b"]  # same model, Habana's forward


# BERT's values for the OptimArgs settings left to the model (None / ''): NVIDIA's and Habana's recipes.
# the schedule kind: the recipe's (Recipe.schedule)
BERT_DEFAULTS = dict(weight_decay=0.01, eps=1e-6, max_grad_norm=1.0)
BERT_WARMUP_RATIO = 0.05  # when neither --warmup_steps nor --warmup_ratio (--warmup_proportion) is given


def bert_defaults(args: OptimArgs) -> OptimArgs:
    """args with BERT's defaults where the model's are asked for (None / '')."""
    fill = {k: v for k, v in BERT_DEFAULTS.items() if getattr(args, k) in (None, "")}
    if args.warmup_ratio is None:
        fill["warmup_ratio"] = 0.0 if args.warmup_steps else BERT_WARMUP_RATIO
    return replace(args, **fill)


def for_preset(args: OptimArgs, preset_name: str, phase: int = 1) -> OptimArgs:
    """args with BERT's defaults and the '' / None / 0 fields filled from the preset's published recipe (PUBLISHED);
    a preset without one needs --optimizer and --learning_rate. bert_ref.train resolves its settings with it."""
    args = bert_defaults(args)
    recipe = PUBLISHED.get(preset_name, {}).get(phase)
    missing = [f"--{k}" for k, v in (("optimizer", args.optimizer), ("learning_rate", args.learning_rate),
                                     ("base_global_batch", args.base_global_batch or
                                      not args.scale_lr_with_global_batch)) if not v]
    if recipe is None and missing:
        raise ConfigError(f"preset {preset_name!r} phase {phase} has no published recipe: set {', '.join(missing)}")
    if recipe is None:
        return replace(args, lr_scheduler_type=args.lr_scheduler_type or "nvidia_poly")
    return replace(args, optimizer=args.optimizer or recipe.optimizer,
                   lr_scheduler_type=args.lr_scheduler_type or recipe.schedule,
                   learning_rate=args.learning_rate or recipe.learning_rate,
                   base_global_batch=args.base_global_batch or recipe.global_batch)


def peak_lr(args: OptimArgs, global_batch: int) -> float:
    """The peak LR a run uses: learning_rate, or with --scale_lr_with_global_batch learning_rate * global_batch /
    base_global_batch (Goyal et al.'s linear rule: bert_1p5b's 0.0015 at 12288 -> 0.003 at 24576). The published
    recipes do not scale: they keep their global batch instead."""
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
                          "bert_ref.optim.for_preset(args, preset) first")
    args = bert_defaults(args)
    lr = peak_lr(args, global_batch)
    groups = param_groups(model, args.weight_decay)
    betas = (args.beta1, args.beta2)
    if args.optimizer == "lamb":  # NVIDIA: FusedLAMB(groups, lr) with apex's defaults
        return NVLAMB(groups, lr=lr, betas=betas, eps=args.eps, max_grad_norm=args.max_grad_norm,
                      adjust_step=args.bias_correction_lag)
    if args.optimizer == "lans":
        # Habana: LANS(max_grad_norm=0., eps=1e-6, adjust_step=<ZeRO on>, ...) with DeepSpeed's gradient_clipping 1.0:
        # the same clip at the same threshold, done here by whichever of the two attach_zero_layout picks
        return LANS(groups, lr=lr, betas=betas, eps=args.eps, max_grad_norm=args.max_grad_norm,
                    adjust_step=args.bias_correction_lag)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=args.eps)
    raise ConfigError(f"--optimizer {args.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")


# The schedules (nvidia_poly, habana_poly: ds_core.schedule.published; poly_warmup, this project's earlier Habana-like
# one) are kinds of ds_core.schedule, shared with BridgeTower; ds_core.config.optim.schedule_for builds them from
# OptimArgs.
# poly_warmup is kept under its old name for callers of lr_factor. Step is 0-based.
lr_factor = poly_warmup_factor


__all__ = ["Recipe", "PUBLISHED", "NVLAMB", "LANS", "build_optimizer", "param_groups", "no_decay", "peak_lr",
           "lr_factor", "bert_defaults", "for_preset", "BERT_DEFAULTS"]
