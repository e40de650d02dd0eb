"""ds_core.config: batch arithmetic, malformed JSON, unknown keys, CLI + JSON round trip, shipped DeepSpeed configs."""
import json

import pytest

from ds_core.config import (DS_CONFIG_DIR, ConfigError, TrainConfig, check_batch_arithmetic, load_ds_config,
                            parse_args, save_run_config)


def test_missing_batch_number_is_derived_like_deepspeed():
    assert check_batch_arithmetic(None, 16, 24, 8) == (3072, 16, 24)
    assert check_batch_arithmetic(3072, 16, None, 8) == (3072, 16, 24)
    assert check_batch_arithmetic(3072, None, 24, 8) == (3072, 16, 24)
    assert check_batch_arithmetic(64, None, None, 8) == (64, 8, 1)
    assert check_batch_arithmetic(None, 4, None, 2) == (8, 4, 1)


def test_inconsistent_batch_numbers_name_every_number():
    with pytest.raises(ConfigError) as e:
        check_batch_arithmetic(100, 16, 24, 8)
    msg = str(e.value)
    for part in ("train_batch_size=100", "train_micro_batch_size_per_gpu=16", "gradient_accumulation_steps=24",
                 "world size=8", "3072"):
        assert part in msg


def test_indivisible_train_batch_is_refused():
    with pytest.raises(ConfigError, match="not divisible"):
        check_batch_arithmetic(100, 16, None, 8)


def test_malformed_json_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_micro_batch_size_per_gpu": 4,\n  "bf16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError) as e:
        load_ds_config(bad, 2)
    assert str(bad) in str(e.value) and "line 3" in str(e.value)


def test_misspelt_deepspeed_key_is_named_with_suggestion(tmp_path):
    p = tmp_path / "typo.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimisation": {"stage": 1}}))
    with pytest.raises(ConfigError) as e:
        load_ds_config(p, 2)
    assert "'zero_optimisation'" in str(e.value) and "zero_optimization" in str(e.value)


def test_overrides_rederive_train_batch():
    cfg = load_ds_config({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4},
                         2, micro_batch=4, zero_stage=3)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) \
        == (32, 4, 4)
    assert cfg["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize("path", sorted(DS_CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
@pytest.mark.parametrize("world", [1, 2, 8])
def test_every_shipped_ds_config_validates(path, world):
    cfg = load_ds_config(path, world)
    assert cfg["train_batch_size"] == (cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
                                       * world)
    assert cfg["zero_optimization"]["stage"] in (0, 1, 2, 3)


def test_config_json_then_flags_override(tmp_path):
    p = tmp_path / "run.json"
    p.write_text(json.dumps({"TrainConfig": {"max_steps": 7, "seed": 3}}))
    (cfg,) = parse_args([TrainConfig], ["--config", str(p), "--seed", "5", "--local_rank=1"])
    assert cfg.max_steps == 7 and cfg.seed == 5
    out = save_run_config(tmp_path / "r", cfg)
    (again,) = parse_args([TrainConfig], ["--config", str(out)])
    assert again == cfg


def test_unknown_key_in_our_config_is_named(tmp_path):
    p = tmp_path / "run.json"
    p.write_text(json.dumps({"max_step": 7}))
    with pytest.raises(ConfigError) as e:
        parse_args([TrainConfig], ["--config", str(p)])
    assert "'max_step'" in str(e.value) and "max_steps" in str(e.value)


def test_unknown_flag_is_named():
    with pytest.raises(ConfigError, match="--max_stepz"):
        parse_args([TrainConfig], ["--max_stepz", "3"])


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match="zero_stage"):
        parse_args([TrainConfig], ["--zero_stage", "5"])
