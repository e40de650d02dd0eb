"""THE training loop, shared by every model: micro-steps through the DeepSpeed engine, gradient accumulation, eval hook,
periodic checkpoints with exact resume, NaN/inf guard, and metrics through ds_core.metrics.

A model package supplies a step function (batch -> StepOutput) and a DataSource; behaviour that differs between
models goes into those or into a hook here, never into a second loop.
"""
from __future__ import annotations

import json
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as tdist

from ds_core import checkpoint as ckpt
from ds_core.config import ConfigError, TrainConfig, atomic_write_text, precision_of
from ds_core.engine import DistInfo, set_seed, shutdown_distributed
from ds_core.metrics import Metrics, accelerator_kind, peak_memory_bytes, peak_probe_for, peak_tflops_for
from ds_core.precision import resolve_precision
from ds_core.run_dir import RunDirInUse, in_use_message, previous_run


class TrainingDiverged(RuntimeError):
    """The loss became NaN or inf; no update was applied and the last good checkpoint stays the latest."""


# Exit status of a run stopped early on purpose (SIGTERM / SIGUSR1, or --max_steps_this_run) after saving a
# checkpoint: "run me again with --resume". 75 is EX_TEMPFAIL of sysexits.h ("temporary failure, retry"); a job
# script loops while the status is 75. 0 means training finished; anything else is a failure.
EXIT_STOPPED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class _StopRequest:
    """Remembers a SIGTERM / SIGUSR1 (Slurm preemption, spot/Batch termination) instead of dying mid-step.

    The handler only sets a flag; the loop folds it into the step's one all-reduce, so every rank stops after the
    same optimizer step even when only some ranks got the signal (DeepSpeed's launcher signals its ranks one after
    another, waiting up to 30 s for each)."""

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
    torch streams back; a new rank r gets ds_core.engine.set_seed(seed + step, r). Data order never comes from these
    streams (each source seeds its own generators from the global seed), so they only drive dropout and the like.
    """

    def set_epoch(self, epoch: int) -> None: ...
    def __iter__(self) -> Iterator[Any]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    # Optional: summary_stats() -> dict of THIS rank's counts (summed over ranks into the summary, lists
    # concatenated), and shared_summary_stats, the keys of it that are the same on every rank (taken from rank 0).


_END = object()  # end-of-epoch sentinel of the timed next(batch)

StepFn = Callable[[Any, Any], StepOutput]
EvalFn = Callable[[Any, int], dict]


def _scalar(v: Any, device: torch.device) -> torch.Tensor:
    return v.detach().float().reshape(()) if isinstance(v, torch.Tensor) else torch.tensor(float(v), device=device)


class _Accumulator:
    """Sums of one optimizer step's micro-steps, reduced across ranks in ONE all-reduce at the boundary."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.stop = False  # this rank wants to stop after this step (signal); set before reduce()
        self.stop_any = False  # some rank wants to: the same on every rank after reduce()
        self.loss = torch.zeros((), device=self.device)
        self.micro = 0
        self.samples = 0
        self.tokens = 0
        self.logs: dict[str, torch.Tensor] = {}

    def add(self, out: StepOutput) -> None:
        self.loss = self.loss + out.loss.detach().float()
        self.micro += 1
        self.samples += int(out.samples)
        self.tokens += int(out.tokens)
        for k, v in out.logs.items():
            self.logs[k] = self.logs.get(k, torch.zeros((), device=self.device)) + _scalar(v, self.device)

    def reduce(self, world_size: int) -> tuple[float, int, int, dict]:
        keys = sorted(self.logs)
        counts = torch.tensor([self.micro, self.samples, self.tokens], dtype=torch.float64, device=self.device)
        vec = torch.cat([self.loss.reshape(1).double(), counts] + [self.logs[k].reshape(1).double() for k in keys]
                        + [torch.tensor([float(self.stop)], dtype=torch.float64, device=self.device)])
        if tdist.is_initialized() and world_size > 1:
            tdist.all_reduce(vec)  # one collective per optimizer step; also makes the NaN verdict the same on all ranks
        vals = vec.tolist()
        self.stop_any = vals[-1] > 0  # and the stop verdict: a signal on any rank stops every rank after this step
        micro = max(vals[1], 1.0)
        return vals[0] / micro, int(vals[2]), int(vals[3]), {k: vals[4 + i] / micro for i, k in enumerate(keys)}


def _fp32_grad_norm(engine) -> float | None:
    """Global gradient norm where DeepSpeed keeps none: ZeRO-0 without bf16/fp16 (its basic-optimizer path clips
    in place and drops the norm). Called at the boundary before engine.step(), when .grad holds the all-reduced
    gradients; every other configuration gets the norm from engine.get_global_grad_norm()."""
    if engine.zero_optimization_stage() != 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None
    norms = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)).item() if norms else None


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


def train(engine, step_fn: StepFn, data: DataSource, cfg: TrainConfig, dist: DistInfo, *, model_name: str,
          flops_per_sample: float, seq_len: int = 0, eval_fn: EvalFn | None = None,
          fingerprint: dict | None = None, clock: Callable[[], float] | None = None, init_from: str | None = None,
          reset_optimizer: bool = False) -> dict:
    """Run training to cfg.max_steps (or cfg.max_epochs); returns the final metrics summary record.
    `clock` replaces the metrics clock (tests drive time with it; time.perf_counter by default).

    init_from: a run directory whose latest checkpoint this run starts from when it has none of its own to resume
    (ckpt.init_from: weights and optimizer state; a new phase with its own schedule and data). Step numbers continue
    from that checkpoint's step, and cfg.max_steps counts the steps of this phase.

    Stopped early (SIGTERM / SIGUSR1 on any rank, or cfg.max_steps_this_run): every rank finishes the optimizer step,
    saves a checkpoint, writes the summary and the process exits with EXIT_STOPPED (SystemExit), to go on with
    --resume."""
    run_dir = Path(cfg.run_dir)
    ckpt_root = run_dir / "checkpoints"
    # Backstop for an entry point that did not call ds_core.run_dir.prepare_run_dir before distributed init. Every
    # rank looks before any rank writes (the barrier), so they all decide alike.
    used = [] if cfg.resume else previous_run(run_dir)
    if tdist.is_initialized():
        tdist.barrier()
    if used:
        raise RunDirInUse(in_use_message(run_dir, used) + " (--overwrite_run_dir takes effect only where the entry "
                          "point calls ds_core.run_dir.prepare_run_dir before distributed init)")
    ds_config = engine.config if isinstance(engine.config, dict) else {}
    stage = engine.zero_optimization_stage()
    if dist.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "ds_config.json", json.dumps(ds_config, indent=2, sort_keys=True) + "\n")
    fp = dict(ckpt.model_fingerprint(engine, stage), **(fingerprint or {}))

    step, epoch = 0, 0
    phase_start = 0  # step this phase started from: 0, or the step of the init_from checkpoint
    resize = check_resize(engine, data, cfg, ckpt_root) if cfg.resume else None  # refusals before any loading
    state = ckpt.load(engine, ckpt_root, fp, seed=cfg.seed) if cfg.resume else None
    if state is not None:
        step, epoch = state["step"], state["epoch"]
        phase_start = state.get("phase_start", 0)
        if hasattr(data, "load_state_dicts"):
            data.load_state_dicts(state["data_states"])
        else:
            data.load_state_dict(state["data"])
        if resize is not None:
            apply_lr_factor(engine, resize.lr_factor)
        if dist.rank == 0:
            print(f"[ds_core] resumed from {ckpt_root / ckpt.tag_for(step)} at step {step}, epoch {epoch}", flush=True)
            if resize is not None:
                print(f"[ds_core] {resize.describe()}", flush=True)
    else:
        if cfg.resume and dist.rank == 0:
            print(f"[ds_core] --resume: no complete checkpoint in {ckpt_root}; starting from step 0", flush=True)
        if init_from:
            phase_start = step = ckpt.init_from(engine, Path(init_from) / "checkpoints", fp, reset_optimizer)
            if dist.rank == 0:
                print(f"[ds_core] starting from {init_from} at step {step} (optimizer state "
                      f"{'reset' if reset_optimizer else 'carried, step counters reset'})", flush=True)
        data.set_epoch(0)
        set_seed(cfg.seed, dist.rank)  # per-rank model randomness (dropout); a resume restored each rank's own
    if cfg.resume and dist.rank == 0:
        # The steps between the checkpoint and the interruption run again: keep one record per step.
        dropped = ckpt.trim_metrics(run_dir / "metrics.jsonl", step)
        if dropped:
            print(f"[ds_core] --resume: dropped {dropped} metrics record(s) after step {step} from "
                  f"{run_dir / 'metrics.jsonl'}", flush=True)
        if resize is not None:  # before ds_core.metrics opens the file (append): the record precedes the steps
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(resize.record(step)) + "\n")

    # Like HF Trainer: max_steps, when given, wins over epochs (the data source is cycled as often as needed).
    max_steps = phase_start + cfg.max_steps if cfg.max_steps else math.inf
    max_epochs = math.inf if cfg.max_steps else cfg.max_epochs
    kind = accelerator_kind(dist.accelerator, dist.device)
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    precision = precision_of(ds_config)
    note = None
    if dist.rank == 0 and cfg.precision == "auto" and dist.accelerator == "cpu" and precision == "fp32":
        note = resolve_precision("auto", "cpu")[1]  # why fp32 (cached speeds), written into the summary
    metrics = Metrics(run_dir, rank=dist.rank, world_size=dist.world_size, nodes=dist.nodes,
                      accelerators_per_node=dist.local_world_size, accelerator=kind, model_name=model_name,
                      micro_batch=engine.train_micro_batch_size_per_gpu(),
                      grad_accum=engine.gradient_accumulation_steps(), zero_stage=stage,
                      precision=precision, flops_per_sample=flops_per_sample, seq_len=seq_len,
                      warmup_steps=cfg.throughput_warmup_steps, log_every=cfg.log_every,
                      total_steps=phase_start + cfg.max_steps if cfg.max_steps else None,
                      peak_tflops=peak_tflops_for(kind, precision) if dist.rank == 0 else None,
                      monitor=getattr(engine, "monitor", None), progress_bar=cfg.progress_bar,
                      sync=accel.synchronize, start_step=step, clock=clock or time.perf_counter,
                      peak_probe=peak_probe_for(kind, precision) if dist.rank == 0 else None, precision_note=note)

    def save() -> None:
        with metrics.timed("checkpoint"):  # outside the throughput window; reported as checkpoint_s
            ckpt.save(engine, ckpt_root, step, {"epoch": epoch, "data": data.state_dict(), "phase_start": phase_start},
                      fp, keep=cfg.save_total_limit)

    def run_eval() -> None:
        with metrics.timed("eval"):
            logs = eval_fn(engine, step)
            engine.train()
            if logs:
                metrics.eval(step, logs)

    acc = _Accumulator(dist.device)
    resumed_in_epoch = state is not None  # a resumed epoch may legitimately be empty (checkpoint at its very end)
    stop_request = _StopRequest()
    stop_request.install()
    stopped = None  # why this process stops before max_steps: "SIGTERM", "SIGUSR1" or "max_steps_this_run"
    start_step = step
    try:
        engine.train()
        metrics.begin()
        while step < max_steps and epoch < max_epochs:
            batches = 0
            batch_iter = iter(data)
            while True:
                t_wait = metrics.clock()
                batch = next(batch_iter, _END)
                metrics.data_wait(metrics.clock() - t_wait)
                if batch is _END:
                    break
                batches += 1
                out = step_fn(engine, batch)
                engine.backward(out.loss)
                acc.add(out)
                boundary = engine.is_gradient_accumulation_boundary()  # read before step() advances the counter
                if boundary:
                    acc.stop = stop_request.signum is not None
                    loss, samples, tokens, logs = acc.reduce(dist.world_size)
                    stop_signal = acc.stop_any
                    if not math.isfinite(loss):
                        raise TrainingDiverged(
                            f"loss is {loss} at optimizer step {step + 1} (epoch {epoch}); the update was not "
                            f"applied and the latest checkpoint is still "
                            f"{ckpt.latest_tag(ckpt_root) or 'none'} in {ckpt_root}")
                    lrs = engine.get_lr()
                    lr = lrs[0] if lrs else None  # the LR this update uses
                    grad_norm = _fp32_grad_norm(engine)
                engine.step()
                if not boundary:
                    continue
                step += 1
                if grad_norm is None:
                    grad_norm = engine.get_global_grad_norm()
                metrics.step(step, samples, tokens, loss=loss, lr=lr, logs=logs, grad_norm=grad_norm)
                acc.reset()
                if cfg.num_steps_per_checkpoint and step % cfg.num_steps_per_checkpoint == 0:
                    save()
                if eval_fn is not None and cfg.eval_every and step % cfg.eval_every == 0:
                    run_eval()
                if step >= max_steps:
                    break
                if stop_signal:  # every rank got the same verdict from the all-reduce
                    stopped = signal.Signals(stop_request.signum).name if stop_request.signum else "signal"
                elif cfg.max_steps_this_run and step - start_step >= cfg.max_steps_this_run:
                    stopped = "max_steps_this_run"
                if stopped:
                    break
            if step >= max_steps or stopped:
                break
            if batches == 0 and not resumed_in_epoch:
                raise RuntimeError(f"the data source yielded no batch in epoch {epoch} on rank {dist.rank}: "
                                   f"too little data for micro batch {engine.train_micro_batch_size_per_gpu()}")
            resumed_in_epoch = False
            epoch += 1
            if epoch < max_epochs:
                data.set_epoch(epoch)
        metrics.end_training()  # the throughput window closes here: the final save and eval are timed apart
        if (cfg.save_final_checkpoint or stopped) and step > 0:
            save()  # a stopped run always saves: --resume continues from exactly this step
        if eval_fn is not None and not stopped and not (cfg.eval_every and step % cfg.eval_every == 0):
            run_eval()
        stats = data.summary_stats() if hasattr(data, "summary_stats") else {}
        extra = reduce_summary_stats(dict(stats, peak_memory_gb_per_rank=[peak_memory_bytes(dist.accelerator) / 2**30]),
                                     dist.world_size, frozenset(getattr(data, "shared_summary_stats", ())))
        extra["peak_memory_kind"] = "process peak RSS" if dist.accelerator == "cpu" else "allocator peak"
        if stopped:
            extra = dict(extra, stopped=stopped, exit_status=EXIT_STOPPED)
        summary = metrics.summary(extra)
    finally:
        metrics.close()
        if not stopped:
            stop_request.restore()
    if dist.rank == 0:
        print(f"[ds_core] metrics: {metrics.path.resolve()}", flush=True)
    if stopped:
        _exit_stopped(stopped, step, ckpt_root, data, dist)
    return summary


def check_resize(engine, data: Any, cfg: TrainConfig, ckpt_root: Path):
    """On --resume: the ds_core.ckpt_resize.ResizePlan when the latest checkpoint has another data-parallel size
    (None otherwise), after refusing what cannot be resized: a data source without load_state_dicts, an engine whose
    batch numbers are not those plan_resize chose (an entry point that did not call it)."""
    from ds_core.checkpoint.resize import Layout, ResizePlan, saved_layout

    tag = ckpt.latest_tag(ckpt_root) if ckpt_root.is_dir() else None
    if tag is None:
        return None
    old = saved_layout(ckpt_root, tag)
    new = Layout(engine.dp_world_size, engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                 engine.gradient_accumulation_steps())
    if old.dp_world_size == new.dp_world_size:
        return None
    where = f"--resume from {ckpt_root / tag} (saved by {old.dp_world_size} data-parallel ranks) on {new.dp_world_size}"
    if not hasattr(data, "load_state_dicts"):
        raise ConfigError(f"{where}: the data source {type(data).__module__}.{type(data).__name__} has no "
                          f"load_state_dicts, so it cannot deal the epoch's remaining samples to another number of "
                          f"ranks; resume on {old.dp_world_size} ranks")
    if cfg.on_resize == "keep_batch" and new.train_batch_size != old.train_batch_size:
        raise ConfigError(f"{where}, --on_resize keep_batch: this engine's global batch is {new.train_batch_size} "
                          f"(micro {new.micro_batch} x accumulation {new.grad_accum} x {new.dp_world_size}), the "
                          f"checkpoint's {old.train_batch_size}: the entry point must call "
                          f"ds_core.ckpt_resize.plan_resize on its DeepSpeed config before build_engine")
    factor = new.train_batch_size / old.train_batch_size if cfg.on_resize == "scale_lr" else 1.0
    return ResizePlan(tag, cfg.on_resize, old, new, factor)


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


def _exit_stopped(reason: str, step: int, ckpt_root: Path, data: Any, dist: DistInfo) -> None:
    """End the process after an early stop: the checkpoint is saved and every rank is here (same verdict)."""
    if dist.rank == 0:
        print(f"[ds_core] stopped after optimizer step {step} ({reason}); checkpoint {ckpt_root / ckpt.tag_for(step)} "
              f"saved; exit status {EXIT_STOPPED}: run again with --resume to continue", flush=True)
    if hasattr(data, "close"):
        data.close()  # prefetch threads would otherwise keep the interpreter alive
    shutdown_distributed()  # as every entry point does at a normal end (gloo's exit-time abort otherwise)
    raise SystemExit(EXIT_STOPPED)
