"""The model card (README.md) written beside a run's exported model, as transformers' Trainer.create_model_card writes
one: transformers' own TrainingSummary template (metadata, evaluation results, the hyperparameters Trainer lists,
the per-evaluation results table, framework versions), from this run's settings and its metrics.jsonl, saved
through huggingface_hub.ModelCard. Nothing is looked up on the hub: Trainer's TrainingSummary asks the hub for the
base model's license when it is given one (transformers 4.x even in offline mode), so the base model is set after
the summary is made.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ds_core.outputs.hf_trainer import read_records

README = "README.md"
TAGS = ("deepspeed", "ds-scale-toolkit")


def history(run_dir: str | os.PathLike, steps_per_epoch: int = 1) -> list[dict]:
    """Trainer's log_history from metrics.jsonl: a train entry per step record, an eval entry (eval_* keys) per eval
    record, and the final entry (train_runtime, train_loss) from the summary record."""
    out: list[dict] = []
    for r in read_records(run_dir):
        epoch = r.get("epoch", r.get("step", 0) / max(1, steps_per_epoch))
        if r.get("type") == "step" and r.get("loss") is not None:
            out.append({"loss": r["loss"], "learning_rate": r.get("lr"), "epoch": epoch, "step": r["step"]})
        elif r.get("type") == "eval":
            values = {(k if k.startswith(("eval_", "test_")) else f"eval_{k}"): v for k, v in r.items()
                      if k not in ("type", "step", "epoch") and isinstance(v, (int, float))}
            if "eval_loss" not in values and "eval_mlm_loss" in values:  # BERT: MLM + NSP, its pretraining loss
                values["eval_loss"] = values["eval_mlm_loss"] + values.get("eval_nsp_loss", 0.0)
            out.append({**values, "epoch": epoch, "step": r["step"]})
        elif r.get("type") == "summary":
            out.append({"train_runtime": r.get("runtime_s"), "train_loss": r.get("mean_loss"), "epoch": epoch,
                        "step": r.get("steps")})
    return out


def hyperparameters(run: Any, optimizer: str, eval_batch_size: int | None = None) -> dict[str, Any]:
    """The hyperparameters Trainer's card lists (transformers.modelcard.extract_hyperparameters_from_trainer's keys),
    as this run set them."""
    from ds_core.config.optim import OptimArgs

    try:
        optim = run.section(OptimArgs)
    except KeyError:  # a settings tree without an optimizer section (the loop's own benchmarks)
        optim = None
    batch, ds = run.batch, run.ds_config
    out: dict[str, Any] = {"learning_rate": optim.learning_rate if optim else None,
                           "train_batch_size": batch.micro}
    if eval_batch_size:
        out["eval_batch_size"] = eval_batch_size
    out["seed"] = run.train.seed
    out["distributed_type"] = f"DeepSpeed ZeRO-{(ds.get('zero_optimization') or {}).get('stage', 0)}"
    if batch.data_parallel > 1:
        out["num_devices"] = batch.data_parallel
    if batch.accumulation > 1:
        out["gradient_accumulation_steps"] = batch.accumulation
    if batch.global_size != batch.micro:
        out["total_train_batch_size"] = batch.global_size
    out["optimizer"] = optimizer
    sched = ds.get("scheduler")
    if isinstance(sched, dict):  # the DeepSpeed JSON's scheduler, as DeepSpeed ran it
        out["lr_scheduler_type"] = f"{sched.get('type')} (DeepSpeed) {sched.get('params', {})}"
    elif optim is not None:
        out["lr_scheduler_type"] = optim.lr_scheduler_type
        if optim.warmup_steps or optim.warmup_ratio:
            out["lr_scheduler_warmup_steps" if optim.warmup_steps else "lr_scheduler_warmup_ratio"] = \
                optim.warmup_steps or optim.warmup_ratio
    out["training_steps"] = run.total_steps
    if run.precision != "fp32":
        out["mixed_precision_training"] = f"DeepSpeed {run.precision}"
    return {k: v for k, v in out.items() if v is not None}


def card_text(run: Any, *, optimizer: str, model_name: str, finetuned_from: str | None = None,
              tasks: str | None = None, dataset: str | None = None, dataset_tags: str | None = None,
              dataset_args: str | None = None, eval_batch_size: int | None = None, steps_per_epoch: int = 1) -> str:
    """The card's markdown: TrainingSummary.to_model_card of the installed transformers, with the arguments
    Trainer.create_model_card takes (finetuned_from, tasks, dataset, dataset_tags, dataset_args)."""
    import deepspeed
    from transformers.modelcard import TrainingSummary, parse_log_history

    _, lines, results = parse_log_history(history(run.train.run_dir, steps_per_epoch))
    summary = TrainingSummary(model_name=model_name, tags=list(TAGS), tasks=tasks, dataset=dataset,
                              dataset_tags=dataset_tags, dataset_args=dataset_args, eval_results=results,
                              eval_lines=lines or None, hyperparameters=hyperparameters(run, optimizer,
                                                                                        eval_batch_size))
    # source "trainer" (the default): Trainer's layout on every release (4.x writes a Keras note for any other)
    summary.finetuned_from = finetuned_from  # after __post_init__: no hub request for its license
    return summary.to_model_card() + f"- DeepSpeed {deepspeed.__version__}\n"


def write_model_card(out_dir: str | os.PathLike, text: str) -> Path:
    """out_dir/README.md through huggingface_hub.ModelCard (its metadata block parsed and written back)."""
    from huggingface_hub import ModelCard

    path = Path(out_dir) / README
    ModelCard(text).save(str(path))
    return path


def optimizer_name(engine: Any, ds_config: dict) -> str:
    """The optimizer as Trainer's card names it: the DeepSpeed JSON's section (its type and params, as DeepSpeed
    built it), else the class built in code with its first group's hyperparameters."""
    section = ds_config.get("optimizer")
    if isinstance(section, dict):
        params = {k: v for k, v in (section.get("params") or {}).items() if k != "lr"}
        return f"{section.get('type')} (DeepSpeed) with {params}"
    opt = getattr(engine, "optimizer", None)
    base = getattr(opt, "optimizer", opt)  # DeepSpeed's ZeRO / bf16 wrappers hold the optimizer built in code
    group = dict(base.param_groups[0]) if base is not None and base.param_groups else {}
    shown = {k: group[k] for k in ("betas", "eps", "weight_decay", "max_grad_norm") if k in group}
    return f"{type(base).__name__} with {shown}"


def hub_id_of(path: str) -> str | None:
    """The hub repository id a model directory was given as: a snapshot in the hub cache's layout
    (models--ORG--NAME/snapshots/REV, where a hub id resolves to), else None. A card names the model it was
    fine-tuned from by its hub id, and none for a local directory (run_bridgetower.py: "required to be a valid repo id
    on the Hub")."""
    for part in Path(path).parts if path else ():
        if part.startswith("models--"):
            return part[len("models--"):].replace("--", "/")
    return None


__all__ = ["README", "history", "hyperparameters", "card_text", "write_model_card", "optimizer_name", "hub_id_of"]
