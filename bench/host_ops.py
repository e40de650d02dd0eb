"""Host operations per training step: aten ops and `.item()` (host syncs) of one training step on one CPU rank (eager,
ZeRO-1, DeepSpeed's bf16 section as the run sets it), total and inside the optimizer step, for BERT (bert_large,
bert_1p5b: NVLAMB / LANS as the preset's recipe, seq 128, micro batch 1) and BridgeTower (bridgetower_large: random
init, ds_configs/bridgetower_zero1_bf16.json, two images of the preset's size and their captions, the contrastive
step of bridgetower_ds.step). On a GPU each op is ~2-3 us of host launch work, so these counts are the host's share of
the step; `.item()` is a wait for the device.

Two counts, not comparable with each other:
- "dispatched": top-level aten ops as a TorchDispatchMode sees them (ds_tools.op_count; an op a composite op runs
  inside it is not counted), on the third step, after the optimizer state and ZeRO's buffers exist;
- "profiler": every `aten::` event of torch.profiler (nested ops and views included) in the 4th and 5th steps, per
  step: what the difference of a 4-step and a 2-step run counts. `.item()` there is `aten::_local_scalar_dense`.

`python -m bench.host_ops [--presets bert_large,bert_1p5b,bridgetower_large] [--layers N]`: --layers N builds N and
2N layers and extrapolates linearly to the preset's depth (every layer dispatches the same ops). For BERT N is the
number of encoder layers; for BridgeTower N is the number of cross-modal layers, with text and vision towers 4N deep
(the Large preset's 24 : 24 : 6), extrapolated to 6. BERT's --settings compare DeepSpeed's default
("bf16": {"check_grad_overflow": true}) with ds_configs/*_bf16.json's (false) in a bench JSON that clips in
DeepSpeed at 1.0, and count the preset's recipe JSON as bert_ref.train runs it ("recipe": clipping inside NVLAMB /
LANS, DeepSpeed's clip 0); BridgeTower's --bt_settings count its JSON as it is ("json") and with DeepSpeed's default
bf16 gradient accumulation ("bf16_accum": DeepSpeedZeroOptimizer instead of BF16_Optimizer in bf16); --image_size
shrinks its images for emulated bf16 on a CPU."""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os

import torch

from ds_core.compat import changes
from ds_tools.op_count import OpCounter

os.environ.setdefault("DS_ACCELERATOR", "cpu")

SETTINGS = {"before": {"check_grad_overflow": True}, "after": {"check_grad_overflow": False}}
# "recipe": the preset's own DeepSpeed JSON as bert_ref.train runs it (gradient_clipping 0: NVLAMB / LANS clip on the
# device; fp32 gradient accumulation), at micro batch 1
RECIPE_JSON = {"bert_large": "bert_large_zero1_bf16.json", "bert_1p5b": "bert_1p5b_zero1_bf16.json",
               "debug": "bert_debug_zero1_bf16.json"}
BT_PRESETS = ("bridgetower_large", "bridgetower_base", "bt_debug")  # bt_debug: bridgetower_ds's `debug` preset
BT_TOWER_PER_CROSS = 4  # text and vision layers per cross-modal layer when --layers shrinks BridgeTower-Large
BT_CAPTION_TOKENS = 40  # a caption's padded length; the op count does not depend on it
# image-caption pairs per step: the contrastive loss of one pair is exactly 0 (its only logit is its own), so every
# gradient would be 0, which DeepSpeed 0.16's BF16_Optimizer refuses (it asserts a positive gradient norm)
BT_PAIRS = 2
STEP_MARK, OPT_MARK = "host_ops.step", "host_ops.optimizer"
# BridgeTower's --bt_settings: its JSON as shipped (fp32 gradient accumulation: DeepSpeed's BF16_Optimizer in bf16), and
# DeepSpeed's default bf16 accumulation (DeepSpeedZeroOptimizer: per-tensor gradient copies in the backward and step)
BT_SETTINGS = {"json": {}, "bf16_accum": {"data_types": {"grad_accum_dtype": "bf16"}}}
KEYS = ("total", "engine_step", "optimizer", "prof_total", "prof_optimizer")


def full_depth(name: str) -> int:
    """What --layers counts, in the whole preset: BERT's encoder layers, BridgeTower's cross-modal layers."""
    if name in BT_PRESETS:
        return _bt_config(name, 0).num_hidden_layers
    return _preset(name, 0).num_hidden_layers


# ---------------------------------------------------------------------------------------------------- BERT
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


def _bert(name: str, layers: int, setting: str, dtype: str):
    """(engine, step function of the engine and a batch) as bench.bert_step builds BERT."""
    from bench.bert_step import bench_ds_config, bench_engine
    from bert_ref.optim import PUBLISHED
    from bert_ref.step import step_fn

    preset = _preset(name, layers)
    if setting == "recipe":
        from ds_core.config import DS_CONFIG_DIR
        from ds_core.device.precision import apply_precision

        cfg = json.loads((DS_CONFIG_DIR / RECIPE_JSON[name]).read_text())
        cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=1)
        cfg = apply_precision(cfg, dtype, RECIPE_JSON[name])
    else:
        cfg = bench_ds_config(1, 1, 1, dtype)
        cfg["bf16"].update(SETTINGS[setting])
    return bench_engine(preset, cfg, PUBLISHED[name][1].optimizer), step_fn, _batch(preset)


# ---------------------------------------------------------------------------------------------------- BridgeTower
def _bt_config(name: str, layers: int, image_size: int = 0):
    from bridgetower_ds.configs import preset

    cfg = preset("debug" if name == "bt_debug" else name)
    if image_size:  # dispatched ops do not depend on it (profiler events by ~0.1 %); emulated bf16 time does
        cfg.vision_config.image_size = image_size
    if layers:
        tower = BT_TOWER_PER_CROSS * layers
        cfg.num_hidden_layers = layers
        cfg.text_config.num_hidden_layers = cfg.vision_config.num_hidden_layers = tower
    return cfg


def _bt_batch(cfg, device) -> dict:
    """BT_PAIRS captions and images of the preset's size, assembled as the training loader assembles a batch."""
    from bridgetower_ds.batching import BadImageLog, BatchAssembler

    g = torch.Generator().manual_seed(0)
    t, v = cfg.text_config, cfg.vision_config
    ids = torch.randint(3, t.vocab_size, (BT_PAIRS, BT_CAPTION_TOKENS), generator=g)
    ids[:, 0], ids[:, -1] = t.bos_token_id, t.eos_token_id
    pixels = torch.randn(BT_PAIRS, v.num_channels, v.image_size, v.image_size, generator=g)
    assembler = BatchAssembler(size=v.image_size, device=device, world_size=1, pad_to_max=False, min_rows=1,
                               fill_in=False, bad=BadImageLog("skip"), first_valid=dict)
    return assembler.assemble(pixels, list(range(BT_PAIRS)), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                              torch.arange(BT_PAIRS))


def bt_ds_config(dtype: str, setting: str = "json") -> dict:
    """ds_configs/bridgetower_zero1_bf16.json (what bridgetower_ds.train runs) at micro batch BT_PAIRS, in `dtype`, with
    BT_SETTINGS[setting] on top."""
    from bridgetower_ds.train import DEFAULT_DS_CONFIG
    from ds_core.config import read_ds_json, resolve_ds_path
    from ds_core.device.precision import apply_precision

    cfg = read_ds_json(str(resolve_ds_path(DEFAULT_DS_CONFIG)))
    cfg.update(train_micro_batch_size_per_gpu=BT_PAIRS, gradient_accumulation_steps=1, train_batch_size=BT_PAIRS,
               **BT_SETTINGS[setting])
    return apply_precision(cfg, dtype, DEFAULT_DS_CONFIG)


def _bt(name: str, layers: int, setting: str, dtype: str, image_size: int = 0):
    """(engine, step function, batch) as bridgetower_ds.train builds them: model, freezing, SDPA, AdamW groups."""
    from bridgetower_ds import optim as bt_optim
    from bridgetower_ds.configs import ModelArgs
    from bridgetower_ds.model import build_model
    from bridgetower_ds.step import step_fn
    from ds_core.config.optim import OptimArgs
    from ds_core.rank.engine_build import build_engine

    cfg = _bt_config(name, layers, image_size)
    model = build_model(ModelArgs(), config=cfg)
    model.logit_scale_as_1d()
    ds_config = bt_ds_config(dtype, setting)
    optim, _ = bt_optim.decide(OptimArgs(), ds_config, "bench DeepSpeed config")
    engine = build_engine(model, ds_config, **bt_optim.engine_kwargs(model, optim, ds_config, 10**6))
    return engine, step_fn, _bt_batch(cfg, engine.device)


# ---------------------------------------------------------------------------------------------------- counting
def count(name: str, layers: int, setting: str, dtype: str = "bf16", image_size: int = 0) -> dict:
    """Both counts (the module's docstring) of one preset: total, DeepSpeed's engine.step (ZeRO + the optimizer) and
    the optimizer's own step; steps 1-2 warm up, 3 is dispatch-counted, 4-5 profiled."""
    from ds_core.rank.dist import init_distributed, set_seed

    init_distributed()  # a world of one on a free port
    set_seed(0)
    if name in BT_PRESETS:
        engine, step_fn, batch = _bt(name, layers, setting, dtype, image_size)
    else:
        engine, step_fn, batch = _bert(name, layers, setting, dtype)
    opt = engine.optimizer.optimizer
    inner = type(opt).step
    for _ in range(2):
        _train_step(engine, step_fn, batch)
    counters = {k: OpCounter(where=True) for k in ("total", "engine_step", "optimizer")}
    opt.step = lambda *a, **k: _in(counters["optimizer"], inner, opt, *a, **k)
    with counters["total"]:
        _train_step(engine, step_fn, batch, counters["engine_step"])
    r = {k: {"ops": c.total, "syncs": c.syncs} for k, c in counters.items()}
    r["sync_sites"] = dict(counters["total"].sync_sites)
    r["top_ops"] = dict(counters["total"].ops.most_common(12))
    r["zero_optimizer"] = type(engine.optimizer).__name__  # DeepSpeed's wrapper: BF16_Optimizer, DeepSpeedZeroOptimizer
    opt.step = lambda *a, **k: _in(torch.profiler.record_function(OPT_MARK), inner, opt, *a, **k)
    r.update(profiled(lambda: _train_step(engine, step_fn, batch), steps=2, warmup=0))
    del opt.step
    return r


def _train_step(engine, step_fn, batch, step_region=None) -> None:
    out = step_fn(engine, batch)
    engine.backward(out.loss)
    with step_region or _Nothing():
        engine.step()


def profiled(step, steps: int, warmup: int = 2) -> dict:
    """torch.profiler over `steps` calls of `step` after `warmup` unprofiled ones: `aten::` events per step inside
    the steps and inside OPT_MARK regions."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(STEP_MARK):
                step()
    return {k: {m: n / steps for m, n in v.items()} for k, v in aten_events(prof.events()).items()}


def aten_events(events) -> dict:
    """{"prof_total" | "prof_optimizer": {"ops": aten:: events, "syncs": aten::_local_scalar_dense events}} among
    the events inside a STEP_MARK range (and inside an OPT_MARK range); prof_sync_via: for the syncs, the outermost
    aten op they ran in (aten::item for a `.item()` of ours or a library's; a composite op that syncs inside)."""
    out = {k: {"ops": 0, "syncs": 0} for k in ("prof_total", "prof_optimizer")}
    via: collections.Counter = collections.Counter()  # the outermost aten op each .item() runs inside
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        chain, p = [], e.cpu_parent
        while p is not None:
            chain.append(p.name)
            p = p.cpu_parent
        for key, mark in (("prof_total", STEP_MARK), ("prof_optimizer", OPT_MARK)):
            if mark in chain:
                out[key]["ops"] += 1
                out[key]["syncs"] += e.name == "aten::_local_scalar_dense"
        if e.name == "aten::_local_scalar_dense" and STEP_MARK in chain:
            via[next((n for n in reversed(chain) if n.startswith("aten::")), e.name)] += 1
    out["prof_sync_via"] = dict(via)
    return out


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _in(region, fn, *a, **k):
    with region:
        return fn(*a, **k)


def extrapolated(name: str, layers: int, setting: str, dtype: str, image_size: int = 0) -> dict:
    """count() of the whole preset from N and 2N layers: lo + (hi - lo) * (full - N) / N for every count."""
    lo, hi = count(name, layers, setting, dtype, image_size), count(name, 2 * layers, setting, dtype, image_size)
    full = full_depth(name)
    r = {k: {m: lo[k][m] + (hi[k][m] - lo[k][m]) * (full - layers) / layers for m in ("ops", "syncs")} for k in KEYS}
    r["sync_sites"], r["prof_sync_via"] = hi["sync_sites"], hi["prof_sync_via"]
    r["measured_layers"], r["extrapolated_to"] = [layers, 2 * layers], full
    return r


def line(label: str, r: dict) -> str:
    t, o, p, po = r["total"], r["optimizer"], r["prof_total"], r["prof_optimizer"]
    return (f"{label:28s} profiler aten:: {p['ops']:8.0f} ops {p['syncs']:3.0f} .item() (optimizer {po['ops']:5.0f} "
            f"ops {po['syncs']:.0f} .item()) | dispatched {t['ops']:7.0f} ops {t['syncs']:3.0f} .item() (engine.step "
            f"{r['engine_step']['ops']:6.0f}, optimizer {o['ops']:5.0f} ops {o['syncs']:.0f} .item())")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--presets", default="bert_large,bert_1p5b,bridgetower_large")
    ap.add_argument("--layers", type=int, default=0, help="0: the whole model; N: extrapolate from N and 2N layers")
    ap.add_argument("--settings", default="before,after,recipe",
                    help="BERT's DeepSpeed configs to count: before / after (a bench JSON with DeepSpeed's clip at 1.0 "
                         "and its bf16 overflow check on / off), recipe (the preset's ds_configs JSON)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                    help="the DeepSpeed JSON's precision; auto: the run's rule on this CPU (ds_core.device.precision: "
                         "fp32 without native bf16, where bf16 matmuls are emulated ~100x slower; the counts differ "
                         "by a few ops and one .item() per step, docs/benchmarks.md)")
    ap.add_argument("--bt_settings", default="json",
                    help="BridgeTower's DeepSpeed configs to count: json (its JSON: fp32 gradient accumulation, "
                         "DeepSpeed's BF16_Optimizer in bf16), bf16_accum (DeepSpeed's default bf16 accumulation: "
                         "DeepSpeedZeroOptimizer)")
    ap.add_argument("--image_size", type=int, default=0,
                    help="BridgeTower's image size (0: the preset's); the dispatched counts do not depend on it (the "
                         "profiler's by ~0.1 %%), the time of emulated bf16 on a CPU does")
    ap.add_argument("--json", default="")
    changes.add_argument(ap)
    a = ap.parse_args()
    changes.configure(a.ds_changes)  # before any rank starts: its processes inherit the switch
    if a.dtype == "auto":
        from ds_core.device.precision import resolve_precision

        a.dtype, reason = resolve_precision("auto", "cpu")
        print(f"[host_ops] {a.dtype}: {reason}", flush=True)
    res = {}
    for name in a.presets.split(","):
        for setting in (a.bt_settings if name in BT_PRESETS else a.settings).split(","):
            size = a.image_size if name in BT_PRESETS else 0
            r = (extrapolated(name, a.layers, setting, a.dtype, size) if a.layers
                 else count(name, 0, setting, a.dtype, size))
            res[f"{name}/{setting}"] = r
            how = f" ({r['measured_layers']}->{r['extrapolated_to']} layers)" if a.layers else ""
            print(line(f"{name} {setting} {a.dtype}", r) + how, flush=True)
            print("  .item() sites (dispatched):", json.dumps(r["sync_sites"]), flush=True)
            print("  .item() inside (profiler, per step):", json.dumps(r["prof_sync_via"]), flush=True)
    if a.layers:
        print(f"--layers {a.layers}: counts measured at N and 2N layers and extrapolated linearly to the preset's "
              "depth (per-layer-linear: every layer dispatches the same ops)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
