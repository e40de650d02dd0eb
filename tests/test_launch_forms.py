"""The launch lines users come with, on every entry point: DeepSpeed's tutorial form (`--deepspeed` switch beside
`--deepspeed_config X`) and transformers' (`--deepspeed X.json`); a 2-rank CPU `torchrun` run of BERT (BridgeTower's:
tests/test_trainer_json_runs.py); `accelerate launch` with its DeepSpeed plugin's JSON, or refused in one line saying
what to run instead; `--report_to` backends checked before any process group ("all": every installed one, as
Trainer); `--resume_from_checkpoint` in bert_ref; BERT's model card and `ds-ckpt export-hf` of its tied weights."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, dist_env, free_port, run_group
from ds_core.errors import ConfigError

DATA = REPO / "tests" / "data" / "trainer_ds_configs" / "optimum_habana"
# the two models' entry points, and ds_core's parser that any entry point of start_run goes through
ENTRY_POINTS = ("bert_ref.train", "bridgetower_ds.train", "ds_core.run.setup.LoopSettings")


def _settings(module: str, argv: list[str]):
    """The parsed settings of an entry point (its own parser: the flags exactly as its main reads them)."""
    from ds_core.config import TrainConfig, parse_settings
    from ds_core.run.setup import LoopSettings

    if module == "bert_ref.train":
        from bert_ref.configs import BertSettings as tree
    elif module == "bridgetower_ds.train":
        from bridgetower_ds.configs import BridgeTowerSettings as tree
    else:
        tree = LoopSettings
    cfg = parse_settings(tree, argv)
    assert isinstance(cfg.train, TrainConfig)
    return cfg


@pytest.mark.parametrize("module", ENTRY_POINTS)
@pytest.mark.parametrize("argv", [["--deepspeed", "--deepspeed_config", "x.json"], ["--deepspeed_config", "x.json",
                                                                                     "--deepspeed"],
                                  ["--deepspeed", "x.json"], ["--deepspeed=x.json"]])
def test_deepspeeds_switch_and_transformers_path_name_the_json(module, argv, tmp_path):
    extra = ["--input_dir", str(tmp_path)] if module == "bert_ref.train" else []
    assert _settings(module, argv + extra).train.deepspeed_config == "x.json"


def test_the_starters_read_the_json_of_either_form():
    import ds_configs
    from ds_core.config.ds_json import ds_config_in

    for args in (["--deepspeed", "--deepspeed_config", "a.json"], ["--deepspeed", "a.json"]):
        assert ds_config_in(args) == "a.json"
        assert ds_configs.json_for_args("bert_ref.train", args)[0] == "a.json"
    assert ds_config_in(["--deepspeed", "--preset", "debug"]) == ""  # the switch alone names no file


def test_accelerate_launch_environment_becomes_flags_or_is_refused():
    from ds_core.config.launch_forms import from_accelerate

    plugin = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json",
              "ACCELERATE_MIXED_PRECISION": "bf16"}
    assert from_accelerate(["--x"], plugin) == ["--x", "--deepspeed_config", "ds.json", "--precision", "bf16"]
    assert from_accelerate(["--deepspeed", "ds.json", "--bf16"], plugin) == ["--deepspeed", "ds.json", "--bf16"]
    assert from_accelerate(["--x"], {}) == ["--x"]  # not accelerate's DeepSpeed plugin: nothing to read
    for env, said in (({**plugin, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ""}, "without a deepspeed_config_file"),
                      ({**plugin, "ACCELERATE_MIXED_PRECISION": "fp16"}, "--mixed_precision fp16: refused"),
                      (plugin, "two DeepSpeed JSONs")):
        with pytest.raises(ConfigError, match=said) as e:
            from_accelerate(["--deepspeed_config", "other.json"] if said.startswith("two") else [], env)
        assert len(str(e.value).splitlines()) == 1
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node N -m <module>"):
        from_accelerate([], {**plugin, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ""})


def test_report_to_a_backend_not_installed_is_refused_before_any_process_group(tmp_path, monkeypatch):
    import importlib.util

    import torch.distributed as dist

    from bert_ref.train import main as bert_main
    from bridgetower_ds.train import main as bt_main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="--report_to wandb: the wandb package is not installed"):
        bert_main(["--preset", "debug", "--input_dir", str(tmp_path), "--report_to", "wandb"])
    (tmp_path / "t.csv").write_text("image,caption\na.jpg,a\n")
    with pytest.raises(ConfigError, match="--report_to wandb: the wandb package is not installed"):
        bt_main(["--do_train", "--train_file", str(tmp_path / "t.csv"), "--report_to", "tensorboard,wandb"])
    assert not dist.is_initialized()


def test_report_to_all_is_every_installed_backend_as_trainer(monkeypatch):
    """Trainer's "all" is transformers.integrations.get_available_reporting_integrations(): each one DeepSpeed has a
    monitor for is turned on, the others named in one line."""
    import transformers.integrations as integrations

    from ds_core.outputs import monitors

    monkeypatch.setattr(integrations, "get_available_reporting_integrations",
                        lambda: ["comet_ml", "mlflow", "tensorboard", "wandb"])
    assert monitors.report_to_names("all") == ["comet", "tensorboard", "wandb"]
    assert monitors.report_to_notices("all") == ["--report_to all: comet, tensorboard, wandb; installed but without a "
                                                 "DeepSpeed monitor: mlflow"]
    ds: dict = {}
    monitors.apply_report_to("all", ds, "run", job_name="x")
    assert ds["tensorboard"]["enabled"] and ds["wandb"] == {"enabled": True} and ds["comet"] == {"enabled": True}


def test_bert_takes_resume_from_checkpoint_as_trainer_spells_it(tmp_path):
    from bert_ref.configs import BertSettings
    from bert_ref.train import resolve
    from ds_core.config import parse_settings

    run = tmp_path / "run"
    for step in (2, 4):
        (run / "checkpoints" / f"global_step{step}").mkdir(parents=True)
        (run / "checkpoints" / f"global_step{step}" / "COMPLETE").write_text("{}")
    (run / "checkpoints" / "latest").write_text("global_step4")
    base = ["--preset", "debug", "--input_dir", str(tmp_path), "--run_dir", str(run)]
    for given in ([], ["True"], ["latest"], [str(run)], [str(run / "checkpoints" / "global_step4")]):
        cfg, _ = resolve(parse_settings(BertSettings, base + ["--resume_from_checkpoint", *given]))
        assert cfg.train.resume, given
    with pytest.raises(ConfigError, match="step 2 is not the newest complete checkpoint"):
        resolve(parse_settings(BertSettings, base + ["--resume_from_checkpoint",
                                                     str(run / "checkpoints" / "global_step2")]))
    assert not resolve(parse_settings(BertSettings, base))[0].train.resume


# ------------------------------------------------------------------------------------------------- real launches
STEPS = 6


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    from test_launch_multinode import make_data

    return make_data(tmp_path_factory.mktemp("bert_data"))


def _bert_args(shards: Path, run: Path, *extra: str) -> list[str]:
    return ["--preset", "debug", "--input_dir", str(shards), "--run_dir", str(run), "--max_steps", str(STEPS),
            "--progress_bar", "false", "--precision", "bf16", "--throughput_warmup_steps", "2", *extra]


@pytest.fixture(scope="module")
def bert_torchrun(shards, tmp_path_factory) -> tuple[Path, str]:
    """`torchrun --nproc_per_node 2 -m bert_ref.train --deepspeed <optimum-habana's deepspeed_zero_2.json>`, as
    docs/settings.md documents it; a Trainer-style JSON (its batch sizes "auto")."""
    run = tmp_path_factory.mktemp("bert_torchrun") / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "bert_ref.train", *_bert_args(shards, run, "--deepspeed", str(DATA / "deepspeed_zero_2.json"),
                                               "--per_device_train_batch_size", "4")]
    proc = run_group(cmd, timeout=600, env=dist_env())
    assert proc.returncode == 0, proc.stdout[-8000:]
    return run, proc.stdout


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.each_gaudi
def test_torchrun_trains_bert_on_two_ranks_with_a_trainer_style_json(bert_torchrun):
    run, _ = bert_torchrun
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = [r for r in records if r["type"] == "summary"][-1]
    assert (summary["world_size"], summary["steps"], summary["zero_stage"]) == (2, STEPS, 2)
    ran = json.loads((run / "ds_config.json").read_text())
    # the flag fills the JSON's "auto"; its fixed clipping (1.0) stays; accumulation: Trainer's default
    assert (ran["train_micro_batch_size_per_gpu"], ran["gradient_accumulation_steps"], ran["train_batch_size"],
            ran["gradient_clipping"]) == (4, 1, 8, 1.0)


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.each_gaudi
def test_bert_writes_a_model_card_and_export_hf_writes_its_tied_weights_as_the_run(bert_torchrun, tmp_path):
    """The run's hf_model has a model card; `ds-ckpt export-hf` of the last checkpoint writes, through the same
    save_pretrained writer, the same files and tensor names (the MLM decoder tied to the word embeddings, written
    once), its fp32 master weights rounding to the run's bf16 export, and from_pretrained ties them again."""
    from huggingface_hub import ModelCard
    from safetensors.torch import load_file
    from transformers import BertForPreTraining

    from ds_tools.ckpt_cli import main

    run, _ = bert_torchrun
    card = ModelCard.load(str(run / "hf_model" / "README.md"))
    assert "- num_devices: 2" in card.text and "- optimizer: NVLAMB" in card.text and "DeepSpeed ZeRO-2" in card.text
    assert main(["export-hf", str(run), str(tmp_path / "hf")]) == 0
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {"model.safetensors", "config.json"}
    ours, exported = load_file(str(tmp_path / "hf" / "model.safetensors")), \
        load_file(str(run / "hf_model" / "model.safetensors"))
    assert set(ours) == set(exported) and "cls.predictions.decoder.weight" not in ours
    assert {t.dtype for t in ours.values()} == {torch.float32}
    differ = [k for k in ours if not torch.equal(ours[k].to(exported[k].dtype), exported[k])]
    assert not differ, differ
    model = BertForPreTraining.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert model.cls.predictions.decoder.weight.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()


def _accelerate(tmp_path: Path, plugin: list[str], module_args: list[str]):
    env = dist_env(HF_HOME=str(tmp_path / "hf_home"))  # no accelerate config of the machine's user
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", *plugin, "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(free_port()), "-m", *module_args]
    return run_group(cmd, timeout=600, env=env)


@pytest.mark.slow
@pytest.mark.stack  # accelerate's launcher of each stack (1.7.0 to 1.15)
@pytest.mark.each_gaudi
def test_accelerate_launch_with_its_deepspeed_plugins_json(shards, tmp_path):
    run = tmp_path / "run"
    json_file = str(DATA / "deepspeed_zero_1.json")
    proc = _accelerate(tmp_path, ["--deepspeed_config_file", json_file, "--mixed_precision", "bf16"],
                       ["bert_ref.train", *_bert_args(shards, run)[:-4], "--throughput_warmup_steps", "2"])
    assert proc.returncode == 0, proc.stdout[-8000:]
    settings = json.loads((run / "run_config.json").read_text())["TrainConfig"]
    assert settings["deepspeed_config"] == json_file and settings["precision"] == "bf16"
    ran = json.loads((run / "ds_config.json").read_text())
    assert ran["zero_optimization"]["stage"] == 1 and ran["train_micro_batch_size_per_gpu"] == 8  # Trainer's default
    summary = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert (summary["type"], summary["world_size"], summary["steps"]) == ("summary", 2, STEPS)


@pytest.mark.slow
@pytest.mark.stack  # accelerate's launcher of each stack (1.7.0 to 1.15)
@pytest.mark.each_gaudi
def test_accelerate_launch_without_a_json_is_refused_in_one_line(shards, tmp_path):
    proc = _accelerate(tmp_path, ["--zero_stage", "2"], ["bert_ref.train", *_bert_args(shards, tmp_path / "run")])
    assert proc.returncode != 0
    said = [ln for ln in proc.stdout.splitlines() if "without a deepspeed_config_file" in ln]
    assert len(said) == 1 and "torchrun --nproc_per_node N" in said[0], proc.stdout[-4000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert os.environ.get("ACCELERATE_USE_DEEPSPEED") is None  # nothing leaked into this process
