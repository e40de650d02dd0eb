"""`make gpu-check` on a machine without CUDA: the plan (parts most valuable first, skipped when the budget left
cannot hold their estimate; the results file valid JSON after each part), and: `python -m bench.gpu_check --cpu_smoke`
runs every part's plumbing (pytest -m gpu, bench.bert_step with its Trainer side doing our side's work,
bridgetower_ds.train host + device pipelines and the Trainer baseline, the BERT-1.5B micro-batch search against
ds-tune) with debug presets, and ends with one JSON line that matches the results file. What it measures here means
nothing; that it runs keeps the GPU call from rotting."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from bench import gpu_check
from conftest import REPO, dist_env
from ds_core.compat.torch_releases import meta_device


def test_plan_keeps_the_order_and_drops_what_does_not_fit():
    est = gpu_check.ESTIMATE_S["gpu"]
    full = gpu_check.plan(gpu_check.PARTS, "gpu", sum(est.values()))
    assert [p for p, _, f in full if f] == list(gpu_check.PARTS) == ["bert_large", "bridgetower", "tests", "bert_1p5b"]
    # room for the first part and the last (cheaper than the third) only: the third is dropped, the last kept
    room = est["bert_large"] + est["bridgetower"] + est["bert_1p5b"]
    assert est["tests"] > est["bert_1p5b"]
    assert [p for p, _, f in gpu_check.plan(gpu_check.PARTS, "gpu", room)] == list(gpu_check.PARTS)
    assert [f for _, _, f in gpu_check.plan(gpu_check.PARTS, "gpu", room)] == [True, True, False, True]
    assert not any(f for _, _, f in gpu_check.plan(gpu_check.PARTS, "gpu", min(est.values()) - 1))
    # the most valuable part does not fit: cheaper ones after it still run while they fit (bridgetower, bert_1p5b)
    no_first = gpu_check.plan(gpu_check.PARTS, "gpu", est["bert_large"] - 1)
    assert [f for _, _, f in no_first] == [False, True, False, True]


def test_a_budget_too_small_skips_every_part_with_its_estimate(tmp_path):
    out = tmp_path / "gc"
    rc = gpu_check.main(["--cpu_smoke", "--budget", "1", "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    assert rc == 0 and res["ok"] and res["mode"] == "cpu_smoke" and list(res["parts"]) == list(gpu_check.PARTS)
    for part, rec in res["parts"].items():
        assert rec["skipped_for_budget"] and rec["estimate_s"] == gpu_check.ESTIMATE_S["cpu_smoke"][part]
    assert "torch" in res["device"] and isinstance(res["nvidia_smi"], str)


def test_the_install_time_counts_against_the_budget(tmp_path):
    out = tmp_path / "gc"
    gpu_check.main(["--cpu_smoke", "--budget", "100000", "--started_at", str(time.time() - 100000),
                    "--part", "tests", "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    assert res["parts"]["tests"]["skipped_for_budget"] and res["spent_before_s"] >= 100000


def test_results_file_is_written_valid_after_each_part_and_its_log_tails_are_bounded(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "big.log").write_text("x" * 10 * gpu_check.LOG_TAIL_CHARS + "END")
    path = tmp_path / "results.json"
    results = {"parts": {"a": {"ok": True}}}
    gpu_check.write_results(path, results, tmp_path / "logs")
    res = json.loads(path.read_text())
    assert res["log_tails"]["big"].endswith("END") and len(res["log_tails"]["big"]) == gpu_check.LOG_TAIL_CHARS
    assert not path.with_suffix(".tmp").exists()


@pytest.mark.slow
def test_cpu_smoke_runs_every_part_and_reports_one_json_line(tmp_path):
    out = tmp_path / "gpu_check_out"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--cpu_smoke", "--budget", "100000", "--out",
                           str(out)], check=False, cwd=REPO,
                          env=dist_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1500)
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    results = json.loads((out / "results.json").read_text())
    assert proc.returncode == 0 and last["ok"], json.dumps(results["parts"], indent=1)[-6000:]
    assert last["gpu_check"] == results["mode"] == "cpu_smoke" and last["parts"] == results["parts"]
    parts = results["parts"]
    assert list(parts) == list(gpu_check.PARTS) and not any(p.get("skipped_for_budget") for p in parts.values())
    # the CUDA tests are collected and every one skips with its reason here
    t = parts["tests"]
    assert t["collected"] >= 8 and t["skipped"] == t["collected"] and t["failed"] == 0
    assert any("CUDA" in r for r in t["skip_reasons"])
    for accum in (2, 1):
        b = parts["bert_large"][f"accum{accum}"]
        assert b["grad_accum"] == accum, b
        assert b["ours_samples_per_s"] > 0 and b["trainer_samples_per_s"] > 0 and b["step_ratio"] > 0
        for side in ("ours", "trainer"):  # where the time went, from CPU events here
            prof = b["profile"][side]
            assert prof["aten_ops_per_step"] > 0 and len(prof["top10_us_per_step"]) == 10, prof
        assert_bench_sides_do_the_same_work(out / "logs" / f"bert_large_micro{b['micro_batch']}_accum{accum}.log",
                                            b["micro_batch"] * accum)
    assert parts["bert_large"]["accum2_compiled"] == {"skipped": "cpu smoke: no compile"}
    bt = parts["bridgetower"]
    assert {v["pipeline_taken"] for v in bt["samples_per_s"].values()} == {"host", "device-cpu"}
    assert bt["trainer_baseline_samples_per_s"] > 0
    # where BridgeTower's step went, ours (a run's --profile_steps) and the Trainer's, from CPU events here
    for prof in [v["profile"] for v in bt["samples_per_s"].values()] + [bt["trainer_baseline_profile"]]:
        assert prof["profiled_steps"] == 1 and prof["aten_ops_per_step"] > 0 and prof["top10_us_per_step"], prof
    for stage in ("zero1", "zero3"):
        z = parts["bert_1p5b"][stage]
        assert z["ds_tune_predicted_micro"] > 0 and z["largest_fit_micro"] >= 1


def assert_bench_sides_do_the_same_work(log, samples_per_step: int) -> None:
    """bench.bert_step's last JSON line (in the smoke's log of that cell): our loop and transformers' Trainer, each in
    its own process, both step our NVLAMB with per-tensor trust ratios (transformers' deepspeed_init drops
    optimizers=(opt, None) and builds AdamW: the bench once compared against that), on as many samples per step."""

    from bert_ref.configs import debug
    from bert_ref.model import hf_config, model_class

    res = json.loads(next(x for x in reversed(log.read_text().splitlines()) if x.startswith("{")))
    with meta_device():
        n_tensors = len(list(model_class(debug(1))(hf_config(debug(1))).parameters()))  # tied weights once
    assert res["both_optimizer"] == "NVLAMB"
    assert res["cpu_step_ratio"] > 0
    assert res["both_trust_ratio_tensors"] == n_tensors  # per parameter tensor, not per ZeRO flat partition
    assert res["both_samples_per_step"] == samples_per_step  # micro batch x accumulation
    assert res["both_threads"] == 1
    assert len(res["step_ratio_rounds"]) == 1 and res["step_ratio"] > 0
