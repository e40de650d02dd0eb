"""bridgetower_ds.train end to end on a tiny generated image-caption set: 2 ranks with ZeRO-1 and ZeRO-3 (the
shipped DeepSpeed JSONs, learning rate raised), loss falls, eval/predict recall, export, reload, eval-only."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, dist_env, run_deepspeed
from ds_core.precision import resolve_precision

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
    losses = [r["loss"] for r in recs if r["type"] == "step"]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first * 0.85, losses


@pytest.fixture(scope="module")
def caption_set(tmp_path_factory) -> Path:
    return make_caption_set(tmp_path_factory.mktemp("captions"))


COMMON = ["--max_steps", "16", "--micro_batch_size", "8", "--max_seq_length", "16", "--progress_bar", "false",
          "--throughput_warmup_steps", "2", "--save_final_checkpoint", "false"]


@pytest.mark.slow
def test_zero1_two_ranks_host_pipeline_global_negatives_train_eval_predict(caption_set, tmp_path):
    run = tmp_path / "run"
    proc = run_deepspeed(["--module", "bridgetower_ds.train", "--do_train", "--do_eval", "--do_predict",
                          "--dataset_path", str(caption_set), "--run_dir", str(run),
                          "--deepspeed_config", str(ds_json(tmp_path, "bridgetower_zero1_bf16.json")),
                          "--dataloader_num_workers", "1", "--eval_every", "8", "--global_negatives", "true",
                          *COMMON])
    recs = records(run)
    assert_loss_falls(recs)
    summary = next(r for r in recs if r["type"] == "summary")
    assert summary["world_size"] == 2 and summary["zero_stage"] == 1 and summary["precision"] == resolve_precision("auto", "cpu")[0]
    assert summary["samples_per_s"] > 0 and summary["warmup_steps_excluded"] == 2 and summary["bad_images"] == 0
    evals = [r for r in recs if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [8, 16]
    assert {"eval_loss", "eval_i2t_r1", "eval_i2t_r5", "eval_i2t_r10", "eval_t2i_r1", "eval_t2i_r5",
            "eval_t2i_r10"} <= set(evals[-1])
    results = json.loads((run / "eval_results.json").read_text())
    # validation and test are carved out of train (10% each of 96 rows), gathered from both ranks, deduplicated
    assert results["eval_samples"] == 10 and results["test_samples"] == 10
    assert results["eval_i2t_r10"] == 1.0 and 0.0 <= results["test_t2i_r1"] <= 1.0
    assert json.loads((run / "config.json").read_text())["ModelArgs"]["preset"] == "debug"
    assert "image pipeline: host" in proc.stdout


@pytest.mark.slow
def test_zero3_two_ranks_device_pipeline_eval_export_then_reload_eval_only(caption_set, tmp_path):
    run, export = tmp_path / "run3", tmp_path / "export"
    proc = run_deepspeed(["--module", "bridgetower_ds.train", "--do_train", "--do_eval",
                          "--dataset_path", str(caption_set),
                          "--run_dir", str(run), "--image_pipeline", "device", "--dataloader_num_workers", "1",
                          "--deepspeed_config", str(ds_json(tmp_path, "bridgetower_zero3_bf16.json")),
                          "--export_dir", str(export), *COMMON])
    recs = records(run)
    assert_loss_falls(recs)
    summary = next(r for r in recs if r["type"] == "summary")
    assert summary["zero_stage"] == 3 and summary["world_size"] == 2
    assert "image pipeline: device-cpu" in proc.stdout
    # evaluation under ZeRO-3: both ranks run forwards in lock-step (gathers), results gathered and deduplicated
    trained = json.loads((run / "eval_results.json").read_text())
    assert trained["eval_samples"] == 10 and trained["eval_i2t_r10"] == 1.0
    assert (export / "config.json").is_file() and (export / "tokenizer.json").is_file()

    # one process, `python -m`, from the exported directory (weights + tokenizer), evaluation only
    run_eval = tmp_path / "eval"
    out = subprocess.run([sys.executable, "-m", "bridgetower_ds.train", "--do_eval", "--model_name_or_path",
                          str(export), "--dataset_path", str(caption_set), "--run_dir", str(run_eval),
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
    from transformers import BridgeTowerForContrastiveLearning

    import torch

    from bridgetower_ds.configs import ModelArgs
    from bridgetower_ds.model import build_model

    exported = BridgeTowerForContrastiveLearning.from_pretrained(export, local_files_only=True).float()
    assert exported.logit_scale.shape == ()
    torch.manual_seed(42)  # the run's --seed: the same initial weights
    fresh = build_model(ModelArgs(preset="debug"))
    pooler, head = "bridgetower.text_model.pooler.dense.weight", "itc_text_head.fc.weight"
    got, init = exported.state_dict(), fresh.state_dict()
    dtype = torch.bfloat16 if resolve_precision("auto", "cpu")[0] == "bf16" else torch.float32  # the run's dtype
    assert torch.allclose(got[pooler], init[pooler].to(dtype).float())  # frozen by default: unchanged
    assert (got[head] - init[head]).abs().max() > 1e-2  # trained
    assert json.loads((run_eval / "config.json").read_text())["RunArgs"]["do_train"] is False


def test_nothing_to_do_is_an_error(tmp_path):
    from ds_core.config import ConfigError

    from bridgetower_ds.train import main

    with pytest.raises(ConfigError, match="nothing to do"):
        main(["--dataset_path", str(tmp_path)])
