"""ds_core.checkpoint.resize's batch plan and ds_core.checkpoint's tag handling, on checkpoint markers written here (no
engine): the numbers a resize chooses and the refusals that name them."""
import json

import pytest

from ds_core import checkpoint as ckpt
from ds_core.checkpoint.resize import plan_resize, saved_layout
from ds_core.config import TrainConfig, load_ds_config
from ds_core.errors import ConfigError


def fake_checkpoint(run_dir, step=4, world=2, tb=32, mb=8, ga=2):
    tag = ckpt.tag_for(step)
    d = run_dir / "checkpoints" / tag
    d.mkdir(parents=True)
    batch = {"dp_world_size": world, "train_batch_size": tb, "micro_batch": mb, "grad_accum": ga}
    (d / ckpt.COMPLETE).write_text(json.dumps({"step": step, "fingerprint": {"dp_world_size": world},
                                               "batch": batch}))
    (run_dir / "checkpoints" / ckpt.LATEST).write_text(tag)
    return tag


def ds(world, mb=8, ga=2, stage=1):
    return load_ds_config({"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": ga,
                           "zero_optimization": {"stage": stage}}, world)


def test_keep_batch_recomputes_accumulation_and_asks_for_universal_loading(tmp_path):
    fake_checkpoint(tmp_path)  # 2 ranks x 8 x 2 = 32
    cfg = TrainConfig(run_dir=str(tmp_path), resume=True)
    d = ds(4)  # the JSON's accumulation 2 on 4 ranks would make 64
    plan = plan_resize(cfg, d, 4)
    assert d["gradient_accumulation_steps"] == 2 and "checkpoint" not in d  # the plan does not edit its input
    d = plan.ds_config(d)
    assert d["gradient_accumulation_steps"] == 1 and d["train_batch_size"] == 32
    assert d["checkpoint"] == {"load_universal": True}
    assert plan.new.grad_accum == 1 and plan.lr_factor == 1.0
    assert "data-parallel size 2 -> 4" in plan.describe() and "accumulation 2 -> 1" in plan.describe()
    plan1 = plan_resize(cfg, ds(1), 1)
    assert plan1.new.grad_accum == 4 and plan1.ds_config(ds(1))["train_batch_size"] == 32


def test_keep_batch_refuses_what_does_not_divide_naming_the_numbers(tmp_path):
    fake_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match=r"global batch 32 is not divisible by micro batch 8 x 3 ranks = 24"):
        plan_resize(TrainConfig(run_dir=str(tmp_path), resume=True), ds(3), 3)


def test_scale_lr_keeps_micro_and_accumulation(tmp_path):
    fake_checkpoint(tmp_path)
    d = ds(4)
    plan = plan_resize(TrainConfig(run_dir=str(tmp_path), resume=True, on_resize="scale_lr"), d, 4)
    d = plan.ds_config(d)
    assert d["gradient_accumulation_steps"] == 2 and d["train_batch_size"] == 64 and plan.lr_factor == 2.0
    assert plan.record(4)["new"]["train_batch_size"] == 64


def test_nothing_changes_without_resume_or_on_the_same_size(tmp_path):
    fake_checkpoint(tmp_path)
    d = ds(2)
    assert plan_resize(TrainConfig(run_dir=str(tmp_path), resume=True), d, 2) is None
    assert plan_resize(TrainConfig(run_dir=str(tmp_path)), ds(4), 4) is None
    assert "checkpoint" not in d
    with pytest.raises(ConfigError, match="on_resize"):
        TrainConfig(on_resize="keep").validate()


def test_universal_conversions_are_not_step_tags(tmp_path):
    tag = fake_checkpoint(tmp_path)
    root = tmp_path / "checkpoints"
    (root / f"{tag}_universal").mkdir()
    (root / f"{tag}_universal" / ckpt.COMPLETE).write_text("{}")
    (root / ckpt.LATEST).unlink()
    assert ckpt.step_tags(root) == [tag] and ckpt.latest_tag(root) == tag
    assert saved_layout(root, tag).train_batch_size == 32
