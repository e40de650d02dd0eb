"""BERT pretraining (MLM + NSP) on DeepSpeed. Runs as
    deepspeed --hostfile H --module bert_ref.train --preset bert_1p5b --deepspeed_config ds_configs/... --input_dir D
    deepspeed bert_ref/train.py ...        mpirun -n N python -m bert_ref.train ...        python -m bert_ref.train ...
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import ds_configs
from bert_ref.configs import BertSettings, check_data_matches
from bert_ref.data import build_data
from bert_ref.eval import held_out_evaluation
from bert_ref.layerwise import attach_zero_layout
from bert_ref.model import build_model, flops_per_sequence, hf_config
from bert_ref.optim import build_optimizer, for_preset
from bert_ref.recipes import check_recipe_batch, expand_recipe
from bert_ref.step import make_step_fn
from ds_core.checkpoint import export_hf
from ds_core.config.optim import schedule_for
from ds_core.errors import ConfigError
from ds_core.outputs.model_card import card_text, hub_id_of, optimizer_name, write_model_card
from ds_core.outputs.monitors import apply_report_to
from ds_core.rank.compile import compile_model
from ds_core.rank.dist import shutdown_distributed
from ds_core.rank.engine_build import build_engine
from ds_core.rank.process_end import run_main
from ds_core.run.run_dir import resume_from_checkpoint
from ds_core.run.setup import Run, RunSpec, start_run
from ds_core.run.trainer import Checkpointing, ModelInfo, Trainer

MODULE = "bert_ref.train"
# The DeepSpeed JSON of the default preset (bert_large phase 1). Each preset brings its own (ds_configs.DEFAULT_JSON,
# default_ds_config below); none has an "optimizer" section: the optimizer (LAMB / LANS / AdamW) is built in code.
DEFAULT_DS_CONFIG = ds_configs.preset_json(MODULE, "")
# Where `--compile auto` compiles BERT besides Gaudi (where every model compiles, as Habana recommends): the
# accelerators on which its compiled step measured faster than eager (CUDA, docs/compile.md)
COMPILE_AUTO_ON = ("cuda",)


def default_ds_config(cfg: BertSettings) -> str:
    """The preset's own DeepSpeed JSON, used when --deepspeed_config is not given; a preset without one is refused."""
    chosen = ds_configs.preset_json(MODULE, cfg.model.preset)
    if not chosen:
        raise ConfigError(f"--preset {cfg.model.preset} has no DeepSpeed JSON of its own (ds_configs.DEFAULT_JSON): "
                          "give --deepspeed_config")
    return chosen


def resolve(cfg: BertSettings) -> tuple[BertSettings, list[str]]:
    """Before any rank starts: the optimizer settings left to the model become BERT's defaults and the preset's
    published recipe; --resume_from_checkpoint is --resume."""
    preset = cfg.model.model_preset()
    train = resume_from_checkpoint(cfg.train)  # transformers' --resume_from_checkpoint [PATH]: --resume
    return dataclasses.replace(cfg, train=train, optim=for_preset(cfg.optim, preset.name, preset.phase)), []


def adjust_ds_config(cfg: BertSettings, ds_config: dict) -> list[str]:
    """The --report_to monitors, written into the resolved DeepSpeed config (as bridgetower_ds.train does); a JSON
    that does not say whether ZeRO may step an optimizer DeepSpeed has not tested may (LAMB / LANS, tested here under
    every ZeRO stage), as accelerate allows a client optimizer under Trainer."""
    ds_config.setdefault("zero_allow_untested_optimizer", True)
    return apply_report_to(cfg.model.report_to, ds_config, cfg.train.run_dir, job_name="bert")


SPEC = RunSpec(settings=BertSettings, default_ds_config=default_ds_config, optimizer_in_code=True,
               description=__doc__, prog=f"python -m {MODULE}", resolve=resolve, adjust_ds_config=adjust_ds_config,
               check_batch=lambda cfg, batch: check_recipe_batch(cfg.model.recipe, batch),  # a recipe's global batch
               model_config=lambda cfg: hf_config(cfg.model.model_preset()),  # a Trainer-style JSON's ZeRO sizes
               why_in_code="BERT trains with its recipe's LAMB / LANS and LR schedule (--optimizer, "
                           "--lr_scheduler_type), with per-tensor trust ratios under ZeRO (bert_ref.layerwise)")


def main(argv: list[str] | None = None) -> dict:
    argv, _ = expand_recipe(list(sys.argv[1:] if argv is None else argv))  # --recipe NAME: the published run's flags
    run = start_run(SPEC, argv)  # settings validated and resolved before any rank starts; process group, DeepSpeed
    args, preset, dist = run.cfg.model, run.cfg.model.model_preset(), run.dist
    # ids are checked against the shards' own vocabulary, or the model's where the files do not store one
    data = build_data(args.input_dir, dist.rank, dist.world_size, run.batch.micro,
                      seed=run.train.seed, vocab_size=preset.vocab_size)
    check_data_matches(preset, data, args.input_dir)  # before building a 1.5B model for the wrong phase
    run = run.with_data(data)  # total optimizer steps, decided once: the schedule and the trainer use it
    mlm_positions = preset.max_predictions_per_seq if args.sparse_mlm else 0
    evaluation = held_out_evaluation(run, args.input_dir, preset, mlm_positions)
    engine = _engine(run)
    # every batch has one shape (seq_len; the sparse head's P positions): one static graph
    # auto compiles on CUDA: BERT-Large's compiled step was 1.51x the eager one on an H200 (docs/compile.md); on Gaudi
    # auto compiles every model (Habana's recommended execution; ds_core.rank.compile.compile_wanted)
    compiled = compile_model(engine, run.train.compile, dynamic=False, auto_on=COMPILE_AUTO_ON)
    checkpoints = Checkpointing(run, engine, {"preset": preset.name, "optimizer": run.cfg.optim.optimizer},
                                init_from=args.init_run_dir() or None, reset_optimizer=args.reset_optimizer)
    model_info = ModelInfo(f"{preset.name}_phase{preset.phase}",
                           flops_per_sequence(preset, mlm_positions=mlm_positions or None), preset.seq_len)
    summary = Trainer(run, engine, make_step_fn(mlm_positions, compiled), model_info, evaluation=evaluation,
                      checkpoints=checkpoints).fit()
    if args.export_hf:  # the module's weights for transformers users; phase 2 starts from the run directory
        export_hf(engine, Path(run.train.run_dir) / "hf_model", extras=lambda d: write_model_card(d, card_text(
            run, optimizer=optimizer_name(engine, run.ds_config), model_name=Path(run.train.run_dir).name,
            finetuned_from=hub_id_of(args.init_checkpoint) if args.init_checkpoint else None)))
    data.close()
    shutdown_distributed()
    return summary


def _engine(run: Run):
    """The model (random, or a Hugging Face / Habana checkpoint's weights), its optimizer and LR schedule, in a
    DeepSpeed engine."""
    args, opt_args = run.cfg.model, run.cfg.optim
    hf_init = "" if args.init_run_dir() else args.init_checkpoint  # a run directory is loaded by the trainer
    model = build_model(args.model_preset(), hf_init, args.activation_checkpointing, args.attn_implementation,
                        sparse_mlm=args.sparse_mlm, fast_dropout=args.fast_dropout)
    optimizer = build_optimizer(model, opt_args, global_batch=run.batch.global_size)
    engine = build_engine(model, run.ds_config, optimizer=optimizer,
                          lr_scheduler=schedule_for(opt_args, run.total_steps))
    attach_zero_layout(engine, optimizer)  # LAMB / LANS trust ratios per tensor, not per ZeRO partition
    return engine


if __name__ == "__main__":
    run_main(main)  # ends without interpreter finalisation: see ds_core.rank.process_end
