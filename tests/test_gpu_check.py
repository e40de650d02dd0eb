"""`make gpu-check` on a machine without CUDA: `python -m bench.gpu_check --cpu_smoke` runs every part's plumbing
(pytest -m gpu, bench.bert_step with its Trainer side, bridgetower_ds.train host + device pipelines and the Trainer
baseline, the BERT-1.5B micro-batch search against ds-tune) with debug presets, and ends with one JSON line that
matches the results file. What it measures here means nothing; that it runs keeps the GPU call from rotting."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, dist_env

pytestmark = pytest.mark.slow


def test_cpu_smoke_runs_every_part_and_reports_one_json_line(tmp_path):
    out = tmp_path / "gpu_check_out"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--cpu_smoke", "--out", str(out)], cwd=REPO,
                          env=dist_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1500)
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    results = json.loads((out / "results.json").read_text())
    assert proc.returncode == 0 and last["ok"], json.dumps(results["parts"], indent=1)[-6000:]
    assert last["gpu_check"] == results["mode"] == "cpu_smoke" and last["parts"] == results["parts"]
    parts = results["parts"]
    assert set(parts) == {"tests", "bert_large", "bridgetower", "bert_1p5b"}
    # the CUDA tests are collected and every one skips with its reason here
    t = parts["tests"]
    assert t["collected"] >= 8 and t["skipped"] == t["collected"] and t["failed"] == 0
    assert any("CUDA" in r for r in t["skip_reasons"])
    b = parts["bert_large"]
    assert b["ours_samples_per_s"] > 0 and b["trainer_samples_per_s"] > 0 and b["step_ratio"] > 0
    bt = parts["bridgetower"]
    assert {v["pipeline_taken"] for v in bt["samples_per_s"].values()} == {"host", "device-cpu"}
    assert bt["trainer_baseline_samples_per_s"] > 0
    for stage in ("zero1", "zero3"):
        z = parts["bert_1p5b"][stage]
        assert z["ds_tune_predicted_micro"] > 0 and z["largest_fit_micro"] >= 1
