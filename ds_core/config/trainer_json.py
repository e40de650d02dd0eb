"""Trainer-style DeepSpeed JSONs: the `"auto"` values filled from this run's flags as transformers' Trainer fills them,
by transformers' own class, and a value the JSON fixes that a given flag contradicts refused, naming both.

A JSON with "auto" anywhere was written for Trainer's DeepSpeed integration (transformers' tests/deepspeed configs,
optimum-habana's, most published fine-tuning recipes), and is read with Trainer's contract. The filling is
`transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig` of the installed transformers, unchanged: its
`trainer_config_process` (batch keys, accumulation, clipping, the optimizer's lr / betas / eps / weight decay,
WarmupLR's min and max LR, fp16 / bf16; transformers 4.x also apex's amp keys) and `trainer_config_finalize`
(reduce_bucket_size = hidden^2, ZeRO-3's stage3_prefetch_bucket_size = int(0.9 hidden^2) and
stage3_param_persistence_threshold = 10 hidden from the model config's hidden size, the scheduler's total_num_steps
and warmup_num_steps). Reused rather than rewritten because its rules differ between the releases of the support
matrix (transformers 5 keeps an auto warmup_num_steps >= 1, which DeepSpeed 0.19.6+ requires; 4.51 / 4.55 fill
apex's amp section): each stack fills as its own Trainer does. It is handed a TrainingArguments-shaped object
(TrainerArgs) rather than a TrainingArguments, whose construction sets up accelerate's process state.

Two keys Trainer leaves to accelerate (Accelerator._prepare_deepspeed and DeepSpeedPlugin.set_mixed_precision) are
filled as accelerate fills them: the older "bfloat16" section's "enabled" (accelerate adds a "bf16" section that
shadows it; here it takes the bf16 value) and zero_optimization.stage3_gather_16bit_weights_on_model_save (False:
the run's export gathers the fp32 master weights itself). An "auto" at any other key is refused, as accelerate
refuses it ("not found in kwargs").

Where this differs from Trainer, on purpose: a flag that is not given does not contradict the JSON. Trainer compares
every fixed value with its flag's default (a JSON's "lr": 3e-5 against the default --learning_rate 5e-5 is refused
there); here the JSON's value stands unless the flag is given, and an "auto" takes the flag, else the model's own
default (which for BridgeTower is Trainer's). A JSON without any "auto" is DeepSpeed's own form and keeps the
toolkit's documented meaning (--micro_batch_size and friends override it; ds_core.config.load_ds_config).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ds_core.errors import ConfigError

AUTO = "auto"
# transformers.TrainingArguments' defaults, for an "auto" whose flag is not given and the model has no value of its own
TRAINER_DEFAULTS = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_grad_norm=1.0,
                        learning_rate=5e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0)
# Where each TrainingArguments value Trainer fills sits in the JSON (HfTrainerDeepSpeedConfig.trainer_config_process):
# a flag that is not given takes the JSON's fixed value from here, so that it does not contradict it
_JSON_KEYS = {"per_device_train_batch_size": ("train_micro_batch_size_per_gpu",),
              "gradient_accumulation_steps": ("gradient_accumulation_steps",),
              "max_grad_norm": ("gradient_clipping",),
              "learning_rate": ("optimizer.params.lr", "scheduler.params.warmup_max_lr"),
              "adam_epsilon": ("optimizer.params.eps",), "weight_decay": ("optimizer.params.weight_decay",),
              "bf16": ("bf16.enabled", "bfloat16.enabled"), "fp16": ("fp16.enabled",)}
# filled as accelerate fills them (module docstring): key -> the run's TrainerArgs attribute or a constant
_ACCELERATE_KEYS = {"bfloat16.enabled": "bf16", "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}


def auto_keys(cfg: Any, prefix: str = "") -> list[str]:
    """The dotted keys whose value is "auto", in the JSON's order."""
    if not isinstance(cfg, dict):
        return []
    out = []
    for key, value in cfg.items():
        if isinstance(value, dict):
            out += auto_keys(value, f"{prefix}{key}.")
        elif value == AUTO:
            out.append(f"{prefix}{key}")
    return out


def is_trainer_style(cfg: dict) -> bool:
    return bool(auto_keys(cfg))


def value_at(cfg: dict, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _fixed(cfg: dict, dotted: str) -> Any:
    """The JSON's own value at `dotted` (None when absent or "auto")."""
    value = value_at(cfg, dotted)
    return None if value == AUTO else value


@dataclass(frozen=True)
class TrainerArgs:
    """The TrainingArguments attributes HfTrainerDeepSpeedConfig reads (transformers 4.51 to 5.x), as this run sets
    them. warmup: optimizer steps -> warm-up steps (TrainingArguments.get_warmup_steps)."""

    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    max_grad_norm: float
    learning_rate: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    weight_decay: float
    bf16: bool
    warmup: Callable[[int], int] = lambda total: 0
    fp16: bool = False
    fp16_full_eval: bool = False
    bf16_full_eval: bool = False
    save_on_each_node: bool = False
    fp16_backend: str = "auto"  # transformers 4.x reads these two (its apex amp keys)
    fp16_opt_level: str = "O1"

    def get_warmup_steps(self, num_training_steps: int) -> int:
        return int(self.warmup(num_training_steps))


@dataclass(frozen=True)
class GivenFlags:
    """The values a run's flags give Trainer's keys: None where the flag was not given (then the JSON's fixed value
    stands), with `defaults`, the model's value for an "auto" whose flag is not given (TRAINER_DEFAULTS fill the
    rest). warmup_given: --warmup_steps / --warmup_ratio was given; warmup: total steps -> the run's warm-up steps."""

    per_device_train_batch_size: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None
    max_grad_norm: Optional[float] = None
    learning_rate: Optional[float] = None
    adam_beta1: Optional[float] = None
    adam_beta2: Optional[float] = None
    adam_epsilon: Optional[float] = None
    weight_decay: Optional[float] = None
    bf16: Optional[bool] = None
    warmup_given: bool = False
    warmup: Callable[[int], int] = lambda total: 0
    defaults: dict = dataclasses.field(default_factory=dict)

    def args_for(self, cfg: dict, world_size: int) -> TrainerArgs:
        """TrainerArgs for this JSON: each value the flag's, else the JSON's fixed one, else the default."""
        betas = _fixed(cfg, "optimizer.params.betas")
        json_values: dict[str, Any] = {}
        for name, keys in _JSON_KEYS.items():
            json_values[name] = next((v for v in map(lambda k: _fixed(cfg, k), keys) if v is not None), None)
        if isinstance(betas, (list, tuple)) and len(betas) == 2:
            json_values.update(adam_beta1=betas[0], adam_beta2=betas[1])
        values = {}
        for name in (*TRAINER_DEFAULTS, "bf16"):
            given = getattr(self, name)
            fallback = self.defaults.get(name, TRAINER_DEFAULTS.get(name))
            values[name] = next(v for v in (given, json_values.get(name), fallback, False) if v is not None)
        warm_json = _fixed(cfg, "scheduler.params.warmup_num_steps")
        warmup = self.warmup if self.warmup_given or warm_json is None else (lambda total: warm_json)
        return TrainerArgs(world_size=world_size, warmup=warmup, fp16=bool(json_values["fp16"]), **values)


def flags_of(given_train: Any, given_optim: Any, optim: Any) -> GivenFlags:
    """GivenFlags of a run's settings: given_train / given_optim as parsed (TrainConfig, OptimArgs or None; 0 / None:
    not given), optim as the model resolved it (its defaults for what was not given). Adam's betas have defaults
    rather than None, which are Trainer's: a beta equal to Trainer's default counts as not given."""
    from ds_core.config.optim import warmup_for

    precision = getattr(given_train, "precision", "auto")
    kw: dict[str, Any] = dict(per_device_train_batch_size=given_train.micro_batch_size or None,
                              gradient_accumulation_steps=given_train.gradient_accumulation_steps or None,
                              bf16={"bf16": True, "fp32": False}.get(precision))
    if given_optim is not None:
        kw.update(max_grad_norm=given_optim.max_grad_norm, learning_rate=given_optim.learning_rate,
                  adam_epsilon=given_optim.eps, weight_decay=given_optim.weight_decay,
                  adam_beta1=None if given_optim.beta1 == TRAINER_DEFAULTS["adam_beta1"] else given_optim.beta1,
                  adam_beta2=None if given_optim.beta2 == TRAINER_DEFAULTS["adam_beta2"] else given_optim.beta2,
                  warmup_given=bool(given_optim.warmup_steps) or given_optim.warmup_ratio is not None)
    defaults: dict[str, Any] = {}
    if optim is not None:
        defaults = {k: v for k, v in (("max_grad_norm", optim.max_grad_norm), ("learning_rate", optim.learning_rate),
                                      ("adam_epsilon", optim.eps), ("weight_decay", optim.weight_decay),
                                      ("adam_beta1", optim.beta1), ("adam_beta2", optim.beta2)) if v is not None}
        if optim.lr_scheduler_type:
            kw["warmup"] = lambda total: warmup_for(optim, total)
    return GivenFlags(defaults=defaults, **kw)


class _Ignored(list):
    """A mismatch list that keeps nothing: a check before the flags are known fills, and compares nothing."""

    def append(self, item: Any) -> None:
        pass


def _hf_config(cfg: dict):
    """HfTrainerDeepSpeedConfig of a copy of cfg, without the global reference it registers (transformers'
    is_deepspeed_zero3_enabled() reads it: a stray ZeRO-3 object would send this process's from_pretrained through
    zero.Init)."""
    from transformers.integrations import deepspeed as hf_ds

    before = hf_ds._hf_deepspeed_config_weak_ref  # noqa: SLF001 - module global, put back as it was
    try:
        return hf_ds.HfTrainerDeepSpeedConfig(copy.deepcopy(cfg))
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = before  # noqa: SLF001


def _refuse_mismatches(mismatches: list[str], source: str) -> None:
    if mismatches:
        raise ConfigError(f"{source}: the JSON fixes values the flags contradict (transformers' Trainer refuses them "
                          f"too): {'; '.join(m.lstrip('- ') for m in mismatches)}. Write \"auto\" there, give the "
                          f"JSON's value, or leave the flag out")


def fill_from_flags(cfg: dict, args: TrainerArgs, source: str, *, check: bool = True) -> dict:
    """A copy of cfg with what Trainer fills when TrainingArguments is made (HfTrainerDeepSpeedConfig.
    trainer_config_process), plus accelerate's two keys; check=False compares nothing."""
    hf = _hf_config(cfg)
    if not check:
        hf.mismatches = _Ignored()
    hf.trainer_config_process(args)
    _refuse_mismatches(hf.mismatches, source)
    out = hf.config
    for key, value in _ACCELERATE_KEYS.items():
        parent, _, leaf = key.rpartition(".")
        node = value_at(out, parent)
        if isinstance(node, dict) and node.get(leaf) == AUTO:
            node[leaf] = getattr(args, value) if isinstance(value, str) else value
    return out


def _finalize(cfg: dict, args: TrainerArgs, model_config: Any, total_steps: int, source: str, check: bool) -> dict:
    from types import SimpleNamespace

    hf = _hf_config(cfg)
    if not check:
        hf.mismatches = _Ignored()
    try:
        hf.trainer_config_finalize(args, SimpleNamespace(config=model_config), total_steps)
    except ValueError as e:
        _refuse_mismatches(hf.mismatches, source)
        raise ConfigError(f"{source}: {e}") from None
    return hf.config


def fill_hidden_size(cfg: dict, args: TrainerArgs, model_config: Any, source: str) -> dict:
    """A copy of cfg with the ZeRO keys Trainer fills from the model config's hidden size (trainer_config_finalize:
    reduce_bucket_size, and under ZeRO-3 the prefetch bucket and persistence threshold); the scheduler's steps wait
    for the number of optimizer steps (fill_steps)."""
    keys = [k for k in auto_keys(cfg) if k.startswith("zero_optimization.")]
    if not keys:
        return copy.deepcopy(cfg)
    without = {k: v for k, v in cfg.items() if k != "scheduler"}
    out = _finalize(without, args, model_config, 1, source, check=False)
    return {k: copy.deepcopy(v) if k == "scheduler" else out[k] for k, v in cfg.items()}


def fill_steps(cfg: dict, args: TrainerArgs, total_steps: int, source: str, *, check: bool = True) -> dict:
    """A copy of cfg with the scheduler's total_num_steps and warmup_num_steps Trainer fills from the run's optimizer
    steps (trainer_config_finalize; the hidden-size keys are filled before: fill_hidden_size)."""
    return _finalize(cfg, args, None, total_steps, source, check)


def refuse_unfilled(cfg: dict, source: str) -> None:
    """An "auto" left after Trainer's filling is at a key Trainer and accelerate fill nowhere."""
    left = auto_keys(cfg)
    if left:
        named = ", ".join(f"{k} = {AUTO!r}" for k in left)
        raise ConfigError(f"{source}: {named}: transformers' Trainer fills no "
                          f"such key from its flags (it fills the batch sizes, accumulation, clipping, fp16 / bf16, "
                          f"the optimizer's lr / betas / eps / weight_decay, the scheduler's warm-up and total steps, "
                          f"and the ZeRO bucket sizes from the hidden size): give a value")


# A stand-in configuration for checks made before the flags or the model are known (a launcher's check of the file):
# Trainer's defaults on one rank, a hidden size of 1024, one optimizer step; nothing is compared.
_NEUTRAL = TrainerArgs(world_size=1, bf16=False, **TRAINER_DEFAULTS)
_NEUTRAL_MODEL = {"hidden_size": 1024}


def probe(cfg: dict, source: str) -> dict:
    """cfg with every "auto" Trainer fills given a neutral value (the checks of the JSON's other keys and of
    DeepSpeed's own parse need numbers there); an "auto" Trainer does not fill is refused."""
    if not is_trainer_style(cfg):
        return cfg
    from types import SimpleNamespace

    out = fill_from_flags(cfg, _NEUTRAL, source, check=False)
    out = fill_hidden_size(out, _NEUTRAL, SimpleNamespace(**_NEUTRAL_MODEL), source)
    out = fill_steps(out, _NEUTRAL, 1, source, check=False)
    refuse_unfilled(out, source)
    return out


__all__ = ["AUTO", "TRAINER_DEFAULTS", "TrainerArgs", "GivenFlags", "flags_of", "auto_keys", "is_trainer_style",
           "value_at", "fill_from_flags", "fill_hidden_size", "fill_steps", "refuse_unfilled", "probe"]
