"""bench.bert_step (run as `python -m bench.bert_step`): the two sides do the same work (real DeepSpeed engines,
real Trainer, tiny model), and the summary of interleaved windows (median ratio and spread, refusal when the sides
differ). No timing is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _window(rate: float, **over) -> dict:
    rec = dict(samples_per_s=rate, cpu_samples_per_s=rate / 2, samples_per_step=8.0, optimizer="NVLAMB",
               trust_ratio_tensors=46, threads=1,
               peak_rss_bytes=1, mfu=0.1, flops_per_seq=1.0, mlm_head="sparse (20/seq)", fast_dropout=True,
               peak_tflops=1.0)
    rec.update(over)
    return rec


def _summarize(tmp_path: Path, rounds: list[dict]) -> subprocess.CompletedProcess:
    """The bench's own summary of recorded windows (`--summarize_windows`), run as the bench is run: nothing imports
    bench (tests/test_layering.py)."""
    f = tmp_path / "windows.json"
    f.write_text(json.dumps({"windows": rounds}))
    return subprocess.run([sys.executable, "-m", "bench.bert_step", "--no_malloc_tuning", "--summarize_windows",
                           str(f)], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=300)


def test_interleaved_median_and_spread(tmp_path):
    rounds = [{"ours": _window(3.0), "trainer": _window(2.0)}, {"trainer": _window(2.0), "ours": _window(2.0)},
              {"ours": _window(4.0), "trainer": _window(1.0)}]
    proc = _summarize(tmp_path, rounds)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["step_ratio_rounds"] == [1.5, 1.0, 4.0]  # each round: its two adjacent windows
    assert res["step_ratio"] == 1.5 and res["step_ratio_min"] == 1.0 and res["step_ratio_max"] == 4.0
    assert res["ours_samples_per_s"] == 3.0 and res["trainer_samples_per_s"] == 2.0
    assert res["both_optimizer"] == "NVLAMB"
    assert res["cpu_step_ratio_rounds"] == [1.5, 1.0, 4.0]


@pytest.mark.parametrize("key,value", [("optimizer", "AdamW"), ("samples_per_step", 6.0),
                                       ("trust_ratio_tensors", 2), ("threads", 2)])
def test_interleaved_refuses_different_work(tmp_path, key, value):
    proc = _summarize(tmp_path, [{"ours": _window(1.0), "trainer": _window(1.0, **{key: value})}])
    assert proc.returncode != 0
    assert f"differ in {key}" in proc.stderr


# One round of both sides on the debug preset (the same optimizer step, the same samples per step): checked on the
# runs `python -m bench.gpu_check --cpu_smoke` makes (tests/test_gpu_check.py), which start this bench anyway.


@pytest.mark.slow
def test_memory_launch_runs_zero0_and_zero1_on_two_ranks(tmp_path):
    """`--memory`'s launch path (2 local ranks, ZeRO-0 then ZeRO-1, LANS) on the tiny Pre-LN preset. It once failed
    at DeepSpeed's batch assertion (train_batch_size set for one rank); ZeRO-1 must hold half the optimizer state
    (fp32 master + moments partitioned over 2 ranks) of ZeRO-0."""
    proc = subprocess.run([sys.executable, "-m", "bench.bert_step", "--no_malloc_tuning", "--memory_only",
                           "--memory_model", "debug_pre_ln", "--precision", "fp32"], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["memory_model"] == "debug_pre_ln" and "step_ratio" not in res
    assert res["zero1_optimizer_state_bytes_per_rank"] < res["zero0_optimizer_state_bytes_per_rank"]
    assert res["zero1_over_zero0_optimizer_memory"] == pytest.approx(0.5, abs=0.01)
    assert res["memory_target_met"] is True
