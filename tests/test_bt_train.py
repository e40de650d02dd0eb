"""bridgetower_ds.train end to end on a tiny generated image-caption set: 2 ranks with ZeRO-1 and ZeRO-3 (the
shipped DeepSpeed JSONs, learning rate raised), loss falls, eval/predict recall, export, reload, eval-only."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, dist_env, run_deepspeed

COLORS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 220, 40)}
SHAPES = ("circle", "square", "triangle")


def make_caption_set(root: Path, n: int = 96) -> Path:
    """n JPEGs (48 x 40) of a colored shape on a colored background; the caption says which: learnable."""
    import numpy as np
    from PIL import Image, ImageDraw

    root.mkdir(parents=True, exist_ok=True)
    names = list(COLORS)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        fg, bg = rng.choice(len(names), 2, replace=False)
        shape = SHAPES[i % 3]
        im = Image.new("RGB", (48, 40), COLORS[names[bg]])
        d = ImageDraw.Draw(im)
        if shape == "circle":
            d.ellipse((8, 6, 38, 34), fill=COLORS[names[fg]])
        elif shape == "square":
            d.rectangle((10, 6, 38, 34), fill=COLORS[names[fg]])
        else:
            d.polygon([(24, 4), (40, 36), (8, 36)], fill=COLORS[names[fg]])
        im.save(root / f"{i:03d}.jpg", quality=90)
        rows.append({"image": f"{i:03d}.jpg", "caption": f"a {names[fg]} {shape} on a {names[bg]} background"})
    manifest = root / "captions.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def ds_json(tmp: Path, name: str, lr: float = 2e-3) -> Path:
    cfg = json.loads((REPO / "ds_configs" / name).read_text())
    cfg["optimizer"]["params"]["lr"] = lr
    out = tmp / name
    out.write_text(json.dumps(cfg))
    return out


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_loss_falls(recs: list[dict]) -> None:
    """The training loss falls epoch after epoch: the mean over each full epoch (the same rows, reshuffled, so the
    same last smaller batch with fewer negatives) below the one before, over at least 3 epochs. Per-step losses vary
    with each batch's negatives more than a few steps of learning move them, and the random initial weights differ
    between transformers releases (each draws its own init in its own order)."""
    steps = [r for r in recs if r["type"] == "step"]
    by_epoch: dict[int, list[float]] = {}
    for r in steps:
        by_epoch.setdefault(math.ceil(r["epoch"] - 1e-9), []).append(r["loss"])
    full = max(len(v) for v in by_epoch.values())
    means = [sum(v) / len(v) for _, v in sorted(by_epoch.items()) if len(v) == full]
    assert len(means) >= 3 and all(b < a for a, b in zip(means, means[1:])), (means, [r["loss"] for r in steps])


@pytest.fixture(scope="module")
def caption_set(tmp_path_factory) -> Path:
    return make_caption_set(tmp_path_factory.mktemp("captions"))


# constant LR: 16 steps of linear decay (Trainer's default schedule) halve the learning these tests look for
COMMON = ["--max_steps", "16", "--micro_batch_size", "8", "--max_seq_length", "16", "--progress_bar", "false",
          "--throughput_warmup_steps", "2", "--save_final_checkpoint", "false", "--lr_scheduler_type", "constant",
          "--bf16"]  # transformers' flag for --precision bf16 (auto is fp32 on a CPU without native bf16)


@pytest.mark.stack
@pytest.mark.slow
def test_zero1_two_ranks_host_pipeline_global_negatives_train_eval_predict(caption_set, tmp_path):
    run = tmp_path / "run"
    proc = run_deepspeed(["--module", "bridgetower_ds.train", "--do_train", "--do_eval", "--do_predict",
                          "--dataset_path", str(caption_set), "--run_dir", str(run),
                          "--deepspeed_config", str(ds_json(tmp_path, "bridgetower_zero1_bf16.json")),
                          "--dataloader_num_workers", "1", "--eval_every", "8", "--global_negatives", "true",
                          "--missing_splits", "fractions",
                          *COMMON])
    recs = records(run)
    assert_loss_falls(recs)
    summary = next(r for r in recs if r["type"] == "summary")
    assert summary["world_size"] == 2 and summary["zero_stage"] == 1 and summary["precision"] == "bf16"  # --bf16
    assert summary["samples_per_s"] > 0 and summary["warmup_steps_excluded"] == 2 and summary["bad_images"] == 0
    evals = [r for r in recs if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [8, 16]
    assert {"eval_loss", "eval_i2t_r1", "eval_i2t_r5", "eval_i2t_r10", "eval_t2i_r1", "eval_t2i_r5",
            "eval_t2i_r10"} <= set(evals[-1])
    results = json.loads((run / "all_results.json").read_text())
    # validation and test are carved out of train (10% each of 96 rows), gathered from both ranks, deduplicated
    assert results["eval_samples"] == 10 and results["test_samples"] == 10
    assert json.loads((run / "eval_results.json").read_text())["eval_samples"] == 10
    assert json.loads((run / "predict_results.json").read_text())["test_samples"] == 10
    assert results["eval_i2t_r10"] == 1.0 and 0.0 <= results["test_t2i_r1"] <= 1.0
    assert json.loads((run / "run_config.json").read_text())["ModelArgs"]["preset"] == "debug"
    assert "image pipeline: host" in proc.stdout


@pytest.mark.stack
@pytest.mark.slow
def test_zero3_two_ranks_device_pipeline_eval_export_then_reload_eval_only(caption_set, tmp_path):
    run, export = tmp_path / "run3", tmp_path / "export"
    proc = run_deepspeed(["--module", "bridgetower_ds.train", "--do_train", "--do_eval",
                          "--dataset_path", str(caption_set),
                          "--run_dir", str(run), "--image_pipeline", "device", "--dataloader_num_workers", "1",
                          "--missing_splits", "fractions",
                          "--deepspeed_config", str(ds_json(tmp_path, "bridgetower_zero3_bf16.json")),
                          "--export_dir", str(export), "--save_model", "false", *COMMON])
    recs = records(run)
    assert_loss_falls(recs)
    summary = next(r for r in recs if r["type"] == "summary")
    assert summary["zero_stage"] == 3 and summary["world_size"] == 2
    # --save_model false: no model in the run directory (measurement runs), the export still written
    assert not list(run.glob("*.safetensors")) and not (run / "config.json").exists()
    assert "image pipeline: device-cpu" in proc.stdout
    # evaluation under ZeRO-3: both ranks run forwards in lock-step (gathers), results gathered and deduplicated
    trained = json.loads((run / "eval_results.json").read_text())
    assert trained["eval_samples"] == 10 and trained["eval_i2t_r10"] == 1.0
    assert (export / "config.json").is_file() and (export / "tokenizer.json").is_file()

    # one process, `python -m`, from the exported directory (weights + tokenizer), evaluation only
    run_eval = tmp_path / "eval"
    out = subprocess.run([sys.executable, "-m", "bridgetower_ds.train", "--do_eval", "--model_name_or_path",
                          str(export), "--dataset_path", str(caption_set), "--missing_splits", "fractions",
                          "--run_dir", str(run_eval),
                          "--deepspeed_config", "bridgetower_zero1_bf16.json", "--micro_batch_size", "8",
                          "--dataloader_num_workers", "0", "--max_seq_length", "16"],
                         cwd=REPO, env=dist_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-6000:]
    res = json.loads((run_eval / "eval_results.json").read_text())
    assert res["eval_samples"] == 10 and res["eval_loss"] > 0
    # the exported weights are the trained ones: per-sample embeddings do not depend on the batch, so retrieval over
    # the gathered split ranks the same (one row may flip on a bf16 near-tie); the loss does depend on the batching
    # (in-batch negatives: 5 per rank there, 8 + 2 here), so it is not compared
    for k in ("i2t_r1", "t2i_r1", "i2t_r5", "t2i_r5"):
        assert res[f"eval_{k}"] == pytest.approx(trained[f"eval_{k}"], abs=0.11), k
    import torch
    from transformers import BridgeTowerForContrastiveLearning

    from bridgetower_ds.configs import ModelArgs
    from bridgetower_ds.model import build_model
    from ds_core.compat.hf import dtype_kwargs

    # the fp32 export reloads as fp32 under the "auto" dtype (its config says float32 under this transformers' name)
    exported = BridgeTowerForContrastiveLearning.from_pretrained(export, local_files_only=True, **dtype_kwargs("auto"))
    assert exported.dtype == torch.float32 and exported.logit_scale.shape == ()
    torch.manual_seed(42)  # the run's --seed: the same initial weights
    fresh = build_model(ModelArgs(preset="debug"))
    pooler, head = "bridgetower.text_model.pooler.dense.weight", "itc_text_head.fc.weight"
    got, init = exported.state_dict(), fresh.state_dict()
    # frozen by default: exported exactly as initialised (fp32, not the bf16 copy the engine computed with)
    assert got[pooler].dtype == torch.float32 and torch.equal(got[pooler], init[pooler])
    assert (got[head] - init[head]).abs().max() > 1e-2  # trained
    # fp32 master weights, not the bf16 module copy: trained values are not all bf16-representable
    assert got[head].dtype == torch.float32 and not torch.equal(got[head], got[head].bfloat16().float())
    assert json.loads((run_eval / "run_config.json").read_text())["RunArgs"]["do_train"] is False


def test_nothing_to_do_is_an_error(tmp_path):
    from bridgetower_ds.train import main
    from ds_core.errors import ConfigError

    with pytest.raises(ConfigError, match="nothing to do"):
        main(["--dataset_path", str(tmp_path)])


@pytest.mark.slow
def test_published_command_trains_on_two_ranks_and_writes_trainers_outputs(tmp_path):
    """optimum-habana's run_bridgetower.py command line (test_bt_compat.PUBLISHED) as written, except: the dataset
    is a tiny New-Yorker-schema one in a tmp datasets cache, the model is the debug preset (no
    --model_name_or_path: the Large checkpoint does not train on a CPU), and the sizes are a test's."""
    import torch
    from transformers import BridgeTowerForContrastiveLearning, BridgeTowerProcessor, get_scheduler

    from test_bt_compat import PUBLISHED, make_newyorker_cache

    cache = make_newyorker_cache(tmp_path / "hf_datasets", {"train": 40, "validation": 8, "test": 8})
    run = tmp_path / "bridgetower-test"
    argv = list(PUBLISHED)
    i = argv.index("--model_name_or_path")
    del argv[i:i + 2]
    argv[argv.index("--output_dir") + 1] = str(run)
    sizes = {"--per_device_train_batch_size=40": "--per_device_train_batch_size=8",
             "--per_device_eval_batch_size=16": "--per_device_eval_batch_size=4"}
    argv = [sizes.get(a, a) for a in argv]
    argv[argv.index("--num_train_epochs") + 1] = "2"
    argv[argv.index("--logging_steps") + 1] = "1"
    argv += ["--max_seq_length", "16", "--warmup_steps", "2", "--progress_bar", "false", "--eval_strategy", "epoch"]
    proc = run_deepspeed(["--module", "bridgetower_ds.train", *argv], env=dist_env(HF_DATASETS_CACHE=str(cache)))
    out = proc.stdout
    assert "--use_habana: " in out and "--gaudi_config_name: " in out and "--sdp_on_bf16: " in out
    assert "--learning_rate 1e-05" not in out  # the shipped JSON's lr is 1e-5 too: nothing replaced, nothing said

    results = {name: json.loads((run / f"{name}_results.json").read_text())
               for name in ("train", "eval", "predict", "all")}
    assert results["all"] == {**results["train"], **results["eval"], **results["predict"]}
    assert results["eval"]["eval_samples"] == 8 and results["predict"]["test_samples"] == 8
    recs = records(run)
    summary = next(r for r in recs if r["type"] == "summary")
    train = results["train"]
    assert train["train_samples"] == 40 and summary["world_size"] == 2
    # the one clock: the same warm-up-excluded figure as metrics.jsonl
    assert train["train_samples_per_second_measured"] == summary["samples_per_s"] > 0  # warm-up excluded
    assert train["train_samples_per_second"] > 0 and train["train_runtime"] > 0  # Trainer's: the whole runtime
    assert train["train_warmup_steps_excluded"] == 3 and train["train_measured_steps"] == summary["steps"] - 3
    # Trainer's schedule: linear decay over the run's optimizer steps after 2 warm-up steps, from --learning_rate
    steps = [r for r in recs if r["type"] == "step"]
    # --eval_strategy epoch: an evaluation at the end of each of the 2 epochs (Trainer's epoch strategy)
    assert [r["step"] for r in recs if r["type"] == "eval"] == [summary["steps"] // 2, summary["steps"]]
    total = summary["steps"]  # the schedule's length must be the loop's: compared through the LR of every step
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-5)
    sched = get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=total)
    want = []
    for _ in range(total):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [r["lr"] for r in steps] == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert steps[0]["lr"] == 0.0 and max(r["lr"] for r in steps) == pytest.approx(1e-5)
    ds_config = json.loads((run / "ds_config.json").read_text())
    assert ds_config["tensorboard"]["enabled"] and list((run / "tensorboard").rglob("events.out.tfevents*"))
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())  # --save_strategy no

    # Trainer.save_model + run_bridgetower.py's tokenizer/image processor: loadable as the published checkpoint is
    processor = BridgeTowerProcessor.from_pretrained(run)
    size = processor.image_processor.size  # a SizeDict on transformers 5, a dict on 4.55
    assert (size["shortest_edge"] if isinstance(size, dict) else size.shortest_edge) == 32  # the debug model's
    model = BridgeTowerForContrastiveLearning.from_pretrained(run, local_files_only=True)
    assert model.dtype == torch.float32 and model.config.vision_config.image_size == 32
    from PIL import Image

    batch = processor(images=[Image.new("RGB", (64, 48), (200, 30, 30))] * 2, text=["a red square"] * 2,
                      return_tensors="pt", padding=True)
    with torch.no_grad():
        emb = model(**batch)
    assert emb.text_embeds.shape == (2, 32) and torch.isfinite(emb.image_embeds).all()
    assert json.loads((run / "run_config.json").read_text())["CompatArgs"]["save_strategy"] == "no"
