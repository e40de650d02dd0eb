"""The step of THE training loop, shared by every model: micro-steps through the DeepSpeed engine, gradient
accumulation with one all-reduce per optimizer step, the NaN/inf guard and stop requests (signals). The loop around it
(epochs, checkpoints, evaluation, metrics) is ds_core.run.trainer.Trainer.

A model package supplies a step function (batch -> StepOutput) and a DataSource; behaviour that differs between
models goes into those or into a Trainer component, never into a second loop.
"""
from __future__ import annotations

import math
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as tdist

from ds_core.device import hpu
from ds_core.errors import ConfigError, RunVerdict
from ds_core.outputs.phases import PhaseTimer


class TrainingDiverged(RunVerdict):
    """The run diverged (a NaN/inf loss, ds_core.run.divergence's verdict, a non-finite gradient norm DeepSpeed stops
    on); no checkpoint holds the diverged state. Said in one line by ds_core.rank.process_end.run_main, status 1."""


class NonFiniteGradNorm(RuntimeError):
    """DeepSpeed's optimizer stopped on a non-finite gradient norm instead of skipping the update (Habana's fork:
    BF16_Optimizer.step asserts `all_groups_norm > 0`); the trainer turns it into the divergence verdict."""


# Exit status of a run stopped early on purpose (SIGTERM / SIGUSR1, or --max_steps_this_run) after saving a
# checkpoint: "run me again with --resume". 75 is EX_TEMPFAIL of sysexits.h ("temporary failure, retry"); a job
# script loops while the status is 75. 0 means training finished; anything else is a failure.
EXIT_STOPPED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Remembers a SIGTERM / SIGUSR1 (Slurm preemption, spot/Batch termination) instead of dying mid-step.

    The handler only sets a flag; the loop folds it into the step's one all-reduce, so every rank stops after the
    same optimizer step even when only some ranks got the signal (DeepSpeed's launcher signals its ranks one after
    another, waiting up to 30 s for each). The verdict is read with the step's other values: at once on a logging
    step (every step with the default --log_every 1), else one step late, so a signal in step k stops the run after
    step k or k + 1, the same step on every rank."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():  # Python delivers signals to the main thread
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass
class StepOutput:
    loss: torch.Tensor  # scalar on the device: what backward uses
    samples: int  # samples in this micro batch on this rank
    tokens: int = 0  # tokens in this micro batch on this rank (0 where it means nothing)
    logs: dict = field(default_factory=dict)  # extra scalars averaged over micro-steps and ranks (mlm_loss, ...)


class DataSource(Protocol):
    """What the loop needs of a model's data.

    state_dict(): THIS rank's position (saved per rank in client_rank{r}.pt of each checkpoint).
    load_state_dict(state): this rank's own saved state; used on a resume onto the same world size by a source that
        has no load_state_dicts.
    load_state_dicts(states) (optional; the resize contract): called on every resume with the saved states of ALL
        ranks of the checkpoint, in rank order, whether the world size is the same or not. The source knows its own
        rank and world size, and takes its share of the epoch's samples that no saved rank consumed: over the epoch
        every sample is seen exactly once, on any world size. On the same world size it must behave as
        load_state_dict(states[rank]) did (bitwise on CPU). A source without it resumes on the same world size only:
        ds_core refuses a resize naming the source's class, before any loading.
    RNG on a resize (ds_core.checkpoint.load): a rank that existed in the saved run gets its own python / numpy /
    torch streams back; a new rank r gets ds_core.rank.dist.set_seed(seed + step, r). Data order never comes from
    these streams (each source seeds its own generators from the global seed), so they only drive dropout and the like.
    """

    def set_epoch(self, epoch: int) -> None: ...
    def __iter__(self) -> Iterator[Any]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    # Optional: summary_stats() -> dict of THIS rank's counts (summed over ranks into the summary, lists
    # concatenated), and shared_summary_stats, the keys of it that are the same on every rank (taken from rank 0).


StepFn = Callable[[Any, Any], StepOutput]
EvalFn = Callable[[Any, int], dict]


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
        makes the stop and NaN verdicts the same on all ranks. PendingStep.read takes the vector apart."""
        keys = sorted(self.logs)
        on_dev = [k for k in keys if isinstance(self.logs[k], torch.Tensor)]
        counts = hpu.count_parts([self.micro, self.samples, self.tokens, int(self.stop)], self.dtype, world_size)
        host = torch.tensor([self.logs[k] for k in keys if k not in on_dev] + counts, dtype=self.dtype)
        parts = [self.loss.reshape(1)] + [self.logs[k].reshape(1) for k in on_dev]
        vec = torch.cat([p.to(self.dtype) for p in parts] + [to_device(host, self.device)])
        if tdist.is_initialized() and world_size > 1:
            tdist.all_reduce(vec)
        return vec, on_dev + [k for k in keys if k not in on_dev]


class PendingStep:
    """One optimizer step's reduced values on their way to the host. On an accelerator the vector is copied into
    pinned host memory behind an event (non_blocking): read() waits for that step's work only, so the loop reads
    step k while step k+1 is already queued and the device never idles for a read. On the CPU the vector is the
    host's already. The trainer fills step, epoch, logs (its step-time record fields), extra (callbacks' keys)."""

    def __init__(self, vec: torch.Tensor, keys: list[str], lr: float | None, skipped: bool, has_norm: bool):
        self.keys, self.lr, self.skipped, self.has_norm = keys, lr, skipped, has_norm
        self.step, self.epoch, self.logs, self.extra = 0, 0, {}, {}
        self._event = None
        if vec.device.type == "cpu":
            self._host = vec
        else:
            from deepspeed.accelerator import get_accelerator

            acc = get_accelerator()
            self._host = acc.pin_memory(torch.empty(vec.shape, dtype=vec.dtype))
            self._host.copy_(vec, non_blocking=True)
            self._event = acc.Event()
            self._event.record()

    def read(self) -> StepResult:
        if self._event is not None:
            self._event.synchronize()
        vals = self._host.tolist()  # a host tensor: no device sync
        n_logs, width = len(self.keys), hpu.count_width(self._host.dtype)
        end = 1 + n_logs + 4 * width
        micro, samples, tokens, stop = hpu.counts_from_parts(vals[1 + n_logs:end], self._host.dtype)
        micro = max(micro, 1)
        logs = dict(sorted((k, vals[1 + i] / micro) for i, k in enumerate(self.keys)))
        norm = vals[end] if self.has_norm else None
        return StepResult(vals[0] / micro, samples, tokens, logs, self.lr, norm, stop > 0, self.skipped, self.step)


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


def reduce_summary_stats(stats: dict, world_size: int, shared: frozenset | set = frozenset()) -> dict:
    """Sum a data source's summary statistics over ranks (numbers summed, lists concatenated in rank order), except
    the keys in `shared` (the same on every rank, e.g. the dataset size): those are rank 0's. Every rank calls it."""
    gathered: list = [stats]
    if tdist.is_initialized() and world_size > 1:
        gathered = [None] * world_size
        tdist.all_gather_object(gathered, stats)
    out: dict = {}
    for key in gathered[0]:
        vals = [g.get(key) for g in gathered]
        if key in shared:
            out[key] = vals[0]
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = sum(vals)
        elif all(isinstance(v, list) for v in vals):
            out[key] = [x for v in vals for x in v]
        else:
            out[key] = vals  # anything else is reported per rank rather than guessed at
    return out


@dataclass
class StepResult:
    """One optimizer step, reduced over ranks: the same on every rank."""

    loss: float
    samples: int
    tokens: int
    logs: dict
    lr: float | None  # the LR this update used
    grad_norm: float | None
    stop: bool  # some rank was asked to stop (signal): every rank stops after this step
    skipped: bool = False  # DeepSpeed skipped the update (non-finite gradient norm): see ds_core.run.divergence
    step: int = 0  # the optimizer step these values belong to


class Step:
    """The step component: one micro batch through the engine (forward by the model's step function, backward,
    engine.step), with the micro-steps of an optimizer step summed and reduced in ONE all-reduce at the boundary.

    Nothing is read on the host here: at a boundary the step returns a PendingStep (loss, counts, logs, stop flag and
    gradient norm on their way to the host), which the trainer reads one optimizer step later, or at once where it
    needs the values (a logging step, a save, an evaluation, the end). A NaN/inf loss is therefore seen after its
    update was applied (in memory); the trainer raises TrainingDiverged before any later save, so no checkpoint holds
    the diverged state."""

    def __init__(self, engine: Any, step_fn: StepFn, world_size: int, stop: StopRequest | None = None,
                 phases: Any = None):
        self.engine, self.step_fn, self.world_size = engine, step_fn, world_size
        self.stop = stop
        self.phases = phases or PhaseTimer(0)  # ds_core.outputs.phases: marks around forward, backward and engine.step
        self.acc = Accumulator(engine.device)
        self.mark_step = step_marker(engine.device)  # Gaudi's lazy mode: its graph cut after backward and after step

    def __call__(self, batch: Any) -> PendingStep | None:
        """Run one micro batch; the step's PendingStep at an accumulation boundary, else None."""
        engine, phases = self.engine, self.phases
        phases.begin("forward")
        out = self.step_fn(engine, batch)
        phases.end("forward")
        phases.begin("backward")
        engine.backward(out.loss)
        if self.mark_step is not None:
            self.mark_step()
        phases.end("backward")
        self.acc.add(out)
        if not engine.is_gradient_accumulation_boundary():  # read before step() advances the counter
            self._engine_step()
            return None
        self.acc.stop = self.stop is not None and self.stop.signum is not None
        vec, keys = self.acc.reduce(self.world_size)
        lrs = engine.get_lr()
        lr = lrs[0] if lrs else None
        grad_norm = fp32_grad_norm(engine)
        skipped_before = engine.skipped_steps
        self._engine_step(boundary=True)
        if grad_norm is None:
            grad_norm = global_grad_norm(engine)
        skipped = engine.skipped_steps > skipped_before
        if skipped and engine.lr_scheduler is not None:
            # DeepSpeed does not step the LR scheduler on a skipped update (engine._take_model_step): step it here
            # so that optimizer step k always uses schedule(k) and the schedule ends on the loop's last step
            engine.lr_scheduler.step()
        norm = _norm_part(grad_norm, vec)
        pending = PendingStep(torch.cat([vec] + norm) if norm else vec, keys, lr, skipped, bool(norm))
        self.acc.reset()
        return pending

    def _engine_step(self, boundary: bool = False) -> None:
        """engine.step() (every micro step: DeepSpeed steps the optimizer at the boundary, through step_or_stop),
        timed, then the lazy-mode graph cut where GaudiTrainer makes it."""
        self.phases.begin("step")
        if boundary:
            step_or_stop(self.engine)
        else:
            self.engine.step()
        if self.mark_step is not None:
            self.mark_step()
        self.phases.end("step")


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


def apply_lr_factor(engine, factor: float) -> None:
    """Multiply the LR by `factor` after a checkpoint restored the old one: the schedule's base LRs (ds_core.schedule
    .LRSchedule, torch LR schedulers) when there is a schedule, else the optimizer's param groups."""
    if factor == 1.0:
        return
    sched = engine.lr_scheduler
    if sched is None:
        for g in engine.optimizer.param_groups:
            g["lr"] *= factor
        return
    if not hasattr(sched, "base_lrs"):
        raise ConfigError(f"--on_resize scale_lr: the LR scheduler {type(sched).__name__} has no base_lrs to scale; "
                          f"use --on_resize keep_batch")
    sched.base_lrs = [b * factor for b in sched.base_lrs]
    for g in engine.optimizer.param_groups:  # the LR of the next update, until the schedule's next step
        g["lr"] *= factor


