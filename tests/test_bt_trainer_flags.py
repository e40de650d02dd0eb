"""Every argument of run_bridgetower.py and the common TrainingArguments is accepted (parsed and mapped) or refused
with the flag to use instead; no prefix is ever taken for a flag; --max_grad_norm is DeepSpeed's
gradient_clipping; --resume_from_checkpoint takes the run's newest checkpoint by any of its names."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from bridgetower_ds import trainer_flags
from bridgetower_ds.configs import BridgeTowerSettings, CompatArgs, DataArgs
from bridgetower_ds.train import DEFAULT_DS_CONFIG
from ds_core.config import TrainConfig, parse_settings, sections_of
from ds_core.errors import ConfigError

# huggingface/optimum-habana examples/contrastive-image-text/run_bridgetower.py at commit
# 1d8504c6c7666a19d71968dba50976dceaf7c6b6: the fields of its ModelArguments and DataTrainingArguments (names only)
RUN_BRIDGETOWER_MODEL = ["model_name_or_path", "config_name", "tokenizer_name", "image_processor_name", "cache_dir",
                         "model_revision", "use_fast_tokenizer", "token", "trust_remote_code", "freeze_vision_model",
                         "freeze_text_model", "freeze_text_pooler"]
RUN_BRIDGETOWER_DATA = ["dataset_name", "dataset_config_name", "dataset_revision", "data_dir", "image_column",
                        "caption_column", "train_file", "validation_file", "max_seq_length", "max_train_samples",
                        "max_eval_samples", "overwrite_cache", "preprocessing_num_workers", "mediapipe_dataloader"]
# transformers TrainingArguments / optimum-habana GaudiTrainingArguments fields a fine-tuning command commonly sets
TRAINING_ARGS = ["output_dir", "overwrite_output_dir", "do_train", "do_eval", "do_predict", "eval_strategy",
                 "eval_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
                 "gradient_accumulation_steps", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
                 "adam_epsilon", "max_grad_norm", "num_train_epochs", "max_steps", "lr_scheduler_type", "warmup_ratio",
                 "warmup_steps", "logging_steps", "save_strategy", "save_steps", "save_total_limit", "seed", "bf16",
                 "fp16", "dataloader_drop_last", "dataloader_num_workers", "remove_unused_columns",
                 "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "report_to", "deepspeed",
                 "resume_from_checkpoint", "gradient_checkpointing", "push_to_hub", "hub_model_id", "ddp_timeout",
                 "use_habana", "use_lazy_mode", "use_hpu_graphs_for_inference", "gaudi_config_name",
                 "throughput_warmup_steps", "distribution_strategy", "sdp_on_bf16"]

# A value each flag takes in the check (the rest are booleans set with no value, or take "1")
VALUES = {"model_name_or_path": None, "config_name": None, "tokenizer_name": None, "image_processor_name": None,
          "cache_dir": "{tmp}/cache", "model_revision": "main", "token": "hf_x", "dataset_name": None,
          "dataset_config_name": "matching", "dataset_revision": "v2", "data_dir": "{tmp}", "image_column": "image",
          "caption_column": "caption", "train_file": "{tmp}/train.csv", "validation_file": "{tmp}/val.csv",
          "output_dir": "{tmp}/run", "eval_strategy": "steps", "save_strategy": "epoch", "learning_rate": "1e-5",
          "weight_decay": "0.01", "adam_beta1": "0.9", "adam_beta2": "0.98", "adam_epsilon": "1e-6",
          "max_grad_norm": "0.5", "lr_scheduler_type": "cosine", "warmup_ratio": "0.1", "metric_for_best_model": "loss",
          "report_to": "tensorboard", "deepspeed": DEFAULT_DS_CONFIG, "resume_from_checkpoint": None,
          "hub_model_id": "me/bt", "gaudi_config_name": "Habana/clip", "distribution_strategy": "ddp",
          "preprocessing_num_workers": "4", "greater_is_better": "false", "max_seq_length": "16"}
BOOLS = {"overwrite_output_dir", "do_train", "do_eval", "do_predict", "use_fast_tokenizer", "trust_remote_code",
         "freeze_vision_model", "freeze_text_model", "freeze_text_pooler", "overwrite_cache", "mediapipe_dataloader",
         "bf16", "fp16", "dataloader_drop_last", "remove_unused_columns", "load_best_model_at_end", "push_to_hub",
         "gradient_checkpointing", "use_habana", "use_lazy_mode", "use_hpu_graphs_for_inference", "sdp_on_bf16"}
# refused flags: the message names the flag to use instead
REFUSED = {"data_dir": "--dataset_path", "dataset_revision": "--dataset_path", "fp16": "--bf16",
           "dataloader_drop_last": "--max_train_samples", "gradient_checkpointing": "--zero_stage",
           "load_best_model_at_end": "--metric_for_best_model", "push_to_hub": "hf upload",
           "eval_steps": "--eval_strategy steps"}  # eval_steps alone would evaluate never, silently


def _resolve(argv: list[str]) -> tuple:
    """parse_settings, then what bridgetower_ds.train.resolve does before any rank starts (without the hub look-up):
    (map_flags' (train, model, data, notes), the parsed settings tree)."""
    cfg = parse_settings(BridgeTowerSettings, argv)
    tc = trainer_flags.check_flags(cfg.compat, cfg.train)
    tc = tc if tc.deepspeed_config else TrainConfig(**{**tc.__dict__, "deepspeed_config": DEFAULT_DS_CONFIG})
    cfg = dataclasses.replace(cfg, train=tc)
    return trainer_flags.map_flags(cfg.compat, tc, cfg.model, cfg.data, DEFAULT_DS_CONFIG, cfg.optim.max_grad_norm), cfg


@pytest.mark.parametrize("name", RUN_BRIDGETOWER_MODEL + RUN_BRIDGETOWER_DATA + TRAINING_ARGS)
def test_every_run_bridgetower_and_trainer_flag_is_accepted_or_refused_with_the_flag_to_use(name, tmp_path):
    for f in ("train.csv", "val.csv"):
        (tmp_path / f).write_text("image,caption\na.jpg,a cat\n")
    value = VALUES.get(name, "1")
    if name in VALUES and value is None:  # a hub id / path flag: a local directory stands in
        value = str(tmp_path)
    argv = ["--do_train", f"--{name}"] + ([] if name in BOOLS else [value.format(tmp=tmp_path)])
    if name in ("config_name", "image_processor_name"):
        argv += ["--model_name_or_path", str(tmp_path)]
    if name not in ("train_file", "validation_file", "data_dir", "dataset_name"):
        argv += ["--dataset_path", str(tmp_path)]
    if name == "resume_from_checkpoint":
        argv = trainer_flags.expand_argv(argv[:2] + argv[3:]) + ["--output_dir", str(tmp_path)]  # no value: latest
    if name in REFUSED:
        with pytest.raises(ConfigError) as e:
            _resolve(argv)
        assert REFUSED[name] in str(e.value) and f"--{name}" in str(e.value)
        return
    (tc, ma, da, notes), cfg = _resolve(argv)
    parsed = {k: v for s in sections_of(cfg) for k, v in s.__dict__.items()}
    assert all(len(n.splitlines()) == 1 for n in notes)
    if name == "resume_from_checkpoint":
        assert tc.resume
    elif name == "eval_strategy":
        assert tc.eval_every == 1  # --eval_steps defaults to --logging_steps (1), as Trainer
    elif name == "deepspeed":
        assert tc.deepspeed_config == DEFAULT_DS_CONFIG
    elif name not in ("tokenizer_name", "output_dir", "per_device_train_batch_size", "per_device_eval_batch_size",
                      "num_train_epochs", "logging_steps", "overwrite_output_dir", "save_steps", "ddp_timeout",
                      "adam_beta1", "adam_beta2", "adam_epsilon", "bf16"):
        assert name in parsed, name  # the flag is a setting of its own (the others are aliases, checked below)


def test_use_hpu_graphs_is_its_own_flag_not_a_prefix():
    ca = parse_settings(BridgeTowerSettings, ["--use_hpu_graphs"]).compat
    assert ca.use_hpu_graphs and not ca.use_hpu_graphs_for_inference
    assert trainer_flags.flag_notices(ca)[0].startswith("--use_hpu_graphs: (optimum-habana's deprecated name")


def test_trainer_spellings_are_aliases_of_our_settings():
    cfg = parse_settings(BridgeTowerSettings, ["--deepspeed", "x.json", "--tokenizer_name", "tok", "--adam_beta2",
                                               "0.98", "--adam_epsilon", "1e-6", "--ddp_timeout", "60",
                                               "--evaluation_strategy", "epoch"])
    tc, ma, oa = cfg.train, cfg.model, cfg.optim
    assert (tc.deepspeed_config, ma.tokenizer_name_or_path, oa.beta2, oa.eps, tc.dist_timeout_s) == \
        ("x.json", "tok", 0.98, 1e-6, 60)


@pytest.mark.parametrize("argv", [["--use_hpu_graphs_for"], ["--tokenizer_name_or", "tok"], ["--deepspeed_conf", "x"],
                                  ["--per_device_train", "8"]])
def test_no_prefix_is_taken_for_a_flag(argv):
    with pytest.raises(ConfigError, match="unknown command-line argument"):
        parse_settings(BridgeTowerSettings, argv)


def test_max_grad_norm_is_gradient_clipping_and_a_conflict_with_the_users_json_is_refused(tmp_path):
    from bridgetower_ds.train import adjust_ds_config

    cfg = _resolve(["--do_train", "--dataset_path", str(tmp_path), "--max_grad_norm", "0.25"])[1]
    ds = {"gradient_clipping": 1.0}
    adjust_ds_config(cfg, ds)
    assert ds["gradient_clipping"] == 0.25
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                "gradient_clipping": 1.0}))
    with pytest.raises(ConfigError, match=rf"--max_grad_norm 0.25 and gradient_clipping 1.0 in .*{mine.name}"):
        _resolve(["--do_train", "--dataset_path", str(tmp_path), "--max_grad_norm", "0.25", "--deepspeed", str(mine)])
    _resolve(["--do_train", "--dataset_path", str(tmp_path), "--max_grad_norm", "1.0", "--deepspeed", str(mine)])


def test_resume_from_checkpoint_takes_the_newest_checkpoint_by_any_name_and_refuses_others(tmp_path):
    run = tmp_path / "run"
    for step in (2, 4):
        d = run / "checkpoints" / f"global_step{step}"
        d.mkdir(parents=True)
        (d / "COMPLETE").write_text("{}")
    (run / "checkpoints" / "latest").write_text("global_step4")
    (run / "checkpoint-4").symlink_to("checkpoints/global_step4")
    base = ["--do_train", "--dataset_path", str(tmp_path), "--output_dir", str(run)]
    for given in ([], [str(run)], [str(run / "checkpoint-4")], [str(run / "checkpoints" / "global_step4")],
                  ["latest"]):
        (tc, *_), _ = _resolve(trainer_flags.expand_argv(base + ["--resume_from_checkpoint", *given]))
        assert tc.resume, given
    with pytest.raises(ConfigError, match="step 2 is not the newest complete checkpoint.*global_step4"):
        _resolve(base + ["--resume_from_checkpoint", str(run / "checkpoints" / "global_step2")])
    other = tmp_path / "other" / "checkpoint-4"
    other.mkdir(parents=True)
    with pytest.raises(ConfigError, match=re.escape(f"not a checkpoint of --output_dir (--run_dir) {run}")):
        _resolve(base + ["--resume_from_checkpoint", str(other)])
    assert not _resolve(base)[0][0].resume


def test_train_validation_test_files_are_the_splits_as_run_bridgetower_reads_them(tmp_path):
    (tmp_path / "train.csv").write_text("image,caption\n" + "".join(f"{i}.jpg,cap {i}\n" for i in range(6)))
    (tmp_path / "val.json").write_text(json.dumps([{"image": "v.jpg", "caption": "val cap"}]))
    (tmp_path / "test.jsonl").write_text(json.dumps({"image": "t.jpg", "caption": "test cap"}) + "\n")
    argv = ["--do_train", "--train_file", str(tmp_path / "train.csv"), "--validation_file", str(tmp_path / "val.json"),
            "--test_file", str(tmp_path / "test.jsonl")]
    (_, _, da, _), cfg = _resolve(argv)
    splits = trainer_flags.open_files(cfg.compat, da)
    assert [len(splits.get(s)) for s in ("train", "validation", "test")] == [6, 1, 1]  # nothing carved out of train
    assert splits.get("validation").captions[0] == "val cap" and splits.get("test").captions[0] == "test cap"
    with pytest.raises(ConfigError, match="give one"):
        _resolve(argv + ["--dataset_path", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        _resolve(["--do_train", "--train_file", str(tmp_path / "missing.csv")])
    assert trainer_flags.open_files(CompatArgs(), DataArgs()) is None


def test_checkpoint_links_follow_complete_checkpoints_and_pruning(tmp_path):
    from ds_core.outputs.hf_trainer import link_checkpoints

    root = tmp_path / "checkpoints"
    for step, complete in ((2, True), (4, True), (6, False)):
        (root / f"global_step{step}").mkdir(parents=True)
        if complete:
            (root / f"global_step{step}" / "COMPLETE").write_text("{}")
    link_checkpoints(tmp_path, root)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]  # not 6
    assert (tmp_path / "checkpoint-4").resolve() == (root / "global_step4").resolve()
    (tmp_path / "checkpoint-9").mkdir()  # a user's own directory of that name is never touched
    import shutil

    shutil.rmtree(root / "global_step2")  # pruned by save_total_limit
    link_checkpoints(tmp_path, root)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-9"]


def _bool_flags(tree: type) -> list[tuple[str, str, object, object]]:
    """(flag, section, field, value when true) of every boolean setting of a settings tree, FLAG_CONSTS included."""
    from ds_core.config import section_types

    found = []
    for section, cls in section_types(tree).items():
        for f in dataclasses.fields(cls):
            if f.type in (bool, "bool"):
                found.append((f"--{f.name}", section, f.name, True))
        for flag, (name, on, _off) in getattr(cls, "FLAG_CONSTS", {}).items():
            found.append((flag, section, name, on))
    return found


@pytest.mark.stack
@pytest.mark.each_gaudi
@pytest.mark.parametrize("tree", ["bridgetower", "bert"])
def test_every_boolean_flag_takes_trainers_forms(tree, tmp_path):
    """`--flag`, `--flag True`, `--flag false` (and yes/no, 1/0), as optimum-habana's commands write them
    (HfArgumentParser's bool fields; `--bf16` too, whose false is fp32); any other word is refused naming the flag."""
    from bert_ref.configs import BertSettings

    settings = {"bridgetower": BridgeTowerSettings, "bert": BertSettings}[tree]
    base = {"bridgetower": [], "bert": ["--input_dir", str(tmp_path)]}[tree]
    flags = _bool_flags(settings)
    assert len(flags) >= (20 if tree == "bridgetower" else 5) and any(f[0] == "--bf16" for f in flags)
    for flag, section, name, on in flags:
        if flag.startswith("--no_"):
            continue

        def parsed(*argv):  # the setting's value, or the refusal of a flag that needs others (--reset_optimizer)
            try:
                return getattr(getattr(parse_settings(settings, base + list(argv)), section), name)
            except ConfigError as e:
                return f"refused: {e}"

        true_forms = {repr(parsed(flag)), repr(parsed(flag, "True")), repr(parsed(flag, "yes"))}
        assert len(true_forms) == 1, (flag, true_forms)
        assert parsed(flag) == on or str(parsed(flag)).startswith("refused"), (flag, parsed(flag))
        false_forms = {repr(parsed(flag, "false")), repr(parsed(flag, "0")), repr(parsed(flag, "No"))}
        assert len(false_forms) == 1 and parsed(flag, "false") != on, (flag, false_forms)
        with pytest.raises((ConfigError, SystemExit)):
            parse_settings(settings, base + [flag, "maybe"])
