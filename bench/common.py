"""What several benchmarks share: the repository root, the ranks' environment, starting local ranks (through
launch.local_ranks, the project's one starter) and the generated photographs of the image benchmarks."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from ds_core.rank.rendezvous import free_port, rank_env
from launch import local_ranks

REPO = Path(__file__).resolve().parents[1]

# Offline and quiet: nothing in a benchmark downloads, and tokenizers' own thread pool would compete with the ranks.
_QUIET = dict(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def bench_env(threads: int | None = None, **extra: str) -> dict[str, str]:
    """Environment for a benchmark's subprocesses and ranks: ds_core.rank.rendezvous.rank_env with this checkout first
    on PYTHONPATH (so `-m bench.x` and the packages resolve to it), offline, `threads` OMP threads each when given."""
    return rank_env(threads=threads, pythonpath=[REPO], extra={**_QUIET, **extra})


def run_local_ranks(num_ranks: int, target: Sequence[str], *, env: dict[str, str], log: Path,
                    timeout_s: float = 3600, what: str = "run") -> local_ranks.LaunchResult:
    """Start `num_ranks` ranks of TARGET (`-m module args` or a script) directly, the toolkit's documented local path;
    on failure print the log's tail and exit naming the log (a benchmark has nothing to report then)."""
    cmds = local_ranks.rank_commands(num_ranks, target, master_port=free_port(), env=env)
    res = local_ranks.run_ranks(cmds, cwd=REPO, timeout_s=timeout_s, log_path=log, poll_s=0.1)
    if not res.ok:
        sys.stdout.write(log.read_text(errors="replace")[-6000:])
        raise SystemExit(f"{what} failed (exit {res.exit_code}{', timed out' if res.timed_out else ''}); log: {log}")
    return res


def photo_like(rng, w: int = 640, h: int = 480):
    """A synthetic photograph: lit gradient background, a few blurred shapes, fine texture and sensor noise."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = rng.uniform(40, 200, 3)
    gx, gy = rng.uniform(-0.2, 0.2, 2)
    img = base + (gx * x + gy * y)[..., None] + 25 * np.sin(x / rng.uniform(40, 120) + rng.uniform(0, 6))[..., None]
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(3, 8))):
        x0, y0 = rng.integers(0, w - 40), rng.integers(0, h - 40)
        x1, y1 = x0 + rng.integers(30, 260), y0 + rng.integers(30, 200)
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=color)
    im = im.filter(ImageFilter.GaussianBlur(rng.uniform(0.6, 2.0)))
    arr = np.asarray(im).astype(np.float32)
    arr += 8 * np.sin(x / 3.1 + y / 4.7)[..., None] * rng.random()  # fine texture
    arr += rng.normal(0, 4, arr.shape)  # sensor noise
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def make_images(root: Path, n: int, seed: int = 0) -> list[Path]:
    """`n` photo-like 640x480 JPEGs (quality 90) in `root`, reused when all are already there."""
    import numpy as np

    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"{i:05d}.jpg" for i in range(n)]
    if all(p.exists() and p.stat().st_size > 0 for p in paths):
        return paths
    rng = np.random.default_rng(seed)
    for p in paths:
        photo_like(rng).save(p, "JPEG", quality=90)
    return paths
