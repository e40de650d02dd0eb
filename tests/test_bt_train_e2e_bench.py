"""Smoke test of bench/_bt_e2e.py (part (b) of bench/image_pipeline.py) at toy size: both sides run, ratio reported."""
from __future__ import annotations

import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_bench_e2e_toy(tmp_path, capsys):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(24):
        Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(tmp_path / f"{i:03d}.jpg", quality=90)
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from _bt_e2e import bench_e2e
    finally:
        sys.path.remove(str(REPO / "bench"))
    out = bench_e2e(image_dir=str(tmp_path), steps=2, warmup=1, batch=4, workers=0, rounds=1)
    assert out["e2e_ratio"] > 0 and out["e2e_samples_per_s"] > 0 and out["e2e_baseline_samples_per_s"] > 0
    assert "e2e_ratio =" in capsys.readouterr().out
