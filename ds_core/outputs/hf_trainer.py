"""transformers Trainer's files beside ours: trainer_state.json (Trainer's own TrainerState class writes it,
so the schema is Trainer's whatever its version), the train metrics under Trainer's keys, and `checkpoint-N` links to
our `checkpoints/global_stepN` directories. Every number comes from ds_core.outputs.metrics (metrics.jsonl and its
summary): one clock, one loss record.

Definitions (Trainer's where it has one):
- train_runtime: seconds from the first step's start to the end of the last step, in-loop evaluations and checkpoint
  saves included (Trainer's train() timer, less its set-up); train_samples_per_second / train_steps_per_second are
  the samples / optimizer steps of this process over train_runtime (Trainer's speed_metrics: warm-up included).
  Ours, warm-up excluded, stay under train_measured_* / train_samples_per_second_measured (= metrics.jsonl's
  samples_per_s).
- train_loss: the mean of every optimizer step's loss in this process (Trainer: tr_loss / steps).
- total_flos: flops_per_sample (forward + backward, the model's own count) x samples trained, over the whole run
  (Trainer: model.floating_point_ops = 6 x parameters x tokens).
- epoch: optimizer step / optimizer steps per epoch (fractional, as Trainer logs it).
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

_TAG = re.compile(r"global_step(\d+)")
_LINK = re.compile(r"checkpoint-(\d+)")


def link_checkpoints(run_dir: str | os.PathLike, ckpt_root: str | os.PathLike) -> list[Path]:
    """run_dir/checkpoint-N -> checkpoints/global_stepN for every COMPLETE checkpoint (the names Trainer users and
    get_last_checkpoint look for); links whose checkpoint is gone (pruned) are removed. Rank 0, after a save."""
    from ds_core import checkpoint as ckpt

    run, root = Path(run_dir), Path(ckpt_root)
    made = []
    for link in run.glob("checkpoint-*"):
        if link.is_symlink() and _LINK.fullmatch(link.name) and not link.exists():
            link.unlink()  # only our own dangling links: a real directory of that name is the user's
    for tag in ckpt.step_tags(root):
        if not ckpt.is_complete(root, tag):
            continue
        link = run / f"checkpoint-{_TAG.fullmatch(tag).group(1)}"
        if not link.exists() and not link.is_symlink():
            tmp = run / f".{link.name}.tmp.{os.getpid()}"
            tmp.symlink_to(os.path.relpath(root / tag, run), target_is_directory=True)
            os.replace(tmp, link)
            made.append(link)
    return made


def read_records(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_metrics(summary: dict, *, steps_per_epoch: int, total_flos: float) -> dict[str, Any]:
    """Trainer's train metrics (its keys, its definitions: module docstring) from our summary record."""
    runtime = summary.get("runtime_s") or 0.0
    steps = summary.get("steps_this_run") or 0
    samples = summary.get("samples_this_run") or 0
    out = {"train_runtime": round(runtime, 4),
           "train_samples_per_second": round(samples / runtime, 3) if runtime > 0 else 0.0,
           "train_steps_per_second": round(steps / runtime, 3) if runtime > 0 else 0.0,
           "total_flos": float(total_flos),
           "train_loss": summary.get("mean_loss") if summary.get("mean_loss") is not None else float("nan"),
           "epoch": summary.get("steps", 0) / max(1, steps_per_epoch)}
    return out


def _log_history(records: list[dict], steps_per_epoch: int, final: dict | None, upto: int) -> list[dict]:
    """Trainer's log_history up to optimizer step `upto`: a train entry per logged step (loss, grad_norm,
    learning_rate, epoch, step), an eval entry per evaluation (eval_* keys, epoch, step), and, at the end of training,
    the final train-metrics entry."""
    history = []
    for r in records:
        if r.get("step", 0) > upto:
            continue
        epoch = r.get("epoch", r.get("step", 0) / max(1, steps_per_epoch))
        if r.get("type") == "step" and r.get("loss") is not None:
            history.append({"loss": r["loss"], "grad_norm": r.get("grad_norm"), "learning_rate": r.get("lr"),
                            "epoch": epoch, "step": r["step"]})
        elif r.get("type") == "eval":
            history.append({**{k: v for k, v in r.items() if k not in ("type", "step")}, "epoch": epoch,
                            "step": r["step"]})
    if final is not None:
        history.append({**final, "step": upto})
    return history


def write_trainer_state(run_dir: str | os.PathLike, *, step: int, epoch: float, total_flos: float,
                        final: dict | None, steps_per_epoch: int, max_steps: int, num_train_epochs: int,
                        logging_steps: int, eval_steps: int, save_steps: int, train_batch_size: int,
                        metric: str = "", greater_is_better: bool | None = None, out_dir: str | os.PathLike = "",
                        rank: int = 0) -> Path:
    """out_dir (default run_dir)/trainer_state.json through transformers.TrainerState (rank 0): the state at optimizer
    step `step`, its log_history read from run_dir/metrics.jsonl up to that step. final: train_metrics(...) at the end
    of training (its entry closes the log_history), None for a checkpoint's state (Trainer's _save_checkpoint: the
    state as it is at that step). metric: Trainer's metric_for_best_model ("" -> no best_metric, as Trainer)."""
    from transformers import TrainerState

    path = Path(out_dir or run_dir) / "trainer_state.json"
    if rank != 0:
        return path
    records = read_records(run_dir)
    state = TrainerState(epoch=epoch, global_step=step, max_steps=max_steps,
                         logging_steps=logging_steps, eval_steps=eval_steps, save_steps=save_steps,
                         train_batch_size=train_batch_size, num_train_epochs=num_train_epochs,
                         total_flos=total_flos, log_history=_log_history(records, steps_per_epoch, final, step))
    if metric:
        key = metric if metric.startswith("eval_") else f"eval_{metric}"
        better = greater_is_better if greater_is_better is not None else not key.endswith("loss")  # Trainer's rule
        best = None
        for r in records:
            if r.get("type") == "eval" and r.get("step", 0) <= step and r.get(key) is not None \
                    and not math.isnan(r[key]):
                if best is None or (r[key] > best[key] if better else r[key] < best[key]):
                    best = r
        if best is not None:
            state.best_metric, state.best_global_step = best[key], best["step"]
            ckpt = Path(run_dir) / f"checkpoint-{best['step']}"
            # a checkpoint's own state names itself when it is the best: Trainer saves the model first, then looks
            saving_it = final is None and best["step"] == step
            state.best_model_checkpoint = str(ckpt) if ckpt.exists() or saving_it else None
    import dataclasses

    from ds_core.files import atomic_write_text

    # TrainerState.save_to_json's text, written atomically (a half-written state file is never left)
    atomic_write_text(path, json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n")
    return path


def write_events(monitor: Any, metrics: dict, step: int) -> None:
    """Trainer's final log to TensorBoard (TensorBoardCallback.on_log after train(): rewrite_logs puts every key
    without an eval_/test_ prefix under train/), through DeepSpeed's monitor (rank 0; nothing when it is off)."""
    if monitor is None or not getattr(monitor, "enabled", False):
        return
    events = [(f"train/{k}", float(v), step) for k, v in metrics.items()
              if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if events:
        monitor.write_events(events)


__all__ = ["link_checkpoints", "read_records", "train_metrics", "write_events", "write_trainer_state"]
