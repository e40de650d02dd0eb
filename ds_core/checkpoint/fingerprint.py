"""What a checkpoint records of the run that wrote it, compared on resume: the model and optimizer
fingerprint, the parameter order, the batch layout, the module's transformers class."""
from __future__ import annotations

HF_MODEL = "hf_model.json"


def base_optimizer(engine):
    """The torch optimizer a run built, under DeepSpeed's ZeRO / bf16 wrapper where there is one."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)  # the torch optimizer inside DeepSpeed's ZeRO / bf16 wrapper


def model_fingerprint(engine, zero_stage: int) -> dict:
    """What must match for a checkpoint to load: parameter names and full shapes, ZeRO stage, optimizer class and
    DeepSpeed's wrapper around it, the flat-buffer order. dp_world_size is recorded but may differ (a resize:
    ds_core.checkpoint.resize)."""
    shapes = {}
    for name, p in engine.module.named_parameters():
        shape = getattr(p, "ds_shape", None) or p.shape  # ZeRO-3 keeps the full shape in ds_shape
        shapes[name] = list(shape)
    return {"param_shapes": shapes, "zero_stage": zero_stage, "dp_world_size": engine.dp_world_size,
            "optimizer_class": type(base_optimizer(engine)).__name__,
            "zero_optimizer": type(engine.optimizer).__name__,
            "flat_layout": getattr(engine, "flat_layout", MODEL_ORDER)}


# The parameter order in DeepSpeed's flat buffers (ds_core.rank.engine_build.flat_layout). Checkpoints written before
# the key existed used the model's order: absent means that, so they load where nothing moved and are refused where
# something did (their optimizer state would land on other parameters).
MODEL_ORDER = "model order"


# Recorded in the fingerprint, compared elsewhere: a data-parallel size change is a resize, not a mismatch.
NOT_COMPARED = frozenset({"dp_world_size"})


def describe_mismatch(saved: dict, current: dict, universal: bool = False) -> list[str]:
    """What differs between a checkpoint's fingerprint and this run's (keys the checkpoint lacks are not compared,
    so checkpoints written before a key existed still load). universal: loaded through DeepSpeed's universal format (a
    resize), which holds each parameter's fp32 weights and optimizer state whichever wrapper wrote them, so DeepSpeed's
    optimizer wrapper may differ (a resize that changes the accumulation can change it: ds_core.config adds fp32
    accumulation when a smaller world keeps the batch with more micro steps)."""
    diffs = []
    for key in ("zero_stage",):
        if saved.get(key) != current.get(key):
            diffs.append(f"{key}: checkpoint {saved.get(key)}, this run {current.get(key)} (DeepSpeed's universal "
                         f"checkpoint loading here changes the data-parallel size, not the ZeRO stage)")
    a, b = saved.get("param_shapes", {}), current.get("param_shapes", {})
    missing, extra = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if missing:
        diffs.append(f"{len(missing)} parameter(s) only in the checkpoint, e.g. {missing[:3]}")
    if extra:
        diffs.append(f"{len(extra)} parameter(s) only in this model, e.g. {extra[:3]}")
    changed = [f"{n}: checkpoint {a[n]}, this run {b[n]}" for n in sorted(set(a) & set(b)) if a[n] != b[n]]
    if changed:
        diffs.append(f"{len(changed)} parameter shape(s) differ, e.g. " + "; ".join(changed[:3]))
    if saved.get("flat_layout", MODEL_ORDER) != current.get("flat_layout", MODEL_ORDER):
        diffs.append(f"flat_layout: checkpoint {saved.get('flat_layout', MODEL_ORDER)!r}, this run "
                     f"{current.get('flat_layout', MODEL_ORDER)!r} (the order of the parameters in DeepSpeed's flat "
                     f"optimizer buffers; the optimizer state would load onto other parameters)")
    if not universal and "zero_optimizer" in saved and saved["zero_optimizer"] != current.get("zero_optimizer"):
        diffs.append(f"zero_optimizer: checkpoint {saved['zero_optimizer']!r}, this run "
                     f"{current.get('zero_optimizer')!r} (DeepSpeed's optimizer wrapper, chosen by the DeepSpeed "
                     f"JSON's precision and data_types.grad_accum_dtype; its state files differ: resume with the "
                     f"precision and DeepSpeed JSON the checkpoint was written with)")
    for key in sorted(set(saved) - {"param_shapes", "zero_stage", "flat_layout", "zero_optimizer"} - NOT_COMPARED):
        if saved.get(key) != current.get(key):
            diffs.append(f"{key}: checkpoint {saved.get(key)!r}, this run {current.get(key)!r}")
    return diffs


def batch_layout(engine) -> dict:
    """The batch numbers a checkpoint records (ds_core.checkpoint.resize.Layout's fields)."""
    return {"dp_world_size": engine.dp_world_size, "train_batch_size": engine.train_batch_size(),
            "micro_batch": engine.train_micro_batch_size_per_gpu(), "grad_accum": engine.gradient_accumulation_steps()}


def hf_model_info(module) -> dict | None:
    """The module's transformers class (the first in its MRO that transformers exports: a subclass such as bert_ref's
    sparse-MLM head saves as its base) and config, so a checkpoint can be exported without the model package."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    from ds_core.checkpoint.pretrained import transformers_class

    cls = transformers_class(module)
    return {"class": cls, "config": config.to_dict()} if cls else None
