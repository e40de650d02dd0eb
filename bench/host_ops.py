"""Host operations per training step: aten ops and `.item()` (host syncs) of one BERT step on one CPU rank (eager,
micro batch 1, ZeRO-1, bf16, NVLAMB / LANS as the preset's recipe), total and inside the optimizer step, for the
DeepSpeed settings before ("bf16": {"check_grad_overflow": true}, DeepSpeed's default) and after (false, as
ds_configs/*_bf16.json set it). Counted by a TorchDispatchMode (ds_tools.op_count: top-level dispatches) on the third
step, after the state and the layout's index tensors exist. On a GPU each op is ~2-3 us of host launch work, so
these counts are the host's share of the step; `.item()` is a wait for the device.

`python -m bench.host_ops [--presets bert_large,bert_1p5b] [--layers N]`: --layers N builds the first N encoder
layers only and extrapolates linearly from N and 2N layers (ops per layer are the same in every layer)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from ds_tools.op_count import OpCounter

os.environ.setdefault("DS_ACCELERATOR", "cpu")

SETTINGS = {"before": {"check_grad_overflow": True}, "after": {"check_grad_overflow": False}}


def _preset(name: str, layers: int):
    from bert_ref import configs

    p = getattr(configs, name)(1)
    p = dataclasses.replace(p, seq_len=128)
    return dataclasses.replace(p, num_hidden_layers=layers) if layers else p


def _batch(preset, seq: int = 128) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, preset.vocab_size, (1, seq), generator=g)
    labels = torch.full((1, seq), -100)
    labels[0, 1:1 + preset.max_predictions_per_seq] = ids[0, 1:1 + preset.max_predictions_per_seq]
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
            "labels": labels, "next_sentence_label": torch.zeros(1, dtype=torch.long)}


def count(name: str, layers: int, setting: str) -> dict:
    """ops / syncs of the third step: total, DeepSpeed's engine.step (ZeRO + our optimizer), our optimizer alone."""
    from bench.bert_step import bench_ds_config, bench_engine
    from bert_ref.optim import PUBLISHED
    from bert_ref.step import step_fn
    from ds_core.rank.engine import set_seed

    set_seed(0)
    preset = _preset(name, layers)
    cfg = bench_ds_config(1, 1, 1, "bf16")
    cfg["bf16"].update(SETTINGS[setting])
    engine = bench_engine(preset, cfg, PUBLISHED[name][1].optimizer)
    batch = _batch(preset)
    for i in range(3):
        counters = {k: OpCounter(where=True) for k in ("total", "engine_step", "optimizer")}
        opt = engine.optimizer.optimizer
        inner = type(opt).step
        opt.step = lambda *a, **k: _counted(counters["optimizer"], inner, opt, *a, **k)  # noqa: B023
        with counters["total"]:
            out = step_fn(engine, batch)
            engine.backward(out.loss)
            with counters["engine_step"]:
                engine.step()
        del opt.step
    r = {k: {"ops": c.total, "syncs": c.syncs} for k, c in counters.items()}
    r["sync_sites"] = dict(counters["total"].sync_sites)
    r["top_ops"] = dict(counters["total"].ops.most_common(12))
    return r


def _counted(counter, fn, *a, **k):
    with counter:
        return fn(*a, **k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--presets", default="bert_large,bert_1p5b")
    ap.add_argument("--layers", type=int, default=0, help="0: the whole model; N: extrapolate from N and 2N layers")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    res = {}
    for name in a.presets.split(","):
        for setting in SETTINGS:
            if a.layers:
                lo, hi = count(name, a.layers, setting), count(name, 2 * a.layers, setting)
                full = _preset(name, 0).num_hidden_layers
                r = {k: {m: lo[k][m] + (hi[k][m] - lo[k][m]) * (full - a.layers) // a.layers for m in ("ops", "syncs")}
                     for k in ("total", "engine_step", "optimizer")}
                r["sync_sites"], r["measured_layers"] = hi["sync_sites"], [a.layers, 2 * a.layers]
            else:
                r = count(name, 0, setting)
            res[f"{name}/{setting}"] = r
            print(f"{name:12s} {setting:6s} total {r['total']['ops']:7d} ops {r['total']['syncs']:2d} .item() | "
                  f"engine.step {r['engine_step']['ops']:6d} ops {r['engine_step']['syncs']:2d} .item() | "
                  f"optimizer {r['optimizer']['ops']:5d} ops {r['optimizer']['syncs']} .item()", flush=True)
        b, f = res[f"{name}/before"]["total"], res[f"{name}/after"]["total"]
        print(f"{name:12s} after/before: ops {f['ops'] / b['ops']:.3f}, .item() {f['syncs']} vs {b['syncs']}")
        print("  .item() sites (after):", json.dumps(res[f"{name}/after"]["sync_sites"]))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
