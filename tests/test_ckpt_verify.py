"""Checkpoints that prove themselves (manifest, verification before anything is loaded, fallback, strict),
a step's record durable before its checkpoint completes, a no-op resume adds nothing, and divergence that stops.

The unit tests check the manifest and the divergence verdicts without DeepSpeed; the two end-to-end tests run the
real engine on 2 CPU ranks (tests/tiny_train.py)."""
import json
import shutil

import pytest

import faults
from conftest import REPO, deepspeed_release, dist_env, run_deepspeed
from ds_core.checkpoint import manifest as mf
from ds_core.run.divergence import DivergenceGuard
from ds_tools.scaling import summary_of
from test_ds_core_train import ds_json, losses, records

SCRIPT = str(REPO / "tests" / "tiny_train.py")


def _tag_dir(tmp_path, world=2):
    d = tmp_path / "global_step4"
    d.mkdir()
    (d / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 40)
    for r in range(world):
        (d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(bytes([r]) * 5000)
        (d / f"client_rank{r}.pt").write_bytes(b"rng" * 100 + bytes([r]))
    for r in range(world):
        mf.write_part(d, r)
    (d / "hf_model.json").write_text("{}")
    mf.merge_parts(d, world)
    (d / "COMPLETE").write_text(json.dumps({"step": 4, "manifest": True}))
    return d


def test_owner_of_deepspeed_and_client_files():
    assert mf.owner("mp_rank_00_model_states.pt") == 0
    assert mf.owner("zero_pp_rank_3_mp_rank_00_optim_states.pt") == 3
    assert mf.owner("bf16_zero_pp_rank_5_mp_rank_00_optim_states.pt") == 5
    assert mf.owner("client_rank7.pt") == 7
    assert mf.owner("hf_model.json") == 0


def test_manifest_names_flipped_truncated_and_missing_files(tmp_path):
    d = _tag_dir(tmp_path)
    manifest = json.loads((d / mf.MANIFEST).read_text())
    assert set(manifest["files"]) == {"mp_rank_00_model_states.pt", "hf_model.json", "client_rank0.pt",
                                      "client_rank1.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                      "zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    assert not list(d.glob(".manifest_rank*"))
    assert mf.verify(d, 0, 2) == [] and mf.verify(d, 1, 2) == []
    # one flipped bit in rank 1's client state: only rank 1 checks that file, and names it
    data = bytearray((d / "client_rank1.pt").read_bytes())
    data[10] ^= 0x01
    (d / "client_rank1.pt").write_bytes(bytes(data))
    assert mf.verify(d, 0, 2) == []
    (problem,) = mf.verify(d, 1, 2)
    assert "client_rank1.pt" in problem and "xxh3_64 checksum" in problem
    # a resume on ONE rank checks every file, the truncated and the missing one by name
    with open(d / "zero_pp_rank_0_mp_rank_00_optim_states.pt", "r+b") as f:
        f.truncate(100)
    (d / "mp_rank_00_model_states.pt").unlink()
    problems = "\n".join(mf.verify(d, 0, 1))
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt: 100 bytes, manifest 5,000" in problems
    assert "mp_rank_00_model_states.pt: missing" in problems
    assert "client_rank1.pt" in problems
    # a deleted manifest is noticed (COMPLETE promised one); a checkpoint from before manifests is not checked
    (d / mf.MANIFEST).unlink()
    assert "missing (COMPLETE promises a manifest)" in mf.verify(d, 0, 1)[0]
    (d / "COMPLETE").write_text(json.dumps({"step": 4}))
    assert mf.verify(d, 0, 1) is None
    assert mf.quarantine(d).name == "global_step4.corrupt" and not d.exists()


def test_divergence_verdicts():
    g = DivergenceGuard(max_skipped=2, spike_factor=10.0, window=5, min_history=3)
    assert g.observe(1, 5.0, False, 1.0) is None
    assert g.observe(2, 40.0, False, 1.0) is None  # too little history for a spike verdict
    assert g.observe(3, 4.0, False, 1.0) is None
    assert g.observe(4, 4.5, True, None) is None and g.observe(5, 4.5, True, float("inf")) is None
    assert "3 consecutive optimizer steps were skipped (steps 4-6" in g.observe(6, 4.5, True, None)
    g = DivergenceGuard(max_skipped=2, spike_factor=10.0, window=5, min_history=3)
    for s, loss in enumerate([5.0, 4.0, 4.5], 1):
        assert g.observe(s, loss, False, 1.0) is None
    assert "is 11.1x the median 4.5" in g.observe(4, 50.0, False, 1.0)
    assert "applied with gradient norm nan" in DivergenceGuard().observe(1, 1.0, False, float("nan"))
    assert "gradient norm -1 (DeepSpeed's mark" in DivergenceGuard().observe(1, 1.0, False, -1.0)
    assert DivergenceGuard(spike_factor=0).observe(9, 1e9, False, 1.0) is None  # off


def test_scaling_report_reads_the_summary_that_measured(tmp_path):
    f = tmp_path / "metrics.jsonl"
    good = {"type": "summary", "steps": 12, "samples_per_s": 10.0, "world_size": 2}
    f.write_text(json.dumps(good) + "\n" + json.dumps(dict(good, samples_per_s=None)) + "\n")
    assert summary_of(f)["samples_per_s"] == 10.0


@pytest.mark.slow
def test_corrupt_checkpoint_strict_fallback_record_durable_and_noop_resume(tmp_path):
    common = ["--deepspeed_config", ds_json(tmp_path, 1), "--max_steps", "12", "--num_steps_per_checkpoint", "4",
              "--progress_bar", "false", "--throughput_warmup_steps", "0"]
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    # rank 0 dies right after checkpoint 8 is complete: its step record must already be on disk
    proc = run_deepspeed([SCRIPT, "--run_dir", str(run), *common], env=dist_env(**faults.env(kill_after_complete=8)),
                         check=False, timeout=300)
    assert proc.returncode != 0 and (ckpts / "global_step8" / "COMPLETE").is_file()
    before = losses(run)
    assert sorted(before) == list(range(1, 9)), sorted(before)
    # one flipped bit in rank 1's saved RNG state of the newest checkpoint
    f = ckpts / "global_step8" / "client_rank1.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    metrics_bytes = (run / "metrics.jsonl").read_bytes()
    proc = run_deepspeed([SCRIPT, "--run_dir", str(run), *common, "--resume", "true", "--resume_strict", "true"],
                         check=False, timeout=300)
    assert proc.returncode != 0
    assert "client_rank1.pt: xxh3_64 checksum" in proc.stdout and "--resume_strict" in proc.stdout
    assert "resumed from" not in proc.stdout
    assert (run / "metrics.jsonl").read_bytes() == metrics_bytes  # nothing trimmed or appended
    # without --resume_strict: back to step 4, said loudly, the bad checkpoint moved aside, steps 5-8 exactly again
    proc = run_deepspeed([SCRIPT, "--run_dir", str(run), *common, "--resume", "true"], timeout=300)
    assert "WARNING: --resume falls back to" in proc.stdout and "global_step8.corrupt" in proc.stdout
    assert (ckpts / "global_step8.corrupt" / "client_rank1.pt").is_file()
    after = losses(run)
    assert sorted(after) == list(range(1, 13))
    assert [r["step"] for r in records(run, "step")] == list(range(1, 13))  # one record per step
    for step in range(5, 9):
        assert after[step] == before[step], f"step {step}: {after[step]} != {before[step]}"
    # resuming a finished run adds nothing
    metrics_bytes = (run / "metrics.jsonl").read_bytes()
    proc = run_deepspeed([SCRIPT, "--run_dir", str(run), *common, "--resume", "true"], timeout=300)
    assert "nothing to train, no record added" in proc.stdout
    assert (run / "metrics.jsonl").read_bytes() == metrics_bytes


# What a non-finite gradient norm does is DeepSpeed's, per release and optimizer wrapper (ds_core.compat.
# deepspeed_behaviour); the toolkit's answer is the same everywhere: one line, exit status 1, no checkpoint of the
# diverged state. "skips": DeepSpeed skips the update and counts it (the guard stops after --max_skipped_steps in a
# row); "stops": the run stops at the first such step (the fork's ZeRO-1/2 applies it with norm -1, its
# BF16_Optimizer asserts on it).
NONFINITE = {(0, 19): {"zero1_fp32": "skips", "bf16_optimizer": "skips"},
             (0, 16): {"zero1_fp32": "stops", "bf16_optimizer": "stops"}}
WRAPPERS = {"zero1_fp32": ("--precision", "fp32"), "bf16_optimizer": ("--precision", "bf16")}


def _one_line_verdict(proc) -> str:
    lines = [ln for ln in proc.stdout.splitlines() if "error: training diverged" in ln]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_nonfinite_gradients_stop_the_run_in_one_line(tmp_path, wrapper):
    release = deepspeed_release(NONFINITE)
    sched = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3,
                                                          "warmup_num_steps": 20, "warmup_type": "linear"}}}
    if wrapper == "bf16_optimizer":  # fp32 accumulation of bf16 gradients: DeepSpeed's BF16_Optimizer at ZeRO-1
        sched["data_types"] = {"grad_accum_dtype": "fp32"}
    run = tmp_path / "run"
    # NaN gradients (finite loss) at step 3, then from step 7 on: 7 and 8 are tolerated, the 3rd in a row stops
    proc = run_deepspeed([SCRIPT, "--run_dir", str(run), "--deepspeed_config", ds_json(tmp_path, 1, **sched),
                          "--max_steps", "12", "--num_steps_per_checkpoint", "3", "--progress_bar", "false",
                          "--max_skipped_steps", "2", *WRAPPERS[wrapper]],
                         env=dist_env(**faults.env(nan_grad_steps="3,7-")), check=False, timeout=300)
    verdict = _one_line_verdict(proc)
    recs = {r["step"]: r for r in records(run, "step")}
    if NONFINITE[release][wrapper] == "stops":
        assert "step 3" in verdict and "the latest checkpoint is still none" in verdict, verdict
        assert not (run / "checkpoints" / "global_step3").exists() and max(recs, default=0) <= 3
        return
    assert "optimizer step 3 skipped by DeepSpeed" in proc.stdout
    assert "3 consecutive optimizer steps were skipped (steps 7-9" in verdict
    assert "the latest checkpoint is still global_step6" in verdict
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step6"
    assert not (run / "checkpoints" / "global_step9").exists()
    assert [s for s, r in recs.items() if r["skipped"]] == [3, 7, 8, 9] and recs[9]["skipped_steps"] == 4
    # the LR schedule stays on the step counter: a linear warm-up never repeats an LR across a skipped step
    # (DeepSpeed's WarmupLR gives steps 1 and 2 both its minimum, 0; from there on it rises every step)
    lrs = [recs[s]["lr"] for s in sorted(recs)][1:]
    assert all(b > a for a, b in zip(lrs, lrs[1:])), lrs


@pytest.mark.slow
def test_an_exploding_loss_stops_the_run_in_one_line(tmp_path):
    # LR 1e3: the loss explodes; the run stops with a non-zero status instead of training on and exiting 0
    run2 = tmp_path / "run2"
    proc = run_deepspeed([SCRIPT, "--run_dir", str(run2), "--deepspeed_config", ds_json(tmp_path, 1, lr=1e3),
                          "--max_steps", "30", "--num_steps_per_checkpoint", "2", "--progress_bar", "false"],
                         check=False, timeout=300)
    _one_line_verdict(proc)
    shutil.rmtree(run2)
