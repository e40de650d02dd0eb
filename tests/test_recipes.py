"""Each `--recipe` command of docs/bert_pretraining.md resolves to the published run's settings, and the doc's BERT-1.5B
table says what the references and each of our commands give.

The published values below are written from the references themselves, not from bert_ref.recipes:
  NVIDIA/DeepLearningExamples 7a4c42501ce05ac5b76999e3b9ddadeffd177b1d PyTorch/LanguageModeling/BERT:
    scripts/run_pretraining.sh lines 17-35 (defaults: train_batch_size 8192 / 4096 per GPU, 8 GPUs, accumulation
    128 / 512, lr 6e-3 / 4e-3, warm-up 0.2843 / 0.128, steps 7038 / 1563, seed 12439, checkpoint every 200);
    run_pretraining.py lines 376-387 (weight decay 0.01 but bias/LayerNorm, FusedLAMB(lr) with apex's defaults
    betas (0.9, 0.999), eps 1e-6, max_grad_norm 1.0; PolyWarmUpScheduler default degree 0.5, no constant phase).
  HabanaAI/Model-References PyTorch/nlp/DeepSpeedExamples/deepspeed-bert: tests/data/habana_bert_1p5b.json holds what
    scripts/run_bert_1.5b_8x.sh, scripts/deepspeed_config_bert_1.5b.json, run_pretraining.py, lans.py and
    scripts/bert_1.5b_config.json set, with the commit they were read at; scripts/run_bert_1.5b_32x.sh (last version
    at 59a69770ac86f7065b2c5954b13cdf5cb9d1dfd8) runs the same flags on HL_NUM_NODES nodes x 8.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from bert_ref.configs import BertSettings
from bert_ref.optim import for_preset
from bert_ref.recipes import RECIPES, check_recipe_batch, expand_recipe
from bert_ref.train import COMPILE_AUTO_ON
from ds_core.config import Batch, ds_config_for, parse_settings
from ds_core.errors import ConfigError
from ds_core.rank.compile import compile_wanted

DOC = Path(__file__).resolve().parents[1] / "docs" / "bert_pretraining.md"

_LAMB = dict(optimizer="lamb", beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, max_grad_norm=1.0,
             bias_correction_lag=False, lr_scheduler_type="nvidia_poly", constant_proportion=0.0, poly_degree=0.5,
             scale_lr_with_global_batch=False)
HABANA = json.loads((Path(__file__).resolve().parent / "data" / "habana_bert_1p5b.json").read_text())
_FILES = HABANA["files"]
_SCRIPT, _JSON = _FILES["scripts/run_bert_1.5b_8x.sh"], _FILES["scripts/deepspeed_config_bert_1.5b.json"]
_RUN, _LANS_PY = _FILES["run_pretraining.py"], _FILES["lans.py"]
_LANS = dict(optimizer=_SCRIPT["optimizer"], beta1=_LANS_PY["betas"][0], beta2=_LANS_PY["betas"][1],
             eps=_RUN["lans_eps"], weight_decay=_RUN["weight_decay"],
             bias_correction_lag=True,  # adjust_step: ZeRO stage 1 > 0
             lr_scheduler_type="habana_poly", warmup_ratio=_SCRIPT["WARMUP"],
             constant_proportion=_SCRIPT["CONST"], poly_degree=_SCRIPT["scheduler_degree"],
             learning_rate=_SCRIPT["LR"], scale_lr_with_global_batch=False)


def _habana(nodes: int) -> dict:
    world, micro = nodes * _SCRIPT["NGPU_PER_NODE"], _JSON["train_micro_batch_size_per_gpu"]
    return dict(_LANS, preset="bert_1p5b", phase=1, world=world, train_batch_size=_JSON["train_batch_size"],
                accum=_JSON["train_batch_size"] // (micro * world), micro=micro, max_steps=_SCRIPT["MAX_STEPS"],
                seed=_SCRIPT["seed"], zero_stage=_JSON["zero_stage"], gradient_clipping=_JSON["gradient_clipping"])


PUBLISHED = {
    "nvidia_large_p1": dict(_LAMB, preset="bert_large", phase=1, world=8, train_batch_size=8192 * 8, accum=128,
                            micro=8192 // 128, learning_rate=6e-3, warmup_ratio=0.2843, max_steps=7038,
                            seed=12439, zero_stage=None, gradient_clipping=None),
    "nvidia_large_p2": dict(_LAMB, preset="bert_large", phase=2, world=8, train_batch_size=4096 * 8, accum=512,
                            micro=4096 // 512, learning_rate=4e-3, warmup_ratio=0.128, max_steps=1563,
                            seed=12439, zero_stage=None, gradient_clipping=None),
    "habana_1p5b_8x": _habana(1), "habana_1p5b_8n": _habana(8), "habana_1p5b_16n": _habana(16),
}


def doc_commands(marker: str = "--recipe") -> list[tuple[int, list[str]]]:
    """(world size from the launcher flags, the module's argv) for each `deepspeed ... --module bert_ref.train` command
    of the doc whose line holds `marker`, in the doc's order."""
    text = DOC.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if marker not in line or not line.startswith("deepspeed ") or "--module bert_ref.train" not in line:
            continue
        argv = shlex.split(line)
        launcher, module = argv[:argv.index("--module")], argv[argv.index("--module") + 2:]
        flag = lambda name: int(launcher[launcher.index(name) + 1]) if name in launcher else 1  # noqa: E731
        out.append((flag("--num_nodes") * flag("--num_gpus"), module))
    return out


def documented_commands() -> dict[str, tuple[int, list[str]]]:
    """recipe -> (world size, argv) of its first `--recipe` command in the doc."""
    out: dict[str, tuple[int, list[str]]] = {}
    for world, argv in doc_commands():
        out.setdefault(argv[argv.index("--recipe") + 1], (world, argv))
    return out


def resolved(argv: list[str], world: int, tmp_path: Path) -> tuple:
    """(train settings, model settings, optimizer settings, DeepSpeed config) of a documented command on `world`
    ranks, as bert_ref.train resolves them before any rank starts (the recipe's batch checked too)."""
    import dataclasses

    import bert_ref.train

    argv = list(argv)
    argv[argv.index("--input_dir") + 1] = str(tmp_path)  # paths must exist for validate()
    if "--init_checkpoint" in argv:  # phase 2 starts from phase 1's run directory
        (tmp_path / "p1" / "checkpoints").mkdir(parents=True, exist_ok=True)
        argv[argv.index("--init_checkpoint") + 1] = str(tmp_path / "p1")
    expanded, _ = expand_recipe(argv)
    cfg = parse_settings(BertSettings, expanded)
    train_cfg = dataclasses.replace(cfg.train, deepspeed_config=cfg.train.deepspeed_config
                                    or bert_ref.train.default_ds_config(cfg))
    ds = ds_config_for(train_cfg, world, "hpu")  # bf16, as on the references' accelerators
    check_recipe_batch(cfg.model.recipe, Batch.of(ds, world))
    return train_cfg, cfg.model, for_preset(cfg.optim, cfg.model.preset, cfg.model.phase), ds


def test_every_recipe_is_documented():
    assert sorted(documented_commands()) == sorted(RECIPES) == sorted(PUBLISHED)


@pytest.mark.stack  # the docs' commands as written resolve on each stack
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_documented_command_resolves_to_the_published_settings(name, tmp_path):
    world, argv = documented_commands()[name]
    pub = PUBLISHED[name]
    assert world == pub["world"]
    train_cfg, args, opt, ds = resolved(argv, world, tmp_path)
    assert args.recipe == name
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
        assert ds["gradient_clipping"] == 0 and opt.max_grad_norm == pub["gradient_clipping"]
        assert ds["bf16"]["enabled"] is _JSON["bf16"]


def _table() -> dict[str, list[str]]:
    """The doc's BERT-1.5B table: setting -> the first `value` of each column (Habana, the recipe, the preset alone)."""
    text = DOC.read_text()
    body = text[text.index("## BERT-1.5B: the published recipe"):text.index("## Single node")]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = [re.match(r"`([^`]*)`", c).group(1) for c in cells[1:]]
    return rows


def _row_values(train_cfg, args, opt, ds) -> dict[str, str]:
    """Our resolved settings in the table's spelling."""
    from bert_ref.configs import get_preset

    p = get_preset(args.preset, args.phase)
    return {"model": f"{p.num_hidden_layers} x {p.hidden_size}, {p.num_attention_heads} heads, FFN "
                     f"{p.intermediate_size}, {'Pre-LN' if p.pre_ln else 'Post-LN'}",
            "train_batch_size": str(ds["train_batch_size"]),
            "train_micro_batch_size_per_gpu": str(ds["train_micro_batch_size_per_gpu"]),
            "gradient_accumulation_steps": str(ds["gradient_accumulation_steps"]),
            "zero_stage": str(ds["zero_optimization"]["stage"]), "bf16": str(ds["bf16"]["enabled"]).lower(),
            "clip_at": str(ds["gradient_clipping"] or opt.max_grad_norm), "optimizer": opt.optimizer,
            "learning_rate": str(opt.learning_rate), "betas": f"{opt.beta1}, {opt.beta2}", "eps": str(opt.eps),
            "weight_decay": str(opt.weight_decay), "bias_correction_lag": str(opt.bias_correction_lag).lower(),
            "lr_schedule": opt.lr_scheduler_type, "warmup_proportion": str(opt.warmup_ratio),
            "constant_proportion": f"{opt.constant_proportion:g}", "poly_degree": str(opt.poly_degree),
            "max_steps": str(train_cfg.max_steps), "seed": str(train_cfg.seed),
            "num_steps_per_checkpoint": str(train_cfg.num_steps_per_checkpoint),
            "activation_checkpointing": str(args.activation_checkpointing).lower(),
            "sequence": f"{p.seq_len} / {p.max_predictions_per_seq}",
            "compile_on_gaudi": str(compile_wanted(train_cfg.compile, "hpu", COMPILE_AUTO_ON)).lower()}


def _habana_values() -> dict[str, str]:
    """The references' values in the table's spelling, from tests/data/habana_bert_1p5b.json."""
    m, run = HABANA["files"]["scripts/bert_1.5b_config.json"], _habana(1)
    return {"model": f"{m['num_hidden_layers']} x {m['hidden_size']}, {m['num_attention_heads']} heads, FFN "
                     f"{m['intermediate_size']}, {'Pre-LN' if m['layer_norm_large_model'] else 'Post-LN'}",
            "train_batch_size": str(run["train_batch_size"]), "train_micro_batch_size_per_gpu": str(run["micro"]),
            "gradient_accumulation_steps": str(run["accum"]), "zero_stage": str(run["zero_stage"]),
            "bf16": str(_JSON["bf16"]).lower(), "clip_at": str(_JSON["gradient_clipping"]),
            "optimizer": run["optimizer"], "learning_rate": str(run["learning_rate"]),
            "betas": f"{run['beta1']}, {run['beta2']}", "eps": str(run["eps"]),
            "weight_decay": str(run["weight_decay"]),
            "bias_correction_lag": "true", "lr_schedule": run["lr_scheduler_type"],
            "warmup_proportion": str(run["warmup_ratio"]), "constant_proportion": str(run["constant_proportion"]),
            "poly_degree": str(run["poly_degree"]), "max_steps": str(run["max_steps"]), "seed": str(run["seed"]),
            "num_steps_per_checkpoint": str(_SCRIPT["NUM_STEPS_PER_CP"]),
            "activation_checkpointing": str(_SCRIPT["checkpoint_activations"]).lower(),
            "sequence": f"{_SCRIPT['MAX_SEQ_LENGTH']} / {_SCRIPT['MAX_PRED']}",
            "compile_on_gaudi": str(_SCRIPT["enable_torch_compile"]).lower()}


def test_the_1p5b_table_is_what_the_references_and_our_commands_give(tmp_path):
    """Every row of the doc's BERT-1.5B table: Habana's column is the reference files' value, the recipe's column what
    the doc's `--recipe habana_1p5b_8x` command resolves to on 8 ranks (and the doc's spelt-out command too), the last
    column what `--preset bert_1p5b` alone resolves to."""
    table = _table()
    habana = _habana_values()
    world, recipe_argv = documented_commands()["habana_1p5b_8x"]
    recipe = _row_values(*resolved(recipe_argv, world, tmp_path))
    spelt = [(w, a) for w, a in doc_commands("--preset bert_1p5b ") if "--recipe" not in a]
    assert len(spelt) == 1, spelt
    assert _row_values(*resolved(spelt[0][1], spelt[0][0], tmp_path)) == recipe  # the same run, spelt out
    preset = _row_values(*resolved(["--preset", "bert_1p5b", "--input_dir", "x"], 8, tmp_path))
    assert set(table) == set(habana) == set(recipe)
    for key, (doc_habana, doc_recipe, doc_preset) in table.items():
        assert doc_habana == habana[key], (key, doc_habana, habana[key])
        assert doc_recipe == recipe[key], (key, doc_recipe, recipe[key])
        assert doc_preset == preset[key], (key, doc_preset, preset[key])
    assert recipe == {**habana}  # the recipe is the published run, row by row


def test_a_smaller_micro_batch_keeps_the_published_global_batch(tmp_path):
    """The doc's 32 GB form of the recipe: micro batch 16, Habana's 12288 sequences per step kept (accumulation 96)."""
    (world, argv), = [(w, a) for w, a in doc_commands("--micro_batch_size 16")]
    _, args, opt, ds = resolved(argv, world, tmp_path)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == \
        (12288, 16, 96)
    assert (args.recipe, opt.learning_rate) == ("habana_1p5b_8x", 0.0015)


def test_a_recipe_refuses_another_global_batch_naming_the_fix(tmp_path):
    argv, name = expand_recipe(["--recipe=nvidia_large_p1", "--input_dir", str(tmp_path)])
    cfg = parse_settings(BertSettings, argv)
    assert cfg.model.recipe == name == "nvidia_large_p1"  # the run records its recipe
    with pytest.raises(ConfigError, match=r"65536 .*this run's is 131072 .*--gradient_accumulation_steps 64"):
        check_recipe_batch(name, Batch.of(ds_config_for(cfg.train, 16, "hpu"), 16))
    with pytest.raises(ConfigError, match=re.escape("--recipe 'nvidia': unknown")):
        expand_recipe(["--recipe", "nvidia"])
    with pytest.raises(ConfigError, match=re.escape("--recipe 'nvidia': unknown")):
        parse_settings(BertSettings, ["--recipe", "nvidia", "--input_dir", str(tmp_path)])  # e.g. from --config
    # a flag given with the recipe wins
    argv, _ = expand_recipe(["--max_steps", "10", "--recipe", "nvidia_large_p1", "--input_dir", str(tmp_path)])
    assert parse_settings(BertSettings, argv).train.max_steps == 10
