"""What every command line of ours shares: one flag spelling and one way to fail on bad input.

Flags are spelled with underscores, as DeepSpeed's and transformers' are (`--max_seq_length`, `--dry_run`);
`flag("--max_seq_length")` also accepts the dashed spelling (`--max-seq-length`) so command lines written before
the rename keep working, and `--help` shows the underscore form first. No parser takes abbreviations.

Bad input (a config field, a hostfile line, a missing user path) ends a command with `<prog>: error: <message>` on
stderr and exit status 2 (USAGE_ERROR): the same line and status argparse gives for a bad flag, so a script or a
batch system sees one kind of "you asked for something impossible". Other statuses keep their meaning (1: a check
found problems; ds_core.run.stop.EXIT_STOPPED: a run stopped on request). Only the error types a command names are
caught: anything else is a bug and keeps its traceback. A reader of stdout that leaves early (`ds-tune ... | head`)
ends the command quietly, as it ends a command killed by SIGPIPE (status 141), not with a BrokenPipeError traceback.

Kept free of torch and deepspeed imports: the launch wrappers use it on a login node.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence, TextIO

USAGE_ERROR = 2  # argparse's status for a bad command line; ours for bad input found after parsing
READER_GONE = 128 + 13  # a shell's status for a command ended by SIGPIPE (its reader, e.g. `head`, left early)


def flag(name: str) -> tuple[str, ...]:
    """Option strings for one flag: the underscore spelling first (shown by --help; argparse takes the dest from
    it), then the dashed spelling as an alias where it differs."""
    if not name.startswith("--"):
        raise ValueError(f"flag({name!r}): expected a long option starting with --")
    dashed = "--" + name[2:].replace("_", "-")
    return (name,) if dashed == name else (name, dashed)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser that takes no abbreviations (allow_abbrev=False, the project's rule for every parser): a
    prefix such as `--baseline` for `--baseline_nodes` stops working, or silently means another flag, the day a
    flag sharing the prefix is added. Subcommand parsers inherit the class (add_subparsers uses type(self)), and so
    the rule, without each add_parser call repeating it."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)


def error(prog: str, message: object) -> int:
    """Print `<prog>: error: <message>` to stderr (argparse's form) and return USAGE_ERROR."""
    sys.stdout.flush()  # what the command printed before the error comes first
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return USAGE_ERROR


def reader_gone() -> int:
    """stdout's reader has left (`... | head`): point stdout at /dev/null, so that nothing more (the interpreter's last
    flush included) raises, and return READER_GONE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return READER_GONE


def run_cli(prog: str, body: Callable[[], int | None], errors: tuple[type[BaseException], ...]) -> int:
    """Run a command's body: its status (None: 0), or USAGE_ERROR with the message of one of `errors`.

    The errors of our packages carry messages written for the user (they name the file, field or line), so the
    message alone is printed; a traceback would bury it."""
    try:
        try:
            status = body()
            sys.stdout.flush()  # a reader gone early shows here, not in the interpreter's last flush
        except BrokenPipeError:  # before `errors`: an OSError, which some commands name for their input files
            return reader_gone()
        except errors as e:
            return error(prog, e)
    except BrokenPipeError:  # error() flushes stdout first
        return reader_gone()
    return 0 if status is None else status


@contextlib.contextmanager
def json_stdout() -> Iterator[TextIO]:
    """For a command whose stdout is JSON (`--json`, `--format json`, `--out -`): yields the real stdout for the JSON
    and sends everything else to stderr while the body runs: prints, and log handlers that write to stdout, those
    there before (moved for good: a library's warning printed after the JSON breaks it as much as one before) and
    those a library creates meanwhile (DeepSpeed's logger writes to the stdout it finds when it is first imported:
    its "Setting accelerator to CPU" warning came first on ds-tune --json's stdout)."""
    real = sys.stdout
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and h.stream in (real, sys.__stdout__):
                h.setStream(sys.stderr)
    with contextlib.redirect_stdout(sys.stderr):
        yield real


def split_passthrough(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(our arguments, what follows the first `--`): the launchers hand the latter to the training module unparsed."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def cli_main(argv: Sequence[str] | None, build_parser: Callable[[], argparse.ArgumentParser],
             body: Callable[..., int | None], errors: tuple[type[BaseException], ...] = (), *,
             subcommand: str | None = None, passthrough: bool = False) -> int:
    """Every command's main(): parse `argv` (default: sys.argv[1:]) with build_parser(), run body(args), and return
    the exit status (run_cli: the body's, or USAGE_ERROR with the message of one of `errors`).

    passthrough: what follows the first `--` is not parsed but handed on, as body(args, rest). subcommand: the dest
    of the subcommand, named after the program in error messages (`ds-ckpt info: error: ...`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    rest: list[str] = []
    if passthrough:
        argv, rest = split_passthrough(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except BrokenPipeError:  # --help into a reader that left
        return reader_gone()
    prog = f"{parser.prog} {getattr(args, subcommand)}" if subcommand else parser.prog
    return run_cli(prog, (lambda: body(args, rest)) if passthrough else (lambda: body(args)), errors)


# Here rather than in ds_tools.tuning: the model packages run it (`python -m bert_ref.configs --write_config`) and
# never import the tools.
def write_spec_main(argv: Sequence[str] | None, *, prog: str, presets: Sequence[str],
                    make_spec: Callable[[argparse.Namespace], dict],
                    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None) -> int:
    """The `--preset NAME --write_config PATH` command each model package runs (`python -m bert_ref.configs`,
    `python -m bridgetower_ds.configs`): make_spec(args) turns the parsed flags into the model description that
    ds_tools.tuning.load_spec reads; one writer, so the files in ds_configs/models/ all have one format."""
    ap = ArgumentParser(prog=prog, description="Write a model preset as ds-tune's --model description.",
                        allow_abbrev=False)
    ap.add_argument("--preset", required=True, help=f"one of {', '.join(presets)}")
    add_arguments(ap)
    ap.add_argument("--write_config", required=True, help="where the JSON goes (then: ds-tune --model PATH)")
    a = ap.parse_args(argv)
    try:
        spec = make_spec(a)
    except ValueError as e:            # ConfigError / TuningError: a bad preset or flag value
        return error(prog, e)
    if "model_type" not in spec:
        raise ValueError(f"{prog}: the description of {a.preset} has no model_type")   # a bug in make_spec
    Path(a.write_config).write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
    return 0
