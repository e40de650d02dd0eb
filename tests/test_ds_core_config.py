"""ds_core.config: batch arithmetic, malformed JSON, unknown keys, CLI + JSON round trip, shipped DeepSpeed configs."""
import json

import pytest

from ds_core.config import (
    DS_CONFIG_DIR,
    TrainConfig,
    check_batch_arithmetic,
    load_ds_config,
    parse_args,
    save_run_config,
)
from ds_core.config.optim import OptimArgs
from ds_core.errors import ConfigError


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
    cfg = load_ds_config(
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4},
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
    assert out.name == "run_config.json"
    (again,) = parse_args([TrainConfig], ["--config", str(out)])
    assert again == cfg
    (from_dir,) = parse_args([TrainConfig], ["--config", str(tmp_path / "r")])  # a run directory: its run_config.json
    assert from_dir == cfg


def test_config_reads_an_older_bert_run_directory_and_names_an_empty_one(tmp_path):
    old = tmp_path / "old_run"
    old.mkdir()
    # before run_config.json; BERT's optimizer section then named the warm-up share warmup_proportion
    (old / "config.json").write_text(json.dumps({"TrainConfig": {"max_steps": 9},
                                                 "OptimArgs": {"warmup_proportion": 0.2, "optimizer": "lamb"}}))
    cfg, optim = parse_args([TrainConfig, OptimArgs], ["--config", str(old)])
    assert cfg.max_steps == 9 and optim.warmup_ratio == 0.2 and optim.optimizer == "lamb"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"--config .*empty: a directory without run_config.json"):
        parse_args([TrainConfig], ["--config", str(tmp_path / "empty")])


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


def test_profile_window_must_fit_in_the_warm_up():
    """--profile_steps N profiles warm-up steps with one untimed step after them: N + 2 <= the warm-up."""
    (cfg,) = parse_args([TrainConfig], ["--profile_steps", "2", "--throughput_warmup_steps", "4"])
    assert cfg.profile_steps == 2
    for bad in (["--profile_steps", "2"], ["--profile_steps", "-1"]):  # default warm-up 3; a negative count
        with pytest.raises(ConfigError, match=r"TrainConfig.profile_steps = -?\d+: expected 0, or at most"):
            parse_args([TrainConfig], bad)


# --- DeepSpeed values refused before training, fp32 gradient accumulation, one default JSON per model package ---

def _ds(**extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    cfg.update(extra)
    return cfg


@pytest.mark.parametrize("change, key", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1e-5}}}, "optimizer.params.lr = -1e-05"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0}}}, "optimizer.params.lr = 0"),
    ({"gradient_clipping": -1.0}, "gradient_clipping = -1.0"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size = 0"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": -5}},
     "zero_optimization.stage3_prefetch_bucket_size = -5"),
    ({"zero_optimization": {"stage": 1, "allgather_bucket_size": 2.5e8 + 0.5}}, "zero_optimization.allgather_bucket"),
    ({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}},
     "stage3_param_persistence_threshold = 'auto'"),
])
def test_bad_deepspeed_values_are_named(change, key):
    with pytest.raises(ConfigError) as e:
        load_ds_config(_ds(**change), 2)
    assert key in str(e.value)


def test_good_deepspeed_values_pass():
    cfg = load_ds_config(_ds(gradient_clipping=0.0, zero_optimization={"stage": 3, "reduce_bucket_size": 5e8,
                                                                        "stage3_param_persistence_threshold": 0}), 2)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 5e8


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_accumulation_is_fp32(stage, capsys):
    cfg = load_ds_config(_ds(gradient_accumulation_steps=8, zero_optimization={"stage": stage}), 2)
    assert cfg["data_types"]["grad_accum_dtype"] == "fp32"
    assert "gradients accumulate in fp32" in capsys.readouterr().err
    # one micro-step per optimizer step: nothing accumulates, DeepSpeed's default path is kept
    assert "data_types" not in load_ds_config(_ds(zero_optimization={"stage": stage}), 2)


def test_bf16_accumulation_asked_for_is_warned_with_the_measured_error(capsys):
    cfg = load_ds_config(_ds(gradient_accumulation_steps=8, data_types={"grad_accum_dtype": "bf16"}), 2)
    assert cfg["data_types"]["grad_accum_dtype"] == "bf16"  # asked for: kept, with a warning
    err = capsys.readouterr().err
    assert "warning" in err and "1.15 %" in err and "0.07 %" in err
    # ZeRO-0: as the installed DeepSpeed runs bf16 there (tests/test_deepspeed_behaviour.py states it per release):
    # 0.19 with bf16 accumulation only (warned), Habana's fork with fp32 only (filled in, with a notice)
    cfg0 = load_ds_config(_ds(gradient_accumulation_steps=8, zero_optimization={"stage": 0}), 2)
    err = capsys.readouterr().err
    if cfg0.get("data_types", {}).get("grad_accum_dtype") == "fp32":
        assert "gradients accumulate in fp32" in err and "bf16 accumulation at this stage: DeepSpeed" in err, err
    else:
        assert "cannot accumulate bf16 gradients in fp32 at ZeRO stage 0" in err and "1.15 %" in err, err


def test_the_accumulation_deepspeed_refuses_with_zero0_bf16_is_refused_before_deepspeed():
    """0.19 refuses fp32 accumulation at bf16 ZeRO-0, Habana's fork bf16 (tests/test_deepspeed_behaviour.py)."""
    from ds_core.compat.deepspeed_behaviour import WrapperRefused, optimizer_wrapper

    try:
        optimizer_wrapper(0, "bf16", "fp32")
        refused = "bf16"
    except WrapperRefused:
        refused = "fp32"
    with pytest.raises(ConfigError, match="grad_accum_dtype.*stage 0"):
        load_ds_config(_ds(zero_optimization={"stage": 0}, data_types={"grad_accum_dtype": refused}), 2)


@pytest.mark.parametrize("path", sorted(DS_CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_shipped_configs_accumulate_in_fp32_when_they_accumulate(path):
    raw = json.loads(path.read_text())
    if raw.get("bf16", {}).get("enabled") and raw.get("gradient_accumulation_steps", 1) > 1:
        assert raw.get("data_types", {}).get("grad_accum_dtype") == "fp32", path.name  # said in the file itself


def test_each_model_package_has_one_default_ds_config():
    import bert_ref.train
    import bridgetower_ds.train
    from ds_core import config as dsc
    from ds_core.config.ds_json import check_ds_json

    assert not hasattr(dsc, "DEFAULT_DS_CONFIG")  # ds_core picks none
    with pytest.raises(ConfigError, match="--deepspeed_config"):
        dsc.ds_config_for(TrainConfig(), 1)
    # bert_ref builds its optimizer in code: its default JSON must have no "optimizer" section, and the reverse
    check_ds_json(bert_ref.train.DEFAULT_DS_CONFIG, optimizer_in_code=True)
    check_ds_json(bridgetower_ds.train.DEFAULT_DS_CONFIG, optimizer_in_code=False)
    with pytest.raises(ConfigError, match="builds its optimizer in code"):
        check_ds_json("zero1_bf16.json", optimizer_in_code=True)


def test_new_run_settings_are_validated():
    with pytest.raises(ConfigError, match="save_total_limit"):
        parse_args([TrainConfig], ["--save_total_limit", "-1"])
    with pytest.raises(ConfigError, match="max_steps_this_run"):
        parse_args([TrainConfig], ["--max_steps_this_run", "-2"])
    with pytest.raises(ConfigError, match="overwrite_run_dir"):
        parse_args([TrainConfig], ["--resume", "true", "--overwrite_run_dir", "true"])


def test_compile_setting_is_auto_on_or_off_and_auto_follows_the_model():
    from ds_core.rank.compile import compile_wanted

    (default,) = parse_args([TrainConfig], [])
    (on,) = parse_args([TrainConfig], ["--compile", "on"])
    assert (default.compile, on.compile) == ("auto", "on")
    with pytest.raises(ConfigError, match=r"TrainConfig.compile = 'yes': expected one of auto, on, off"):
        parse_args([TrainConfig], ["--compile", "yes"])
    # auto stays eager unless the model names the accelerator where its compiled step measured faster
    assert [compile_wanted(s) for s in ("auto", "on", "off")] == [False, True, False]
    assert [compile_wanted(s, "cuda", ("cuda",)) for s in ("auto", "on", "off")] == [True, True, False]
    assert [compile_wanted(s, "cpu", ("cuda",)) for s in ("auto", "on", "off")] == [False, True, False]
    # on Gaudi auto compiles (Habana's default execution, eager + torch.compile), except in lazy mode, which has no
    # torch.compile: there auto stays eager and on is refused naming PT_HPU_LAZY_MODE
    assert [compile_wanted(s, "hpu", ("cuda",)) for s in ("auto", "on", "off")] == [True, True, False]
    assert [compile_wanted(s, "hpu", ("cuda",), lazy=True) for s in ("auto", "off")] == [False, False]
    with pytest.raises(ConfigError, match="PT_HPU_LAZY_MODE=1"):
        compile_wanted("on", "hpu", lazy=True)
    assert compile_wanted("on", "cuda", lazy=True)  # the lazy flag means Gaudi's mode: nothing elsewhere
