"""A tiny model trained through ds_core exactly the way a model package does; driven by the ds_core tests.

Run as `deepspeed --num_gpus 2 tests/tiny_train.py --run_dir R --deepspeed_config zero1_bf16.json ...`.
What to break, and when (a NaN loss, a kill inside a save, a signal, a full disk, a straggler), and which instruments
to add (a fake clock, an eval hook, optimizer dumps) come through the one fault-injection hook, tests/faults.py: the
tests write `dist_env(**faults.env(nan_at_step=5))`, and this driver reads them once, as FAULTS.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

import numpy as np
import torch

import faults
from ds_core import checkpoint as ckpt
from ds_core.config import TrainConfig
from ds_core.rank.dist import shutdown_distributed
from ds_core.rank.engine_build import build_engine
from ds_core.rank.process_end import run_main
from ds_core.run.evaluation import EvalTask, Evaluation
from ds_core.run.setup import Run, RunSpec, start_run
from ds_core.run.step import StepOutput
from ds_core.run.trainer import ModelInfo, Trainer

FAULTS = faults.read()


@dataclass(frozen=True)
class TinyArgs:
    num_samples: int = field(default=512, metadata={"help": "Synthetic samples."})
    vocab: int = field(default=64, metadata={"help": "Vocabulary of the tiny BERT."})
    seq_len: int = field(default=16, metadata={"help": "Tokens per sample."})
    export_dir: str = field(default="", metadata={"help": "Export a Hugging Face model here after training."})


class SyntheticData:
    """Per-rank slice of a seeded synthetic classification set; position = (epoch, offset) in a seeded permutation."""

    def __init__(self, args: TinyArgs, rank: int, world: int, micro_batch: int, seed: int):
        g = np.random.default_rng(1234)
        self.ids = g.integers(1, args.vocab, size=(args.num_samples, args.seq_len))
        self.labels = (self.ids[:, 0] > args.vocab // 2).astype(np.int64)  # learnable: depends on the first token
        self.rank, self.world, self.mb, self.seed = rank, world, micro_batch, seed
        self.epoch, self.offset = 0, 0

    def _perm(self) -> np.ndarray:
        return np.random.default_rng(self.seed + self.epoch).permutation(len(self.ids))

    def _order(self) -> np.ndarray:
        if self.dealt is not None:  # this rank's share of a resized epoch's remaining samples
            return self.dealt
        return self._perm()[self.rank::self.world]

    dealt: np.ndarray | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.offset, self.dealt = epoch, 0, None

    def __len__(self) -> int:
        """Micro batches of a full epoch on this rank (ds_core.run.setup counts the run's optimizer steps with it)."""
        return len(range(self.rank, len(self.ids), self.world)) // self.mb

    def __iter__(self):
        order = self._order()
        log = FAULTS.sample_log
        while self.offset + self.mb <= len(order):
            idx = order[self.offset:self.offset + self.mb]
            self.offset += self.mb
            if log:  # every sample this rank trains on: "epoch index" lines (the exactly-once check of the tests)
                with open(os.path.join(log, f"samples_rank{self.rank}.txt"), "a") as f:
                    f.write("".join(f"{self.epoch} {i}\n" for i in idx))
            yield {"input_ids": torch.from_numpy(self.ids[idx]), "labels": torch.from_numpy(self.labels[idx])}

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "offset": self.offset}
        if self.dealt is not None:
            state["dealt"] = self.dealt.tolist()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]
        self.dealt = np.asarray(state["dealt"]) if "dealt" in state else None


class ResizableData(SyntheticData):
    """SyntheticData with ds_core's resize contract (the no_resize fault uses the plain one, which cannot resize)."""

    def load_state_dicts(self, states: list) -> None:
        """ds_core's resize contract: same world size -> load_state_dict(own); otherwise the samples of the epoch no
        saved rank consumed, in the epoch's order, dealt round-robin to this world's ranks."""
        if len(states) == self.world:
            self.load_state_dict(states[self.rank])
            return
        epochs = {s["epoch"] for s in states}
        if len(epochs) != 1:
            raise ValueError(f"saved ranks are in different epochs {sorted(epochs)}")
        self.epoch = epochs.pop()
        consumed = set()
        for r, s in enumerate(states):
            order = (np.asarray(s["dealt"]) if "dealt" in s else self._perm()[r::len(states)])
            consumed.update(order[:s["offset"]].tolist())
        remaining = np.array([i for i in self._perm() if i not in consumed], dtype=np.int64)
        self.dealt, self.offset = remaining[self.rank::self.world], 0

    shared_summary_stats = ("data_samples",)  # the whole set's size: the same on every rank

    def summary_stats(self) -> dict:
        if not FAULTS.stats:
            return {}
        return {"bad_rows": self.rank + 1, "bad_row_examples": [f"rank{self.rank}"], "data_samples": len(self.ids)}


def dump_optimizer(engine, path: str, rank: int) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        if engine.zero_optimization_stage() == 0 and not engine.bfloat16_enabled():  # fp32 ZeRO-0: plain torch
            st = engine.optimizer.state[p]
            fp32, avg, avg_sq = p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()
        else:
            fp32, avg, avg_sq = (safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"),
                                 safe_get_full_optimizer_state(p, "exp_avg_sq"))
        out[name] = {"fp32": fp32, "exp_avg": avg, "exp_avg_sq": avg_sq, "lr": engine.optimizer.param_groups[0]["lr"]}
    if rank == 0:
        torch.save(out, path)


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


FAKE_CLOCK = FakeClock() if FAULTS.fake_clock else None


def _nan_grad_at(step: int) -> bool:
    for part in filter(None, FAULTS.nan_grad_steps.split(",")):
        if part.endswith("-") and step >= int(part[:-1]) or part == str(step):
            return True
    return False


def step_fn(engine, batch) -> StepOutput:
    batch = {k: v.to(engine.device) for k, v in batch.items()}
    out = engine(input_ids=batch["input_ids"], labels=batch["labels"])
    loss = out.loss
    rank = int(os.environ.get("RANK", "0"))
    if FAULTS.signal_at_step and engine.global_steps + 1 == FAULTS.signal_at_step and FAULTS.signal_rank == rank:
        os.kill(os.getpid(), getattr(signal, FAULTS.signal))
    if _nan_grad_at(engine.global_steps + 1):
        out.logits.register_hook(lambda g: g * float("nan"))  # finite loss, NaN gradients
    if FAULTS.nan_at_step and engine.global_steps + 1 == FAULTS.nan_at_step:
        loss = loss * float("nan")
    if FAULTS.slow_rank == rank:
        time.sleep(FAULTS.slow_s)
    n = batch["input_ids"].shape[0]
    if FAKE_CLOCK is not None:
        FAKE_CLOCK.t += 1.0
    return StepOutput(loss=loss, samples=n, tokens=batch["input_ids"].numel(), logs={"aux": loss.detach() * 0 + 1})


DEFAULT_DS_CONFIG = "zero1_bf16.json"  # has an optimizer section: the tiny model builds none in code


def build_data(run: Run) -> SyntheticData:
    args, dist = run.cfg.model, run.dist
    cls = SyntheticData if FAULTS.no_resize else ResizableData
    return cls(args, dist.rank, dist.world_size, run.batch.micro, run.train.seed)


@dataclass(frozen=True)
class TinySettings:
    train: TrainConfig
    model: TinyArgs


SPEC = RunSpec(settings=TinySettings, default_ds_config=DEFAULT_DS_CONFIG, optimizer_in_code=False)


def record_lazy_marks(engine, path: str, rank: int) -> None:
    """The lazy_marks fault (FILE): the loop runs as on a Gaudi in lazy mode, with a recorder in place of
    htcore.mark_step (ds_core.run.step.step_marker, looked up by ds_core.run.trainer), and rank 0 writes the order of
    engine.backward, engine.step and the marks of the first 8 micro steps to FILE, one event per line."""
    from ds_core.run import trainer

    events: list[str] = []
    trainer.step_marker = lambda device: (lambda: events.append("mark"))
    for name in ("backward", "step"):
        real = getattr(engine, name)

        def recorded(*a, _real=real, _name=name, **kw):
            out = _real(*a, **kw)
            events.append(_name)
            if rank == 0 and len(events) >= 32 and not os.path.exists(path):  # 8 micro steps' events at least
                with open(path, "w") as f:
                    f.write("\n".join(events[:32]) + "\n")
            return out

        setattr(engine, name, recorded)


def main(argv=None) -> dict:
    from transformers import BertConfig, BertForSequenceClassification

    run = start_run(SPEC, argv)
    run = run.with_data(build_data(run))
    args, dist, data = run.cfg.model, run.dist, run.data
    model = BertForSequenceClassification(BertConfig(vocab_size=args.vocab, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64,
                                                     max_position_embeddings=args.seq_len, num_labels=2))
    engine = build_engine(model, run.ds_config)
    if dist.rank == 0:
        print(f"tiny: parameter dtype {next(engine.module.parameters()).dtype}", flush=True)
    if FAKE_CLOCK is not None:
        real_ds_save = engine.save_checkpoint

        def slow_save(*a, **kw):
            FAKE_CLOCK.t += 100.0
            return real_ds_save(*a, **kw)

        engine.save_checkpoint = slow_save
    evaluation = None
    if FAULTS.eval:
        def eval_fn(engine, step):
            if FAKE_CLOCK is not None:
                FAKE_CLOCK.t += 50.0
            return {"eval_marker": float(step)}

        evaluation = Evaluation(during=EvalTask("eval", eval_fn), every=run.train.eval_every)
    kill_step = FAULTS.kill_in_save
    if kill_step and dist.rank == 0:
        real_save = engine.save_checkpoint

        def save_then_die(*a, **kw):
            real_save(*a, **kw)
            if kw.get("tag") == ckpt.tag_for(kill_step):
                os.kill(os.getpid(), signal.SIGKILL)

        engine.save_checkpoint = save_then_die
    after_complete = FAULTS.kill_after_complete
    if after_complete and dist.rank == 0:
        real_ckpt_save = ckpt.save  # the loop calls ds_core.checkpoint.save through the module

        def save_complete_then_die(*a, **kw):
            path = real_ckpt_save(*a, **kw)
            if path.name == ckpt.tag_for(after_complete):
                os.kill(os.getpid(), signal.SIGKILL)
            return path

        ckpt.save = save_complete_then_die
    full_step = FAULTS.disk_full_at
    if full_step:
        import errno

        real_save_full = engine.save_checkpoint

        def save_disk_full(*a, **kw):
            if kw.get("tag") == ckpt.tag_for(full_step):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), kw.get("tag"))
            return real_save_full(*a, **kw)

        engine.save_checkpoint = save_disk_full
    dump = FAULTS.dropout_dump
    if dump:
        def keep_first_mask(module, inputs, output):
            if not getattr(module, "_dumped", False):
                module._dumped = True
                mask = (output == 0) & (inputs[0] != 0)
                torch.save(mask.cpu(), os.path.join(dump, f"mask_rank{dist.rank}.pt"))

        engine.module.bert.embeddings.dropout.register_forward_hook(keep_first_mask)
    if FAULTS.dump_opt_at_save:  # the optimizer state a checkpoint holds, while training goes on
        real_save_dump = engine.save_checkpoint

        def save_then_dump(*a, **kw):
            out = real_save_dump(*a, **kw)
            dump_optimizer(engine, FAULTS.dump_opt_at_save, dist.rank)
            return out

        engine.save_checkpoint = save_then_dump
    if FAULTS.dump_opt_on_resume:  # the optimizer state as the checkpoint load left it
        real_load = data.load_state_dicts

        def dump_then_load(states):  # the loop calls this right after ds_core.checkpoint.load, on every rank
            dump_optimizer(engine, FAULTS.dump_opt_on_resume, dist.rank)
            real_load(states)

        data.load_state_dicts = dump_then_load
    marks = FAULTS.lazy_marks
    if marks:
        record_lazy_marks(engine, marks, dist.rank)
    per_sample = 6 * sum(p.numel() for p in model.parameters()) * args.seq_len  # ~6 N T training FLOPs
    summary = Trainer(run, engine, step_fn, ModelInfo("tiny-bert", per_sample, args.seq_len), evaluation=evaluation,
                      clock=FAKE_CLOCK).fit()
    if args.export_dir:
        ckpt.export_hf(engine, args.export_dir)
    if FAULTS.dump_opt:  # full fp32 master weights and Adam moments per parameter (collective)
        dump_optimizer(engine, FAULTS.dump_opt, dist.rank)
    shutdown_distributed()
    return summary


if __name__ == "__main__":
    run_main(main)  # ends without interpreter finalisation: see ds_core.rank.process_end
