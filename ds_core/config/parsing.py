"""Command line and --config JSON into a tree of settings dataclasses: one parser built from the dataclasses
(transformers' HfArgumentParser), flat or sectioned JSON, unknown flags refused with a did-you-mean."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
import typing
from typing import Any, Sequence, TypeVar

from ds_core.config.accumulation import settle_grad_accum_dtype  # noqa: F401 - part of ds_core.config's API
from ds_core.config.run_config import config_file
from ds_core.errors import ConfigError
from ds_core.redact import dropped_placeholders

T = TypeVar("T")


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
