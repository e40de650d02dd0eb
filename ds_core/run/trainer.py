"""THE training loop, shared by every model: Trainer.fit reads top-down, micro batch after micro batch through the
model's step function (forward), engine.backward and engine.step(), and at each accumulation boundary the optimizer
step's values reduced in one all-reduce (ds_core.run.step), sent to the host and read one step late
(ds_core.run.readback), recorded (ds_core.outputs.metrics, built from one RunInfo), judged (ds_core.run.divergence),
evaluated (ds_core.run.evaluation) and saved (ds_core.run.checkpointing) when due; a stop request
(ds_core.run.stop) ends it after the same step on every rank.

An entry point: run = start_run(spec) (ds_core.run.setup); build model and engine; Trainer(run, engine, step_fn,
ModelInfo(...), evaluation=..., checkpoints=..., callbacks=[...]).fit(); export. What one model needs that another does
not (Trainer's files beside each checkpoint, an epoch in every record) comes in as a Callback
(ds_core.run.callbacks), never as a loop argument. Total optimizer steps come from run.total_steps, decided once by
start_run, the same number the LR schedule was built with.
"""
from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ds_core import checkpoint as ckpt, log
from ds_core.compat import changes
from ds_core.device.precision import resolve_precision
from ds_core.files import atomic_write_text
from ds_core.outputs.metrics import (
    Metrics,
    RunInfo,
    accelerator_kind,
    last_summary,
    peak_memory_bytes,
    peak_probe_for,
    peak_tflops_for,
)
from ds_core.outputs.phases import PhaseTimer, console_line, record_fields, summary_fields
from ds_core.outputs.results import save_metrics
from ds_core.rank.dist import shutdown_distributed
from ds_core.run.callbacks import Callback, ProfileSteps
from ds_core.run.checkpointing import Checkpointing, Position
from ds_core.run.data import reduce_summary_stats
from ds_core.run.divergence import DivergenceGuard, TrainingDiverged
from ds_core.run.evaluation import EvalTask, Evaluation
from ds_core.run.readback import ReadBack, StepResult
from ds_core.run.setup import Run
from ds_core.run.step import Accumulator, NonFiniteGradNorm, StepFn, Update, step_marker, step_or_stop
from ds_core.run.stop import EXIT_STOPPED, StopRequest

_END = object()  # end-of-epoch sentinel of the timed next(batch)


@dataclass(frozen=True)
class ModelInfo:
    """What the metrics know of the model: its name in the records, its FLOPs per sample (forward + backward: the
    throughput in TFLOPs and the MFU) and its sequence length (0 where it means nothing)."""

    name: str
    flops_per_sample: float
    seq_len: int = 0




class Trainer:
    """Train run.data with `engine` to run.total_steps (cfg.max_steps, or cfg.max_epochs of the data), then the
    evaluation's `after` tasks; fit() returns the final metrics summary record ({} for a run without training).

    model: the model's name, FLOPs per sample and sequence length (the metrics' throughput and MFU).
    evaluation: when and what to evaluate (ds_core.run.evaluation.Evaluation).
    checkpoints: save / resume / init_from (ds_core.run.checkpointing.Checkpointing); default: one built from the
        run, saving every cfg.num_steps_per_checkpoint steps.
    callbacks: the model's own behaviour at the loop's named points (ds_core.run.callbacks.Callback: keys added to
        step and eval records, files written beside each checkpoint).
    clock: replaces the metrics clock (tests drive time with it; time.perf_counter by default).

    Stopped early (SIGTERM / SIGUSR1 on any rank, or cfg.max_steps_this_run): every rank finishes the optimizer step,
    saves a checkpoint, writes the summary and the process exits with EXIT_STOPPED (SystemExit), to go on with
    --resume."""

    def __init__(self, run: Run, engine: Any, step_fn: StepFn, model: ModelInfo, *,
                 evaluation: Evaluation | None = None, checkpoints: Checkpointing | None = None,
                 callbacks: Sequence[Callback] = (), clock: Callable[[], float] | None = None):
        self.run, self.engine, self.step_fn, self.model = run, engine, step_fn, model
        self.cfg, self.dist = run.train, run.dist
        self.evaluation = evaluation or Evaluation()
        self.checkpoints = checkpoints or Checkpointing(run, engine)
        self.callbacks = list(callbacks)
        self.profile = ProfileSteps(self.cfg.profile_steps, self.cfg.throughput_warmup_steps) \
            if self.cfg.profile_steps else None
        self.callbacks += [self.profile] if self.profile else []
        self.clock = clock or time.perf_counter

    # -- the run -----------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train: micro batches through forward, backward and engine.step(); at each accumulation boundary the
        optimizer step's values go to the host (read one step late) and the step is recorded, evaluated and saved
        when due. Then the evaluation's `after` tasks. Returns the final summary record."""
        if self.run.data is None:
            return self._evaluate_after({})  # an eval-only run
        if not self._start():  # resumed from this run's final checkpoint: its summary is in metrics.jsonl already
            return self._evaluate_after(last_summary(Path(self.cfg.run_dir) / "metrics.jsonl") or {})
        engine, phases = self.engine, self.phases
        try:
            engine.train()
            self.metrics.begin()
            for batch in self._micro_batches():  # epoch after epoch to the end step; each wait timed ("data")
                phases.begin("forward")
                out = self.step_fn(engine, batch)  # the model's forward and loss (a StepOutput)
                phases.end("forward")
                phases.begin("backward")
                engine.backward(out.loss)
                self._cut_graph()
                phases.end("backward")
                self.acc.add(out)
                update = None
                if engine.is_gradient_accumulation_boundary():  # read before step() advances the counter
                    # the optimizer step: its micro steps' sums in ONE all-reduce (stop requests too), the LR it uses
                    update = Update.of(engine, self.acc, self.dist.world_size, self.stop_request.signum is not None)
                phases.begin("step")
                if update is None:
                    engine.step()  # DeepSpeed counts the micro step; the optimizer waits for the boundary
                else:
                    step_or_stop(engine)  # engine.step(): the update (Habana's fork asserts on a non-finite norm)
                self._cut_graph()
                phases.end("step")
                if update is not None and self._after_optimizer_step(update):  # read, record, evaluate, save
                    break
            summary = self._end_training()
        except NonFiniteGradNorm as e:
            raise self._unusable_norm(e) from None
        finally:
            self.metrics.close()
            if not self.stopped:
                self.stop_request.restore()
        log.say(f"metrics: {self.metrics.path.resolve()}")
        if self.stopped:
            self._exit_stopped(self.stopped, self.step)
        return self._evaluate_after(summary)

    def _evaluate_after(self, summary: dict) -> dict:
        """After training (or instead of it): an eval-only run's one evaluation, the `after` tasks, their results."""
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
        precision = self.run.precision
        note = None
        if dist.rank == 0 and cfg.precision == "auto" and dist.accelerator == "cpu" and precision == "fp32":
            note = resolve_precision("auto", "cpu")[1]  # why fp32 (cached speeds), written into the summary
        return RunInfo(model=self.model.name, world_size=dist.world_size, nodes=dist.nodes,
                       accelerators_per_node=dist.local_world_size, accelerator=kind,
                       micro_batch=engine.train_micro_batch_size_per_gpu(),
                       grad_accum=engine.gradient_accumulation_steps(), zero_stage=engine.zero_optimization_stage(),
                       precision=precision, flops_per_sample=self.model.flops_per_sample, seq_len=self.model.seq_len,
                       warmup_steps=cfg.throughput_warmup_steps, log_every=cfg.log_every,
                       total_steps=start_step + self.run.total_steps,
                       peak_tflops=peak_tflops_for(kind, precision) if dist.rank == 0 else None,
                       precision_note=note)

    def _start(self) -> bool:
        """Resume or start, and set up the loop; False: resumed from this run's final checkpoint (nothing to train)."""
        self._write_ds_config()
        pos = self.checkpoints.start(self.run.data)
        if self._finished_before(pos):
            return False
        self._begin(pos)
        return True

    def _write_ds_config(self) -> None:
        """run_dir/ds_config.json: the DeepSpeed config the engine runs (rank 0)."""
        if self.dist.rank == 0:
            run_dir = Path(self.cfg.run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            config = self.engine.config if isinstance(self.engine.config, dict) else {}
            atomic_write_text(run_dir / "ds_config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")

    def _finished_before(self, pos: Position) -> bool:
        """Resumed from the final checkpoint: nothing to train, and no second eval or summary in metrics.jsonl."""
        end_step = pos.phase_start + self.run.total_steps
        if not pos.resumed or not (pos.step >= end_step if self.cfg.max_steps else pos.epoch >= self.cfg.max_epochs):
            return False
        log.say(f"--resume: {self.checkpoints.root / ckpt.tag_for(pos.step)} is this run's end (step {pos.step}, "
                f"epoch {pos.epoch}); nothing to train, no record added")
        self.evaluation.during = None  # its last results are in metrics.jsonl already
        return True

    def _begin(self, pos: Position) -> None:
        """The loop's state and its parts: metrics, stop requests, phase timing, the sums, the read-back, the guard."""
        from deepspeed.accelerator import get_accelerator

        cfg, dist, engine = self.cfg, self.dist, self.engine
        self.pos, self.step, self.epoch = pos, pos.step, pos.epoch
        self.end_step = pos.phase_start + self.run.total_steps
        self.stopped: str | None = None  # why this process stops before the end: "SIGTERM", "SIGUSR1", ...
        info = self.run_info(pos.phase_start)
        self.metrics = Metrics(Path(cfg.run_dir), info, rank=dist.rank, start_step=pos.step, clock=self.clock,
                               sync=get_accelerator().synchronize, monitor=getattr(engine, "monitor", None),
                               progress_bar=cfg.progress_bar,
                               peak_probe=peak_probe_for(info.accelerator, info.precision) if dist.rank == 0 else None)
        self.stop_request = StopRequest()
        self.stop_request.install()
        # sampled phase timing (ds_core.outputs.phases): data, forward, backward, exposed communication, optimizer
        # step, wait
        self.phases = PhaseTimer(cfg.phase_timing_every, rank=dist.rank, world_size=dist.world_size,
                                 device=dist.device, accelerator=get_accelerator())
        self.phases.next_step = pos.step + 1
        self.acc = Accumulator(engine.device)  # the micro steps' sums of the optimizer step under way
        self.mark_step = step_marker(engine.device)  # Gaudi's lazy mode: its graph cut after backward and after step
        self.guard = DivergenceGuard(cfg.max_skipped_steps, cfg.loss_spike_factor)
        self.readback = ReadBack()  # the steps whose values are still on their way to the host
        self.stop_seen: str | None = None  # a read step carried a stop request

    # -- the loop: epochs, micro batches, optimizer steps -----------------------------------------------------
    def _at_end(self) -> bool:
        """max_steps, when given, wins over epochs (the data is cycled as often as needed), as in HF Trainer."""
        return bool(self.cfg.max_steps) and self.step >= self.end_step

    def _micro_batches(self) -> Iterator[Any]:
        """run.data's micro batches, epoch after epoch, until the end step or the last epoch (fit breaks out at the
        end step and on a stop). By epochs the epochs run to their end (a last partial accumulation included) and
        make run.total_steps optimizer steps: start_run counted them from the same len(data), and the LR schedule
        ends there too."""
        max_epochs = float("inf") if self.cfg.max_steps else self.cfg.max_epochs
        resumed_in_epoch = self.pos.resumed  # a resumed epoch may legitimately be empty (checkpoint at its very end)
        while not self._at_end() and self.epoch < max_epochs:
            batches, batch_iter = 0, iter(self.run.data)
            while (batch := self._next_batch(batch_iter)) is not _END:
                batches += 1
                yield batch
            if batches == 0 and not resumed_in_epoch:
                raise RuntimeError(f"the data source yielded no batch in epoch {self.epoch} on rank {self.dist.rank}: "
                                   f"too little data for micro batch {self.engine.train_micro_batch_size_per_gpu()}")
            resumed_in_epoch = False
            self.epoch += 1
            if self.epoch < max_epochs:
                self.run.data.set_epoch(self.epoch)

    def _next_batch(self, batch_iter) -> Any:
        """next(batch_iter), or _END; the wait is timed (data wait, the data phase)."""
        t_wait = self.metrics.clock()
        self.phases.begin("data")
        batch = next(batch_iter, _END)
        self.phases.end("data")
        self.metrics.data_wait(self.metrics.clock() - t_wait)
        return batch

    def _cut_graph(self) -> None:
        """htcore.mark_step after backward and after engine.step on a Gaudi in lazy mode, where GaudiTrainer makes
        it; nothing elsewhere (ds_core.run.step.step_marker)."""
        if self.mark_step is not None:
            self.mark_step()

    def _after_optimizer_step(self, update: Update) -> bool:
        """Send the step's values to the host, read those that are due, evaluate and save when due; whether the loop
        stops here (the end, or a stop).

        A step's loss, counts and stop flag are read one optimizer step late (ds_core.run.readback), except where
        they are needed now (_read_now): the step's record, guard verdict and stop verdict then follow one step
        behind."""
        update.after_step(self.engine)  # the gradient norm, whether DeepSpeed skipped the update
        self.step += 1
        step = self.step
        pending = self.readback.send(update, step=step, epoch=self.epoch)
        self.acc.reset()
        # at the step itself (every rank): the phase sample and the callbacks' keys (epoch, the profiler's step mark)
        pending.phase = record_fields(self.phases.boundary(step))
        for cb in self.callbacks:
            cb.on_step_end(step, pending.extra)
        self._read(keep=0 if self._read_now(step) else 1)
        # evaluate, then save, as transformers' Trainer does (_maybe_log_save_evaluate): the step's record, written
        # durably before its checkpoint completes, then holds its eval time too
        if self.evaluation.due(step):
            self._evaluate()
        if self.checkpoints.due(step):
            self._save()
        if self._at_end():
            return True
        self.stopped = self._stop_reason()
        return self.stopped is not None

    def _read_now(self, step: int) -> bool:
        """Whether step's values are needed at once: a logging step (its record, timed after a device sync anyway),
        the last throughput warm-up step (the window opens at its end), an evaluation, a save, the end of the run.
        The other warm-up steps read late like any step: --profile_steps profiles them as the steady state runs."""
        cfg, done = self.cfg, step - self.pos.step
        return (step % cfg.log_every == 0 or done == cfg.throughput_warmup_steps or self.evaluation.due(step)
                or self.checkpoints.due(step) or self._at_end()
                or bool(cfg.max_steps_this_run and done >= cfg.max_steps_this_run))

    def _read(self, keep: int = 0) -> None:
        """Read and record the unread steps, oldest first, leaving the newest `keep`; raises TrainingDiverged."""
        for res in self.readback.take(keep):
            if not math.isfinite(res.loss):
                raise TrainingDiverged(self._diverged(res.loss, res.step, res.epoch))
            self._record(res)
            if res.stop and self.stop_seen is None:
                signum = self.stop_request.signum
                self.stop_seen = signal.Signals(signum).name if signum else "signal"

    def _record(self, res: StepResult) -> None:
        """The step's metrics record; a skipped update is reported, a diverged run stops without saving."""
        step, guard = res.step, self.guard
        verdict = guard.observe(step, res.loss, res.skipped, res.grad_norm)
        logs = dict(res.logs, **res.phase, skipped=res.skipped, skipped_steps=guard.total, **res.extra)
        self.metrics.step(step, res.samples, res.tokens, loss=res.loss, lr=res.lr, logs=logs, grad_norm=res.grad_norm)
        if res.skipped:
            log.say(f"optimizer step {step} skipped by DeepSpeed (gradient norm {res.grad_norm}): the update was not "
                    f"applied; the LR schedule advanced as for an applied step ({guard.consecutive} in a row, stop "
                    f"after {self.cfg.max_skipped_steps})")
        if verdict is not None:
            self.metrics.persist()
            raise TrainingDiverged(f"training diverged: {verdict}. Stopped without saving; the latest checkpoint is "
                                   f"still {self.checkpoints.latest()} in {self.checkpoints.root} (resume from it "
                                   f"with a lower learning rate)")

    def _stop_reason(self) -> str | None:
        """Why this process stops after this step: a signal on any rank (the same verdict on every rank, from a
        step's all-reduce, read with its values) or --max_steps_this_run; None: go on."""
        if self.stop_seen is not None:
            return self.stop_seen
        if self.cfg.max_steps_this_run and self.step - self.pos.step >= self.cfg.max_steps_this_run:
            return "max_steps_this_run"
        return None

    def _unusable_norm(self, e: NonFiniteGradNorm) -> TrainingDiverged:
        """The verdict on an update DeepSpeed's optimizer refused (NonFiniteGradNorm), the steps before it recorded
        (and judged) first."""
        self._read()
        self.metrics.persist()
        return TrainingDiverged(
            f"training diverged: the gradient norm of optimizer step {self.step + 1} is not usable, and {e}. "
            f"Stopped without saving; the latest checkpoint is still {self.checkpoints.latest()} in "
            f"{self.checkpoints.root} (resume from it with a lower learning rate)")

    def _diverged(self, loss: float, step: int, epoch: int) -> str:
        return (f"training diverged: loss is {loss} at optimizer step {step} (epoch {epoch}); stopped without saving: "
                f"the latest checkpoint is still {self.checkpoints.latest()} in {self.checkpoints.root}")

    # -- evaluation, saving, the end ------------------------------------------------------------------------------
    def _evaluate(self) -> None:
        self._read()  # every step before it recorded (and checked) first
        ev, step = self.evaluation, self.step
        with self.metrics.timed("eval"):
            logs = ev.run(ev.during, self.engine, step)
            self.engine.train()
            if logs:
                record = dict(logs)  # the evaluation's results stay as the task returned them
                for cb in self.callbacks:
                    cb.on_evaluate(step, record)
                self.metrics.eval(step, record)

    def _save(self) -> None:
        self._read()  # no checkpoint of a state whose loss was not checked
        step = self.step

        def before_complete() -> None:  # rank 0
            # the step's record is written (and fsync'ed) before COMPLETE: a kill after it never loses the record
            self.metrics.persist()
            for cb in self.callbacks:
                cb.on_save(self.checkpoints.root / ckpt.tag_for(step), step)

        with self.metrics.timed("checkpoint"):  # outside the throughput window; reported as checkpoint_s
            self.checkpoints.save(self.pos, step, self.epoch, self.run.data, before_complete=before_complete)

    def _end_training(self) -> dict:
        """Close the throughput window, save and evaluate at the end, and write the summary record."""
        step, phases = self.step, self.phases
        self._read()  # the last steps' values: their records and verdicts before the final save
        self.metrics.end_training()  # the throughput window closes here: the final save and eval are timed apart
        phases.finish()  # a sample still pending (read one step late on CUDA/HPU); every rank
        if not self.stopped and step != self.end_step:  # a len() that is not what it yields
            log.warn(f"the run ended at optimizer step {step}, its LR schedule at {self.end_step} (len() of "
                     f"{type(self.run.data).__name__} differs from the batches it yielded)")
        if (self.cfg.save_final_checkpoint or self.stopped) and step > 0:
            self._save()  # a stopped run always saves: --resume continues from exactly this step
        if self.evaluation.at_end(step, bool(self.stopped)):
            self._evaluate()
        extra = self._summary_extra(self.stopped)
        extra.update(summary_fields(phases.samples, first_step=self.pos.step + self.cfg.throughput_warmup_steps,
                                    overhead_s=phases.overhead_s))
        summary = self.metrics.summary(extra)
        if phases.samples:  # the console summary line of the phase timing
            log.say(f"step time ({summary['phase_sampled_steps']} sampled steps): {console_line(summary)}")
        return summary

    def _summary_extra(self, stopped: str | None) -> dict:
        data, dist = self.run.data, self.dist
        stats = data.summary_stats() if hasattr(data, "summary_stats") else {}
        extra = reduce_summary_stats(dict(stats, peak_memory_gb_per_rank=[peak_memory_bytes(dist.accelerator) / 2**30]),
                                     dist.world_size, frozenset(getattr(data, "shared_summary_stats", ())))
        extra["peak_memory_kind"] = "process peak RSS" if dist.accelerator == "cpu" else "allocator peak"
        # every change inside DeepSpeed: on / off / not needed, with the reason (ds_core.compat.changes)
        extra["ds_changes"] = changes.states()
        if self.profile is not None and self.profile.summary is not None:
            extra["profile"] = self.profile.summary  # this rank's (rank 0 writes the summary record)
        if stopped:
            extra = dict(extra, stopped=stopped, exit_status=EXIT_STOPPED)
        return extra

    def _exit_stopped(self, reason: str, step: int) -> None:
        """End the process after an early stop: the checkpoint is saved and every rank is here (same verdict)."""
        # the last line of ours: DeepSpeed's launcher then logs "[ERROR] ... exits with return code = 75" (its words)
        log.say(f"stopped after optimizer step {step} ({reason}); checkpoint "
                f"{self.checkpoints.root / ckpt.tag_for(step)} saved; exit status {EXIT_STOPPED} is a planned stop, "
                f"not a failure (DeepSpeed's launcher reports it as '[ERROR] ... return code = {EXIT_STOPPED}'): run "
                f"again with --resume to continue")
        if hasattr(self.run.data, "close"):
            self.run.data.close()  # prefetch threads would otherwise keep the interpreter alive
        shutdown_distributed()  # as every entry point does at a normal end (gloo's exit-time abort otherwise)
        raise SystemExit(EXIT_STOPPED)


__all__ = ["Trainer", "ModelInfo", "Callback", "Checkpointing", "Evaluation", "EvalTask", "Position"]
