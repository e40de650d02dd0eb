"""Typed run config, CLI + JSON parsing, and DeepSpeed JSON validation with batch arithmetic, one concern a module:
settings (TrainConfig, `arg`), parsing (command line and --config), run_config (the file a run writes), batch (the
three batch numbers), ds_file (the DeepSpeed JSON a run reads and resolves), ds_values (values DeepSpeed accepts
silently), ds_json (the whole JSON through DeepSpeed's own classes), trainer_json (Trainer-style "auto" values),
accumulation, launch_forms, optim. This module only gathers their names.

One place decides every number of a run before any rank does work: our own settings live in dataclasses (one help
line per field), DeepSpeed's settings live in the DeepSpeed JSON only, and the three batch numbers are checked against
the data-parallel world size here (llm-foundry's validate_config, HF's HfArgumentParser).
"""
from __future__ import annotations

from ds_core.config.accumulation import settle_grad_accum_dtype
from ds_core.config.batch import Batch, check_batch_arithmetic
from ds_core.config.ds_file import (
    DS_CONFIG_DIR,
    DS_TOP_LEVEL_KEYS,
    check_ds_keys,
    ds_config_for,
    load_ds_config,
    precision_of,
    read_ds_json,
    resolve_ds_path,
    resolve_ds_precision,
)
from ds_core.config.ds_values import check_ds_values
from ds_core.config.parsing import parse_args, parse_settings, section_types, sections_of, settings_parser
from ds_core.config.run_config import OLD_RUN_CONFIG, RUN_CONFIG, config_file, save_run_config
from ds_core.config.settings import TrainConfig, arg

__all__ = ["settle_grad_accum_dtype", "arg", "TrainConfig", "settings_parser", "parse_args", "section_types",
           "sections_of", "parse_settings", "RUN_CONFIG", "OLD_RUN_CONFIG", "config_file", "save_run_config",
           "check_batch_arithmetic", "Batch", "DS_CONFIG_DIR", "DS_TOP_LEVEL_KEYS", "resolve_ds_path",
           "read_ds_json", "check_ds_keys", "load_ds_config", "ds_config_for", "resolve_ds_precision",
           "precision_of", "check_ds_values"]
