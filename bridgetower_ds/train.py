"""Fine-tune BridgeTower (contrastive) through ds_core: `deepspeed --num_gpus N --module bridgetower_ds.train ...`,
`deepspeed bridgetower_ds/train.py ...`, or `python -m bridgetower_ds.train ...` for one process.

optimum-habana's run_bridgetower.py command line is accepted as written (bridgetower_ds/trainer_flags.py says how);
results and the final model land in --output_dir (= --run_dir) as transformers' Trainer writes them."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import ds_configs
from bridgetower_ds import log, optim as bt_optim, trainer_files, trainer_flags
from bridgetower_ds.configs import BridgeTowerSettings
from bridgetower_ds.data import build_data, check_dataset, open_dataset
from bridgetower_ds.eval import evaluation_for
from bridgetower_ds.hub import check_model_dir, resolve_pretrained
from bridgetower_ds.image_pipeline import ImagePipeline
from bridgetower_ds.image_processor import image_processor
from bridgetower_ds.model import build_model, flops_per_sample, load_config, model_summary
from bridgetower_ds.step import step_fn
from bridgetower_ds.tokenizer import expected_padded_length, load_tokenizer
from ds_core.config import read_ds_json
from ds_core.errors import ConfigError
from ds_core.outputs.model_card import card_text, hub_id_of, optimizer_name, write_model_card
from ds_core.outputs.results import keep_frozen_fp32, save_metrics, save_model
from ds_core.rank.compile import compile_model
from ds_core.rank.dist import shutdown_distributed
from ds_core.rank.engine_build import build_engine
from ds_core.rank.process_end import run_main
from ds_core.run.setup import Run, RunSpec, start_run
from ds_core.run.trainer import Checkpointing, ModelInfo, Trainer

MODULE = "bridgetower_ds.train"
# bridgetower_ds's one default DeepSpeed JSON (ds_configs.DEFAULT_JSON). The optimizer is its "optimizer" section
# (AdamW) or, without one, AdamW built in code; learning rate and weight decay follow OptimArgs' rule either way
# (bridgetower_ds/optim.py).
DEFAULT_DS_CONFIG = ds_configs.preset_json(MODULE, "")


def resolve(cfg: BridgeTowerSettings) -> tuple[BridgeTowerSettings, list[str]]:
    """Before any rank starts: flags mapped or refused, hub ids looked up in the local cache, and the learning rate
    and weight decay resolved against the DeepSpeed JSON (OptimArgs' rule, bridgetower_ds/optim.py)."""
    task, optim, compat_args = cfg.task, cfg.optim, cfg.compat
    if not (task.do_train or task.do_eval or task.do_predict):
        raise ConfigError("nothing to do: pass at least one of --do_train, --do_eval, --do_predict")
    train_cfg = trainer_flags.check_flags(compat_args, cfg.train)
    train_cfg, model_args, data_args, flag_notes = trainer_flags.map_flags(compat_args, train_cfg, cfg.model,
                                                                           cfg.data, DEFAULT_DS_CONFIG,
                                                                           optim.max_grad_norm)
    if not (compat_args.train_file or compat_args.validation_file or compat_args.test_file):
        check_dataset(data_args)  # a dataset missing from the offline cache stops here, before any rank builds a model
    model_args = dataclasses.replace(
        model_args, model_name_or_path=resolve_pretrained(model_args.model_name_or_path,
                                                          revision=compat_args.model_revision),
        tokenizer_name_or_path=resolve_pretrained(model_args.tokenizer_name_or_path, "--tokenizer_name_or_path"))
    check_model_dir(model_args.model_name_or_path)
    ds_json, source = read_ds_json(train_cfg.deepspeed_config), f"DeepSpeed config {train_cfg.deepspeed_config}"
    optim, notes = bt_optim.decide(optim, ds_json, source)  # the one place lr, weight decay and defaults are decided
    notices = trainer_flags.flag_notices(compat_args) + flag_notes + notes
    return dataclasses.replace(cfg, train=train_cfg, model=model_args, data=data_args, optim=optim), notices


def adjust_ds_config(cfg: BridgeTowerSettings, ds_config: dict) -> list[str]:
    """The learning rate / weight decay decided in `resolve` and the --report_to monitors, written into the DeepSpeed
    config."""
    optim = cfg.optim
    bt_optim.write_decided(optim, ds_config)
    if optim.max_grad_norm is not None:  # Trainer's --max_grad_norm is DeepSpeed's gradient_clipping
        ds_config["gradient_clipping"] = optim.max_grad_norm
    return trainer_flags.apply_report_to(cfg.compat.report_to, ds_config, cfg.train.run_dir)


SPEC = RunSpec(settings=BridgeTowerSettings, default_ds_config=DEFAULT_DS_CONFIG, optimizer_in_code=None,
               description="BridgeTower contrastive fine-tuning", prog=f"python -m {MODULE}", resolve=resolve,
               trains=lambda cfg: cfg.task.do_train,  # an eval-only run writes no run
               adjust_ds_config=adjust_ds_config,
               model_config=lambda cfg: load_config(cfg.model))  # a Trainer-style JSON's ZeRO sizes


def main(argv=None) -> dict:
    run = start_run(SPEC, trainer_flags.expand_argv(sys.argv[1:] if argv is None else argv))
    cfg, micro = run.cfg, run.batch.micro
    sources = Sources.open(run)
    if cfg.task.do_train:
        run = run.with_data(sources.data("train", micro, shuffle=True))  # total optimizer steps, decided once
    per_epoch = trainer_flags.steps_per_epoch(len(run.data), run.batch.accumulation) if run.data is not None else 1
    eval_every = per_epoch if cfg.compat.eval_strategy == "epoch" else cfg.train.eval_every
    model, engine, frozen = _engine(run, sources.image_size)
    evaluation = evaluation_for(cfg.task, eval_every, lambda split: sources.data(
        split, cfg.task.eval_micro_batch(micro), shuffle=False))
    seq_len = expected_padded_length(sources.tokenizer, run.data.table.captions, micro, cfg.data.max_seq_length,
                                     run.data.pad_to_max) if run.data is not None else 0  # the data's padding
    fps = flops_per_sample(model.config, seq_len, freeze_vision=cfg.model.freeze_vision_model,
                           freeze_text=cfg.model.freeze_text_model)
    # Trainer's files (trainer_state.json, training_args.bin) at the end and in every checkpoint-N
    files = trainer_files.TrainerFiles(run, per_epoch=per_epoch, eval_every=eval_every, flops_per_sample=fps,
                                       save_every=per_epoch if cfg.compat.save_strategy == "epoch"
                                       else cfg.train.num_steps_per_checkpoint)
    summary = Trainer(run, engine, step_fn, ModelInfo(f"bridgetower:{_model_name(cfg.model)}", fps, seq_len),
                      evaluation=evaluation, checkpoints=Checkpointing(run, engine, every=files.save_every),
                      callbacks=[files]).fit()
    results = _outputs(run, engine, frozen, sources, files, summary, evaluation)
    shutdown_distributed()
    return {**summary, **results}


@dataclasses.dataclass(frozen=True)
class Sources:
    """What every split's data source is built from, opened and decided once: the tokenizer, the model's image size,
    the splits (--train_file/--validation_file/--test_file, or the dataset) and the image pipeline (--image_pipeline
    on this rank's device); every evaluation reuses them."""

    run: Run
    tokenizer: Any
    image_size: int
    splits: Any
    pipeline: ImagePipeline

    @classmethod
    def open(cls, run: Run) -> "Sources":
        cfg = run.cfg
        tokenizer = load_tokenizer(cfg.model, cfg.data.max_seq_length)
        image_size = int(load_config(cfg.model).vision_config.image_size)
        if cfg.data.image_size and cfg.data.image_size != image_size:
            raise ConfigError(f"--image_size {cfg.data.image_size} != the model's vision image_size {image_size}")
        seed = cfg.train.seed
        splits = trainer_flags.open_files(cfg.compat, cfg.data, seed) or open_dataset(cfg.data, seed)
        pipeline = ImagePipeline.resolve(cfg.data.requested_pipeline, run.dist.device, cfg.data.pipeline_flag)
        pipeline.announce(run.dist.rank)
        return cls(run, tokenizer, image_size, splits, pipeline)

    def data(self, split: str, micro: int, shuffle: bool):
        dist = self.run.dist
        return build_data(self.splits, split, self.tokenizer, self.image_size, dist.rank, dist.world_size,
                          micro_batch=micro, seed=self.run.train.seed, device=dist.device, shuffle=shuffle,
                          pipeline=self.pipeline)


def _model_name(model_args) -> str:
    return Path(model_args.model_name_or_path).name if model_args.model_name_or_path else model_args.preset


def _engine(run: Run, image_size: int) -> tuple[Any, Any, dict]:
    """(model, DeepSpeed engine, the frozen weights kept in fp32 for the export)."""
    optim, ds_config = run.cfg.optim, run.ds_config
    model = build_model(run.cfg.model)
    _announce(run, model, image_size)
    model.logit_scale_as_1d()  # DeepSpeed cannot broadcast 0-dim parameters
    frozen = keep_frozen_fp32(model, keep=run.dist.rank == 0)
    engine = build_engine(model, ds_config, **bt_optim.engine_kwargs(model, optim, ds_config, run.total_steps or 1))
    # captions are padded to the batch's longest (unless --pad_to_max_length) and a micro batch loses its bad images:
    # shapes vary, so torch makes the varying sizes symbolic at the first change instead of compiling each shape
    compile_model(engine, run.train.compile, dynamic=None)
    return model, engine, frozen


def _outputs(run: Run, engine, frozen: dict, sources: Sources, files, summary: dict, evaluation) -> dict:
    """What run_bridgetower.py leaves after the run: results files, Trainer's files, the saved model; the evaluation
    results (printed on rank 0)."""
    cfg, dist = run.cfg, run.dist
    if run.data is not None:
        files.save_train_outputs(summary, evaluation.results, train_samples=len(run.data.table),
                                 monitor=getattr(engine, "monitor", None))
        run.data.close()
    elif "eval" in evaluation.results:  # run_bridgetower.py's name for the same file
        save_metrics(cfg.train.run_dir, "validation", evaluation.results["eval"], dist.rank, combined=False)
    _export(run, engine, frozen, sources.tokenizer,
            image_processor(cfg.compat.image_processor_name or cfg.model.model_name_or_path,
                            sources.image_size))
    results = {**evaluation.results.get("eval", {}), **evaluation.results.get("predict", {})}
    if results:
        log.say(json.dumps(results))
    return results


def _announce(run: Run, model, image_size: int) -> None:
    optim, data_args = run.cfg.optim, run.cfg.data
    for line in run.notices:
        log.say(line)
    log.say(f"{model_summary(model)}; images {image_size}px, captions <= {data_args.max_seq_length} tokens; "
            f"lr {optim.learning_rate}, weight decay {optim.weight_decay}")


def _export(run: Run, engine, frozen: dict, tokenizer, processor) -> None:
    """Trainer.save_model into --output_dir after training (unless --save_model false); --export_dir as well (also
    without training), each with what run_bridgetower.py saves beside the model (tokenizer, image-processor config)."""
    cfg = run.cfg

    def extras(d: Path) -> None:
        tokenizer.save_pretrained(str(d))
        processor.save_pretrained(str(d))
        # trainer.create_model_card(**kwargs), as run_bridgetower.py ends: its arguments, the run's settings and
        # results (nothing looked up on the hub)
        name, config_name = cfg.data.dataset_name or None, cfg.data.dataset_config_name or None
        write_model_card(d, card_text(
            run, optimizer=optimizer_name(engine, run.ds_config), model_name=Path(cfg.train.run_dir).name,
            finetuned_from=hub_id_of(cfg.model.model_name_or_path), tasks="contrastive-image-text-modeling",
            dataset=f"{name} {config_name}" if name and config_name else name, dataset_tags=name,
            dataset_args=config_name if name else None, eval_batch_size=cfg.task.eval_micro_batch(run.batch.micro),
            steps_per_epoch=trainer_flags.steps_per_epoch(len(run.data), run.batch.accumulation)
            if run.data is not None else 1))

    export_dir, trained = run.cfg.task.export_dir, run.data is not None and run.cfg.task.save_model
    for out in ([run.train.run_dir] if trained else []) + ([export_dir] if export_dir else []):
        save_model(engine, out, frozen=frozen, extras=extras)


if __name__ == "__main__":
    run_main(main)  # ends without interpreter finalisation: see ds_core.rank.process_end
