"""Trainer-style DeepSpeed JSONs (ds_core.config.trainer_json): the "auto" values filled from the flags with the
values transformers' own Trainer fills (checked against a real TrainingArguments of the same flags and
HfTrainerDeepSpeedConfig's finalize, for every JSON of tests/data/trainer_ds_configs); a value the JSON fixes and a
flag contradicts refused before any rank starts, naming both; an "auto" Trainer fills nowhere refused; BERT's
optimizer / scheduler sections and an optimizer offload it cannot run refused with the reason; the starters' check
takes such JSONs. The 2-rank runs on these JSONs are tests/test_trainer_json_runs.py."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, environment_kept
from ds_core.errors import ConfigError

pytestmark = [pytest.mark.stack, pytest.mark.each_gaudi]

DATA = REPO / "tests" / "data" / "trainer_ds_configs"
JSONS = sorted(p.relative_to(DATA).as_posix() for p in DATA.rglob("*.json"))
# Trainer's flags, and ours: the same names (ours are aliases: --per_device_train_batch_size is --micro_batch_size)
FLAGS = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "learning_rate": 3e-4,
         "weight_decay": 0.01, "adam_beta2": 0.98, "adam_epsilon": 1e-6, "max_grad_norm": 0.5}
TOTAL_STEPS = 40
WARMUP_RATIO = 0.1
# what only accelerate (not HfTrainerDeepSpeedConfig) changes under Trainer: its steps_per_print (logging), and the two
# keys ds_core.config.trainer_json fills as accelerate does (tested on their own below)
ACCELERATE_ONLY = ("steps_per_print", "bfloat16")


def _bridgetower(tmp_path: Path, argv: list[str]):
    """bridgetower_ds.train's settings as start_run has them before the process group: (as given, resolved)."""
    from bridgetower_ds.configs import BridgeTowerSettings
    from bridgetower_ds.train import resolve
    from ds_core.config import parse_settings

    (tmp_path / "train.csv").write_text("image,caption\na.jpg,a cat\n")
    given = parse_settings(BridgeTowerSettings, ["--do_train", "--train_file", str(tmp_path / "train.csv"),
                                                 "--output_dir", str(tmp_path / "run"), *argv])
    return given, resolve(given)[0]


def _ours(tmp_path: Path, name: str, argv: list[str], world: int = 1) -> dict:
    """The JSON as a BridgeTower run fills it (ds_core.run.setup.TrainerFill, then the steps Run.with_data fills)."""
    from bridgetower_ds.train import SPEC
    from ds_core.config import trainer_json
    from ds_core.run.setup import TrainerFill

    given, cfg = _bridgetower(tmp_path, ["--deepspeed", str(DATA / name), *argv])  # name: in DATA, or a path
    fill = TrainerFill.of(SPEC, given, cfg)
    return trainer_json.fill_steps(fill.ds_json(world), fill.args(world), TOTAL_STEPS, "X")


def _trainers(tmp_path: Path, name: str, **flags) -> dict:
    """What transformers' Trainer makes of the JSON with these flags: TrainingArguments(deepspeed=...) runs
    HfTrainerDeepSpeedConfig.trainer_config_process, Trainer then trainer_config_finalize with its model (BridgeTower's
    debug preset) and the number of optimizer steps."""
    from transformers import TrainingArguments
    from transformers.integrations import deepspeed as hf_ds

    from bridgetower_ds.configs import debug

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    if "warmup_ratio" in flags and "warmup_ratio" not in fields:  # transformers 5: a share is warmup_steps < 1
        flags["warmup_steps"] = flags.pop("warmup_ratio")
    before = hf_ds._hf_deepspeed_config_weak_ref
    with environment_kept():  # 4.x's TrainingArguments(deepspeed=...) sets ACCELERATE_USE_DEEPSPEED
        try:
            args = TrainingArguments(output_dir=str(tmp_path / "trainer"), deepspeed=str(DATA / name), use_cpu=True,
                                     report_to="none", **flags)
            hf = args.hf_deepspeed_config
            hf.trainer_config_finalize(args, SimpleNamespace(config=debug()), TOTAL_STEPS)
            return hf.config
        finally:
            hf_ds._hf_deepspeed_config_weak_ref = before


def _without(cfg: dict, keys=ACCELERATE_ONLY) -> dict:
    return {k: v for k, v in cfg.items() if k not in keys}


@pytest.mark.parametrize("name", JSONS)
def test_auto_values_are_the_ones_trainer_fills(name, tmp_path):
    """Each stored JSON, unchanged, with Trainer's flags given and with none given: the values ours fills are the
    ones transformers' Trainer fills (batch keys, accumulation, clipping, the optimizer's lr / betas / eps / weight
    decay, WarmupLR's values, the ZeRO-3 sizes from the hidden size, precision); nothing is left "auto"."""
    from ds_core.config.trainer_json import auto_keys

    flags = {**FLAGS, "bf16": True, **_fixed_flags(name)}  # a flag the JSON fixes, given its value (no conflict)
    argv = [x for k, v in flags.items() if k != "bf16" for x in (f"--{k}", str(v))]
    argv += ["--warmup_ratio", str(WARMUP_RATIO), "--bf16", str(flags["bf16"])]
    ours = _ours(tmp_path, name, argv)
    assert auto_keys(ours) == []
    assert _without(ours) == _without(_trainers(tmp_path, name, **flags, warmup_ratio=WARMUP_RATIO))
    # nothing given: Trainer's defaults (BridgeTower's own are Trainer's), and a value the JSON fixes kept, where
    # Trainer would compare it with its flag's default: Trainer given the JSON's own values for those flags
    ours = _ours(tmp_path, name, [])
    assert _without(ours) == _without(_trainers(tmp_path, name, **_fixed_flags(name)))


# TrainingArguments' flags a JSON can fix, by the key that fixes them
FIXES = {"max_grad_norm": "gradient_clipping", "per_device_train_batch_size": "train_micro_batch_size_per_gpu",
         "gradient_accumulation_steps": "gradient_accumulation_steps", "bf16": "bf16.enabled",
         "learning_rate": "optimizer.params.lr", "weight_decay": "optimizer.params.weight_decay",
         "adam_epsilon": "optimizer.params.eps"}


def _fixed_flags(name: str) -> dict:
    from ds_core.config.trainer_json import value_at

    cfg = json.loads((DATA / name).read_text())
    return {flag: value_at(cfg, key) for flag, key in FIXES.items() if value_at(cfg, key) not in (None, "auto")}


def test_the_values_of_the_acceptance_json_by_hand(tmp_path):
    """transformers' ds_config_zero3_bf16.json on 2 ranks, written out (Trainer's rules as its source states them):
    train_batch_size = world x micro x accumulation, reduce_bucket_size = hidden^2, stage3_prefetch_bucket_size =
    int(0.9 hidden^2), stage3_param_persistence_threshold = 10 hidden, warmup = ceil(ratio x total steps)."""
    from bridgetower_ds.configs import debug

    argv = [x for k, v in FLAGS.items() for x in (f"--{k}", str(v))] + ["--warmup_ratio", str(WARMUP_RATIO)]
    cfg = _ours(tmp_path, "transformers/ds_config_zero3_bf16.json", argv, world=2)
    hidden = debug().hidden_size
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"],
            cfg["gradient_clipping"]) == (4, 2, 2 * 4 * 2, 0.5)
    assert cfg["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.01}
    assert cfg["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                          "warmup_num_steps": math.ceil(WARMUP_RATIO * TOTAL_STEPS)}
    zero = cfg["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (hidden ** 2, int(0.9 * hidden ** 2), 10 * hidden)
    # the older "bfloat16" section: the bf16 value, as accelerate's own "bf16" section shadows it under Trainer
    assert cfg["bfloat16"] == {"enabled": False}


def test_a_value_the_json_fixes_and_a_flag_contradicts_is_refused_naming_both(tmp_path):
    """optimum-habana's deepspeed_zero_1.json with its micro batch fixed at 2 and --per_device_train_batch_size 4,
    or its gradient_clipping 1.0 and --max_grad_norm 0.5: refused before any process group, naming the file, the
    key and the flag with both values (Trainer refuses both too); the same value passes, and a flag not given keeps
    the JSON's value (where Trainer would compare its default)."""
    import torch.distributed as dist

    from bridgetower_ds.train import main

    fixed = json.loads((DATA / "optimum_habana" / "deepspeed_zero_1.json").read_text())
    fixed["train_micro_batch_size_per_gpu"] = 2
    name = tmp_path / "fixed.json"
    name.write_text(json.dumps(fixed))
    (tmp_path / "train.csv").write_text("image,caption\na.jpg,a cat\n")
    base = ["--do_train", "--train_file", str(tmp_path / "train.csv"), "--output_dir", str(tmp_path / "run"),
            "--deepspeed", str(name)]
    with pytest.raises(ConfigError) as e:
        main(base + ["--per_device_train_batch_size", "4"])
    assert "ds train_micro_batch_size_per_gpu=2 vs hf per_device_train_batch_size=4" in str(e.value), e.value
    assert str(name) in str(e.value) and not dist.is_initialized()
    with pytest.raises(ConfigError) as e:
        main(base + ["--max_grad_norm", "0.5"])
    assert all(w in str(e.value) for w in ("max_grad_norm", "0.5", "gradient_clipping", "1.0", str(name))), e.value
    assert not dist.is_initialized()
    agreed = _ours(tmp_path, str(name), ["--max_grad_norm", "1.0", "--per_device_train_batch_size", "2"])
    assert (agreed["gradient_clipping"], agreed["train_micro_batch_size_per_gpu"]) == (1.0, 2)
    kept = _ours(tmp_path, str(name), [])
    assert (kept["gradient_clipping"], kept["train_micro_batch_size_per_gpu"]) == (1.0, 2)


def test_an_auto_trainer_fills_nowhere_is_refused(tmp_path):
    from ds_core.config.ds_json import check_before_spawn

    cfg = json.loads((DATA / "optimum_habana" / "deepspeed_zero_1.json").read_text())
    cfg["zero_optimization"]["stage"] = "auto"
    (tmp_path / "x.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"zero_optimization.stage = 'auto': transformers' Trainer fills no such"):
        check_before_spawn(tmp_path / "x.json", world_size=2)


@pytest.mark.parametrize("name", JSONS)
def test_the_starters_check_takes_trainer_style_jsons(name):
    """launch.run / launch.local_ranks check the JSON before spawning a rank: its "auto"s are the ranks' to fill."""
    from ds_core.config.ds_json import check_before_spawn

    check_before_spawn(DATA / name, world_size=2)


def _bert(tmp_path: Path, argv: list[str]):
    from bert_ref.train import main

    (tmp_path / "shards").mkdir(exist_ok=True)
    return main(["--preset", "debug", "--input_dir", str(tmp_path / "shards"), "--run_dir", str(tmp_path / "run"),
                 *argv])


def test_bert_refuses_the_optimizer_and_scheduler_sections_with_the_reason(tmp_path):
    import torch.distributed as dist

    with pytest.raises(ConfigError, match=r"has an \"optimizer\" section, but this model builds its optimizer in "
                                          r"code \(BERT trains with its recipe's LAMB / LANS"):
        _bert(tmp_path, ["--deepspeed", str(DATA / "transformers" / "ds_config_zero2_bf16.json")])
    cfg = json.loads((DATA / "optimum_habana" / "deepspeed_zero_3_gaudi1.json").read_text())
    del cfg["optimizer"]
    (tmp_path / "sched.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"has a \"scheduler\" section, but this model builds its LR schedule"):
        _bert(tmp_path, ["--deepspeed", str(tmp_path / "sched.json")])
    assert not dist.is_initialized()


def test_optimizer_offload_it_cannot_run_is_refused_in_one_line(tmp_path, monkeypatch):
    """Offload steps DeepSpeed's CPU Adam: BERT's optimizer built in code cannot offload; an accelerator whose
    DeepSpeed has no CPUAdamBuilder cannot either (the CPU accelerator has one: tests/test_trainer_json_runs.py
    trains with it)."""
    from ds_core.config.ds_json import check_offload

    cfg = json.loads((DATA / "optimum_habana" / "deepspeed_zero_2.json").read_text())
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    (tmp_path / "offload.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        _bert(tmp_path, ["--deepspeed", str(tmp_path / "offload.json")])
    assert "offload_optimizer.device = 'cpu'" in str(e.value) and "LAMB / LANS" in str(e.value)
    assert len(str(e.value).splitlines()) == 1
    with_adam = {**cfg, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    check_offload(with_adam, "X", None)  # this DeepSpeed's CPU accelerator has its CPU Adam
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "create_op_builder", lambda self, name: None)
    with pytest.raises(ConfigError, match="has no CPUAdamBuilder"):
        check_offload(with_adam, "X", None)


def test_bridgetower_refuses_a_second_schedule_beside_the_jsons_scheduler(tmp_path):
    name = str(DATA / "transformers" / "ds_config_zero2_bf16.json")
    with pytest.raises(ConfigError, match=r"--lr_scheduler_type cosine and the \"scheduler\" section \(WarmupLR\)"):
        _bridgetower(tmp_path, ["--deepspeed", name, "--lr_scheduler_type", "cosine"])
    cfg = json.loads((DATA / "transformers" / "ds_config_zero3.json").read_text())
    cfg["scheduler"]["params"] = {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}
    cfg = {k: v for k, v in cfg.items() if k != "fp16"}
    for k in ("train_batch_size", "gradient_accumulation_steps", "gradient_clipping"):
        cfg.pop(k)
    cfg["train_micro_batch_size_per_gpu"] = 4
    cfg["optimizer"]["params"] = {"lr": 3e-5}
    cfg["zero_optimization"] = {"stage": 3}
    (tmp_path / "ds_form.json").write_text(json.dumps(cfg))  # no "auto": DeepSpeed's own form
    with pytest.raises(ConfigError, match=r"--learning_rate 0.001 and .* scheduler.params.warmup_max_lr = 3e-05"):
        _bridgetower(tmp_path, ["--deepspeed", str(tmp_path / "ds_form.json"), "--learning_rate", "1e-3"])
    with pytest.raises(ConfigError, match=r"--warmup_steps / --warmup_ratio and .*warmup_num_steps = 500"):
        _bridgetower(tmp_path, ["--deepspeed", str(tmp_path / "ds_form.json"), "--warmup_steps", "10"])
