"""Fine-tune BridgeTower (contrastive) through ds_core: `deepspeed --num_gpus N --module bridgetower_ds.train ...`,
`deepspeed bridgetower_ds/train.py ...`, or `python -m bridgetower_ds.train ...` for one process.

optimum-habana's run_bridgetower.py command line is accepted as written (bridgetower_ds/compat.py says how); results
and the final model land in --output_dir (= --run_dir) as transformers' Trainer writes them."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from ds_core.config import ConfigError, TrainConfig, read_ds_json, resolve_ds_path
from ds_core.engine import build_engine, compile_model, shutdown_distributed
from ds_core.process_end import run_main
from ds_core.results import keep_frozen_fp32, save_metrics, save_model
from ds_core.settings import OptimArgs
from ds_core.setup import Run, RunSpec, start_run
from ds_core.trainer import Trainer

from bridgetower_ds import compat, trainer_files, trainer_flags
from bridgetower_ds.configs import CompatArgs, ModelArgs, RunArgs
from bridgetower_ds.data import DataArgs, build_data, check_dataset, open_dataset
from bridgetower_ds.eval import evaluation_for
from bridgetower_ds.hub import resolve_pretrained
from bridgetower_ds.model import build_model, flops_per_sample, load_config, model_summary
from bridgetower_ds.step import step_fn
from bridgetower_ds.tokenizer import expected_padded_length, load_tokenizer

# bridgetower_ds's one default DeepSpeed JSON. The optimizer is its "optimizer" section (AdamW) or, without one,
# AdamW built in code; learning rate and weight decay follow OptimArgs' rule either way (bridgetower_ds/compat.py).
DEFAULT_DS_CONFIG = "bridgetower_zero1_bf16.json"


def resolve(sections: tuple) -> tuple[tuple, list[str]]:
    """Before any rank starts: flags mapped or refused, hub ids looked up in the local cache, and the learning rate
    and weight decay resolved against the DeepSpeed JSON (OptimArgs' rule, bridgetower_ds/compat.py)."""
    train_cfg, model_args, data_args, run_args, optim, compat_args = sections
    if not (run_args.do_train or run_args.do_eval or run_args.do_predict):
        raise ConfigError("nothing to do: pass at least one of --do_train, --do_eval, --do_predict")
    train_cfg = compat.check_flags(compat_args, train_cfg)
    train_cfg, model_args, data_args, flag_notes = trainer_flags.map_flags(compat_args, train_cfg, model_args,
                                                                           data_args, DEFAULT_DS_CONFIG,
                                                                           optim.max_grad_norm)
    if not (compat_args.train_file or compat_args.validation_file or compat_args.test_file):
        check_dataset(data_args)  # a dataset missing from the offline cache stops here, before any rank builds a model
    model_args = dataclasses.replace(
        model_args, model_name_or_path=resolve_pretrained(model_args.model_name_or_path,
                                                          revision=compat_args.model_revision),
        tokenizer_name_or_path=resolve_pretrained(model_args.tokenizer_name_or_path, "--tokenizer_name_or_path"))
    lr, wd, notes = compat.resolve_optimizer(optim, read_ds_json(train_cfg.deepspeed_config),
                                             f"DeepSpeed config {train_cfg.deepspeed_config}")
    optim = dataclasses.replace(compat.trainer_defaults(optim), learning_rate=lr, weight_decay=wd)
    notices = compat.flag_notices(compat_args) + flag_notes + notes
    return (train_cfg, model_args, data_args, run_args, optim, compat_args), notices


def adjust_ds_config(sections: tuple, ds_config: dict) -> list[str]:
    """The resolved learning rate / weight decay and the --report_to monitors, written into the DeepSpeed config."""
    train_cfg, _, _, _, optim, compat_args = sections
    compat.resolve_optimizer(optim, ds_config, f"DeepSpeed config {resolve_ds_path(train_cfg.deepspeed_config)}")
    if optim.max_grad_norm is not None:  # Trainer's --max_grad_norm is DeepSpeed's gradient_clipping
        ds_config["gradient_clipping"] = optim.max_grad_norm
    return compat.apply_report_to(compat_args.report_to, ds_config, train_cfg.run_dir)


SPEC = RunSpec(types=(TrainConfig, ModelArgs, DataArgs, RunArgs, OptimArgs, CompatArgs),
               default_ds_config=DEFAULT_DS_CONFIG, optimizer_in_code=None,
               description="BridgeTower contrastive fine-tuning", resolve=resolve,
               trains=lambda sections: sections[3].do_train,  # RunArgs: an eval-only run writes no run
               adjust_ds_config=adjust_ds_config)


def main(argv=None) -> dict:
    run = start_run(SPEC, trainer_flags.expand_argv(sys.argv[1:] if argv is None else argv))
    train_cfg, model_args, data_args, run_args, optim, compat_args = run.settings
    dist, ds_config, micro = run.dist, run.ds_config, run.ds_config["train_micro_batch_size_per_gpu"]
    tokenizer = load_tokenizer(model_args, data_args.max_seq_length)
    image_size = int(load_config(model_args).vision_config.image_size)
    if data_args.image_size and data_args.image_size != image_size:
        raise ConfigError(f"--image_size {data_args.image_size} != the model's vision image_size {image_size}")
    # opened and split once (--train_file/--validation_file/--test_file, or the dataset); every evaluation reuses it
    splits = trainer_flags.open_files(compat_args, data_args, train_cfg.seed) or open_dataset(data_args, train_cfg.seed)

    def data(split: str, micro: int, shuffle: bool):
        return build_data(splits, split, tokenizer, image_size, dist.rank, dist.world_size, micro_batch=micro,
                          seed=train_cfg.seed, device=dist.device, shuffle=shuffle)

    if run_args.do_train:
        run = run.with_data(data("train", micro, shuffle=True))  # total optimizer steps, decided once
    per_epoch = trainer_flags.steps_per_epoch(len(run.data), ds_config["gradient_accumulation_steps"]) \
        if run.data is not None else 1
    eval_every = per_epoch if compat_args.eval_strategy == "epoch" else train_cfg.eval_every
    model = build_model(model_args)
    _announce(run, model, image_size)
    model.logit_scale_as_1d()  # DeepSpeed cannot broadcast 0-dim parameters
    frozen = keep_frozen_fp32(model, keep=dist.rank == 0)
    engine = build_engine(model, ds_config, **compat.engine_kwargs(model, optim, ds_config, optim.learning_rate,
                                                                   optim.weight_decay, run.total_steps or 1))
    # captions are padded to the batch's longest (unless --pad_to_max_length) and a micro batch loses its bad images:
    # shapes vary, so torch makes the varying sizes symbolic at the first change instead of compiling each shape
    compile_model(engine, train_cfg.compile, dynamic=None)
    evaluation = evaluation_for(run_args, eval_every,
                                lambda split: data(split, run_args.eval_micro_batch_size or micro, shuffle=False))
    seq_len = expected_padded_length(tokenizer, run.data.table.captions, micro, data_args.max_seq_length,
                                     run.data.pad_to_max) if run.data is not None else 0  # the data's padding
    name = Path(model_args.model_name_or_path).name if model_args.model_name_or_path else model_args.preset
    fps = flops_per_sample(model.config, seq_len, freeze_vision=model_args.freeze_vision_model,
                           freeze_text=model_args.freeze_text_model)
    # Trainer's files (trainer_state.json, training_args.bin) at the end and in every checkpoint-N
    files = trainer_files.TrainerFiles(run, per_epoch=per_epoch, eval_every=eval_every, flops_per_sample=fps,
                                       save_every=per_epoch if compat_args.save_strategy == "epoch"
                                       else train_cfg.num_steps_per_checkpoint)
    trainer = Trainer(run, engine, step_fn, model_name=f"bridgetower:{name}", seq_len=seq_len, evaluation=evaluation,
                      flops_per_sample=fps, save_every=files.save_every, epoch_of=files.epoch_of,
                      checkpoint_files=files.checkpoint)
    summary = trainer.fit()
    if run.data is not None:
        files.save_train_outputs(summary, evaluation.results, train_samples=len(run.data.table),
                                 monitor=getattr(engine, "monitor", None))
        run.data.close()
    elif "eval" in evaluation.results:  # run_bridgetower.py's name for the same file
        save_metrics(train_cfg.run_dir, "validation", evaluation.results["eval"], dist.rank, combined=False)
    _export(run, engine, frozen, tokenizer,
            compat.image_processor(compat_args.image_processor_name or model_args.model_name_or_path, image_size))
    results = {**evaluation.results.get("eval", {}), **evaluation.results.get("predict", {})}
    if dist.rank == 0 and results:
        print("[bridgetower] " + json.dumps(results), flush=True)
    shutdown_distributed()
    return {**summary, **results}


def _announce(run: Run, model, image_size: int) -> None:
    if run.dist.rank == 0:
        optim, data_args = run.section(OptimArgs), run.section(DataArgs)
        for line in run.notices:
            print(f"[bridgetower] {line}", flush=True)
        print(f"[bridgetower] {model_summary(model)}; images {image_size}px, captions <= {data_args.max_seq_length} "
              f"tokens; lr {optim.learning_rate}, weight decay {optim.weight_decay}", flush=True)


def _export(run: Run, engine, frozen: dict, tokenizer, processor) -> None:
    """Trainer.save_model into --output_dir after training; --export_dir as well (also without training), each with
    what run_bridgetower.py saves beside the model (tokenizer, image-processor config)."""
    def extras(d: Path) -> None:
        tokenizer.save_pretrained(str(d))
        processor.save_pretrained(str(d))

    export_dir = run.section(RunArgs).export_dir
    for out in ([run.train.run_dir] if run.data is not None else []) + ([export_dir] if export_dir else []):
        save_model(engine, out, frozen=frozen, extras=extras)


if __name__ == "__main__":
    run_main(main)  # ends without interpreter finalisation: see ds_core.process_end
