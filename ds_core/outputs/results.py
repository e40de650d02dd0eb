"""Outputs as transformers' Trainer writes them: {split}_results.json + all_results.json, and the final model in
save_pretrained format with fp32 master weights.

The results files follow `Trainer.save_metrics` (trainer_pt_utils.save_metrics): one JSON per split, indent 4, sorted
keys, merged into all_results.json; written by rank 0, atomically. The training figures come from
ds_core.outputs.metrics' summary record, the one clock. Trainer's own keys (train_runtime, train_samples_per_second over
the whole runtime, train_loss, total_flos, epoch) come from ds_core.outputs.hf_trainer.train_metrics; the
warm-up-excluded figures are ours: `train_samples_per_second_measured` is the same number as `samples_per_s` in
metrics.jsonl (optimum-habana's --throughput_warmup_steps semantics).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from ds_core.checkpoint.pretrained import write_pretrained
from ds_core.files import atomic_write_text

# summary record key -> our name in train_results.json (the post-warm-up window; Trainer's keys:
# ds_core.outputs.hf_trainer)
_TRAIN_KEYS = {
    "samples_per_s": "train_samples_per_second_measured",
    "seqs_per_s_per_accelerator": "train_samples_per_second_per_accelerator",
    "tokens_per_s": "train_tokens_per_second",
    "tflops_per_accelerator": "train_tflops_per_accelerator",
    "mfu": "train_mfu",
    "measured_steps": "train_measured_steps",
    "measured_seconds": "train_measured_seconds",
    "warmup_steps_excluded": "train_warmup_steps_excluded",
    "steps": "train_steps",
    "final_loss": "train_final_loss",
    "global_batch": "train_global_batch",
    "world_size": "train_world_size",
    "bad_images": "train_bad_images",
    "bad_captions": "train_bad_captions",
}


def train_metrics(summary: dict, **extra: Any) -> dict:
    """Trainer-style train metrics from a ds_core.outputs.metrics summary record (plus e.g. train_samples=N)."""
    out = {new: summary[old] for old, new in _TRAIN_KEYS.items() if summary.get(old) is not None}
    steps, seconds = summary.get("measured_steps"), summary.get("measured_seconds")
    if steps and seconds:
        out["train_steps_per_second_measured"] = steps / seconds
    out.update(extra)
    return out


def save_metrics(out_dir: str | os.PathLike, split: str, metrics: dict, rank: int = 0, combined: bool = True) -> Path:
    """Trainer.save_metrics: out_dir/{split}_results.json, merged into out_dir/all_results.json (rank 0 writes)."""
    out = Path(out_dir)
    path = out / f"{split}_results.json"
    if rank != 0:
        return path
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(metrics, indent=4, sort_keys=True) + "\n")
    if combined:
        everything = out / "all_results.json"
        merged = json.loads(everything.read_text()) if everything.exists() else {}
        merged.update(metrics)
        atomic_write_text(everything, json.dumps(merged, indent=4, sort_keys=True) + "\n")
    return path


def keep_frozen_fp32(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor | None]:
    """CPU fp32 copies of the parameters that will not train (call before deepspeed.initialize, on every rank).

    Under bf16 DeepSpeed keeps fp32 masters for trained parameters only; a frozen one is cast to bf16 in the module
    and its fp32 value would be lost, so an fp32 export would write the bf16-rounded value. keep=False (ranks that
    do not write) records the names only, so every rank takes the same path through fp32_state_dict's collectives."""
    return {n: (p.detach().float().cpu().clone() if keep else None)
            for n, p in model.named_parameters() if not p.requires_grad}


def fp32_state_dict(engine, frozen: dict[str, torch.Tensor | None] | None = None) -> dict[str, torch.Tensor] | None:
    """The full model state dict in fp32 from the optimizer's master weights (collective: every rank calls it;
    rank 0 gets the dict, the others None).

    deepspeed.utils.safe_get_full_fp32_param assembles a trained parameter's fp32 master across ZeRO-1/2/3 partitions
    and the bf16 optimizer; a frozen parameter comes from `frozen` (keep_frozen_fp32) or, without it, from the module
    (gathered under ZeRO-3); buffers come from the module."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    frozen = frozen or {}
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        full = safe_get_full_fp32_param(p) if p.requires_grad else None
        if full is None:
            if name in frozen:
                full = frozen[name]
            elif hasattr(p, "ds_id"):  # ZeRO-3 partitioned and not trained: gather the module's copy
                with deepspeed.zero.GatheredParameters([p]):
                    full = p.detach().float().clone() if rank == 0 else None
            else:
                full = p.detach()
        if rank == 0:
            out[name] = full.detach().float().cpu().clone()
    if rank != 0:
        return None
    # persistent buffers only, as module.state_dict() and save_pretrained have them: a non-persistent one (BridgeTower's
    # token_type_ids, position_ids) in the file is an UNEXPECTED key on reload
    persistent = set(module.state_dict(keep_vars=True))
    for name, b in module.named_buffers():
        if name in persistent:
            out[name] = b.detach().cpu().clone()
    return out


def save_model(engine, out_dir: str | os.PathLike, *, frozen: dict[str, torch.Tensor | None] | None = None,
               extras: Callable[[Path], None] | None = None) -> Path | None:
    """Trainer.save_model for a DeepSpeed engine: save_pretrained of the fp32 master weights (collective).

    Rank 0 writes (ds_core.checkpoint.pretrained.write_pretrained, the writer of every export; `extras(tmp)` adds
    tokenizer / processor files and the model card): a partial write never sits under a model file's name, and files
    of the run already in out_dir are not touched."""
    state = fp32_state_dict(engine, frozen)
    out = Path(out_dir)
    if state is not None:
        write_pretrained(engine.module, state, out, extras=extras)  # fp32 masters: the config says float32
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out if state is not None else None
