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
from bert_ref.model import build_model, flops_per_sequence  # noqa: E402
from bert_ref.optim import OptimArgs, build_optimizer, schedule_for  # noqa: E402
from bert_ref.step import make_step_fn  # noqa: E402
from ds_core.checkpoint import export_hf  # noqa: E402
from ds_core.config import (ConfigError, TrainConfig, check_optimizer_source, ds_config_for, parse_args,  # noqa: E402
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
    check_optimizer_source(train_cfg.deepspeed_config, optimizer_in_code=True)  # before distributed init
    prepare_run_dir(train_cfg)  # a used run_dir is refused (or moved aside) before any rank starts
    dist = init_distributed(train_cfg.dist_timeout_s)
    set_seed(train_cfg.seed)
    ds_config = ds_config_for(train_cfg, dist.world_size)
    save_run_config(train_cfg.run_dir, train_cfg, args, opt_args, rank=dist.rank)

    data = build_data(args.input_dir, dist.rank, dist.world_size, ds_config["train_micro_batch_size_per_gpu"],
                      seed=train_cfg.seed)
    check_data_matches(preset, data, args.input_dir)  # before building a 1.5B model for the wrong phase
    accum = ds_config["gradient_accumulation_steps"]
    total_steps = train_cfg.max_steps or (len(data) // accum) * train_cfg.max_epochs
    if total_steps < 1:
        raise ConfigError(f"{args.input_dir}: {len(data)} micro batches per epoch on rank {dist.rank} make no "
                          f"optimizer step of {accum} accumulated micro batches")

    model = build_model(preset, args.init_checkpoint, args.activation_checkpointing, args.attn_implementation,
                        sparse_mlm=args.sparse_mlm, fast_dropout=args.fast_dropout)
    mlm_positions = preset.max_predictions_per_seq if args.sparse_mlm else 0
    optimizer = build_optimizer(model, opt_args, nodes=dist.nodes)
    engine = build_engine(model, ds_config, optimizer=optimizer, lr_scheduler=schedule_for(opt_args, total_steps))

    summary = train(engine, make_step_fn(mlm_positions), data, train_cfg, dist,
                    model_name=f"{preset.name}_phase{preset.phase}",
                    flops_per_sample=flops_per_sequence(preset, mlm_positions=mlm_positions or None),
                    seq_len=preset.seq_len,
                    fingerprint={"preset": preset.name, "optimizer": opt_args.optimizer})
    if args.export_hf:
        export_hf(engine, Path(train_cfg.run_dir) / "hf_model")  # --init_checkpoint of phase 2
    data.close()
    shutdown_distributed()
    return summary


if __name__ == "__main__":
    main()
