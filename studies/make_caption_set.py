"""A synthetic image-caption set for the shipped studies: N JPEGs (smooth colour fields with shapes, so that JPEG
decoding does real work) and a captions.jsonl manifest that bridgetower_ds.data reads (`--dataset_path`).

    python studies/make_caption_set.py data/bt_study [--images 256] [--width 320] [--height 240]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLORS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 220, 40),
          "white": (240, 240, 240), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")


def make(out: Path, n: int, width: int, height: int, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = list(COLORS)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    rows = []
    for i in range(n):
        fg, bg = rng.choice(len(names), 2, replace=False)
        base = np.array(COLORS[names[bg]], np.float32)
        # a gradient plus mild noise: photo-like entropy, so the decoder is not timing a flat image
        grad = (xx / width - 0.5)[..., None] * rng.uniform(-60, 60, 3) + (yy / height - 0.5)[..., None] * \
            rng.uniform(-60, 60, 3)
        img = np.clip(base + grad + rng.normal(0, 6, (height, width, 3)), 0, 255).astype(np.uint8)
        im = Image.fromarray(img)
        d = ImageDraw.Draw(im)
        s = min(width, height)
        x0, y0 = int(rng.integers(0, width - s // 2)), int(rng.integers(0, height - s // 2))
        box = (x0, y0, x0 + s // 2, y0 + s // 2)
        shape = SHAPES[i % 3]
        if shape == "circle":
            d.ellipse(box, fill=COLORS[names[fg]])
        elif shape == "square":
            d.rectangle(box, fill=COLORS[names[fg]])
        else:
            d.polygon([((box[0] + box[2]) // 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=COLORS[names[fg]])
        im.save(out / f"{i:05d}.jpg", quality=90)
        rows.append({"image": f"{i:05d}.jpg", "caption": f"a {names[fg]} {shape} on a {names[bg]} background"})
    manifest = out / "captions.jsonl"
    tmp = out / ".captions.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(manifest)  # written last: its existence means the set is complete
    return manifest


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("out", help="output directory")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--width", type=int, default=320)
    ap.add_argument("--height", type=int, default=240)
    a = ap.parse_args(argv)
    print(make(Path(a.out), a.images, a.width, a.height))


if __name__ == "__main__":
    main()
