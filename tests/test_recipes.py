"""Each `--recipe` command of docs/bert_pretraining.md resolves to the published run's settings.

The table below is written from the references themselves, not from bert_ref.recipes:
  NVIDIA/DeepLearningExamples 7a4c42501ce05ac5b76999e3b9ddadeffd177b1d PyTorch/LanguageModeling/BERT:
    scripts/run_pretraining.sh lines 17-35 (defaults: train_batch_size 8192 / 4096 per GPU, 8 GPUs, accumulation
    128 / 512, lr 6e-3 / 4e-3, warm-up 0.2843 / 0.128, steps 7038 / 1563, seed 12439, checkpoint every 200);
    run_pretraining.py lines 376-387 (weight decay 0.01 but bias/LayerNorm, FusedLAMB(lr) with apex's defaults
    betas (0.9, 0.999), eps 1e-6, max_grad_norm 1.0; PolyWarmUpScheduler default degree 0.5, no constant phase).
  HabanaAI/Model-References PyTorch/nlp/DeepSpeedExamples/deepspeed-bert: scripts/run_bert_1.5b_32x.sh and
    scripts/deepspeed_config_bert_1.5b.json at 59a69770ac86f7065b2c5954b13cdf5cb9d1dfd8 (the script's last version;
    HL_NUM_NODES nodes x 8; lr 0.0015, warm-up 0.05, constant 0.25, degree 1.0, 155000 steps, seed 12439, checkpoint
    every 200; train_batch_size 12288, micro 32, ZeRO-1, bf16, gradient_clipping 1.0); run_pretraining.py and lans.py
    at 06bfc5eaa56c3282c26896efd535982abe52b2eb (LANS(max_grad_norm=0., eps=1e-6, adjust_step=args.zero_optimization),
    betas 0.9, 0.999; weight decay 0.01 but bias/LayerNorm).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from bert_ref.configs import BertSettings
from bert_ref.optim import for_preset
from bert_ref.recipes import RECIPES, check_recipe_batch, expand_recipe
from ds_core.config import Batch, ds_config_for, parse_settings
from ds_core.errors import ConfigError

DOC = Path(__file__).resolve().parents[1] / "docs" / "bert_pretraining.md"

_LAMB = dict(optimizer="lamb", beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, max_grad_norm=1.0,
             bias_correction_lag=False, lr_scheduler_type="nvidia_poly", constant_proportion=0.0, poly_degree=0.5,
             scale_lr_with_global_batch=False)
_LANS = dict(optimizer="lans", beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction_lag=True,
             lr_scheduler_type="habana_poly", warmup_ratio=0.05, constant_proportion=0.25, poly_degree=1.0,
             learning_rate=0.0015, scale_lr_with_global_batch=False)
PUBLISHED = {
    "nvidia_large_p1": dict(_LAMB, preset="bert_large", phase=1, world=8, train_batch_size=8192 * 8, accum=128,
                            micro=8192 // 128, learning_rate=6e-3, warmup_ratio=0.2843, max_steps=7038,
                            seed=12439, zero_stage=None, gradient_clipping=None),
    "nvidia_large_p2": dict(_LAMB, preset="bert_large", phase=2, world=8, train_batch_size=4096 * 8, accum=512,
                            micro=4096 // 512, learning_rate=4e-3, warmup_ratio=0.128, max_steps=1563,
                            seed=12439, zero_stage=None, gradient_clipping=None),
    "habana_1p5b_8n": dict(_LANS, preset="bert_1p5b", phase=1, world=64, train_batch_size=12288,
                           accum=12288 // (32 * 64), micro=32, max_steps=155000, seed=12439, zero_stage=1,
                           gradient_clipping=1.0),
    "habana_1p5b_16n": dict(_LANS, preset="bert_1p5b", phase=1, world=128, train_batch_size=12288,
                            accum=12288 // (32 * 128), micro=32, max_steps=155000, seed=12439, zero_stage=1,
                            gradient_clipping=1.0),
}


def documented_commands() -> dict[str, tuple[int, list[str]]]:
    """recipe -> (world size from the launcher flags, the module's argv) for each `--recipe` command in the doc."""
    text = DOC.read_text().replace("\\\n", " ")
    out = {}
    for line in text.splitlines():
        if "--recipe" not in line or not line.startswith("deepspeed "):
            continue
        argv = shlex.split(line)
        launcher, module = argv[:argv.index("--module")], argv[argv.index("--module") + 2:]
        flag = lambda name: int(launcher[launcher.index(name) + 1]) if name in launcher else 1  # noqa: E731
        out[module[module.index("--recipe") + 1]] = (flag("--num_nodes") * flag("--num_gpus"), module)
    return out


def test_every_recipe_is_documented():
    assert sorted(documented_commands()) == sorted(RECIPES) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_documented_command_resolves_to_the_published_settings(name, tmp_path):
    world, argv = documented_commands()[name]
    pub = PUBLISHED[name]
    assert world == pub["world"]
    argv = list(argv)
    argv[argv.index("--input_dir") + 1] = str(tmp_path)  # paths must exist for validate()
    if "--init_checkpoint" in argv:  # phase 2 starts from phase 1's run directory
        (tmp_path / "p1" / "checkpoints").mkdir(parents=True)
        argv[argv.index("--init_checkpoint") + 1] = str(tmp_path / "p1")
    expanded, recipe = expand_recipe(argv)
    assert recipe == name
    cfg = parse_settings(BertSettings, expanded)
    train_cfg, args = cfg.train, cfg.model
    ds = ds_config_for(train_cfg, world)
    check_recipe_batch(recipe, Batch.of(ds, world))
    opt = for_preset(cfg.optim, args.preset, args.phase)
    assert (args.preset, args.phase) == (pub["preset"], pub["phase"])
    assert ds["train_batch_size"] == pub["train_batch_size"]
    assert ds["train_micro_batch_size_per_gpu"] == pub["micro"] and ds["gradient_accumulation_steps"] == pub["accum"]
    assert (train_cfg.max_steps, train_cfg.seed, train_cfg.num_steps_per_checkpoint) == (pub["max_steps"], 12439, 200)
    for key in ("optimizer", "learning_rate", "beta1", "beta2", "eps", "weight_decay", "bias_correction_lag",
                "lr_scheduler_type", "warmup_ratio", "constant_proportion", "poly_degree",
                "scale_lr_with_global_batch"):
        assert getattr(opt, key) == pub[key], key
    if opt.optimizer == "lamb":
        assert opt.max_grad_norm == pub["max_grad_norm"]
    if pub["zero_stage"] is not None:
        assert ds["zero_optimization"]["stage"] == pub["zero_stage"]
        # the published DeepSpeed clip, done by the optimizer here (the JSON's gradient_clipping 0): same threshold
        assert (ds["gradient_clipping"] or opt.max_grad_norm) == pub["gradient_clipping"]


def test_a_recipe_refuses_another_global_batch_naming_the_fix(tmp_path):
    argv, name = expand_recipe(["--recipe=habana_1p5b_8n", "--input_dir", str(tmp_path)])
    train_cfg = parse_settings(BertSettings, argv).train
    with pytest.raises(ConfigError, match=r"12288 .*this run's is 3072 .*--gradient_accumulation_steps 24"):
        check_recipe_batch(name, Batch.of(ds_config_for(train_cfg, 16), 16))
    with pytest.raises(ConfigError, match=re.escape("--recipe 'nvidia': unknown")):
        expand_recipe(["--recipe", "nvidia"])
    # a flag given with the recipe wins
    argv, _ = expand_recipe(["--max_steps", "10", "--recipe", "nvidia_large_p1", "--input_dir", str(tmp_path)])
    assert parse_settings(BertSettings, argv).train.max_steps == 10
