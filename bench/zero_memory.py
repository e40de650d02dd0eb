"""Measured vs predicted per-rank memory, ZeRO 0/1/2/3 x fp32/bf16 x accumulation 1/2: 2 CPU ranks, a 110 M BERT.

One real 2-rank DeepSpeed job (CPU accelerator, gloo, torch AdamW) runs every case in turn (CASES; a launch costs a
minute of imports here): it builds a BertForPreTraining (hidden 768, 12 layers), trains it for 2 optimizer steps and
measures on every rank:

  peak      VmHWM while the steps run (reset through /proc/self/clear_refs after engine init, and before each step's
            forward/backward and optimizer step, giving the per-phase peaks too) minus the RSS before the model was
            built: every byte the model, its optimizer and a step touched, transients included.
  tensors   sum of the unique storages of all live torch tensors after the last step, minus those alive before the
            case: what the rank holds between steps.

Why RSS: the CPU accelerator has no allocator statistics (get_accelerator().max_memory_allocated() is 0 there);
large blocks are forced to mmap (MALLOC_MMAP_THRESHOLD_) so freed memory leaves the RSS and a peak is a peak.

bf16 at ZeRO >= 1 accumulates in fp32 (data_types.grad_accum_dtype, as the shipped configs); bf16 ZeRO-0 cannot
(DeepSpeed 0.19 raises NotImplementedError) and accumulates in bf16. The prediction is
ds_tools.zero_memory_model.estimate() (what ds-tune uses) for the same model, stage, precision, accumulation, buckets,
non-fused Adam. Activations are small (micro batch 1, 64 tokens) so the comparison is about what DeepSpeed allocates.

    python -m bench.zero_memory                        # every case; last line: {"max_rel_error": ...}
    python -m bench.zero_memory --cases small          # the slice tests/test_bench_zero_memory.py runs
    python -m bench.zero_memory --save m.json          # keep the measurements; --measured m.json re-compares them
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
from ds_core.compat import changes
from ds_core.rank.process_end import run_main

BERT = {"model_type": "bert", "architectures": ["BertForPreTraining"], "hidden_size": 768, "num_hidden_layers": 12,
        "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 30522, "max_position_embeddings": 128,
        "type_vocab_size": 2}
SEQ, MICRO, STEPS = 64, 1, 2
REDUCE_BUCKET = 20_000_000
# ZeRO 0-3 x fp32/bf16 x accumulation 1/2. bf16 at ZeRO >= 1 accumulates in fp32 (data_types.grad_accum_dtype, as the
# shipped configs and ds_core.config.settle_grad_accum_dtype do); ZeRO-0 has no bf16 + fp32-accumulation path in
# DeepSpeed 0.19, so bf16 ZeRO-0 accumulates in bf16. "z1-bf16acc-ga1" is the shipped zero1_bf16.json (bf16, no
# data_types): DeepSpeedZeroOptimizer instead of BF16_Optimizer.
CASES = tuple(f"z{st}-{p}-ga{ga}" for st in (0, 1, 2, 3) for p in ("fp32", "bf16") for ga in (1, 2)) + (
    "z1-bf16acc-ga1",)
SMALL = ("z1-bf16-ga2", "z2-fp32-ga1")      # the slice the test runs: the BF16_Optimizer gap and a ZeRO-2 path


def parse_case(case: str) -> dict:
    """"z{stage}-{fp32|bf16|bf16acc}-ga{n}" -> stage, precision, grad_accum, grad_accum_dtype (None: the model's)."""
    try:
        st, prec, ga = case.split("-")
        stage, accum = int(st[1:]), int(ga[2:])
        assert st[0] == "z" and ga.startswith("ga") and prec in ("fp32", "bf16", "bf16acc") and stage in (0, 1, 2, 3)
    except (ValueError, AssertionError):
        raise SystemExit(f"case {case!r}: expected z{{0..3}}-{{fp32|bf16|bf16acc}}-ga{{N}}") from None
    acc = "fp32" if prec == "bf16" and stage > 0 else None
    return {"stage": stage, "precision": "bf16" if prec.startswith("bf16") else "fp32", "grad_accum": accum,
            "grad_accum_dtype": acc}


def ds_config(case: str, world: int) -> dict:
    c = parse_case(case)
    zero = {"stage": c["stage"], "reduce_bucket_size": REDUCE_BUCKET, "allgather_bucket_size": REDUCE_BUCKET,
            "overlap_comm": False, "contiguous_gradients": True}
    if c["stage"] == 3:
        zero.update(stage3_prefetch_bucket_size=REDUCE_BUCKET, stage3_param_persistence_threshold=100_000)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": c["grad_accum"],
           "train_batch_size": MICRO * world * c["grad_accum"], "gradient_clipping": 1.0,
           "bf16": {"enabled": c["precision"] == "bf16"}, "zero_optimization": zero, "steps_per_print": 1_000_000,
           # torch's AdamW: the CPU accelerator's FusedAdam would need a C++ build; the model knows it is non-fused
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}}}
    if c["grad_accum_dtype"]:
        cfg["data_types"] = {"grad_accum_dtype": c["grad_accum_dtype"]}
    return cfg


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
        except Exception:  # noqa: BLE001 - tensors without storage (meta, some wrapper subclasses)
            continue
    return sum(seen.values())


def worker(cases: list, out: Path, seq: int) -> None:
    import deepspeed
    import torch
    from transformers import BertConfig, BertForPreTraining

    from ds_core.rank.dist import init_distributed, shutdown_distributed

    init_distributed()  # DeepSpeed's, plus the release of its CPU allreduce workspace name in /dev/shm
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # warm-up: load the bf16/fp32 matmul and optimizer kernels and gloo buffers so their pages are in the baseline
    for dt in (torch.bfloat16, torch.float32):
        w = torch.nn.Linear(64, 64).to(dt)
        w(torch.randn(4, 64, dtype=dt)).sum().backward()
        torch.optim.AdamW(w.parameters()).step()
        torch.distributed.all_reduce(torch.ones(1024, dtype=dt))
    del w
    # One process runs every case in turn (a launch costs ~1 min of imports here); each case measures from its own
    # baseline, and large blocks are mmapped (MALLOC_MMAP_THRESHOLD_), so what a finished case freed left the RSS.
    for case in cases:
        c = parse_case(case)
        gc.collect()
        rss0 = _rss()
        # ZeRO-3's hooks keep a finished engine's tensors alive (a leak of deepspeed.destroy()): they sit in this
        # case's RSS baseline, and are subtracted from its live-tensor count
        tensors0 = _live_tensor_bytes()
        torch.manual_seed(0)
        cfg = ds_config(case, world)
        bert = BertConfig(**{k: v for k, v in BERT.items() if k not in ("model_type", "architectures")})
        # built whole, then partitioned by deepspeed.initialize; the peak is reset after init, so only training
        # counts (zero.Init would trip over transformers' padding_idx init on empty partitions)
        model = BertForPreTraining(bert)
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        del model
        gc.collect()
        rss_init = _rss()
        reset_ok = _reset_hwm()
        g = torch.Generator().manual_seed(rank)
        phase = {"fwd_bwd": 0, "step": 0}
        for _ in range(STEPS):
            _reset_hwm()
            for _ in range(c["grad_accum"]):
                ids = torch.randint(0, BERT["vocab_size"], (MICRO, seq), generator=g)
                out_ = engine(input_ids=ids, labels=ids, next_sentence_label=torch.zeros(MICRO, dtype=torch.long))
                engine.backward(out_.loss)
                if not engine.is_gradient_accumulation_boundary():
                    engine.step()       # DeepSpeed's step() between boundaries only counts the micro step
            phase["fwd_bwd"] = max(phase["fwd_bwd"], _hwm() - rss0)
            _reset_hwm()
            engine.step()
            phase["step"] = max(phase["step"], _hwm() - rss0)
        del out_
        gc.collect()
        rec = {"case": case, **c, "rank": rank, "seq": seq, "rss_before_model": rss0, "init_delta": rss_init - rss0,
               "peak_delta": max(phase.values()), "phase_peak_delta": phase,
               "tensors_after_step": _live_tensor_bytes() - tensors0, "hwm_reset": reset_ok,
               "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                             for p in engine.module.parameters()),
               "optimizer": type(engine.optimizer).__name__}
        (out / f"{case}_rank{rank}.json").write_text(json.dumps(rec))
        engine.destroy()
        del engine
        gc.collect()
        torch.distributed.barrier()
    shutdown_distributed()


# ------------------------------------------------------------------------------------------------- driver

def measure(cases: list, tmp: Path, timeout: float, seq: int) -> list:
    out = tmp / "records"
    out.mkdir()
    env = bench_env(threads=1, DS_ACCELERATOR="cpu", MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    run_local_ranks(2, ["-m", "bench.zero_memory", "--worker", "--cases", ",".join(cases), "--out", str(out),
                        "--seq", str(seq)],
                    env=env, log=tmp / "ranks.log", timeout_s=timeout, what="ZeRO memory run")
    recs = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    if len(recs) != 2 * len(cases):
        sys.exit(f"the ranks wrote {len(recs)} of {2 * len(cases)} records in {out}; log: {tmp / 'ranks.log'}")
    return recs


def predict(shape, case: str):
    """ds-tune's estimate for the bench's case: same stage, precision, accumulation, buckets, CPU (non-fused Adam)."""
    from ds_tools.zero_memory_model import estimate

    c = parse_case(case)
    z = ds_config(case, 2)["zero_optimization"]
    return estimate(shape, c["stage"], MICRO, 2, 1, fused_adam=False, precision=c["precision"],
                    grad_accum=c["grad_accum"], grad_accum_dtype=c["grad_accum_dtype"],
                    buckets={k: z[k] for k in ("reduce_bucket_size", "allgather_bucket_size")
                             } | {"stage3_prefetch_bucket_size": REDUCE_BUCKET},
                    overlap_comm=z["overlap_comm"], contiguous_gradients=z["contiguous_gradients"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cases", default=",".join(CASES),
                    help="comma-separated z{0..3}-{fp32|bf16|bf16acc}-ga{N} (default: all); 'small' = "
                         + ",".join(SMALL))
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the whole 2-rank run")
    ap.add_argument("--save", type=Path, help="also write the measured records (JSON) here")
    changes.add_argument(ap)
    ap.add_argument("--measured", type=Path, help="compare against records saved by --save instead of running")
    ap.add_argument("--target", type=float, default=0.10, help="max relative error per case")
    ap.add_argument("--seq", type=int, default=SEQ,
                    help=f"tokens per sample (default {SEQ}; the prediction uses the same). Fewer is faster where the "
                         "CPU has no native bf16 and makes activations an even smaller share")
    a = ap.parse_args()
    changes.configure(a.ds_changes)  # before any rank starts: its processes inherit the switch
    cases = list(SMALL) if a.cases == "small" else [c for c in a.cases.split(",") if c]
    for c in cases:
        parse_case(c)
    if a.worker:
        return worker(cases, a.out, a.seq)

    from ds_tools.model_shapes import model_shape

    GB = 1e9   # this bench's tables are in 10^9 bytes (ds-tune prints GiB)

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = tmp / "bert_bench.json"
        spec.write_text(json.dumps({**BERT, "seq_len": a.seq}))
        shape = model_shape(str(spec), a.seq)
        t0 = time.time()
        if a.measured:
            recs = [r for r in json.loads(a.measured.read_text()) if r["case"] in cases]
            seqs = {r.get("seq", SEQ) for r in recs}  # records saved before --seq existed ran SEQ tokens
            if seqs != {a.seq}:
                sys.exit(f"{a.measured}: the records ran {sorted(seqs)} tokens per sample; pass --seq to match")
        else:
            recs = measure(cases, tmp, a.timeout, a.seq)
        if a.save:
            a.save.write_text(json.dumps(recs, indent=1) + "\n")
    rows = []
    for r in sorted(recs, key=lambda r: (cases.index(r["case"]), r["rank"])):
        est = predict(shape, r["case"])
        err = (est.total - r["peak_delta"]) / r["peak_delta"]
        err_res = (est.resident - r["tensors_after_step"]) / r["tensors_after_step"]
        rows.append((r, est, err, err_res))
    print(f"BERT {shape.params / 1e6:.1f} M parameters, 2 CPU ranks, micro batch {MICRO} x {a.seq} tokens, "
          f"torch AdamW, buckets {REDUCE_BUCKET:.0e}, contiguous gradients, no overlap; GB = 1e9 bytes; "
          f"{time.time() - t0:.0f} s")
    print("| case | ZeRO | precision | accum | accum dtype | rank | DeepSpeed optimizer | predicted peak | "
          "measured peak (RSS) | error | predicted resident | measured live tensors | error |")
    print("|:---|---:|:---|---:|:---|---:|:---|---:|---:|---:|---:|---:|---:|")
    for r, est, err, err_res in rows:
        print(f"| {r['case']} | {r['stage']} | {r['precision']} | {r['grad_accum']} | "
              f"{r['grad_accum_dtype'] or r['precision']} | {r['rank']} | {r['optimizer']} | {est.total / GB:.3f} | "
              f"{r['peak_delta'] / GB:.3f} | {100 * err:+.1f} % | {est.resident / GB:.3f} | "
              f"{r['tensors_after_step'] / GB:.3f} | {100 * err_res:+.1f} % |")
    print("predicted peak = ds_tools.zero_memory_model.estimate (what ds-tune uses): resident states + the largest of "
          "the per-phase transients (forward/backward with activations, boundary reduction, optimizer step); "
          "measured peak = VmHWM over the training steps minus the RSS before the model was built. resident = what "
          "a rank holds between steps vs the live tensors' storages after the last step.")
    worst = max(max(abs(e), abs(er)) for _, _, e, er in rows)
    print(json.dumps({"bench": "zero_memory", "params": shape.params, "cases": cases,
                      "max_rel_error": round(worst, 4), "target": a.target,
                      "max_rel_error_peak": round(max(abs(e) for _, _, e, _ in rows), 4),
                      "max_rel_error_resident": round(max(abs(er) for _, _, _, er in rows), 4),
                      "per_case": {f"{r['case']}_rank{r['rank']}": {
                          "optimizer": r["optimizer"], "predicted_peak_gb": round(est.total / GB, 3),
                          "measured_peak_gb": round(r["peak_delta"] / GB, 3), "peak_error": round(e, 4),
                          "measured_phase_peak_gb": {k: round(v / GB, 3) for k, v in r["phase_peak_delta"].items()},
                          "predicted_phase_peak_gb": {k: round((est.resident + v) / GB, 3)
                                                      for k, v in est.phase_totals().items()},
                          "resident_error": round(er, 4)} for r, est, e, er in rows}}))


if __name__ == "__main__":
    run_main(main)  # ends without interpreter finalisation: see ds_core.rank.process_end
