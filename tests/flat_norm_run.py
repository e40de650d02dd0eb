"""DeepSpeed's global gradient norm, its per-tensor method against ds_core.compat.flat_norm's flat one, on the same
gradients of the debug BERT (bf16 weights, fp32 gradient accumulation as the recipe's JSONs); driven by
tests/test_flat_norm.py:

    python -m launch.local_ranks -n 2 tests/flat_norm_run.py OUT_DIR STAGE [STAGE ...]

One engine per STAGE, built one after the other in the same processes (one launch for all). STAGE 1: DeepSpeed's
BF16_Optimizer (what ZeRO-1 with these data types runs); 2: DeepSpeedZeroOptimizer with its flat
fp32 gradient partition; 1-bf16acc: ZeRO-1 with bf16 gradient accumulation (BridgeTower's JSON), DeepSpeedZeroOptimizer
with per-tensor gradient views. Each rank
trains one step on its own batch, then, at the boundary (after backward, before engine.step), evaluates both methods
on the same gradients and counts their aten ops; writes OUT_DIR/STAGE/rank<R>.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ds_core.rank.process_end import run_main


def main() -> None:
    from ds_core.rank.dist import init_distributed, shutdown_distributed

    out_dir, *modes = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    dist = init_distributed()
    for mode in modes:
        out = measure(dist, mode)
        (Path(out_dir) / mode).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / mode / f"rank{dist.rank}.json").write_text(json.dumps(out))
    shutdown_distributed()


def measure(dist, mode: str) -> dict:
    """One engine of `mode` (the module's STAGE), one step: both norms on the same gradients, and their op counts."""
    stage, fp32_acc = int(mode[0]), not mode.endswith("bf16acc")
    from bert_ref.configs import debug
    from bert_ref.layerwise import attach_zero_layout
    from bert_ref.model import build_model
    from bert_ref.optim import bert_defaults, build_optimizer
    from bert_ref.step import step_fn
    from ds_core.config import DS_CONFIG_DIR
    from ds_core.config.optim import OptimArgs
    from ds_core.rank.dist import set_seed
    from ds_core.rank.engine_build import build_engine
    from ds_tools.op_count import OpCounter

    set_seed(0)
    preset = debug(1)
    cfg = json.loads((DS_CONFIG_DIR / "bert_debug_zero1_bf16.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, train_batch_size=2 * dist.world_size,
               data_types={"grad_accum_dtype": "fp32" if fp32_acc else "bf16"})
    cfg["zero_optimization"]["stage"] = stage
    model = build_model(preset)
    opt = build_optimizer(model, bert_defaults(OptimArgs(optimizer="lamb", learning_rate=1e-3)))
    engine = build_engine(model, cfg, optimizer=opt)
    attach_zero_layout(engine, opt)  # as bert_ref.train: NVLAMB's per-tensor trust ratios under ZeRO
    g = torch.Generator().manual_seed(100 + dist.rank)  # another batch per rank: the all-reduce matters
    ids = torch.randint(5, preset.vocab_size, (2, 32), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, 1:6] = ids[:, 1:6]
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
             "labels": labels, "next_sentence_label": torch.zeros(2, dtype=torch.long)}
    batch = {k: v.to(engine.device) for k, v in batch.items()}
    zo = engine.optimizer
    hook = compare_grad_hooks(engine, zo, lambda: engine.backward(step_fn(engine, batch).loss), OpCounter)
    from deepspeed.runtime.utils import get_global_norm_of_tensors

    stage = stage if fp32_acc else 2  # bf16 accumulation: DeepSpeedZeroOptimizer at ZeRO-1 too
    # the exact value, float64 over every parameter's gradient view (DeepSpeed's own lists of them)
    views = (type(zo).get_grads_for_norm(zo)[0] if stage == 1 else
             [g for grads in zo.averaged_gradients.values() for g in grads])
    truth = float(torch.stack([v.double().pow(2).sum() for v in views]).sum().sqrt()) if stage == 1 else None
    if stage == 1:  # the whole norm, as BF16_Optimizer.step computes it
        ours_fn = lambda: get_global_norm_of_tensors(zo.get_grads_for_norm()[0])  # noqa: E731
        ref_fn = lambda: get_global_norm_of_tensors(type(zo).get_grads_for_norm(zo)[0])  # noqa: E731
        parts = [(len(g), ours_fn, ref_fn) for g in [[p for g in zo.bf16_groups for p in g]]]
    else:  # per parameter group, as DeepSpeedZeroOptimizer.scaled_global_norm calls it
        parts = [(len(params), (lambda g=zo.averaged_gradients[i], p=params: zo.get_grad_norm_direct(g, p)),
                  (lambda g=zo.averaged_gradients[i], p=params: type(zo).get_grad_norm_direct(zo, g, p)))
                 for i, params in enumerate(zo.params_in_partition)]
    groups = []
    for tensors, ours_fn, ref_fn in parts:
        ours_count, ref_count = OpCounter(), OpCounter()
        with ours_count:
            ours = ours_fn()
        with ref_count:
            ref = ref_fn()
        groups.append({"tensors": tensors, "ours": float(ours), "deepspeed": float(ref), "ours_ops": ours_count.total,
                       "deepspeed_ops": ref_count.total, "float64": truth})
    engine.step()
    method = "get_grads_for_norm" if stage == 1 else "get_grad_norm_direct"
    from deepspeed.runtime import bf16_optimizer

    from ds_core.compat.changes import applied, states

    clip_on = applied(bf16_optimizer.clip_tensors_by_global_norm) == "device_clip"
    return {"rank": dist.rank, "world": dist.world_size, "optimizer": type(zo).__name__, "groups": groups,
            "installed": method in vars(zo), "grad_hook": hook,  # installed: the instance's own method
            "changes": states(), "device_clip": clip_on}


def compare_grad_hooks(engine, zo, backward, counter) -> dict | None:
    """BF16_Optimizer only: the same backward with ds_core.compat.grad_hook's gradient hook (installed by build_engine)
    and then with DeepSpeed's own (the class's method), each from zeroed fp32 gradient buffers and without a step in
    between (the same weights): whether the buffers are bitwise equal, and the aten ops the hook dispatched, over all
    its calls. Otherwise one backward. Leaves DeepSpeed's result in the buffers (the norm checks read it) and the
    instance's hook installed again."""
    ours = vars(zo).get("_update_hp_grad")
    if type(zo).__name__ != "BF16_Optimizer" or ours is None:
        backward()
        return None if type(zo).__name__ != "BF16_Optimizer" else {"installed": False}
    runs = {}
    for name, fn in (("ours", ours), ("deepspeed", type(zo)._update_hp_grad.__get__(zo))):
        count = counter()

        def counted(*a, fn=fn, count=count, **k):
            with count:
                return fn(*a, **k)

        zo._update_hp_grad = counted
        for f in zo.fp32_groups_gradients_flat:
            f.zero_()
        backward()
        runs[name] = ([f.clone() for f in zo.fp32_groups_gradients_flat], count.total)
    zo._update_hp_grad = ours
    tensors = sum(sum(has) for has in zo.fp32_groups_has_gradients)
    return {"installed": ours is not None, "tensors": tensors, "ours_ops": runs["ours"][1],
            "deepspeed_ops": runs["deepspeed"][1],
            "bitwise": all(torch.equal(a, b) for a, b in zip(runs["ours"][0], runs["deepspeed"][0])),
            "nonzero": all(bool(f.abs().sum() > 0) for f in runs["ours"][0])}


if __name__ == "__main__":
    run_main(main)
