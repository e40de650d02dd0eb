"""The whole DeepSpeed JSON, nested keys included, checked by DeepSpeed's own config classes before any rank is spawned.

DeepSpeed parses its JSON inside deepspeed.initialize, after distributed init and after the model was built; a nested
unknown key (`zero_optimization.offload_optimizer.devcie`) then comes back as a pydantic error that names neither the
file nor the section. Here the JSON goes through `deepspeed.runtime.config.DeepSpeedConfig` (the class
deepspeed.initialize builds; its section models -- DeepSpeedZeroConfig, DeepSpeedBF16Config, DeepSpeedFP16Config,
the monitor, comms-logger, compile, timers and tensor-parallel models -- forbid unknown keys at every depth) without a
process group, with the batch numbers replaced by a world-of-one equivalent (ds_core.config checks the arithmetic
against the real world size). The optimizer and scheduler types are checked the way DeepSpeed resolves them later
(DEEPSPEED_OPTIMIZERS or a torch.optim class; deepspeed.runtime.lr_schedules or torch.optim.lr_scheduler), and a
DeepSpeed scheduler's params against its constructor. Errors are ConfigErrors naming the file, the dotted key and
what DeepSpeed expected.

Cost: importing deepspeed's config classes (~3.5 s on an idle 2-core CPU, far more under load) in a process that
would not import them otherwise, so a starter calls this once per launch; the entry points' check_ds_json (before
distributed init) calls it too, where deepspeed is imported anyway.
"""
from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import os
import typing
from pathlib import Path
from typing import Any, Sequence

from ds_core.config.ds_file import check_ds_keys, read_ds_json, resolve_ds_path
from ds_core.config.ds_values import check_ds_values
from ds_core.errors import ConfigError

# DeepSpeed's pydantic model (class name) -> where its section sits in the JSON ("" = top level, several keys)
_SECTION_OF = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedBF16Config": "bf16",
               "DeepSpeedFP16Config": "fp16", "DeepSpeedMonitorConfig": "", "CommsLoggerConfig": "comms_logger",
               "CompileConfig": "compile", "HybridEngineConfig": "hybrid_engine",
               "DeepSpeedThroughputTimerConfig": "timers.throughput", "TPTrainingConfig": "tensor_parallel"}


# DeepSpeed's pydantic section models, where the installed DeepSpeed has them: 0.19 has all of these; Habana's fork
# (0.16.1) has no compile, tensor-parallel, bf16 or fp16 models (it reads those sections as plain dicts)
_MODELS = (("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
           ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
           ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
           ("deepspeed.monitor.config", "DeepSpeedMonitorConfig"), ("deepspeed.comm.config", "CommsLoggerConfig"),
           ("deepspeed.compile.config", "CompileConfig"), ("deepspeed.runtime.config", "HybridEngineConfig"),
           ("deepspeed.utils.config", "DeepSpeedThroughputTimerConfig"),
           ("deepspeed.runtime.tensor_parallel.config", "TPTrainingConfig"))


def _model_classes() -> dict[str, type]:
    import importlib

    found = {}
    for module, name in _MODELS:
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            cls = None
        if cls is not None:
            found[name] = cls
    return found


def _model_in(annotation: Any) -> type | None:
    """The pydantic model inside a field's annotation (X, Optional[X], X | None), if any."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _allowed_keys(model: type, path: tuple) -> list[str]:
    """The keys (field names and aliases) a JSON object at `path` inside `model` may hold."""
    for name in path:
        fields = {**model.model_fields, **{f.alias: f for f in model.model_fields.values() if f.alias}}
        if name not in fields or (model := _model_in(fields[name].annotation)) is None:
            return []
    return sorted({*model.model_fields, *(f.alias for f in model.model_fields.values() if f.alias)})


def _describe(err, source: str, models: dict[str, type]) -> str:
    section = _SECTION_OF.get(err.title, "")
    problems = []
    for e in err.errors():
        loc = tuple(str(x) for x in e["loc"])
        key = ".".join(filter(None, (section, *loc)))
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(models[err.title], loc[:-1]) if err.title in models else []
            hint = difflib.get_close_matches(loc[-1], allowed, 1)
            problems.append(f"unknown key {key}" + (f" (did you mean {'.'.join([*key.split('.')[:-1], hint[0]])}?)"
                                                    if hint else ""))
        else:
            problems.append(f"{key} = {e.get('input')!r}: {e['msg']}")
    return f"{source}: {'; '.join(problems)} (checked by DeepSpeed's {err.title})"


def _world_of_one(cfg: dict) -> dict:
    """A copy whose batch numbers DeepSpeed accepts on a world of one (the arithmetic is ds_core.config's)."""
    probe = json.loads(json.dumps(cfg))
    ints = {k: v for k, v in probe.items() if k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
            and isinstance(v, int) and not isinstance(v, bool) and v > 0}
    mb, ga = ints.get("train_micro_batch_size_per_gpu", 1), ints.get("gradient_accumulation_steps", 1)
    probe.update(train_batch_size=mb * ga, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=ga)
    return probe


def _check_optimizer_and_scheduler(cfg: dict, source: str) -> None:
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    opt = cfg.get("optimizer")
    if isinstance(opt, dict) and "type" in opt:
        name = opt["type"]
        if not isinstance(name, str) or not (name.lower() in DEEPSPEED_OPTIMIZERS or hasattr(torch.optim, name)):
            hint = difflib.get_close_matches(str(name).lower(), DEEPSPEED_OPTIMIZERS, 1)
            raise ConfigError(f"{source}: optimizer.type = {name!r}: not an optimizer DeepSpeed knows (one of "
                              f"{', '.join(DEEPSPEED_OPTIMIZERS)}, or a torch.optim class)"
                              + (f"; did you mean {hint[0]!r}?" if hint else ""))
    sched = cfg.get("scheduler")
    if sched is None:
        return
    if not isinstance(sched, dict) or "type" not in sched:
        raise ConfigError(f"{source}: scheduler must be an object with a \"type\", got {sched!r}")
    name, params = sched["type"], sched.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: scheduler.params must be an object, got {params!r}")
    if isinstance(name, str) and name in lr_schedules.VALID_LR_SCHEDULES and hasattr(lr_schedules, name):
        accepted = [p for p in inspect.signature(getattr(lr_schedules, name)).parameters if p != "optimizer"]
        for key in params:
            if key not in accepted:
                hint = difflib.get_close_matches(key, accepted, 1)
                raise ConfigError(f"{source}: unknown key scheduler.params.{key} for {name} (accepted: "
                                  f"{', '.join(accepted)})" + (f"; did you mean {hint[0]!r}?" if hint else ""))
    elif not (isinstance(name, str) and hasattr(torch.optim.lr_scheduler, name)):
        raise ConfigError(f"{source}: scheduler.type = {name!r}: not a scheduler DeepSpeed knows (one of "
                          f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)}, or a torch.optim.lr_scheduler class)")


# The bf16 / fp16 sections where the installed DeepSpeed parses them as plain dicts (Habana's fork, 0.16.1: no
# DeepSpeedBF16Config / DeepSpeedFP16Config), so that a typo or a wrong type is still refused before any rank starts
# rather than silently ignored: the keys and types of DeepSpeed 0.19's models of the two sections (runtime/
# precision_config.py), whose keys are a superset of what 0.16 reads. key -> (type, lowest value or None)
_PRECISION_FIELDS = {
    "bf16": {"enabled": (bool, None), "immediate_grad_update": (bool, None), "check_grad_overflow": (bool, None),
             "bf16_master_weights_and_grads": (bool, None), "bf16_optimizer_states": (bool, None)},
    "fp16": {"enabled": (bool, None), "auto_cast": (bool, None), "loss_scale": ((int, float), 0),
             "initial_scale_power": (int, 0), "loss_scale_window": (int, 1), "hysteresis": (int, 1),
             "consecutive_hysteresis": (bool, None), "min_loss_scale": ((int, float), 0),
             "fp16_master_weights_and_grads": (bool, None)},
}


def _check_precision_sections(cfg: dict, source: str, models: dict[str, type]) -> None:
    """bf16 / fp16 checked by key and type where DeepSpeed has no model for them (_PRECISION_FIELDS)."""
    for section, model in (("bf16", "DeepSpeedBF16Config"), ("fp16", "DeepSpeedFP16Config")):
        if model in models or not isinstance(cfg.get(section), dict):
            continue
        fields = _PRECISION_FIELDS[section]
        for key, value in cfg[section].items():
            if key not in fields:
                hint = difflib.get_close_matches(key, fields, 1)
                raise ConfigError(f"{source}: unknown key {section}.{key}"
                                  + (f" (did you mean {section}.{hint[0]}?)" if hint else ""))
            kind, low = fields[key]
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            if not ok or (low is not None and value < low):
                want = "true or false" if kind is bool else f"a number >= {low}"
                raise ConfigError(f"{source}: {section}.{key} = {value!r}: expected {want}")


# top-level sections DeepSpeed reads as JSON objects (a list or number there fails inside DeepSpeed with a TypeError)
_OBJECT_SECTIONS = ("zero_optimization", "bf16", "bfloat16", "fp16", "amp", "optimizer", "scheduler", "tensorboard",
                    "wandb", "csv_monitor", "comet", "comms_logger", "compile", "hybrid_engine", "timers",
                    "tensor_parallel", "activation_checkpointing", "flops_profiler", "data_types", "aio", "autotuning",
                    "checkpoint", "elasticity", "data_efficiency", "curriculum_learning", "pipeline", "nebula")


def check_with_deepspeed(cfg: dict, source: str) -> None:
    """Parse `cfg` with DeepSpeed's own config classes; raise ConfigError naming `source`, the key and the problem."""
    import logging

    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger

    for key in _OBJECT_SECTIONS:
        if key in cfg and not isinstance(cfg[key], dict):
            raise ConfigError(f"{source}: {key} = {cfg[key]!r}: expected a JSON object")
    _check_optimizer_and_scheduler(cfg, source)
    _check_precision_sections(cfg, source, _model_classes())
    level = logger.level
    logger.setLevel(logging.WARNING)  # DeepSpeedConfig logs its world size at INFO; deprecation warnings stay
    try:
        DeepSpeedConfig(_world_of_one(cfg))
    except pydantic.ValidationError as e:
        raise ConfigError(_describe(e, source, _model_classes())) from None
    except (AssertionError, ValueError, TypeError, KeyError, AttributeError, NotImplementedError) as e:
        raise ConfigError(f"{source}: DeepSpeed refuses it: {type(e).__name__}: {e}") from None
    finally:
        logger.setLevel(level)


# ------------------------------------------------------------------------------------------- before spawning ranks
def _verdict_dir() -> Path:
    """Where passed checks are remembered: this venv (beside its torch_extensions), else the user's cache."""
    from ds_core.rank.venv import venv_dir

    venv = venv_dir()
    if venv is not None:
        return venv / "ds_core_checked"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ds_core" / "ds_json_checked"


def _verdict_key(cfg: dict) -> str:
    """Everything the verdict depends on: the JSON, DeepSpeed's / pydantic's / torch's versions and this checker."""
    from importlib import metadata

    versions = []
    for dist in ("deepspeed", "pydantic", "torch"):
        try:
            versions.append(metadata.version(dist))
        except metadata.PackageNotFoundError:
            versions.append("-")
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    h.update(" ".join(versions).encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


def check_before_spawn(path: str | os.PathLike, world_size: int | None = None) -> None:
    """What a starter checks before it spawns a rank: the JSON reads, its top-level keys, values and (given the world
    size) batch arithmetic (ds_core.config), then DeepSpeed's own classes (check_with_deepspeed). A JSON that passed
    with the same DeepSpeed and checker is not parsed by DeepSpeed again (a verdict file per content hash): importing
    deepspeed costs a starter seconds per launch. Raises ConfigError naming the file."""
    from ds_core.config.batch import check_batch_arithmetic
    from ds_core.config.trainer_json import auto_keys, probe

    raw = read_ds_json(path)
    source = f"DeepSpeed config {resolve_ds_path(path)}"
    check_ds_keys(raw, source)
    cfg = probe(raw, source)  # a Trainer-style JSON: its "auto"s are the flags', which the ranks fill
    check_ds_values(cfg, source)
    if world_size and not set(auto_keys(raw)) & {"train_batch_size", "train_micro_batch_size_per_gpu",
                                                 "gradient_accumulation_steps"}:
        check_batch_arithmetic(cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu"),
                               cfg.get("gradient_accumulation_steps"), world_size, source)
    verdict = _verdict_dir() / _verdict_key(cfg)
    if verdict.exists():
        return
    check_with_deepspeed(cfg, source)
    try:
        verdict.parent.mkdir(parents=True, exist_ok=True)
        verdict.write_text(f"{resolve_ds_path(path)}\n")
    except OSError:  # a read-only venv: checked again next time
        pass


def ds_config_in(args: Sequence[str]) -> str:
    """The DeepSpeed JSON a training module's arguments name ('' if none): `--deepspeed_config X`, or transformers'
    `--deepspeed X` (not DeepSpeed's bare `--deepspeed` switch, which a flag or nothing follows)."""
    for i, a in enumerate(args):
        if a in ("--deepspeed_config", "--deepspeed") and i + 1 < len(args) and not args[i + 1].startswith("-"):
            return args[i + 1]
        if a.startswith(("--deepspeed_config=", "--deepspeed=")):
            return a.split("=", 1)[1]
    return ""


def check_ds_json(ds_config_path: str | os.PathLike, optimizer_in_code: bool | None, cfg: dict | None = None,
                  why_in_code: str = "") -> None:
    """Before distributed init (the world size, hence the batch arithmetic, comes later in load_ds_config): the JSON
    reads, its values pass check_ds_values, and the optimizer is built either in code or from the JSON's "optimizer"
    section, never both and never neither (ds_core.rank.engine_build checks the same, but only after init and
    model build). optimizer_in_code None: the model takes either (BridgeTower builds AdamW in code when the JSON
    has no "optimizer"), so only the values are checked; True: the LR schedule is built in code too, and a
    "scheduler" section is refused as well, with why_in_code as the reason. cfg: the JSON as the run fills it
    (ds_core.config.trainer_json), else the file's."""
    from ds_core.config.trainer_json import probe

    source = f"DeepSpeed config {resolve_ds_path(ds_config_path)}"
    cfg = read_ds_json(ds_config_path) if cfg is None else cfg
    check_ds_keys(cfg, source)
    cfg = probe(cfg, source)  # what the flags fill later (the scheduler's steps) given a stand-in value
    check_ds_values(cfg, source)
    check_with_deepspeed(cfg, source)  # every nested key, by DeepSpeed's classes (the rank imports deepspeed anyway)
    if optimizer_in_code is None:
        check_offload(cfg, source, optimizer_in_code, why_in_code)
        return
    why = f" ({why_in_code})" if why_in_code else ""
    if optimizer_in_code and "optimizer" in cfg:
        raise ConfigError(f"{source} has an \"optimizer\" section, but this model builds its optimizer in code{why}: "
                          f"use a DeepSpeed JSON without \"optimizer\" (the model's optimizer flags set it)")
    if optimizer_in_code and "scheduler" in cfg:
        raise ConfigError(f"{source} has a \"scheduler\" section, but this model builds its LR schedule in code{why}: "
                          f"use a DeepSpeed JSON without \"scheduler\" (--lr_scheduler_type and the warm-up flags set "
                          f"it)")
    if not optimizer_in_code and "optimizer" not in cfg:
        raise ConfigError(f"{source} has no \"optimizer\" section and this model builds none in code: add one")
    check_offload(cfg, source, optimizer_in_code, why_in_code)


# DeepSpeed's op builder each offload device needs (the CPU Adam that steps an offloaded optimizer; NVMe's async I/O)
_OFFLOAD_OPS = {"cpu": ("CPUAdamBuilder",), "nvme": ("CPUAdamBuilder", "AsyncIOBuilder")}


def check_offload(cfg: dict, source: str, optimizer_in_code: bool | None, why_in_code: str = "") -> None:
    """ZeRO's optimizer offload, refused in one line before any rank starts where it cannot run: DeepSpeed steps an
    offloaded optimizer in its own CPU Adam (DeepSpeedCPUAdam, from the JSON's "optimizer" section; an optimizer
    built in code is refused by deepspeed.initialize), and the accelerator must have that op (and, for NVMe, async
    I/O): asked of the installed DeepSpeed's accelerator, whose op builders say what it can build."""
    zero = cfg.get("zero_optimization") or {}
    device = str(((zero.get("offload_optimizer") or {}).get("device")) or "none").lower()
    if device not in _OFFLOAD_OPS:
        return
    key = f"zero_optimization.offload_optimizer.device = {device!r}"
    if optimizer_in_code or "optimizer" not in cfg:
        why = f" ({why_in_code})" if optimizer_in_code and why_in_code else ""
        raise ConfigError(f"{source}: {key}: DeepSpeed steps an offloaded optimizer in its own CPU Adam, built from "
                          f"the JSON's \"optimizer\" section, and this run's optimizer is built in code{why}: remove "
                          f"offload_optimizer" + ("" if optimizer_in_code else " or add an \"optimizer\" section "
                                                  "(AdamW / Adam)"))
    opt_type = str((cfg.get("optimizer") or {}).get("type", "")).lower()
    if opt_type not in ("adam", "adamw", "cpuadam"):
        raise ConfigError(f"{source}: {key} with optimizer.type {opt_type!r}: DeepSpeed's optimizer offload steps "
                          f"Adam / AdamW only (DeepSpeedCPUAdam): remove offload_optimizer or use AdamW")
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    for op in _OFFLOAD_OPS[device]:
        try:
            builder = accel.create_op_builder(op)
        except (AttributeError, KeyError, ValueError, ImportError):
            builder = None
        if builder is None:
            raise ConfigError(f"{source}: {key}: the {accel.device_name()} accelerator of the installed DeepSpeed has "
                              f"no {op} (the op an offloaded optimizer needs): remove offload_optimizer")
