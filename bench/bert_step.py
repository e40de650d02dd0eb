"""BERT training-step benchmark on the CPU accelerator (DeepSpeed engine, bf16).

1. MFU: one process, ZeRO-0, a BERT-Large-shaped slice (hidden 1024, 16 heads, 4 layers, seq 128, vocab 30528).
   Training-step TFLOPs come from ds_core.metrics (the one clock, warm-up steps excluded) with bert_ref's FLOPs per
   sequence; the baseline is this CPU's bf16 matmul peak, measured in the same run by ds_core.metrics.cpu_peak_tflops
   with the same thread count, and probed again (2 s) after the run: MFU = step TFLOPs / the best probe.
   Settings (each can be turned back for comparison): 1 torch thread (--threads; on this 2-vCPU shared VM two threads
   do not raise the probe's AMX peak but every matmul waits at a barrier for the busier core), the sparse MLM head
   (--dense_mlm; the MLM transform + decoder run at the max_predictions_per_seq = 20 positions per sequence, and the
   FLOPs count exactly those: 2 * 20 * (h^2 + hV) instead of 2 * 128 * (h^2 + hV)), bert_ref.model.FastDropout for
   the hidden dropouts (--torch_dropout), glibc malloc thresholds that keep freed activations in the heap
   (--no_malloc_tuning). Tried without gain here: --compile, micro batch 32, copying dY^T contiguous for the weight
   gradient matmuls (the bf16 transpose copy costs what it saves).
2. Memory: two ranks, a BERT-1.5B-shaped slice (hidden 1600, 25 heads, 2 layers), LANS (the 1.5B optimizer), one
   launch with ZeRO-0 and one with ZeRO-1. Per rank: optimizer-state bytes (fp32 master weights + moments, read from
   the tensors the optimizer holds) and the process peak RSS.
3. Bound (after 1, --skip_bound): mfu_upper_bound, the MFU the step would have if only its linear layers' GEMMs and
   the LAMB update cost anything (see bound_part): where it is below the target, the target is out of reach on this
   CPU at these settings.
The last line printed is one JSON object (mfu, zero1_over_zero0_optimizer_memory, ...).

    python bench/bert_step.py [--micro_batch 16] [--grad_accum 2] [--steps 4] [--threads 1] [--compile] [--dense_mlm]
        [--torch_dropout] [--no_malloc_tuning] [--skip_memory] [--skip_mfu] [--skip_bound]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

LARGE_SLICE = dict(name="bert_large_4l", num_hidden_layers=4)
BIG_SLICE = dict(name="bert_1p5b_2l", num_hidden_layers=2)


def _ds_config(micro: int, accum: int, stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000_000},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


def _shards(tmp: Path, n: int, seq: int, preds: int, vocab: int) -> Path:
    from bert_ref.prep.h5io import synthetic_arrays, write_shard

    d = tmp / f"shards_{seq}"
    d.mkdir(parents=True, exist_ok=True)
    write_shard(d / "part-00000.hdf5", synthetic_arrays(n, seq, preds, vocab_size=vocab, seed=0), compression=None)
    return d


def _engine(preset, ds_config: dict, optimizer: str, compile_model: bool = False, sparse_mlm: bool = False,
            fast_dropout: bool = False):
    from bert_ref.layerwise import attach_zero_layout
    from bert_ref.model import build_model
    from bert_ref.optim import OptimArgs, build_optimizer, schedule_for
    from ds_core.engine import build_engine

    model = build_model(preset, sparse_mlm=sparse_mlm, fast_dropout=fast_dropout)
    args = OptimArgs(optimizer=optimizer, learning_rate=1e-4, warmup_proportion=0.0)
    opt = build_optimizer(model, args)
    engine = build_engine(model, ds_config, optimizer=opt, lr_scheduler=schedule_for(args, 10**6))
    attach_zero_layout(engine, opt)  # per-tensor LAMB / LANS trust ratios under ZeRO, as bert_ref.train
    if compile_model:
        engine.compile()
    return engine


def mfu_part(a: argparse.Namespace, tmp: Path) -> dict:
    """One process: the whole training step (fwd, bwd, bf16 grads -> fp32 master, clip, LAMB) through ds_core.train."""
    import dataclasses

    import torch

    from bert_ref.configs import bert_large
    from bert_ref.data import build_data
    from bert_ref.model import flops_per_sequence
    from bert_ref.step import make_step_fn
    from ds_core.config import TrainConfig
    from ds_core.engine import init_distributed, set_seed, shutdown_distributed
    from ds_core.loop import train

    if a.threads:
        torch.set_num_threads(a.threads)
    preset = dataclasses.replace(bert_large(1), **LARGE_SLICE)
    dist = init_distributed()
    set_seed(0)
    total = a.micro_batch * a.grad_accum * (a.steps + a.warmup)
    data = build_data(str(_shards(tmp, total, 128, 20, 30522)), 0, 1, a.micro_batch)
    engine = _engine(preset, _ds_config(a.micro_batch, a.grad_accum, 0), "lamb", a.compile, not a.dense_mlm,
                     not a.torch_dropout)
    preds = 0 if a.dense_mlm else preset.max_predictions_per_seq
    flops = flops_per_sequence(preset, mlm_positions=preds)
    cfg = TrainConfig(run_dir=str(tmp / "mfu_run"), max_steps=a.steps + a.warmup, throughput_warmup_steps=a.warmup,
                      save_final_checkpoint=False, progress_bar=False)
    s = train(engine, make_step_fn(preds), data, cfg, dist, model_name=preset.name, flops_per_sample=flops,
              seq_len=preset.seq_len)
    data.close()
    shutdown_distributed()
    # ds_core probes the peak once, best of 0.5 s; on shared cores that window can be all contention (seen: 0.49 vs
    # 1.14 TFLOPs), which would inflate the MFU. Probe again after the run (2 s) and divide by the best probe.
    from ds_core.metrics import cpu_peak_tflops

    probes = [s["peak_tflops_per_accelerator"], cpu_peak_tflops(seconds=2.0)]
    s = dict(s, peak_tflops_per_accelerator=max(probes), mfu=s["tflops_per_accelerator"] / max(probes))
    head = "dense" if a.dense_mlm else f"sparse ({preds}/seq)"
    print(f"[mfu] {preset.name}: micro {a.micro_batch} x accum {a.grad_accum}, threads {torch.get_num_threads()}, "
          f"compile {a.compile}, MLM head {head}: {s['samples_per_s']:.2f} seq/s, {s['tflops_per_accelerator']:.3f} "
          f"TFLOPs vs bf16 "
          f"matmul peak {s['peak_tflops_per_accelerator']:.3f} TFLOPs -> MFU {s['mfu']:.3f}", flush=True)
    return {"mfu": s["mfu"], "step_tflops": s["tflops_per_accelerator"],
            "peak_bf16_matmul_tflops": s["peak_tflops_per_accelerator"], "seqs_per_s": s["samples_per_s"],
            "flops_per_seq": flops, "mlm_head": head, "micro_batch": a.micro_batch, "grad_accum": a.grad_accum,
            "peak_probes_tflops": probes, "threads": torch.get_num_threads(), "compile": a.compile,
            "fast_dropout": not a.torch_dropout,
            "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}


def bound_part(a: argparse.Namespace, peak: float) -> dict:
    """What this CPU allows at all: the MFU the step would have if everything but its linear layers' GEMMs and the
    optimizer's own update were free (attention, softmax, LayerNorm, GELU, dropout, embeddings, loss, DeepSpeed's
    bf16 <-> fp32 copies and clipping cost nothing). Same threads, shapes, micro batch and accumulation as mfu_part.

    t_linear: forward + backward (input and weight gradients) of every nn.Linear of the slice at its real row count
    (B*S rows in the encoder, B*P in the sparse MLM head, B in pooler/NSP), bf16, median of 5.
    t_opt: one step of the bench's LAMB over two flat fp32 tensors holding the slice's parameters (the decay and
    no-decay groups: the layout DeepSpeed's bf16 optimizer hands it), median of 3.
    mfu_upper_bound = step FLOPs / (accum * t_linear + t_opt) / peak; linear_only_mfu = linear FLOPs / t_linear /
    peak. On a CPU where mfu_upper_bound is below the 0.5 target the target is out of reach however the rest is done."""
    import dataclasses
    import statistics
    import time

    import torch

    from bert_ref.configs import bert_large
    from bert_ref.model import flops_per_sequence, hf_config
    from bert_ref.optim import OptimArgs, build_optimizer, param_groups

    preset = dataclasses.replace(bert_large(1), **LARGE_SLICE)
    h, inter, B = preset.hidden_size, preset.intermediate_size, a.micro_batch
    P = preset.seq_len if a.dense_mlm else preset.max_predictions_per_seq
    rows_in_out = ([(B * preset.seq_len, h, h)] * 4 + [(B * preset.seq_len, h, inter), (B * preset.seq_len, inter, h)]
                   ) * preset.num_hidden_layers + [(B * P, h, h), (B * P, h, preset.vocab_size), (B, h, h), (B, h, 2)]
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(r, k, generator=g).bfloat16(),
               torch.nn.Linear(k, n).bfloat16(), torch.randn(r, n, generator=g).bfloat16()) for r, k, n in rows_in_out]
    for _, lin, _ in layers:
        lin.requires_grad_(True)
    linear_flops = sum(6 * r * k * n for r, k, n in rows_in_out)

    def linear_pass() -> float:
        t0 = time.perf_counter()
        for x, lin, dy in layers:
            xg = x.requires_grad_(True)
            lin(xg).backward(dy)
            xg.grad = None
            lin.weight.grad = lin.bias.grad = None
        return time.perf_counter() - t0

    linear_pass()
    t_linear = statistics.median(linear_pass() for _ in range(5))
    del layers

    # the slice's parameters as DeepSpeed's bf16 optimizer holds them: one flat fp32 tensor per weight-decay group
    from transformers import BertForPreTraining

    with torch.device("meta"):
        groups = param_groups(BertForPreTraining(hf_config(preset)), 0.01)
    sizes = [sum(prm.numel() for prm in grp["params"]) for grp in groups]
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(sizes[0]))
    model.bias = torch.nn.Parameter(torch.zeros(sizes[1]))
    opt = build_optimizer(model, OptimArgs(optimizer="lamb", learning_rate=1e-4, warmup_proportion=0.0))
    for prm in (model.weight, model.bias):
        prm.grad = torch.randn(prm.shape, generator=g)

    def opt_step() -> float:
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    opt_step()
    t_opt = statistics.median(opt_step() for _ in range(3))
    step_flops = flops_per_sequence(preset, mlm_positions=0 if a.dense_mlm else P) * B * a.grad_accum
    bound = step_flops / (a.grad_accum * t_linear + t_opt) / 1e12 / peak
    linear_only = linear_flops / t_linear / 1e12 / peak
    print(f"[bound] linear layers fwd+bwd {t_linear:.3f} s per micro batch ({linear_flops / t_linear / 1e12:.3f} "
          f"TFLOPs, {linear_only:.3f} of peak), LAMB update {t_opt:.3f} s per step over "
          f"{sum(sizes) / 1e6:.1f}M params -> MFU upper bound {bound:.3f}", flush=True)
    return {"mfu_upper_bound": bound, "linear_only_mfu": linear_only, "linear_fwd_bwd_s_per_micro": t_linear,
            "optimizer_update_s_per_step": t_opt}


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
    import dataclasses

    from bert_ref.configs import bert_1p5b
    from bert_ref.data import build_data
    from bert_ref.step import step_fn
    from ds_core.engine import init_distributed, set_seed, shutdown_distributed

    preset = dataclasses.replace(bert_1p5b(1), **BIG_SLICE)
    dist = init_distributed()
    set_seed(0)
    data = build_data(os.environ["BENCH_SHARDS"], dist.rank, dist.world_size, 2)
    engine = _engine(preset, _ds_config(2, 1, stage), "lans")
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


def memory_part(tmp: Path) -> dict:
    shards = _shards(tmp, 16, 128, 20, 30522)
    res: dict = {}
    for stage in (0, 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", BENCH_SHARDS=str(shards),
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
               str(Path(__file__).resolve()), "--memory_worker", str(stage), "--out", str(tmp)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode:
            sys.stdout.write(proc.stdout[-6000:])
            raise SystemExit(f"memory launch with ZeRO-{stage} failed (exit {proc.returncode})")
        ranks = [json.loads((tmp / f"mem_zero{stage}_rank{r}.json").read_text()) for r in (0, 1)]
        res[stage] = {k: max(r[k] for r in ranks) for k in ("optimizer_state_bytes", "master_bytes", "moment_bytes",
                                                           "peak_rss_bytes")}
        res[stage]["params"] = ranks[0]["params"]
        gib = 2**30
        print(f"[memory] {BIG_SLICE['name']} ({ranks[0]['params'] / 1e6:.0f}M params), 2 ranks, ZeRO-{stage}: "
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
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, GLIBC_TUNABLES=MALLOC_TUNABLES))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--micro_batch", type=int, default=16)
    ap.add_argument("--grad_accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="measured optimizer steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2, help="optimizer steps excluded from the measurement")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the MFU part (0: torch's default); the peak probe uses the same count")
    ap.add_argument("--dense_mlm", action="store_true",
                    help="MLM decoder at all seq_len positions (transformers' default) instead of the sparse head")
    ap.add_argument("--torch_dropout", action="store_true",
                    help="torch's nn.Dropout for the hidden dropouts instead of bert_ref.model.FastDropout")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (DeepSpeed engine.compile)")
    ap.add_argument("--no_malloc_tuning", action="store_true", help="keep glibc's default malloc thresholds")
    ap.add_argument("--skip_memory", action="store_true")
    ap.add_argument("--skip_mfu", action="store_true")
    ap.add_argument("--skip_bound", action="store_true", help="skip the MFU upper bound (linear layers + optimizer)")
    ap.add_argument("--memory_worker", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.memory_worker >= 0:
        memory_worker(a.memory_worker, Path(a.out))
        return
    result: dict = {"bench": "bert_step"}
    with tempfile.TemporaryDirectory(prefix="bert_step_") as d:
        tmp = Path(d)
        if not a.skip_memory:  # first: before this process holds a 4-layer model and a process group
            result.update(memory_part(tmp))
        if not a.skip_mfu:
            result.update(mfu_part(a, tmp))
            if not a.skip_bound:
                result.update(bound_part(a, result["peak_bf16_matmul_tflops"]))
    result.update(targets={"mfu": 0.5, "zero1_over_zero0_optimizer_memory": 0.55})
    if "mfu" in result:
        result["mfu_target_met"] = bool(result["mfu"] and result["mfu"] >= 0.5)
    if "zero1_over_zero0_optimizer_memory" in result:
        result["memory_target_met"] = result["zero1_over_zero0_optimizer_memory"] <= 0.55
    print(json.dumps(result))


if __name__ == "__main__":
    main()
