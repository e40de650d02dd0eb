"""Typed run config, CLI + JSON parsing, and DeepSpeed JSON validation with batch arithmetic.

One place decides every number of a run before any rank does work: our own settings live in dataclasses (one help
line per field), DeepSpeed's settings live in the DeepSpeed JSON only, and the three batch numbers are checked against
the data-parallel world size here (llm-foundry's validate_config, HF's HfArgumentParser).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, TypeVar

from ds_core import log
from ds_core.config.accumulation import settle_grad_accum_dtype  # noqa: F401 - part of ds_core.config's API
from ds_core.errors import ConfigError
from ds_core.files import atomic_write_text
from ds_core.redact import dropped_placeholders, redact_mapping

T = TypeVar("T")

DS_CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
# No default DeepSpeed JSON here: each model package declares its own (bert_ref.train, bridgetower_ds.train), because
# whether the JSON may hold an "optimizer" section depends on whether the model builds its optimizer in code.


def arg(text: str, *, aliases: Sequence[str] = (), **kw: Any) -> Any:
    """A dataclass field with its one-line help (HfArgumentParser shows it in --help).

    aliases: other flag names for the same setting (HfArgumentParser's "aliases" metadata), e.g. transformers'
    `--output_dir` for `--run_dir`: one setting, two spellings, no second parser. A flag that sets a field to a
    fixed value (`--bf16` -> precision "bf16", `--bf16 false` -> "fp32") goes in the class attribute
    FLAG_CONSTS = {"--bf16": ("precision", "bf16", "fp32")} (HfArgumentParser hands every metadata key to argparse,
    so it cannot live in the field's metadata)."""
    metadata: dict[str, Any] = {"help": text}
    if aliases:
        metadata["aliases"] = list(aliases)
    return field(metadata=metadata, **kw)


@dataclass(frozen=True)
class TrainConfig:
    """Settings of the training loop shared by every model (DeepSpeed's own settings stay in the DeepSpeed JSON)."""

    # transformers' `--bf16` is `--precision bf16` (a class attribute, not a field: parse_args reads it)
    FLAG_CONSTS = {"--bf16": ("precision", "bf16", "fp32")}

    run_dir: str = arg("Output directory: run_config.json, ds_config.json, metrics.jsonl, checkpoints/.",
                         default="runs/default", aliases=["--output_dir"])
    deepspeed_config: str = arg("DeepSpeed JSON (path, or a file name inside ds_configs/).", default="",
                                aliases=["--deepspeed"])  # transformers' TrainingArguments.deepspeed
    max_steps: int = arg("Optimizer steps to run; 0 runs max_epochs.", default=0)
    max_epochs: int = arg("Epochs to run when max_steps is 0 (max_steps, when set, wins and cycles the data).",
                          default=1, aliases=["--num_train_epochs"])
    num_steps_per_checkpoint: int = arg("Save a checkpoint every N optimizer steps; 0 saves none periodically.",
                                          default=0, aliases=["--save_steps"])
    save_final_checkpoint: bool = arg("Save a checkpoint when training ends.", default=True)
    resume: bool = arg("Resume from the latest complete checkpoint in run_dir/checkpoints.", default=False)
    # transformers' TrainingArguments.resume_from_checkpoint: `--resume_from_checkpoint` alone is "latest" (nargs ?)
    resume_from_checkpoint: str = field(default="", metadata={
        "help": "--resume, as transformers' Trainer spells it: no value, 'latest' or True -> the newest complete "
                "checkpoint of --run_dir; or a path to it (checkpoint-N, checkpoints/global_stepN, the run directory)",
        "nargs": "?", "const": "latest"})
    resume_strict: bool = arg("With --resume: refuse a checkpoint that fails verification (its manifest's sizes and "
                              "checksums) instead of falling back to the newest one that verifies.", default=False)
    overwrite_run_dir: bool = arg("Start afresh in a run_dir that holds checkpoints or metrics: its contents are moved "
                                  "aside to a dated sibling folder (never deleted).", default=False,
                                  aliases=["--overwrite_output_dir"])
    save_total_limit: int = arg("Keep only the newest K complete checkpoints (never the one `latest` names); "
                                "0 keeps all.", default=0)  # same name as transformers' TrainingArguments
    on_resize: str = arg("--resume onto another data-parallel size: keep_batch keeps the global batch by recomputing "
                         "gradient accumulation (refused when it does not divide); scale_lr keeps micro batch and "
                         "accumulation and scales the LR by new/old global batch (ds_core.checkpoint.resize).",
                         default="keep_batch")
    max_steps_this_run: int = arg("Stop this process after N optimizer steps: save a checkpoint and exit with status "
                                  "75 (resume with --resume); 0 runs to max_steps.", default=0)
    max_skipped_steps: int = arg("Stop the run (non-zero exit, `latest` kept) after more than N consecutive optimizer "
                                 "steps skipped for a non-finite gradient norm.", default=5)
    loss_spike_factor: float = arg("Stop the run when a step's loss exceeds this factor times the median loss of the "
                                   "last 20 steps (0: off).", default=10.0)
    log_every: int = arg("Write a metrics record every N optimizer steps.", default=1, aliases=["--logging_steps"])
    eval_every: int = arg("Run the eval hook every N optimizer steps; 0 runs it once at the end.", default=0)
    throughput_warmup_steps: int = arg("Optimizer steps excluded from throughput (compilation, caches).",
                                         default=3)
    profile_steps: int = arg("torch.profiler over the last N warm-up steps before the throughput window (one untimed "
                             "step after them): aten ops and host syncs per step, the 10 kernels with the most "
                             "device time, the device's idle share, in that step's metrics record under \"profile\" "
                             "(ds_core.outputs.profile); needs throughput_warmup_steps >= N + 2. 0: off.", default=0)
    phase_timing_every: int = arg("Time the phases of every N-th optimizer step (data, forward, backward, exposed "
                                  "communication, optimizer step, wait for the slowest rank: ds_core.outputs.phases); "
                                  "0 turns it off.", default=10)
    seed: int = arg("Seed for python, numpy and torch.", default=42)
    micro_batch_size: int = arg("Override train_micro_batch_size_per_gpu of the DeepSpeed JSON; 0 keeps it. A JSON "
                                "that fixes train_batch_size (and no gradient_accumulation_steps) keeps its global "
                                "batch: the accumulation follows.", default=0,
                                aliases=["--per_device_train_batch_size"])
    gradient_accumulation_steps: int = arg("Override gradient_accumulation_steps of the DeepSpeed JSON; 0 keeps it.",
                                             default=0)
    zero_stage: int = arg("Override zero_optimization.stage of the DeepSpeed JSON; -1 keeps it.", default=-1)
    dist_timeout_s: int = arg("Collective timeout in seconds: a dead rank makes the others fail after this.",
                                default=1800, aliases=["--ddp_timeout"])
    progress_bar: bool = arg("Show a rank-0 tqdm progress bar.", default=True)
    precision: str = arg("Compute dtype: auto (bf16 on CUDA/HPU and on CPUs with native bf16, else fp32), bf16 or "
                         "fp32; switches the DeepSpeed JSON's bf16 section (ds_core.device.precision).", default="auto")
    compile: str = arg("torch.compile the model's forward through DeepSpeed's engine.compile, with the accelerator's "
                       "backend (inductor; hpu_backend on Gaudi): on, off, or auto (on where the model measured its "
                       "compiled step faster, BERT on CUDA, and on Gaudi in eager mode as Habana recommends; "
                       "docs/compile.md).", default="auto")
    ds_changes: str = arg("The toolkit's changes inside DeepSpeed (ds_core.compat.changes): on (each where the "
                          "installed DeepSpeed has and needs it), off (DeepSpeed's own path throughout) or "
                          "off:NAME[,NAME...]; empty keeps the environment's DS_TOOLKIT_CHANGES. The run's summary "
                          "lists each change's state.", default="")

    def validate(self) -> None:
        checks = [
            ("max_steps", self.max_steps >= 0, ">= 0"),
            ("max_epochs", self.max_epochs >= 1 or self.max_steps > 0, ">= 1 when max_steps is 0"),
            ("num_steps_per_checkpoint", self.num_steps_per_checkpoint >= 0, ">= 0"),
            ("log_every", self.log_every >= 1, ">= 1"),
            ("max_skipped_steps", self.max_skipped_steps >= 0, ">= 0"),
            ("loss_spike_factor", self.loss_spike_factor == 0 or self.loss_spike_factor > 1, "0 (off) or > 1"),
            ("eval_every", self.eval_every >= 0, ">= 0"),
            ("throughput_warmup_steps", self.throughput_warmup_steps >= 0, ">= 0"),
            ("profile_steps", self.profile_steps == 0 or 0 < self.profile_steps <= self.throughput_warmup_steps - 2,
             f"0, or at most throughput_warmup_steps - 2 ({self.throughput_warmup_steps - 2}): the profiled steps and "
             "one untimed step after them come out of the warm-up"),
            ("micro_batch_size", self.micro_batch_size >= 0, ">= 0"),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps >= 0, ">= 0"),
            ("zero_stage", self.zero_stage in (-1, 0, 1, 2, 3), "one of -1, 0, 1, 2, 3"),
            ("dist_timeout_s", self.dist_timeout_s > 0, "> 0"),
            ("precision", self.precision in ("auto", "bf16", "fp32"), "one of auto, bf16, fp32"),
            ("compile", self.compile in ("auto", "on", "off"), "one of auto, on, off"),
            ("save_total_limit", self.save_total_limit >= 0, ">= 0"),
            ("max_steps_this_run", self.max_steps_this_run >= 0, ">= 0"),
            ("on_resize", self.on_resize in ("keep_batch", "scale_lr"), "one of keep_batch, scale_lr"),
            ("overwrite_run_dir", not (self.overwrite_run_dir and self.resume),
             "not together with --resume (resume continues the run in run_dir, overwrite moves it aside)"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ConfigError(f"TrainConfig.{name} = {getattr(self, name)!r}: expected {expected}")
        if self.ds_changes:
            from ds_core.compat.changes import parse_switch

            parse_switch(self.ds_changes, "TrainConfig.ds_changes (--ds_changes)")


# ---------------------------------------------------------------------------------------------------------------
# CLI and JSON


def _flatten_json(data: dict, types: Sequence[type], source: str) -> dict:
    """Accept flat keys or sections named after the dataclasses ({"TrainConfig": {...}}, as save_run_config writes)."""
    names = {t.__name__ for t in types}
    # a field's other spellings (arg(aliases=...)) name it in a JSON file too, e.g. an older run's
    # "warmup_proportion" for OptimArgs.warmup_ratio
    alias_of = {a.lstrip("-"): f.name for t in types for f in dataclasses.fields(t)
                for a in f.metadata.get("aliases", ())}
    flat: dict = {}
    for key, value in data.items():
        if key in names and isinstance(value, dict):
            flat.update({alias_of.get(k, k): v for k, v in value.items()})
        else:
            flat[alias_of.get(key, key)] = value
    known = {f.name for t in types for f in dataclasses.fields(t)}
    unknown = sorted(set(flat) - known)
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, known, 1)) else "")
                 for k in unknown]
        raise ConfigError(f"{source}: unknown key(s) {', '.join(hints)}; known keys: {', '.join(sorted(known))}")
    return flat


def settings_parser(types: Sequence[type], description: str | None, prog: str | None):
    """HfArgumentParser over the settings dataclasses, as a user reads it: usage names the command (`python -m
    bert_ref.train`, not the file), each `--no_X` says that it turns X off, and a bad value is a ConfigError (one
    line from one rank: ds_core.rank.process_end.run_main) instead of argparse's usage block and exit on every rank."""
    from transformers import HfArgumentParser

    # allow_abbrev=False: a prefix is never taken for a longer flag (`--use_hpu_graphs` is not
    # `--use_hpu_graphs_for_inference`, `--deepspeed` is not ambiguous)
    parser = HfArgumentParser(list(types), prog=prog, description=description, allow_abbrev=False)

    def refuse(message: str) -> None:
        raise ConfigError(message)

    parser.error = refuse  # argparse's own check of a value (`--max_steps x`): the message names flag and value
    positive = {a.dest: a for a in parser._actions if a.option_strings and a.option_strings[0].startswith("--")  # noqa: SLF001
                and not a.option_strings[0].startswith("--no_")}
    for action in parser._actions:  # noqa: SLF001 (argparse lists its actions nowhere public)
        # argparse %-formats every help string; a field's help is plain text ("40 % of train"), so escape it once here
        if action.help:
            action.help = action.help.replace("%", "%%")
        # HfArgumentParser gives `--no_X` the help of X and a default of False: say what "no" does instead
        if action.option_strings and action.option_strings[0].startswith("--no_") and action.dest in positive:
            action.help = f"Turns {positive[action.dest].option_strings[0]} off (the same as " \
                          f"{positive[action.dest].option_strings[0]} false)."
            action.default = argparse.SUPPRESS  # the default is X's, shown there
    return parser


class _BoolConst(argparse.Action):
    """A FLAG_CONSTS flag in the forms HfArgumentParser gives a bool field (`--bf16`, `--bf16 True`, `--bf16 false`):
    const = (the field's value when true, when false); the word is read by transformers' own string_to_bool."""

    def __call__(self, parser, namespace, values, option_string=None):
        from transformers.hf_argparser import string_to_bool

        on, off = self.const
        try:
            # `--bf16` alone: argparse hands nargs='?' its const
            setting = True if values is None or values is self.const else string_to_bool(values)
        except argparse.ArgumentTypeError:
            raise ConfigError(f"{option_string} {values}: expected nothing, or a boolean (true/false, yes/no, 1/0)") \
                from None
        setattr(namespace, self.dest, on if setting else off)


def parse_args(types: Sequence[type], argv: Sequence[str] | None = None, description: str | None = None,
               prog: str | None = None) -> tuple:
    """Parse dataclass types from `--config FILE.json` (defaults) and flags (overrides); one instance per type.

    Launchers add `--local_rank=N`; it is accepted and ignored (LOCAL_RANK from the environment is what counts).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = settings_parser(types, description, prog)
    if "--deepspeed" in parser._option_string_actions:  # noqa: SLF001 - DeepSpeed's bare switch beside the alias
        from ds_core.config.launch_forms import drop_deepspeed_switch

        argv = drop_deepspeed_switch(argv)
    parser.add_argument("--config", default=None, help="JSON file of settings (flat, or sectioned by class name), "
                                                       "or a run directory (its run_config.json); flags given on the "
                                                       "command line override it.")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="Set by launchers; ignored.")
    for t in types:  # flags that set a field to a fixed value (FLAG_CONSTS), writing the field's own dest
        for flag, (name, value, off) in getattr(t, "FLAG_CONSTS", {}).items():
            parser.add_argument(flag, dest=name, nargs="?", metavar="BOOL", action=_BoolConst, const=(value, off),
                                help=f"same as --{name} {value} (`{flag}`, `{flag} true`; `{flag} false`: "
                                     f"--{name} {off}), as transformers' TrainingArguments takes it")
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        path = config_file(pre.config)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"--config {path}: file not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object of settings, got {type(data).__name__}")
        # a setting redacted when run_config.json was written keeps its default, not the placeholder
        parser.set_defaults(**dropped_placeholders(_flatten_json(data, types, str(path))))
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        known = [a for act in parser._actions for a in act.option_strings if "-" not in a.lstrip("-")]
        # a value right after an unknown flag is that flag's value, not a second unknown argument
        flags = [u for i, u in enumerate(unknown) if u.startswith("-") or i == 0 or not unknown[i - 1].startswith("-")]
        raise ConfigError(f"unknown command-line argument(s): {', '.join(_flag_hint(u, known) for u in flags)}")
    out = []
    values = vars(ns)
    for t in types:
        inst = t(**{f.name: values[f.name] for f in dataclasses.fields(t) if f.init})
        if hasattr(inst, "validate"):
            inst.validate()
        out.append(inst)
    return tuple(out)


def section_types(tree: type) -> dict[str, type]:
    """The sections of a settings tree (a frozen dataclass whose fields are settings dataclasses), by field name."""
    hints = typing.get_type_hints(tree)
    return {f.name: hints[f.name] for f in dataclasses.fields(tree)}


def sections_of(cfg: Any) -> list:
    """The section instances of a settings tree, in field order (what save_run_config writes, by class name)."""
    return [getattr(cfg, f.name) for f in dataclasses.fields(cfg)]


def parse_settings(tree: type[T], argv: Sequence[str] | None = None, description: str | None = None,
                   prog: str | None = None) -> T:
    """One settings tree from flags and `--config FILE.json` (parse_args, one section per field of `tree`): a run
    reads a setting by name, `cfg.train.max_steps`, never by position. The JSON format is parse_args': flat, or
    sectioned by class name, as run_config.json is written (so files written before the tree existed still load)."""
    types = section_types(tree)
    sections = parse_args(list(types.values()), argv, description=description, prog=prog)
    return tree(**dict(zip(types, sections)))


def _flag_hint(given: str, known: Sequence[str]) -> str:
    """'--flag' plus a hint only when one is close (ratio >= 0.8: '--learning_rte' -> '--learning_rate', but
    '--eval_strategy' is not offered '--save_strategy'); a transformers TrainingArguments flag that this toolkit does
    not take is named as such rather than matched to an unrelated setting."""
    flag = given.split("=")[0]
    if not flag.startswith("--"):
        return repr(given)
    try:
        from transformers import TrainingArguments

        trainer_flags = {f"--{f.name}" for f in dataclasses.fields(TrainingArguments)}
    except ImportError:  # pragma: no cover - transformers is a dependency
        trainer_flags = set()
    m = difflib.get_close_matches(flag, known, 1, cutoff=0.8)
    if m and (flag not in trainer_flags or m[0] == flag):
        return f"{given!r} (did you mean {m[0]!r}?)"
    if flag in trainer_flags:
        return f"{given!r} (a transformers TrainingArguments flag that this toolkit does not take)"
    return repr(given)


# The file a run writes its resolved settings to. Not config.json: BridgeTower's run_dir also receives the saved model,
# whose own config.json is the model's. OLD_RUN_CONFIG is what bert_ref runs wrote before; --config still reads it.
RUN_CONFIG = "run_config.json"
OLD_RUN_CONFIG = "config.json"


def config_file(given: str | os.PathLike) -> Path:
    """--config's file: the path itself, or for a run directory its run_config.json (config.json in a run directory
    written before the rename)."""
    path = Path(given)
    if not path.is_dir():
        return path
    for name in (RUN_CONFIG, OLD_RUN_CONFIG):
        if (path / name).is_file():
            return path / name
    raise ConfigError(f"--config {path}: a directory without {RUN_CONFIG} (or {OLD_RUN_CONFIG} of an older run); "
                      f"expected a settings JSON file or a run directory")


def save_run_config(run_dir: str | os.PathLike, *instances: Any, rank: int = 0) -> Path:
    """Write run_dir/run_config.json, sectioned by dataclass name (rank 0 only); it reads back with --config."""
    path = Path(run_dir) / RUN_CONFIG
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a secret-looking setting (--token) is written as ds_core.redact.REDACTED: never on disk
        data = redact_mapping({type(i).__name__: dataclasses.asdict(i) for i in instances})
        atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed JSON

# Top-level keys DeepSpeed 0.19 reads (recorded by handing DeepSpeedConfig a dict that logs every lookup) plus the
# documented sections it reads elsewhere (optimizer, scheduler, flops_profiler, activation_checkpointing, ...).
# DeepSpeed silently ignores unknown keys, so a typo such as "zero_optimisation" would silently train with ZeRO-0;
# we refuse it instead.
DS_TOP_LEVEL_KEYS = frozenset("""
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer scheduler fp16 bf16 bfloat16
amp gradient_clipping prescale_gradients gradient_predivide_factor gradient_allreduce_op sparse_gradients
zero_optimization zero_allow_untested_optimizer zero_force_ds_cpu_optimizer steps_per_print wall_clock_breakdown
dump_state flops_profiler activation_checkpointing sparse_attention data_efficiency curriculum_learning tensorboard
csv_monitor wandb comet aim elasticity communication_data_type seq_parallel_communication_data_type autotuning
compression_training checkpoint data_types memory_breakdown disable_allgather dataloader_drop_last nebula pipeline
compile torch_autocast weight_quantization hybrid_engine timers eigenvalue progressive_layer_drop quantize_training
use_data_before_expert_parallelism graph_harvesting comms_logger datastates_ckpt disable_python_gc expert_parallel
log_level managed_gradient_accumulation tensor_parallel vocabulary_size aio load_universal_checkpoint
use_node_local_storage zero_quantized_weights zero_quantized_gradients mesh_device
""".split())

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def resolve_ds_path(path: str | os.PathLike) -> Path:
    """A DeepSpeed JSON path as given, or a file name inside the shipped ds_configs/ directory."""
    if not str(path):
        raise ConfigError("no DeepSpeed config: pass --deepspeed_config (a path, or a file name in ds_configs/)")
    p = Path(path)
    if not p.exists() and (DS_CONFIG_DIR / p.name).exists() and len(p.parts) <= 2:
        return DS_CONFIG_DIR / p.name
    return p


def read_ds_json(path: str | os.PathLike) -> dict:
    p = resolve_ds_path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config {p}: file not found (shipped configs: "
                          f"{', '.join(sorted(x.name for x in DS_CONFIG_DIR.glob('*.json')))})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"DeepSpeed config {p}: malformed JSON at line {e.lineno} column {e.colno}: "
                          f"{e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {p}: expected a JSON object, got {type(data).__name__}")
    return data


def check_batch_arithmetic(tb: int | None, mb: int | None, ga: int | None, world_size: int,
                           source: str = "DeepSpeed config") -> tuple[int, int, int]:
    """Fill in and check train_batch_size = micro_batch x grad_accum x world_size, deriving a missing number the way
    DeepSpeed's _configure_train_batch_size does. Returns (train_batch_size, micro_batch, grad_accum)."""
    if world_size < 1:
        raise ConfigError(f"{source}: data-parallel world size {world_size}: expected >= 1")
    for name, v in zip(_BATCH_KEYS, (tb, mb, ga)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"{source}: {name} = {v!r}: expected a positive integer")
    numbers = (f"train_batch_size={tb}, train_micro_batch_size_per_gpu={mb}, gradient_accumulation_steps={ga}, "
               f"data-parallel world size={world_size}")
    if tb and mb and ga:
        if tb != mb * ga * world_size:
            raise ConfigError(f"{source}: inconsistent batch numbers: {numbers}; expected train_batch_size = "
                              f"{mb} x {ga} x {world_size} = {mb * ga * world_size}")
    elif tb and mb:
        if tb % (mb * world_size):
            raise ConfigError(f"{source}: train_batch_size {tb} is not divisible by micro batch x world size = "
                              f"{mb} x {world_size} = {mb * world_size} ({numbers})")
        ga = tb // (mb * world_size)
    elif tb and ga:
        if tb % (ga * world_size):
            raise ConfigError(f"{source}: train_batch_size {tb} is not divisible by grad accumulation x world size "
                              f"= {ga} x {world_size} = {ga * world_size} ({numbers})")
        mb = tb // (ga * world_size)
    elif mb and ga:
        tb = mb * ga * world_size
    elif tb:
        ga = 1
        if tb % world_size:
            raise ConfigError(f"{source}: train_batch_size {tb} is not divisible by world size {world_size}")
        mb = tb // world_size
    elif mb:
        ga = 1
        tb = mb * world_size
    else:
        raise ConfigError(f"{source}: give train_batch_size or train_micro_batch_size_per_gpu ({numbers})")
    return tb, mb, ga


@dataclass(frozen=True)
class Batch:
    """A run's batch numbers, decided once from its resolved DeepSpeed config (load_ds_config fills them in):
    micro batch per rank, micro batches accumulated per optimizer step, data-parallel ranks, and the global batch
    (micro x accumulation x data-parallel ranks), in samples."""

    micro: int
    accumulation: int
    data_parallel: int
    global_size: int

    @classmethod
    def of(cls, ds_config: dict, data_parallel: int) -> "Batch":
        """The numbers of a resolved DeepSpeed config (load_ds_config's, after any resize) on `data_parallel` ranks,
        checked against each other once more: a config edited after resolving would fail here, naming them."""
        tb, mb, ga = check_batch_arithmetic(ds_config.get("train_batch_size"),
                                            ds_config.get("train_micro_batch_size_per_gpu"),
                                            ds_config.get("gradient_accumulation_steps"), data_parallel,
                                            "resolved DeepSpeed config")
        return cls(micro=mb, accumulation=ga, data_parallel=data_parallel, global_size=tb)


def check_ds_keys(cfg: dict, source: str = "DeepSpeed config") -> None:
    """Unknown top-level keys refused with a did-you-mean (nested keys: ds_core.config.ds_json)."""
    unknown = sorted(set(cfg) - DS_TOP_LEVEL_KEYS)
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, DS_TOP_LEVEL_KEYS, 1))
                              else "") for k in unknown]
        raise ConfigError(f"{source}: unknown top-level key(s) {', '.join(hints)}")


def load_ds_config(path_or_dict: str | os.PathLike | dict, world_size: int, *, micro_batch: int = 0,
                   grad_accum: int = 0, zero_stage: int = -1, source: str = "DeepSpeed config") -> dict:
    """Load, validate and resolve a DeepSpeed JSON for `world_size` data-parallel ranks.

    Overrides (micro_batch, grad_accum > 0; zero_stage >= 0) replace the JSON's values. A JSON that fixes the global
    batch (train_batch_size without gradient_accumulation_steps, as Habana's BERT-1.5B JSON) keeps it under a micro
    batch override: the accumulation follows, as DeepSpeed derives it. Otherwise, when micro batch or accumulation is
    overridden, train_batch_size is re-derived rather than kept, so the override cannot conflict.
    """
    if isinstance(path_or_dict, dict):
        cfg = json.loads(json.dumps(path_or_dict))  # `source` names where it came from
    else:
        cfg, source = read_ds_json(path_or_dict), f"DeepSpeed config {resolve_ds_path(path_or_dict)}"
    check_ds_keys(cfg, source)
    if micro_batch:
        cfg["train_micro_batch_size_per_gpu"] = micro_batch
    if grad_accum:
        cfg["gradient_accumulation_steps"] = grad_accum
    fixes_global = "train_batch_size" in cfg and "gradient_accumulation_steps" not in cfg
    if grad_accum or (micro_batch and not fixes_global):
        cfg.pop("train_batch_size", None)
    tb, mb, ga = check_batch_arithmetic(cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu"),
                                        cfg.get("gradient_accumulation_steps"), world_size, source)
    cfg.update(train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=ga)
    zero = cfg.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{source}: zero_optimization must be an object, got {zero!r}")
    if zero_stage >= 0:
        zero["stage"] = zero_stage
    stage = zero.setdefault("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{source}: zero_optimization.stage = {stage!r}: expected 0, 1, 2 or 3")
    if cfg.get("bf16", {}).get("enabled") and cfg.get("fp16", {}).get("enabled"):
        raise ConfigError(f"{source}: bf16.enabled and fp16.enabled are both true: pick one precision")
    check_ds_values(cfg, source)
    settle_grad_accum_dtype(cfg, source)
    return cfg


def ds_config_for(cfg: TrainConfig, world_size: int, accelerator: str | None = None,
                  ds_json: dict | None = None) -> dict:
    """The resolved DeepSpeed config of a run: its JSON (as given, or `ds_json`: the file with its "auto" values
    filled, ds_core.config.trainer_json) plus the TrainConfig overrides, its bf16 section switched to the dtype
    TrainConfig.precision resolves to on `accelerator` (default: the one DeepSpeed finds)."""
    source = f"DeepSpeed config {resolve_ds_path(cfg.deepspeed_config)}"
    ds = load_ds_config(cfg.deepspeed_config if ds_json is None else ds_json, world_size,
                        micro_batch=cfg.micro_batch_size, grad_accum=cfg.gradient_accumulation_steps,
                        zero_stage=cfg.zero_stage, source=source)
    return resolve_ds_precision(ds, cfg.precision, accelerator, source=source)


def resolve_ds_precision(ds: dict, precision: str, accelerator: str | None = None,
                         source: str = "DeepSpeed config") -> dict:
    """Apply ds_core.device.precision's rule to a resolved DeepSpeed config; rank 0 prints the one-line notice when auto
    falls back to fp32. An fp16 JSON is kept under auto (the user chose it); bf16/fp32 against it is refused."""
    from ds_core.device import precision as prec

    if precision == "auto" and ds.get("fp16", {}).get("enabled"):
        return ds
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator().device_name()
    dtype, reason = prec.resolve_precision(precision, accelerator)
    try:
        prec.apply_precision(ds, dtype, source)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if precision == "auto" and dtype == "fp32":
        log.say(f"precision {reason}")
    return ds


def precision_of(ds_config: dict) -> str:
    if ds_config.get("bf16", {}).get("enabled") or ds_config.get("bfloat16", {}).get("enabled"):
        return "bf16"
    if ds_config.get("fp16", {}).get("enabled"):
        return "fp16"
    return "fp32"


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed values that DeepSpeed itself accepts silently (or refuses only after distributed init and model build)

# Sizes in elements. DeepSpeed 0.19's ZeroConfig allows 0 for most (ge=0) but a 0 bucket makes no progress, so
# bucket sizes must be positive; thresholds and distances may be 0 (0 = persist/reuse nothing).
_ZERO_POSITIVE = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "sub_group_size")
_ZERO_NON_NEGATIVE = ("stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
                      "stage3_max_live_parameters", "stage3_max_reuse_distance")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_optimizer_params(params: dict, source: str) -> None:
    """eps > 0, weight_decay >= 0 and betas two numbers in [0, 1), all finite (NaN and inf included: JSON has
    neither, but Python's json module reads NaN and Infinity); "auto" is left to the Trainer-style filling."""
    for key, low, closed in (("eps", 0, False), ("weight_decay", 0, True)):
        v = params.get(key, "auto")
        if v != "auto" and not (_is_number(v) and (v >= low if closed else v > low)):
            raise ConfigError(f"{source}: optimizer.params.{key} = {v!r}: expected a number {'>=' if closed else '>'} "
                              f"{low}")
    betas = params.get("betas", "auto")
    if betas != "auto" and not (isinstance(betas, list) and len(betas) == 2
                                and all(b == "auto" or (_is_number(b) and 0 <= b < 1) for b in betas)):
        raise ConfigError(f"{source}: optimizer.params.betas = {betas!r}: expected two numbers in [0, 1)")


def check_ds_values(cfg: dict, source: str = "DeepSpeed config") -> None:
    """Refuse values DeepSpeed would train with silently (a negative lr or clipping) or reject only after distributed
    init (bucket sizes), naming the key."""
    opt = cfg.get("optimizer")
    if opt is not None:
        params = opt.get("params", {}) if isinstance(opt, dict) else None
        if not isinstance(params, dict):
            raise ConfigError(f"{source}: optimizer must be an object with a \"params\" object, got {opt!r}")
        if "lr" in params and not (_is_number(params["lr"]) and params["lr"] > 0):
            raise ConfigError(f"{source}: optimizer.params.lr = {params['lr']!r}: expected a number > 0")
        _check_optimizer_params(params, source)
    if "gradient_clipping" in cfg and not (_is_number(cfg["gradient_clipping"]) and cfg["gradient_clipping"] >= 0):
        raise ConfigError(f"{source}: gradient_clipping = {cfg['gradient_clipping']!r}: expected a number >= 0 "
                          f"(0 turns clipping off)")
    zero = cfg.get("zero_optimization") or {}
    for key in _ZERO_POSITIVE + _ZERO_NON_NEGATIVE:
        if key not in zero:
            continue
        v, low = zero[key], (1 if key in _ZERO_POSITIVE else 0)
        if not (_is_number(v) and float(v).is_integer() and v >= low):
            raise ConfigError(f"{source}: zero_optimization.{key} = {v!r}: expected a whole number of elements "
                              f">= {low}")


