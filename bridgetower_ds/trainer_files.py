"""What run_bridgetower.py's Trainer leaves in --output_dir after training, written from our run (issue 26):
train_results.json with Trainer's keys (ds_core.hf_outputs says each definition) plus ours, eval_results.json AND
validation_results.json (run_bridgetower.py's name), all_results.json, and trainer_state.json.
"""
from __future__ import annotations

from ds_core import hf_outputs
from ds_core.results import save_metrics, train_metrics
from ds_core.setup import Run

from .configs import CompatArgs


def save_train_outputs(run: Run, summary: dict, results: dict[str, dict], *, per_epoch: int, train_samples: int,
                       eval_every: int, save_every: int) -> dict:
    """Rank 0 writes; every rank may call. Returns the train metrics."""
    cfg, compat, rank = run.train, run.section(CompatArgs), run.dist.rank
    steps = int(summary.get("steps") or 0)
    # total_flos: the model's forward+backward FLOPs per sample x samples of every optimizer step so far (a resumed
    # run counts its earlier steps at the global batch)
    flos = float(summary.get("flops_per_sample") or 0.0) * int(summary.get("global_batch") or 0) * steps
    trainer_keys = hf_outputs.train_metrics(summary, steps_per_epoch=per_epoch, total_flos=flos)
    train = {**train_metrics(summary, train_samples=train_samples), **trainer_keys}
    save_metrics(cfg.run_dir, "train", train, rank)
    if "eval" in results:  # Trainer.evaluate's metrics carry the epoch they were taken at
        ev = {**results["eval"], "epoch": trainer_keys["epoch"]}
        save_metrics(cfg.run_dir, "eval", ev, rank)
        save_metrics(cfg.run_dir, "validation", ev, rank, combined=False)  # run_bridgetower.py's name
    hf_outputs.write_trainer_state(
        cfg.run_dir, final={**trainer_keys, "step": steps}, steps_per_epoch=per_epoch,
        max_steps=run.total_steps, num_train_epochs=_epochs(cfg, per_epoch),
        logging_steps=cfg.log_every, eval_steps=eval_every or cfg.log_every, save_steps=save_every,
        train_batch_size=int(summary.get("micro_batch") or 0), metric=compat.metric_for_best_model,
        greater_is_better=compat.greater_is_better, rank=rank)
    return train


def _epochs(cfg, per_epoch: int) -> int:
    """Trainer's num_train_epochs in its state: the epochs asked for, or those max_steps spans."""
    return -(-cfg.max_steps // per_epoch) if cfg.max_steps else cfg.max_epochs
