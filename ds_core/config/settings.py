"""The settings every run shares (TrainConfig) and `arg`, a dataclass field with its one help line and its
flag aliases: what the model packages' settings trees are made of."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ds_core.config.accumulation import settle_grad_accum_dtype  # noqa: F401 - part of ds_core.config's API
from ds_core.errors import ConfigError


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
