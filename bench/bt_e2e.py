"""Part (b) of bench.image_pipeline: end-to-end BridgeTower fine-tuning samples/s, ours vs a Trainer baseline.

Both sides: the debug BridgeTower (same config, random init), the same images and captions, batch, worker count,
max_seq_length (captions padded to it on both sides, so the model does identical work), AdamW lr 1e-5 with
clipping 1.0, fp32, one process on the CPU, OMP_NUM_THREADS=1, the same number of optimizer steps after the same
number of warm-up steps, which are excluded from the timing on both sides. The sides alternate for `rounds` rounds
and each keeps its best round (the machine this runs on may be shared).

  baseline: plain transformers `Trainer` (no DeepSpeed; DDP when started by torchrun, one process otherwise, as the
            published GPU runs of run_bridgetower.py trained) with a per-sample transform in a torch Dataset's
            __getitem__, which also tokenizes the caption; the DataLoader has the same workers (persistent, to give
            the baseline its best case). The transform (`--transform`, baseline process only): "processor" (this
            bench's CPU case) opens the image with PIL and runs BridgeTowerImageProcessor on it; "run_bridgetower"
            is optimum-habana's run_bridgetower.py (examples/contrastive-image-text, huggingface/optimum-habana
            1d8504c6c7666a19d71968dba50976dceaf7c6b6) exactly: torchvision `read_image(path, RGB)`, then its
            Transform, Resize([S], bicubic) + CenterCrop(S) + ConvertImageDtype(float) + Normalize(CLIP); it needs
            torchvision.
  ours:     `python -m bridgetower_ds.train` (our data pipeline: JPEG draft decode, uint8 resize/crop in workers,
            normalization in the training process; the DeepSpeed engine with ZeRO-0), throughput from its
            metrics.jsonl summary (ds_core's clock, warm-up excluded).

Each side runs in its own subprocess so neither inherits the other's process group, threads or caches.

    python -m bench.bt_e2e [--image_dir DIR] [--steps 40] [--warmup 5] [--batch 32] [--workers 2] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, bench_env, make_images

MAX_SEQ = 32

_WORDS = {
    "color": ["red", "blue", "green", "yellow", "white", "black", "brown", "orange", "pink", "gray"],
    "thing": ["dog", "cat", "car", "bus", "tree", "house", "pizza", "boat", "horse", "kite", "bird", "table"],
    "place": ["street", "park", "beach", "kitchen", "field", "room", "snow", "water", "city", "grass"],
}


def _caption(i: int) -> str:
    w = _WORDS
    c, t, p = w["color"][i % 10], w["thing"][(i // 10) % 12], w["place"][(i * 7) % 10]
    return f"a {c} {t} in the {p} next to {['one', 'two', 'three'][i % 3]} people on a bright day"


def make_manifest(image_dir: Path, out_dir: Path) -> Path:
    """A JSONL manifest over every *.jpg of image_dir (absolute paths) with a synthetic COCO-like caption each."""
    paths = sorted(Path(image_dir).glob("*.jpg"))
    if not paths:
        raise FileNotFoundError(f"no *.jpg in {image_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = out_dir / "captions.jsonl"
    manifest.write_text("".join(json.dumps({"image": str(p.resolve()), "caption": _caption(i)}) + "\n"
                                for i, p in enumerate(paths)))
    return manifest


# ------------------------------------------------------------------------------------------------- baseline
def reference_images(transform: str, size: int):
    """path -> normalized [3, S, S] float32, the baseline's per-sample image transform (see the module docstring)."""
    if transform == "processor":
        from PIL import Image
        from transformers import BridgeTowerImageProcessor

        processor = BridgeTowerImageProcessor(size={"shortest_edge": size}, crop_size={"shortest_edge": size})
        return lambda path: processor(images=Image.open(path).convert("RGB"), return_tensors="pt")["pixel_values"][0]
    if transform != "run_bridgetower":
        raise ValueError(f"--transform must be processor or run_bridgetower, got {transform!r}")
    from bridgetower_ds.image_processor import torchvision_transform

    return torchvision_transform(size)  # RuntimeError naming torchvision where it is missing


def run_baseline(manifest: str, steps: int, warmup: int, batch: int, workers: int, out: str, preset: str = "debug",
                 image_size: int = 0, bf16: bool = False, transform: str = "processor", profile_steps: int = 0) -> None:
    """Plain transformers Trainer + a per-sample image transform (runs in its own process). The defaults are this
    bench's CPU case; bench.gpu_check passes the BridgeTower-Large preset, 294 px, bf16 and run_bridgetower.py's
    transform, and then the Trainer runs on the GPU when one is visible. profile_steps: ds_core.outputs.profile over
    that many warm-up steps (as a run's --profile_steps profiles ours)."""
    import torch
    from transformers import BridgeTowerForContrastiveLearning, Trainer, TrainerCallback, TrainingArguments

    from bridgetower_ds.configs import preset as bt_preset
    from bridgetower_ds.tokenizer import debug_tokenizer
    from ds_core.outputs.profile import StepProfile

    rows = [json.loads(line) for line in Path(manifest).read_text().splitlines() if line.strip()]
    cfg = bt_preset(preset)
    if image_size:
        cfg.vision_config.image_size = image_size
    image = reference_images(transform, int(cfg.vision_config.image_size))
    tokenizer = debug_tokenizer()

    class ReferenceDataset(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            r = rows[i]
            enc = tokenizer(r["caption"], padding="max_length", max_length=MAX_SEQ, truncation=True,
                            return_tensors="pt")
            return {"pixel_values": image(r["image"]), "input_ids": enc["input_ids"][0],
                    "attention_mask": enc["attention_mask"][0]}

    def collate(items):
        batch_ = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        batch_["return_loss"] = True
        return batch_

    times: list[float] = []
    prof = StepProfile(warmup - 1 - profile_steps, profile_steps) if profile_steps else None

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())
            if prof is not None:
                prof.step_end()

    torch.manual_seed(0)
    model = BridgeTowerForContrastiveLearning(cfg)
    args = TrainingArguments(
        output_dir=str(Path(out).parent / "trainer_out"), use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=batch, bf16=bf16,
        max_steps=warmup + steps, learning_rate=1e-5, weight_decay=0.0, lr_scheduler_type="constant",
        optim="adamw_torch", max_grad_norm=1.0, dataloader_num_workers=workers,
        dataloader_persistent_workers=workers > 0, dataloader_drop_last=True, remove_unused_columns=False,
        save_strategy="no", logging_strategy="no", report_to=[], disable_tqdm=True, seed=0)
    Trainer(model=model, args=args, train_dataset=ReferenceDataset(), data_collator=collate,
            callbacks=[Clock()]).train()
    measured = times[-1] - times[warmup - 1] if warmup else times[-1] - times[0]
    n_steps = len(times) - warmup if warmup else len(times) - 1
    Path(out).write_text(json.dumps({"samples_per_s": n_steps * batch / measured, "steps": n_steps,
                                     "seconds": measured, "transform": transform, "bf16": bf16,
                                     "world_size": args.world_size, "device": str(args.device),
                                     "profile": prof.summary if prof else None}))


# ------------------------------------------------------------------------------------------------- ours
def run_ours(manifest: str, steps: int, warmup: int, batch: int, workers: int, work: Path, env: dict) -> dict:
    ds = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                    "weight_decay": 0.0}},
          "steps_per_print": 1000000}
    work.mkdir(parents=True, exist_ok=True)
    (work / "ds_zero0_fp32.json").write_text(json.dumps(ds))
    run_dir = work / "ours_run"
    cmd = [sys.executable, "-m", "bridgetower_ds.train", "--do_train", "--preset", "debug",
           "--dataset_path", manifest, "--missing_splits", "fractions", "--validation_fraction", "0",
           "--test_fraction", "0", "--image_transform", "processor",  # the baseline's BridgeTowerImageProcessor
           "--deepspeed_config", str(work / "ds_zero0_fp32.json"), "--run_dir", str(run_dir),
           "--max_steps", str(warmup + steps), "--throughput_warmup_steps", str(warmup),
           "--dataloader_num_workers", str(workers), "--max_seq_length", str(MAX_SEQ), "--pad_to_max_length", "true",
           "--image_pipeline", "host", "--save_final_checkpoint", "false", "--progress_bar", "false", "--seed", "0"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ours failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in recs if r["type"] == "summary")
    return {"samples_per_s": summary["samples_per_s"], "steps": summary["measured_steps"],
            "seconds": summary["measured_seconds"]}


def bench_e2e(image_dir: str | None = None, steps: int = 40, warmup: int = 5, batch: int = 32,
              workers: int = 2, n_images: int = 500, rounds: int = 2) -> dict:
    """Run both sides `rounds` times, interleaved (baseline, ours, baseline, ours, ...), and keep each side's best
    samples/s: on a shared machine other processes' load only ever slows a run down, so the best round is the one
    least disturbed, for both sides alike. Prints every round and e2e_ratio = ours / baseline; returns the numbers."""
    with tempfile.TemporaryDirectory(prefix="bt_e2e_") as tmp:
        work = Path(tmp)
        if image_dir is None:
            image_dir = str(work / "jpeg640x480")
            make_images(Path(image_dir), n_images)
        manifest = make_manifest(Path(image_dir), work)
        n = sum(1 for _ in manifest.open())
        env = bench_env(threads=1, DS_ACCELERATOR="cpu", ACCELERATE_USE_CPU="1")
        common = dict(steps=steps, warmup=warmup, batch=batch, workers=workers)
        print(f"(b) end-to-end fine-tuning, debug BridgeTower, {n} JPEGs 640x480 -> 32x32, batch {batch}, "
              f"{workers} workers, {steps} steps after {warmup} warm-up steps, 1 process, CPU, fp32, "
              f"{rounds} interleaved rounds (best kept):")
        bases, ours_ = [], []
        for r in range(1, rounds + 1):
            out = work / f"baseline{r}.json"
            proc = subprocess.run([sys.executable, "-m", "bench.bt_e2e", "--baseline", "--manifest",
                                   str(manifest), "--out", str(out)] + [f"--{k}={v}" for k, v in common.items()],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"baseline failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
            bases.append(json.loads(out.read_text())["samples_per_s"])
            print(f"    round {r}: baseline transformers Trainer + per-sample BridgeTowerImageProcessor: "
                  f"{bases[-1]:7.1f} samples/s")
            ours_.append(run_ours(str(manifest), work=work / f"ours{r}", env=env, **common)["samples_per_s"])
            print(f"    round {r}: ours (bridgetower_ds.train, host pipeline, DeepSpeed ZeRO-0):           "
                  f"{ours_[-1]:7.1f} samples/s")
        base, ours = max(bases), max(ours_)
        ratio = ours / base
        print(f"    best: baseline {base:.1f}, ours {ours:.1f} samples/s -> e2e_ratio = {ratio:.2f} (target >= 1.5)")
        return {"e2e_ratio": round(ratio, 3), "e2e_samples_per_s": round(ours, 2),
                "e2e_baseline_samples_per_s": round(base, 2), "e2e_rounds_ours": [round(x, 1) for x in ours_],
                "e2e_rounds_baseline": [round(x, 1) for x in bases], "e2e_batch": batch, "e2e_workers": workers,
                "e2e_steps": steps, "e2e_warmup_steps": warmup}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--image_dir", default=None, help="JPEGs to use (default: generate 500 photo-like 640x480)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per side (best kept)")
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)  # internal: the baseline process
    ap.add_argument("--manifest", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    # the baseline process only (bench.gpu_check): model preset, image size, bf16, the per-sample image transform
    ap.add_argument("--preset", default="debug", help=argparse.SUPPRESS)
    ap.add_argument("--image_size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--transform", choices=("processor", "run_bridgetower"), default="processor",
                    help=argparse.SUPPRESS)
    ap.add_argument("--profile_steps", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.baseline:
        run_baseline(a.manifest, a.steps, a.warmup, a.batch, a.workers, a.out, a.preset, a.image_size, a.bf16,
                     a.transform, a.profile_steps)
        return
    print(json.dumps(bench_e2e(a.image_dir, a.steps, a.warmup, a.batch, a.workers, rounds=a.rounds)))


if __name__ == "__main__":
    main()
