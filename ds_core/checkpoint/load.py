"""Reading a checkpoint back: which tag a resume takes, the exact resume (a resize through Universal
Checkpointing), a new phase started from another run's checkpoint, and the save_pretrained export of a live engine."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ds_core import log
from ds_core.checkpoint import manifest as ckpt_manifest
from ds_core.checkpoint.client_state import CheckpointError, read_client_states, set_rng_state
from ds_core.checkpoint.collective import any_rank, barrier, rank, world_size
from ds_core.checkpoint.fingerprint import base_optimizer, describe_mismatch
from ds_core.checkpoint.resize import ensure_universal
from ds_core.checkpoint.tags import LATEST, is_complete, latest_tag, read_marker, step_tags
from ds_core.errors import ConfigError
from ds_core.files import atomic_write_text


def select_resume_tag(ckpt_root: str | os.PathLike, strict: bool = False) -> str | None:
    """Collective: the checkpoint a --resume loads, the same on every rank, chosen before anything is loaded, printed
    or trimmed. The newest complete checkpoint whose files match its manifest on every rank (each rank checks its own
    files, ds_core.checkpoint.manifest.verify, and prints what is wrong: path, expected vs found). A newer one that
    fails is moved aside as global_step{N}.corrupt once an older one verifies, `latest` then names the one loaded, and
    rank 0 says so loudly; strict (--resume_strict) refuses instead. None: no complete checkpoint."""
    root = Path(ckpt_root)
    first = latest_tag(root) if root.is_dir() else None
    if first is None:
        return None
    me, world = rank(), world_size()
    tags = [first] + [t for t in step_tags(root) if t != first and is_complete(root, t)]
    failed: list[str] = []
    for tag in tags:
        problems = ckpt_manifest.verify(root / tag, me, world)
        for p in problems or []:
            log.say(f"rank {me}: checkpoint {tag} failed verification: {p}", every_rank=True, stderr=True)
        if any_rank(bool(problems)):
            if strict:
                raise CheckpointError(f"--resume_strict: checkpoint {root / tag} failed verification (each rank "
                                      f"printed its files above: path, expected vs found); nothing was loaded. "
                                      f"Without --resume_strict, --resume falls back to the newest checkpoint that "
                                      f"verifies")
            failed.append(tag)
            continue
        if problems is None:
            log.say(f"checkpoint {root / tag} has no manifest (written before manifests existed): its files are not "
                    f"verified")
        barrier()  # every rank has finished reading the failed ones before they move
        if failed and me == 0:
            moved = [ckpt_manifest.quarantine(root / t).name for t in failed]
            atomic_write_text(root / LATEST, tag + "\n")
            log.say(f"WARNING: --resume falls back to {root / tag}: the newer checkpoint(s) {', '.join(failed)} failed "
                    f"verification (problems printed above) and were moved aside as {', '.join(moved)} (not deleted); "
                    f"training repeats the steps after {tag}. Pass --resume_strict to refuse instead", stderr=True)
        barrier()
        return tag
    raise CheckpointError(f"--resume: no checkpoint under {root} verifies ({', '.join(failed)} failed; each rank "
                          f"printed its files above: path, expected vs found); nothing was loaded or moved")


def saved_world_size(ckpt_root: str | os.PathLike, tag: str) -> int:
    """The data-parallel size the checkpoint was saved with (its COMPLETE marker)."""
    meta = read_marker(ckpt_root, tag)
    return int(meta.get("batch", {}).get("dp_world_size") or meta["fingerprint"]["dp_world_size"])


def load(engine, ckpt_root: str | os.PathLike, fingerprint: dict, seed: int = 0, tag: str | None = None) -> dict | None:
    """Load the latest complete checkpoint into `engine`; returns this rank's client state (RNG restored), or None.
    Collective.

    The returned state also holds "data_states": the data states of ALL saved ranks in rank order (for a data source's
    load_state_dicts), and "saved_world_size". On another data-parallel size (a resize) a ZeRO >= 1 checkpoint is
    converted once to DeepSpeed's universal format (ds_core.checkpoint.resize.ensure_universal) and loaded from it: the
    engine must have been built with checkpoint.load_universal (ds_core.run.setup.start_run's resize plan sets it). RNG
    on a resize: a rank that existed in the saved run gets its own streams back; a new rank r gets
    ds_core.rank.dist.set_seed(seed + step, r), fresh per-rank streams that replay none of another rank's draws at
    step 0. "data" of a new rank is None. tag: the checkpoint select_resume_tag chose (default: latest_tag)."""
    from ds_core.rank.dist import set_seed

    root = Path(ckpt_root)
    tag = tag or latest_tag(root)
    if tag is None:
        return None
    saved = read_marker(root, tag)["fingerprint"]
    saved_world, world = saved_world_size(root, tag), engine.dp_world_size
    resize = saved_world != world and engine.zero_optimization_stage() > 0  # loaded from the universal format
    diffs = describe_mismatch(saved, fingerprint, universal=resize)
    if diffs:
        raise ConfigError(f"checkpoint {root / tag} does not match this run: " + " | ".join(diffs))
    states = read_client_states(root, tag, saved_world)  # before any loading: a missing file fails first
    load_tag = tag
    if saved_world != world:
        stage = engine.zero_optimization_stage()
        if stage == 0 and (engine.bfloat16_enabled() or engine.fp16_enabled()):
            raise ConfigError(f"checkpoint {root / tag}: saved by {saved_world} ranks, this run has {world}: ZeRO "
                              f"stage 0 with bf16/fp16 partitions its fp32 master weights per rank (BF16_Optimizer) "
                              f"and is not resized here; use ZeRO stage 1-3 or the same world size")
        if stage > 0:
            if not engine.load_universal_checkpoint():
                raise ConfigError(f"checkpoint {root / tag}: saved by {saved_world} ranks, this run has {world}, and "
                                  f"the engine was built without checkpoint.load_universal: the entry point must call "
                                  f"build_engine with run.ds_config of ds_core.run.setup.start_run")

            load_tag = ensure_universal(root, tag).name
    load_path, _ = engine.load_checkpoint(str(root), tag=load_tag, load_module_strict=True, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {root / load_tag}")
    # the changes of this stage (ds_core.compat.changes): after a universal load, the links older DeepSpeed leaves
    # wrong, made right
    from ds_core.compat.changes import apply_stage

    apply_stage("checkpoint_load", engine=engine, universal=load_tag != tag, say=log.say)
    me = rank()
    if me < saved_world:
        state: dict[str, Any] = dict(states[me])
        set_rng_state(state.pop("rng"))
    else:
        state = {k: v for k, v in states[0].items() if k != "rng"}
        state["data"] = None
        set_seed(seed + int(state["step"]), me)
    state["data_states"] = [s["data"] for s in states]
    state["saved_world_size"] = saved_world
    return state


def export_hf(engine, out_dir: str | os.PathLike, extras=None) -> Path | None:
    """Write the model in Hugging Face `save_pretrained` format, gathering ZeRO-3 partitions (collective).

    The module's own weights (bf16 under bf16: what the run computed with), written by the writer of every export
    (ds_core.checkpoint.pretrained.write_pretrained: safetensors, tied weights once, a partial export never under a
    model file's name). Rank 0 writes.
    """
    from ds_core.checkpoint.pretrained import write_pretrained

    out = Path(out_dir)
    if engine.zero_optimization_stage() == 3:
        # Gathers one module at a time onto rank 0 (what HF Trainer uses for ZeRO-3 saves).
        state_dict = engine._zero3_consolidated_16bit_state_dict()
    else:
        state_dict = engine.module.state_dict()
    if rank() == 0:
        write_pretrained(engine.module, state_dict, out, extras=extras)
    barrier()
    return out if rank() == 0 else None


def init_from(engine, ckpt_root: str | os.PathLike, fingerprint: dict, reset_optimizer: bool = False) -> int:
    """Start a new training phase from another run's latest complete checkpoint (BERT phase 2 from phase 1); returns
    that checkpoint's step, from which the new phase's step numbering continues. Collective.

    Loaded: the module and the optimizer's fp32 master weights and state (DeepSpeed's ZeRO checkpoint, not a 16-bit
    export). Not loaded: the LR scheduler, data position and RNG (the new phase has its own schedule and data). As
    NVIDIA's run_pretraining.py --phase2 does, the optimizer's moments carry over with its step counters set to 0 (bias
    correction restarts) and this run's hyperparameters (LR, betas, weight decay) replace the saved ones;
    reset_optimizer also drops the moments (the next step initialises them as for a new optimizer)."""
    root = Path(ckpt_root)
    tag = latest_tag(root)
    if tag is None:
        raise CheckpointError(f"{root}: no complete checkpoint to start from (a COMPLETE marker under "
                              f"{root}/global_step*)")
    saved = read_marker(root, tag)
    diffs = describe_mismatch(saved["fingerprint"], fingerprint)
    if saved_world_size(root, tag) != engine.dp_world_size:  # a new phase is not a resume: no universal conversion
        diffs.append(f"dp_world_size: checkpoint {saved_world_size(root, tag)}, this run {engine.dp_world_size}")
    if diffs:
        raise ConfigError(f"cannot start from checkpoint {root / tag}: " + " | ".join(diffs) + " (the model, "
                          "optimizer, ZeRO stage and data-parallel size must be those of the run that saved it)")
    base = base_optimizer(engine)
    mine = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
    load_path, _ = engine.load_checkpoint(str(root), tag=tag, load_module_strict=True, load_optimizer_states=True,
                                          load_lr_scheduler_states=False)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {root / tag}")
    for group, hyper in zip(base.param_groups, mine):
        group.update(hyper)
        if "step" in group:  # optimizers that count steps per group (FusedLAMB-style)
            group["step"] = group["step"].zero_() if isinstance(group["step"], torch.Tensor) else 0
    if reset_optimizer:
        base.state.clear()
    else:
        for st in base.state.values():
            if "step" in st:
                st["step"] = st["step"].zero_() if isinstance(st["step"], torch.Tensor) else 0
    return int(saved["step"])
