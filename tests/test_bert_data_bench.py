"""bench.h5_loader runs end to end on a small shard and prints its JSON contract (the real run uses 200k samples)."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, dist_env


def test_h5_loader_bench_small(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.h5_loader", "--samples", "3000", "--ref_samples", "640",
                           "--seek_offsets", "100", "2500", "--no_compression", "--keep", str(tmp_path)],
                          cwd=REPO, env=dist_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"ratio", "seek_ratio", "ours_samples_per_s", "reference_samples_per_s"} <= set(last)
    assert last["ratio"] > 0 and last["seek_ratio"] > 0
    assert last["samples"] == 3000 and last["compression"] is None
    assert list(tmp_path.glob("bench_training_seq128_pred20_3000.hdf5"))
