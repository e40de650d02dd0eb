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
