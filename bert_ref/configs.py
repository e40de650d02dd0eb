"""BERT presets (functions deriving from each other) and the run arguments of bert_ref.train.

A preset fixes the architecture (incl. Post-LN / Pre-LN) and the phase's sequence shape; it never fixes DeepSpeed
settings (those live in ds_configs/*.json) or optimizer settings (ds_core.config.optim.OptimArgs, whose BERT defaults
follow the preset's published recipe: bert_ref.optim.PUBLISHED).

Phases follow the published two-phase recipe (NVIDIA / Habana BERT pretraining): phase 1 trains on sequences of 128
tokens with at most 20 masked positions, phase 2 continues from phase 1's weights on 512 tokens with at most 80.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bert_ref.habana_ckpt import is_habana_checkpoint
from bert_ref.recipes import RECIPES, check_recipe_name
from ds_core.config import TrainConfig, arg
from ds_core.config.optim import OptimArgs
from ds_core.errors import ConfigError
from ds_core.outputs.monitors import REPORT_TO_HELP, report_to_names

BERT_VOCAB = 30522  # the uncased WordPiece vocabulary of the original BERT release
PHASES = {1: (128, 20), 2: (512, 80)}  # phase -> (max_seq_length, max_predictions_per_seq)


class UnknownPresetError(ConfigError):
    """--preset names no preset in bert_ref.configs.PRESETS."""


class InputDirError(ConfigError):
    """--input_dir is missing, not a directory, or holds no shards."""


class PhaseMismatchError(ConfigError):
    """The shards were made for another phase than the preset (sequence length or masked positions differ)."""


def pad_vocab(vocab_size: int, multiple: int = 8) -> int:
    """Round the vocabulary up to a multiple of 8 so the embedding / decoder matmuls hit aligned tensor-core and
    MME tiles (30522 -> 30528); the extra rows are never produced by the tokenizer."""
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class BertPreset:
    """Architecture + phase shape of a BERT model (field names follow transformers.BertConfig where they overlap)."""

    name: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int = pad_vocab(BERT_VOCAB)
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pre_ln: bool = False  # LayerNorm before each sublayer (MegatronBertForPreTraining); False: BERT's Post-LN
    habana_pre_ln: bool = False  # Pre-LN exactly as Habana's modeling.py (bert_ref.model.habana_pre_ln_form)
    phase: int = 1
    seq_len: int = PHASES[1][0]
    max_predictions_per_seq: int = PHASES[1][1]

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"preset {self.name}: hidden_size {self.hidden_size} is not divisible by "
                              f"num_attention_heads {self.num_attention_heads}")
        if self.seq_len > self.max_position_embeddings:
            raise ConfigError(f"preset {self.name}: seq_len {self.seq_len} > max_position_embeddings "
                              f"{self.max_position_embeddings}")


def _phase(preset: BertPreset, phase: int) -> BertPreset:
    if phase not in PHASES:
        raise ConfigError(f"phase = {phase!r}: expected 1 (seq 128, 20 predictions) or 2 (seq 512, 80 predictions)")
    seq, preds = PHASES[phase]
    return dataclasses.replace(preset, phase=phase, seq_len=seq, max_predictions_per_seq=preds)


def bert_large(phase: int = 1) -> BertPreset:
    """BERT-Large (Devlin et al. 2018): 24 layers, hidden 1024, 16 heads, FFN 4096; ~336M parameters with heads."""
    return _phase(BertPreset("bert_large", num_hidden_layers=24, hidden_size=1024, num_attention_heads=16,
                             intermediate_size=4096), phase)


def bert_1p5b(phase: int = 1) -> BertPreset:
    """BERT-1.5B (Habana Model-References deepspeed-bert, scripts/bert_1.5b_config.json): 48 layers, hidden 1600,
    25 heads, FFN 6400, Pre-LN (`layer_norm_large_model: true`; bert_ref.model says how MegatronBert's Pre-LN
    differs from Habana's); 1,530,388,930 parameters with heads (vocab padded to 30528)."""
    return dataclasses.replace(bert_large(phase), name="bert_1p5b", num_hidden_layers=48, hidden_size=1600,
                               num_attention_heads=25, intermediate_size=6400, pre_ln=True)


def bert_1p5b_habana(phase: int = 1) -> BertPreset:
    """bert_1p5b computing exactly the function of Habana's modeling.py (residual stream from 0, embedding dropout
    after the LayerNorm; bert_ref.model); loads Habana checkpoints (bert_ref.habana_ckpt)."""
    return dataclasses.replace(bert_1p5b(phase), name="bert_1p5b_habana", habana_pre_ln=True)


def debug(phase: int = 1) -> BertPreset:
    """Tiny BERT for tests and `make demo`: 2 layers, hidden 64. Its vocabulary is small (1024) so the MLM decoder
    does not dominate a CPU step; build the demo vocab with at most that many tokens. No dropout, so that a small
    repeated corpus overfits quickly and resumed runs are easy to compare."""
    return dataclasses.replace(bert_large(phase), name="debug", num_hidden_layers=2, hidden_size=64,
                               num_attention_heads=4, intermediate_size=256, vocab_size=1024,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def debug_pre_ln(phase: int = 1) -> BertPreset:
    """The debug size in bert_1p5b's Pre-LN form (MegatronBertForPreTraining): tests of the 1.5B model's code paths."""
    return dataclasses.replace(debug(phase), name="debug_pre_ln", pre_ln=True)


def debug_habana(phase: int = 1) -> BertPreset:
    """The debug size in bert_1p5b_habana's form."""
    return dataclasses.replace(debug_pre_ln(phase), name="debug_habana", habana_pre_ln=True)


PRESETS: dict[str, Callable[[int], BertPreset]] = {"bert_large": bert_large, "bert_1p5b": bert_1p5b, "debug": debug,
                                                   "debug_pre_ln": debug_pre_ln, "bert_1p5b_habana": bert_1p5b_habana,
                                                   "debug_habana": debug_habana}


def get_preset(name: str, phase: int = 1) -> BertPreset:
    if name not in PRESETS:
        raise UnknownPresetError(f"--preset {name!r}: unknown preset; expected one of {', '.join(PRESETS)}")
    return PRESETS[name](phase)



def tuning_spec(preset: BertPreset) -> dict[str, Any]:
    """The preset as ds-tune reads a model (ds_tools.tuning): HF config.json fields of the transformers class
    bert_ref.model builds for it, plus the phase's seq_len. ds_configs/models/<name>.json holds this for the
    published presets (a test keeps them equal)."""
    return {"model_type": "megatron-bert" if preset.pre_ln else "bert",
            "architectures": ["MegatronBertForPreTraining" if preset.pre_ln else "BertForPreTraining"],
            "hidden_size": preset.hidden_size, "num_hidden_layers": preset.num_hidden_layers,
            "num_attention_heads": preset.num_attention_heads, "intermediate_size": preset.intermediate_size,
            "vocab_size": preset.vocab_size, "max_position_embeddings": preset.max_position_embeddings,
            "type_vocab_size": preset.type_vocab_size, "seq_len": preset.seq_len}


@dataclass(frozen=True)
class BertArgs:
    """Model and data settings of bert_ref.train (optimizer settings: ds_core.config.optim.OptimArgs)."""

    recipe: str = arg(f"A published run, one of {', '.join(RECIPES)} (bert_ref.recipes; docs/bert_pretraining.md): "
                      "sets every setting the reference fixes (preset, phase, DeepSpeed JSON, optimizer, LR schedule, "
                      "steps, seed); flags given as well override it. '' = none.", default="")
    preset: str = arg(f"Model preset: one of {', '.join(PRESETS)}. Each brings its DeepSpeed JSON (ds_configs."
                      "DEFAULT_JSON: bert_large_zero1_bf16.json, bert_1p5b_zero1_bf16.json = Habana's 1.5B JSON, "
                      "bert_debug_zero1_bf16.json) unless --deepspeed_config names one.", default="bert_large")
    phase: int = arg("1: seq 128 / 20 masked positions; 2: seq 512 / 80 (usually with --init_checkpoint).",
                       default=1)
    input_dir: str = arg("Directory of pretraining shards written by `python -m bert_ref.prep shards`.",
                           default="")
    init_checkpoint: str = arg("Start from: a bert_ref.train run directory (phase 2 from phase 1: its latest "
                                 "checkpoint's fp32 master weights and optimizer state, step numbers continue), or a "
                                 "local Hugging Face directory (weights only; of the preset's form: Post-LN "
                                 "BertForPreTraining or Pre-LN MegatronBertForPreTraining); '' = random init.",
                                 default="")
    reset_optimizer: bool = arg("With a run-directory --init_checkpoint: start with fresh optimizer moments instead "
                                "of phase 1's (NVIDIA's phase 2 keeps them, restarting the bias-correction step).",
                                default=False)
    activation_checkpointing: bool = arg("Recompute each encoder layer's activations in backward (less memory, "
                                           "~1/3 more compute; reported FLOPs exclude the recompute).",
                                           default=False)
    attn_implementation: str = arg("Attention kernel: 'sdpa' or 'eager' (Pre-LN presets: bert_ref.model gives "
                                   "MegatronBert the SDPA path of transformers' BERT).", default="sdpa")
    sparse_mlm: bool = arg("Run the MLM head (transform + vocabulary decoder) only at the max_predictions_per_seq "
                           "masked positions (NVIDIA's and Habana's recipes compute it at every position); same loss, "
                           "fewer FLOPs (and the reported FLOPs count only those positions).", default=False)
    fast_dropout: bool = arg("Hidden dropouts draw 16-bit random numbers (bert_ref.model.FastDropout, p rounded to "
                             "a multiple of 2^-15): faster on CPU.", default=False)
    report_to: str = arg(REPORT_TO_HELP + "; as transformers' Trainer and bridgetower_ds.train.", default="none")
    export_hf: bool = arg("At the end write run_dir/hf_model (save_pretrained format, ZeRO-3 gathered): the "
                            "--init_checkpoint of the next phase.", default=True)

    def validate(self) -> None:
        check_recipe_name(self.recipe)
        report_to_names(self.report_to)
        get_preset(self.preset, self.phase)
        if not self.input_dir:
            raise InputDirError("--input_dir is required: a directory of shards from `python -m bert_ref.prep shards`")
        p = Path(self.input_dir)
        if not p.is_dir():
            raise InputDirError(f"--input_dir {p}: " + ("not a directory" if p.exists() else "no such directory"))
        hf_dir = (Path(self.init_checkpoint) / "config.json").is_file()
        habana = self.model_preset().habana_pre_ln and is_habana_checkpoint(self.init_checkpoint)
        if self.init_checkpoint and not (self.init_run_dir() or hf_dir or habana):
            raise ConfigError(f"--init_checkpoint {self.init_checkpoint}: expected a bert_ref.train run directory "
                              "(with checkpoints/) or a Hugging Face checkpoint directory with config.json "
                              "(save_pretrained format), or with a habana_pre_ln preset a Habana deepspeed-bert "
                              "checkpoint (bert_ref.habana_ckpt)")
        if self.reset_optimizer and not self.init_run_dir():
            raise ConfigError("--reset_optimizer applies to a run-directory --init_checkpoint only")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError(f"--attn_implementation {self.attn_implementation!r}: expected 'sdpa' or 'eager'")

    def init_run_dir(self) -> str:
        """--init_checkpoint when it is a run directory (has checkpoints/), else ''."""
        if not self.init_checkpoint:
            return ""
        return self.init_checkpoint if (Path(self.init_checkpoint) / "checkpoints").is_dir() else ""

    def model_preset(self) -> BertPreset:
        return get_preset(self.preset, self.phase)


@dataclass(frozen=True)
class BertSettings:
    """The settings tree of bert_ref.train: the loop, the model and its data, the optimizer and LR schedule."""

    train: TrainConfig
    model: BertArgs
    optim: OptimArgs


def check_data_matches(preset: BertPreset, data: Any, input_dir: str = "") -> None:
    """Refuse shards made for another phase: a seq-128 shard fed to a seq-512 preset would train silently on the
    wrong shape (and the other way round overflows the position embeddings)."""
    seq = getattr(data, "seq_len", None)
    preds = getattr(data, "max_predictions_per_seq", None)
    where = f" in {input_dir}" if input_dir else ""
    if seq != preset.seq_len or preds != preset.max_predictions_per_seq:
        raise PhaseMismatchError(
            f"shards{where} have seq_len={seq}, max_predictions_per_seq={preds} but preset {preset.name} phase "
            f"{preset.phase} expects seq_len={preset.seq_len}, max_predictions_per_seq="
            f"{preset.max_predictions_per_seq}; make shards with those numbers or pick --phase "
            f"{next((k for k, v in PHASES.items() if v == (seq, preds)), '?')}")
    vocab = getattr(data, "vocab_size", None)
    if isinstance(vocab, int) and vocab > preset.vocab_size:
        raise ConfigError(f"shards{where} use a vocabulary of {vocab} tokens but preset {preset.name} has "
                          f"vocab_size {preset.vocab_size}")


def main(argv: list[str] | None = None) -> int:
    """`python -m bert_ref.configs --preset bert_1p5b [--phase 2] --write_config PATH`: the preset's model
    description for `ds-tune --model PATH`."""
    from ds_core.cli import write_spec_main

    return write_spec_main(argv, prog="python -m bert_ref.configs", presets=list(PRESETS),
                           make_spec=lambda a: tuning_spec(get_preset(a.preset, a.phase)),
                           add_arguments=lambda p: p.add_argument("--phase", type=int, default=1,
                                                                  help="1: seq 128; 2: seq 512"))


if __name__ == "__main__":
    raise SystemExit(main())
