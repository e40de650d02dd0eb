"""Fine-tune BridgeTower (contrastive) through ds_core: `deepspeed --num_gpus N --module bridgetower_ds.train ...`,
`deepspeed bridgetower_ds/train.py ...`, or `python -m bridgetower_ds.train ...` for one process."""
from __future__ import annotations

import json
from pathlib import Path

from ds_core.checkpoint import export_hf
from ds_core.config import (ConfigError, TrainConfig, atomic_write_text, check_ds_json, ds_config_for,
                            parse_args, save_run_config)
from ds_core.engine import build_engine, init_distributed, set_seed, shutdown_distributed
from ds_core.loop import train
from ds_core.run_dir import prepare_run_dir

from bridgetower_ds.configs import ModelArgs, RunArgs
from bridgetower_ds.data import DataArgs, build_data, open_dataset
from bridgetower_ds.eval import evaluate
from bridgetower_ds.model import build_model, flops_per_sample, model_summary
from bridgetower_ds.step import step_fn
from bridgetower_ds.tokenizer import expected_padded_length, load_tokenizer

# bridgetower_ds's one default DeepSpeed JSON; the optimizer (AdamW) comes from its "optimizer" section.
DEFAULT_DS_CONFIG = "bridgetower_zero1_bf16.json"


def main(argv=None) -> dict:
    train_cfg, model_args, data_args, run_args = parse_args(
        [TrainConfig, ModelArgs, DataArgs, RunArgs], argv, description="BridgeTower contrastive fine-tuning")
    if not (run_args.do_train or run_args.do_eval or run_args.do_predict):
        raise ConfigError("nothing to do: pass at least one of --do_train, --do_eval, --do_predict")
    train_cfg.deepspeed_config = train_cfg.deepspeed_config or DEFAULT_DS_CONFIG
    check_ds_json(train_cfg.deepspeed_config, optimizer_in_code=False)  # before distributed init
    if run_args.do_train:
        prepare_run_dir(train_cfg)  # a used run_dir is refused (or moved aside) before any rank starts
    dist = init_distributed(train_cfg.dist_timeout_s)
    set_seed(train_cfg.seed)
    ds_config = ds_config_for(train_cfg, dist.world_size)
    save_run_config(train_cfg.run_dir, train_cfg, model_args, data_args, run_args, rank=dist.rank)

    tokenizer = load_tokenizer(model_args, data_args.max_seq_length)
    model = build_model(model_args)
    image_size = int(model.config.vision_config.image_size)
    if data_args.image_size and data_args.image_size != image_size:
        raise ConfigError(f"--image_size {data_args.image_size} != the model's vision image_size {image_size}")
    if dist.rank == 0:
        print(f"[bridgetower] {model_summary(model)}; images {image_size}px, captions <= "
              f"{data_args.max_seq_length} tokens", flush=True)
    model.logit_scale_as_1d()  # DeepSpeed cannot broadcast 0-dim parameters
    engine = build_engine(model, ds_config)

    splits = open_dataset(data_args)  # opened and split once; every evaluation reuses it

    def data(split: str, micro: int, shuffle: bool):
        return build_data(splits, split, tokenizer, image_size, dist.rank, dist.world_size, micro_batch=micro,
                          seed=train_cfg.seed, device=dist.device, shuffle=shuffle)

    eval_micro = run_args.eval_micro_batch_size or ds_config["train_micro_batch_size_per_gpu"]
    results: dict = {}
    eval_sources: dict = {}

    def run_split(split: str, prefix: str):
        if split not in eval_sources:
            eval_sources[split] = data(split, eval_micro, shuffle=False)
        source = eval_sources[split]
        source.set_epoch(0)
        res = evaluate(engine, iter(source), prefix=prefix)
        results.update(res)
        return res

    summary: dict = {}
    if run_args.do_train:
        micro = ds_config["train_micro_batch_size_per_gpu"]
        train_data = data("train", micro, shuffle=True)
        seq_len = expected_padded_length(tokenizer, train_data.table.captions, micro, data_args.max_seq_length,
                                         train_data.pad_to_max)  # the data's one padding policy
        eval_fn = (lambda eng, step: run_split("validation", "eval")) if run_args.do_eval else None
        name = Path(model_args.model_name_or_path).name if model_args.model_name_or_path else model_args.preset
        summary = train(engine, step_fn, train_data, train_cfg, dist, model_name=f"bridgetower:{name}",
                        seq_len=seq_len, eval_fn=eval_fn,
                        flops_per_sample=flops_per_sample(model.config, seq_len,
                                                          freeze_vision=model_args.freeze_vision_model,
                                                          freeze_text=model_args.freeze_text_model))
        train_data.close()
    elif run_args.do_eval:
        run_split("validation", "eval")
    if run_args.do_predict:
        run_split("test", "test")
    for source in eval_sources.values():
        source.close()
    if run_args.export_dir:
        export_hf(engine, run_args.export_dir)
        if dist.rank == 0:
            tokenizer.save_pretrained(run_args.export_dir)
    if dist.rank == 0 and results:
        Path(train_cfg.run_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(train_cfg.run_dir) / "eval_results.json", json.dumps(results, indent=2) + "\n")
        print("[bridgetower] " + json.dumps(results), flush=True)
    shutdown_distributed()
    return {**summary, **results}


if __name__ == "__main__":
    main()
