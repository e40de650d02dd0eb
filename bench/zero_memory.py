"""Measured vs predicted per-rank memory for ZeRO 0, 1 and 3: 2 CPU ranks, a BERT of ~110 M parameters.

For each stage this launches a real 2-rank DeepSpeed job (CPU accelerator, gloo, bf16, torch AdamW) that trains a
BertForPreTraining (hidden 768, 12 layers) for a few steps and measures on every rank:

  peak      VmHWM while training steps run (peak reset via /proc/self/clear_refs after engine init) minus the RSS
            before the model was built: every byte the model, its optimizer and a step touched, transients included.
  tensors   sum of the unique storages of all live torch tensors after the last step (params, fp32 master,
            optimizer state, persistent buffers): what the rank holds between steps.

The prediction is ds_core.tuning.estimate() (the ds-tune memory model) for the same model, stage, micro batch and
buckets. Activations are kept small (micro batch 1, 64 tokens) so the comparison is about model-state memory.
Large allocations are forced to mmap (MALLOC_MMAP_THRESHOLD_) so freed memory leaves the RSS and a peak is a peak.

    python -m bench.zero_memory            # prints the table; last line: {"max_rel_error": ...}
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import bench_env, run_local_ranks


BERT = {"model_type": "bert", "architectures": ["BertForPreTraining"], "hidden_size": 768, "num_hidden_layers": 12,
        "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 30522, "max_position_embeddings": 128,
        "type_vocab_size": 2}
SEQ, MICRO, STEPS = 64, 1, 2
REDUCE_BUCKET = 20_000_000
STAGES = (0, 1, 3)


def ds_config(stage: int, world: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": REDUCE_BUCKET, "overlap_comm": False, "contiguous_gradients": True}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=REDUCE_BUCKET, stage3_param_persistence_threshold=100_000)
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "train_batch_size": MICRO * world, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "zero_optimization": zero, "steps_per_print": 1_000_000,
            # torch's AdamW: the CPU accelerator's FusedAdam would need a C++ build; the model knows it is non-fused
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}}}


# ------------------------------------------------------------------------------------------- worker (per rank)

def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")           # 5 = reset the peak RSS (VmHWM) to the current RSS
        return True
    except OSError:
        return False


def _live_tensor_bytes() -> int:
    import torch

    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                st = obj.untyped_storage()
                if st.data_ptr():
                    seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except Exception:       # tensors without storage (meta, some wrapper subclasses)
            continue
    return sum(seen.values())


def worker(stage: int, out: Path) -> None:
    import torch
    import deepspeed
    from transformers import BertConfig, BertForPreTraining

    from ds_core.engine import init_distributed, shutdown_distributed

    init_distributed()  # DeepSpeed's, plus the release of its CPU allreduce workspace name in /dev/shm
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    # warm-up: load the bf16 matmul/optimizer kernels and gloo buffers so their pages are in the baseline
    w = torch.nn.Linear(64, 64).bfloat16()
    w(torch.randn(4, 64, dtype=torch.bfloat16)).sum().backward()
    torch.optim.AdamW(w.parameters()).step()
    torch.distributed.all_reduce(torch.ones(1024))
    del w
    gc.collect()
    rss0 = _rss()

    cfg = ds_config(stage, world)
    bert = BertConfig(**{k: v for k, v in BERT.items() if k not in ("model_type", "architectures")})
    # built whole, then partitioned by deepspeed.initialize; the peak is reset after init, so only training counts
    # (zero.Init would trip over transformers' padding_idx init on empty partitions)
    model = BertForPreTraining(bert)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    del model
    gc.collect()
    rss_init = _rss()
    reset_ok = _reset_hwm()

    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        ids = torch.randint(0, BERT["vocab_size"], (MICRO, SEQ), generator=g)
        out_ = engine(input_ids=ids, labels=ids, next_sentence_label=torch.zeros(MICRO, dtype=torch.long))
        engine.backward(out_.loss)
        engine.step()
    peak = _hwm()
    del out_
    gc.collect()
    rec = {"rank": rank, "stage": stage, "rss_before_model": rss0, "init_delta": rss_init - rss0,
           "peak_delta": peak - rss0, "tensors_after_step": _live_tensor_bytes(), "hwm_reset": reset_ok,
           "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters()),
           "optimizer": type(engine.optimizer).__name__}
    (out / f"rank{rank}.json").write_text(json.dumps(rec))
    torch.distributed.barrier()
    shutdown_distributed()


# ------------------------------------------------------------------------------------------------- driver

def run_stage(stage: int, tmp: Path, timeout: float) -> list:
    out = tmp / f"stage{stage}"
    out.mkdir()
    env = bench_env(threads=1, DS_ACCELERATOR="cpu", MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    run_local_ranks(2, ["-m", "bench.zero_memory", "--worker", "--stage", str(stage), "--out", str(out)], env=env,
                    log=tmp / f"stage{stage}.log", timeout_s=timeout, what=f"ZeRO-{stage} run")
    files = sorted(out.glob("rank*.json"))
    if len(files) != 2:
        sys.exit(f"ZeRO-{stage} run wrote {len(files)} of 2 rank records in {out}")
    return [json.loads(f.read_text()) for f in files]


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--stages", default=",".join(map(str, STAGES)), help="ZeRO stages to measure")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per stage run")
    a = ap.parse_args()
    if a.worker:
        return worker(a.stage, a.out)

    from ds_core.tuning import GB, estimate, model_shape, resident_state_bytes

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = tmp / "bert_bench.json"
        spec.write_text(json.dumps({**BERT, "seq_len": SEQ}))
        shape = model_shape(str(spec), SEQ)
        rows, errs = [], []
        for stage in map(int, a.stages.split(",")):
            t0 = time.time()
            ranks = run_stage(stage, tmp, a.timeout)
            est = estimate(shape, stage, MICRO, 2, 1, fused_adam=False, buckets={
                "reduce_bucket_size": REDUCE_BUCKET, "stage3_prefetch_bucket_size": REDUCE_BUCKET})
            resident = resident_state_bytes(shape, stage, 2, {"reduce_bucket_size": REDUCE_BUCKET})
            for r in ranks:
                err = (est.total - r["peak_delta"]) / r["peak_delta"]
                err_res = (resident - r["tensors_after_step"]) / r["tensors_after_step"]
                errs += [abs(err), abs(err_res)]
                rows.append((stage, r["rank"], r["optimizer"], est.total, r["peak_delta"], err, resident,
                             r["tensors_after_step"], err_res, time.time() - t0))
    print(f"BERT {shape.params / 1e6:.1f} M parameters, 2 CPU ranks, micro batch {MICRO} x {SEQ} tokens, bf16, "
          f"torch AdamW; GB = 1e9 bytes")
    print("| ZeRO | rank | DeepSpeed optimizer | predicted peak | measured peak (RSS) | error "
          "| predicted resident states | measured live tensors after step | error |")
    print("|---:|---:|:---|---:|---:|---:|---:|---:|---:|")
    for st, rk, opt, tot, peak, err, res, tens, err_res, _ in rows:
        print(f"| {st} | {rk} | {opt} | {tot / GB:.3f} | {peak / GB:.3f} | {100 * err:+.1f} % | {res / GB:.3f} "
              f"| {tens / GB:.3f} | {100 * err_res:+.1f} % |")
    print("predicted peak = model states (20 B/param at ZeRO-0; DeepSpeed estimators for ZeRO-3) + non-fused Adam "
          "temporary + buckets + activations (ds_core.tuning.estimate); resident = what a rank holds between steps "
          "(ds_core.tuning.resident_state_bytes). max_rel_error covers both comparisons.")
    print(json.dumps({"bench": "zero_memory", "params": shape.params, "stages": sorted({r[0] for r in rows}),
                      "max_rel_error": round(max(errs), 4), "target": 0.15,
                      "max_rel_error_peak": round(max(abs(r[5]) for r in rows), 4),
                      "max_rel_error_resident": round(max(abs(r[8]) for r in rows), 4),
                      "per_rank": {f"zero{r[0]}_rank{r[1]}": {"predicted_peak_gb": round(r[3] / GB, 3),
                                                              "measured_peak_gb": round(r[4] / GB, 3),
                                                              "predicted_resident_gb": round(r[6] / GB, 3),
                                                              "measured_resident_gb": round(r[7] / GB, 3)}
                                   for r in rows}}))


if __name__ == "__main__":
    main()
