"""transformers Trainer's and run_bridgetower.py's flags with their meaning here: strategies, gradient
clipping, --resume_from_checkpoint, per-split manifest files, revisions and the offline cache. Each flag is honoured,
accepted with a one-line notice (it changes nothing here), or refused naming the flag to use instead; nothing is
silently dropped. tests/test_bt_trainer_flags.py holds run_bridgetower.py's argument names and checks each.

The flags that ARE settings of this toolkit are aliases on those settings (`--output_dir` is TrainConfig.run_dir,
`--per_device_train_batch_size` is TrainConfig.micro_batch_size, ...): one parser, one source of truth. The
TrainingArguments flags with no setting of their own (CompatArgs) are checked here: refusals (`check_flags`), notices
(`flag_notices`), `--report_to` (`apply_report_to`) and the strategies (`map_flags`).
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Sequence

from ds_core.config import TrainConfig
from ds_core.errors import ConfigError, InputNotFound
from ds_core.outputs import monitors
from ds_core.run.run_dir import resume_from_checkpoint

from .configs import GAUDI_TRAINER_NOTICES, HPU_NOTICES, CompatArgs, ModelArgs

STRATEGIES = ("no", "steps", "epoch")

# Accepted flags that change nothing here: flag -> (is it set?, why it changes nothing)
_NOTICES = {
    "preprocessing_num_workers": (lambda c: c.preprocessing_num_workers is not None,
                                  "captions are tokenized in the DataLoader workers: --dataloader_num_workers sets "
                                  "how many"),
    "overwrite_cache": (lambda c: c.overwrite_cache, "no preprocessed dataset cache is written, nothing to overwrite"),
    "use_fast_tokenizer": (lambda c: not c.use_fast_tokenizer,
                           "false is not followed: the model directory's tokenizer loads as AutoTokenizer does (the "
                           "fast one when it has one; it gives the same ids)"),
    "trust_remote_code": (lambda c: c.trust_remote_code,
                          "BridgeTower is transformers' own code; no remote code is run"),
    "token": (lambda c: bool(c.token), "unused: nothing is downloaded (offline caches only)"),
}


def expand_argv(argv: Sequence[str]) -> list[str]:
    """`--resume_from_checkpoint` without a value (Trainer: the newest checkpoint) -> `--resume_from_checkpoint
    latest` (the setting parses that form itself too: TrainConfig.resume_from_checkpoint)."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--resume_from_checkpoint" and (i + 1 == len(out) or out[i + 1].startswith("--")):
            out.insert(i + 1, "latest")
    return out


def map_flags(compat: CompatArgs, train_cfg: TrainConfig, model_args: ModelArgs, data_args,
              default_ds_config: str, max_grad_norm: float | None = None
              ) -> tuple[TrainConfig, ModelArgs, object, list[str]]:
    """Before any rank starts: refusals, the strategies and --resume_from_checkpoint onto TrainConfig, the offline
    cache and revisions onto the model/data settings; returns new instances and the notices for rank 0."""
    notices = [f"--{name}: {text}" for name, (given, text) in _NOTICES.items() if given(compat)]
    if compat.gradient_checkpointing:
        raise ConfigError("--gradient_checkpointing: refused; transformers' BridgeTower does not support gradient "
                          "checkpointing (supports_gradient_checkpointing is False). To fit memory use --zero_stage 3 "
                          "or a smaller --per_device_train_batch_size with --gradient_accumulation_steps")
    if compat.dataloader_drop_last:
        raise ConfigError("--dataloader_drop_last: refused; an epoch's last (smaller) micro batch is trained (a "
                          "one-row batch, which has no negative, is dropped). For full batches only, pass "
                          "--max_train_samples N with N a multiple of --per_device_train_batch_size x ranks")
    if compat.fp16:
        raise ConfigError("--fp16: refused; mixed precision here is bf16 (no loss scaling needed): pass --bf16 (or "
                          "--precision fp32)")
    if compat.load_best_model_at_end:
        raise ConfigError("--load_best_model_at_end: refused; the saved model is the last step's. Pass "
                          "--metric_for_best_model M: trainer_state.json names the best checkpoint "
                          "(best_model_checkpoint), and `ds-ckpt export-hf` writes it in save_pretrained format")
    if compat.data_dir:
        raise ConfigError(f"--data_dir {compat.data_dir}: refused; pass --dataset_path {compat.data_dir} (a "
                          "save_to_disk directory, an imagefolder, or a csv/json/jsonl manifest)")
    if compat.dataset_revision not in ("", "main"):
        raise ConfigError(f"--dataset_revision {compat.dataset_revision}: refused; the offline datasets cache holds "
                          "the revision it was filled with: save that revision with save_to_disk where there is "
                          "internet and pass --dataset_path DIR")
    for name in ("eval_strategy", "save_strategy"):
        if getattr(compat, name) not in STRATEGIES:
            raise ConfigError(f"--{name} {getattr(compat, name)!r}: expected one of {', '.join(STRATEGIES)}")
    if compat.eval_steps < 0:
        raise ConfigError(f"--eval_steps {compat.eval_steps}: expected >= 0")
    if compat.eval_steps and compat.eval_strategy != "steps":
        raise ConfigError(f"--eval_steps {compat.eval_steps} with --eval_strategy {compat.eval_strategy}: "
                          "eval_steps counts only with --eval_strategy steps")
    if compat.eval_strategy == "steps":
        every = compat.eval_steps or train_cfg.eval_every or train_cfg.log_every  # Trainer: eval_steps or logging
        train_cfg = dataclasses.replace(train_cfg, eval_every=every)
    elif train_cfg.eval_every and compat.eval_strategy == "epoch":
        raise ConfigError(f"--eval_every {train_cfg.eval_every} with --eval_strategy epoch: pick one")
    if max_grad_norm is not None:
        if max_grad_norm < 0:
            raise ConfigError(f"--max_grad_norm {max_grad_norm}: expected >= 0 (0: no clipping)")
        if train_cfg.deepspeed_config != default_ds_config:  # the user's own JSON: a second value is a conflict
            from ds_core.config import read_ds_json

            json_value = read_ds_json(train_cfg.deepspeed_config).get("gradient_clipping")
            # "auto" (a Trainer-style JSON) takes the flag: ds_core.config.trainer_json fills it
            if json_value not in (None, "auto") and float(json_value) != max_grad_norm:
                raise ConfigError(f"--max_grad_norm {max_grad_norm} and gradient_clipping {json_value} in "
                                  f"the DeepSpeed config {train_cfg.deepspeed_config}: give one (or the same value)")
    if compat.cache_dir:
        use_cache_dir(compat.cache_dir)
    if compat.model_revision not in ("", "main") and Path(model_args.model_name_or_path).expanduser().is_dir():
        notices.append(f"--model_revision {compat.model_revision}: unused, --model_name_or_path is a local directory")
    if compat.config_name and _real(compat.config_name) != _real(model_args.model_name_or_path):
        raise ConfigError(f"--config_name {compat.config_name}: refused; the config is read from "
                          f"--model_name_or_path {model_args.model_name_or_path or '(none: --preset)'}: put the "
                          "config.json beside the weights, or pass --preset for a random init")
    files = [f for f in (compat.train_file, compat.validation_file, compat.test_file) if f]
    if files and (data_args.dataset_path or data_args.dataset_name):
        raise ConfigError("--train_file/--validation_file/--test_file with --dataset_path/--dataset_name: give one")
    for f in files:
        if not Path(f).expanduser().is_file():
            raise InputNotFound(f"{f}: no such file (--train_file / --validation_file / --test_file)")
        if Path(f).suffix.lower() not in (".csv", ".json", ".jsonl"):
            raise ConfigError(f"{f}: expected a .csv, .json or .jsonl file, as run_bridgetower.py reads them")
    train_cfg = resume_from_checkpoint(train_cfg)  # --resume_from_checkpoint [PATH] (ds_core.run.run_dir)
    if compat.save_strategy == "no":
        if train_cfg.num_steps_per_checkpoint:
            raise ConfigError(f"--save_strategy no with --save_steps {train_cfg.num_steps_per_checkpoint}: pick one")
        train_cfg = dataclasses.replace(train_cfg, save_final_checkpoint=False)
    elif compat.save_strategy == "epoch" and train_cfg.num_steps_per_checkpoint:
        raise ConfigError(f"--save_strategy epoch with --save_steps {train_cfg.num_steps_per_checkpoint}: pick one")
    return train_cfg, model_args, data_args, notices


def _real(path: str) -> str:
    return str(Path(path).expanduser().resolve()) if path else ""


def use_cache_dir(cache_dir: str) -> None:
    """--cache_dir: from_pretrained's and load_dataset's cache. Hub snapshots and datasets are looked up under it
    (HF_HUB_CACHE, HF_DATASETS_CACHE); the libraries read these when imported, so loaded modules are set too."""
    root = str(Path(cache_dir).expanduser())
    os.environ["HF_HUB_CACHE"] = root
    os.environ["HF_DATASETS_CACHE"] = root
    for mod, attr in (("huggingface_hub.constants", "HF_HUB_CACHE"), ("datasets.config", "HF_DATASETS_CACHE")):
        if mod in sys.modules:
            setattr(sys.modules[mod], attr, root if attr == "HF_HUB_CACHE" else Path(root))


def steps_per_epoch(micro_batches_per_epoch: int, grad_accum: int) -> int:
    """Optimizer steps of one epoch, for --eval_strategy / --save_strategy epoch (accumulation carries across an
    epoch's end in ds_core.run.trainer, so with a remainder an "epoch" event lands on the nearest step before its
    end)."""
    return max(1, micro_batches_per_epoch // max(1, grad_accum))


def open_files(compat: CompatArgs, data_args, seed: int = 42):
    """--train_file / --validation_file / --test_file as the run's splits (a missing one is carved out of train as
    for any source without it, with the training `seed`), or None when none is given."""
    from .data import Splits, load_tables

    files = {data_args.train_split: compat.train_file, data_args.validation_split: compat.validation_file,
             data_args.test_split: compat.test_file}
    tables = {}
    for split, f in files.items():
        if f:
            one = load_tables(dataclasses.replace(data_args, dataset_path=f, dataset_format="auto"))
            if len(one) != 1:
                raise ConfigError(f"{f}: a 'split' column names {sorted(one)}; a --{split}_file holds one split")
            tables[split] = next(iter(one.values()))
    return Splits(dataclasses.replace(data_args, dataset_path=compat.train_file or next(iter(files.values()))),
                  tables, seed=seed) if tables else None


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
    return train_cfg  # the strategies and the other Trainer flags: map_flags


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
