"""What makes optimum-habana's `run_bridgetower.py` command line run here: the TrainingArguments flags with no setting
of their own (CompatArgs: notices, refusals, report_to, save_strategy), the optimizer and LR schedule from
OptimArgs (ds_core.schedule), and the Trainer-style final model (tokenizer + image-processor config beside it).

The flags that ARE settings of this toolkit are aliases on those settings (`--output_dir` is TrainConfig.run_dir,
`--per_device_train_batch_size` is TrainConfig.micro_batch_size, ...): one parser, one source of truth.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from ds_core.compat.hf import bridgetower_image_processor
from ds_core.config import TrainConfig
from ds_core.config.optim import OptimArgs, schedule_for
from ds_core.errors import ConfigError
from ds_core.outputs import monitors
from ds_core.schedule import param_groups

from .configs import GAUDI_TRAINER_NOTICES, HPU_NOTICES, CompatArgs
from .images import CLIP_MEAN, CLIP_STD, SIZE_DIVISOR

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


def check_flags(compat: CompatArgs, train_cfg: TrainConfig) -> TrainConfig:
    """Refuse what cannot be honoured (push_to_hub, GaudiTrainer's fp8 and profiling steps); --torch_compile is
    --compile on (a --compile off given too is refused: two answers to one question)."""
    monitors.report_to_names(compat.report_to)  # a backend not installed: one line, before any process group
    if compat.fp8:
        raise ConfigError("--fp8: refused; training here is bf16 or fp32 (--bf16, --precision)")
    if compat.profiling_steps or compat.profiling_warmup_steps:
        raise ConfigError("--profiling_steps / --profiling_warmup_steps: refused; pass --profile_steps N, which "
                          "profiles the last N warm-up steps (--throughput_warmup_steps) with torch.profiler, HPU "
                          "activity included (docs/metrics.md)")
    if compat.torch_compile:
        if train_cfg.compile == "off":
            raise ConfigError("--torch_compile with --compile off: pass one of them")
        train_cfg = dataclasses.replace(train_cfg, compile="on")
    if compat.push_to_hub:
        raise ConfigError("--push_to_hub: refused; this toolkit never uploads (training hosts often have no internet "
                          "and a credential on every node is a risk). The model is saved in --output_dir in "
                          "save_pretrained format: upload it from there with `hf upload REPO DIR`")
    return train_cfg  # the strategies and the other Trainer flags: bridgetower_ds.trainer_flags.map_flags


def flag_notices(compat: CompatArgs) -> list[str]:
    """One line per accepted flag that does nothing here (HPU-only flags, --hub_model_id)."""
    notices = [f"--{name}: {text}" for name, text in {**HPU_NOTICES, **GAUDI_TRAINER_NOTICES}.items()
               if getattr(compat, name)]
    if compat.hub_model_id:
        notices.append(f"--hub_model_id {compat.hub_model_id}: unused (nothing is pushed to the hub)")
    return notices


def apply_report_to(report_to: str, ds_config: dict, run_dir: str) -> list[str]:
    """Turn on DeepSpeed's monitors for --report_to (Trainer's names), writing under run_dir/<monitor>/
    (ds_core.outputs.monitors, shared with bert_ref)."""
    return monitors.apply_report_to(report_to, ds_config, run_dir, job_name="bridgetower")


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


def engine_kwargs(model: torch.nn.Module, optim: OptimArgs, ds_config: dict, lr: float, wd: float,
                  total_steps: int) -> dict[str, Any]:
    """build_engine's optimizer / model_parameters / lr_scheduler: Trainer's decay groups and the schedule (the
    DeepSpeed JSON's "scheduler" section where it has one: DeepSpeed builds it, as under Trainer)."""
    groups = param_groups(model, wd, lr)
    kw: dict[str, Any] = dict(model_parameters=groups)
    if "scheduler" not in ds_config:
        kw["lr_scheduler"] = schedule_for(trainer_defaults(optim), total_steps)
    if "optimizer" not in ds_config:  # Trainer's adamw_torch
        kw["optimizer"] = torch.optim.AdamW(groups, lr=lr, betas=(optim.beta1, optim.beta2),
                                            eps=trainer_defaults(optim).eps)
    return kw


def image_processor(source_dir: str, image_size: int):
    """The checkpoint's image processor when it has one, else BridgeTower's with this pipeline's geometry (shorter
    side S, S x S center crop, size divisor 32, CLIP mean/std: bridgetower_ds.images). The PIL-backed class of the
    installed transformers (ds_core.compat.hf.bridgetower_image_processor)."""
    processor_cls = bridgetower_image_processor()
    if source_dir and (Path(source_dir) / "preprocessor_config.json").is_file():
        proc = processor_cls.from_pretrained(source_dir)
    else:
        proc = processor_cls(size={"shortest_edge": image_size}, crop_size={"shortest_edge": image_size},
                             size_divisor=SIZE_DIVISOR, do_center_crop=True, image_mean=list(CLIP_MEAN),
                             image_std=list(CLIP_STD))
    got = proc.size.get("shortest_edge") if isinstance(proc.size, dict) else getattr(proc.size, "shortest_edge", None)
    if got != image_size:
        raise ConfigError(f"{source_dir}/preprocessor_config.json: size.shortest_edge {got} != the model's vision "
                          f"image_size {image_size}")
    return proc




def torchvision_transform(size: int):
    """path -> normalized [3, S, S] float32 exactly as run_bridgetower.py makes pixels from an image file
    (examples/contrastive-image-text/run_bridgetower.py, huggingface/optimum-habana
    1d8504c6c7666a19d71968dba50976dceaf7c6b6): torchvision `read_image(path, RGB)`, then its Transform,
    Resize([S], bicubic) + CenterCrop(S) + ConvertImageDtype(float) + Normalize(CLIP mean, std). The reference
    itself, for baselines and for checking images.host_transform(transform="run_bridgetower"); needs torchvision."""
    try:
        from torchvision.io import ImageReadMode, read_image  # optional: the reference only
        from torchvision.transforms import CenterCrop, ConvertImageDtype, InterpolationMode, Normalize, Resize
    except ImportError as e:
        raise RuntimeError(f"run_bridgetower.py's image transform is torchvision's, and torchvision is not importable "
                           f"here ({e})") from None
    pipeline = torch.nn.Sequential(Resize([size], interpolation=InterpolationMode.BICUBIC), CenterCrop(size),
                                   ConvertImageDtype(torch.float), Normalize(CLIP_MEAN, CLIP_STD))

    def run(path: str) -> torch.Tensor:
        with torch.no_grad():
            return pipeline(read_image(path, mode=ImageReadMode.RGB))
    return run
