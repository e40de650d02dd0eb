"""A few optimizer steps of the debug Pre-LN BERT through the real DeepSpeed engine; rank 0 saves the full weights.

Driven by tests/test_bert_optim_zero.py: the same 8 samples per step either as 2 ranks x 4 (ZeRO-1/2/3, the optimizer
sees flat partitions) or 1 rank x 4 x 2 accumulated micro batches (ZeRO-0, the optimizer sees the model's tensors):
the same averaged gradient, so per-tensor LAMB / LANS must give the same weights.
    deepspeed --num_gpus 2 tests/zero_trust_step.py --out_dir D --runs z1_lamb:1:lamb,z3_lans:3:lans,...
per_partition: give the optimizer one segment per flat partition (the old per-partition trust ratios), so the test
can show its comparison tells the two apart."""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch

from ds_core.rank.process_end import run_main

STEPS = 3


def _fragment_mismatches(ds_opt, layouts: dict) -> int:
    """Parameters whose slice in this rank's flat partition, by bert_ref.layerwise's layout, differs from the one
    DeepSpeed itself links to the parameter (lp_param._hp_mapping.hp_fragment_address, the map universal
    checkpointing reads): an independent check of the layout, exact, free of numerics (ZeRO-1/2 and bf16 ZeRO-1)."""
    groups = getattr(ds_opt, "bf16_groups", None) or ds_opt.round_robin_bit16_groups
    flats = getattr(ds_opt, "fp32_groups_flat_partition", None) or ds_opt.single_partition_of_fp32_groups
    bad = 0
    for params, flat in zip(groups, flats):
        mine = {id(params[k]): (s, ln) for k, s, ln in layouts[id(flat)].segments if k >= 0}
        theirs = {id(p): (p._hp_mapping.hp_fragment_address.start, p._hp_mapping.hp_fragment_address.numel)
                  for p in params if getattr(p, "_hp_mapping", None) is not None}
        bad += len(set(mine.items()) ^ set(theirs.items())) + (not theirs)
    return bad


def run(name: str, stage: int, optimizer: str, bf16: bool, per_partition: bool, out_dir: str, dist,
        noclip: bool = False, fp32_accum: bool = False, clip05: bool = False) -> None:
    """STEPS steps of one configuration; rank 0 writes out_dir/name.pt (full fp32 weights) and name.json (layout).
    noclip: DeepSpeed gradient_clipping 0 (the optimizer clips, across ranks); clip05: gradient_clipping 0.5, which
    attach_zero_layout must refuse for max_grad_norm 1.0 (name.json: the error)."""
    import json

    import deepspeed

    from bert_ref.configs import debug_pre_ln
    from bert_ref.data import make_batch
    from bert_ref.layerwise import FlatLayout, attach_zero_layout, zero_layouts
    from bert_ref.model import build_model
    from bert_ref.optim import build_optimizer
    from bert_ref.prep.h5io import synthetic_arrays
    from bert_ref.step import step_fn
    from ds_core.config.optim import OptimArgs
    from ds_core.rank.engine_build import build_engine

    accum = 2 // dist.world_size
    ds_config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum,
                 "train_batch_size": 8, "gradient_clipping": 0.0 if noclip else 0.5 if clip05 else 1.0,
                 "zero_optimization": {"stage": stage},
                 "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    if bf16:
        ds_config["bf16"] = {"enabled": True}
    if fp32_accum:  # bf16 ZeRO-1 then runs DeepSpeed's BF16_Optimizer (tensors back to back, one step() call)
        ds_config["data_types"] = {"grad_accum_dtype": "fp32"}
    preset = dataclasses.replace(debug_pre_ln(1), seq_len=32, max_predictions_per_seq=5)
    torch.manual_seed(0)
    model = build_model(preset)
    opt = build_optimizer(model, OptimArgs(optimizer=optimizer, learning_rate=0.01))
    engine = build_engine(model, ds_config, optimizer=opt)
    if clip05:
        from ds_core.errors import ConfigError

        try:
            attach_zero_layout(engine, opt)
            msg = ""
        except ConfigError as e:
            msg = str(e)
        if dist.rank == 0:
            with open(f"{out_dir}/{name}.json", "w") as f:
                json.dump({"error": msg}, f)
        return
    attach_zero_layout(engine, opt)
    layouts, group = zero_layouts(engine.optimizer)
    if per_partition:  # one segment per flat partition: the per-partition trust ratios this module replaced
        opt.attach({k: FlatLayout([(0, 0, sum(s[2] for s in v.segments))], 1) for k, v in layouts.items()}, group,
                   False)
    norms = []  # DeepSpeed's global gradient norm of each step (it computes it with or without its own clip)
    for step in range(STEPS):
        arr = synthetic_arrays(8, preset.seq_len, preset.max_predictions_per_seq, vocab_size=preset.vocab_size,
                               seed=100 + step)
        for micro in range(accum):
            half = dist.rank if dist.world_size == 2 else micro
            out = step_fn(engine, make_batch(arr, np.arange(4 * half, 4 * half + 4)))
            engine.backward(out.loss)
            engine.step()
        norm = engine.get_global_grad_norm()  # None under fp32 ZeRO-0 (DeepSpeed keeps none there)
        norms.append(None if norm is None else float(norm))
    mismatches = _fragment_mismatches(engine.optimizer, layouts) if stage in (1, 2) else -1
    if mismatches >= 0:
        t = torch.tensor([mismatches], dtype=torch.int64)
        torch.distributed.all_reduce(t)
        mismatches = int(t)
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=stage == 3):
        if dist.rank == 0:
            torch.save({n: p.detach().float().clone() for n, p in params}, f"{out_dir}/{name}.pt")
            info = {"wrapper": type(engine.optimizer).__name__, "partitioned": group is not None,
                    "layout_mismatches": mismatches, "grad_norms": norms,
                    "flats": len(layouts),
                    "tensor_segments": sum(1 for lay in layouts.values() for k, s, ln in lay.segments if k >= 0)}
            with open(f"{out_dir}/{name}.json", "w") as f:
                json.dump(info, f)
    engine.destroy() if hasattr(engine, "destroy") else None


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--runs", required=True, help="comma list of name:stage:optimizer[:bf16][:per_partition]")
    ap.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher adds it
    a = ap.parse_args()

    from ds_core.rank.dist import init_distributed, shutdown_distributed

    dist = init_distributed(600)
    for spec in a.runs.split(","):
        name, stage, optimizer, *flags = spec.split(":")
        run(name, int(stage), optimizer, "bf16" in flags, "per_partition" in flags, a.out_dir, dist,
            noclip="noclip" in flags, fp32_accum="fp32_accum" in flags, clip05="clip05" in flags)
    shutdown_distributed()


if __name__ == "__main__":
    run_main(main)  # ends without interpreter finalisation: see ds_core.rank.process_end
