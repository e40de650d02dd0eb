"""Gradient collectives per optimizer step, `allreduce = buckets` vs `single`, on a model big enough for several
reduce buckets: a 110M-parameter BertForPreTraining (BERT-base shape, bench/zero_memory.py's model), random init,
ZeRO-1, on N local ranks. Counted by DeepSpeed's own communication logger (`comms_logger` in the DeepSpeed JSON,
deepspeed.comm.comms_logger), not by hand.

    python studies/allreduce_comms.py [--ranks 2] [--steps 3] [--bucket 50000000] [--dtype fp32]

`buckets` is bert_debug_zero1_bf16.json's zero_optimization (reduce_bucket_size 5e7, DeepSpeed's defaults otherwise);
`single` adds ds_tools.study.spec.SINGLE_ZERO, exactly what the study axis applies. fp32 by default: on a CPU without
bf16 matmul units a bf16 step of this model takes minutes, and the precision changes neither the number of
collectives nor (ZeRO-1 reduces its fp32 gradient accumulators) their bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BERT_BASE = {"model_type": "bert", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "vocab_size": 30522, "max_position_embeddings": 512}


def ds_config(mode: str, bucket: int, dtype: str) -> dict:
    from ds_core.config import read_ds_json
    from ds_tools.study.spec import DEFAULT_SINGLE_BUCKET, SINGLE_ZERO

    cfg = read_ds_json("bert_debug_zero1_bf16.json")
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    cfg["bf16"] = {"enabled": dtype == "bf16"}
    cfg["zero_optimization"] = {"stage": 1, "reduce_bucket_size": bucket}
    if mode == "single":
        cfg["zero_optimization"].update(SINGLE_ZERO, reduce_bucket_size=DEFAULT_SINGLE_BUCKET)
    cfg["comms_logger"] = {"enabled": True, "prof_all": True}
    return cfg


def rank_main(mode: str, steps: int, bucket: int, dtype: str, out: str) -> None:
    import deepspeed
    import torch
    from deepspeed.comm import comm
    from transformers import BertConfig, BertForPreTraining

    from ds_tools.study.cell import comms_records

    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(**BERT_BASE))
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5),
                                      config=ds_config(mode, bucket, dtype))
    before = json.loads(json.dumps(comms_records()))  # init broadcasts etc. are not gradient traffic
    ids = torch.randint(0, BERT_BASE["vocab_size"], (1, 64))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids, next_sentence_label=torch.zeros(1, dtype=torch.long)).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    after = comms_records()
    grad_n = grad_b = 0
    for op in ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter"):
        for size, n in after.get(op, {}).get("sizes", {}).items():
            n -= before.get(op, {}).get("sizes", {}).get(size, 0)
            if int(size) > 64:  # scalar reductions (norm, overflow flag) are 1-8 bytes
                grad_n, grad_b = grad_n + n, grad_b + n * int(size)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps({"mode": mode, "params": params, "dtype": dtype, "reduce_bucket_size":
                                         engine.zero_reduce_bucket_size(), "grad_collectives_per_step": grad_n / steps,
                                         "grad_bytes_per_step": grad_b / steps,
                                         "step_s_after_first": sum(times[1:]) / max(1, len(times) - 1),
                                         "ranks": comm.get_world_size()}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket", type=int, default=50_000_000, help="reduce_bucket_size of `buckets`")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--rank_mode", help=argparse.SUPPRESS)  # internal: this process is a rank
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rank_mode:
        rank_main(a.rank_mode, a.steps, a.bucket, a.dtype, a.out)
        return
    import tempfile

    from ds_core.rank.rendezvous import free_port, rank_env
    from launch import local_ranks

    env = rank_env(pythonpath=[REPO], threads=1)
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("buckets", "single"):
            out = Path(tmp) / f"{mode}.json"
            cmd = local_ranks.local_command(a.ranks, [str(Path(__file__).resolve()), "--rank_mode", mode, "--steps",
                                                      str(a.steps), "--bucket", str(a.bucket), "--dtype", a.dtype,
                                                      "--out", str(out)], master_port=free_port())
            res = local_ranks.run_launchers([cmd], env=env, cwd=REPO, timeout_s=1800, log_path=Path(tmp) / "log")
            if not res.ok:
                sys.exit(f"{mode}: exit {res.exit_code}\n" + (Path(tmp) / "log").read_text()[-4000:])
            print(out.read_text(), flush=True)


if __name__ == "__main__":
    main()
