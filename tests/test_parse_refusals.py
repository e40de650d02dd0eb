"""Bad values are refused when the settings are parsed (before any process group or model exists), in one line that
names the setting: non-finite or out-of-range optimizer values (flags and the DeepSpeed JSON's optimizer section),
and a study axis value or name that is not a plain path component (a cell's run directory is built from it)."""
from __future__ import annotations

import math
import textwrap

import pytest

from ds_core.errors import ConfigError


@pytest.mark.parametrize("flag, value, expected", [
    ("--learning_rate", "inf", "> 0, finite"), ("--learning_rate", "nan", "> 0, finite"),
    ("--eps", "inf", "> 0, finite"), ("--weight_decay", "inf", ">= 0, finite"),
    ("--beta1", "nan", "in [0, 1)"), ("--beta2", "7", "in [0, 1)"), ("--beta2", "1", "in [0, 1)"),
    ("--adam_beta1", "-0.1", "in [0, 1)"), ("--max_grad_norm", "nan", ">= 0, finite"),
    ("--poly_degree", "inf", "> 0, finite"), ("--warmup_steps", "inf", ">= 0, finite")])
def test_bad_optimizer_flag_is_refused_at_parse_time(tmp_path, flag, value, expected):
    from bert_ref.configs import BertSettings
    from ds_core.config import parse_settings

    with pytest.raises(ConfigError) as e:
        parse_settings(BertSettings, ["--preset", "debug", "--input_dir", str(tmp_path), flag, value])
    msg = str(e.value)
    assert "\n" not in msg and f"(--{flag.lstrip('-').replace('adam_', '')}): expected {expected}" in msg, msg


def test_good_optimizer_flags_still_parse(tmp_path):
    from bert_ref.configs import BertSettings
    from ds_core.config import parse_settings

    cfg = parse_settings(BertSettings, ["--preset", "debug", "--input_dir", str(tmp_path), "--beta1", "0", "--beta2",
                                        "0.999", "--eps", "1e-8", "--weight_decay", "0", "--warmup_ratio", "1"])
    assert (cfg.optim.beta1, cfg.optim.eps) == (0.0, 1e-8)


@pytest.mark.parametrize("params, key", [({"betas": [0.9, 1.5]}, "betas"), ({"betas": [math.nan, 0.9]}, "betas"),
                                         ({"betas": [0.9]}, "betas"), ({"eps": math.inf}, "eps"),
                                         ({"eps": 0}, "eps"), ({"weight_decay": -1}, "weight_decay"),
                                         ({"weight_decay": math.nan}, "weight_decay")])
def test_bad_optimizer_values_in_the_deepspeed_json_are_refused(params, key):
    from ds_core.config import load_ds_config

    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, **params}}}
    with pytest.raises(ConfigError, match=rf"optimizer\.params\.{key} = "):
        load_ds_config(cfg, 1)


def _study(tmp_path, axes: str, extra: str = ""):
    from ds_tools.study.spec import load_study

    f = tmp_path / "s.toml"
    f.write_text(textwrap.dedent(f"""
        [study]
        module = "bert_ref.train"
        {extra}
        [axes]
    """) + axes + "\n")
    return load_study(f)


@pytest.mark.parametrize("axes, why", [('dataloader_num_workers = ["../x"]', "value '../x'"),
                                       ('tag = ["a/b"]', "value 'a/b'"), ('tag = ["a b"]', "value 'a b'"),
                                       ('tag = ["$(id)"]', r"value '\$\(id\)'"), ('"../x" = [1]', "'../x'")])
def test_study_axis_that_is_not_a_path_component_is_refused(tmp_path, axes, why):
    from ds_tools.study.spec import StudyError

    with pytest.raises(StudyError, match=why):
        _study(tmp_path, axes)


def test_study_axis_values_stay_inside_the_study(tmp_path):
    from ds_tools.study import plan

    study = _study(tmp_path, 'micro = [1, 2]\ntag = ["a.b", "c-d", "1e-05"]')
    out = tmp_path / "out"
    for cell in study.cells():
        assert plan.cell_dir(out, cell).resolve().parent == (out / "cells").resolve()
    with pytest.raises(Exception, match=r"name = '\.\./up'"):
        _study(tmp_path, "micro = [1]", extra='name = "../up"')
