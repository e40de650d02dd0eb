"""Our run's --output_dir beside a real transformers.Trainer's: the same debug BridgeTower, the same
strategy flags, the steps run_bridgetower.py takes after training (save_model, tokenizer and image processor,
save_metrics("train"), save_state, evaluate -> save_metrics("validation")) plus predict. File names (of the output
directory and of each checkpoint-N), trainer_state.json keys (final and per checkpoint), log_history entry keys,
results keys, checkpoint names, TensorBoard tags and the export's state-dict keys are compared; what differs is
pinned here, so a change on either side shows. training_args.bin is loaded back and compared with run_config.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import dist_env, run_deepspeed
from ds_core.run.stop import EXIT_STOPPED

pytestmark = [pytest.mark.stack, pytest.mark.each_gaudi]  # Trainer's files and a resume, on every stack

STEPS, MICRO, EVAL_STEPS = 4, 4, 2

# our own files beside Trainer's (Trainer's runs/ TensorBoard directory is our tensorboard/)
OURS_ONLY_FILES = {"run_config.json", "ds_config.json", "metrics.jsonl", "checkpoints", "tensorboard",
                   "eval_results.json"}
# Trainer's final train log (TensorBoardCallback.on_log after train()): written once, at the last step
FINAL_TAGS = {"train/epoch", "train/train_runtime", "train/train_samples_per_second", "train/train_steps_per_second",
              "train/total_flos", "train/train_loss"}
# in each checkpoint-N, besides the checkpoint itself: Trainer's _save_checkpoint files we write too
CHECKPOINT_FILES = {"trainer_state.json", "training_args.bin"}


def _trainer_reference(out: Path) -> None:
    """What run_bridgetower.py does with Trainer, on 16 random (caption, image) pairs of the debug model."""
    import torch
    from transformers import BridgeTowerForContrastiveLearning, Trainer, TrainingArguments

    from bridgetower_ds.configs import debug
    from bridgetower_ds.image_processor import image_processor
    from bridgetower_ds.tokenizer import debug_tokenizer

    torch.manual_seed(0)
    tok = debug_tokenizer(16)
    caps = [f"a {c} shape number {i}" for i, c in enumerate(["red", "green", "blue", "yellow"] * 4)]

    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return len(caps)

        def __getitem__(self, i):
            enc = tok(caps[i], max_length=16, truncation=True, padding="max_length")
            return {"input_ids": torch.tensor(enc["input_ids"]), "attention_mask": torch.tensor(enc["attention_mask"]),
                    "pixel_values": torch.rand(3, 32, 32)}

    def collate(rows):  # run_bridgetower.py's collate_fn
        return {**{k: torch.stack([r[k] for r in rows]) for k in rows[0]}, "return_loss": True}

    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=MICRO,
                             per_device_eval_batch_size=MICRO, eval_strategy="steps", eval_steps=EVAL_STEPS,
                             save_steps=EVAL_STEPS, logging_steps=1, metric_for_best_model="loss",
                             report_to=["tensorboard"], use_cpu=True,
                             dataloader_num_workers=0, remove_unused_columns=False, do_train=True, do_eval=True)
    trainer = Trainer(model=BridgeTowerForContrastiveLearning(debug()), args=args, train_dataset=Pairs(),
                      eval_dataset=Pairs(), data_collator=collate)
    result = trainer.train()
    trainer.save_model()
    tok.save_pretrained(str(out))
    image_processor("", 32).save_pretrained(str(out))
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    trainer.save_metrics("validation", trainer.evaluate())
    trainer.save_metrics("predict", trainer.predict(Pairs(), metric_key_prefix="test").metrics)
    # run_bridgetower.py's last call (model_name_or_path a local directory: finetuned_from None)
    trainer.create_model_card(finetuned_from=None, tasks="contrastive-image-text-modeling")


def _scalars(root: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard scalars under root: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict = {}
    for f in root.rglob("events.out.tfevents*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def _keys(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def _assert_card_is_trainers(theirs: Path, ours: Path) -> None:
    """The model card has Trainer's template: its sections in its order, its metadata keys, every hyperparameter it
    names (ours adds DeepSpeed's), its per-evaluation results table's columns."""
    from huggingface_hub import ModelCard

    t, o = ModelCard.load(str(theirs)), ModelCard.load(str(ours))

    def sections(card):
        return [ln for ln in card.text.splitlines() if ln.startswith("##")]

    def hyperparameters(card):
        part = card.text.split("### Training hyperparameters", 1)[1].split("###", 1)[0]
        return {ln[2:].split(":")[0] for ln in part.splitlines() if ln.startswith("- ")}

    def table_head(card):
        return next(ln for ln in card.text.splitlines() if ln.startswith("| Training Loss"))

    assert sections(o) == sections(t)
    assert set(t.data.to_dict()) <= set(o.data.to_dict()), (t.data.to_dict(), o.data.to_dict())
    assert hyperparameters(t) <= hyperparameters(o), hyperparameters(t) - hyperparameters(o)
    assert {c.strip() for c in table_head(t).split("|")} <= {c.strip() for c in table_head(o).split("|")}


@pytest.mark.slow
def test_output_dir_matches_a_real_trainers_files_and_keys(tmp_path):
    from test_bt_train import make_caption_set

    ref = tmp_path / "trainer"
    _trainer_reference(ref)
    run = tmp_path / "ours"
    manifest = make_caption_set(tmp_path / "data", 40)
    argv = ["--module", "bridgetower_ds.train", "--do_train", "--do_eval", "--do_predict",
            "--dataset_path", str(manifest), "--output_dir", str(run), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", str(MICRO // 2), "--max_seq_length", "16",
            "--eval_strategy", "steps", "--eval_steps", str(EVAL_STEPS), "--save_steps", str(EVAL_STEPS),
            "--logging_steps", "1", "--metric_for_best_model", "loss", "--report_to", "tensorboard",
            "--progress_bar", "false", "--precision", "fp32", "--dataloader_num_workers", "0"]
    # ours in two processes: stopped after checkpoint-2, then Trainer's --resume_from_checkpoint (no value: the
    # newest) to the end; everything below holds across the resume
    first = run_deepspeed(argv + ["--max_steps_this_run", str(EVAL_STEPS)], env=dist_env(), check=False)
    assert first.returncode == EXIT_STOPPED, first.stdout[-4000:]
    assert (run / f"checkpoint-{EVAL_STEPS}" / "trainer_state.json").is_file()
    assert not (run / "trainer_state.json").exists() and not (run / "training_args.bin").exists()
    out = run_deepspeed(argv + ["--resume_from_checkpoint"], env=dist_env()).stdout
    assert f"resumed from {run / 'checkpoints' / f'global_step{EVAL_STEPS}'} at step {EVAL_STEPS}" in out
    theirs, ours = {p.name for p in ref.iterdir()}, {p.name for p in run.iterdir()}
    assert theirs - ours == {"runs"}  # runs/: Trainer's TensorBoard dir (ours: tensorboard/)
    assert ours - theirs == OURS_ONLY_FILES
    assert {"checkpoint-2", "checkpoint-4"} <= theirs & ours
    assert (run / "checkpoint-4").resolve() == (run / "checkpoints" / "global_step4").resolve()

    st_t, st_o = (json.loads((d / "trainer_state.json").read_text()) for d in (ref, run))
    assert set(st_t) == set(st_o)
    assert (st_o["global_step"], st_o["max_steps"], st_o["logging_steps"], st_o["eval_steps"], st_o["save_steps"]) \
        == (st_t["global_step"], st_t["max_steps"], st_t["logging_steps"], st_t["eval_steps"], st_t["save_steps"])
    assert st_o["best_global_step"] in (2, 4) and st_o["best_model_checkpoint"].endswith(
        f"checkpoint-{st_o['best_global_step']}")
    assert st_t["best_model_checkpoint"].endswith(f"checkpoint-{st_t['best_global_step']}")

    def kinds(state):  # log_history entries by kind: train log, eval, final train metrics
        out = {}
        for e in state["log_history"]:
            kind = "eval" if "eval_loss" in e else "final" if "train_runtime" in e else "log"
            out.setdefault(kind, []).append(e)
        return out

    k_t, k_o = kinds(st_t), kinds(st_o)
    assert [e["step"] for e in k_o["log"]] == [e["step"] for e in k_t["log"]] == list(range(1, STEPS + 1))
    assert {frozenset(e) for e in k_o["log"]} == {frozenset(e) for e in k_t["log"]}  # loss, grad_norm, lr, epoch..
    assert [e["step"] for e in k_o["eval"]] == [e["step"] for e in k_t["eval"]] == [2, 4]
    assert set(k_t["eval"][0]) <= set(k_o["eval"][0])  # ours adds recall@k and eval_samples
    assert set(k_o["final"][0]) == set(k_t["final"][0])

    for name in ("train", "validation", "predict", "all"):
        t, o = (json.loads((d / f"{name}_results.json").read_text()) for d in (ref, run))
        assert set(t) <= set(o), (name, set(t) - set(o))
    train = json.loads((run / "train_results.json").read_text())
    assert train["train_samples_per_second"] > 0 and train["train_runtime"] > 0 and train["epoch"] > 0
    _assert_card_is_trainers(ref / "README.md", run / "README.md")

    sc_t, sc_o = _scalars(ref / "runs"), _scalars(run / "tensorboard")
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "eval/loss", "eval/runtime"} <= set(sc_o)
    assert FINAL_TAGS <= set(sc_t)
    assert {t for t in sc_t if t.startswith(("train/", "eval/"))} <= set(sc_o)  # every Trainer tag is ours too
    # Trainer's epoch with every log (train and eval), the final train metrics once, at the last step
    assert {s for s, _ in sc_o["train/epoch"]} == {s for s, _ in sc_t["train/epoch"]} == set(range(1, STEPS + 1))
    for tag in FINAL_TAGS - {"train/epoch"}:
        assert [s for s, _ in sc_o[tag]] == [s for s, _ in sc_t[tag]] == [STEPS], tag
    assert sc_o["train/train_loss"][0][1] == pytest.approx(train["train_loss"], rel=1e-6)
    assert sc_o["train/total_flos"][0][1] == pytest.approx(train["total_flos"], rel=1e-6)

    _checkpoints_hold_trainers_state(ref, run, st_o)
    _training_args_are_the_run_settings(run)

    # Trainer.save_model's file and ours: exactly the same state-dict keys (no extra buffers: nothing UNEXPECTED)
    assert _keys(run / "model.safetensors") == _keys(ref / "model.safetensors")


def _checkpoints_hold_trainers_state(ref: Path, run: Path, final_state: dict) -> None:
    """checkpoint-N holds trainer_state.json at step N (its log_history up to N, no final entry) and
    training_args.bin, as Trainer's _save_checkpoint writes them."""
    for n in (EVAL_STEPS, STEPS):
        files_t, files_o = ({p.name for p in (d / f"checkpoint-{n}").iterdir()} for d in (ref, run))
        assert CHECKPOINT_FILES <= files_t & files_o, (n, files_o)
        st_t, st_o = (json.loads((d / f"checkpoint-{n}" / "trainer_state.json").read_text()) for d in (ref, run))
        assert set(st_o) == set(st_t)
        assert st_o["global_step"] == st_t["global_step"] == n and st_o["epoch"] > 0
        assert [e["step"] for e in st_o["log_history"]] == [e["step"] for e in st_t["log_history"]]
        assert [set(e) <= set(o) for e, o in zip(st_t["log_history"], st_o["log_history"])] \
            == [True] * len(st_t["log_history"])  # same entries in the same order; ours add recall@k to evals
        assert st_o["best_model_checkpoint"].endswith(f"checkpoint-{st_o['best_global_step']}")
        assert st_o["best_global_step"] <= n and 0 < st_o["total_flos"] <= final_state["total_flos"]
    # the last checkpoint's history is the final state's, less the final train-metrics entry
    last = json.loads((run / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    assert last["log_history"] == final_state["log_history"][:-1]
    assert "train_runtime" in final_state["log_history"][-1]


def _training_args_are_the_run_settings(run: Path) -> None:
    """training_args.bin (output_dir and every checkpoint) loads as the TrainingArguments of what ran."""
    import torch
    from transformers import TrainingArguments

    cfg = json.loads((run / "run_config.json").read_text())
    ds = json.loads((run / "ds_config.json").read_text())
    train, optim, compat = cfg["TrainConfig"], cfg["OptimArgs"], cfg["CompatArgs"]
    # one TrainingArguments per process, as Trainer saves its self.args everywhere: checkpoint-2 is the first
    # process's, checkpoint-4 and output_dir the resumed one's (which says so)
    assert (run / "training_args.bin").read_bytes() == (run / "checkpoint-4" / "training_args.bin").read_bytes()
    args = torch.load(run / "training_args.bin", weights_only=False)
    before = torch.load(run / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert (args.resume_from_checkpoint, before.resume_from_checkpoint) == ("latest", None)
    assert before.to_dict() == {**args.to_dict(), "resume_from_checkpoint": None}
    assert isinstance(args, TrainingArguments)
    assert args.output_dir == train["run_dir"] == str(run)
    assert args.learning_rate == optim["learning_rate"] > 0
    assert "optimizer" not in ds or ds["optimizer"]["params"]["lr"] == args.learning_rate
    assert (args.weight_decay, args.adam_beta1, args.adam_beta2, args.adam_epsilon) \
        == (optim["weight_decay"], optim["beta1"], optim["beta2"], optim["eps"])
    assert args.lr_scheduler_type.value == optim["lr_scheduler_type"] == "linear"
    assert args.per_device_train_batch_size == ds["train_micro_batch_size_per_gpu"] == MICRO // 2
    assert args.gradient_accumulation_steps == ds["gradient_accumulation_steps"]
    assert args.max_steps == train["max_steps"] == STEPS and args.seed == train["seed"]
    assert (args.eval_strategy.value, args.eval_steps, args.save_strategy.value, args.save_steps) \
        == (compat["eval_strategy"], EVAL_STEPS, compat["save_strategy"], train["num_steps_per_checkpoint"])
    assert args.logging_steps == train["log_every"] == 1 and args.metric_for_best_model == "loss"
    assert (args.bf16, args.fp16, args.use_cpu) == (False, False, True)  # --precision fp32 on the CPU
    assert args.do_train and args.do_eval and args.do_predict and args.report_to == ["tensorboard"]
    assert args.deepspeed == str((run / "ds_config.json").resolve())
    # the device set-up saw the real run (2 ranks), and Trainer's own check of TrainingArguments against the
    # DeepSpeed JSON (batch sizes, clipping, optimizer, precision) finds no mismatch
    assert args.world_size == 2 and args.hf_deepspeed_config.mismatches == []


def _run_of(tmp_path: Path, argv: list[str], ds: dict):
    """A ds_core Run of these flags (rank 0 of 1 on the CPU), resolved as bridgetower_ds.train.resolve leaves the
    optimizer settings, with `ds` as the run's ds_config.json; no process group, no model."""
    import dataclasses

    import torch

    from bridgetower_ds import optim as bt_optim
    from bridgetower_ds.configs import BridgeTowerSettings
    from ds_core.config import parse_settings
    from ds_core.rank.dist import DistInfo
    from ds_core.run.setup import Run

    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "ds_config.json").write_text(json.dumps(ds))
    cfg = parse_settings(BridgeTowerSettings, ["--output_dir", str(run_dir), *argv])
    optim = cfg.optim
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(bt_optim.trainer_defaults(optim),
                                                             weight_decay=optim.weight_decay or 0.0))
    dist = DistInfo(0, 0, 1, 1, 1, "cpu", torch.device("cpu"), "gloo")
    return Run.of(cfg, dist, ds, total_steps=30)


def test_training_args_hold_the_settings_and_leave_the_process_as_it_was(tmp_path, capsys):
    """training_args() maps each setting to its TrainingArguments field (epoch strategies, a warm-up share, bf16,
    ZeRO-3, a JSON without a ZeRO section) in the process of a run: the environment and transformers' global ZeRO-3
    switch are as before while the TrainingArguments object is alive. A schedule transformers has no name for writes
    no training_args.bin, and says why."""
    import os

    from transformers.integrations import is_deepspeed_zero3_enabled

    from bridgetower_ds import trainer_files

    ds = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "train_batch_size": 6,
          "gradient_clipping": 0.5, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    argv = ["--do_train", "--do_eval", "--num_train_epochs", "3", "--learning_rate", "3e-5", "--weight_decay", "0.01",
            "--warmup_ratio", "0.1", "--lr_scheduler_type", "cosine", "--save_strategy", "epoch",
            "--eval_strategy", "epoch", "--seed", "7", "--logging_steps", "5"]
    run = _run_of(tmp_path, argv, ds)
    env = dict(os.environ)
    args = trainer_files.training_args(run, eval_every=10, save_every=10)
    assert dict(os.environ) == env and not is_deepspeed_zero3_enabled()  # args is alive: its config is not global
    assert (args.learning_rate, args.weight_decay, args.lr_scheduler_type.value, args.seed, args.logging_steps) \
        == (3e-5, 0.01, "cosine", 7, 5)
    assert getattr(args, "warmup_ratio", args.warmup_steps) == 0.1
    assert (args.num_train_epochs, args.max_steps, args.eval_strategy.value, args.save_strategy.value) \
        == (3.0, -1, "epoch", "epoch")
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_grad_norm) == (3, 2, 0.5)
    assert args.bf16 and args.use_cpu and args.do_eval and not args.do_predict
    assert args.hf_deepspeed_config.is_zero3() and args.hf_deepspeed_config.mismatches == []

    # a JSON without zero_optimization (DeepSpeed: stage 0), which accelerate's DeepSpeedPlugin alone would refuse
    bare = {k: v for k, v in ds.items() if k != "zero_optimization"}
    args = trainer_files.training_args(_run_of(tmp_path / "bare", argv, bare), eval_every=10, save_every=10)
    assert args.deepspeed == str((tmp_path / "bare" / "run" / "ds_config.json").resolve())
    assert args.hf_deepspeed_config.config["zero_optimization"]["stage"] == 0 and not is_deepspeed_zero3_enabled()

    run = _run_of(tmp_path / "poly", ["nvidia_poly" if a == "cosine" else a for a in argv], ds)
    files = trainer_files.TrainerFiles(run, per_epoch=10, eval_every=10, save_every=10, flops_per_sample=1.0)
    files._write_args(Path(run.train.run_dir))
    assert not (Path(run.train.run_dir) / "training_args.bin").exists()
    assert "training_args.bin not written: ValueError: --lr_scheduler_type nvidia_poly has no transformers " \
           "SchedulerType" in capsys.readouterr().out
