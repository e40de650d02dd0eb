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
from bert_ref.eval import held_out_evaluation  # noqa: E402
from bert_ref.layerwise import attach_zero_layout  # noqa: E402
from bert_ref.model import build_model, flops_per_sequence  # noqa: E402
from bert_ref.optim import build_optimizer, for_preset  # noqa: E402
from bert_ref.recipes import check_recipe_batch, expand_recipe  # noqa: E402
from bert_ref.step import make_step_fn  # noqa: E402
from ds_core.checkpoint import export_hf  # noqa: E402
from ds_core.config import TrainConfig  # noqa: E402
from ds_core.engine import build_engine, compile_model, shutdown_distributed  # noqa: E402
from ds_core.process_end import run_main  # noqa: E402
from ds_core.settings import OptimArgs, schedule_for  # noqa: E402
from ds_core.setup import RunSpec, start_run  # noqa: E402
from ds_core.trainer import Trainer  # noqa: E402

# bert_ref's one default DeepSpeed JSON (the default preset, bert_large phase 1). It has no "optimizer" section: the
# optimizer (LAMB / LANS / AdamW) is built in code from --optimizer.
DEFAULT_DS_CONFIG = "bert_large_zero1_bf16.json"


def resolve(sections: tuple) -> tuple[tuple, list[str]]:
    """Before any rank starts: the optimizer settings left to the model become BERT's defaults and the preset's
    published recipe."""
    train_cfg, args, opt_args = sections
    preset = args.model_preset()
    return (train_cfg, args, for_preset(opt_args, preset.name, preset.phase)), []


SPEC = RunSpec(types=(TrainConfig, BertArgs, OptimArgs), default_ds_config=DEFAULT_DS_CONFIG, optimizer_in_code=True,
               description=__doc__, resolve=resolve)


def main(argv: list[str] | None = None) -> dict:
    argv, recipe = expand_recipe(list(sys.argv[1:] if argv is None else argv))  # --recipe NAME: the published run
    run = start_run(SPEC, argv)  # settings validated and resolved before any rank starts; process group, DeepSpeed
    _, args, opt_args = run.settings
    preset, dist, ds_config = args.model_preset(), run.dist, run.ds_config
    check_recipe_batch(recipe, ds_config)  # a recipe's LR and steps hold for its global batch only
    # ids are checked against the shards' own vocabulary, or the model's where the files do not store one
    data = build_data(args.input_dir, dist.rank, dist.world_size, ds_config["train_micro_batch_size_per_gpu"],
                      seed=run.train.seed, vocab_size=preset.vocab_size)
    check_data_matches(preset, data, args.input_dir)  # before building a 1.5B model for the wrong phase
    run = run.with_data(data)  # total optimizer steps, decided once: the schedule and the trainer use it
    mlm_positions = preset.max_predictions_per_seq if args.sparse_mlm else 0
    evaluation = held_out_evaluation(run, args.input_dir, preset, mlm_positions)

    hf_init = "" if args.init_run_dir() else args.init_checkpoint  # a run directory is loaded by the trainer
    model = build_model(preset, hf_init, args.activation_checkpointing, args.attn_implementation,
                        sparse_mlm=args.sparse_mlm, fast_dropout=args.fast_dropout)
    optimizer = build_optimizer(model, opt_args, global_batch=ds_config["train_batch_size"])
    engine = build_engine(model, ds_config, optimizer=optimizer, lr_scheduler=schedule_for(opt_args, run.total_steps))
    attach_zero_layout(engine, optimizer)  # LAMB / LANS trust ratios per tensor, not per ZeRO partition
    # every batch has one shape (seq_len; the sparse head's P positions): one static graph
    compiled = compile_model(engine, run.train.compile, dynamic=False)

    step = make_step_fn(mlm_positions, compiled)
    summary = Trainer(run, engine, step, model_name=f"{preset.name}_phase{preset.phase}",
                      flops_per_sample=flops_per_sequence(preset, mlm_positions=mlm_positions or None),
                      seq_len=preset.seq_len, evaluation=evaluation,
                      fingerprint={"preset": preset.name, "optimizer": opt_args.optimizer},
                      init_from=args.init_run_dir() or None, reset_optimizer=args.reset_optimizer).fit()
    if args.export_hf:  # the module's weights for transformers users; phase 2 starts from the run directory
        export_hf(engine, Path(run.train.run_dir) / "hf_model")
    data.close()
    shutdown_distributed()
    return summary


if __name__ == "__main__":
    run_main(main)  # ends without interpreter finalisation: see ds_core.process_end
