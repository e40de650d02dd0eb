"""Fine-tune BridgeTower (contrastive) through ds_core: `deepspeed --num_gpus N --module bridgetower_ds.train ...`,
`deepspeed bridgetower_ds/train.py ...`, or `python -m bridgetower_ds.train ...` for one process.

optimum-habana's run_bridgetower.py command line is accepted as written (bridgetower_ds/compat.py says how); results
and the final model land in --output_dir (= --run_dir) as transformers' Trainer writes them."""
from __future__ import annotations

import json
from pathlib import Path

from ds_core.checkpoint.resize import plan_resize
from ds_core.config import ConfigError, TrainConfig, check_ds_json, ds_config_for, parse_args, save_run_config
from ds_core.engine import build_engine, init_distributed, set_seed, shutdown_distributed
from ds_core.loop import train
from ds_core.results import keep_frozen_fp32, save_metrics, save_model, train_metrics
from ds_core.schedule import total_optimizer_steps
from ds_core.run_dir import prepare_run_dir

from bridgetower_ds import compat
from bridgetower_ds.configs import CompatArgs, ModelArgs, OptimArgs, RunArgs
from bridgetower_ds.data import DataArgs, build_data, open_dataset
from bridgetower_ds.eval import evaluate
from bridgetower_ds.hub import resolve_pretrained
from bridgetower_ds.model import build_model, flops_per_sample, model_summary
from bridgetower_ds.step import step_fn
from bridgetower_ds.tokenizer import expected_padded_length, load_tokenizer

# bridgetower_ds's one default DeepSpeed JSON. The optimizer is its "optimizer" section (AdamW) or, without one,
# AdamW built in code; learning rate and weight decay follow OptimArgs' rule either way (bridgetower_ds/compat.py).
DEFAULT_DS_CONFIG = "bridgetower_zero1_bf16.json"
# The run's settings file: run_dir also receives the final model, whose own config.json is the model's.
RUN_CONFIG = "run_config.json"


def main(argv=None) -> dict:
    train_cfg, model_args, data_args, run_args, optim, compat_args = parse_args(
        [TrainConfig, ModelArgs, DataArgs, RunArgs, OptimArgs, CompatArgs], argv,
        description="BridgeTower contrastive fine-tuning")
    if not (run_args.do_train or run_args.do_eval or run_args.do_predict):
        raise ConfigError("nothing to do: pass at least one of --do_train, --do_eval, --do_predict")
    notices = compat.check_flags(compat_args, train_cfg)
    model_args.model_name_or_path = resolve_pretrained(model_args.model_name_or_path)
    model_args.tokenizer_name_or_path = resolve_pretrained(model_args.tokenizer_name_or_path,
                                                           "--tokenizer_name_or_path")
    train_cfg.deepspeed_config = train_cfg.deepspeed_config or DEFAULT_DS_CONFIG
    check_ds_json(train_cfg.deepspeed_config, optimizer_in_code=None)  # values checked before distributed init
    if run_args.do_train:
        prepare_run_dir(train_cfg)  # a used run_dir is refused (or moved aside) before any rank starts
    dist = init_distributed(train_cfg.dist_timeout_s)
    set_seed(train_cfg.seed)
    ds_config = ds_config_for(train_cfg, dist.world_size)
    plan_resize(train_cfg, ds_config, dist.world_size)  # --resume onto another world size: batch, universal load
    lr, wd, notes = compat.resolve_optimizer(optim, ds_config, f"DeepSpeed config {train_cfg.deepspeed_config}")
    notices += notes + compat.apply_report_to(compat_args.report_to, ds_config, train_cfg.run_dir)
    save_run_config(train_cfg.run_dir, train_cfg, model_args, data_args, run_args, optim, compat_args,
                    rank=dist.rank, name=RUN_CONFIG)

    tokenizer = load_tokenizer(model_args, data_args.max_seq_length)
    model = build_model(model_args)
    image_size = int(model.config.vision_config.image_size)
    if data_args.image_size and data_args.image_size != image_size:
        raise ConfigError(f"--image_size {data_args.image_size} != the model's vision image_size {image_size}")
    processor = compat.image_processor(model_args.model_name_or_path, image_size)
    if dist.rank == 0:
        for line in notices:
            print(f"[bridgetower] {line}", flush=True)
        print(f"[bridgetower] {model_summary(model)}; images {image_size}px, captions <= "
              f"{data_args.max_seq_length} tokens; lr {lr}, weight decay {wd}", flush=True)

    splits = open_dataset(data_args)  # opened and split once; every evaluation reuses it

    def data(split: str, micro: int, shuffle: bool):
        return build_data(splits, split, tokenizer, image_size, dist.rank, dist.world_size, micro_batch=micro,
                          seed=train_cfg.seed, device=dist.device, shuffle=shuffle)

    micro = ds_config["train_micro_batch_size_per_gpu"]
    train_data = data("train", micro, shuffle=True) if run_args.do_train else None
    total = total_optimizer_steps(train_cfg.max_steps, train_cfg.max_epochs, len(train_data),
                                  ds_config["gradient_accumulation_steps"]) if train_data is not None else 1
    model.logit_scale_as_1d()  # DeepSpeed cannot broadcast 0-dim parameters
    frozen = keep_frozen_fp32(model, keep=dist.rank == 0)
    engine = build_engine(model, ds_config, **compat.engine_kwargs(model, optim, ds_config, lr, wd, total))

    eval_micro = run_args.eval_micro_batch_size or micro
    results: dict = {"eval": {}, "predict": {}}
    eval_sources: dict = {}

    def run_split(split: str, prefix: str) -> dict:
        if split not in eval_sources:  # built once, reused by every evaluation of the run
            eval_sources[split] = data(split, eval_micro, shuffle=False)
        source = eval_sources[split]
        source.set_epoch(0)
        res = evaluate(engine, iter(source), prefix=prefix)
        results["predict" if prefix == "test" else "eval"] = res
        return res

    summary: dict = {}
    if train_data is not None:
        seq_len = expected_padded_length(tokenizer, train_data.table.captions, micro, data_args.max_seq_length,
                                         train_data.pad_to_max)  # the data's one padding policy
        eval_fn = (lambda eng, step: run_split("validation", "eval")) if run_args.do_eval else None
        name = Path(model_args.model_name_or_path).name if model_args.model_name_or_path else model_args.preset
        summary = train(engine, step_fn, train_data, train_cfg, dist, model_name=f"bridgetower:{name}",
                        seq_len=seq_len, eval_fn=eval_fn,
                        flops_per_sample=flops_per_sample(model.config, seq_len,
                                                          freeze_vision=model_args.freeze_vision_model,
                                                          freeze_text=model_args.freeze_text_model))
        save_metrics(train_cfg.run_dir, "train", train_metrics(summary, train_samples=len(train_data.table)),
                     dist.rank)
        train_data.close()
    elif run_args.do_eval:
        run_split("validation", "eval")
    if run_args.do_predict:
        run_split("test", "test")
    for source in eval_sources.values():
        source.close()
    for split in ("eval", "predict"):
        if results[split]:
            save_metrics(train_cfg.run_dir, split, results[split], dist.rank)

    def extras(d: Path) -> None:  # what run_bridgetower.py saves beside the model
        tokenizer.save_pretrained(str(d))
        processor.save_pretrained(str(d))

    # Trainer.save_model into --output_dir after training; --export_dir as well (also without training)
    outs = [train_cfg.run_dir] if train_data is not None else []
    for out in outs + ([run_args.export_dir] if run_args.export_dir else []):
        save_model(engine, out, frozen=frozen, extras=extras)
    if dist.rank == 0 and (results["eval"] or results["predict"]):
        print("[bridgetower] " + json.dumps({**results["eval"], **results["predict"]}), flush=True)
    shutdown_distributed()
    return {**summary, **results["eval"], **results["predict"]}


if __name__ == "__main__":
    main()
