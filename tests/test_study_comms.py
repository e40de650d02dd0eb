"""The single-allreduce ZeRO-1 configuration with FP32 weights, counted by DeepSpeed's comms_logger: the BERT debug
preset (LAMB, ZeRO-1, fp32: DeepSpeedZeroOptimizer's path, not the BF16_Optimizer that bf16 + ZeRO-1 takes) on 2
CPU ranks, run through ds_tools.study.cell as a study cell runs. One gradient all-reduce per optimizer step; LAMB's
per-tensor norm exchange under ZeRO (bert_ref.layerwise) is recorded under its own name and not counted as one. On
every stack: Habana's fork all-reduces no gradient in this configuration on the CPU accelerator unless its gradient
buckets are grouped by dtype (ds_core.compat.zero_buckets); the comms logger's latency is read as the installed
DeepSpeed keeps it (ds_core.compat.deepspeed_behaviour)."""
from __future__ import annotations

import json

import pytest

from conftest import REPO, run_deepspeed
from test_launch_multinode import make_data

pytestmark = [pytest.mark.slow, pytest.mark.stack]
STEPS = 2


def test_single_allreduce_fp32_bert_one_gradient_collective_per_step(tmp_path):
    from ds_tools.study.report import comms_per_step
    from ds_tools.study.spec import SINGLE_ZERO

    cfg = json.loads((REPO / "ds_configs" / "zero1_bf16_single_allreduce.json").read_text())
    assert all(cfg["zero_optimization"][k] == v for k, v in SINGLE_ZERO.items())  # the shipped JSON is the axis
    cfg.pop("optimizer")  # bert_ref builds its own LAMB (bert_ref.layerwise), as in every BERT run
    cfg["bf16"] = {"enabled": False}
    cfg["zero_allow_untested_optimizer"] = True  # LAMB is not on DeepSpeed's list (a study cell's JSON sets it too)
    cfg["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False, "debug": False}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    run_dir = tmp_path / "run"
    run_deepspeed(["--module", "ds_tools.study.cell", "--study_target", "bert_ref.train", "--preset", "debug",
                   "--deepspeed_config", str(tmp_path / "ds.json"), "--precision", "fp32", "--micro_batch_size", "4",
                   "--input_dir", str(make_data(tmp_path / "data")), "--run_dir", str(run_dir),
                   "--max_steps", str(STEPS), "--throughput_warmup_steps", "1", "--progress_bar", "false",
                   "--save_final_checkpoint", "false", "--export_hf", "false"], timeout=900)
    summary = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert summary["precision"] == "fp32" and summary["steps"] == STEPS, summary
    for rank in range(2):
        stats = json.loads((run_dir / "cell_stats" / f"rank{rank}.json").read_text())
        assert stats["comms_window"] == "training", stats
        per_step = comms_per_step(stats, STEPS)
        assert per_step["grad_collectives_per_step"] == 1.0, stats["comms"]
        assert stats["comms"]["all_reduce"]["latency_ms"] > 0, stats["comms"]
        # the one all-reduce carries every gradient: fp32, one element per trainable parameter
        sizes = [int(s) for s in stats["comms"]["all_reduce"]["sizes"] if int(s) > 64]
        assert len(sizes) == 1 and per_step["grad_bytes_per_step"] == sizes[0], stats["comms"]
        # LAMB's per-tensor norms under ZeRO: one named all-reduce per step, not gradient traffic
        assert per_step["other_collectives"].get("layerwise_norms_all_reduce") == STEPS, stats["comms"]
