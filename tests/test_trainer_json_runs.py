"""transformers' own tests/deepspeed bf16 JSONs, unchanged (tests/data/trainer_ds_configs), train BridgeTower's debug
preset on 2 CPU ranks with the values Trainer fills, started as Trainer users start it: `torchrun ... --deepspeed
--deepspeed_config X` (DeepSpeed's tutorial form) for ZeRO-2, `--deepspeed X.json` under the toolkit's starter for
ZeRO-3. The JSONs' optimizer (AdamW), WarmupLR scheduler and CPU offload of the optimizer (and, ZeRO-3, of the
parameters) run as DeepSpeed builds them; the run writes a model card, and `ds-ckpt export-hf` of its last
checkpoint writes the same files as the run's own export."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, dist_env, environment_kept, free_port, run_deepspeed, run_group
from test_bt_train import make_caption_set

pytestmark = [pytest.mark.slow, pytest.mark.stack]

DATA = REPO / "tests" / "data" / "trainer_ds_configs" / "transformers"
STEPS, MICRO, LR, WARMUP_RATIO = 8, 4, 1e-3, 0.25
FLAGS = ["--do_train", "--do_eval", "--missing_splits", "fractions", "--max_steps", str(STEPS),
         "--per_device_train_batch_size", str(MICRO), "--learning_rate", str(LR), "--warmup_ratio", str(WARMUP_RATIO),
         "--max_seq_length", "16", "--eval_strategy", "steps", "--eval_steps", "4", "--dataloader_num_workers", "0",
         "--progress_bar", "false", "--throughput_warmup_steps", "2", "--bf16"]


def torchrun(module_args: list[str], nproc: int = 2, timeout: float = 600):
    """`torchrun --nproc_per_node N -m MODULE ARGS` (python -m torch.distributed.run), 1 thread per rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), *module_args]
    proc = run_group(cmd, timeout=timeout, env=dist_env())
    assert proc.returncode == 0, proc.stdout[-8000:]
    return proc


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def captions(tmp_path_factory) -> Path:
    return make_caption_set(tmp_path_factory.mktemp("captions"), n=48)


@pytest.fixture(scope="module")
def zero2_run(captions, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("zero2") / "bt-zero2"
    torchrun(["-m", "bridgetower_ds.train", "--deepspeed", "--deepspeed_config",
              str(DATA / "ds_config_zero2_bf16.json"), "--dataset_path", str(captions), "--output_dir", str(run),
              *FLAGS])
    return run


def trainer_fill(name: str, world: int, total_steps: int) -> dict:
    """What Trainer fills in the JSON for FLAGS: TrainingArguments of the same flags (HfTrainerDeepSpeedConfig's
    trainer_config_process, one process: world size 1, so train_batch_size scaled to `world`), then its
    trainer_config_finalize with the model and the run's optimizer steps."""
    import dataclasses

    from transformers import TrainingArguments
    from transformers.integrations import deepspeed as hf_ds

    from bridgetower_ds.configs import debug

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    warm = {"warmup_ratio" if "warmup_ratio" in fields else "warmup_steps": WARMUP_RATIO}
    before = hf_ds._hf_deepspeed_config_weak_ref
    with environment_kept():  # 4.x's TrainingArguments(deepspeed=...) sets ACCELERATE_USE_DEEPSPEED
        try:
            args = TrainingArguments(output_dir="unused", deepspeed=str(DATA / name), use_cpu=True, report_to="none",
                                     per_device_train_batch_size=MICRO, learning_rate=LR, bf16=True, max_steps=STEPS,
                                     **warm)
            hf = args.hf_deepspeed_config
            hf.trainer_config_finalize(args, SimpleNamespace(config=debug()), total_steps)
            cfg = hf.config
        finally:
            hf_ds._hf_deepspeed_config_weak_ref = before
    cfg["train_batch_size"] *= world
    return cfg


def assert_filled_as_trainer(run: Path, name: str) -> dict:
    from ds_core.config.trainer_json import auto_keys, value_at

    ran = json.loads((run / "ds_config.json").read_text())
    assert auto_keys(ran) == []  # the resolved JSON of the run directory has no "auto" left
    raw = json.loads((DATA / name).read_text())
    reference = trainer_fill(name, world=2, total_steps=STEPS)
    filled = [k for k in auto_keys(raw) if not k.startswith("bfloat16.")]  # accelerate's: tested on its own
    assert filled and {k: value_at(ran, k) for k in filled} == {k: value_at(reference, k) for k in filled}
    return ran


def test_zero2_bf16_json_trains_with_the_values_trainer_fills(zero2_run):
    ran = assert_filled_as_trainer(zero2_run, "ds_config_zero2_bf16.json")
    assert (ran["train_micro_batch_size_per_gpu"], ran["train_batch_size"]) == (MICRO, 2 * MICRO)
    assert ran["zero_optimization"]["offload_optimizer"]["device"] == "cpu"  # DeepSpeed's CPU Adam steps it
    recs = records(zero2_run)
    summary = [r for r in recs if r["type"] == "summary"][-1]
    assert (summary["world_size"], summary["steps"], summary["zero_stage"]) == (2, STEPS, 2)
    # the JSON's WarmupLR, as DeepSpeed builds it: below the peak during warm-up, at the peak after it
    warm = max(1, math.ceil(WARMUP_RATIO * STEPS))
    lrs = [r["lr"] for r in recs if r["type"] == "step"]
    assert all(lr < LR for lr in lrs[:warm]) and lrs[warm:] == pytest.approx([LR] * (STEPS - warm)), lrs
    assert all(math.isfinite(r["loss"]) for r in recs if r["type"] == "step")


def test_the_run_writes_a_model_card_with_its_settings_and_results(zero2_run):
    from huggingface_hub import ModelCard

    card = ModelCard.load(str(zero2_run / "README.md"))
    assert "deepspeed" in card.data.tags and card.data.library_name == "transformers"
    text = card.text
    for line in (f"- learning_rate: {LR}", f"- train_batch_size: {MICRO}", "- num_devices: 2",
                 f"- total_train_batch_size: {2 * MICRO}", "- distributed_type: DeepSpeed ZeRO-2",
                 f"- training_steps: {STEPS}", "- optimizer: AdamW (DeepSpeed)", "- lr_scheduler_type: WarmupLR"):
        assert line in text, (line, text)
    final = json.loads((zero2_run / "eval_results.json").read_text())
    assert f"- Loss: {final['eval_loss']:.4f}" in text  # the evaluation set's results, as Trainer lists them
    table = [ln for ln in text.splitlines() if ln.startswith("| ") and "Validation Loss" not in ln]
    assert len(table) == 2  # one row per evaluation (steps 4 and 8)


def test_export_hf_of_the_last_checkpoint_writes_what_the_run_exported(zero2_run, tmp_path):
    """`ds-ckpt export-hf` (fp32 masters of the checkpoint, zero_to_fp32) and the run's own export (fp32 masters of the
    engine) through the one save_pretrained writer: the same files, safetensors, the same tensors bit for bit."""
    from safetensors.torch import load_file

    from ds_tools.ckpt_cli import main

    assert main(["export-hf", str(zero2_run), str(tmp_path / "hf")]) == 0
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert names == {"model.safetensors", "config.json"} and not (zero2_run / "pytorch_model.bin").exists()
    ours, run = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(zero2_run / "model.safetensors"))
    assert set(ours) == set(run)
    # a frozen weight (BridgeTower's text pooler): DeepSpeed's checkpoint keeps it in the bf16 the module computed in
    # (zero_to_fp32 upcasts that), the run's export the fp32 value it was initialised with (keep_frozen_fp32)
    from bridgetower_ds.configs import ModelArgs
    from bridgetower_ds.model import build_model

    frozen = {n for n, p in build_model(ModelArgs(preset="debug")).named_parameters() if not p.requires_grad}
    assert frozen and frozen <= set(run)
    differ = [k for k in run if not torch.equal(ours[k], run[k] if k not in frozen else run[k].bfloat16().float())]
    assert not differ, differ
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == json.loads((zero2_run / "config.json").read_text())


def test_zero3_bf16_json_trains_with_trainers_sizes_from_the_hidden_size(captions, tmp_path):
    """`--deepspeed X.json` under the toolkit's starter: ZeRO-3 with parameters and optimizer offloaded to the CPU;
    reduce_bucket_size, stage3_prefetch_bucket_size and stage3_param_persistence_threshold from the model config's
    hidden size by Trainer's rule."""
    from bridgetower_ds.configs import debug

    run = tmp_path / "bt-zero3"
    run_deepspeed(["--module", "bridgetower_ds.train", "--deepspeed", str(DATA / "ds_config_zero3_bf16.json"),
                   "--dataset_path", str(captions), "--output_dir", str(run), "--save_final_checkpoint", "false",
                   *FLAGS])
    ran = assert_filled_as_trainer(run, "ds_config_zero3_bf16.json")
    hidden = debug().hidden_size
    zero = ran["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (hidden ** 2, int(0.9 * hidden ** 2), 10 * hidden)
    summary = [r for r in records(run) if r["type"] == "summary"][-1]
    assert (summary["world_size"], summary["steps"], summary["zero_stage"]) == (2, STEPS, 3)
