"""bert_ref.train on the real DeepSpeed engine, 2 CPU ranks: ZeRO-1 and ZeRO-3 overfit a tiny repeated corpus,
and a run resumed from a mid-run checkpoint continues with exactly the losses of the uninterrupted run.

Three launches in all (each costs a launcher start-up): ZeRO-1 uninterrupted (LAMB, via --module), ZeRO-1 resumed
from the uninterrupted run's step-10 checkpoint, and ZeRO-3 (LANS, activation checkpointing, via the file path)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_deepspeed

STEPS, CKPT_AT = 20, 10


def _records(run_dir: Path, kind: str = "step") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def _assert_overfits(recs: list[dict]) -> None:
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for key, drop in (("mlm_loss", 0.3), ("nsp_loss", 0.05)):
        first = sum(r[key] for r in recs[:3]) / 3
        last = sum(r[key] for r in recs[-3:]) / 3
        assert last < first - drop, f"{key} did not fall: first 3 steps {first:.4f}, last 3 {last:.4f}"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """8 fixed samples (one micro batch of 4 per rank per epoch): every step sees the same data, so it must overfit."""
    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    d = tmp_path_factory.mktemp("bert_shards")
    write_shard(d / "part-00000.hdf5", synthetic_arrays(8, 128, 20, vocab_size=1024, seed=3))
    return d


def _args(shards: Path, run_dir: Path, config: str, *extra: str) -> list[str]:
    return ["--preset", "debug", "--deepspeed_config", f"ds_configs/{config}", "--input_dir", str(shards),
            "--run_dir", str(run_dir), "--max_steps", str(STEPS), "--progress_bar", "false", *extra]


@pytest.mark.slow
def test_zero1_overfits_and_resume_matches_uninterrupted(shards, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_deepspeed(["--module", "bert_ref.train",
                   *_args(shards, full, "bert_debug_zero1_bf16.json", "--optimizer", "lamb", "--learning_rate",
                          "0.02", "--num_steps_per_checkpoint", str(CKPT_AT), "--export_hf", "false")])
    recs = _records(full)
    _assert_overfits(recs)
    summary = _records(full, "summary")[-1]
    assert summary["zero_stage"] == 1 and summary["world_size"] == 2 and summary["samples_per_s"] > 0

    # The state a run killed right after its step-10 checkpoint leaves behind (kill -9 atomicity of checkpoints
    # themselves is ds_core's test): resume from it to the same max_steps.
    tag = f"global_step{CKPT_AT}"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / tag, resumed / "checkpoints" / tag)
    (resumed / "checkpoints" / "latest").write_text(tag + "\n")
    proc = run_deepspeed(["--module", "bert_ref.train",
                          *_args(shards, resumed, "bert_debug_zero1_bf16.json", "--optimizer", "lamb",
                                 "--learning_rate", "0.02", "--resume", "true", "--export_hf", "false")])
    assert "resumed from" in proc.stdout
    after = _records(resumed)
    assert [r["step"] for r in after] == list(range(CKPT_AT + 1, STEPS + 1))
    for a, b in zip(after, recs[CKPT_AT:]):
        for key in ("loss", "mlm_loss", "nsp_loss", "lr"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key, a[key], b[key])


@pytest.mark.slow
def test_zero3_lans_activation_checkpointing_overfits_and_exports(shards, tmp_path):
    """Also the sparse MLM head: same objective, and the summary's FLOPs count only the masked positions."""
    run_dir = tmp_path / "z3"
    run_deepspeed(["bert_ref/train.py",
                   *_args(shards, run_dir, "bert_debug_zero3_bf16.json", "--optimizer", "lans", "--learning_rate",
                          "0.02", "--activation_checkpointing", "true", "--sparse_mlm", "true")])
    _assert_overfits(_records(run_dir))
    summary = _records(run_dir, "summary")[-1]
    assert summary["zero_stage"] == 3
    from bert_ref.configs import debug as _debug
    from bert_ref.model import flops_per_sequence

    assert summary["flops_per_sample"] == pytest.approx(flops_per_sequence(_debug(1), mlm_positions=20))
    assert summary["flops_per_sample"] < flops_per_sequence(_debug(1))
    # the exported model (ZeRO-3 partitions gathered) is phase 2's --init_checkpoint
    from bert_ref.configs import debug
    from bert_ref.model import build_model

    model = build_model(debug(2), init_checkpoint=str(run_dir / "hf_model"))
    assert model.bert.embeddings.word_embeddings.weight.shape == (1024, 64)
    assert json.loads((run_dir / "config.json").read_text())["BertArgs"]["preset"] == "debug"
