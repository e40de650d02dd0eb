"""BERT pretraining (MLM + NSP) on DeepSpeed. Runs as
    deepspeed --hostfile H --module bert_ref.train --preset bert_1p5b --deepspeed_config ds_configs/... --input_dir D
    deepspeed bert_ref/train.py ...        mpirun -n N python -m bert_ref.train ...        python -m bert_ref.train ...
"""
from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (`deepspeed bert_ref/train.py`): make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bert_ref.configs import BertArgs, check_data_matches  # noqa: E402
from bert_ref.data import build_data  # noqa: E402
from bert_ref.shards import list_test_shards  # noqa: E402
from bert_ref.eval import EvalData, make_eval_fn  # noqa: E402
from bert_ref.model import build_model, flops_per_sequence  # noqa: E402
from bert_ref.layerwise import attach_zero_layout  # noqa: E402
from bert_ref.optim import OptimArgs, build_optimizer, schedule_for  # noqa: E402
from bert_ref.step import make_step_fn  # noqa: E402
from ds_core.checkpoint import export_hf  # noqa: E402
from ds_core.checkpoint.resize import plan_resize  # noqa: E402
from ds_core.config import (ConfigError, TrainConfig, check_ds_json, ds_config_for, parse_args,  # noqa: E402
                            save_run_config)
from ds_core.engine import build_engine, init_distributed, set_seed, shutdown_distributed  # noqa: E402
from ds_core.loop import train  # noqa: E402
from ds_core.run_dir import prepare_run_dir  # noqa: E402

# bert_ref's one default DeepSpeed JSON (the default preset, bert_large phase 1). It has no "optimizer" section: the
# optimizer (LAMB / LANS / AdamW) is built in code from --optimizer.
DEFAULT_DS_CONFIG = "bert_large_zero1_bf16.json"


def main(argv: list[str] | None = None) -> dict:
    # parse_args validates every section first: a bad preset or a missing --input_dir fails before any rank starts
    train_cfg, args, opt_args = parse_args([TrainConfig, BertArgs, OptimArgs], argv, description=__doc__)
    preset = args.model_preset()
    train_cfg.deepspeed_config = train_cfg.deepspeed_config or DEFAULT_DS_CONFIG
    check_ds_json(train_cfg.deepspeed_config, optimizer_in_code=True)  # before distributed init
    prepare_run_dir(train_cfg)  # a used run_dir is refused (or moved aside) before any rank starts
    dist = init_distributed(train_cfg.dist_timeout_s)
    set_seed(train_cfg.seed)
    ds_config = ds_config_for(train_cfg, dist.world_size)
    plan_resize(train_cfg, ds_config, dist.world_size)  # --resume onto another world size: batch, universal load
    opt_args = opt_args.for_preset(preset.name, preset.phase)  # '' / 0 -> the preset's published recipe
    save_run_config(train_cfg.run_dir, train_cfg, args, opt_args, rank=dist.rank)

    micro = ds_config["train_micro_batch_size_per_gpu"]
    # ids are checked against the shards' own vocabulary, or the model's where the files do not store one
    data = build_data(args.input_dir, dist.rank, dist.world_size, micro, seed=train_cfg.seed,
                      vocab_size=preset.vocab_size)
    check_data_matches(preset, data, args.input_dir)  # before building a 1.5B model for the wrong phase
    tests = list_test_shards(args.input_dir)
    if train_cfg.eval_every and not tests:
        raise ConfigError(f"--eval_every {train_cfg.eval_every}: {args.input_dir} has no held-out *_test_* shards "
                          "(bert-prep shards --num_test_shards K writes them)")
    eval_data = EvalData(tests, dist.rank, dist.world_size, micro, vocab_size=preset.vocab_size) if tests else None
    if eval_data is not None:
        check_data_matches(preset, eval_data, args.input_dir)
    accum = ds_config["gradient_accumulation_steps"]
    total_steps = train_cfg.max_steps or (len(data) // accum) * train_cfg.max_epochs
    if total_steps < 1:
        raise ConfigError(f"{args.input_dir}: {len(data)} micro batches per epoch on rank {dist.rank} make no "
                          f"optimizer step of {accum} accumulated micro batches")

    hf_init = "" if args.init_run_dir() else args.init_checkpoint  # a run directory is loaded by the loop
    model = build_model(preset, hf_init, args.activation_checkpointing, args.attn_implementation,
                        sparse_mlm=args.sparse_mlm, fast_dropout=args.fast_dropout)
    mlm_positions = preset.max_predictions_per_seq if args.sparse_mlm else 0
    optimizer = build_optimizer(model, opt_args, global_batch=ds_config["train_batch_size"])
    engine = build_engine(model, ds_config, optimizer=optimizer, lr_scheduler=schedule_for(opt_args, total_steps))
    attach_zero_layout(engine, optimizer)  # LAMB / LANS trust ratios per tensor, not per ZeRO partition

    summary = train(engine, make_step_fn(mlm_positions), data, train_cfg, dist,
                    model_name=f"{preset.name}_phase{preset.phase}",
                    flops_per_sample=flops_per_sequence(preset, mlm_positions=mlm_positions or None),
                    seq_len=preset.seq_len,
                    fingerprint={"preset": preset.name, "optimizer": opt_args.optimizer},
                    eval_fn=make_eval_fn(eval_data, mlm_positions) if eval_data is not None else None,
                    init_from=args.init_run_dir() or None, reset_optimizer=args.reset_optimizer)
    if args.export_hf:  # the module's weights for transformers users; phase 2 starts from the run directory
        export_hf(engine, Path(train_cfg.run_dir) / "hf_model")
    data.close()
    shutdown_distributed()
    return summary


if __name__ == "__main__":
    main()
