"""Checkpointing for the loop: where training starts (Position), and save / resume / resize / init_from and when to
save (Checkpointing); the files and their checks are ds_core.checkpoint's."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ds_core import checkpoint as ckpt, log
from ds_core.errors import ConfigError
from ds_core.rank.dist import set_seed
from ds_core.run.setup import Run


@dataclass(frozen=True)
class Position:
    """Where training starts: the optimizer step and epoch, the step this phase started from (0, or the step of an
    init_from checkpoint), and whether it resumed a checkpoint of this run (a resumed epoch may be empty)."""

    step: int = 0
    epoch: int = 0
    phase_start: int = 0
    resumed: bool = False


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


__all__ = ["Checkpointing", "Position", "apply_lr_factor"]
