"""Run directories, early stops and per-rank RNG on the real DeepSpeed engine (CPU, gloo, 2 ranks), plus the file-level
pieces (metrics trimming, checkpoint pruning, refusing or moving a used run_dir) without DeepSpeed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import faults
from conftest import REPO, dist_env, run_deepspeed
from ds_core import checkpoint as ckpt
from ds_core.config import TrainConfig
from ds_core.run.run_dir import RunDirInUse, prepare_run_dir, previous_run
from ds_core.run.stop import EXIT_STOPPED
from test_ds_core_train import SCRIPT, ds_json, losses, records

pytestmark = pytest.mark.stack  # kill -9 during a save and an exact resume, on every stack


def step_counts(run_dir: Path) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in records(run_dir, "step"):
        counts[r["step"]] = counts.get(r["step"], 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------------------------
# file level


def test_trim_metrics_drops_records_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [{"type": "step", "step": s} for s in range(1, 8)] + [{"type": "eval", "step": 6},
                                                                 {"type": "summary", "steps": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"type": "step", "st')  # last line cut by a kill
    assert ckpt.trim_metrics(path, 4) == 5  # steps 5, 6, 7, the eval at 6 and the cut line
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r.get("step", r.get("steps")) for r in kept] == [1, 2, 3, 4, 3]
    assert ckpt.trim_metrics(path, 4) == 0


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> None:
    (root / ckpt.tag_for(step)).mkdir(parents=True)
    (root / ckpt.tag_for(step) / "model.pt").write_bytes(b"x")
    if complete:
        (root / ckpt.tag_for(step) / ckpt.COMPLETE).write_text("{}")


def test_prune_keeps_newest_complete_and_the_latest(tmp_path):
    for s in (2, 4, 6, 8):
        _fake_checkpoint(tmp_path, s)
    _fake_checkpoint(tmp_path, 10, complete=False)  # a save in progress / interrupted: not touched
    (tmp_path / ckpt.LATEST).write_text("global_step2\n")  # e.g. resumed from an older one by hand
    assert ckpt.prune(tmp_path, 2) == ["global_step4"]
    assert sorted(p.name for p in tmp_path.glob("global_step*")) == ["global_step10", "global_step2", "global_step6",
                                                                      "global_step8"]


def test_used_run_dir_is_refused_then_moved_aside(tmp_path):
    run = tmp_path / "run"
    cfg = TrainConfig(run_dir=str(run))
    prepare_run_dir(cfg)  # empty / missing: nothing to say (rank 0 creates it to hold the run_dir lock)
    assert [p.name for p in run.iterdir()] == [".run.lock"]
    (run / "run_config.json").write_text("{}")
    prepare_run_dir(cfg)  # config.json alone is not a run
    (run / "metrics.jsonl").write_text('{"type": "step", "step": 1}\n')
    with pytest.raises(RunDirInUse) as e:
        prepare_run_dir(cfg)
    for part in (str(run), "metrics.jsonl", "--resume", "--overwrite_run_dir"):
        assert part in str(e.value)
    prepare_run_dir(TrainConfig(run_dir=str(run), resume=True))
    prepare_run_dir(TrainConfig(run_dir=str(run), overwrite_run_dir=True), rank=1)  # only rank 0 moves
    assert (run / "metrics.jsonl").exists()
    moved = prepare_run_dir(TrainConfig(run_dir=str(run), overwrite_run_dir=True), rank=0)
    assert moved.parent == run.parent and moved.name.startswith("run.old-")
    assert (moved / "metrics.jsonl").read_text() == '{"type": "step", "step": 1}\n'
    assert [p.name for p in run.iterdir()] == [".run.lock"] and not (moved / ".run.lock").exists()  # lock moved over
    assert previous_run(run) == []


def test_data_order_ignores_the_global_rng():
    """Data order is a function of the global seed only: seeding the process RNGs per rank must not change it."""
    import numpy as np

    from bert_ref.data import plan_segments
    from bridgetower_ds.batching import BatchPlan

    sizes = {f"/d/shard_{i}.h5": 100 + i for i in range(5)}
    orders = []
    for global_seed in (0, 123):
        np.random.seed(global_seed)
        torch.manual_seed(global_seed)
        orders.append(([b.tolist() for b in BatchPlan(50, 1, 2, 4, 42, train=True).rank_batches(1)],
                       [(s.path, s.start, s.stop) for s in plan_segments(sizes, 1, 2, 1, 42, 64)]))
    assert orders[0] == orders[1]


def test_negative_lr_is_refused_before_distributed_init(tmp_path):
    bad = json.loads(Path(ds_json(tmp_path, 1)).read_text())
    bad["optimizer"]["params"]["lr"] = -1e-5
    (tmp_path / "neg.json").write_text(json.dumps(bad))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, SCRIPT, "--run_dir", str(run), "--deepspeed_config",
                           str(tmp_path / "neg.json"), "--max_steps", "2"], env=dist_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "optimizer.params.lr = -1e-05: expected a number > 0" in proc.stderr
    assert not run.exists()  # nothing written: refused before init, config.json and model build


# ---------------------------------------------------------------------------------------------------------------
# 2 ranks, real engine

pytest_slow = pytest.mark.slow
REF_STEPS = 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted ZeRO-1 run of REF_STEPS steps that the interrupted and resumed runs below must match, loss for
    loss (a constant LR: a shorter run's steps are this run's first ones)."""
    tmp = tmp_path_factory.mktemp("reference")
    ref = tmp / "ref"
    run_deepspeed([SCRIPT, "--run_dir", str(ref), "--deepspeed_config", ds_json(tmp, 1), "--max_steps", str(REF_STEPS),
                   "--progress_bar", "false", "--throughput_warmup_steps", "0", "--save_final_checkpoint", "false"])
    return ref


@pytest_slow
def test_signal_on_one_rank_stops_all_then_resume_matches_uninterrupted(tmp_path, reference):
    """SIGTERM reaches rank 1 only (in step 4): both ranks finish step 4, save, exit 75. --max_steps_this_run stops
    the resumed run the same way; the last resume finishes with the losses of an uninterrupted run. The stopped run
    also records each rank's first dropout mask: the ranks must draw different ones (seed + rank)."""
    cfg = ds_json(tmp_path, 1)
    common = ["--deepspeed_config", cfg, "--max_steps", str(REF_STEPS), "--progress_bar", "false",
              "--throughput_warmup_steps", "0"]
    ref = reference

    run, masks = tmp_path / "run", tmp_path / "masks"
    masks.mkdir()
    proc = run_deepspeed([SCRIPT, "--run_dir", str(run), *common], check=False,
                         env=dist_env(**faults.env(signal_at_step=4, signal_rank=1, dropout_dump=str(masks))))
    assert proc.returncode == EXIT_STOPPED, proc.stdout[-4000:]
    ours = [ln for ln in proc.stdout.splitlines() if "[ds_core]" in ln]  # DeepSpeed's launcher may log after it
    assert "stopped after optimizer step 4" in ours[-1] and "planned stop" in ours[-1], ours[-3:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step4"
    summary = records(run, "summary")[-1]
    assert summary["steps"] == 4 and summary["stopped"] and summary["exit_status"] == EXIT_STOPPED
    m0, m1 = torch.load(masks / "mask_rank0.pt"), torch.load(masks / "mask_rank1.pt")
    assert m0.shape == m1.shape and 0.02 < m0.float().mean() < 0.3  # dropout 0.1 was applied
    assert not torch.equal(m0, m1), "ranks drew the same dropout mask"

    proc = run_deepspeed([SCRIPT, "--run_dir", str(run), *common, "--resume", "true", "--max_steps_this_run", "3"],
                         check=False)
    assert proc.returncode == EXIT_STOPPED, proc.stdout[-4000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step7"
    assert records(run, "summary")[-1]["stopped"] == "max_steps_this_run"

    run_deepspeed([SCRIPT, "--run_dir", str(run), *common, "--resume", "true"])
    ref_l, run_l = losses(ref), losses(run)
    assert step_counts(run) == {s: 1 for s in range(1, 11)}
    for step in range(1, 11):
        assert run_l[step] == ref_l[step], f"step {step}: stopped+resumed {run_l[step]} != uninterrupted {ref_l[step]}"


@pytest_slow
def test_kill_during_save_used_run_dir_resume_bitwise_and_save_total_limit(tmp_path, reference):
    """Rank 0 is killed with SIGKILL inside the save of step 6 (checkpoints every 2, keep 2), after DeepSpeed wrote
    its files: `latest` stays at the complete step 4; re-running without --resume is refused before any rank starts;
    --resume goes back to step 4 and trains steps 5-8 with exactly the losses of the uninterrupted run, leaves one
    record per step and only the newest 2 checkpoints; --overwrite_run_dir moves the run aside."""
    cfg = ds_json(tmp_path, 1)
    run = tmp_path / "run"
    common = ["--run_dir", str(run), "--deepspeed_config", cfg, "--max_steps", "8", "--num_steps_per_checkpoint", "2",
              "--save_total_limit", "2", "--progress_bar", "false", "--throughput_warmup_steps", "0"]
    proc = run_deepspeed([SCRIPT, *common], env=dist_env(**faults.env(kill_in_save=6)), check=False, timeout=300)
    assert proc.returncode != 0
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "global_step4"
    assert sorted(p.name for p in ckpts.glob("global_step*") if (p / "COMPLETE").exists()) \
        == ["global_step2", "global_step4"]
    assert (ckpts / "global_step6").is_dir() and not (ckpts / "global_step6" / "COMPLETE").exists()
    # step 5 was logged after the checkpoint of step 4; step 6's record is written after its save (it carries
    # checkpoint_s), which the kill interrupted
    assert max(step_counts(run)) == 5
    before = (run / "metrics.jsonl").read_bytes()
    config_written = (run / "run_config.json").stat().st_mtime_ns  # rewritten right after distributed init

    proc = run_deepspeed([SCRIPT, *common], check=False)
    assert proc.returncode != 0
    assert f"run_dir {run} already holds an earlier run" in proc.stdout and "--overwrite_run_dir" in proc.stdout
    assert (run / "metrics.jsonl").read_bytes() == before
    assert (run / "run_config.json").stat().st_mtime_ns == config_written  # refused before any rank got that far

    run_deepspeed([SCRIPT, *common, "--resume", "true"])
    assert step_counts(run) == {s: 1 for s in range(1, 9)}
    ref_l, run_l = losses(reference), losses(run)
    for step in range(5, 9):
        assert run_l[step] == ref_l[step], f"step {step}: resumed {run_l[step]} != uninterrupted {ref_l[step]}"
    assert (ckpts / "latest").read_text().strip() == "global_step8"
    assert sorted(p.name for p in ckpts.glob("global_step*")) == ["global_step6", "global_step8"]

    run_deepspeed([SCRIPT, *common, "--overwrite_run_dir", "true", "--max_steps", "1"])
    (old,) = tmp_path.glob("run.old-*")
    assert step_counts(old) == {s: 1 for s in range(1, 9)} and (old / "checkpoints" / "global_step8").is_dir()
    assert step_counts(run) == {1: 1} and len(records(run, "summary")) == 1


@pytest_slow
def test_full_disk_during_save_names_path_space_and_latest(tmp_path):
    """A checkpoint write that runs out of space names the path, the free bytes and the checkpoint that stays latest.
    As root: checkpoints/ is a tmpfs with room for one checkpoint and a half; otherwise the writer is patched to
    fail with ENOSPC."""
    cfg = ds_json(tmp_path, 1)
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    env = dist_env()
    mounted = False
    if os.geteuid() == 0:
        # one ZeRO-1 checkpoint of the tiny model on 2 ranks is ~357 kB (+ ~41 kB of DeepSpeed's helper scripts)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=560k", "tmpfs", str(ckpts)]).returncode == 0
    if not mounted:
        env = dist_env(**faults.env(disk_full_at=4))
    try:
        proc = run_deepspeed([SCRIPT, "--run_dir", str(run), "--deepspeed_config", cfg, "--max_steps", "6",
                              "--num_steps_per_checkpoint", "2", "--progress_bar", "false"], env=env, check=False)
        assert proc.returncode != 0
        out = proc.stdout
        assert f"writing checkpoint {ckpts / 'global_step4'} failed" in out, out[-4000:]
        assert "bytes free on the file system of" in out and "`latest` still names global_step2" in out
        if not mounted:
            assert "No space left on device" in out
        assert (ckpts / "latest").read_text().strip() == "global_step2"
        assert not (ckpts / "global_step4" / "COMPLETE").exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(ckpts)], check=True)


def test_bert_optimizer_in_code_and_json_is_refused_before_distributed_init(tmp_path):
    """bert_ref builds its optimizer in code; a DeepSpeed JSON with an "optimizer" section is refused before any
    distributed init or model build (it used to fail in build_engine)."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "bert_ref.train", "--preset", "debug", "--input_dir", str(tmp_path),
                           "--run_dir", str(run), "--deepspeed_config", "zero1_bf16.json"], env=dist_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "zero1_bf16.json has an \"optimizer\" section, but this model builds its optimizer in code" in proc.stderr
    assert not run.exists()
