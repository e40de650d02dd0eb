"""The run directory before any rank does work: a used run_dir is refused unless the run resumes it or moves it aside.

Before this, re-running into a used `--run_dir` without `--resume` silently mixed two runs: saves of steps that already
existed were skipped, `latest` still named the old run and metrics.jsonl got a second run appended, so a later
`--resume` loaded the old run. HF Trainer's `overwrite_output_dir` deletes; here the old contents are only renamed
aside, never deleted.

Called by each entry point right after parsing, before distributed init: every rank of a job reads the same directory
and refuses alike, and only global rank 0 (known from the launcher's environment) moves it, which is safe because no
rank can pass distributed init before rank 0 joins it. ds_core.run.setup.start_run calls it for every entry point.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path

from ds_core import log
from ds_core.config import TrainConfig
from ds_core.errors import ConfigError
from ds_core.rank import run_lock
from ds_core.rank.rendezvous import env_rank


class RunDirInUse(ConfigError):
    """run_dir holds checkpoints or metrics of an earlier run and neither --resume nor --overwrite_run_dir was given."""


def previous_run(run_dir: str | os.PathLike) -> list[str]:
    """What in run_dir belongs to an earlier run: a non-empty checkpoints/ and/or metrics.jsonl (config.json alone
    is not a run: it is written before training starts)."""
    root = Path(run_dir)
    found = []
    ckpts = root / "checkpoints"
    if ckpts.is_dir() and any(ckpts.iterdir()):
        found.append("checkpoints/")
    if (root / "metrics.jsonl").is_file():
        found.append("metrics.jsonl")
    return found


def in_use_message(run_dir: str | os.PathLike, found: list[str]) -> str:
    return (f"run_dir {run_dir} already holds an earlier run ({', '.join(found)}). Continue it with --resume, or "
            f"start afresh with --overwrite_run_dir (moves the old contents to a dated folder beside it), or choose "
            f"another --run_dir")


def move_aside(run_dir: str | os.PathLike) -> Path:
    """Rename run_dir to a dated sibling `<name>.old-<UTC time>` (one rename: nothing copied, nothing deleted)."""
    root = Path(run_dir).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = root.with_name(f"{root.name}.old-{stamp}")
    n = 1
    while dest.exists():
        dest = root.with_name(f"{root.name}.old-{stamp}-{n}")
        n += 1
    try:
        os.rename(root, dest)
    except OSError as e:
        raise ConfigError(f"--overwrite_run_dir: could not move {root} aside to {dest}: {e.strerror} (a mount point "
                          f"or no write permission on {root.parent}?); move or remove it yourself") from None
    return dest


def prepare_run_dir(cfg: TrainConfig, rank: int | None = None) -> Path | None:
    """Refuse a used run_dir, or move it aside for --overwrite_run_dir (rank 0 only). Returns where the old run went.

    Call before distributed init. `rank` defaults to the launcher's environment (env_rank). Rank 0 first takes the
    run_dir lock for the life of this process (ds_core.rank.run_lock): a run_dir in use by a live run is refused, with
    or without --resume, before anything is written."""
    rank0 = (env_rank() if rank is None else rank) == 0
    lock = run_lock.acquire(cfg.run_dir) if rank0 else None
    if cfg.resume:
        return None
    found = previous_run(cfg.run_dir)
    if not found:
        return None
    if not cfg.overwrite_run_dir:
        raise RunDirInUse(in_use_message(cfg.run_dir, found))
    if not rank0:
        return None
    dest = move_aside(cfg.run_dir)
    # our lock moved with the old contents: take the fresh run_dir's, then drop the moved one
    lock.moved_to(dest)
    run_lock.acquire(cfg.run_dir)
    lock.release()
    log.say(f"--overwrite_run_dir: moved the earlier run in {cfg.run_dir} to {dest}", every_rank=True)
    return dest


_LATEST = ("latest", "true", "True", "1")
_NOT_GIVEN = ("", "false", "False", "0")
_CKPT_NAME = re.compile(r"(?:checkpoint-|global_step)(\d+)")


def resume_from_checkpoint(train: TrainConfig) -> TrainConfig:
    """transformers' --resume_from_checkpoint [PATH] as --resume: no value, latest or True: the newest complete
    checkpoint; PATH may be the run directory, its checkpoint-N link or checkpoints/global_stepN, and must be the
    newest complete checkpoint (the one --resume continues from: an older one would be overwritten by the run)."""
    from ds_core import checkpoint as ckpt
    from ds_core.errors import InputNotFound

    given = train.resume_from_checkpoint
    if given in _NOT_GIVEN:
        return train
    if given not in _LATEST:
        run_dir, path = Path(train.run_dir).resolve(), Path(given).expanduser()
        if not path.exists():
            raise InputNotFound(f"--resume_from_checkpoint {given}: no such checkpoint")
        real = path.resolve()
        if real != run_dir:
            m = _CKPT_NAME.fullmatch(real.name)
            if m is None or real.parent not in (run_dir, run_dir / "checkpoints"):
                raise ConfigError(f"--resume_from_checkpoint {given}: not a checkpoint of --output_dir (--run_dir) "
                                  f"{run_dir} (expected {run_dir}/checkpoint-N or {run_dir}/checkpoints/global_stepN); "
                                  "a run continues only its own checkpoints: pass that run's directory as --run_dir")
            latest = ckpt.latest_tag(run_dir / "checkpoints")
            if latest != f"global_step{m.group(1)}":
                raise ConfigError(f"--resume_from_checkpoint {given}: step {m.group(1)} is not the newest complete "
                                  f"checkpoint of {run_dir} ({latest}); resuming an older one would overwrite newer "
                                  "ones: move them aside first")
    if train.overwrite_run_dir:
        raise ConfigError("--resume_from_checkpoint with --overwrite_output_dir: pick one (overwrite moves the run "
                          "and its checkpoints aside)")
    return dataclasses.replace(train, resume=True)
