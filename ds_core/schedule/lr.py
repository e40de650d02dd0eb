"""Learning-rate schedules shared by every model, as transformers' Trainer has them.

Schedules: `transformers.get_scheduler`'s LambdaLR kinds (linear, cosine, cosine_with_restarts, polynomial, constant,
constant_with_warmup, inverse_sqrt) plus "poly_warmup" (linear warm-up, constant phase, polynomial decay: a
Habana-like BERT schedule; NVIDIA's and Habana's own are in ds_core.schedule.published). For the HF kinds
the per-step multiplier is transformers' own lambda, taken from a LambdaLR built on a one-tensor probe optimizer, so
the values are transformers' by construction rather than a copy that could drift.

`LRSchedule` is a plain class, not a torch LRScheduler: torch's refuses DeepSpeed's ZeRO optimizer wrappers (they are
not torch.optim.Optimizer instances), and DeepSpeed only needs step(), get_last_lr(), state_dict(), load_state_dict().
DeepSpeed calls step() once per optimizer step, after the update, and saves/restores the state with its checkpoints.

Step numbering is Trainer's: optimizer step k (0-based, the number of updates already applied) uses base_lr x
factor(k); with warm-up the first update therefore uses factor(0) = 0, exactly as a Trainer run does.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ds_core.errors import ConfigError
from ds_core.schedule.published import REF_KINDS, ref_schedule_factor

# transformers' LambdaLR-based kinds (reduce_lr_on_plateau and greedy react to metrics; wsd needs its own knobs).
HF_KINDS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
            "inverse_sqrt")


# + this project's earlier BERT schedule, and NVIDIA's and Habana's own (ds_core.schedule.published)
KINDS = HF_KINDS + ("poly_warmup",) + REF_KINDS


def warmup_steps_for(total_steps: int, warmup_steps: float = 0, warmup_ratio: float = 0.0) -> int:
    """Warm-up length in optimizer steps, as Trainer resolves it.

    transformers 5 takes one `warmup_steps` (>= 1: steps; < 1: a share of total steps, rounded up); transformers 4
    and optimum-habana also had `warmup_ratio`, used when warmup_steps is 0. Both forms are accepted."""
    if warmup_steps < 0 or not 0.0 <= warmup_ratio <= 1.0:
        raise ConfigError(f"warmup_steps = {warmup_steps} (expected >= 0), warmup_ratio = {warmup_ratio} "
                          "(expected in [0, 1])")
    if warmup_steps and warmup_ratio:
        raise ConfigError(f"warmup_steps = {warmup_steps} and warmup_ratio = {warmup_ratio} are both set: give one")
    if warmup_steps >= 1:
        return int(warmup_steps)
    share = warmup_steps or warmup_ratio
    return math.ceil(total_steps * share)


def total_optimizer_steps(max_steps: int, max_epochs: int, micro_batches_per_epoch: int, grad_accum: int) -> int:
    """Optimizer steps ds_core.run.trainer will run: max_steps when set, else epochs x micro batches / accumulation (the
    loop counts accumulation boundaries across epoch ends, so a partial accumulation carries into the next epoch)."""
    if max_steps:
        return max_steps
    return (max_epochs * micro_batches_per_epoch) // max(grad_accum, 1)


def poly_warmup_factor(step: int, total_steps: int, warmup_proportion: float, constant_proportion: float = 0.0,
                       degree: float = 1.0) -> float:
    """poly_warmup, a Habana-like BERT schedule (not NVIDIA's: ds_core.schedule.published). Step is 0-based.

    Linear warm-up reaching 1 at the last warm-up step ((step + 1) / warm, so the first update is not wasted at
    LR 0), a constant phase, then (1 - progress)^degree towards 0; steps past total_steps use 0."""
    if total_steps <= 0:
        raise ConfigError(f"LR schedule: total_steps = {total_steps}: expected > 0 (set --max_steps)")
    warm = int(round(warmup_proportion * total_steps))
    const = int(round(constant_proportion * total_steps))
    if step >= total_steps:
        return 0.0
    if step < warm:
        return (step + 1) / warm
    if step < warm + const:
        return 1.0
    decay = max(total_steps - warm - const, 1)
    return max(0.0, 1.0 - (step - warm - const) / decay) ** degree


def hf_factor(kind: str, total_steps: int, warmup_steps: int, base_lr: float = 1.0) -> Callable[[int], float]:
    """transformers' multiplier function for `kind` (what get_scheduler's LambdaLR applies at each step).

    base_lr matters for "polynomial" only: its lambda is relative to the optimizer's initial LR (lr_end is absolute)."""
    if kind not in HF_KINDS:
        raise ConfigError(f"lr_scheduler_type {kind!r}: expected one of {', '.join(KINDS)}")
    if kind == "constant" and warmup_steps:
        raise ConfigError(f"lr_scheduler_type constant with {warmup_steps} warm-up steps: transformers' constant "
                          "schedule ignores warm-up; use constant_with_warmup")
    if total_steps <= 0 and kind not in ("constant", "constant_with_warmup", "inverse_sqrt"):
        raise ConfigError(f"lr_scheduler_type {kind}: total_steps = {total_steps}: expected > 0")
    from transformers import get_scheduler

    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    return get_scheduler(kind, probe, num_warmup_steps=warmup_steps, num_training_steps=total_steps).lr_lambdas[0]


def schedule_factor(kind: str, total_steps: int, warmup_steps: int = 0, *, base_lr: float = 1.0,
                    constant_proportion: float = 0.0, degree: float = 1.0,
                    warmup_proportion: float | None = None) -> Callable[[int], float]:
    """step -> LR multiplier for any kind in KINDS (poly_warmup takes warmup_steps as a step count too; nvidia_poly
    and habana_poly take warmup_proportion, a share of the steps, as their references do)."""
    if kind in REF_KINDS:
        share = warmup_proportion if warmup_proportion is not None else (
            warmup_steps / total_steps if total_steps > 0 else 0.0)
        return ref_schedule_factor(kind, total_steps, share, constant_proportion, degree)
    if kind == "poly_warmup":
        if total_steps <= 0:
            raise ConfigError(f"lr_scheduler_type poly_warmup: total_steps = {total_steps}: expected > 0")
        proportion = warmup_steps / total_steps
        return lambda step: poly_warmup_factor(step, total_steps, proportion, constant_proportion, degree)
    return hf_factor(kind, total_steps, warmup_steps, base_lr)


class LRSchedule:
    """Applies base_lr x factor(step) to every param group of an optimizer (torch's or DeepSpeed's wrapper)."""

    def __init__(self, optimizer: Any, factor: Callable[[int], float], description: str = ""):
        self.optimizer, self.factor, self.description = optimizer, factor, description
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.last_step = 0  # optimizer steps taken
        self._apply()

    def _apply(self) -> None:
        f = float(self.factor(self.last_step))
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = base * f

    def step(self, *_: Any, **__: Any) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "base_lrs": list(self.base_lrs), "description": self.description}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = int(state["last_step"])
        self.base_lrs = list(state["base_lrs"])
        self._apply()


def lr_schedule(kind: str, total_steps: int, warmup_steps: int = 0, **kw: Any) -> Callable[[Any], LRSchedule]:
    """callable(optimizer) -> LRSchedule, the form deepspeed.initialize's `lr_scheduler=` accepts.

    The base LR is each param group's LR when DeepSpeed hands over its optimizer."""
    schedule_factor(kind, total_steps, warmup_steps, **kw)  # refuse a bad kind / step count before any rank builds

    def make(optimizer: Any) -> LRSchedule:
        base = optimizer.param_groups[0]["lr"] if optimizer.param_groups else 1.0
        factor = schedule_factor(kind, total_steps, warmup_steps, base_lr=base, **kw)
        return LRSchedule(optimizer, factor, f"{kind}, {warmup_steps} warm-up of {total_steps} steps")
    return make
