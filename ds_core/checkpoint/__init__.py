"""Checkpoints through the DeepSpeed engine on every rank, made "latest" only once complete.

Layout under run_dir/checkpoints/:
  global_step{N}/            DeepSpeed's files (module, ZeRO partitions) written by engine.save_checkpoint
  global_step{N}/client_rank{r}.pt   per-rank client state: step, epoch, data position, RNG states, fingerprint
  global_step{N}/COMPLETE    written by rank 0 after every rank finished (barrier); JSON with the fingerprint and
                             the batch numbers (train_batch_size, micro batch, accumulation, data-parallel size)
  global_step{N}/hf_model.json   the module's transformers class and config (rank 0), for `ds-ckpt export-hf`
  global_step{N}/MANIFEST.json   every file's size and XXH3 checksum, written before COMPLETE and verified on resume
                             (ds_core.checkpoint.manifest); a checkpoint that fails is moved aside as
                             global_step{N}.corrupt
  global_step{N}_universal/  the same step converted by DeepSpeed's ds_to_universal, made on a resume onto another
                             data-parallel size (ds_core.checkpoint.resize); COMPLETE once the conversion finished
  latest                     tag of the newest COMPLETE checkpoint, replaced atomically

DeepSpeed's own client_state is saved by data-parallel rank 0 only, but the data position and RNG streams differ per
rank, so each rank writes its own file. A kill -9 during a save leaves a tag without COMPLETE and `latest` still
naming the previous checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ds_core import log
from ds_core.checkpoint import manifest as ckpt_manifest
from ds_core.checkpoint.client_state import CheckpointError, plain_data, read_client_states, rng_state, set_rng_state
from ds_core.checkpoint.collective import any_rank, barrier, rank, world_size
from ds_core.checkpoint.resize import ensure_universal
from ds_core.checkpoint.tags import COMPLETE, LATEST, is_complete, latest_tag, read_marker, step_tags, tag_for
from ds_core.errors import ConfigError
from ds_core.files import atomic_write_text

HF_MODEL = "hf_model.json"


def _base_optimizer(engine):
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)  # the torch optimizer inside DeepSpeed's ZeRO / bf16 wrapper


def model_fingerprint(engine, zero_stage: int) -> dict:
    """What must match for a checkpoint to load: parameter names and full shapes, ZeRO stage, optimizer class and
    DeepSpeed's wrapper around it, the flat-buffer order. dp_world_size is recorded but may differ (a resize:
    ds_core.checkpoint.resize)."""
    shapes = {}
    for name, p in engine.module.named_parameters():
        shape = getattr(p, "ds_shape", None) or p.shape  # ZeRO-3 keeps the full shape in ds_shape
        shapes[name] = list(shape)
    return {"param_shapes": shapes, "zero_stage": zero_stage, "dp_world_size": engine.dp_world_size,
            "optimizer_class": type(_base_optimizer(engine)).__name__,
            "zero_optimizer": type(engine.optimizer).__name__,
            "flat_layout": getattr(engine, "flat_layout", MODEL_ORDER)}


# The parameter order in DeepSpeed's flat buffers (ds_core.rank.engine_build.flat_layout). Checkpoints written before
# the key existed used the model's order: absent means that, so they load where nothing moved and are refused where
# something did (their optimizer state would land on other parameters).
MODEL_ORDER = "model order"


# Recorded in the fingerprint, compared elsewhere: a data-parallel size change is a resize, not a mismatch.
NOT_COMPARED = frozenset({"dp_world_size"})


def describe_mismatch(saved: dict, current: dict, universal: bool = False) -> list[str]:
    """What differs between a checkpoint's fingerprint and this run's (keys the checkpoint lacks are not compared,
    so checkpoints written before a key existed still load). universal: loaded through DeepSpeed's universal format (a
    resize), which holds each parameter's fp32 weights and optimizer state whichever wrapper wrote them, so DeepSpeed's
    optimizer wrapper may differ (a resize that changes the accumulation can change it: ds_core.config adds fp32
    accumulation when a smaller world keeps the batch with more micro steps)."""
    diffs = []
    for key in ("zero_stage",):
        if saved.get(key) != current.get(key):
            diffs.append(f"{key}: checkpoint {saved.get(key)}, this run {current.get(key)} (DeepSpeed's universal "
                         f"checkpoint loading here changes the data-parallel size, not the ZeRO stage)")
    a, b = saved.get("param_shapes", {}), current.get("param_shapes", {})
    missing, extra = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if missing:
        diffs.append(f"{len(missing)} parameter(s) only in the checkpoint, e.g. {missing[:3]}")
    if extra:
        diffs.append(f"{len(extra)} parameter(s) only in this model, e.g. {extra[:3]}")
    changed = [f"{n}: checkpoint {a[n]}, this run {b[n]}" for n in sorted(set(a) & set(b)) if a[n] != b[n]]
    if changed:
        diffs.append(f"{len(changed)} parameter shape(s) differ, e.g. " + "; ".join(changed[:3]))
    if saved.get("flat_layout", MODEL_ORDER) != current.get("flat_layout", MODEL_ORDER):
        diffs.append(f"flat_layout: checkpoint {saved.get('flat_layout', MODEL_ORDER)!r}, this run "
                     f"{current.get('flat_layout', MODEL_ORDER)!r} (the order of the parameters in DeepSpeed's flat "
                     f"optimizer buffers; the optimizer state would load onto other parameters)")
    if not universal and "zero_optimizer" in saved and saved["zero_optimizer"] != current.get("zero_optimizer"):
        diffs.append(f"zero_optimizer: checkpoint {saved['zero_optimizer']!r}, this run "
                     f"{current.get('zero_optimizer')!r} (DeepSpeed's optimizer wrapper, chosen by the DeepSpeed "
                     f"JSON's precision and data_types.grad_accum_dtype; its state files differ: resume with the "
                     f"precision and DeepSpeed JSON the checkpoint was written with)")
    for key in sorted(set(saved) - {"param_shapes", "zero_stage", "flat_layout", "zero_optimizer"} - NOT_COMPARED):
        if saved.get(key) != current.get(key):
            diffs.append(f"{key}: checkpoint {saved.get(key)!r}, this run {current.get(key)!r}")
    return diffs


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


def _free_bytes(path: Path) -> str:
    for p in (path, *path.parents):
        if p.exists():
            return f"{shutil.disk_usage(p).free:,} bytes free on the file system of {p}"
    return "free space unknown"


def batch_layout(engine) -> dict:
    """The batch numbers a checkpoint records (ds_core.checkpoint.resize.Layout's fields)."""
    return {"dp_world_size": engine.dp_world_size, "train_batch_size": engine.train_batch_size(),
            "micro_batch": engine.train_micro_batch_size_per_gpu(), "grad_accum": engine.gradient_accumulation_steps()}


def hf_model_info(module) -> dict | None:
    """The module's transformers class (the first in its MRO that transformers exports: a subclass such as bert_ref's
    sparse-MLM head saves as its base) and config, so a checkpoint can be exported without the model package."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    from ds_core.checkpoint.pretrained import transformers_class

    cls = transformers_class(module)
    return {"class": cls, "config": config.to_dict()} if cls else None


def save(engine, ckpt_root: str | os.PathLike, step: int, client_state: dict, fingerprint: dict,
         keep: int = 0, before_complete=None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory. keep > 0: afterwards only the newest `keep`
    complete checkpoints stay (see prune). before_complete: called on rank 0 after every file and the manifest are
    written and before COMPLETE (what must be on disk whenever this checkpoint counts as saved)."""
    root = Path(ckpt_root)
    tag = tag_for(step)
    path = root / tag
    if is_complete(root, tag):  # same step already saved (e.g. a periodic save that is also the final one)
        return path
    if rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if path.exists():  # leftovers of an interrupted save of this step: never mix old and new files
            shutil.rmtree(path)
    barrier()
    previous = latest_tag(root)
    # A full disk surfaces from torch's zip writer as "[enforce fail at inline_container.cc] unexpected pos 128 vs 0"
    # (a RuntimeError, not an OSError): catch both, and say where, how much room was left and what is still good.
    try:
        engine.save_checkpoint(str(root), tag=tag, client_state={"step": step}, save_latest=False)
    except (OSError, RuntimeError) as e:
        # No verdict collective here: peers whose writes went through wait in DeepSpeed's closing barrier, which a
        # different collective would not match. This rank fails with the name; the launcher then stops the others.
        raise CheckpointError(_write_failed(path, previous, f"rank {rank()}: {type(e).__name__}: {e}")) from e
    error = None
    try:
        # plain data only (tensors, numbers, lists, dicts): the file loads with weights_only=True
        state = plain_data(dict(client_state, step=step, rng=rng_state(), fingerprint=fingerprint))
        tmp = path / f".client_rank{rank()}.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path / f"client_rank{rank()}.pt")
        ckpt_manifest.write_part(path, rank())  # this rank's files, hashed in parallel with the other ranks'
    except (OSError, RuntimeError, TypeError) as e:  # TypeError: plain_data named a value that is not data
        error = e
    # Every rank has finished writing its part, and the verdict is the same on all ranks. Saves are rare, so this
    # collective costs nothing per step.
    if any_rank(error is not None):
        where = f"rank {rank()}: {type(error).__name__}: {error}" if error else "another rank's write failed"
        raise CheckpointError(_write_failed(path, previous, where)) from error
    if rank() == 0:
        try:  # each an atomic rename: a failure leaves `latest` on the previous checkpoint
            info = hf_model_info(engine.module)
            if info is not None:
                atomic_write_text(path / HF_MODEL, json.dumps(info, default=str) + "\n")
            ckpt_manifest.merge_parts(path, world_size())
            if before_complete is not None:
                before_complete()  # e.g. the step's metrics record: durable before the step counts as saved
            atomic_write_text(path / COMPLETE, json.dumps({"step": step, "fingerprint": fingerprint,
                                                           "batch": batch_layout(engine), "manifest": True}) + "\n")
            atomic_write_text(root / LATEST, tag + "\n")
        except OSError as e:
            raise CheckpointError(_write_failed(path, latest_tag(root), f"rank 0: {e}")) from e
        if keep:
            prune(root, keep)
    barrier()
    return path


def _write_failed(path: Path, previous: str | None, where: str) -> str:
    still = f"`latest` still names {previous}" if previous else "there is no earlier complete checkpoint"
    return (f"writing checkpoint {path} failed ({where}); {_free_bytes(path)}; {still}, which --resume loads; "
            f"{path.name} has no {COMPLETE} marker and is never taken as good")


def prune(ckpt_root: str | os.PathLike, keep: int) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints, never the one `latest` names (rank 0, after a save).

    Incomplete tags are left alone: one may be a save in progress, and they are never loaded anyway. COMPLETE goes
    first, so a deletion cut short leaves a directory that is never taken as good."""
    root = Path(ckpt_root)
    named = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    tags = [t for t in step_tags(root) if is_complete(root, t)]
    removed = []
    for tag in tags[keep:]:
        if tag == named:
            continue
        uni = root / (tag + "_universal")  # its conversion (ds_core.checkpoint.resize) goes with it, marker first
        if (uni / COMPLETE).is_file():
            (uni / COMPLETE).unlink()
        shutil.rmtree(uni, ignore_errors=True)
        (root / tag / COMPLETE).unlink()
        shutil.rmtree(root / tag)
        removed.append(tag)
    return removed


def trim_metrics(path: str | os.PathLike, step: int) -> int:
    """Drop records of steps after `step` from metrics.jsonl (a resume from that step writes them again), atomically.

    Records carry "step" (step, eval, ...) or "steps" (a summary); lines without either are kept. Returns how many
    records were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill: it belongs to no step that survives
            dropped += 1
            continue
        at = rec.get("step", rec.get("steps")) if isinstance(rec, dict) else None
        if isinstance(at, int) and at > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        atomic_write_text(path, "".join(x + "\n" for x in kept))
    return dropped


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
    base = _base_optimizer(engine)
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
