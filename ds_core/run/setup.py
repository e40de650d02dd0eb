"""One run set-up for every entry point: start_run parses, validates, prepares the run directory, starts the process
group, seeds, resolves the DeepSpeed config and plans a resize, and returns ONE frozen Run. The total optimizer steps
depend on the training data, which the model package builds with the run's numbers: `run.with_data(data)` decides them,
once (a second call is refused), before the engine and its LR schedule are built. Nothing edits the settings after
start_run returns; the LR schedule and ds_core.run.trainer.Trainer read the same `run.total_steps`.

A model package describes itself with a RunSpec: its settings tree, its default DeepSpeed JSON, and two hooks
(resolve its settings before any rank starts; add its own values to the resolved DeepSpeed config).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from ds_core.checkpoint import select_resume_tag
from ds_core.checkpoint.resize import ResizePlan, plan_resize
from ds_core.compat import changes
from ds_core.config import (
    Batch,
    TrainConfig,
    ds_config_for,
    parse_settings,
    precision_of,
    read_ds_json,
    resolve_ds_path,
    save_run_config,
    sections_of,
    trainer_json,
)
from ds_core.config.ds_json import check_ds_json
from ds_core.config.launch_forms import from_accelerate
from ds_core.config.optim import OptimArgs
from ds_core.config.trainer_json import TrainerArgs
from ds_core.errors import ConfigError
from ds_core.rank.dist import DistInfo, init_distributed, set_seed
from ds_core.run.run_dir import prepare_run_dir
from ds_core.schedule import total_optimizer_steps

T = TypeVar("T")


@dataclass(frozen=True)
class RunSpec:
    """What a model package tells start_run. `settings` is its settings tree: a frozen dataclass whose fields are the
    settings sections (ds_core.config.parse_settings), one of them `train: TrainConfig`."""

    settings: type
    # the DeepSpeed JSON when --deepspeed_config is not given: a file name in ds_configs/, or cfg -> that name (a model
    # whose presets each bring their own), raising ConfigError where the settings have none
    default_ds_config: str | Callable[[Any], str]
    optimizer_in_code: bool | None  # ds_core.config.ds_json.check_ds_json: True, False, or None (either)
    description: str | None = None
    prog: str | None = None  # the command --help and errors name, e.g. "python -m bert_ref.train"
    # cfg -> (cfg, notices), before any rank starts (presets resolved, paths looked up, flags mapped): a new tree
    # (dataclasses.replace), the parsed one is frozen; notices are one-line messages for rank 0
    resolve: Callable[[Any], tuple[Any, list[str]]] | None = None
    # (cfg, batch) -> None, raising ConfigError: a check of the batch numbers the model's settings depend on (a
    # published recipe's global batch)
    check_batch: Callable[[Any, Batch], None] | None = None
    # cfg -> whether this run trains (an eval-only run leaves run_dir as it is: nothing of a run is written)
    trains: Callable[[Any], bool] = lambda cfg: True
    # (cfg, ds_config) -> notices: the model's own values written into the resolved DeepSpeed config (a copy)
    adjust_ds_config: Callable[[Any, dict], list[str]] | None = None
    # cfg -> the model's transformers config, for a Trainer-style JSON's ZeRO sizes that Trainer derives from the
    # hidden size (ds_core.config.trainer_json); called only when the JSON asks for them with "auto"
    model_config: Callable[[Any], Any] | None = None
    # why the optimizer and LR schedule are built in code (optimizer_in_code True), for the refusal of a JSON section
    why_in_code: str = ""


@dataclass(frozen=True)
class LoopSettings:
    """The settings tree of a run with the loop's settings only (benchmarks and tests that drive the Trainer
    without a model package's sections)."""

    train: TrainConfig


@dataclass(frozen=True)
class Run:
    """Everything decided before the model is built. Frozen: `cfg` is the settings tree (frozen dataclasses, read by
    name: run.cfg.train, run.cfg.optim, ...), `batch` the batch numbers decided once from the resolved DeepSpeed
    config, which is parsed once and handed out as a fresh copy (`ds_config`: DeepSpeed may edit what it is given)."""

    cfg: Any
    dist: DistInfo
    resolved_ds_config: dict = field(repr=False)
    batch: Batch
    resize: ResizePlan | None = None
    resume_tag: str | None = None  # the checkpoint --resume loads (ds_core.checkpoint.select_resume_tag), or None
    total_steps: int = 0  # optimizer steps of this run (its LR schedule and the trainer's end): with_data decides
    data: Any = None  # the training data source (None when the run does not train): with_data sets it
    notices: tuple[str, ...] = field(default_factory=tuple)
    precision: str = "fp32"  # the compute dtype the resolved DeepSpeed config runs: bf16, fp16 or fp32 (Run.of decides)
    # a Trainer-style JSON's flag values (ds_core.config.trainer_json): the scheduler's steps it leaves "auto" until
    # with_data knows them; None for a JSON without "auto"
    trainer_args: TrainerArgs | None = field(default=None, repr=False)

    @classmethod
    def of(cls, cfg: Any, dist: DistInfo, ds_config: dict, **kw: Any) -> "Run":
        """A run of a resolved DeepSpeed config whose batch numbers and precision are decided here (start_run's own
        way)."""
        return cls(cfg, dist, ds_config, Batch.of(ds_config, dist.world_size), precision=precision_of(ds_config), **kw)

    @property
    def train(self) -> TrainConfig:
        return self.cfg.train

    @property
    def ds_config(self) -> dict:
        return copy.deepcopy(self.resolved_ds_config)

    def with_data(self, data: Any) -> "Run":
        """The run with its training data and the total optimizer steps decided from it (len(data): micro batches
        per epoch on this rank), the one decision the LR schedule and the trainer share. Called once."""
        if self.data is not None:
            raise RuntimeError("Run.with_data: this run already has its data and total steps")
        total = decide_total_steps(self.train, len(data), self.batch.accumulation, self.dist.rank)
        return dataclasses.replace(self, data=data, total_steps=total,
                                   resolved_ds_config=self.steps_filled(self.resolved_ds_config, total))

    def steps_filled(self, ds_config: dict, total_steps: int) -> dict:
        """A Trainer-style JSON's scheduler steps filled from the run's optimizer steps, as Trainer fills them."""
        if self.trainer_args is None:
            return ds_config
        source = f"DeepSpeed config {resolve_ds_path(self.train.deepspeed_config)}"
        filled = trainer_json.fill_steps(ds_config, self.trainer_args, total_steps, source)
        trainer_json.refuse_unfilled(filled, source)
        return filled

    def section(self, cls: type[T]) -> T:
        """The settings section of type `cls` (for code that serves several models' trees, e.g. TrainConfig)."""
        for s in sections_of(self.cfg):
            if isinstance(s, cls):
                return s
        raise KeyError(f"run settings have no {cls.__name__} section")


@dataclass(frozen=True)
class TrainerFill:
    """A Trainer-style DeepSpeed JSON of a run (ds_core.config.trainer_json) and what fills it: the file's contents,
    the flags as given and the model's defaults, and the model's config for the hidden-size keys."""

    raw: dict
    source: str
    flags: trainer_json.GivenFlags
    model_config: Any

    @classmethod
    def of(cls, spec: RunSpec, given: Any, cfg: Any) -> "TrainerFill | None":
        """None for a JSON without "auto" (DeepSpeed's own form: the flags override it, load_ds_config)."""
        raw = read_ds_json(cfg.train.deepspeed_config)
        if not trainer_json.is_trainer_style(raw):
            return None
        source = f"DeepSpeed config {resolve_ds_path(cfg.train.deepspeed_config)}"
        model_config = None
        if any(k.startswith("zero_optimization.") for k in trainer_json.auto_keys(raw)):
            if spec.model_config is None:
                raise ConfigError(f"{source}: the ZeRO sizes Trainer derives from the model's hidden size are "
                                  f"\"auto\", and this entry point does not know its model's hidden size: give numbers")
            model_config = spec.model_config(cfg)
        flags = trainer_json.flags_of(given.train, _optim_of(given), _optim_of(cfg))
        return cls(raw, source, flags, model_config)

    def args(self, world_size: int) -> trainer_json.TrainerArgs:
        return self.flags.args_for(self.raw, world_size)

    def ds_json(self, world_size: int) -> dict:
        """The JSON with everything Trainer fills before the optimizer steps are known (a contradicted value refused,
        naming the key and the flag); the scheduler's steps stay "auto" until Run.with_data."""
        args = self.args(world_size)
        out = trainer_json.fill_from_flags(self.raw, args, self.source)
        return trainer_json.fill_hidden_size(out, args, self.model_config, self.source)


def _optim_of(cfg: Any) -> Any:
    """The settings tree's OptimArgs section, or None."""
    return next((s for s in sections_of(cfg) if isinstance(s, OptimArgs)), None)


def world_size_from_env() -> int:
    """The world size a launcher gave this process before the process group exists (torchrun / DeepSpeed's
    WORLD_SIZE, MPI's), 1 for a process started by hand (init_distributed makes that a world of one)."""
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def decide_total_steps(train: TrainConfig, micro_batches_per_epoch: int, grad_accum: int, rank: int = 0) -> int:
    """The one decision of how many optimizer steps a run takes (ds_core.schedule.total_optimizer_steps), refused
    when the data makes none."""
    total = total_optimizer_steps(train.max_steps, train.max_epochs, micro_batches_per_epoch, grad_accum)
    if total < 1:
        raise ConfigError(f"{micro_batches_per_epoch} micro batches per epoch on rank {rank} x {train.max_epochs} "
                          f"epoch(s) make no optimizer step of {grad_accum} accumulated micro batches")
    return total


def start_run(spec: RunSpec, argv: Sequence[str] | None = None) -> Run:
    """Parse and resolve the settings, then start this rank: see the module docstring. Every rank calls it."""
    # what `accelerate launch` set for this rank, as flags (ds_core.config.launch_forms); parsed, sections validated
    argv = from_accelerate(sys.argv[1:] if argv is None else argv, os.environ)
    cfg = parse_settings(spec.settings, argv, description=spec.description, prog=spec.prog)
    default = spec.default_ds_config(cfg) if callable(spec.default_ds_config) else spec.default_ds_config
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, deepspeed_config=cfg.train.deepspeed_config or default))
    given = cfg  # the flags as given, before the model fills its defaults (a Trainer-style JSON compares with them)
    notices: list[str] = []
    if spec.resolve is not None:
        cfg, notices = spec.resolve(cfg)
        notices = list(notices)
    train = cfg.train
    filled = TrainerFill.of(spec, given, cfg)  # a Trainer-style JSON's "auto"s, from the flags (None: none)
    # before distributed init: the JSON as this run fills it, on the world size the launcher gave
    check_ds_json(train.deepspeed_config, optimizer_in_code=spec.optimizer_in_code, why_in_code=spec.why_in_code,
                  cfg=filled.ds_json(world_size_from_env()) if filled else None)
    if spec.trains(cfg):
        prepare_run_dir(train)  # a used run_dir is refused (or moved aside) before any rank starts
    changes.configure(train.ds_changes)  # --ds_changes: which changes inside DeepSpeed apply (and in child processes)
    dist = init_distributed(train.dist_timeout_s)
    set_seed(train.seed)
    # --resume: the newest checkpoint whose files verify on every rank, agreed before anything is loaded or printed
    resume_tag = select_resume_tag(Path(train.run_dir) / "checkpoints", train.resume_strict) if train.resume else None
    ds_config = ds_config_for(train, dist.world_size, ds_json=filled.ds_json(dist.world_size) if filled else None)
    resize = plan_resize(train, ds_config, dist.world_size)  # --resume onto another world size
    if resize is not None:
        ds_config = resize.ds_config(ds_config)
    if spec.adjust_ds_config is not None:
        notices += spec.adjust_ds_config(cfg, ds_config)
    run = Run.of(cfg, dist, ds_config, resize=resize, resume_tag=resume_tag, notices=tuple(notices),
                 trainer_args=filled.args(dist.world_size) if filled else None)
    if filled and not spec.trains(cfg):  # no data, no schedule to step: the scheduler's steps are a placeholder
        run = dataclasses.replace(run, resolved_ds_config=run.steps_filled(run.resolved_ds_config, 1))
    if spec.check_batch is not None:
        spec.check_batch(cfg, run.batch)
    save_run_config(train.run_dir, *sections_of(cfg), rank=dist.rank)
    return run


__all__ = ["RunSpec", "LoopSettings", "Run", "start_run", "decide_total_steps"]
