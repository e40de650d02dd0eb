"""THE training loop, shared by every model, as a Trainer made of components: the step (ds_core.run.loop.Step: micro-steps,
accumulation, one all-reduce per optimizer step, NaN guard), checkpointing and evaluation (ds_core.run.components), metrics
(ds_core.outputs.metrics, built from one RunInfo) and stop requests (ds_core.run.loop.StopRequest).

An entry point: run = start_run(spec) (ds_core.run.setup); build model and engine; Trainer(run, engine, step_fn, ...)
.fit(); export. Total optimizer steps come from run.total_steps, decided once by start_run, the same number the LR
schedule was built with.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, Callable

from ds_core import checkpoint as ckpt
from ds_core.run.components import Checkpointing, Evaluation, EvalTask, Position
from ds_core.config import atomic_write_text, precision_of
from ds_core.run.divergence import DivergenceGuard
from ds_core.rank.engine import shutdown_distributed
from ds_core.run.loop import EXIT_STOPPED, Step, StepFn, StopRequest, TrainingDiverged, reduce_summary_stats
from ds_core.outputs.metrics import (Metrics, RunInfo, accelerator_kind, last_summary, peak_memory_bytes, peak_probe_for,
                             peak_tflops_for)
from ds_core.outputs.phases import PhaseTimer, console_line, record_fields, summary_fields
from ds_core.device.precision import resolve_precision
from ds_core.outputs.results import save_metrics
from ds_core.run.setup import Run

_END = object()  # end-of-epoch sentinel of the timed next(batch)


class Trainer:
    """Train run.data with `engine` to run.total_steps (cfg.max_steps, or cfg.max_epochs of the data), then the
    evaluation's `after` tasks; fit() returns the final metrics summary record ({} for a run without training).

    fingerprint: extra keys a checkpoint must match on resume (preset, optimizer).
    init_from: a run directory whose latest checkpoint this run starts from when it has none of its own to resume
        (ds_core.checkpoint.init_from: weights and optimizer state; a new phase with its own schedule and data); step
        numbers continue from that checkpoint's step, and the run's total steps count the steps of this phase.
    clock: replaces the metrics clock (tests drive time with it; time.perf_counter by default).
    save_every: checkpoint every N optimizer steps instead of cfg.num_steps_per_checkpoint (0: none).
    epoch_of: step -> the (fractional) epoch written into each step and eval record as "epoch" (transformers'
        Trainer logs it with every entry); None: no such key.
    checkpoint_files: rank 0, (checkpoint directory, step) -> None, called while a checkpoint is saved, after the
        step's metrics record is durable and before COMPLETE: files of the model's own beside the checkpoint's
        (transformers' trainer_state.json, training_args.bin in checkpoint-N).

    Stopped early (SIGTERM / SIGUSR1 on any rank, or cfg.max_steps_this_run): every rank finishes the optimizer step,
    saves a checkpoint, writes the summary and the process exits with EXIT_STOPPED (SystemExit), to go on with
    --resume."""

    def __init__(self, run: Run, engine: Any, step_fn: StepFn, *, model_name: str, flops_per_sample: float,
                 seq_len: int = 0, evaluation: Evaluation | None = None, fingerprint: dict | None = None,
                 init_from: str | None = None, reset_optimizer: bool = False,
                 clock: Callable[[], float] | None = None, save_every: int | None = None,
                 epoch_of: Callable[[int], float] | None = None,
                 checkpoint_files: Callable[[Path, int], None] | None = None):
        self.run, self.engine, self.step_fn = run, engine, step_fn
        self.cfg, self.dist = run.train, run.dist
        self.evaluation = evaluation or Evaluation()
        self.checkpoints = Checkpointing(run, engine, fingerprint, init_from=init_from,
                                         reset_optimizer=reset_optimizer)
        self.model_name, self.flops_per_sample, self.seq_len = model_name, flops_per_sample, seq_len
        self.clock = clock or time.perf_counter
        # checkpoint every N optimizer steps: cfg.num_steps_per_checkpoint unless the model decides it from its data
        # (Trainer's --save_strategy epoch)
        self.save_every = save_every if save_every is not None else self.cfg.num_steps_per_checkpoint
        self.epoch_of, self.checkpoint_files = epoch_of, checkpoint_files

    # -- the run -----------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        summary = self._train() if self.run.data is not None else {}
        ev = self.evaluation
        if self.run.data is None and ev.during is not None:
            ev.run(ev.during, self.engine, 0)  # an eval-only run
        for task in ev.after:
            ev.run(task, self.engine, 0)
        if ev.close is not None:
            ev.close()
        if ev.save_results:
            for name, res in ev.results.items():
                save_metrics(self.cfg.run_dir, name, res, self.dist.rank)
        return summary

    def run_info(self, start_step: int) -> RunInfo:
        engine, dist, cfg = self.engine, self.dist, self.cfg
        kind = accelerator_kind(dist.accelerator, dist.device)
        precision = precision_of(self.run.ds_config)
        note = None
        if dist.rank == 0 and cfg.precision == "auto" and dist.accelerator == "cpu" and precision == "fp32":
            note = resolve_precision("auto", "cpu")[1]  # why fp32 (cached speeds), written into the summary
        return RunInfo(model=self.model_name, world_size=dist.world_size, nodes=dist.nodes,
                       accelerators_per_node=dist.local_world_size, accelerator=kind,
                       micro_batch=engine.train_micro_batch_size_per_gpu(),
                       grad_accum=engine.gradient_accumulation_steps(), zero_stage=engine.zero_optimization_stage(),
                       precision=precision, flops_per_sample=self.flops_per_sample, seq_len=self.seq_len,
                       warmup_steps=cfg.throughput_warmup_steps, log_every=cfg.log_every,
                       total_steps=start_step + self.run.total_steps,
                       peak_tflops=peak_tflops_for(kind, precision) if dist.rank == 0 else None,
                       precision_note=note)

    def _train(self) -> dict:
        engine, data, cfg, dist, ev = self.engine, self.run.data, self.cfg, self.dist, self.evaluation
        run_dir = Path(cfg.run_dir)
        if dist.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(run_dir / "ds_config.json", json.dumps(engine.config if isinstance(engine.config, dict)
                                                                     else {}, indent=2, sort_keys=True) + "\n")
        pos = self.checkpoints.start(data)
        end_step = pos.phase_start + self.run.total_steps
        if pos.resumed and (pos.step >= end_step if cfg.max_steps else pos.epoch >= cfg.max_epochs):
            # resumed from the final checkpoint: nothing to train, and no second eval or summary in metrics.jsonl
            if dist.rank == 0:
                print(f"[ds_core] --resume: {self.checkpoints.root / ckpt.tag_for(pos.step)} is this run's end (step "
                      f"{pos.step}, epoch {pos.epoch}); nothing to train, no record added", flush=True)
            self.evaluation.during = None  # its last results are in metrics.jsonl already
            return last_summary(run_dir / "metrics.jsonl") or {}
        from deepspeed.accelerator import get_accelerator

        info = self.run_info(pos.phase_start)
        metrics = Metrics(run_dir, info, rank=dist.rank, start_step=pos.step, clock=self.clock,
                          sync=get_accelerator().synchronize, monitor=getattr(engine, "monitor", None),
                          progress_bar=cfg.progress_bar,
                          peak_probe=peak_probe_for(info.accelerator, info.precision) if dist.rank == 0 else None)
        stop_request = StopRequest()
        stop_request.install()
        # sampled phase timing (ds_core.outputs.phases): data, forward, backward, exposed communication, optimizer step, wait
        phases = PhaseTimer(cfg.phase_timing_every, rank=dist.rank, world_size=dist.world_size, device=dist.device,
                            accelerator=get_accelerator())
        phases.next_step = pos.step + 1
        step_once = Step(engine, self.step_fn, dist.world_size, stop_request, phases)
        guard = DivergenceGuard(cfg.max_skipped_steps, cfg.loss_spike_factor)
        # max_steps, when given, wins over epochs (the data is cycled as often as needed), as in HF Trainer. By epochs
        # the epochs run to their end (a last partial accumulation included, as before) and make run.total_steps
        # optimizer steps: start_run counted them from the same len(data), and the LR schedule ends there too
        max_steps = end_step if cfg.max_steps else float("inf")
        max_epochs = float("inf") if cfg.max_steps else cfg.max_epochs
        step, epoch = pos.step, pos.epoch
        stopped = None  # why this process stops before the end: "SIGTERM", "SIGUSR1" or "max_steps_this_run"

        def before_complete() -> None:  # rank 0
            # the step's record is written (and fsync'ed) before COMPLETE: a kill after it never loses the record
            metrics.persist()
            if self.checkpoint_files is not None:
                self.checkpoint_files(self.checkpoints.root / ckpt.tag_for(step), step)

        def save() -> None:
            with metrics.timed("checkpoint"):  # outside the throughput window; reported as checkpoint_s
                self.checkpoints.save(pos, step, epoch, data, before_complete=before_complete)

        def evaluate() -> None:
            with metrics.timed("eval"):
                logs = ev.run(ev.during, engine, step)
                engine.train()
                if logs:
                    metrics.eval(step, dict(logs, epoch=self.epoch_of(step)) if self.epoch_of else logs)

        def diverged(loss: float) -> str:
            return (f"loss is {loss} at optimizer step {step + 1} (epoch {epoch}); the update was not applied and the "
                    f"latest checkpoint is still {self.checkpoints.latest()} in {self.checkpoints.root}")

        resumed_in_epoch = pos.resumed  # a resumed epoch may legitimately be empty (checkpoint at its very end)
        try:
            engine.train()
            metrics.begin()
            while step < max_steps and epoch < max_epochs:
                batches = 0
                batch_iter = iter(data)
                while True:
                    t_wait = metrics.clock()
                    phases.begin("data")
                    batch = next(batch_iter, _END)
                    phases.end("data")
                    metrics.data_wait(metrics.clock() - t_wait)
                    if batch is _END:
                        break
                    batches += 1
                    res = step_once(batch, diverged)
                    if res is None:
                        continue
                    step += 1
                    verdict = guard.observe(step, res.loss, res.skipped, res.grad_norm)
                    logs = dict(res.logs, **record_fields(phases.boundary(step)),  # every rank calls boundary()
                                skipped=res.skipped, skipped_steps=guard.total)
                    if self.epoch_of is not None:
                        logs["epoch"] = self.epoch_of(step)
                    metrics.step(step, res.samples, res.tokens, loss=res.loss, lr=res.lr, logs=logs,
                                 grad_norm=res.grad_norm)
                    if res.skipped and dist.rank == 0:
                        print(f"[ds_core] optimizer step {step} skipped by DeepSpeed (gradient norm {res.grad_norm}): "
                              f"the update was not applied; the LR schedule advanced as for an applied step "
                              f"({guard.consecutive} in a row, stop after {cfg.max_skipped_steps})", flush=True)
                    if verdict is not None:
                        metrics.persist()
                        raise TrainingDiverged(f"training diverged: {verdict}. Stopped without saving; the latest "
                                               f"checkpoint is still {self.checkpoints.latest()} in "
                                               f"{self.checkpoints.root} (resume from it with a lower learning rate)")
                    # evaluate, then save, as transformers' Trainer does (_maybe_log_save_evaluate): the step's record,
                    # written durably before its checkpoint completes, then holds its eval time too
                    if ev.due(step):
                        evaluate()
                    if self.save_every and step % self.save_every == 0:
                        save()
                    if step >= max_steps:
                        break
                    if res.stop:  # every rank got the same verdict from the all-reduce
                        stopped = signal.Signals(stop_request.signum).name if stop_request.signum else "signal"
                    elif cfg.max_steps_this_run and step - pos.step >= cfg.max_steps_this_run:
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
            phases.finish()  # a sample still pending (read one step late on CUDA/HPU); every rank
            if not stopped and step != end_step and dist.rank == 0:  # a data source whose len() is not what it yields
                print(f"[ds_core] warning: the run ended at optimizer step {step}, its LR schedule at {end_step} "
                      f"(len() of {type(data).__name__} differs from the batches it yielded)", flush=True)
            if (cfg.save_final_checkpoint or stopped) and step > 0:
                save()  # a stopped run always saves: --resume continues from exactly this step
            if ev.at_end(step, bool(stopped)):
                evaluate()
            extra = self._summary_extra(stopped)
            extra.update(summary_fields(phases.samples, first_step=pos.step + cfg.throughput_warmup_steps,
                                        overhead_s=phases.overhead_s))
            summary = metrics.summary(extra)
            if dist.rank == 0 and phases.samples:  # the console summary line of the phase timing
                print(f"[ds_core] step time ({summary['phase_sampled_steps']} sampled steps): "
                      f"{console_line(summary)}", flush=True)
        finally:
            metrics.close()
            if not stopped:
                stop_request.restore()
        if dist.rank == 0:
            print(f"[ds_core] metrics: {metrics.path.resolve()}", flush=True)
        if stopped:
            self._exit_stopped(stopped, step)
        return summary

    def _summary_extra(self, stopped: str | None) -> dict:
        data, dist = self.run.data, self.dist
        stats = data.summary_stats() if hasattr(data, "summary_stats") else {}
        extra = reduce_summary_stats(dict(stats, peak_memory_gb_per_rank=[peak_memory_bytes(dist.accelerator) / 2**30]),
                                     dist.world_size, frozenset(getattr(data, "shared_summary_stats", ())))
        extra["peak_memory_kind"] = "process peak RSS" if dist.accelerator == "cpu" else "allocator peak"
        if stopped:
            extra = dict(extra, stopped=stopped, exit_status=EXIT_STOPPED)
        return extra

    def _exit_stopped(self, reason: str, step: int) -> None:
        """End the process after an early stop: the checkpoint is saved and every rank is here (same verdict)."""
        if self.dist.rank == 0:
            # the last line of ours: DeepSpeed's launcher then logs "[ERROR] ... exits with return code = 75" (its words)
            print(f"[ds_core] stopped after optimizer step {step} ({reason}); checkpoint "
                  f"{self.checkpoints.root / ckpt.tag_for(step)} saved; exit status {EXIT_STOPPED} is a planned stop, "
                  f"not a failure (DeepSpeed's launcher reports it as '[ERROR] ... return code = {EXIT_STOPPED}'): "
                  f"run again with --resume to continue", flush=True)
        if hasattr(self.run.data, "close"):
            self.run.data.close()  # prefetch threads would otherwise keep the interpreter alive
        shutdown_distributed()  # as every entry point does at a normal end (gloo's exit-time abort otherwise)
        raise SystemExit(EXIT_STOPPED)


__all__ = ["Trainer", "Evaluation", "EvalTask", "Position"]
