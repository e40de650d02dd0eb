"""BridgeTower presets and the model/run arguments of `bridgetower_ds.train`.

Presets are functions returning a `transformers.BridgeTowerConfig`; `bridgetower_base()` and `debug()` derive from
`bridgetower_large()` in code. Current transformers no longer defaults `contrastive_hidden_size` and
`logit_scale_init_value` on a config built in code, so every preset sets them explicitly.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Optional

from transformers import BridgeTowerConfig

from ds_core.config import TrainConfig
from ds_core.config.optim import OptimArgs
from ds_core.errors import ConfigError

from .images import DEFAULT_MAX_PIXELS, TRANSFORMS

# The published checkpoint's contrastive head width and initial logit scale (log(1/0.07) = 2.6592).
CONTRASTIVE_HIDDEN_SIZE = 512
LOGIT_SCALE_INIT = 2.6592


def _config(text: dict, vision: dict, **cross) -> BridgeTowerConfig:
    cross.setdefault("contrastive_hidden_size", CONTRASTIVE_HIDDEN_SIZE)
    cross.setdefault("logit_scale_init_value", LOGIT_SCALE_INIT)
    return BridgeTowerConfig(text_config=dict(text), vision_config=dict(vision), **cross)


# Architecture of the published Large ITM/MLM/ITC checkpoint (its config.json): RoBERTa-large text tower
# (1024 hidden, 24 layers, 16 heads), CLIP ViT-L/14 vision tower, 6 shared-transform cross-modal layers.
# Note: the checkpoint's vision image_size is 294 (21 x 21 patches of 14 px) and its preprocessor resizes the
# shorter side to 294; transformers 5 rejects any other input size, so S = 294 for Large, not 288.
_LARGE_TEXT = dict(vocab_size=50265, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                   intermediate_size=4096, hidden_act="gelu", hidden_dropout_prob=0.1,
                   attention_probs_dropout_prob=0.1, max_position_embeddings=514, type_vocab_size=1,
                   layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2)
_LARGE_VISION = dict(hidden_size=1024, num_hidden_layers=24, patch_size=14, image_size=294, num_channels=3,
                     layer_norm_eps=1e-5, share_layernorm=True, remove_last_layer=False, stop_gradient=False)
_LARGE_CROSS = dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, hidden_act="gelu",
                    layer_norm_eps=1e-5, share_cross_modal_transformer_layers=True, share_link_tower_layers=False,
                    link_tower_type="add", init_layernorm_from_vision_encoder=False, tie_word_embeddings=False)


def bridgetower_large() -> BridgeTowerConfig:
    """BridgeTower Large (ITM/MLM/ITC checkpoint architecture, ~0.9B parameters)."""
    return _config(_LARGE_TEXT, _LARGE_VISION, **_LARGE_CROSS)


def bridgetower_base() -> BridgeTowerConfig:
    """BridgeTower Base: RoBERTa-base text tower, CLIP ViT-B/16 at 288 px, 6 cross-modal layers of 768."""
    text = {**_LARGE_TEXT, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
            "intermediate_size": 3072}
    vision = {**_LARGE_VISION, "hidden_size": 768, "num_hidden_layers": 12, "patch_size": 16, "image_size": 288}
    cross = {**_LARGE_CROSS, "hidden_size": 768, "num_attention_heads": 12}
    return _config(text, vision, **cross)


# The debug tokenizer's vocabulary size (bridgetower_ds.tokenizer builds exactly this many ids).
DEBUG_VOCAB_SIZE = 512


def debug() -> BridgeTowerConfig:
    """Tiny random-init model for tests and benches: 2 layers everywhere, width 64, 32 px images.

    Constraints from the modeling code: vision heads = hidden // 64 (so vision hidden >= 64); the cross-modal
    layers run at the text width, so cross hidden == text hidden; vision layers >= text layers >= cross layers.
    """
    # No dropout: a tiny random-init model does not need it, and on a CPU the dropout masks cost ~15% of a step.
    text = {**_LARGE_TEXT, "vocab_size": DEBUG_VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "intermediate_size": 128, "max_position_embeddings": 130,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    vision = {**_LARGE_VISION, "hidden_size": 64, "num_hidden_layers": 2, "patch_size": 8, "image_size": 32}
    cross = {**_LARGE_CROSS, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    return _config(text, vision, contrastive_hidden_size=32, **cross)


PRESETS: dict[str, Callable[[], BridgeTowerConfig]] = {
    "bridgetower_large": bridgetower_large,
    "bridgetower_base": bridgetower_base,
    "debug": debug,
}


def preset(name: str) -> BridgeTowerConfig:
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r}: unknown BridgeTower preset; expected one of {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name]())


# Text tokens ds-tune assumes for BridgeTower when --seq_len is not given. Kept from ds-tune's earlier copy of the
# shapes so its numbers do not move; a run padded to the data default (--max_seq_length 128) is tuned with 128.
TUNING_SEQ_LEN = 50
_TUNING_TOP = ("hidden_size", "num_hidden_layers", "num_attention_heads", "contrastive_hidden_size",
               "logit_scale_init_value", "share_cross_modal_transformer_layers", "share_link_tower_layers",
               "link_tower_type", "tie_word_embeddings")
_TUNING_TEXT = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "type_vocab_size", "pad_token_id")
_TUNING_VISION = ("hidden_size", "num_hidden_layers", "patch_size", "image_size", "share_layernorm",
                  "remove_last_layer")


def tuning_spec(name: str, seq_len: int = TUNING_SEQ_LEN) -> dict:
    """The preset as ds-tune reads a model (ds_tools.tuning): the BridgeTowerConfig fields that fix parameter count
    and activation shapes, for the class bridgetower_ds.model builds, plus the text seq_len. Other fields (dropout,
    eps, activation) change neither. ds_configs/models/<name>.json holds this for bridgetower_large (a test keeps it
    equal)."""
    cfg = preset(name)
    return {"model_type": "bridgetower", "architectures": ["BridgeTowerForContrastiveLearning"],
            **{k: getattr(cfg, k) for k in _TUNING_TOP}, "seq_len": seq_len,
            "text_config": {k: getattr(cfg.text_config, k) for k in _TUNING_TEXT},
            "vision_config": {k: getattr(cfg.vision_config, k) for k in _TUNING_VISION}}


@dataclass(frozen=True)
class ModelArgs:
    """Which BridgeTower to build and what to train of it."""

    preset: str = field(default="debug", metadata={
        "help": "architecture when no checkpoint is given: bridgetower_large | bridgetower_base | debug"})
    model_name_or_path: str = field(default="", metadata={
        "help": "local directory with a saved BridgeTower (config.json + weights, e.g. the Large ITM/MLM/ITC "
                "checkpoint); empty -> random init from --preset"})
    tokenizer_name_or_path: str = field(default="", metadata={
        "help": "local tokenizer directory; empty -> --model_name_or_path, or the locally built debug tokenizer",
        "aliases": ["--tokenizer_name"]})
    freeze_vision_model: bool = field(default=False, metadata={"help": "freeze the vision tower (ViT)"})
    freeze_text_model: bool = field(default=False, metadata={"help": "freeze the text tower (RoBERTa)"})
    freeze_text_pooler: bool = field(default=True, metadata={
        "help": "freeze the text tower's pooler (unused by the contrastive loss, so it gets no gradient)"})
    global_negatives: bool = field(default=False, metadata={
        "help": "contrastive negatives from every rank's micro batch (all-gather) instead of this rank's only"})
    attn_implementation: str = field(default="sdpa", metadata={
        "help": "text and cross-modal attention: sdpa (torch's fused scaled_dot_product_attention, the same "
                "function) | eager (transformers' matmul + softmax + matmul)"})


@dataclass(frozen=True)
class RunArgs:
    """What the run does (Trainer-style switches)."""

    do_train: bool = field(default=False, metadata={"help": "fine-tune on the train split"})
    do_eval: bool = field(default=False, metadata={
        "help": "evaluate on the validation split (contrastive loss, i2t / t2i recall@1/5/10); at the end of "
                "training and every --eval_every steps when training"})
    do_predict: bool = field(default=False, metadata={"help": "evaluate on the test split after training"})
    eval_micro_batch_size: int = field(default=0, metadata={
        "help": "per-rank evaluation batch; 0 -> the training micro batch",
        "aliases": ["--per_device_eval_batch_size"]})
    export_dir: str = field(default="", metadata={
        "help": "after the run, write the model (ZeRO-3 partitions gathered) and tokenizer here in "
                "save_pretrained format; empty -> no export"})
    save_model: bool = field(default=True, metadata={
        "help": "after training, save the model into --output_dir as run_bridgetower.py's trainer.save_model() does; "
                "false for measurement runs that only need the numbers (a BridgeTower-Large model is 3.5 GB)"})

    def eval_micro_batch(self, train_micro: int) -> int:
        """The per-rank evaluation batch: --eval_micro_batch_size, else the training micro batch."""
        return self.eval_micro_batch_size or train_micro


FORMATS = ("auto", "hf", "imagefolder", "json", "jsonl", "csv")
SPLIT_POLICIES = ("run_bridgetower", "fractions")


@dataclass(frozen=True)
class DataArgs:
    dataset_path: str = field(default="", metadata={
        "help": "Image-caption data: a save_to_disk directory, an imagefolder directory, or a .json/.jsonl/.csv "
                "manifest (image path relative to the manifest, caption)."})
    dataset_format: str = field(default="auto", metadata={"help": "auto|hf|imagefolder|json|csv|jsonl."})
    dataset_name: str = field(default="", metadata={
        "help": "Hub dataset (e.g. jmhessel/newyorker_caption_contest), loaded from the local datasets cache "
                "offline (bridgetower_ds.hub); instead of --dataset_path."})
    dataset_config_name: str = field(default="", metadata={"help": "Configuration of --dataset_name (e.g. matching)."})
    max_train_samples: int = field(default=0, metadata={
        "help": "Use only the first N rows of the train split (after any carve-out); 0: all."})
    max_eval_samples: int = field(default=0, metadata={"help": "Use only the first N rows of validation; 0: all."})
    max_predict_samples: int = field(default=0, metadata={"help": "Use only the first N rows of test; 0: all."})
    image_column: str = field(default="image", metadata={"help": "Column with the image (path, bytes or HF Image)."})
    caption_column: str = field(default="caption", metadata={
        "help": "Column with the caption text (a list of captions uses its first entry)."})
    train_split: str = field(default="train", metadata={"help": "Name of the training split."})
    validation_split: str = field(default="validation", metadata={"help": "Name of the validation split."})
    test_split: str = field(default="test", metadata={"help": "Name of the test split."})
    validation_fraction: float = field(default=0.1, metadata={
        "help": "Share of train carved out as validation when the data has no validation split."})
    test_fraction: float = field(default=0.1, metadata={
        "help": "Share of train carved out as test when the data has no test split."})
    split_seed: int = field(default=42, metadata={"help": "Seed of the deterministic carve-out of missing splits."})
    missing_splits: str = field(default="run_bridgetower", metadata={
        "help": "run_bridgetower: no test split -> 40 % of train held out with the training seed, halved into "
                "validation and test when there is no validation split either (run_bridgetower.py's "
                "train_test_split calls); fractions: --validation_fraction / --test_fraction with --split_seed."})
    image_transform: str = field(default="run_bridgetower", metadata={
        "help": "run_bridgetower: torchvision Resize([S], bicubic) + CenterCrop(S) as run_bridgetower.py trains; "
                "processor: BridgeTowerImageProcessor's geometry (size divisor 32, long-side cap, zero padding)."})
    image_pipeline: str = field(default="host", metadata={
        "help": "host: decode/resize/crop in DataLoader workers, normalize on the accelerator; device: decode on "
                "the accelerator (HPU media pipe, CUDA nvJPEG, or a CPU thread pool); auto: best available."})
    mediapipe_dataloader: bool = field(default=False, metadata={"help": "Alias for --image_pipeline device."})
    dataloader_num_workers: int = field(default=2, metadata={"help": "DataLoader worker processes per rank."})
    bad_image: str = field(default="skip", metadata={
        "help": "skip: drop unreadable images (counted in metrics, first paths logged); error: stop with the path."})
    max_seq_length: int = field(default=128, metadata={"help": "Caption token limit (truncation)."})
    image_size: int = field(default=0, metadata={"help": "Image side S; 0 -> the model's vision image size."})
    pad_to_max_length: bool = field(default=False, metadata={
        "help": "Pad captions to max_seq_length (static shapes; always on for HPU) instead of the batch's longest."})
    jpeg_draft: bool = field(default=True, metadata={
        "help": "Decode large JPEGs at a reduced DCT scale (1/2, 1/4, 1/8) that still covers the resize target."})
    decode_threads: int = field(default=0, metadata={
        "help": "Threads of the device pipeline's CPU decoder (0 -> min(8, cores))."})
    max_image_pixels: int = field(default=DEFAULT_MAX_PIXELS, metadata={
        "help": "Images with more pixels (from the header) are bad images: decompression-bomb guard."})
    image_cache_dir: str = field(default="", metadata={
        "help": "HPU media pipe only: where images stored as bytes in the dataset are written as files (it reads "
                "files), named by their content; empty -> this user's bt_images-<uid> under the system temp dir. "
                "Must be this user's own directory, not writable by others."})
    dataloader_timeout_s: int = field(default=600, metadata={
        "help": "Seconds to wait for one batch from a worker before failing (instead of hanging)."})

    def validate(self) -> None:
        if self.dataset_format not in FORMATS:
            raise ConfigError(f"--dataset_format must be one of {FORMATS}, got {self.dataset_format!r}")
        if self.image_pipeline not in ("host", "device", "auto"):
            raise ConfigError(f"--image_pipeline must be host, device or auto, got {self.image_pipeline!r}")
        if self.missing_splits not in SPLIT_POLICIES:
            raise ConfigError(f"--missing_splits must be one of {SPLIT_POLICIES}, got {self.missing_splits!r}")
        if self.image_transform not in TRANSFORMS:
            raise ConfigError(f"--image_transform must be one of {TRANSFORMS}, got {self.image_transform!r}")
        if self.bad_image not in ("skip", "error"):
            raise ConfigError(f"--bad_image must be skip or error, got {self.bad_image!r}")
        for name in ("validation_fraction", "test_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ConfigError(f"--{name} must be in [0, 1), got {v}")
        if self.validation_fraction + self.test_fraction >= 1.0:
            raise ConfigError("--validation_fraction + --test_fraction must leave some training data")
        if self.max_seq_length < 2 or self.dataloader_num_workers < 0 or self.image_size < 0:
            raise ConfigError("max_seq_length >= 2, dataloader_num_workers >= 0, image_size >= 0 expected")

    @property
    def requested_pipeline(self) -> str:
        return "device" if self.mediapipe_dataloader else self.image_pipeline

    @property
    def pipeline_flag(self) -> str:
        """The option that asked for the pipeline, as the user wrote it (for errors)."""
        return "--mediapipe_dataloader" if self.mediapipe_dataloader else f"--image_pipeline {self.image_pipeline}"


# Where optimum-habana's HPU-only flags point a user of this toolkit instead (one line each, printed on rank 0).
HPU_NOTICES = {
    "use_habana": "the accelerator is detected (HPU, CUDA or CPU) by DeepSpeed; nothing to switch on",
    "use_lazy_mode": "the HPU execution mode comes from the environment (PT_HPU_LAZY_MODE), as Habana's bridge "
                     "reads it; Gaudi's default is eager + torch.compile (PT_HPU_LAZY_MODE=0), lazy mode is legacy",
    "use_hpu_graphs_for_inference": "evaluation runs the DeepSpeed engine's eager forward; HPU graphs are not used",
    "use_hpu_graphs": "(optimum-habana's deprecated name of --use_hpu_graphs_for_inference) evaluation runs the "
                      "DeepSpeed engine's eager forward; HPU graphs are not used",
    "gaudi_config_name": "mixed precision comes from the DeepSpeed JSON (bf16 section), not a Gaudi config",
    "distribution_strategy": "data parallelism is DeepSpeed ZeRO (--zero_stage / the DeepSpeed JSON), not DDP",
    "sdp_on_bf16": "attention runs transformers' BridgeTower implementation; no Gaudi SDPA switch",
}
# GaudiTrainingArguments' other settings (optimum-habana, optimum/habana/transformers/training_args.py), accepted
# where what they ask for is what happens here anyway or does not apply; --torch_compile maps to --compile on, and
# --fp8 / --profiling_* are refused naming what to use (bridgetower_ds.trainer_flags.check_flags)
GAUDI_TRAINER_NOTICES = {
    "adjust_throughput": "logging, evaluation and saving are always outside the measured throughput window "
                         "(train_samples_per_second_measured)",
    "non_blocking_data_copy": "batches always go to the device without blocking, from pinned host memory",
    "pipelining_fwd_bwd": "no extra graph cut between forward and backward: in lazy mode the loop cuts the graph after "
                          "backward and after the optimizer step, as GaudiTrainer does without this flag",
    "use_hpu_graphs_for_training": "training runs eager (and compiled with --compile); HPU graphs are not used",
    "use_compiled_autograd": "compiled autograd is not used; --compile compiles the model's forward",
    "torch_compile_backend": "the model compiles with the accelerator's own backend (hpu_backend on Gaudi, inductor "
                             "elsewhere), whatever is named here",
}


@dataclass(frozen=True)
class CompatArgs:
    """transformers / optimum-habana TrainingArguments flags that have no setting of their own here: accepted with
    their meaning mapped (report_to, save_strategy, remove_unused_columns), with a one-line notice (HPU-only), or
    refused with the reason (push_to_hub). See bridgetower_ds/trainer_flags.py."""

    report_to: str = field(default="none", metadata={
        "help": "tensorboard | csv | wandb | comet | all | none (comma-separated for several): DeepSpeed's monitor, "
                "writing under --output_dir/<name>/ (a monitor section in the DeepSpeed JSON wins); all: every "
                "installed one, as transformers' Trainer"})
    save_strategy: str = field(default="steps", metadata={
        "help": "steps: checkpoints every --save_steps (and at the end); epoch: at every epoch's end; no: none"})
    eval_strategy: str = field(default="no", metadata={
        "help": "no: evaluate once after training (--do_eval); steps: every --eval_steps optimizer steps (default "
                "--logging_steps, as Trainer); epoch: at every epoch's end", "aliases": ["--evaluation_strategy"]})
    eval_steps: int = field(default=0, metadata={"help": "with --eval_strategy steps: evaluate every N steps"})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "refused: transformers' BridgeTower has no gradient checkpointing (use --zero_stage 3 or a smaller "
                "--per_device_train_batch_size)"})
    dataloader_drop_last: bool = field(default=False, metadata={
        "help": "true is refused (the last micro batch of an epoch is kept; see bridgetower_ds.batching)"})
    train_file: str = field(default="", metadata={"help": "csv / json / jsonl manifest of the train split"})
    validation_file: str = field(default="", metadata={"help": "csv / json / jsonl manifest of the validation split"})
    test_file: str = field(default="", metadata={"help": "csv / json / jsonl manifest of the test split"})
    data_dir: str = field(default="", metadata={"help": "refused: pass --dataset_path DIR"})
    dataset_revision: str = field(default="main", metadata={
        "help": "only main (the revision in the offline datasets cache); another is refused"})
    model_revision: str = field(default="main", metadata={
        "help": "revision of a hub id's snapshot in the local hub cache (--model_name_or_path)"})
    cache_dir: str = field(default="", metadata={
        "help": "the offline cache: hub snapshots (HF_HUB_CACHE) and datasets (HF_DATASETS_CACHE) are looked up here"})
    config_name: str = field(default="", metadata={
        "help": "accepted when it is --model_name_or_path (the config is read from the model's directory)"})
    image_processor_name: str = field(default="", metadata={
        "help": "directory of the preprocessor_config.json saved with the model (default: --model_name_or_path)"})
    preprocessing_num_workers: Optional[int] = field(default=None, metadata={
        "help": "accepted: captions are tokenized in the DataLoader workers (--dataloader_num_workers)"})
    overwrite_cache: bool = field(default=False, metadata={"help": "accepted: no preprocessed cache is written"})
    use_fast_tokenizer: bool = field(default=True, metadata={
        "help": "accepted: the model directory's tokenizer is loaded as AutoTokenizer does (fast when it has one)"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "accepted: BridgeTower is transformers' own code; no remote code is ever run"})
    token: str = field(default="", metadata={"help": "accepted and unused: nothing is downloaded"})
    metric_for_best_model: str = field(default="", metadata={
        "help": "an eval metric (loss, i2t_r1, ...): trainer_state.json records best_metric, best_global_step and "
                "best_model_checkpoint, as Trainer does"})
    greater_is_better: Optional[bool] = field(default=None, metadata={
        "help": "with --metric_for_best_model; default: false for a *loss, else true (Trainer's rule)"})
    fp16: bool = field(default=False, metadata={"help": "refused: mixed precision is bf16 here (--bf16)"})
    load_best_model_at_end: bool = field(default=False, metadata={
        "help": "refused: the final model is the last step's; export the best with `ds-ckpt export-hf` from its "
                "checkpoint (trainer_state.json's best_model_checkpoint)"})
    remove_unused_columns: bool = field(default=True, metadata={
        "help": "accepted for transformers' scripts: only --image_column and --caption_column are ever read"})
    push_to_hub: bool = field(default=False, metadata={"help": "refused: this toolkit never uploads"})
    hub_model_id: str = field(default="", metadata={"help": "accepted and unused (only --push_to_hub reads it)"})
    use_habana: bool = field(default=False, metadata={"help": "HPU-only flag, accepted: " + HPU_NOTICES["use_habana"]})
    use_lazy_mode: bool = field(default=False, metadata={"help": "HPU-only flag, accepted: "
                                                                 + HPU_NOTICES["use_lazy_mode"]})
    use_hpu_graphs_for_inference: bool = field(default=False, metadata={
        "help": "HPU-only flag, accepted: " + HPU_NOTICES["use_hpu_graphs_for_inference"]})
    use_hpu_graphs: bool = field(default=False, metadata={"help": "HPU-only flag, accepted: "
                                                                  + HPU_NOTICES["use_hpu_graphs"]})
    gaudi_config_name: str = field(default="", metadata={"help": "HPU-only flag, accepted: "
                                                                  + HPU_NOTICES["gaudi_config_name"]})
    distribution_strategy: str = field(default="", metadata={
        "help": "HPU-only flag, accepted: " + HPU_NOTICES["distribution_strategy"]})
    sdp_on_bf16: bool = field(default=False, metadata={"help": "HPU-only flag, accepted: "
                                                               + HPU_NOTICES["sdp_on_bf16"]})
    adjust_throughput: bool = field(default=False, metadata={
        "help": "GaudiTrainer's flag, accepted: " + GAUDI_TRAINER_NOTICES["adjust_throughput"]})
    non_blocking_data_copy: bool = field(default=False, metadata={
        "help": "GaudiTrainer's flag, accepted: " + GAUDI_TRAINER_NOTICES["non_blocking_data_copy"]})
    pipelining_fwd_bwd: bool = field(default=False, metadata={
        "help": "GaudiTrainer's flag, accepted: " + GAUDI_TRAINER_NOTICES["pipelining_fwd_bwd"]})
    use_hpu_graphs_for_training: bool = field(default=False, metadata={
        "help": "GaudiTrainer's flag, accepted: " + GAUDI_TRAINER_NOTICES["use_hpu_graphs_for_training"]})
    use_compiled_autograd: bool = field(default=False, metadata={
        "help": "GaudiTrainer's flag, accepted: " + GAUDI_TRAINER_NOTICES["use_compiled_autograd"]})
    torch_compile: bool = field(default=False, metadata={"help": "Trainer's flag: --compile on"})
    torch_compile_backend: str = field(default="", metadata={
        "help": "Trainer's flag, accepted: " + GAUDI_TRAINER_NOTICES["torch_compile_backend"]})
    fp8: bool = field(default=False, metadata={"help": "GaudiTrainer's flag, refused: no fp8 training here (--bf16)"})
    profiling_steps: int = field(default=0, metadata={
        "help": "GaudiTrainer's flag, refused: --profile_steps N profiles the last N warm-up steps"})
    profiling_warmup_steps: int = field(default=0, metadata={
        "help": "GaudiTrainer's flag, refused: --profile_steps N profiles the last N warm-up steps"})


@dataclass(frozen=True)
class BridgeTowerSettings:
    """The settings tree of bridgetower_ds.train: the loop, the model, the data, what the run does (train / eval /
    predict), the optimizer and LR schedule, and the transformers Trainer flags that have no setting of their own."""

    train: TrainConfig
    model: ModelArgs
    data: DataArgs
    task: RunArgs
    optim: OptimArgs
    compat: CompatArgs


def main(argv: list[str] | None = None) -> int:
    """`python -m bridgetower_ds.configs --preset bridgetower_large [--seq_len N] --write_config PATH`: the preset's
    model description for `ds-tune --model PATH`."""
    from ds_core.cli import write_spec_main

    return write_spec_main(argv, prog="python -m bridgetower_ds.configs", presets=list(PRESETS),
                           make_spec=lambda a: tuning_spec(a.preset, a.seq_len),
                           add_arguments=lambda p: p.add_argument("--seq_len", type=int, default=TUNING_SEQ_LEN,
                                                                  help="caption tokens"))


if __name__ == "__main__":
    raise SystemExit(main())
