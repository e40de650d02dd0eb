"""Start the debug BridgeTower on the real DeepSpeed engine through ds_core.rank.engine_build.build_engine and take 2
optimizer steps; each rank writes what happened to OUT_DIR/rank<R>.json.

Driven by tests/test_ops_check.py and tests/test_bt_logit_scale_ds.py:
    python -m launch.local_ranks -n 2 tests/bt_engine_start.py --ds_json J --out_dir D [--logit_scale 0d|1d]
    python -m launch.local_ranks -n 2 tests/bt_engine_start.py --out_dir D --run NAME:0d|1d:J [--run ...]
The second form starts one engine per --run, one after the other in the same processes (one launch for all), and
writes D/NAME/rank<R>.json for each.
--logit_scale 0d keeps transformers' 0-dim `logit_scale` (the control: DeepSpeed 0.19's parameter broadcast refuses
it); 1d is what bridgetower_ds.train does (BridgeTowerContrastive.logit_scale_as_1d). A failure inside
deepspeed.initialize is recorded, not raised, so the test reads DeepSpeed's own message."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ds_core.rank.process_end import run_main


def _batch(tok, n: int = 4, size: int = 32) -> dict:
    g = torch.Generator().manual_seed(0)
    caps = ["a red circle on a blue background", "two dogs playing in the snow", "a man riding a horse",
            "a pizza on a white plate"][:n]
    enc = tok(caps, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "pixel_values": torch.randn(n, 3, size, size, generator=g), "pixel_mask": torch.ones(n, size, size)}


def start(ds_json: str, logit_scale: str) -> dict:
    from bridgetower_ds.configs import ModelArgs
    from bridgetower_ds.model import build_model
    from bridgetower_ds.tokenizer import debug_tokenizer
    from ds_core.rank.dist import init_distributed, set_seed
    from ds_core.rank.engine_build import build_engine

    dist = init_distributed()
    set_seed(1)
    model = build_model(ModelArgs(preset="debug"))
    if logit_scale == "1d":
        model.logit_scale_as_1d()
    out: dict = {"rank": dist.rank, "world": dist.world_size, "logit_scale_shape": list(model.logit_scale.shape)}
    try:
        engine = build_engine(model, json.loads(Path(ds_json).read_text()))
    except Exception as err:  # noqa: BLE001 - the control records DeepSpeed's refusal
        return {**out, "error": f"{type(err).__name__}: {err}"}
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # DeepSpeed's bf16 / ZeRO wrappers hold the basic optimizer
    out.update(optimizer=f"{type(inner).__module__}.{type(inner).__name__}", bf16=engine.bfloat16_enabled(),
               param_dtype=str(next(engine.module.parameters()).dtype).replace("torch.", ""),
               flat_layout=getattr(engine, "flat_layout", None),
               # views into DeepSpeed's flat buffers whose size allows 16-byte alignment but that do not have it
               # (cuBLAS's slow align1 GEMM kernels on a GPU)
               misaligned=[n for n, p in engine.module.named_parameters()
                           if p.numel() % 8 == 0 and p.data_ptr() % 16])
    batch = {k: v.to(dist.device) for k, v in _batch(debug_tokenizer()).items()}
    losses = []
    for _ in range(2):
        loss = engine(**batch, return_loss=True).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    sd = engine.module.state_dict()
    return {**out, "losses": losses, "saved_logit_scale_shape": list(sd["logit_scale"].shape),
            "logit_scale_after": float(engine.module.logit_scale.float().reshape(()))}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--ds_json")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--logit_scale", choices=("0d", "1d"), default="1d")
    p.add_argument("--run", action="append", default=[], metavar="NAME:0d|1d:DS_JSON",
                   help="one engine start per --run, in this order; instead of --ds_json / --logit_scale")
    p.add_argument("--local_rank", type=int, default=0)  # what the DeepSpeed-style launchers pass
    args = p.parse_args()
    if bool(args.run) == bool(args.ds_json):
        p.error("give either --ds_json or one or more --run")
    runs = [(Path(args.out_dir), args.ds_json, args.logit_scale)]
    if args.run:
        runs = []
        for spec in args.run:
            name, logit_scale, ds_json = spec.split(":", 2)
            if logit_scale not in ("0d", "1d"):
                p.error(f"--run {spec}: logit_scale {logit_scale!r}, expected 0d or 1d")
            runs.append((Path(args.out_dir) / name, ds_json, logit_scale))
    for out_dir, ds_json, logit_scale in runs:
        out = start(ds_json, logit_scale)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"rank{out['rank']}.json").write_text(json.dumps(out))
    from ds_core.rank.dist import shutdown_distributed

    shutdown_distributed()


if __name__ == "__main__":
    run_main(main)
