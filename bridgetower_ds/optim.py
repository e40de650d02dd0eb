"""BridgeTower's optimizer and LR schedule as run_bridgetower.py's Trainer makes them: Trainer's defaults (AdamW,
linear schedule, eps 1e-8) where the model's are asked for, the learning rate and weight decay under OptimArgs' rule
against the DeepSpeed JSON (ds_core.config.optim), decided once (`decide`) and read by everything after; the
JSON's "optimizer" and "scheduler" sections built by DeepSpeed, as under Trainer."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ds_core.config.optim import OptimArgs, schedule_for
from ds_core.errors import ConfigError
from ds_core.schedule import param_groups

TRAINER_DEFAULT_LR = 5e-5  # transformers.TrainingArguments.learning_rate
TRAINER_DEFAULT_WD = 0.0
# BridgeTower's values for the OptimArgs settings left to the model: transformers' Trainer defaults (adamw_torch)
TRAINER_DEFAULTS = dict(lr_scheduler_type="linear", eps=1e-8, warmup_ratio=0.0)


def trainer_defaults(optim: OptimArgs) -> OptimArgs:
    """optim with Trainer's defaults where the model's are asked for (optimizer '' stays: AdamW built in code, or the
    DeepSpeed JSON's section); lamb / lans are refused."""
    if optim.optimizer not in ("", "adamw"):
        raise ConfigError(f"--optimizer {optim.optimizer}: BridgeTower trains with AdamW (or the DeepSpeed JSON's "
                          "\"optimizer\" section); lamb and lans are bert_ref's")
    return dataclasses.replace(optim, **{k: v for k, v in TRAINER_DEFAULTS.items() if getattr(optim, k) in (None, "")})


def decide(optim: OptimArgs, ds_json: dict, source: str) -> tuple[OptimArgs, list[str]]:
    """BridgeTower's optimizer settings, decided once before any rank starts: Trainer's defaults where the model's
    are asked for, the learning rate and weight decay under OptimArgs' rule against the DeepSpeed JSON (its
    "scheduler" section checked against the flags first). Everything after reads the returned settings."""
    check_scheduler_section(optim, ds_json, source)
    lr, wd, notes = resolve_optimizer(optim, ds_json, source)
    return dataclasses.replace(trainer_defaults(optim), learning_rate=lr, weight_decay=wd), notes


def write_decided(optim: OptimArgs, ds_config: dict) -> None:
    """The decided learning rate and weight decay into the DeepSpeed config's optimizer section, where it has one,
    so the resolved ds_config.json holds the values used."""
    if "optimizer" in ds_config:
        ds_config["optimizer"].setdefault("params", {}).update(lr=optim.learning_rate, weight_decay=optim.weight_decay)


def resolve_optimizer(optim: OptimArgs, ds_config: dict, source: str) -> tuple[float, float, list[str]]:
    """The run's (learning rate, weight decay) under OptimArgs' rule, written into the DeepSpeed config's optimizer
    section when it has one, so the resolved ds_config.json holds the values used."""
    params = ds_config.get("optimizer", {}).get("params", {}) if "optimizer" in ds_config else None
    notes = []

    def pick(flag: str, given: float | None, key: str, default: float) -> float:
        json_value = params.get(key) if params is not None else None
        if json_value == "auto":  # HF's DeepSpeed-integration spelling: "take it from the flags"
            json_value = None
        if given is None:
            return float(json_value) if json_value is not None else default
        if json_value is not None and float(json_value) != given:
            notes.append(f"--{flag} {given} replaces {source} optimizer.params.{key} = {json_value}")
        return given

    lr = pick("learning_rate", optim.learning_rate, "lr", TRAINER_DEFAULT_LR)
    wd = pick("weight_decay", optim.weight_decay, "weight_decay", TRAINER_DEFAULT_WD)
    if params is not None:
        ds_config["optimizer"].setdefault("params", {}).update(lr=lr, weight_decay=wd)
    return lr, wd, notes


def check_scheduler_section(given: OptimArgs, ds_json: dict, source: str) -> None:
    """A DeepSpeed JSON with a "scheduler" section (WarmupLR, WarmupDecayLR, ...) sets the LR schedule, as under
    Trainer: --lr_scheduler_type given too is a second schedule, refused. In a JSON of DeepSpeed's own form (no
    "auto": nothing is filled from the flags) a warm-up flag or a --learning_rate other than the section's
    warmup_max_lr would change nothing, and is refused naming both (a Trainer-style JSON takes them where it says
    "auto" and refuses a contradiction: ds_core.config.trainer_json)."""
    from ds_core.config.trainer_json import is_trainer_style

    sched = ds_json.get("scheduler")
    if not isinstance(sched, dict):
        return
    kind = sched.get("type")
    if given.lr_scheduler_type:
        raise ConfigError(f"--lr_scheduler_type {given.lr_scheduler_type} and the \"scheduler\" section ({kind}) of "
                          f"{source}: the section is the LR schedule; remove one of them")
    if is_trainer_style(ds_json):
        return
    params = sched.get("params") or {}
    if given.warmup_steps or given.warmup_ratio is not None:
        raise ConfigError(f"--warmup_steps / --warmup_ratio and {source} scheduler.params.warmup_num_steps = "
                          f"{params.get('warmup_num_steps')!r} ({kind}): the section's value is the warm-up; give it "
                          f"there (or \"auto\", which takes the flag)")
    peak = params.get("warmup_max_lr")
    if given.learning_rate is not None and peak is not None and float(peak) != given.learning_rate:
        raise ConfigError(f"--learning_rate {given.learning_rate} and {source} scheduler.params.warmup_max_lr = "
                          f"{peak} ({kind}): the scheduler sets the LR; give the same value (or \"auto\")")


def engine_kwargs(model: torch.nn.Module, optim: OptimArgs, ds_config: dict, total_steps: int) -> dict[str, Any]:
    """build_engine's optimizer / model_parameters / lr_scheduler from the decided settings (`decide`): Trainer's
    decay groups and the schedule (the DeepSpeed JSON's "scheduler" section where it has one: DeepSpeed builds it, as
    under Trainer)."""
    groups = param_groups(model, optim.weight_decay, optim.learning_rate)
    kw: dict[str, Any] = dict(model_parameters=groups)
    if "scheduler" not in ds_config:
        kw["lr_scheduler"] = schedule_for(optim, total_steps)
    if "optimizer" not in ds_config:  # Trainer's adamw_torch
        kw["optimizer"] = torch.optim.AdamW(groups, lr=optim.learning_rate, betas=(optim.beta1, optim.beta2),
                                            eps=optim.eps)
    return kw
