"""Smoke test of bench.bt_e2e (part (b) of bench.image_pipeline) at toy size: both sides run, ratio reported."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, dist_env


@pytest.mark.slow
def test_bench_e2e_toy(tmp_path):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(24):
        Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(tmp_path / f"{i:03d}.jpg", quality=90)
    proc = subprocess.run([sys.executable, "-m", "bench.bt_e2e", "--image_dir", str(tmp_path), "--steps", "2",
                           "--warmup", "1", "--batch", "4", "--workers", "0", "--rounds", "1"], cwd=REPO,
                          env=dist_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["e2e_ratio"] > 0 and out["e2e_samples_per_s"] > 0 and out["e2e_baseline_samples_per_s"] > 0
    assert "e2e_ratio =" in proc.stdout


@pytest.mark.gpu  # torchvision comes with the CUDA images (none for this CPU torch); the check itself runs on the CPU
def test_run_bridgetower_baseline_transform_is_torchvisions_and_equals_ours(tmp_path):
    """The Trainer baseline's run_bridgetower transform (image_processor.torchvision_transform: torchvision read_image +
    run_bridgetower.py's Transform) against our host pipeline's run_bridgetower geometry, normalized: equal within
    float32 rounding of the two normalizations (and 1 grey level where the float resize rounds a .5 the other way
    on another CPU). Both decode with libjpeg-turbo (torchvision's read_image, simplejpeg)."""
    pytest.importorskip("torchvision", reason="the run_bridgetower baseline transform is torchvision's")
    import numpy as np
    import torch
    from PIL import Image

    from bridgetower_ds.image_processor import torchvision_transform
    from bridgetower_ds.images import CLIP_STD, host_transform, normalize

    rng = np.random.default_rng(0)
    ref = torchvision_transform(64)
    for w, h in ((160, 120), (120, 160), (300, 70)):
        path = tmp_path / f"{w}x{h}.jpg"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path, quality=90)
        want = ref(str(path))
        got = normalize(torch.from_numpy(host_transform(path.read_bytes(), str(path), 64, transform="run_bridgetower"))
                        [None])[0]
        levels = (got - want).abs() * 255 * torch.tensor(CLIP_STD).view(3, 1, 1)
        assert want.shape == (3, 64, 64) and levels.max() <= 1.001 and (levels > 1e-3).float().mean() < 1e-3
