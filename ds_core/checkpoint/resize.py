"""Resume onto another data-parallel size: the batch plan (before the engine exists) and the one-time conversion to
DeepSpeed's Universal Checkpoint (ds_to_universal), next to the original, atomically.

Why a conversion: a ZeRO-1/2/3 checkpoint holds the fp32 master weights and Adam moments as one flat partition per
data-parallel rank, so a run on another number of ranks cannot read them (DeepSpeed refuses: "Automatic adjustment of
ZeRO's optimizer state partitioning with a new world size is not currently supported"). ds_to_universal rewrites them
per parameter (zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt), which any world size loads with the DeepSpeed config key
`checkpoint: {load_universal: true}` (engine.load_checkpoint then reads zero/ instead of the partitions).

Batch on a resize (TrainConfig.on_resize):
  keep_batch (default)  global batch and micro batch kept, gradient accumulation recomputed: old_global / (micro x W');
                        refused, naming the numbers, when it does not divide. The LR schedule is unchanged.
  scale_lr              micro batch and accumulation kept, so the global batch becomes micro x gas x W'; the LR
                        (schedule base LRs and the optimizer's current LR) is multiplied by new_global / old_global,
                        the linear rule of bert_ref's --scale_lr_with_global_batch (Goyal et al.).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from argparse import Namespace
from dataclasses import asdict, dataclass
from pathlib import Path

from ds_core.checkpoint.collective import any_rank, barrier, rank
from ds_core.checkpoint.tags import COMPLETE, is_complete, latest_tag
from ds_core.config import TrainConfig, settle_grad_accum_dtype
from ds_core.errors import ConfigError
from ds_core.files import atomic_write_text

ON_RESIZE = ("keep_batch", "scale_lr")
UNIVERSAL_SUFFIX = "_universal"
TAG_RE = re.compile(r"global_step(\d+)$")


@dataclass(frozen=True)
class Layout:
    """The batch numbers of a checkpoint's run, or of this run."""

    dp_world_size: int
    train_batch_size: int
    micro_batch: int
    grad_accum: int


@dataclass(frozen=True)
class ResizePlan:
    tag: str
    on_resize: str
    old: Layout
    new: Layout
    lr_factor: float  # new global / old global under scale_lr; 1.0 under keep_batch

    def record(self, step: int) -> dict:
        """The metrics.jsonl record of the resize."""
        return {"type": "resize", "step": step, "tag": self.tag, "on_resize": self.on_resize, "old": asdict(self.old),
                "new": asdict(self.new), "lr_factor": self.lr_factor}

    def describe(self) -> str:
        o, n = self.old, self.new
        what = (f"global batch kept at {n.train_batch_size} (gradient accumulation {o.grad_accum} -> {n.grad_accum})"
                if self.on_resize == "keep_batch" else
                f"micro batch {n.micro_batch} and accumulation {n.grad_accum} kept; global batch "
                f"{o.train_batch_size} -> {n.train_batch_size}, LR x {self.lr_factor:g}")
        return (f"resize {self.tag}: data-parallel size {o.dp_world_size} -> {n.dp_world_size} "
                f"(--on_resize {self.on_resize}): {what}")

    def ds_config(self, ds_config: dict) -> dict:
        """A copy of `ds_config` with this plan's batch numbers (gradient accumulation recomputed under keep_batch,
        its bf16 accumulation dtype following) and, for ZeRO >= 1, checkpoint.load_universal."""
        out = json.loads(json.dumps(ds_config))
        out.update(gradient_accumulation_steps=self.new.grad_accum, train_batch_size=self.new.train_batch_size)
        if self.on_resize == "keep_batch":
            settle_grad_accum_dtype(out)  # bf16 accumulation dtype follows the new accumulation
        if (out.get("zero_optimization") or {}).get("stage", 0) > 0:
            out.setdefault("checkpoint", {})["load_universal"] = True
        return out


def _complete_meta(ckpt_root: Path, tag: str) -> dict:
    path = ckpt_root / tag / COMPLETE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: unreadable checkpoint marker ({e}); expected JSON with step and fingerprint") \
            from None


def saved_layout(ckpt_root: str | os.PathLike, tag: str) -> Layout:
    """The batch numbers the checkpoint was saved with: its COMPLETE marker's "batch" (written since the resize
    support), else the run directory's ds_config.json of the run that saved it (older checkpoints)."""
    root = Path(ckpt_root)
    meta = _complete_meta(root, tag)
    if "batch" in meta:
        return Layout(**meta["batch"])
    world = meta["fingerprint"].get("dp_world_size")
    ds_file = root.parent / "ds_config.json"
    try:
        ds = json.loads(ds_file.read_text())
        return Layout(world, ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"],
                      ds["gradient_accumulation_steps"])
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise ConfigError(f"{root / tag}: its COMPLETE marker has no \"batch\" and {ds_file} does not give the saved "
                          f"batch numbers ({type(e).__name__}: {e}); cannot plan a resize") from None


def plan_resize(cfg: TrainConfig, ds_config: dict, world_size: int) -> ResizePlan | None:
    """Before deepspeed.initialize (every rank, once: ds_core.run.setup.start_run): when --resume finds a checkpoint of
    another data-parallel size, the plan (ResizePlan.ds_config gives the DeepSpeed config it needs); None when
    nothing changes. Refuses, naming the numbers, what cannot be kept. `ds_config` is not modified."""
    if not cfg.resume:
        return None
    root = Path(cfg.run_dir) / "checkpoints"
    tag = latest_tag(root) if root.is_dir() else None
    if tag is None:
        return None
    old = saved_layout(root, tag)
    if old.dp_world_size == world_size:
        return None
    mb = ds_config["train_micro_batch_size_per_gpu"]
    if cfg.on_resize == "keep_batch":
        if old.train_batch_size % (mb * world_size):
            raise ConfigError(
                f"--resume from {root / tag} onto {world_size} data-parallel ranks (saved with {old.dp_world_size}), "
                f"--on_resize keep_batch: global batch {old.train_batch_size} is not divisible by micro batch {mb} x "
                f"{world_size} ranks = {mb * world_size}; choose a micro batch (--micro_batch_size) that divides it, "
                f"or --on_resize scale_lr")
        new = Layout(world_size, old.train_batch_size, mb, old.train_batch_size // (mb * world_size))
        factor = 1.0
    else:
        new = Layout(world_size, ds_config["train_batch_size"], mb, ds_config["gradient_accumulation_steps"])
        factor = ds_config["train_batch_size"] / old.train_batch_size
    return ResizePlan(tag, cfg.on_resize, old, new, factor)


def universal_dir(ckpt_root: str | os.PathLike, tag: str) -> Path:
    return Path(ckpt_root) / f"{tag}{UNIVERSAL_SUFFIX}"


def convert_to_universal(ckpt_root: str | os.PathLike, tag: str, workers: int = 1) -> Path:
    """Convert checkpoint `tag` once with DeepSpeed's ds_to_universal into <tag>_universal next to it (one process).

    Written into a hidden temporary directory and renamed when complete (with its own COMPLETE marker), so a
    conversion cut short is never used: the next call starts it again. An existing complete conversion is reused."""
    root = Path(ckpt_root)
    src, out = root / tag, universal_dir(root, tag)
    if not is_complete(root, tag):
        raise ConfigError(f"{src}: no {COMPLETE} marker: an incomplete checkpoint is never converted")
    if (out / COMPLETE).is_file():
        return out
    from deepspeed.checkpoint import ds_to_universal

    tmp = root / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if out.exists():  # a directory without COMPLETE: a conversion cut short before this marker existed
        shutil.rmtree(out)
    args = Namespace(input_folder=str(src), output_folder=str(tmp), num_extract_workers=workers,
                     num_merge_workers=workers, keep_temp_folder=False, strict=True, inject_missing_state=True)
    try:
        ds_to_universal.main(args)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"converting {src} to a universal checkpoint failed: {type(e).__name__}: {e}") from e
    # ds_to_universal points <root>/latest_universal at its output folder (our temporary name): name the final one
    atomic_write_text(tmp / COMPLETE, json.dumps({"source": tag}) + "\n")
    os.replace(tmp, out)
    atomic_write_text(root / "latest_universal", out.name + "\n")
    return out


def ensure_universal(ckpt_root: str | os.PathLike, tag: str) -> Path:
    """Collective: rank 0 converts (or finds the conversion), the others wait at a barrier; every rank gets the path.
    The verdict is shared, so a failed conversion fails every rank with the same message."""
    error = None
    if rank() == 0:
        try:
            convert_to_universal(ckpt_root, tag)
        except ConfigError as e:
            error = e
    barrier()
    if any_rank(error is not None):
        raise error or ConfigError(f"converting {Path(ckpt_root) / tag} to a universal checkpoint failed on rank 0")
    return universal_dir(ckpt_root, tag)
