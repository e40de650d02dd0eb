"""optimum-habana's run_bridgetower.py command line without DeepSpeed: every flag parses into this toolkit's own
settings (aliases, not a second parser), HPU-only flags get a notice, --push_to_hub is refused, unknown flags get a
hint only when one is close; the learning-rate rule against a DeepSpeed JSON; --dataset_name from a local datasets
cache (offline) and the error when it is not there; the image-processor config saved with the model."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bridgetower_ds import optim as bt_optim, trainer_flags
from bridgetower_ds.configs import BridgeTowerSettings, CompatArgs, DataArgs, ModelArgs
from bridgetower_ds.image_processor import image_processor
from conftest import REPO
from ds_core.config import TrainConfig, parse_settings
from ds_core.config.optim import OptimArgs
from ds_core.errors import ConfigError

# optimum-habana examples/contrastive-image-text/README.md, "BridgeTower" (the published Gaudi benchmark), as a user
# pastes it after `run_bridgetower.py`, with the blog's --report_to tensorboard and Trainer flags users add to it;
# --push_to_hub is left out (refused, see below).
PUBLISHED = """--output_dir /tmp/bridgetower-test
  --model_name_or_path BridgeTower/bridgetower-large-itm-mlm-itc
  --dataset_name jmhessel/newyorker_caption_contest --dataset_config_name matching
  --image_column image --caption_column image_description
  --remove_unused_columns=False
  --do_train --do_eval --do_predict
  --per_device_train_batch_size=40 --per_device_eval_batch_size=16
  --num_train_epochs 5
  --learning_rate=1e-5
  --overwrite_output_dir
  --save_strategy no
  --use_habana --use_lazy_mode --use_hpu_graphs_for_inference --gaudi_config_name Habana/clip
  --throughput_warmup_steps 3
  --logging_steps 10
  --dataloader_num_workers 1
  --sdp_on_bf16
  --report_to tensorboard""".split()

EXTRA = ["--gradient_accumulation_steps", "2", "--max_steps", "0", "--weight_decay", "0.01", "--warmup_steps", "0",
         "--warmup_ratio", "0.1", "--lr_scheduler_type", "cosine", "--save_steps", "0", "--save_total_limit", "2",
         "--seed", "7", "--bf16", "--mediapipe_dataloader", "--max_seq_length", "40", "--max_train_samples", "100",
         "--max_eval_samples", "20", "--distribution_strategy", "ddp"]


@pytest.mark.stack  # the command as optimum-habana users write it, on each stack's transformers
@pytest.mark.each_gaudi
def test_published_command_parses_into_the_toolkits_settings():
    cfg = parse_settings(BridgeTowerSettings, PUBLISHED + EXTRA)
    tc, ma, da, ra, oa, ca = cfg.train, cfg.model, cfg.data, cfg.task, cfg.optim, cfg.compat
    assert tc.run_dir == "/tmp/bridgetower-test" and tc.overwrite_run_dir and tc.max_epochs == 5
    assert tc.micro_batch_size == 40 and ra.eval_micro_batch_size == 16 and tc.gradient_accumulation_steps == 2
    assert tc.throughput_warmup_steps == 3 and tc.log_every == 10 and tc.save_total_limit == 2 and tc.seed == 7
    assert tc.precision == "bf16"
    assert ma.model_name_or_path == "BridgeTower/bridgetower-large-itm-mlm-itc"
    assert (da.dataset_name, da.dataset_config_name) == ("jmhessel/newyorker_caption_contest", "matching")
    assert (da.image_column, da.caption_column, da.dataloader_num_workers) == ("image", "image_description", 1)
    assert da.requested_pipeline == "device" and da.max_seq_length == 40
    assert (da.max_train_samples, da.max_eval_samples) == (100, 20)
    assert ra.do_train and ra.do_eval and ra.do_predict
    assert (oa.learning_rate, oa.weight_decay, oa.warmup_ratio, oa.lr_scheduler_type) == (1e-5, 0.01, 0.1, "cosine")
    assert ca.remove_unused_columns is False and ca.report_to == "tensorboard" and ca.save_strategy == "no"
    tc = trainer_flags.check_flags(ca, tc)
    tc, ma, da, _ = trainer_flags.map_flags(ca, tc, ma, da, "bridgetower_zero1_bf16.json")
    notices = trainer_flags.flag_notices(ca)
    assert tc.save_final_checkpoint is False  # --save_strategy no: no checkpoints at all
    assert [n.split(":")[0] for n in notices] == ["--use_habana", "--use_lazy_mode", "--use_hpu_graphs_for_inference",
                                                  "--gaudi_config_name", "--distribution_strategy", "--sdp_on_bf16"]
    assert all(len(n.splitlines()) == 1 for n in notices)


def test_gaudi_trainer_flags_are_taken_as_this_toolkit_does_what_they_ask():
    """GaudiTrainingArguments' own flags (optimum-habana): --torch_compile is --compile on; the ones whose effect
    happens anyway or does not apply are accepted with one line each; fp8 and the profiling steps are refused naming
    what to use (docs/gaudi.md's table)."""
    from bridgetower_ds.configs import GAUDI_TRAINER_NOTICES

    flags = ["--adjust_throughput", "--non_blocking_data_copy", "--pipelining_fwd_bwd",
             "--use_hpu_graphs_for_training", "--use_compiled_autograd", "--torch_compile_backend", "hpu_backend"]
    cfg = parse_settings(BridgeTowerSettings, ["--do_train", "--torch_compile", *flags])
    assert trainer_flags.check_flags(cfg.compat, cfg.train).compile == "on"
    notices = trainer_flags.flag_notices(cfg.compat)
    assert [n.split(":")[0] for n in notices] == [f"--{k}" for k in GAUDI_TRAINER_NOTICES]
    assert all(len(n.splitlines()) == 1 for n in notices)
    for argv, message in ((["--fp8"], "--fp8: refused"), (["--profiling_steps", "3"], "pass --profile_steps N"),
                          (["--torch_compile", "--compile", "off"], "pass one of them")):
        cfg = parse_settings(BridgeTowerSettings, ["--do_train", *argv])
        with pytest.raises(ConfigError, match=message):
            trainer_flags.check_flags(cfg.compat, cfg.train)


def test_push_to_hub_is_refused_with_the_reason():
    cfg = parse_settings(BridgeTowerSettings, ["--push_to_hub", "--hub_model_id", "me/bt", "--do_train"])
    tc, ca = cfg.train, cfg.compat
    with pytest.raises(ConfigError, match="never uploads.*hf upload"):
        trainer_flags.check_flags(ca, tc)
    with pytest.raises(ConfigError, match="save_strategy 'hourly'"):
        trainer_flags.map_flags(CompatArgs(save_strategy="hourly"), TrainConfig(), ModelArgs(), DataArgs(), "")
    with pytest.raises(ConfigError, match="pick one"):
        trainer_flags.map_flags(CompatArgs(save_strategy="no"), TrainConfig(num_steps_per_checkpoint=5), ModelArgs(),
                                DataArgs(), "")


@pytest.mark.parametrize("flag,hint", [
    ("--per_device_train_bach_size", "did you mean '--per_device_train_batch_size'"),
    ("--learning_rte", "did you mean '--learning_rate'"),
    ("--eval_accumulation_steps", "a transformers TrainingArguments flag that this toolkit does not take"),
    ("--hub_token", "a transformers TrainingArguments flag that this toolkit does not take"),
    ("--output_path", None),
    ("--frobnicate", None),
])
def test_unknown_flags_get_a_hint_only_when_close(flag, hint):
    with pytest.raises(ConfigError) as e:
        parse_settings(BridgeTowerSettings, ["--do_train", flag, "1"])
    msg = str(e.value)
    assert f"'{flag}'" in msg
    if hint:
        assert hint in msg
    else:
        assert "did you mean" not in msg and "TrainingArguments" not in msg


def test_learning_rate_rule_against_a_deepspeed_json_optimizer_section():
    section = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0, "betas": [0.9, 0.98]}}}
    # no flag: the JSON's values
    ds = json.loads(json.dumps(section))
    assert bt_optim.resolve_optimizer(OptimArgs(), ds, "X")[:2] == (1e-5, 0.0)
    # a flag wins, says so, and the resolved config holds what is used (betas kept)
    ds = json.loads(json.dumps(section))
    lr, wd, notes = bt_optim.resolve_optimizer(OptimArgs(learning_rate=3e-4, weight_decay=0.01), ds, "X")
    assert (lr, wd) == (3e-4, 0.01) and ds["optimizer"]["params"] == {"lr": 3e-4, "weight_decay": 0.01,
                                                                       "betas": [0.9, 0.98]}
    assert notes == ["--learning_rate 0.0003 replaces X optimizer.params.lr = 1e-05",
                     "--weight_decay 0.01 replaces X optimizer.params.weight_decay = 0.0"]
    # the same value: nothing to say; "auto" (HF's DeepSpeed spelling) takes the flag or Trainer's default
    assert bt_optim.resolve_optimizer(OptimArgs(learning_rate=1e-5), json.loads(json.dumps(section)), "X")[2] == []
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    assert bt_optim.resolve_optimizer(OptimArgs(), ds, "X")[:2] == (5e-5, 0.0)
    assert ds["optimizer"]["params"]["lr"] == 5e-5
    # no optimizer section: the flags, else Trainer's defaults; AdamW is then built in code with decay groups
    assert bt_optim.resolve_optimizer(OptimArgs(), {}, "X")[:2] == (5e-5, 0.0)
    # a "scheduler" section is the schedule DeepSpeed builds (as under Trainer): none of ours beside it
    with_section = {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}}
    decided, notes = bt_optim.decide(OptimArgs(), json.loads(json.dumps(section)), "X")
    assert (decided.learning_rate, decided.weight_decay, decided.eps, decided.lr_scheduler_type, notes) == \
        (1e-5, 0.0, 1e-8, "linear", [])  # the JSON's values, Trainer's defaults for the rest: decided once
    ds = json.loads(json.dumps(section))
    bt_optim.write_decided(decided, ds)  # what adjust_ds_config writes: the decided values, not a second decision
    assert ds["optimizer"]["params"] == {"lr": 1e-5, "weight_decay": 0.0, "betas": [0.9, 0.98]}
    assert "lr_scheduler" not in bt_optim.engine_kwargs(torch.nn.Linear(2, 2), decided, with_section, 10)
    assert "lr_scheduler" in bt_optim.engine_kwargs(torch.nn.Linear(2, 2), decided, {}, 10)
    with pytest.raises(ConfigError, match="lr_scheduler_type"):
        parse_settings(BridgeTowerSettings, ["--do_train", "--lr_scheduler_type", "exponential"])


def test_report_to_turns_on_deepspeeds_monitor(tmp_path):
    ds: dict = {}
    assert trainer_flags.apply_report_to("tensorboard", ds, str(tmp_path)) == []
    assert ds["tensorboard"] == {"enabled": True, "output_path": str(tmp_path / "tensorboard"),
                                 "job_name": "bridgetower"}
    ds = {"csv_monitor": {"enabled": True, "output_path": "mine"}}
    assert "used as it is" in trainer_flags.apply_report_to("csv", ds, str(tmp_path))[0]
    assert ds["csv_monitor"]["output_path"] == "mine"
    assert trainer_flags.apply_report_to("none", ds := {}, "x") == [] and ds == {}
    with pytest.raises(ConfigError, match="mlflow"):
        trainer_flags.apply_report_to("mlflow", {}, "x")


# ------------------------------------------------------------------------------------------------- datasets cache
NEWYORKER_FEATURES = {  # the "matching" configuration's columns (jmhessel/newyorker_caption_contest)
    "image": "image", "contest_number": "int32", "image_location": "string", "image_description": "string",
    "image_uncanny_description": "string", "entities": ["string"], "questions": ["string"],
    "caption_choices": ["string"], "from_description": "string", "label": "string", "n_tokens_label": "int32",
    "instance_id": "string",
}


def make_newyorker_cache(cache: Path, rows: dict[str, int], name: str = "jmhessel/newyorker_caption_contest",
                         config: str = "matching") -> Path:
    """A tiny New-Yorker-schema dataset in a datasets cache, laid out as `datasets.load_dataset(name, config)` leaves
    it after one online call (<cache>/<org>___<name>/<config>/0.0.0/<hash>/<name>-<split>.arrow + dataset_info.json).

    Built with datasets' own Parquet builder, then renamed where a local-files build names things differently from
    a hub build (config id suffix, namespace in the arrow file names)."""
    import datasets
    import numpy as np
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet
    from PIL import Image

    from test_bt_train import COLORS, SHAPES

    feats = datasets.Features({k: datasets.Image() if v == "image" else
                               datasets.Sequence(datasets.Value(v[0])) if isinstance(v, list) else datasets.Value(v)
                               for k, v in NEWYORKER_FEATURES.items()})
    src = cache.parent / f"{cache.name}-parquet"
    src.mkdir(parents=True, exist_ok=True)
    names, rng, files = list(COLORS), np.random.default_rng(1), {}
    for split, n in rows.items():
        recs = []
        for i in range(n):
            fg, bg = rng.choice(len(names), 2, replace=False)
            im = Image.new("RGB", (48, 40), COLORS[names[bg]])
            from PIL import ImageDraw

            ImageDraw.Draw(im).rectangle((10, 6, 38, 34), fill=COLORS[names[fg]])
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=90)
            desc = f"a {names[fg]} {SHAPES[0]} on a {names[bg]} background"
            recs.append(dict(image={"bytes": buf.getvalue(), "path": None}, contest_number=i,
                             image_location="an office", image_description=desc, image_uncanny_description="odd",
                             entities=["https://en.wikipedia.org/wiki/Office"], questions=["why?"],
                             caption_choices=["A", "B", "C", "D", "E"], from_description="scene", label="A",
                             n_tokens_label=1, instance_id=f"{split}-{i}"))
        files[split] = str(src / f"{split}.parquet")
        datasets.Dataset.from_list(recs, features=feats).to_parquet(files[split])
    org, short = name.split("/")
    builder = Parquet(cache_dir=str(cache), dataset_name=f"{org}___{short}", config_name=config, hash="0" * 16,
                      data_files=DataFilesDict.from_patterns({k: [v] for k, v in files.items()}), features=feats)
    builder.download_and_prepare()
    root = cache / f"{org}___{short}"
    (built,) = [d for d in root.iterdir() if d.name.startswith(config)]
    built.rename(root / config)
    for f in (root / config).glob("*/*/*.arrow"):
        f.rename(f.with_name(f.name.replace(f"{org}___", "")))
    shutil.rmtree(src)
    return cache


def _in_subprocess(code: str, cache: Path) -> subprocess.CompletedProcess:
    # a fresh interpreter: datasets reads HF_DATASETS_CACHE when it is imported
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache), PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}")
    env.pop("HF_DATASETS_OFFLINE", None)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)


def test_dataset_name_loads_from_the_local_cache_offline_else_says_how_to_save_it(tmp_path):
    cache = make_newyorker_cache(tmp_path / "hf_datasets", {"train": 12, "validation": 4, "test": 4})
    out = _in_subprocess(
        "from bridgetower_ds.configs import DataArgs\n"
        "from bridgetower_ds.data import load_tables, build_data, select_split, limit_rows\n"
        "a = DataArgs(dataset_name='jmhessel/newyorker_caption_contest', dataset_config_name='matching',\n"
        "             caption_column='image_description', max_eval_samples=3)\n"
        "t = load_tables(a)\n"
        "print('SPLITS', sorted((k, len(v)) for k, v in t.items()))\n"
        "print('CAPTION', t['train'].captions[0])\n"
        "print('BYTES', type(t['train'].load(0)[0]).__name__)\n"
        "print('LIMIT', len(limit_rows(a, 'validation', t['validation'])), len(limit_rows(a, 'test', t['test'])))\n",
        cache)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "SPLITS [('test', 4), ('train', 12), ('validation', 4)]" in out.stdout
    assert "CAPTION a " in out.stdout and "BYTES bytes" in out.stdout and "LIMIT 3 4" in out.stdout
    missing = _in_subprocess(
        "from bridgetower_ds.configs import DataArgs\n"
        "from bridgetower_ds.data import load_tables\n"
        "load_tables(DataArgs(dataset_name='jmhessel/newyorker_caption_contest', dataset_config_name='ranking'))\n",
        cache)
    assert missing.returncode != 0
    assert "not in the local datasets cache" in missing.stdout and "load_dataset('jmhessel/newyorker_caption_contest'" \
        in missing.stdout and "save_to_disk" in missing.stdout, missing.stdout[-3000:]


def test_hub_model_id_resolves_from_the_hub_cache_only(tmp_path, monkeypatch):
    from bridgetower_ds.hub import resolve_pretrained

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_pretrained(str(tmp_path)) == str(tmp_path)  # a directory stays as given
    assert resolve_pretrained("") == ""
    with pytest.raises(FileNotFoundError, match="hf download BridgeTower/bridgetower-large-itm-mlm-itc"):
        resolve_pretrained("BridgeTower/bridgetower-large-itm-mlm-itc")
    # a filled hub cache (what `hf download` leaves) resolves to its snapshot
    snap = tmp_path / "hub" / "models--BridgeTower--bt" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("a" * 40)
    assert Path(resolve_pretrained("BridgeTower/bt")) == snap


@pytest.mark.stack
@pytest.mark.each_gaudi
def test_image_processor_config_is_the_checkpoints_or_the_pipelines(tmp_path):
    from ds_core.compat.hf import bridgetower_image_processor

    def edge(size):  # a SizeDict on transformers 5, a dict on 4.55
        return size["shortest_edge"] if isinstance(size, dict) else size.shortest_edge

    made = image_processor("", 32)
    assert edge(made.size) == 32 and edge(made.crop_size) == 32 and made.size_divisor == 32
    # the published Large checkpoint's preprocessor: shorter side 294, kept as it is
    ckpt = tmp_path / "ckpt"
    bridgetower_image_processor()(size={"shortest_edge": 294}, crop_size={"shortest_edge": 294}).save_pretrained(ckpt)
    assert edge(image_processor(str(ckpt), 294).size) == 294
    with pytest.raises(ConfigError, match="shortest_edge 294 != the model's vision image_size 288"):
        image_processor(str(ckpt), 288)
