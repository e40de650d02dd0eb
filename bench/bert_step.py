"""BERT training-step benchmark: our step (bert_ref + ds_core.run.trainer) against transformers' Trainer, in one run.

1. step_ratio: the recipe's DeepSpeed JSON for both (recipe_ds_config: ZeRO-1, bf16 with fp32 accumulation), the same
   BertForPreTraining-shaped BERT-Large slice (hidden 1024, 16 heads, 4 layers, seq 128, vocab 30528), the same
   generated h5 shard (one epoch per window: each side trains on every sample once, in its own order), the same micro
   batch, accumulation, optimizer (bert_ref.layerwise.NVLAMB with per-tensor trust ratios under ZeRO on both sides:
   attach_zero_layout), gradient clipping at 1.0 (in NVLAMB for ours as the recipe runs, DeepSpeed's for the
   Trainer), precision and torch thread count. Ours: bert_ref.data's block loader, the sparse MLM head (--dense_mlm
   turns it off), FastDropout (--torch_dropout) and bert_ref.step through ds_core.train. Baseline: transformers'
   Trainer with the same DeepSpeed config (as a dict), transformers' BertForPreTraining, and a per-sample dataset
   written as NVIDIA's h5-era run_pretraining.py `pretraining_dataset` (whole file in numpy, labels built per sample)
   with the default collator. Each window is its own process (start-up not timed) and the sides alternate ABBA over
   --rounds rounds, so load on a shared machine falls on both; a side's rate is over the steps after --warmup, data
   loading included (ours from ds_core.outputs.metrics, the Trainer's from on_step_end timestamps). step_ratio =
   median over rounds of our samples/s / the Trainer's in the same round, with min and max; the bench refuses a ratio
   when the sides differ in samples per step, optimizer, trust-ratio tensors or threads. cpu_step_ratio: the same
   ratio per CPU-second of each side's process (all its threads, data loading included), which other processes' load
   inflates far less than wall time on a shared machine; step_ratio (wall clock) is the figure a user sees and the
   target. The precision is the run's rule (ds_core.device.precision.resolve_precision, as bert_ref.train applies
   it): bf16 where the accelerator has it natively, fp32 on a CPU without native bf16 (emulated bf16 is ~60x slower
   there). Our MFU is against the measured matmul peak of that dtype (ds_core.outputs.metrics).
2. Bound (after 1, --skip_bound): mfu_upper_bound, the MFU our step would have if only its linear layers' GEMMs and
   the LAMB update cost anything (see bench.mfu_bound), in the same dtype and thread count.
3. Memory (--memory, off by default to keep the bench within 10 minutes on a 2-core CPU): two ranks, a
   BERT-1.5B-shaped slice (hidden 1600, 25 heads, 2 layers), LANS, one launch with ZeRO-0 and one with ZeRO-1: per
   rank optimizer-state bytes (fp32 master weights + moments) and the process peak RSS.
The last line printed is one JSON object (step_ratio, mfu, mfu_upper_bound, ...). Target: step_ratio >= 1.3.

    python -m bench.bert_step [--micro_batch 4] [--grad_accum 8] [--steps 2] [--warmup 1] [--rounds 3] [--threads 1]
        [--precision auto|bf16|fp32] [--dense_mlm] [--torch_dropout] [--no_malloc_tuning] [--skip_trainer]
        [--skip_bound] [--memory | --memory_only] [--memory_model debug_pre_ln] [--model debug]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import REPO, bench_env, run_local_ranks
from bench.mfu_bound import bound_part
from ds_core.compat import changes
from ds_core.rank.process_end import run_main

os.environ.setdefault("DS_ACCELERATOR", "cpu")

LARGE_SLICE = dict(name="bert_large_4l", num_hidden_layers=4)
BIG_SLICE = dict(name="bert_1p5b_2l", num_hidden_layers=2)
LR = 1e-4


def bench_ds_config(micro: int, accum: int, stage: int, dtype: str, world: int = 1) -> dict:
    """The one DeepSpeed config both sides get; its precision section set by ds_core.device.precision (the run's rule).
    train_batch_size counts every rank (the memory launch has 2: DeepSpeed asserts micro x accum x world)."""
    from ds_core.device.precision import apply_precision

    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum, "train_batch_size":
           micro * accum * world, "gradient_clipping": 1.0, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000_000},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    return apply_precision(cfg, dtype, "bench DeepSpeed config")


def recipe_ds_config(micro: int, accum: int, dtype: str, clipping: str = "optimizer") -> dict:
    """The BERT-Large recipe's DeepSpeed JSON (ds_configs/bert_large_zero1_bf16.json: ZeRO-1, bf16 with fp32 gradient
    accumulation, no per-tensor overflow check) at this micro batch and accumulation, as `bert_ref.train` runs it.
    clipping "optimizer": the JSON's gradient_clipping 0, NVLAMB clips at 1.0 on the device (ours, the recipe);
    "deepspeed": gradient_clipping 1.0, DeepSpeed clips (the Trainer: transformers sets DeepSpeed's clip from
    max_grad_norm and refuses a JSON that disagrees). The same clip at the same threshold either way."""
    from ds_core.config import DS_CONFIG_DIR
    from ds_core.device.precision import apply_precision

    cfg = json.loads((DS_CONFIG_DIR / "bert_large_zero1_bf16.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum, train_batch_size=micro * accum,
               steps_per_print=10**9)
    if clipping == "deepspeed":
        cfg["gradient_clipping"] = 1.0
    return apply_precision(cfg, dtype, "bench DeepSpeed config")


def _shards(tmp: Path, n: int, seq: int, preds: int, vocab: int) -> Path:
    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    d = tmp / f"shards_{seq}"
    d.mkdir(parents=True, exist_ok=True)
    write_shard(d / "part-00000.hdf5", synthetic_arrays(n, seq, preds, vocab_size=vocab, seed=0), compression=None)
    return d


def bench_engine(preset, ds_config: dict, optimizer: str, sparse_mlm: bool = False, fast_dropout: bool = False):
    from bert_ref.layerwise import attach_zero_layout
    from bert_ref.model import build_model
    from bert_ref.optim import bert_defaults, build_optimizer
    from ds_core.config.optim import OptimArgs, schedule_for
    from ds_core.rank.engine_build import build_engine

    model = build_model(preset, sparse_mlm=sparse_mlm, fast_dropout=fast_dropout)
    args = OptimArgs(optimizer=optimizer, learning_rate=LR, warmup_ratio=0.0, lr_scheduler_type="poly_warmup")
    opt = build_optimizer(model, args)
    engine = build_engine(model, ds_config, optimizer=opt, lr_scheduler=schedule_for(bert_defaults(args), 10**6))
    attach_zero_layout(engine, opt)  # per-tensor LAMB / LANS trust ratios under ZeRO, as bert_ref.train
    return engine


def _slice(model: str = LARGE_SLICE["name"]):
    """The bench's model: the BERT-Large slice, bert_ref's tiny `debug` preset (tests of the bench itself), or the
    whole 24-layer BERT-Large (`bert_large`: bench.gpu_check on a GPU, where the full model is the headline)."""
    import dataclasses

    from bert_ref.configs import bert_large, debug

    if model == "bert_large":
        return bert_large(1)
    return debug(1) if model == "debug" else dataclasses.replace(bert_large(1), **LARGE_SLICE)


def _trust_keys(opt) -> int:
    """Parameter tensors NVLAMB computes a trust ratio for (per tensor, through attach_zero_layout's layout); -1 for
    an optimizer without trust ratios."""
    if not hasattr(opt, "_layouts"):
        return -1
    return sum(lay.n_keys for lay in opt._layouts.values()) if opt._layouts else \
        sum(len(g["params"]) for g in opt.param_groups)


def ours_part(a: argparse.Namespace, tmp: Path, shards: Path, dtype: str) -> dict:
    """Our whole training step through ds_core.run.trainer: block loader, forward, backward, ZeRO-1 reduce, clip,
    LAMB."""
    from bert_ref.data import build_data
    from bert_ref.model import flops_per_sequence
    from bert_ref.step import make_step_fn
    from ds_core.config import TrainConfig
    from ds_core.rank.compile import compile_model
    from ds_core.rank.dist import set_seed
    from ds_core.run.setup import LoopSettings, Run
    from ds_core.run.trainer import ModelInfo, Trainer

    preset = _slice(a.model)
    set_seed(0)
    data = build_data(str(shards), 0, 1, a.micro_batch)
    ds_config = recipe_ds_config(a.micro_batch, a.grad_accum, dtype)
    engine = bench_engine(preset, ds_config, "lamb", not a.dense_mlm, not a.torch_dropout)
    preds = 0 if a.dense_mlm else preset.max_predictions_per_seq
    flops = flops_per_sequence(preset, mlm_positions=preds)
    compiled = compile_model(engine, a.compile, dynamic=False)
    prof = _profile(a)
    cpu = _cpu_clock_at_step_end(engine, prof.step_end if prof else None)
    # a metrics record every 10 steps (the Trainer side logs nothing): steps without one read nothing on the host
    cfg = TrainConfig(run_dir=str(tmp / "ours_run"), max_steps=a.steps + a.warmup, throughput_warmup_steps=a.warmup,
                      save_final_checkpoint=False, progress_bar=False, precision=dtype, log_every=10)
    run = Run.of(LoopSettings(cfg), _DIST, ds_config).with_data(data)  # the settings start_run would resolve
    s = Trainer(run, engine, make_step_fn(preds, compiled), ModelInfo(preset.name, flops, preset.seq_len)).fit()
    data.close()
    head = "dense" if a.dense_mlm else f"sparse ({preds}/seq)"
    opt = engine.optimizer.optimizer
    print(f"[ours] {preset.name} ZeRO-1 {dtype}: micro {a.micro_batch} x accum {a.grad_accum}, MLM head {head}, "
          f"fast dropout {not a.torch_dropout}: {s['samples_per_s']:.3f} seq/s, {s['tflops_per_accelerator']:.4f} "
          f"TFLOPs vs {dtype} matmul peak {s['peak_tflops_per_accelerator']:.4f} -> MFU "
          f"{'n/a' if s['mfu'] is None else format(s['mfu'], '.3f')}", flush=True)
    return {"samples_per_s": s["samples_per_s"], "mfu": s["mfu"], "step_tflops": s["tflops_per_accelerator"],
            "peak_tflops": s["peak_tflops_per_accelerator"], "flops_per_seq": flops, "mlm_head": head,
            "fast_dropout": not a.torch_dropout, "cpu_samples_per_s": _cpu_rate(cpu, a),
            "samples_per_step": round(s["samples_per_s"] * s["measured_seconds"] / s["measured_steps"], 6),
            "optimizer": type(opt).__name__, "compiled": compiled,
            "trust_ratio_tensors": _trust_keys(opt), "threads": _threads(),
            **({"profile": prof.summary} if prof else {})}


def _profile(a: argparse.Namespace):
    """ds_core.outputs.profile over --profile_steps steps ending one step before the timed window (see StepProfile)."""
    from ds_core.outputs.profile import StepProfile

    return StepProfile(a.warmup - 1 - a.profile_steps, a.profile_steps) if a.profile_steps else None


def _cpu_clock_at_step_end(engine, also=None) -> list[float]:
    """This process's CPU time (all its threads: data loading included) at the end of each optimizer step, read right
    after DeepSpeed's engine.step() at the accumulation boundary, where the Trainer's on_step_end reads it too."""
    import time

    marks: list[float] = []
    step = engine.step

    def timed_step(*args, **kw):
        boundary = engine.is_gradient_accumulation_boundary()
        out = step(*args, **kw)
        if boundary:
            marks.append(time.process_time())
            if also is not None:
                also()
        return out

    engine.step = timed_step
    return marks


def _cpu_rate(marks: list[float], a: argparse.Namespace) -> float:
    """Samples per CPU-second over the steps after --warmup: on a shared machine the CPU time a side needs is
    not inflated by other processes' load the way its wall time is (cache and memory-bandwidth sharing aside)."""
    return a.steps * a.micro_batch * a.grad_accum / (marks[a.warmup + a.steps - 1] - marks[a.warmup - 1])


def _threads() -> int:
    import torch

    return torch.get_num_threads()


class NvidiaStyleDataset:
    """NVIDIA DeepLearningExamples' h5-era `pretraining_dataset` (run_pretraining.py): the whole file read into numpy
    at construction, and per sample: six int64 tensors, MLM labels filled up to the first 0-padded position. Returns
    the keyword names transformers' BertForPreTraining takes, with -100 for unmasked positions (NVIDIA: -1 and its own
    loss)."""

    def __init__(self, input_file: str, max_pred_length: int):
        import h5py
        import numpy as np

        keys = ["input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
                "next_sentence_labels"]
        with h5py.File(input_file, "r") as f:
            self.inputs = [np.asarray(f[key][:]) for key in keys]
        self.max_pred_length = max_pred_length

    def __len__(self) -> int:
        return len(self.inputs[0])

    def __getitem__(self, index: int) -> dict:
        import numpy as np
        import torch

        input_ids, input_mask, segment_ids, masked_lm_positions, masked_lm_ids, next_sentence_labels = [
            torch.from_numpy(x[index].astype(np.int64)) if i < 5 else torch.from_numpy(np.asarray(x[index].astype(
                np.int64))) for i, x in enumerate(self.inputs)]
        masked_lm_labels = torch.full(input_ids.shape, -100, dtype=torch.long)
        idx = self.max_pred_length
        padded = (masked_lm_positions == 0).nonzero()
        if len(padded) != 0:
            idx = padded[0].item()
        masked_lm_labels[masked_lm_positions[:idx]] = masked_lm_ids[:idx]
        return {"input_ids": input_ids, "token_type_ids": segment_ids, "attention_mask": input_mask,
                "labels": masked_lm_labels, "next_sentence_label": next_sentence_labels}


def trainer_part(a: argparse.Namespace, tmp: Path, shards: Path, dtype: str) -> dict:
    """transformers' Trainer, DeepSpeed ZeRO-1 (the same config dict), the same model shape, LAMB and batch numbers."""
    import time

    import torch
    from transformers import BertForPreTraining, Trainer, TrainerCallback, TrainingArguments, default_data_collator

    from bert_ref.layerwise import attach_zero_layout
    from bert_ref.model import hf_config
    from bert_ref.optim import build_optimizer
    from ds_core.config.optim import OptimArgs
    from ds_core.rank.dist import set_seed

    preset = _slice(a.model)
    set_seed(0)
    model = BertForPreTraining(hf_config(preset))
    times: list[float] = []
    cpu: list[float] = []
    seen = [0]  # sequences the model has run forward on (accelerate's loader reads one batch ahead of the model)
    fed: list[int] = []
    model.register_forward_pre_hook(lambda m, args, kw: seen.__setitem__(0, seen[0] + kw["input_ids"].size(0)),
                                    with_kwargs=True)
    ds = NvidiaStyleDataset(str(next(shards.glob("*.hdf5"))), preset.max_predictions_per_seq)
    prof = _profile(a)

    class LambTrainer(Trainer):
        """The Trainer with our NVLAMB (bert_ref.optim.build_optimizer: the same groups and hyper-parameters as ours).
        Passing it as `optimizers=(opt, None)` does not work under DeepSpeed: transformers' deepspeed_init sets
        trainer.optimizer = None and calls create_optimizer(), which then builds the default AdamW (what this bench
        silently compared against before). create_optimizer is the override point transformers documents."""

        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = build_optimizer(model or self.model, OptimArgs(optimizer="lamb", learning_rate=LR,
                                                                                  warmup_ratio=0.0))
            return self.optimizer

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            # per-tensor trust ratios under ZeRO, as ours_part and bert_ref.train (attach after deepspeed.initialize)
            attach_zero_layout(trainer.deepspeed, trainer.deepspeed.optimizer.optimizer)

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter())
            cpu.append(time.process_time())
            fed.append(seen[0])
            if prof is not None:
                prof.step_end()

    args = TrainingArguments(
        output_dir=str(tmp / "trainer_run"), per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.grad_accum, max_steps=a.steps + a.warmup, learning_rate=LR,
        lr_scheduler_type="constant", max_grad_norm=1.0, bf16=dtype == "bf16", deepspeed=recipe_ds_config(
            a.micro_batch, a.grad_accum, dtype, clipping="deepspeed"), save_strategy="no", report_to=[],
        logging_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True, seed=0, data_seed=0,
        # transformers refuses bf16 off a GPU unless told it runs on the CPU (a CPU with native bf16 picks bf16)
        use_cpu=dtype == "bf16" and not torch.cuda.is_available())
    if a.threads:  # TrainingArguments(use_cpu=True) resets torch's thread count: the same threads as ours
        torch.set_num_threads(a.threads)
    trainer = LambTrainer(model=model, args=args, train_dataset=ds, data_collator=default_data_collator,
                          callbacks=[Clock()])
    trainer.train()
    steps = len(times) - a.warmup
    rate = steps * a.micro_batch * a.grad_accum / (times[-1] - times[a.warmup - 1])
    print(f"[trainer] transformers Trainer + DeepSpeed ZeRO-1 {dtype}, per-sample dataset: {rate:.3f} seq/s "
          f"({steps} steps after {a.warmup} warm-up)", flush=True)
    opt = trainer.deepspeed.optimizer.optimizer  # the optimizer that stepped, inside DeepSpeed's ZeRO wrapper
    return {"samples_per_s": rate, "cpu_samples_per_s": _cpu_rate(cpu, a),
            "samples_per_step": (fed[-1] - fed[a.warmup - 1]) / steps,
            "optimizer": type(opt).__name__, "trust_ratio_tensors": _trust_keys(opt), "threads": _threads(),
            **({"profile": prof.summary} if prof else {})}


def side_worker(a: argparse.Namespace, side: str, shards: Path, out: Path) -> None:
    """One measurement window in its own process: build `side` (ours / trainer), train warm-up + --steps optimizer
    steps, write its numbers to `out`. A fresh process per window: neither side inherits the other's heap, caches or
    threads, and a window's numbers are not skewed by which side happened to run first in one process."""
    from ds_core.rank.dist import init_distributed, shutdown_distributed

    global _DIST
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    _DIST = init_distributed()
    with tempfile.TemporaryDirectory(prefix=f"bert_step_{side}_") as d:
        rec = (ours_part if side == "ours" else trainer_part)(a, Path(d), shards, os.environ["BENCH_DTYPE"])
    rec["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.write_text(json.dumps(rec))
    shutdown_distributed()


def _run_window(a: argparse.Namespace, side: str, shards: Path, tmp: Path, dtype: str, i: int) -> dict:
    out = tmp / f"window_{i}_{side}.json"
    # the accelerator this bench process runs on (cpu unless DS_ACCELERATOR names another, e.g. cuda: bench.gpu_check)
    env = dict(os.environ, DS_ACCELERATOR=os.environ["DS_ACCELERATOR"], BENCH_DTYPE=dtype,
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    flags = [f"--{k}={getattr(a, k)}" for k in ("micro_batch", "grad_accum", "steps", "warmup", "threads",
                                                   "model", "profile_steps", "compile")]
    flags += [f for f in ("--dense_mlm", "--torch_dropout") if getattr(a, f[2:])]
    cmd = [sys.executable, "-m", "bench.bert_step", "--side", side, "--shards", str(shards), "--out", str(out),
           *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode or not out.exists():
        sys.stdout.write(proc.stdout[-6000:])
        raise SystemExit(f"bench window {i} ({side}) failed (exit {proc.returncode}): {' '.join(cmd)}")
    for line in proc.stdout.splitlines():
        if line.startswith(f"[{side}]"):
            print(f"{line} (window {i})", flush=True)
    return json.loads(out.read_text())


def interleaved(a: argparse.Namespace, tmp: Path, shards: Path, dtype: str) -> dict:
    """--rounds rounds of one window per side, in ABBA order (ours, trainer, trainer, ours, ...) so that a load
    trend on a shared machine does not favour either side; step_ratio is the median over rounds of ours / trainer
    within a round (adjacent windows), with the min and max as the spread."""
    sides = ["ours"] + ([] if a.skip_trainer else ["trainer"])
    rounds: list[dict] = []
    for r in range(a.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        rounds.append({side: _run_window(a, side, shards, tmp, dtype, len(sides) * r + j)
                       for j, side in enumerate(order)})
    return dict(summarize(rounds, a.skip_trainer), windows=rounds)


def summarize(rounds: list[dict], skip_trainer: bool = False) -> dict:
    """The figures of rounds of windows ({side: window record}); refuses a ratio when the sides did different work.
    Also reachable as `--summarize_windows FILE`: FILE holds the bench's last JSON line (its `windows`) or the list."""
    import statistics

    ours = [w["ours"] for w in rounds]
    res = {k: ours[-1].get(k) for k in ("flops_per_seq", "mlm_head", "fast_dropout", "peak_tflops")}
    res["ours_compiled"] = ours[-1].get("compiled", False)  # windows kept before --compile existed: eager
    res["ours_samples_per_s"] = statistics.median(w["samples_per_s"] for w in ours)
    res["ours_samples_per_s_windows"] = [w["samples_per_s"] for w in ours]
    mfus = [w["mfu"] for w in ours if w["mfu"] is not None]
    res["mfu"] = statistics.median(mfus) if mfus else None
    res["ours_peak_rss_bytes"] = max(w["peak_rss_bytes"] for w in ours)
    if skip_trainer:
        return res
    tr = [w["trainer"] for w in rounds]
    # the same work per optimizer step on both sides, or no ratio at all
    for key in ("samples_per_step", "optimizer", "trust_ratio_tensors", "threads"):
        got = {w[key] for w in ours + tr}
        if len(got) != 1:
            raise SystemExit(f"bench: the two sides differ in {key}: ours {[w[key] for w in ours]}, trainer "
                             f"{[w[key] for w in tr]}; the ratio would compare different work")
        res[f"both_{key}"] = got.pop()
    ratios = [w["ours"]["samples_per_s"] / w["trainer"]["samples_per_s"] for w in rounds]
    cpu_ratios = [w["ours"]["cpu_samples_per_s"] / w["trainer"]["cpu_samples_per_s"] for w in rounds]
    res.update(trainer_samples_per_s=statistics.median(w["samples_per_s"] for w in tr),
               trainer_samples_per_s_windows=[w["samples_per_s"] for w in tr],
               trainer_peak_rss_bytes=max(w["peak_rss_bytes"] for w in tr),
               step_ratio=statistics.median(ratios), step_ratio_rounds=ratios, step_ratio_min=min(ratios),
               step_ratio_max=max(ratios), cpu_step_ratio=statistics.median(cpu_ratios),
               cpu_step_ratio_rounds=cpu_ratios)
    print(f"[bench] step_ratio median {res['step_ratio']:.3f} over {len(ratios)} rounds (min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}); ours {res['ours_samples_per_s']:.3f} seq/s, trainer "
          f"{res['trainer_samples_per_s']:.3f} seq/s (medians); per CPU-second of each process: cpu_step_ratio "
          f"{res['cpu_step_ratio']:.3f} (min {min(cpu_ratios):.3f}, max {max(cpu_ratios):.3f})", flush=True)
    return res


def optimizer_state_bytes(engine) -> dict:
    """Bytes of the tensors the wrapped torch optimizer holds on this rank: its parameters (DeepSpeed's fp32 master
    copies: the full model under ZeRO-0, this rank's flat partition under ZeRO-1) and its state (moments)."""
    import torch

    inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    seen: set = set()

    def nbytes(tensors) -> int:
        n = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() > 1:
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
                if key not in seen:
                    seen.add(key)
                    n += t.numel() * t.element_size()
        return n

    master = nbytes(p for g in inner.param_groups for p in g["params"])
    moments = nbytes(v for st in inner.state.values() for v in st.values())
    return {"master_bytes": master, "moment_bytes": moments, "optimizer_state_bytes": master + moments}


def memory_worker(stage: int, out: Path) -> None:
    """One rank of the memory launch: build the 1.5B slice engine, run 2 optimizer steps, write this rank's numbers."""
    from bert_ref.data import build_data
    from bert_ref.step import step_fn
    from ds_core.rank.dist import init_distributed, set_seed, shutdown_distributed

    preset = _memory_slice(os.environ.get("BENCH_MEMORY_MODEL", BIG_SLICE["name"]))
    dist = init_distributed()
    set_seed(0)
    data = build_data(os.environ["BENCH_SHARDS"], dist.rank, dist.world_size, 2)
    engine = bench_engine(preset, bench_ds_config(2, 1, stage, os.environ["BENCH_DTYPE"], dist.world_size), "lans")
    it = iter(data)
    for _ in range(2):
        out_ = step_fn(engine, next(it))
        engine.backward(out_.loss)
        engine.step()
    rec = dict(optimizer_state_bytes(engine), rank=dist.rank, zero_stage=stage,
               peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               params=sum(p.numel() for p in engine.module.parameters()))
    data.close()
    (out / f"mem_zero{stage}_rank{dist.rank}.json").write_text(json.dumps(rec))
    shutdown_distributed()


def _memory_slice(model: str):
    """The memory launch's model: the BERT-1.5B slice, or bert_ref's tiny Pre-LN `debug_pre_ln` (tests of the bench)."""
    import dataclasses

    from bert_ref.configs import bert_1p5b, debug_pre_ln

    return debug_pre_ln(1) if model == "debug_pre_ln" else dataclasses.replace(bert_1p5b(1), **BIG_SLICE)


def memory_part(tmp: Path, dtype: str, model: str = BIG_SLICE["name"]) -> dict:
    preset = _memory_slice(model)
    shards = _shards(tmp / "memory", 16, 128, 20, min(30522, preset.vocab_size))
    res: dict = {}
    for stage in (0, 1):
        env = bench_env(threads=1, DS_ACCELERATOR="cpu", BENCH_SHARDS=str(shards), BENCH_DTYPE=dtype,
                        BENCH_MEMORY_MODEL=model)
        run_local_ranks(2, ["-m", "bench.bert_step", "--memory_worker", str(stage), "--out", str(tmp)], env=env,
                        log=tmp / f"memory_zero{stage}.log", what=f"memory launch with ZeRO-{stage}")
        ranks = [json.loads((tmp / f"mem_zero{stage}_rank{r}.json").read_text()) for r in (0, 1)]
        res[stage] = {k: max(r[k] for r in ranks) for k in ("optimizer_state_bytes", "master_bytes", "moment_bytes",
                                                           "peak_rss_bytes")}
        res[stage]["params"] = ranks[0]["params"]
        gib = 2**30
        print(f"[memory] {preset.name} ({ranks[0]['params'] / 1e6:.1f}M params), 2 ranks, ZeRO-{stage}: "
              f"optimizer state {res[stage]['optimizer_state_bytes'] / gib:.3f} GiB/rank (master "
              f"{res[stage]['master_bytes'] / gib:.3f} + moments {res[stage]['moment_bytes'] / gib:.3f}), peak RSS "
              f"{res[stage]['peak_rss_bytes'] / gib:.3f} GiB/rank", flush=True)
    return {"zero0_optimizer_state_bytes_per_rank": res[0]["optimizer_state_bytes"],
            "zero1_optimizer_state_bytes_per_rank": res[1]["optimizer_state_bytes"],
            "zero1_over_zero0_optimizer_memory": res[1]["optimizer_state_bytes"] / res[0]["optimizer_state_bytes"],
            "zero0_peak_rss_bytes_per_rank": res[0]["peak_rss_bytes"],
            "zero1_peak_rss_bytes_per_rank": res[1]["peak_rss_bytes"],
            "zero1_over_zero0_peak_rss": res[1]["peak_rss_bytes"] / res[0]["peak_rss_bytes"]}


# glibc malloc returns big freed blocks to the OS (mmap/munmap, trim), so every step page-faults its activations in
# again; keeping them in the heap is the allocator setting Intel's PyTorch CPU guide gets from jemalloc/tcmalloc.
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184"


def main() -> None:
    if "GLIBC_TUNABLES" not in os.environ and "--no_malloc_tuning" not in sys.argv:  # read at process start only
        os.execve(sys.executable, [sys.executable, "-m", "bench.bert_step", *sys.argv[1:]],
                  dict(os.environ, GLIBC_TUNABLES=MALLOC_TUNABLES))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--micro_batch", type=int, default=4)
    ap.add_argument("--grad_accum", type=int, default=8,
                    help="micro batches per optimizer step: 8, the fewest NVIDIA's phase-1 recipe runs per GPU (256 x "
                         "32 on 8 GPUs), so the optimizer is amortised as there; 1 shows the optimizer's share")
    ap.add_argument("--compile", default="off", choices=("off", "on"),
                    help="our side's model and losses through torch.compile as `--compile on` runs them "
                         "(ds_core.rank.compile.compile_model); the Trainer stays eager")
    ap.add_argument("--steps", type=int, default=2, help="measured optimizer steps per window (after --warmup)")
    ap.add_argument("--profile_steps", type=int, default=0,
                    help="torch.profiler over this many warm-up steps of each side (ds_core.outputs.profile: aten ops, "
                         "syncs, top kernels, device idle share); needs --warmup >= profile_steps + 2")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of one window per side (ABBA order); step_ratio is the median over rounds")
    ap.add_argument("--warmup", type=int, default=1, help="optimizer steps excluded from the measurement (>= 1)")
    ap.add_argument("--model", default=LARGE_SLICE["name"], choices=(LARGE_SLICE["name"], "bert_large", "debug"),
                    help="the BERT-Large slice, or the tiny debug preset (tests of the bench; no meaningful ratio)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: torch's default); the peak probe uses the same count")
    ap.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                    help="the run's precision rule (ds_core.device.precision.resolve_precision)")
    ap.add_argument("--dense_mlm", action="store_true",
                    help="our MLM decoder at all seq_len positions (transformers' default) instead of the sparse head")
    ap.add_argument("--torch_dropout", action="store_true",
                    help="torch's nn.Dropout for our hidden dropouts instead of bert_ref.model.FastDropout")
    ap.add_argument("--no_malloc_tuning", action="store_true", help="keep glibc's default malloc thresholds")
    ap.add_argument("--skip_trainer", action="store_true", help="no Trainer baseline (no step_ratio)")
    ap.add_argument("--skip_bound", action="store_true", help="skip the MFU upper bound (linear layers + optimizer)")
    ap.add_argument("--memory", action="store_true", help="also the 2-rank ZeRO-0 vs ZeRO-1 memory part")
    ap.add_argument("--memory_only", action="store_true", help="only the memory part (implies --memory)")
    ap.add_argument("--memory_model", default=BIG_SLICE["name"], choices=(BIG_SLICE["name"], "debug_pre_ln"),
                    help="the memory part's model: the BERT-1.5B slice, or the tiny Pre-LN debug preset (tests)")
    ap.add_argument("--memory_worker", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--side", default="", choices=("", "ours", "trainer"), help=argparse.SUPPRESS)
    ap.add_argument("--shards", default="", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    changes.add_argument(ap)
    ap.add_argument("--summarize_windows", default="",
                    help="re-summarize a kept run's windows (its last JSON line, or the list of rounds) and exit")
    a = ap.parse_args()
    changes.configure(a.ds_changes)  # before any rank starts: its processes inherit the switch
    if a.profile_steps and a.warmup < a.profile_steps + 2:
        ap.error(f"--profile_steps {a.profile_steps} needs --warmup >= {a.profile_steps + 2} (got {a.warmup}): the "
                 "profiled steps and one untimed step after them come out of the warm-up")
    if a.summarize_windows:
        kept = json.loads(Path(a.summarize_windows).read_text())
        print(json.dumps(summarize(kept["windows"] if isinstance(kept, dict) else kept, a.skip_trainer)))
        return
    if a.memory_worker >= 0:
        memory_worker(a.memory_worker, Path(a.out))
        return
    if a.side:
        side_worker(a, a.side, Path(a.shards), Path(a.out))
        return
    if a.warmup < 1:
        ap.error("--warmup must be >= 1 (the Trainer's rate is timed from the end of a warm-up step)")
    import time

    import torch
    from deepspeed.accelerator import get_accelerator

    from ds_core.device.precision import resolve_precision

    t0 = time.perf_counter()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype, reason = resolve_precision(a.precision, get_accelerator().device_name())
    print(f"[bench] precision {dtype}: {reason}", flush=True)
    result: dict = {"bench": "bert_step", "precision": dtype, "precision_reason": reason,
                    "threads": torch.get_num_threads(), "micro_batch": a.micro_batch, "grad_accum": a.grad_accum,
                    "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}
    a.memory = a.memory or a.memory_only
    with tempfile.TemporaryDirectory(prefix="bert_step_") as d:
        tmp = Path(d)
        if a.memory:  # first: before this process holds a model and a process group
            result.update(memory_part(tmp, dtype, a.memory_model), memory_model=a.memory_model)
        if not a.memory_only:
            # one epoch per window: each side trains on every sample of the shard once (in its own order)
            total = a.micro_batch * a.grad_accum * (a.steps + a.warmup)
            preset = _slice(a.model)
            shards = _shards(tmp, total, preset.seq_len, preset.max_predictions_per_seq,
                             min(30522, preset.vocab_size))
            result.update(interleaved(a, tmp, shards, dtype))
            if not a.skip_bound:
                result.update(bound_part(a, _slice(a.model), result["peak_tflops"], dtype))
    result["targets"] = ({} if a.memory_only else {"step_ratio": 1.3}) | \
        ({"zero1_over_zero0_optimizer_memory": 0.55} if a.memory else {})
    if "step_ratio" in result:
        result["step_ratio_target_met"] = result["step_ratio"] >= 1.3
    if "zero1_over_zero0_optimizer_memory" in result:
        result["memory_target_met"] = result["zero1_over_zero0_optimizer_memory"] <= 0.55
    result["bench_seconds"] = time.perf_counter() - t0
    print(json.dumps(result))


_DIST = None  # ds_core.rank.dist.DistInfo of this process, set in main()

if __name__ == "__main__":
    run_main(main)  # ends without interpreter finalisation: see ds_core.rank.process_end
