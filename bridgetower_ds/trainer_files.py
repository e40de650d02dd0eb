"""What run_bridgetower.py's Trainer leaves in --output_dir after training, written from our run:
train_results.json with Trainer's keys (ds_core.outputs.hf_trainer says each definition) plus ours,
eval_results.json AND
validation_results.json (run_bridgetower.py's name), all_results.json, trainer_state.json, training_args.bin (a
pickled transformers.TrainingArguments of the settings that ran) and Trainer's final TensorBoard scalars; and in
every checkpoint-N, as Trainer's _save_checkpoint writes them, trainer_state.json at step N and training_args.bin.
"""
from __future__ import annotations

import dataclasses
import io
import os
import warnings
from pathlib import Path
from typing import Any

from ds_core.files import atomic_write_bytes
from ds_core.outputs import hf_trainer, monitors
from ds_core.outputs.results import save_metrics, train_metrics
from ds_core.run.callbacks import Callback
from ds_core.run.setup import Run

from . import log

ARGS_NAME = "training_args.bin"  # transformers.trainer.TRAINING_ARGS_NAME


@dataclasses.dataclass
class TrainerFiles(Callback):
    """Trainer's files of one run (rank 0 writes; every rank may call), and the loop's callback that writes them
    into every checkpoint-N and puts Trainer's fractional "epoch" into every step and eval record. per_epoch:
    optimizer steps of an epoch; eval_every / save_every: the steps the run evaluated / saved at (0: never);
    flops_per_sample: the model's forward + backward count (total_flos = it x samples trained)."""

    run: Run
    per_epoch: int
    eval_every: int
    save_every: int
    flops_per_sample: float
    _args: bytes | None = None
    _args_tried: bool = False

    def epoch_of(self, step: int) -> float:
        """Trainer's state.epoch at an optimizer step (fractional)."""
        return step / max(1, self.per_epoch)

    def total_flos(self, step: int) -> float:
        # every optimizer step trains a global batch (a resumed run counts its earlier steps too)
        return float(self.flops_per_sample) * self.run.batch.global_size * step

    def on_step_end(self, step: int, logs: dict) -> None:
        logs["epoch"] = self.epoch_of(step)  # transformers' Trainer logs it with every entry

    def on_evaluate(self, step: int, logs: dict) -> None:
        logs["epoch"] = self.epoch_of(step)

    def on_save(self, tag_dir: Path, step: int) -> None:
        """Rank 0, before the checkpoint's COMPLETE: checkpoint-N's trainer_state.json (the state at step N:
        log_history up to N, no final entry) and training_args.bin. Both are outside the checkpoint's MANIFEST.json:
        a resume never reads them."""
        self._state(step, final=None, out_dir=tag_dir)
        self._write_args(tag_dir)

    def save_train_outputs(self, summary: dict, results: dict[str, dict], *, train_samples: int,
                           monitor: Any = None) -> dict:
        """After training: results files, trainer_state.json, training_args.bin and Trainer's final TensorBoard
        scalars (train/train_runtime, ..., train/epoch at the last step). Returns the train metrics."""
        cfg, rank = self.run.train, self.run.dist.rank
        steps = int(summary.get("steps") or 0)
        trainer_keys = hf_trainer.train_metrics(summary, steps_per_epoch=self.per_epoch,
                                                total_flos=self.total_flos(steps))
        train = {**train_metrics(summary, train_samples=train_samples), **trainer_keys}
        save_metrics(cfg.run_dir, "train", train, rank)
        if "eval" in results:  # Trainer.evaluate's metrics carry the epoch they were taken at
            ev = {**results["eval"], "epoch": trainer_keys["epoch"]}
            save_metrics(cfg.run_dir, "eval", ev, rank)
            save_metrics(cfg.run_dir, "validation", ev, rank, combined=False)  # run_bridgetower.py's name
        self._state(steps, final=trainer_keys)
        if rank == 0:
            self._write_args(Path(cfg.run_dir))
            hf_trainer.write_events(monitor, trainer_keys, steps)
        return train

    # -- trainer_state.json ----------------------------------------------------------------------------------------
    def _state(self, step: int, *, final: dict | None, out_dir: Path | str = "") -> None:
        cfg, compat = self.run.train, self.run.cfg.compat
        hf_trainer.write_trainer_state(
            cfg.run_dir, step=step, epoch=final["epoch"] if final else self.epoch_of(step),
            total_flos=final["total_flos"] if final else self.total_flos(step), final=final,
            steps_per_epoch=self.per_epoch, max_steps=self.run.total_steps, num_train_epochs=self._epochs(),
            logging_steps=cfg.log_every, eval_steps=self.eval_every or cfg.log_every, save_steps=self.save_every,
            train_batch_size=self.run.batch.micro,
            metric=compat.metric_for_best_model, greater_is_better=compat.greater_is_better, out_dir=out_dir,
            rank=self.run.dist.rank)

    def _epochs(self) -> int:
        """Trainer's num_train_epochs in its state: the epochs asked for, or those max_steps spans."""
        cfg = self.run.train
        return -(-cfg.max_steps // self.per_epoch) if cfg.max_steps else cfg.max_epochs

    # -- training_args.bin -----------------------------------------------------------------------------------------
    def _write_args(self, out_dir: Path) -> None:
        if not self._args_tried:
            self._args_tried = True
            self._args = self._pickled_args()
        if self._args is not None:
            atomic_write_bytes(out_dir / ARGS_NAME, self._args)

    def _pickled_args(self) -> bytes | None:
        """torch.save(TrainingArguments) as Trainer.save_model writes it, built once. Without it (no accelerate, a
        schedule transformers has no name for, an older transformers refusing a value) the run goes on: one line
        says why, run_config.json holds the settings either way."""
        import torch

        try:
            args = training_args(self.run, eval_every=self.eval_every, save_every=self.save_every)
        except Exception as e:  # noqa: BLE001 - rank 0 alone is here, inside a checkpoint save the other ranks wait
            # on: an error of an optional file must not leave them in the barrier (ImportError: no accelerate;
            # ValueError: TrainingArguments' own checks; RuntimeError: accelerate's device set-up)
            log.say(f"{ARGS_NAME} not written: {type(e).__name__}: {e}")
            return None
        buf = io.BytesIO()
        torch.save(args, buf)
        return buf.getvalue()


def training_args(run: Run, *, eval_every: int, save_every: int):
    """transformers.TrainingArguments holding the settings this run used (resolved: the learning rate and weight
    decay of OptimArgs' rule, the DeepSpeed JSON's batch sizes and clipping, the strategies' step counts), deepspeed
    = the run's ds_config.json (the JSON the engine ran; the user's file is run_config.json's deepspeed_config).

    TrainingArguments.__post_init__ sets up a device (accelerate's PartialState) and, with `deepspeed`, an accelerate
    DeepSpeedPlugin. Here that runs inside a live run: torch.distributed is already initialized, so nothing
    collective happens (rank 0 alone builds it), and the environment variables and torch's thread count it may
    change (accelerate sets RANK/WORLD_SIZE..., and OMP threads on CPU) are put back, and so is transformers'
    global DeepSpeed-config reference. accelerate's own singleton state is reset by it (this toolkit does not use
    accelerate during a run). optim is left at Trainer's
    default: with a DeepSpeed "optimizer" section Trainer ignores it, and ours is AdamW either way."""
    import torch
    from transformers import TrainingArguments
    from transformers.trainer_utils import SchedulerType

    cfg, dist, ds = run.train, run.dist, run.ds_config
    optim, compat, run_args, data_args = run.cfg.optim, run.cfg.compat, run.cfg.task, run.cfg.data
    if optim.lr_scheduler_type not in {s.value for s in SchedulerType}:
        raise ValueError(f"--lr_scheduler_type {optim.lr_scheduler_type} has no transformers SchedulerType")
    precision = run.precision
    kw = dict(
        output_dir=cfg.run_dir, do_train=run_args.do_train,
        do_eval=run_args.do_eval, do_predict=run_args.do_predict,
        eval_strategy=compat.eval_strategy, eval_steps=eval_every if compat.eval_strategy == "steps" else None,
        per_device_train_batch_size=run.batch.micro,
        per_device_eval_batch_size=run_args.eval_micro_batch(run.batch.micro),
        gradient_accumulation_steps=run.batch.accumulation,
        learning_rate=optim.learning_rate, weight_decay=optim.weight_decay, adam_beta1=optim.beta1,
        adam_beta2=optim.beta2, adam_epsilon=optim.eps, max_grad_norm=float(ds.get("gradient_clipping", 0.0)),
        num_train_epochs=float(cfg.max_epochs), max_steps=cfg.max_steps or -1,
        lr_scheduler_type=optim.lr_scheduler_type, warmup_steps=_count(optim.warmup_steps),
        logging_strategy="steps", logging_steps=cfg.log_every,
        save_strategy=compat.save_strategy, save_total_limit=cfg.save_total_limit or None,
        seed=cfg.seed, data_seed=cfg.seed, bf16=precision == "bf16", fp16=precision == "fp16",
        use_cpu=dist.accelerator == "cpu", dataloader_num_workers=data_args.dataloader_num_workers,
        dataloader_drop_last=compat.dataloader_drop_last, remove_unused_columns=compat.remove_unused_columns,
        load_best_model_at_end=compat.load_best_model_at_end,
        metric_for_best_model=compat.metric_for_best_model or None, greater_is_better=compat.greater_is_better,
        report_to=monitors.report_to_names(compat.report_to) or "none",
        resume_from_checkpoint=cfg.resume_from_checkpoint or None, disable_tqdm=not cfg.progress_bar,
        ddp_timeout=cfg.dist_timeout_s)
    # accelerate's DeepSpeedPlugin refuses a JSON without a zero_optimization section, which DeepSpeed runs as ZeRO
    # stage 0: such a config is handed over with that default spelled out, and `deepspeed` then names the file
    ds_path = str((Path(cfg.run_dir) / "ds_config.json").resolve())
    kw["deepspeed"] = ds_path if "zero_optimization" in ds else {**ds, "zero_optimization": {"stage": 0}}
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    if "logging_dir" in fields:  # transformers 4.x: TensorBoard's directory (its default is stamped with the time)
        kw["logging_dir"] = str(Path(cfg.run_dir) / "tensorboard")  # where this run's TensorBoard events go
    if optim.warmup_ratio:  # transformers 5: a share is warmup_steps < 1 (4.x: warmup_ratio)
        kw["warmup_ratio" if "warmup_ratio" in fields else "warmup_steps"] = optim.warmup_ratio
    if compat.save_strategy == "steps":
        kw["save_steps"] = save_every
    from transformers.integrations import deepspeed as hf_ds

    env, threads, zero3_ref = dict(os.environ), torch.get_num_threads(), hf_ds._hf_deepspeed_config_weak_ref
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # accelerate's OMP_NUM_THREADS advice, deprecations: not the user's
            # a name the installed transformers lacks (renamed across 4.x / 5.x) is left out, not an error
            args = TrainingArguments(**{k: v for k, v in kw.items() if k in fields})
        args.deepspeed = ds_path
        return args
    finally:  # only what changed is put back: other threads of this process may read the environment
        for k in set(os.environ) - set(env):
            del os.environ[k]
        for k, v in env.items():
            if os.environ.get(k) != v:
                os.environ[k] = v
        torch.set_num_threads(threads)
        # the HfDeepSpeedConfig it made registers itself (a weak global: is_deepspeed_zero3_enabled()): put back, so
        # rank 0 never takes transformers' ZeRO-3 code paths the other ranks do not
        hf_ds._hf_deepspeed_config_weak_ref = zero3_ref


def _count(x: float) -> float | int:
    """A float setting that holds a count (>= 1, whole) as the int Trainer's parser gives."""
    return int(x) if x >= 1 and x == int(x) else x


__all__ = ["ARGS_NAME", "TrainerFiles", "training_args"]
