"""bench.image_pipeline stays runnable: a tiny part (a) run, last line one JSON object with host_ratio."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_image_pipeline_bench_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.image_pipeline", "--images", "12", "--rounds", "1",
                           "--image_dir", str(tmp_path), "--skip_e2e"], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["images"] == 12 and last["host_ratio"] > 0 and "host_ratio_incl_normalize" in last
    assert len(list((tmp_path / "jpeg640x480").glob("*.jpg"))) == 12
