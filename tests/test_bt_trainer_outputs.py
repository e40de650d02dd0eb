"""Our run's --output_dir beside a real transformers.Trainer's (issue 26 item 1): the same debug BridgeTower, the same
strategy flags, the steps run_bridgetower.py takes after training (save_model, tokenizer and image processor,
save_metrics("train"), save_state, evaluate -> save_metrics("validation")) plus predict. File names, trainer_state.json
keys, log_history entry keys, results keys, checkpoint names, TensorBoard tags and the export's state-dict keys are
compared; what differs is pinned here, so a change on either side shows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import dist_env, run_deepspeed

STEPS, MICRO, EVAL_STEPS = 4, 4, 2

# Trainer files we do not write: training_args.bin is a pickled TrainingArguments (our settings are run_config.json)
TRAINER_ONLY_FILES = {"training_args.bin"}
# our own files beside Trainer's
OURS_ONLY_FILES = {"run_config.json", "ds_config.json", "metrics.jsonl", "checkpoints", "tensorboard",
                   "eval_results.json"}
# Trainer's TensorBoard tags we do not write: the epoch of each log, the final train metrics, hparams text
TRAINER_ONLY_TAGS = {"train/epoch", "train/train_runtime", "train/train_samples_per_second",
                     "train/train_steps_per_second", "train/total_flos", "train/train_loss"}


def _trainer_reference(out: Path) -> None:
    """What run_bridgetower.py does with Trainer, on 16 random (caption, image) pairs of the debug model."""
    import torch
    from transformers import BridgeTowerForContrastiveLearning, Trainer, TrainingArguments

    from bridgetower_ds import compat
    from bridgetower_ds.configs import debug
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
    compat.image_processor("", 32).save_pretrained(str(out))
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    trainer.save_metrics("validation", trainer.evaluate())
    trainer.save_metrics("predict", trainer.predict(Pairs(), metric_key_prefix="test").metrics)


def _tags(root: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for f in root.rglob("events.out.tfevents*"):
        acc = EventAccumulator(str(f))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


def _keys(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return set(f.keys())


@pytest.mark.slow
def test_output_dir_matches_a_real_trainers_files_and_keys(tmp_path):
    from test_bt_train import make_caption_set

    ref = tmp_path / "trainer"
    _trainer_reference(ref)
    run = tmp_path / "ours"
    manifest = make_caption_set(tmp_path / "data", 40)
    run_deepspeed(["--module", "bridgetower_ds.train", "--do_train", "--do_eval", "--do_predict",
                   "--dataset_path", str(manifest), "--output_dir", str(run), "--max_steps", str(STEPS),
                   "--per_device_train_batch_size", str(MICRO // 2), "--max_seq_length", "16",
                   "--eval_strategy", "steps", "--eval_steps", str(EVAL_STEPS), "--save_steps", str(EVAL_STEPS),
                   "--logging_steps", "1", "--metric_for_best_model", "loss", "--report_to", "tensorboard",
                   "--progress_bar", "false", "--precision", "fp32", "--dataloader_num_workers", "0"],
                  env=dist_env())
    theirs, ours = {p.name for p in ref.iterdir()}, {p.name for p in run.iterdir()}
    assert theirs - ours == TRAINER_ONLY_FILES | {"runs"}  # runs/: Trainer's TensorBoard dir (ours: tensorboard/)
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

    tags_t, tags_o = _tags(ref / "runs"), _tags(run / "tensorboard")
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "eval/loss", "eval/runtime"} <= tags_o
    assert {t for t in tags_t - tags_o if t.startswith(("train/", "eval/"))} == TRAINER_ONLY_TAGS

    # Trainer.save_model's file and ours: exactly the same state-dict keys (no extra buffers: nothing UNEXPECTED)
    assert _keys(run / "model.safetensors") == _keys(ref / "model.safetensors")
