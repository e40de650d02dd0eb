"""The parts of a training step that the loop (ds_core.run.trainer.Trainer.fit) calls around the DeepSpeed engine:
what a model's step function returns (StepOutput), moving host batches to the device and cutting Gaudi's lazy-mode
graph (to_device, pin_batches, step_marker), the micro steps' sums and their ONE all-reduce per optimizer step
(Accumulator), and the optimizer step's values around engine.step() (Update: the LR it used, whether DeepSpeed
skipped it, the gradient norm, all without a host read; step_or_stop: engine.step() where a non-finite norm that
Habana's fork asserts on becomes the divergence verdict).

A model package supplies the step function (engine, batch) -> StepOutput; the loop does backward, step and timing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as tdist

from ds_core.device import hpu


class NonFiniteGradNorm(RuntimeError):
    """DeepSpeed's optimizer stopped on a non-finite gradient norm instead of skipping the update (Habana's fork:
    BF16_Optimizer.step asserts `all_groups_norm > 0`); the trainer turns it into the divergence verdict."""


@dataclass
class StepOutput:
    loss: torch.Tensor  # scalar on the device: what backward uses
    samples: int  # samples in this micro batch on this rank
    tokens: int = 0  # tokens in this micro batch on this rank (0 where it means nothing)
    logs: dict = field(default_factory=dict)  # extra scalars averaged over micro-steps and ranks (mlm_loss, ...)


StepFn = Callable[[Any, Any], StepOutput]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (a batch's, a small vector) on the device without a host sync: a copy from pageable memory waits
    for the device (torch.tensor(..., device=cuda) waits for the stream); from pinned memory, which DeepSpeed's
    accelerator gives on CUDA and HPU alike (GaudiTrainer pins its batches by default), it is asynchronous."""
    if not pin_batches(device):
        return host
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().pin_memory(host).to(device, non_blocking=True)


def pin_batches(device: torch.device) -> bool:
    """Whether host batches for `device` go through pinned memory (a DataLoader's pin_memory, to_device): on every
    accelerator, CUDA and HPU alike (optimum-habana's GaudiTrainer pins by default; Habana's "Profiling with PyTorch"
    page recommends pinned memory and non_blocking copies); never on a CPU, where nothing is copied."""
    return device.type != "cpu"


def step_marker(device: torch.device) -> Callable[[], None] | None:
    """What cuts the graph after a backward and after an optimizer step: htcore.mark_step on an HPU in lazy mode
    (PT_HPU_LAZY_MODE=1), where optimum-habana's GaudiTrainer and Habana's DeepSpeed BERT call it; None elsewhere
    (eager mode, torch.compile, CUDA, CPU: nothing accumulates). ds_core.device.hpu says where each rule is from."""
    return hpu.mark_step_fn(device.type, device.type == "hpu" and hpu.lazy_mode())


class Accumulator:
    """Sums of one optimizer step's micro-steps, reduced across ranks in ONE all-reduce at the boundary, on the
    device: nothing here reads a device value on the host. The sums are float64 where the device has it and float32
    on an HPU (no float64 there, and HCCL reduces none: ds_core.device.hpu.sum_dtype), with the counts (micro steps,
    samples, tokens, the stop flag) kept exact in float32 by hpu.count_parts."""

    def __init__(self, device: torch.device):
        self.device = device
        self.dtype = hpu.sum_dtype(device.type)
        self.reset()

    def reset(self) -> None:
        self.stop = False  # this rank wants to stop after this step (signal); set before reduce()
        self.loss = torch.zeros((), device=self.device)
        self.micro = 0
        self.samples = 0
        self.tokens = 0
        self.logs: dict[str, Any] = {}  # a device tensor, or a host number where the step function gave one

    def add(self, out: StepOutput) -> None:
        self.loss = self.loss + out.loss.detach().float()
        self.micro += 1
        self.samples += int(out.samples)
        self.tokens += int(out.tokens)
        for k, v in out.logs.items():
            v = v.detach().float().reshape(()) if isinstance(v, torch.Tensor) else float(v)
            self.logs[k] = self.logs[k] + v if k in self.logs else v

    def reduce(self, world_size: int) -> tuple[torch.Tensor, list[str]]:
        """[loss, logs (device ones, then host ones)..., counts (micro, samples, tokens, stop; hpu.count_parts)]
        summed over ranks in self.dtype on the device; the logs' keys. One collective per optimizer step; it also
        makes the stop and NaN verdicts the same on all ranks. ds_core.run.readback takes the vector apart."""
        keys = sorted(self.logs)
        on_dev = [k for k in keys if isinstance(self.logs[k], torch.Tensor)]
        counts = hpu.count_parts([self.micro, self.samples, self.tokens, int(self.stop)], self.dtype, world_size)
        host = torch.tensor([self.logs[k] for k in keys if k not in on_dev] + counts, dtype=self.dtype)
        parts = [self.loss.reshape(1)] + [self.logs[k].reshape(1) for k in on_dev]
        vec = torch.cat([p.to(self.dtype) for p in parts] + [to_device(host, self.device)])
        if tdist.is_initialized() and world_size > 1:
            tdist.all_reduce(vec)
        return vec, on_dev + [k for k in keys if k not in on_dev]


@dataclass
class Update:
    """One optimizer step's values around engine.step(), none read on the host: `of` takes them before it (the
    micro steps' sums in their one all-reduce, the LR this update uses, ZeRO-0 fp32's norm, DeepSpeed's skipped-step
    counter), `after_step` after it (the gradient norm, whether DeepSpeed skipped the update). ds_core.run.readback
    carries them to the host."""

    vec: torch.Tensor  # Accumulator.reduce's vector, summed over ranks; after_step appends the gradient norm
    keys: list[str]  # its logs' keys
    lr: float | None
    grad_norm: Any  # a device tensor, a number, or None (after_step takes DeepSpeed's where this is None)
    skipped_before: int
    skipped: bool = False
    has_norm: bool = False

    @classmethod
    def of(cls, engine: Any, acc: Accumulator, world_size: int, stop: bool) -> "Update":
        """At the boundary, before engine.step(); `stop`: this rank was asked to stop (a signal)."""
        acc.stop = stop
        vec, keys = acc.reduce(world_size)
        lrs = engine.get_lr()
        return cls(vec, keys, lrs[0] if lrs else None, fp32_grad_norm(engine), engine.skipped_steps)

    def after_step(self, engine: Any) -> None:
        """After engine.step(): the gradient norm joins the vector where there is one; `skipped` is set. A skipped
        update's LR schedule is stepped here: DeepSpeed does not step the scheduler on a skipped update
        (engine._take_model_step), and optimizer step k always uses schedule(k), so the schedule ends on the loop's
        last step."""
        grad_norm = self.grad_norm if self.grad_norm is not None else global_grad_norm(engine)
        self.skipped = engine.skipped_steps > self.skipped_before
        if self.skipped and engine.lr_scheduler is not None:
            engine.lr_scheduler.step()
        norm = _norm_part(grad_norm, self.vec)
        self.has_norm = bool(norm)
        if norm:
            self.vec = torch.cat([self.vec] + norm)


def fp32_grad_norm(engine) -> torch.Tensor | None:
    """Global gradient norm (on the device) where DeepSpeed keeps none: ZeRO-0 without bf16/fp16 (its basic-optimizer
    path clips in place and drops the norm). Called at the boundary before engine.step(), when .grad holds the
    all-reduced gradients; every other configuration gets the norm from engine.get_global_grad_norm()."""
    if engine.zero_optimization_stage() != 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None
    norms = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else None


def _norm_part(norm: Any, like: torch.Tensor) -> list[torch.Tensor]:
    """DeepSpeed's norm (a device tensor, a Python inf on a skipped step, or None) as a 1-element part in like's
    dtype (the step vector's: float64, or float32 on an HPU)."""
    if norm is None:
        return []
    if isinstance(norm, torch.Tensor):
        return [norm.detach().reshape(1).to(device=like.device, dtype=like.dtype)]
    return [to_device(torch.tensor([float(norm)], dtype=like.dtype), like.device)]


def global_grad_norm(engine) -> Any:
    """The global gradient norm of the last step as DeepSpeed keeps it (a device tensor, a number, or None), without a
    host read: the engine's _global_grad_norm, which DeepSpeed sets after every optimizer step and 0.19's
    get_global_grad_norm() returns as it is; Habana's fork's get_global_grad_norm() calls .item() on it, a device sync
    every step (ds_core.compat.changes: engine_grad_norm). An engine without the attribute: its method."""
    from ds_core.compat.changes import is_on

    if "_global_grad_norm" in vars(engine) and is_on("engine_grad_norm"):
        return vars(engine)["_global_grad_norm"]
    return engine.get_global_grad_norm()


def step_or_stop(engine) -> None:
    """engine.step(); NonFiniteGradNorm where the optimizer asserted on a non-finite gradient norm. What a non-finite
    norm does is DeepSpeed's (ds_core.compat.deepspeed_behaviour): 0.19's BF16_Optimizer skips the update (counted in
    engine.skipped_steps, judged by the divergence guard); Habana's fork's asserts the norm is > 0 after masking a
    non-finite one as -1. Only that case is caught: any other assertion is DeepSpeed's and propagates."""
    try:
        engine.step()
    except AssertionError:
        norm = getattr(engine.optimizer, "_global_grad_norm", None)
        value = float(norm) if isinstance(norm, (torch.Tensor, float, int)) else None
        if value is None or (math.isfinite(value) and value > 0):
            raise
        what = "0 (no gradient reached the optimizer)" if value == 0 else f"{value:g} (its mark of inf/NaN)"
        raise NonFiniteGradNorm(f"{type(engine.optimizer).__name__} of DeepSpeed {_ds_version()} stops on a norm "
                                f"that is not > 0 (gradient norm {what}) rather than skipping the update") from None


def _ds_version() -> str:
    import deepspeed

    return str(deepspeed.__version__)


__all__ = ["Accumulator", "NonFiniteGradNorm", "StepFn", "StepOutput", "Update", "fp32_grad_norm", "global_grad_norm",
           "pin_batches", "step_marker", "step_or_stop", "to_device"]
