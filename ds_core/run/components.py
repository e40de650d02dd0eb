"""The Trainer's components besides the step (ds_core.run.loop.Step): what the metrics know of the model (ModelInfo),
checkpointing (save / resume / resize, and when to save), evaluation (when and what, for every model), and the
callbacks through which a model package adds its own behaviour at the loop's named points (transformers'
TrainerCallback style). ds_core.run.trainer.Trainer wires them; each is small enough to read alone.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ds_core import checkpoint as ckpt, log
from ds_core.errors import ConfigError
from ds_core.rank.dist import set_seed
from ds_core.run.loop import EvalFn, apply_lr_factor
from ds_core.run.setup import Run


@dataclass(frozen=True)
class Position:
    """Where training starts: the optimizer step and epoch, the step this phase started from (0, or the step of an
    init_from checkpoint), and whether it resumed a checkpoint of this run (a resumed epoch may be empty)."""

    step: int = 0
    epoch: int = 0
    phase_start: int = 0
    resumed: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """What the metrics know of the model: its name in the records, its FLOPs per sample (forward + backward: the
    throughput in TFLOPs and the MFU) and its sequence length (0 where it means nothing)."""

    name: str
    flops_per_sample: float
    seq_len: int = 0


class Callback:
    """A model's own behaviour at the loop's named points (transformers' TrainerCallback style); every hook does
    nothing unless overridden. Hooks run on every rank unless their docstring says otherwise."""

    def on_step_end(self, step: int, logs: dict) -> None:
        """After optimizer step `step` (called at the step, on every rank), before its metrics record is written: add
        keys to `logs` (in place). The step's device values (loss, the step function's logs) are read later and
        are not in `logs` here."""

    def on_evaluate(self, step: int, logs: dict) -> None:
        """After an evaluation at `step`, before its eval record is written: add keys to `logs` (a copy of the
        evaluation's results, in place)."""

    def on_save(self, checkpoint_dir: Path, step: int) -> None:
        """Rank 0, while checkpoint `step` is saved, after the step's metrics record is durable and before COMPLETE:
        files of the model's own beside the checkpoint's (e.g. transformers' trainer_state.json)."""


class ProfileSteps(Callback):
    """TrainConfig.profile_steps: torch.profiler (ds_core.outputs.profile.StepProfile) over the last N warm-up steps,
    ending one step before the throughput window opens (turning the profiler off must not land in a timed step); the
    Trainer puts `summary` into the run's summary record under "profile"."""

    def __init__(self, steps: int, warmup: int):
        from ds_core.outputs.profile import StepProfile

        self.prof = StepProfile(warmup - 1 - steps, steps)

    @property
    def summary(self) -> dict | None:
        return self.prof.summary

    def on_step_end(self, step: int, logs: dict) -> None:
        self.prof.step_end()


class Checkpointing:
    """Save (every `every` optimizer steps: cfg.num_steps_per_checkpoint unless the model decides it, e.g. at each
    epoch's end; 0: none), resume (same or another data-parallel size: the run's ResizePlan, decided once by
    start_run), and start from another run's checkpoint (init_from). Every method is collective.

    fingerprint: extra keys a checkpoint must match on resume (preset, optimizer).
    init_from: a run directory whose latest checkpoint this run starts from when it has none of its own to resume
        (ds_core.checkpoint.init_from: weights and optimizer state; a new phase with its own schedule and data); step
        numbers continue from that checkpoint's step, and the run's total steps count the steps of this phase."""

    def __init__(self, run: Run, engine: Any, fingerprint: dict | None = None, *, init_from: str | None = None,
                 reset_optimizer: bool = False, every: int | None = None):
        self.run, self.engine = run, engine
        self.train = run.train
        self.root = Path(self.train.run_dir) / "checkpoints"
        self.fingerprint = dict(ckpt.model_fingerprint(engine, engine.zero_optimization_stage()), **(fingerprint or {}))
        self.init_from, self.reset_optimizer = init_from, reset_optimizer
        self.every = self.train.num_steps_per_checkpoint if every is None else every

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def latest(self) -> str:
        return ckpt.latest_tag(self.root) or "none"

    def save(self, pos: Position, step: int, epoch: int, data: Any, before_complete: Callable | None = None) -> None:
        ckpt.save(self.engine, self.root, step, {"epoch": epoch, "data": data.state_dict(),
                                                 "phase_start": pos.phase_start},
                  self.fingerprint, keep=self.train.save_total_limit, before_complete=before_complete)
        if self.run.dist.rank == 0:  # Trainer's names beside ours: run_dir/checkpoint-N -> checkpoints/global_stepN
            from ds_core.outputs.hf_trainer import link_checkpoints

            link_checkpoints(self.train.run_dir, self.root)

    def start(self, data: Any) -> Position:
        """Resume (--resume), start from init_from, or start afresh; `data` is positioned to match."""
        rank, resize = self.run.dist.rank, self.run.resize
        if resize is not None and not hasattr(data, "load_state_dicts"):  # refused before any loading
            raise ConfigError(f"--resume from {self.root / resize.tag} (saved by {resize.old.dp_world_size} "
                              f"data-parallel ranks) on {resize.new.dp_world_size}: the data source "
                              f"{type(data).__module__}.{type(data).__name__} has no load_state_dicts, so it cannot "
                              f"deal the epoch's remaining samples to another number of ranks; resume on "
                              f"{resize.old.dp_world_size} ranks")
        tag = self.run.resume_tag  # verified and agreed on by every rank in start_run, before anything was loaded
        state = ckpt.load(self.engine, self.root, self.fingerprint, seed=self.train.seed, tag=tag) if tag else None
        if state is not None:
            pos = Position(state["step"], state["epoch"], state.get("phase_start", 0), resumed=True)
            if hasattr(data, "load_state_dicts"):
                data.load_state_dicts(state["data_states"])
            else:
                data.load_state_dict(state["data"])
            if resize is not None:
                apply_lr_factor(self.engine, resize.lr_factor)
            log.say(f"resumed from {self.root / ckpt.tag_for(pos.step)} at step {pos.step}, epoch {pos.epoch}")
            if resize is not None:
                log.say(resize.describe())
        else:
            if self.train.resume:
                log.say(f"--resume: no complete checkpoint in {self.root}; starting from step 0")
            pos = Position()
            if self.init_from:
                step = ckpt.init_from(self.engine, Path(self.init_from) / "checkpoints", self.fingerprint,
                                      self.reset_optimizer)
                pos = Position(step, 0, step)
                log.say(f"starting from {self.init_from} at step {step} (optimizer state "
                        f"{'reset' if self.reset_optimizer else 'carried, step counters reset'})")
            data.set_epoch(0)
            set_seed(self.train.seed, rank)  # per-rank model randomness (dropout); a resume restored each rank's own
        if self.train.resume and rank == 0:
            self._rewrite_metrics(pos.step)
        return pos

    def _rewrite_metrics(self, step: int) -> None:
        """On --resume (rank 0, before ds_core.outputs.metrics opens the file): the steps between the checkpoint and the
        interruption run again, so their records go; a resize record precedes the resumed steps."""
        path = Path(self.train.run_dir) / "metrics.jsonl"
        dropped = ckpt.trim_metrics(path, step)
        if dropped:
            log.say(f"--resume: dropped {dropped} metrics record(s) after step {step} from {path}")
        if self.run.resize is not None:
            with open(path, "a") as f:
                f.write(json.dumps(self.run.resize.record(step)) + "\n")


@dataclass(frozen=True)
class EvalTask:
    """One evaluation: `name` keys its results (and Trainer-style <name>_results.json when the Evaluation saves
    them); fn(engine, step) -> dict is collective."""

    name: str
    fn: EvalFn


@dataclass
class Evaluation:
    """When and what to evaluate, for every model.

    during: evaluated every `every` optimizer steps and once at the end of training (unless the run stopped early,
        or the last step was an `every` step); its results become metrics.jsonl "eval" records. Without training
        (an eval-only run) it is evaluated once.
    after: evaluated once after training (or instead of it), e.g. a test split (predict).
    save_results: write each task's last results as transformers' Trainer does (<name>_results.json and
        all_results.json in run_dir, ds_core.outputs.results.save_metrics).
    close: releases what the tasks hold (prefetch threads of eval data sources)."""

    during: EvalTask | None = None
    after: Sequence[EvalTask] = ()
    every: int = 0
    save_results: bool = False
    close: Callable[[], None] | None = None
    results: dict[str, dict] = field(default_factory=dict)  # the last results of each task, by name

    def due(self, step: int) -> bool:
        return self.during is not None and bool(self.every) and step % self.every == 0

    def at_end(self, step: int, stopped: bool) -> bool:
        return self.during is not None and not stopped and not self.due(step)

    def run(self, task: EvalTask, engine: Any, step: int) -> dict:
        logs = task.fn(engine, step)
        if logs:
            self.results[task.name] = logs
        return logs


__all__ = ["Position", "ModelInfo", "Callback", "Checkpointing", "EvalTask", "Evaluation"]
