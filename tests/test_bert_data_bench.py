"""bench/h5_loader.py runs end to end on a small shard and prints its JSON contract (the real run uses 200k samples)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "h5_loader.py"


def test_h5_loader_bench_small(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("h5_loader_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.main(["--samples", "3000", "--ref-samples", "640", "--seek-offsets", "100", "2500",
                       "--no-compression", "--keep", str(tmp_path)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == result
    assert {"ratio", "seek_ratio", "ours_samples_per_s", "reference_samples_per_s"} <= set(last)
    assert last["ratio"] > 0 and last["seek_ratio"] > 0
