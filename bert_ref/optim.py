"""Optimizers (LAMB, LANS, AdamW), weight-decay groups and the warm-up / constant / polynomial-decay LR schedule.

LAMB comes from pytorch_optimizer (a maintained library). It has no LANS, so LANS is implemented here (~40 lines)
from its paper. Both are tested against their papers' update rules on a hand-computed example
(tests/test_bert_optim.py).

Trust ratios under ZeRO: DeepSpeed's bf16 / ZeRO optimizer wrappers hand the optimizer flat fp32 tensors (one per
parameter group and rank), so LAMB's and LANS's per-tensor "layer-wise" norms become norms over each rank's flat
partition. That is what DeepSpeed's own LAMB and Habana's ZeRO-1 BERT-1.5B runs do too; AdamW is unaffected.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from ds_core.config import ConfigError, arg

OPTIMIZERS = ("lamb", "lans", "adamw")



@dataclass
class OptimArgs:
    """Optimizer and learning-rate schedule of bert_ref.train (DeepSpeed JSON has no optimizer section for BERT)."""

    optimizer: str = arg("lamb (You et al. 2019), lans (Zheng et al. 2020; BERT-1.5B on Gaudi) or adamw.",
                           default="lamb")
    learning_rate: float = arg("Peak learning rate (before --scale_lr_with_nodes).", default=0.0015)
    weight_decay: float = arg("Weight decay for all weights except biases and LayerNorm.", default=0.01)
    beta1: float = arg("Adam beta1.", default=0.9)
    beta2: float = arg("Adam beta2.", default=0.999)
    eps: float = arg("Adam epsilon.", default=1e-6)
    warmup_proportion: float = arg("Fraction of max_steps with linear warm-up from 0 to the peak LR.", default=0.05)
    constant_proportion: float = arg("Fraction of max_steps held at the peak LR after warm-up.", default=0.0)
    poly_degree: float = arg("Degree of the polynomial decay to 0 over the remaining steps (1 = linear).",
                               default=1.0)
    scale_lr_with_nodes: bool = arg("Use learning_rate * nodes / base_nodes (the published BERT-1.5B runs: "
                                      "0.0015 at 8 nodes, 0.003 at 16).", default=False)
    base_nodes: int = arg("Node count that learning_rate was tuned for (with --scale_lr_with_nodes).", default=8)

    def validate(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer {self.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
        checks = [("learning_rate", self.learning_rate > 0, "> 0"), ("weight_decay", self.weight_decay >= 0, ">= 0"),
                  ("warmup_proportion", 0 <= self.warmup_proportion <= 1, "in [0, 1]"),
                  ("constant_proportion", 0 <= self.constant_proportion <= 1, "in [0, 1]"),
                  ("poly_degree", self.poly_degree > 0, "> 0"), ("base_nodes", self.base_nodes >= 1, ">= 1")]
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"OptimArgs.{name} = {getattr(self, name)!r}: expected {expected}")
        if self.warmup_proportion + self.constant_proportion > 1:
            raise ConfigError(f"warmup_proportion {self.warmup_proportion} + constant_proportion "
                              f"{self.constant_proportion} > 1")


def scaled_lr(lr: float, nodes: int, base_nodes: int = 8, enabled: bool = True) -> float:
    """Linear LR scaling with the node count (global batch grows with nodes): 0.0015 @ 8 nodes -> 0.003 @ 16."""
    return lr * nodes / base_nodes if enabled else lr


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and LayerNorm weights get no weight decay (BERT's original recipe)."""
    return name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name.lower()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, skip = [], []
    for name, p in model.named_parameters():  # tied weights are yielded once
        if p.requires_grad:
            (skip if no_decay(name, p) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": skip, "weight_decay": 0.0}]


class LANS(torch.optim.Optimizer):
    """LANS: Zheng et al. 2020, "Accelerated Large Batch Optimization of BERT Pretraining in 54 minutes"
    (arXiv:2006.13484), Algorithm 2, with phi = identity as in its GluonNLP reference implementation.

    Per parameter tensor x (a "block") with gradient g, at step t:
        g~ = g / ||g||                                     (per-block gradient normalisation)
        m = b1 m + (1 - b1) g~        v = b2 v + (1 - b2) g~^2
        m^ = m / (1 - b1^t)           v^ = v / (1 - b2^t)
        r = m^ / (sqrt(v^) + eps) + wd x        c = g~ / (sqrt(v^) + eps) + wd x
        x <- x - lr b1 (||x|| / ||r||) r - lr (1 - b1) (||x|| / ||c||) c
    A trust ratio whose numerator or denominator is 0 is replaced by 1 (as LAMB implementations do)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0):
        if lr <= 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"LANS: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @staticmethod
    def _trust(w_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
        ok = (w_norm > 0) & (u_norm > 0)
        return torch.where(ok, w_norm / torch.where(ok, u_norm, 1.0), torch.ones_like(w_norm))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                # fp32 math for bf16 / fp16 tensors (DeepSpeed hands us fp32 masters anyway); fp64 stays fp64
                g = p.grad if p.grad.dtype in (torch.float32, torch.float64) else p.grad.float()
                x = p if p.dtype in (torch.float32, torch.float64) else p.float()
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(x, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(x, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                g_norm = g.norm()
                g = g / torch.where(g_norm > 0, g_norm, 1.0)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
                r = (m / (1 - b1 ** t)).div_(denom)
                c = g.div(denom)
                if wd:
                    r.add_(x, alpha=wd)
                    c.add_(x, alpha=wd)
                w_norm = x.norm()
                upd = r.mul_(lr * b1 * self._trust(w_norm, r.norm()))
                upd.add_(c.mul_(lr * (1 - b1) * self._trust(w_norm, c.norm())))
                p.sub_(upd.to(p.dtype))
        return loss


def build_optimizer(model: torch.nn.Module, args: OptimArgs, nodes: int = 1) -> torch.optim.Optimizer:
    """The client optimizer handed to DeepSpeed, with weight-decay groups and the node-scaled peak LR."""
    lr = scaled_lr(args.learning_rate, nodes, args.base_nodes, args.scale_lr_with_nodes)
    groups = param_groups(model, args.weight_decay)
    betas = (args.beta1, args.beta2)
    if args.optimizer == "lamb":
        from pytorch_optimizer import Lamb

        # The paper's update (arXiv:1904.00962 v3, Algorithm 2; pytorch_optimizer follows v3, without bias
        # correction, and clamps ||x|| at 10 as the paper's phi):
        #   weight_decouple=False puts wd * x inside the trust-ratio update (the paper's r + lambda x), not
        #   AdamW-style outside it;
        #   adam_debias=True keeps the step size at lr: with False the library divides the already trust-normalised
        #   step by (1 - beta1^t), a 10x larger first step than the paper's rule (tests/test_bert_optim.py).
        return Lamb(groups, lr=lr, betas=betas, eps=args.eps, weight_decouple=False, grad_averaging=True,
                    adam_debias=True)
    if args.optimizer == "lans":
        return LANS(groups, lr=lr, betas=betas, eps=args.eps)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=args.eps)
    raise ConfigError(f"--optimizer {args.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")


def lr_factor(step: int, total_steps: int, warmup_proportion: float, constant_proportion: float = 0.0,
              degree: float = 1.0) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based: the number of steps already taken).

    Linear warm-up over the first warmup_proportion * total steps (reaching 1 at the last warm-up step), a constant
    phase of constant_proportion * total steps, then polynomial decay (1 - progress)^degree towards 0 over the rest
    (the last step keeps a small positive LR). Steps past total_steps use 0."""
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


class PolyWarmupSchedule:
    """LR scheduler over any object with param_groups (a torch optimizer or DeepSpeed's wrapper of it).

    A plain class instead of torch's LRScheduler because that refuses DeepSpeed's ZeRO wrappers (not torch
    Optimizer instances); DeepSpeed only needs step(), get_last_lr(), state_dict() and load_state_dict()."""

    def __init__(self, optimizer: Any, total_steps: int, warmup_proportion: float, constant_proportion: float = 0.0,
                 degree: float = 1.0):
        self.optimizer = optimizer
        self.total_steps, self.warmup_proportion = total_steps, warmup_proportion
        self.constant_proportion, self.degree = constant_proportion, degree
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.last_step = 0  # optimizer steps taken
        lr_factor(0, total_steps, warmup_proportion, constant_proportion, degree)  # validate early
        self._apply()

    def _apply(self) -> None:
        f = lr_factor(self.last_step, self.total_steps, self.warmup_proportion, self.constant_proportion,
                      self.degree)
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
        return {"last_step": self.last_step, "base_lrs": list(self.base_lrs), "total_steps": self.total_steps}

    def load_state_dict(self, state: dict) -> None:
        self.last_step = int(state["last_step"])
        self.base_lrs = list(state["base_lrs"])
        self._apply()


def schedule_for(args: OptimArgs, total_steps: int):
    """callable(optimizer) -> PolyWarmupSchedule, the form DeepSpeed's `lr_scheduler=` argument accepts."""
    def make(optimizer: Any) -> PolyWarmupSchedule:
        return PolyWarmupSchedule(optimizer, total_steps, args.warmup_proportion, args.constant_proportion,
                                  args.poly_degree)
    return make


__all__ = ["OptimArgs", "LANS", "build_optimizer", "param_groups", "no_decay", "scaled_lr", "lr_factor",
           "PolyWarmupSchedule", "schedule_for", "OPTIMIZERS"]
