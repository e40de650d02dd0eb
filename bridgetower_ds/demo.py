"""`make demo`, BridgeTower part: generated photos in the New Yorker caption contest "matching" schema -> 2-rank ZeRO-1
contrastive fine-tuning of the debug preset (train + eval + predict, run_bridgetower.py's flags and pixels) -> the
results files; then the seed's data-loading table in small (DataLoader workers 0/1/2 x host/device pipeline).
About two minutes on 2 CPU cores; nothing is downloaded.

    python -m bridgetower_ds.demo --out demo_out/bridgetower [--steps 24] [--ranks 2]

The data has one undecodable image and one empty caption per split, so the results show `*_bad_images` and
`*_bad_captions` (skipped, counted once, summed over ranks). The table times the data pipeline alone (samples/s it
delivers into the training process, and the CPU seconds that process spends per 100 samples: what a pipeline takes
from the training loop), at the Large model's 294 px on 640 x 480 JPEGs, with no model step: on 2 shared cores a
training step per configuration would not fit the demo's time.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ds_core.files import claim_output_dir
from ds_core.rank.rendezvous import rank_env

REPO = Path(__file__).resolve().parents[1]
# jmhessel/newyorker_caption_contest, configuration "matching": its columns and types (the published command reads
# --image_column image --caption_column image_description)
NEWYORKER_FEATURES = {"image": "image", "contest_number": "int32", "image_location": "string",
                      "image_description": "string", "image_uncanny_description": "string", "entities": ["string"],
                      "questions": ["string"], "caption_choices": ["string"], "from_description": "string",
                      "label": "string", "n_tokens_label": "int32", "instance_id": "string"}
COLORS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 220, 40),
          "white": (240, 240, 240), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")
SIZES = ((160, 120), (120, 160), (200, 90), (144, 144))  # several aspect ratios (w, h)


def photo(w: int, h: int, rng: np.random.Generator, fg: tuple, bg: tuple, shape: str) -> bytes:
    """A JPEG of a coloured shape on a gradient with mild noise: photo-like entropy, a caption that describes it."""
    from PIL import Image, ImageDraw

    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    grad = (xx / w - 0.5)[..., None] * rng.uniform(-50, 50, 3) + (yy / h - 0.5)[..., None] * rng.uniform(-50, 50, 3)
    im = Image.fromarray(np.clip(np.array(bg, np.float32) + grad + rng.normal(0, 5, (h, w, 3)), 0, 255)
                         .astype(np.uint8))
    s = min(w, h) // 2
    x0, y0 = int(rng.integers(0, w - s)), int(rng.integers(0, h - s))
    box, d = (x0, y0, x0 + s, y0 + s), ImageDraw.Draw(im)
    if shape == "circle":
        d.ellipse(box, fill=fg)
    elif shape == "square":
        d.rectangle(box, fill=fg)
    else:
        d.polygon([((box[0] + box[2]) // 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=fg)
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def make_newyorker_set(out: Path, rows: dict[str, int], seed: int = 0) -> Path:
    """A DatasetDict in the New Yorker "matching" schema (save_to_disk), images embedded as bytes like the hub's.
    Each split's second-to-last row has a truncated JPEG and its last row an empty caption."""
    import datasets

    feats = datasets.Features({k: datasets.Image() if v == "image" else datasets.Sequence(datasets.Value(v[0]))
                               if isinstance(v, list) else datasets.Value(v) for k, v in NEWYORKER_FEATURES.items()})
    rng, names, parts = np.random.default_rng(seed), list(COLORS), {}
    for split, n in rows.items():
        recs = []
        for i in range(n):
            fg, bg = rng.choice(len(names), 2, replace=False)
            shape = SHAPES[int(rng.integers(0, 3))]
            w, h = SIZES[i % len(SIZES)]
            data = photo(w, h, rng, COLORS[names[fg]], COLORS[names[bg]], shape)
            desc = f"a {names[fg]} {shape} on a {names[bg]} background"
            if i == n - 2:
                data = data[: len(data) // 3]  # a truncated download: a bad image, named and counted
            if i == n - 1:
                desc = ""  # an empty caption: skipped and counted
            recs.append(dict(image={"bytes": data, "path": None}, contest_number=i, image_location="a gallery",
                             image_description=desc, image_uncanny_description="the shape is unusually bright",
                             entities=["https://en.wikipedia.org/wiki/Shape"], questions=["why this colour?"],
                             caption_choices=["A", "B", "C", "D", "E"], from_description="scene", label="A",
                             n_tokens_label=1, instance_id=f"{split}-{i}"))
        parts[split] = datasets.Dataset.from_list(recs, features=feats)
    path = out / "newyorker_matching"
    datasets.DatasetDict(parts).save_to_disk(str(path))
    return path


def _run(cmd: list[str], env: dict, log: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.stdout.write(log.read_text()[-6000:])
        raise SystemExit(f"demo: {cmd[0]} failed (exit {proc.returncode}); full log: {log}")


def fine_tune(out: Path, dataset: Path, steps: int, ranks: int) -> dict:
    """run_bridgetower.py's flags (HPU-only ones left out) on the generated set, 2 local ranks; returns the results."""
    env = rank_env(pythonpath=[REPO], extra={"TOKENIZERS_PARALLELISM": "false"})
    if env.get("DS_ACCELERATOR") == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // ranks)))
    run = out / "run"
    _run([sys.executable, "-m", "launch.local_ranks", "-n", str(ranks), "-m", "bridgetower_ds.train",
          "--output_dir", str(run), "--preset", "debug", "--dataset_path", str(dataset),
          "--image_column", "image", "--caption_column", "image_description", "--remove_unused_columns", "false",
          "--do_train", "--do_eval", "--do_predict", "--per_device_train_batch_size", "8",
          "--per_device_eval_batch_size", "8", "--max_steps", str(steps), "--learning_rate", "5e-4",
          "--lr_scheduler_type", "constant", "--max_seq_length", "16", "--dataloader_num_workers", "1",
          "--throughput_warmup_steps", "3", "--precision", "fp32", "--save_final_checkpoint", "false",
          "--progress_bar", "false"], env=env, log=out / "train.log")
    return json.loads((run / "all_results.json").read_text())


def loader_table(out: Path, n_images: int = 64, size: int = 294, micro: int = 16) -> list[dict]:
    """Samples/s the data pipeline delivers into this (training) process and its CPU s per 100 samples, for
    dataloader_num_workers 0/1/2 x image_pipeline host/device, one rank, two epochs each (the first pays the
    workers' start)."""
    import torch

    from bridgetower_ds.configs import DataArgs
    from bridgetower_ds.data import build_data, open_dataset
    from bridgetower_ds.tokenizer import debug_tokenizer

    rng, names = np.random.default_rng(1), list(COLORS)
    img_dir = out / "photos"
    img_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n_images):
        fg, bg = rng.choice(len(names), 2, replace=False)
        (img_dir / f"{i:04d}.jpg").write_bytes(photo(640, 480, rng, COLORS[names[fg]], COLORS[names[bg]], "circle"))
        rows.append({"image": f"{i:04d}.jpg", "caption": f"a {names[fg]} circle on a {names[bg]} background"})
    (img_dir / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok, table = debug_tokenizer(), []
    torch.set_num_threads(1)
    for workers in (0, 1, 2):
        for pipeline in ("host", "device"):
            args = DataArgs(dataset_path=str(img_dir / "captions.jsonl"), missing_splits="fractions",
                            validation_fraction=0.0, test_fraction=0.0, image_pipeline=pipeline,
                            dataloader_num_workers=workers, decode_threads=2, max_seq_length=16)
            data = build_data(open_dataset(args), "train", tok, size, 0, 1, micro, 0, "cpu", shuffle=True)
            data.set_epoch(0)
            sum(1 for _ in data)  # warm-up epoch: worker start, thread pool, caches
            data.set_epoch(1)
            c0, t0, n = time.process_time(), time.perf_counter(), 0
            for batch in data:
                n += batch["pixel_values"].shape[0]
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            data.close()
            table.append({"workers": workers, "pipeline": data.pipeline.name, "samples_per_s": n / wall,
                          "main_cpu_s_per_100": 100 * cpu / n})
    return table


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--out", default="demo_out/bridgetower",
                    help="output directory: made, or replaced where an earlier run of this demo made it; any "
                         "other non-empty directory is refused")
    ap.add_argument("--steps", type=int, default=24, help="optimizer steps of the fine-tune")
    ap.add_argument("--ranks", type=int, default=2, help="local ranks (python -m launch.local_ranks -n)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out).resolve()
    try:  # a directory of the user's is never replaced: only what an earlier run of this demo made
        said = claim_output_dir(out, "bridgetower_ds.demo")
    except FileExistsError as e:
        raise SystemExit(f"demo: {e}") from None
    if said:
        print(said, flush=True)
    dataset = make_newyorker_set(out, {"train": 96, "validation": 24, "test": 24})
    t_data = time.perf_counter() - t0
    res = fine_tune(out, dataset, args.steps, args.ranks)
    t_train = time.perf_counter() - t0 - t_data
    table = loader_table(out)
    t_table = time.perf_counter() - t0 - t_data - t_train

    def g(key, spec=".3f"):
        return "n/a" if res.get(key) is None else format(res[key], spec)

    print(f"\n== BridgeTower debug fine-tuning demo: New Yorker 'matching' schema, {args.ranks} ranks, ZeRO-1 fp32, "
          f"run_bridgetower.py's pixels ==")
    print(f"train: {g('train_steps', 'd')} steps, final loss {g('train_final_loss')}, samples/s "
          f"{g('train_samples_per_second', '.1f')}; bad images {g('train_bad_images', 'd')}, bad captions "
          f"{g('train_bad_captions', 'd')}")
    for split in ("eval", "test"):
        print(f"{split}: {g(f'{split}_samples', 'd')} samples, loss {g(f'{split}_loss')}, i2t R@1 "
              f"{g(f'{split}_i2t_r1')} R@5 {g(f'{split}_i2t_r5')}, t2i R@1 {g(f'{split}_t2i_r1')}; bad images "
              f"{g(f'{split}_bad_images', 'd')}, bad captions {g(f'{split}_bad_captions', 'd')}")
    print(f"results: {out / 'run' / 'all_results.json'} (also train_, eval_, predict_results.json)")
    print("\n== data loading, one rank, 640x480 JPEGs -> 294 px (pipeline only, no model step) ==")
    print("| dataloader_num_workers | pipeline | samples/s | training-process CPU s / 100 samples |")
    print("|---|---|---|---|")
    for r in table:
        print(f"| {r['workers']} | {r['pipeline']} | {r['samples_per_s']:.0f} | {r['main_cpu_s_per_100']:.2f} |")
    print(f"\ndata {t_data:.0f} s, fine-tune {t_train:.0f} s, table {t_table:.0f} s, total "
          f"{time.perf_counter() - t0:.0f} s; training log: {out / 'train.log'}")
    return {"results": res, "table": table}


if __name__ == "__main__":
    main()
