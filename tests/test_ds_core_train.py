"""ds_core end to end on the real DeepSpeed engine (CPU accelerator, gloo, 2 ranks): ZeRO 0-3 training, NaN guard,
incompatible resume, ZeRO-3 export to Hugging Face format."""
import json
import re
from pathlib import Path

import pytest

import faults
from conftest import REPO, dist_env, run_deepspeed, run_group
from ds_core.config import DS_CONFIG_DIR
from ds_core.rank.shm import SHM_DIR

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "tests" / "tiny_train.py")
SUMMARY_FIELDS = ["model", "world_size", "nodes", "accelerators_per_node", "accelerator", "micro_batch", "grad_accum",
                  "zero_stage", "precision", "warmup_steps_excluded", "samples_per_s", "seqs_per_s_per_accelerator",
                  "tokens_per_s", "tflops_per_accelerator", "mfu"]


def ds_json(tmp_path: Path, stage: int, lr: float = 3e-3, accum: int = 1, **extra) -> str:
    """A shipped ZeRO config with a learning rate that lets the tiny model learn in a few steps."""
    cfg = json.loads((DS_CONFIG_DIR / f"zero{stage}_bf16.json").read_text())
    cfg["optimizer"]["params"]["lr"] = lr
    cfg["gradient_accumulation_steps"] = accum
    cfg.update(extra)
    p = tmp_path / f"zero{stage}.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, "step")}


@pytest.mark.stack  # every ZeRO stage of the installed DeepSpeed (bf16 ZeRO-0 takes another wrapper on the fork)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tiny_model_trains_with_each_zero_stage(tmp_path, stage):
    run = tmp_path / "run"
    extra = ["--export_dir", str(tmp_path / "hf")] if stage == 3 else []
    # ZeRO-2 also checks that metrics reach DeepSpeed's monitor when the JSON enables one.
    monitor = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "tiny"}} \
        if stage == 2 else {}
    # ZeRO-1 also profiles the last 2 of its 4 warm-up steps (--profile_steps): the summary says where a step went
    profile = ["--profile_steps", "2", "--throughput_warmup_steps", "4"] if stage == 1 else []
    # ZeRO-1 also records where the loop cuts Gaudi's lazy-mode graph (a recorder in htcore.mark_step's place)
    marks = tmp_path / "marks.txt"
    env = dist_env(**faults.env(lazy_marks=str(marks))) if stage == 1 else None
    run_deepspeed([SCRIPT, "--run_dir", str(run), "--deepspeed_config", ds_json(tmp_path, stage, accum=2, **monitor),
                   "--max_steps", "30", "--progress_bar", "false", "--save_final_checkpoint", "false", *extra,
                   *profile], env=env)
    ls = losses(run)
    first, last = sum(ls[s] for s in (1, 2, 3)) / 3, sum(ls[s] for s in (28, 29, 30)) / 3
    assert last < first - 0.05, f"ZeRO-{stage}: loss did not fall: {ls}"
    summary = records(run, "summary")[0]
    assert summary["zero_stage"] == stage and summary["world_size"] == 2 and summary["grad_accum"] == 2
    for f in SUMMARY_FIELDS:
        assert summary[f] is not None, f
    if stage == 1:
        # after each backward and after each engine.step (every micro step), as GaudiTrainer and Habana's BERT do
        assert marks.read_text().split() == ["backward", "mark", "step", "mark"] * 8
        prof = summary["profile"]
        assert prof["profiled_steps"] == 2 and prof["aten_ops_per_step"] > 0 and prof["device_idle_share"] is None
        assert any(name.startswith("aten::") for name, _ in prof["top10_us_per_step"]), prof
    else:
        assert "profile" not in summary
    if stage == 2:
        csvs = {p.name for p in (tmp_path / "csv").rglob("*.csv")}
        # Trainer's tags (train/loss, train/learning_rate): DeepSpeed's csv monitor writes train_loss.csv
        assert {"train_samples_per_s.csv", "train_loss.csv", "train_learning_rate.csv"} <= csvs, csvs
    if stage == 3:  # ZeRO-3 partitions were gathered into a loadable Hugging Face model
        from transformers import BertForSequenceClassification

        model = BertForSequenceClassification.from_pretrained(tmp_path / "hf")
        assert model.bert.embeddings.word_embeddings.weight.shape == (64, 32)
        assert model.bert.embeddings.word_embeddings.weight.abs().sum() > 0


# kill -9 during a save, then a bitwise-exact resume: tests/test_ds_core_run_dir.py's
# test_kill_during_save_used_run_dir_resume_bitwise_and_save_total_limit (one killed run for both).


def test_nan_stops_run_and_incompatible_resume_is_named(tmp_path):
    run = tmp_path / "run"
    common = ["--run_dir", str(run), "--max_steps", "10", "--num_steps_per_checkpoint", "3", "--progress_bar", "false"]
    proc = run_deepspeed([SCRIPT, *common, "--deepspeed_config", ds_json(tmp_path, 1)],
                         env=dist_env(**faults.env(nan_at_step=5)), check=False)
    assert proc.returncode != 0
    assert "loss is nan at optimizer step 5" in proc.stdout
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step3"
    assert not (run / "checkpoints" / "global_step5").exists()
    # The checkpoint was written with ZeRO-1; resuming it as ZeRO-3 must say what differs.
    proc = run_deepspeed([SCRIPT, *common, "--deepspeed_config", ds_json(tmp_path, 3), "--resume", "true"],
                         check=False)
    assert proc.returncode != 0
    assert "zero_stage: checkpoint 1, this run 3" in proc.stdout


def test_mpirun_discovery(tmp_path):
    """`mpirun -n 2 python script.py`: ranks come from mpi4py discovery (no launcher variables)."""
    import sys

    mpirun = Path(sys.executable).parent / "mpirun"
    if not mpirun.exists():
        pytest.skip("no mpirun in the venv (install the 'mpich' extra)")
    env = {k: v for k, v in dist_env().items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    run = tmp_path / "run"
    proc = run_group([str(mpirun), "-n", "2", sys.executable, SCRIPT, "--run_dir", str(run), "--max_steps", "3",
                      "--progress_bar", "false", "--deepspeed_config", ds_json(tmp_path, 1)], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    summary = records(run, "summary")[0]
    assert summary["world_size"] == 2 and summary["steps"] == 3


SHM_WORKER = """
import os
import deepspeed
import torch
from ds_core.rank.dist import init_distributed, shutdown_distributed
from ds_core.rank.shm import SHM_DIR, cpu_shm_buffer_name
from ds_core.rank.process_end import end_process

deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed alone: its CPU allreduce workspace is created
rank = torch.distributed.get_rank()
existed = (SHM_DIR / cpu_shm_buffer_name(rank)).exists()
torch.distributed.barrier()
dist = init_distributed()  # ours, on top: releases the name
gone = not (SHM_DIR / cpu_shm_buffer_name(rank)).exists()
x = torch.full((4,), float(rank + 1), dtype=torch.bfloat16)
torch.distributed.all_reduce(x)
shutdown_distributed()  # right after a collective: without it about 4 runs in 10 aborted at exit
shutdown_distributed()  # a second call is a no-op
down = not torch.distributed.is_initialized()
print(f"SHM rank={rank} port={os.environ['MASTER_PORT']} existed={existed} gone={gone} sum={x[0].item()} "
      f"down={down}", flush=True)
end_process(0)  # as every rank entry ends (ds_core.rank.process_end.run_main)
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_cpu_allreduce_workspace_is_not_left_in_dev_shm(tmp_path, ranks):
    """DeepSpeed's CPU allreduce op leaves a ~66 MB /dev/shm file per rank after every run (a world of one too);
    init_distributed unlinks each rank's own once all ranks have mapped it, and collectives still work.
    shutdown_distributed then tears the group down, so the ranks exit cleanly right after a collective."""
    if not SHM_DIR.is_dir():
        pytest.skip("no /dev/shm")
    script = tmp_path / "shm_worker.py"
    script.write_text(SHM_WORKER)
    proc = run_deepspeed([str(script)], num_ranks=ranks)
    # the ranks' lines can interleave on the launcher's stdout (seen: "down=TrueSHM rank=1 ..."): match the
    # records, with closed alternatives for the words, not lines
    keys = ("rank", "port", "existed", "gone", "sum", "down")
    record = r"SHM rank=(\d+) port=(\d+) existed=(True|False) gone=(True|False) sum=([\d.]+) down=(True|False)"
    fields = [dict(zip(keys, m)) for m in re.findall(record, proc.stdout)]
    assert sorted(f["rank"] for f in fields) == [str(r) for r in range(ranks)], proc.stdout[-3000:]
    for f in fields:
        assert f["existed"] == "True", f"DeepSpeed created no workspace (layout changed?): {f}"
        assert f["gone"] == "True" and float(f["sum"]) == ranks * (ranks + 1) / 2, f
        assert f["down"] == "True", f
    port = fields[0]["port"]
    left = [p.name for p in SHM_DIR.glob(f"deepspeed_allreduce_buffer_*_{port}_*")]
    assert not left, f"left in /dev/shm after the run: {left}"
