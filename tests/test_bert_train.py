"""bert_ref.train on the real DeepSpeed engine, 2 CPU ranks: ZeRO-1 and ZeRO-3 overfit a tiny repeated corpus,
a run resumed from a mid-run checkpoint continues with exactly the losses of the uninterrupted run, held-out eval
counts every test sample once (2 ranks and 1; the 1-rank run also shows that a training rank loads no tool), phase 2
starts from phase 1's fp32 master weights and continues its step numbers, and out-of-vocabulary ids stop a run before
its first step.

Launches: phase 1 = ZeRO-1 uninterrupted (LAMB, via --module, eval every 10 steps), ZeRO-1 resumed from its step-10
checkpoint, phase 2 from it, ZeRO-3 (LANS, activation checkpointing, via the file path), one 1-rank eval run and one
1-rank run that fails on its data."""
from __future__ import annotations

import glob
import json
import shutil
from pathlib import Path

import h5py
import pytest
import torch

from conftest import run_deepspeed

STEPS, CKPT_AT, TEST_SAMPLES = 20, 10, 13


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
    """8 fixed samples (one micro batch of 4 per rank per epoch): every step sees the same data, so it must overfit.
    Plus a held-out file of 13 samples (no multiple of ranks x micro batch), which training never reads."""
    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    d = tmp_path_factory.mktemp("bert_shards")
    write_shard(d / "part-00000.hdf5", synthetic_arrays(8, 128, 20, vocab_size=1024, seed=3))
    write_shard(d / "bert_test_00001.hdf5", synthetic_arrays(TEST_SAMPLES, 128, 20, vocab_size=1024, seed=4),
                vocab_size=1024)
    return d


def _args(shards: Path, run_dir: Path, config: str, *extra: str) -> list[str]:
    return ["--preset", "debug", "--deepspeed_config", f"ds_configs/{config}", "--input_dir", str(shards),
            "--run_dir", str(run_dir), "--max_steps", str(STEPS), "--progress_bar", "false", *extra]


def _assert_eval_counts(run_dir: Path, shards: Path, steps: list[int]) -> list[dict]:
    """Every eval record saw each test sample once: sample and masked-token counts equal the file's."""
    with h5py.File(shards / "bert_test_00001.hdf5", "r") as f:
        masked = int((f["masked_lm_positions"][:] > 0).sum())
    recs = _records(run_dir, "eval")
    assert [r["step"] for r in recs] == steps
    for r in recs:
        assert r["samples"] == TEST_SAMPLES and r["mlm_tokens"] == masked, r
        assert 0 <= r["mlm_accuracy"] <= 1 and 0 <= r["nsp_accuracy"] <= 1 and r["mlm_loss"] > 0 < r["nsp_loss"]
    return recs


# bf16 (DeepSpeed's bf16 optimizer: bf16 weights, fp32 master copies) also where auto would pick fp32 (CPUs without
# native bf16): the phase-2 test tells the fp32 master weights from the bf16 ones
PHASE1_ARGS = ("--optimizer", "lamb", "--learning_rate", "0.02", "--export_hf", "false", "--precision", "bf16")


@pytest.fixture(scope="module")
def phase1(shards, tmp_path_factory) -> Path:
    full = tmp_path_factory.mktemp("phase1") / "full"
    run_deepspeed(["--module", "bert_ref.train",
                   *_args(shards, full, "bert_debug_zero1_bf16.json", *PHASE1_ARGS, "--num_steps_per_checkpoint",
                          str(CKPT_AT), "--eval_every", str(CKPT_AT), "--report_to", "tensorboard")])
    return full


@pytest.mark.stack
@pytest.mark.slow
def test_zero1_overfits_and_resume_matches_uninterrupted(shards, phase1, tmp_path):
    full, resumed = phase1, tmp_path / "resumed"
    recs = _records(full)
    _assert_overfits(recs)
    summary = _records(full, "summary")[-1]
    assert summary["zero_stage"] == 1 and summary["world_size"] == 2 and summary["samples_per_s"] > 0
    evals = _assert_eval_counts(full, shards, [CKPT_AT, STEPS])  # 2 ranks; no second eval at the end
    assert evals[1]["mlm_loss"] != evals[0]["mlm_loss"]  # evaluated with the weights of the step
    _assert_tensorboard(full, recs)

    # The state a run killed right after its step-10 checkpoint leaves behind (kill -9 atomicity of checkpoints
    # themselves is ds_core's test): resume from it to the same max_steps.
    tag = f"global_step{CKPT_AT}"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / tag, resumed / "checkpoints" / tag)
    (resumed / "checkpoints" / "latest").write_text(tag + "\n")
    proc = run_deepspeed(["--module", "bert_ref.train",
                          *_args(shards, resumed, "bert_debug_zero1_bf16.json", *PHASE1_ARGS, "--resume", "true",
                                 "--eval_every", str(CKPT_AT))])
    assert "resumed from" in proc.stdout
    after = _records(resumed)
    assert [r["step"] for r in after] == list(range(CKPT_AT + 1, STEPS + 1))
    for a, b in zip(after, recs[CKPT_AT:]):
        for key in ("loss", "mlm_loss", "nsp_loss", "lr"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key, a[key], b[key])
    (e,) = _assert_eval_counts(resumed, shards, [STEPS])
    for key in ("mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy"):
        assert e[key] == pytest.approx(evals[1][key], rel=1e-6, abs=1e-7), key


def _assert_tensorboard(run_dir: Path, recs: list[dict]) -> None:
    """--report_to tensorboard: rank 0 wrote TensorBoard scalars under run_dir/tensorboard/, the loss of every logged
    step among them (as bridgetower_ds.train does)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted((run_dir / "tensorboard").rglob("events.out.tfevents*"))
    assert files, sorted(p.name for p in run_dir.iterdir())
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    losses = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(losses) == [r["step"] for r in recs]
    assert losses[recs[-1]["step"]] == pytest.approx(recs[-1]["loss"], rel=1e-5)


def _step_counters(ckpt_dir: Path) -> list[int]:
    """Every optimizer step counter (per group and per parameter) in the ZeRO optimizer files of a checkpoint."""
    def walk(x) -> list[int]:
        if isinstance(x, dict):
            return [int(v) for k, v in x.items() if k == "step"] + [c for k, v in x.items() if k != "step"
                                                                    for c in walk(v)]
        return [c for v in x for c in walk(v)] if isinstance(x, (list, tuple)) else []

    out = []
    for f in sorted(glob.glob(str(ckpt_dir / "*optim_states.pt"))):
        out += walk(torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
                    ["base_optimizer_state"])
    return out


@pytest.mark.stack
@pytest.mark.slow
def test_phase2_starts_from_phase1_fp32_master_weights(phase1, tmp_path):
    """Phase 2 (seq 512 shards) from the phase-1 run directory: step numbers continue at 21, the optimizer's step
    counters restart (NVIDIA's --phase2), and with a vanishing LR the phase-2 checkpoint's fp32 master weights are
    phase 1's, bit for bit; they are not bf16 values, so a start from the bf16 weights would not match."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as fp32_of

    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    shards2 = tmp_path / "seq512"
    shards2.mkdir()
    write_shard(shards2 / "bert_training_0.hdf5", synthetic_arrays(8, 512, 80, vocab_size=1024, seed=5),
                vocab_size=1024)
    run2 = tmp_path / "phase2"
    proc = run_deepspeed(["--module", "bert_ref.train",
                          *_args(shards2, run2, "bert_debug_zero1_bf16.json", "--phase", "2", "--optimizer", "lamb",
                                 "--learning_rate", "1e-30", "--export_hf", "false", "--precision", "bf16",
                                 "--init_checkpoint",
                                 str(phase1), "--max_steps", "2")])
    assert f"starting from {phase1} at step {STEPS}" in proc.stdout
    assert [r["step"] for r in _records(run2)] == [STEPS + 1, STEPS + 2]
    assert (run2 / "checkpoints" / "latest").read_text().strip() == f"global_step{STEPS + 2}"
    w1 = fp32_of(str(phase1 / "checkpoints"), f"global_step{STEPS}")
    w2 = fp32_of(str(run2 / "checkpoints"), f"global_step{STEPS + 2}")
    assert w1.keys() == w2.keys()
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
    assert sum(int((w != w.bfloat16().float()).sum()) for w in w1.values()) > 0
    c1 = _step_counters(phase1 / "checkpoints" / f"global_step{STEPS}")
    c2 = _step_counters(run2 / "checkpoints" / f"global_step{STEPS + 2}")
    assert c1 and set(c1) == {STEPS} and c2 and set(c2) == {2}, (c1, c2)


@pytest.mark.slow
def test_eval_on_one_rank_counts_every_sample_once_and_the_rank_loads_no_tool(shards, tmp_path):
    """Started through tests/test_layering.py's RANK_PROBE: the rank that trained, evaluated and saved its final
    checkpoint has imported neither ds_tools nor matplotlib."""
    from test_layering import RANK_PROBE, check_rank_imports

    probe = tmp_path / "probe.py"
    probe.write_text(RANK_PROBE)
    run_dir = tmp_path / "one"
    proc = run_deepspeed([str(probe), *_args(shards, run_dir, "bert_debug_zero1_bf16.json", *PHASE1_ARGS),
                          "--max_steps", "1"], num_ranks=1)
    _assert_eval_counts(run_dir, shards, [1])  # --eval_every 0: once, at the end
    assert (run_dir / "checkpoints" / "global_step1" / "COMPLETE").is_file()
    check_rank_imports(proc.stdout)


@pytest.mark.slow
def test_out_of_vocab_ids_stop_the_run_before_the_first_step(tmp_path):
    """A file without the vocab_size attribute (as NVIDIA writes them) holding id 5000 for the debug preset's
    1024-token vocabulary: the run fails naming file, dataset and row, and no step is taken."""
    from bert_ref.prep.h5io import synthetic_arrays

    shards = tmp_path / "oov"
    shards.mkdir()
    a = synthetic_arrays(8, 128, 20, vocab_size=1024, seed=3)
    a["masked_lm_ids"][5, 0] = 5000
    with h5py.File(shards / "nv_training_0.hdf5", "w") as f:
        for k, v in a.items():
            f.create_dataset(k, data=v)
    run_dir = tmp_path / "run"
    proc = run_deepspeed(["--module", "bert_ref.train",
                          *_args(shards, run_dir, "bert_debug_zero1_bf16.json", *PHASE1_ARGS)], num_ranks=1,
                         check=False)
    assert proc.returncode != 0
    assert "nv_training_0.hdf5 [dataset 'masked_lm_ids']: token ids out of the vocabulary [0, 1024) (first at " \
           "sample 5" in proc.stdout, proc.stdout[-3000:]
    assert not (run_dir / "metrics.jsonl").exists() or not _records(run_dir)


@pytest.mark.stack
@pytest.mark.slow
def test_zero3_lans_activation_checkpointing_overfits_and_exports(shards, tmp_path):
    """Also the sparse MLM head: same objective, and the summary's FLOPs count only the masked positions."""
    run_dir = tmp_path / "z3"
    run_deepspeed(["bert_ref/train.py",
                   *_args(shards, run_dir, "bert_debug_zero3_bf16.json", "--optimizer", "lans", "--learning_rate",
                          "0.02", "--activation_checkpointing", "true", "--sparse_mlm", "true", "--precision",
                          "bf16")])
    _assert_overfits(_records(run_dir))
    _assert_eval_counts(run_dir, shards, [STEPS])  # ZeRO-3 (collective forwards) and the sparse head
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
    # the export holds the module's weights (bf16: trained in bf16) and its config says so under the name this
    # transformers reads (`dtype`, `torch_dtype` before 4.56): the "auto" dtype reloads them as they are saved
    from safetensors.torch import load_file
    from transformers import BertForPreTraining

    from ds_core.compat.hf import dtype_field, dtype_kwargs

    saved = load_file(str(run_dir / "hf_model" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert json.loads((run_dir / "hf_model" / "config.json").read_text())[dtype_field()] == "bfloat16"
    auto = BertForPreTraining.from_pretrained(str(run_dir / "hf_model"), local_files_only=True, **dtype_kwargs("auto"))
    assert auto.dtype == torch.bfloat16
    assert json.loads((run_dir / "run_config.json").read_text())["BertArgs"]["preset"] == "debug"


@pytest.mark.slow
def test_run_by_epochs_ends_its_lr_schedule_on_the_last_step(tmp_path):
    """10 micro batches per epoch, accumulation 4, 3 epochs: 30 micro batches make 7 optimizer steps (a partial
    accumulation carries over the epoch ends). The LR schedule is built for the same 7 steps (ds_core.run.setup decides
    them once): linear decay without warm-up, so step k (1-based) uses lr x (1 - (k-1)/7) and the last step's LR is
    not 0 (before, bert_ref.train counted (10 // 4) x 3 = 6 steps and the 7th update ran at LR 0)."""
    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    shards = tmp_path / "ten"
    shards.mkdir()
    write_shard(shards / "part-00000.hdf5", synthetic_arrays(10, 128, 20, vocab_size=1024, seed=5))
    run_dir = tmp_path / "run"
    lr = 0.01
    run_deepspeed(["--module", "bert_ref.train", "--preset", "debug", "--deepspeed_config",
                   "ds_configs/bert_debug_zero1_bf16.json", "--input_dir", str(shards), "--run_dir", str(run_dir),
                   "--max_epochs", "3", "--micro_batch_size", "1", "--gradient_accumulation_steps", "4",
                   "--precision", "fp32", "--optimizer", "adamw", "--learning_rate", str(lr), "--warmup_proportion",
                   "0", "--lr_scheduler_type", "poly_warmup",  # decays from step 0 (nvidia_poly reaches 0 on the last)
                   "--export_hf", "false", "--save_final_checkpoint", "false", "--progress_bar", "false"],
                  num_ranks=1)
    recs = _records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, 8))
    assert [r["lr"] for r in recs] == pytest.approx([lr * (1 - k / 7) for k in range(7)])
    assert recs[-1]["lr"] > 0


def test_report_to_turns_on_deepspeeds_monitor(tmp_path):
    """--report_to tensorboard (transformers' flag, as bridgetower_ds.train takes it) writes DeepSpeed's tensorboard
    section into the run's resolved DeepSpeed config, under run_dir/tensorboard; a section of the JSON is kept."""
    import bert_ref.train as bert_train
    from bert_ref.configs import BertSettings
    from ds_core.config import parse_settings

    cfg = parse_settings(BertSettings, ["--preset", "debug", "--input_dir", str(tmp_path), "--run_dir",
                                        str(tmp_path / "run"), "--report_to", "tensorboard"])
    ds: dict = {}
    assert bert_train.adjust_ds_config(cfg, ds) == []
    assert ds == {"tensorboard": {"enabled": True, "output_path": str(tmp_path / "run" / "tensorboard"),
                                  "job_name": "bert"},
                  "zero_allow_untested_optimizer": True}  # LAMB / LANS under ZeRO, where the JSON does not say
    mine = {"tensorboard": {"enabled": True, "output_path": "tb"}}
    assert "used as it is" in bert_train.adjust_ds_config(cfg, mine)[0] and mine["tensorboard"]["output_path"] == "tb"
    none = parse_settings(BertSettings, ["--preset", "debug", "--input_dir", str(tmp_path)])
    assert bert_train.adjust_ds_config(none, ds := {}) == [] and ds == {"zero_allow_untested_optimizer": True}
