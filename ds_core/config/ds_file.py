"""The DeepSpeed JSON a run reads: its path (or a shipped file name), its top-level keys, the overrides of
TrainConfig and the precision rule, giving the resolved config (nested keys: ds_core.config.ds_json)."""
from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

from ds_core import log
from ds_core.config.accumulation import settle_grad_accum_dtype  # noqa: F401 - part of ds_core.config's API
from ds_core.config.batch import check_batch_arithmetic
from ds_core.config.ds_values import check_ds_values
from ds_core.config.settings import TrainConfig
from ds_core.errors import ConfigError

DS_CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
# No default DeepSpeed JSON here: each model package declares its own (bert_ref.train, bridgetower_ds.train), because
# whether the JSON may hold an "optimizer" section depends on whether the model builds its optimizer in code.

# Top-level keys DeepSpeed 0.19 reads (recorded by handing DeepSpeedConfig a dict that logs every lookup) plus the
# documented sections it reads elsewhere (optimizer, scheduler, flops_profiler, activation_checkpointing, ...).
# DeepSpeed silently ignores unknown keys, so a typo such as "zero_optimisation" would silently train with ZeRO-0;
# we refuse it instead.
DS_TOP_LEVEL_KEYS = frozenset("""
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer scheduler fp16 bf16 bfloat16
amp gradient_clipping prescale_gradients gradient_predivide_factor gradient_allreduce_op sparse_gradients
zero_optimization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer steps_per_print wall_clock_breakdown
dump_state flops_profiler activation_checkpointing sparse_attention data_efficiency curriculum_learning tensorboard
csv_monitor wandb comet aim elasticity communication_data_type seq_parallel_communication_data_type autotuning
compression_training checkpoint data_types memory_breakdown disable_allgather dataloader_drop_last nebula pipeline
compile torch_autocast weight_quantization hybrid_engine timers eigenvalue progressive_layer_drop quantize_training
use_data_before_expert_parallelism graph_harvesting comms_logger datastates_ckpt disable_python_gc expert_parallel
log_level managed_gradient_accumulation tensor_parallel vocabulary_size aio load_universal_checkpoint
use_node_local_storage zero_quantized_weights zero_quantized_gradients mesh_device
""".split())

def resolve_ds_path(path: str | os.PathLike) -> Path:
    """A DeepSpeed JSON path as given, or a file name inside the shipped ds_configs/ directory."""
    if not str(path):
        raise ConfigError("no DeepSpeed config: pass --deepspeed_config (a path, or a file name in ds_configs/)")
    p = Path(path)
    if not p.exists() and (DS_CONFIG_DIR / p.name).exists() and len(p.parts) <= 2:
        return DS_CONFIG_DIR / p.name
    return p


def read_ds_json(path: str | os.PathLike) -> dict:
    p = resolve_ds_path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config {p}: file not found (shipped configs: "
                          f"{', '.join(sorted(x.name for x in DS_CONFIG_DIR.glob('*.json')))})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {p}: malformed JSON at line {e.lineno} column {e.colno}: "
                          f"{e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {p}: expected a JSON object, got {type(data).__name__}")
    return data


def check_ds_keys(cfg: dict, source: str = "DeepSpeed config") -> None:
    """Unknown top-level keys refused with a did-you-mean (nested keys: ds_core.config.ds_json)."""
    unknown = sorted(set(cfg) - DS_TOP_LEVEL_KEYS)
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, DS_TOP_LEVEL_KEYS, 1))
                              else "") for k in unknown]
        raise ConfigError(f"{source}: unknown top-level key(s) {', '.join(hints)}")


def load_ds_config(path_or_dict: str | os.PathLike | dict, world_size: int, *, micro_batch: int = 0,
                   grad_accum: int = 0, zero_stage: int = -1, source: str = "DeepSpeed config") -> dict:
    """Load, validate and resolve a DeepSpeed JSON for `world_size` data-parallel ranks.

    Overrides (micro_batch, grad_accum > 0; zero_stage >= 0) replace the JSON's values. A JSON that fixes the global
    batch (train_batch_size without gradient_accumulation_steps, as Habana's BERT-1.5B JSON) keeps it under a micro
    batch override: the accumulation follows, as DeepSpeed derives it. Otherwise, when micro batch or accumulation is
    overridden, train_batch_size is re-derived rather than kept, so the override cannot conflict.
    """
    if isinstance(path_or_dict, dict):
        cfg = json.loads(json.dumps(path_or_dict))  # `source` names where it came from
    else:
        cfg, source = read_ds_json(path_or_dict), f"DeepSpeed config {resolve_ds_path(path_or_dict)}"
    check_ds_keys(cfg, source)
    if micro_batch:
        cfg["train_micro_batch_size_per_gpu"] = micro_batch
    if grad_accum:
        cfg["gradient_accumulation_steps"] = grad_accum
    fixes_global = "train_batch_size" in cfg and "gradient_accumulation_steps" not in cfg
    if grad_accum or (micro_batch and not fixes_global):
        cfg.pop("train_batch_size", None)
    tb, mb, ga = check_batch_arithmetic(cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu"),
                                        cfg.get("gradient_accumulation_steps"), world_size, source)
    cfg.update(train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=ga)
    zero = cfg.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{source}: zero_optimization must be an object, got {zero!r}")
    if zero_stage >= 0:
        zero["stage"] = zero_stage
    stage = zero.setdefault("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{source}: zero_optimization.stage = {stage!r}: expected 0, 1, 2 or 3")
    if cfg.get("bf16", {}).get("enabled") and cfg.get("fp16", {}).get("enabled"):
        raise ConfigError(f"{source}: bf16.enabled and fp16.enabled are both true: pick one precision")
    check_ds_values(cfg, source)
    settle_grad_accum_dtype(cfg, source)
    return cfg


def ds_config_for(cfg: TrainConfig, world_size: int, accelerator: str | None = None,
                  ds_json: dict | None = None) -> dict:
    """The resolved DeepSpeed config of a run: its JSON (as given, or `ds_json`: the file with its "auto" values
    filled, ds_core.config.trainer_json) plus the TrainConfig overrides, its bf16 section switched to the dtype
    TrainConfig.precision resolves to on `accelerator` (default: the one DeepSpeed finds)."""
    source = f"DeepSpeed config {resolve_ds_path(cfg.deepspeed_config)}"
    ds = load_ds_config(cfg.deepspeed_config if ds_json is None else ds_json, world_size,
                        micro_batch=cfg.micro_batch_size, grad_accum=cfg.gradient_accumulation_steps,
                        zero_stage=cfg.zero_stage, source=source)
    return resolve_ds_precision(ds, cfg.precision, accelerator, source=source)


def resolve_ds_precision(ds: dict, precision: str, accelerator: str | None = None,
                         source: str = "DeepSpeed config") -> dict:
    """Apply ds_core.device.precision's rule to a resolved DeepSpeed config; rank 0 prints the one-line notice when auto
    falls back to fp32. An fp16 JSON is kept under auto (the user chose it); bf16/fp32 against it is refused."""
    from ds_core.device import precision as prec

    if precision == "auto" and ds.get("fp16", {}).get("enabled"):
        return ds
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator().device_name()
    dtype, reason = prec.resolve_precision(precision, accelerator)
    try:
        prec.apply_precision(ds, dtype, source)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if precision == "auto" and dtype == "fp32":
        log.say(f"precision {reason}")
    return ds


def precision_of(ds_config: dict) -> str:
    if ds_config.get("bf16", {}).get("enabled") or ds_config.get("bfloat16", {}).get("enabled"):
        return "bf16"
    if ds_config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"
