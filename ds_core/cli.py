"""What every command line of ours shares: one flag spelling and one way to fail on bad input.

Flags are spelled with underscores, as DeepSpeed's and transformers' are (`--max_seq_length`, `--dry_run`);
`flag("--max_seq_length")` also accepts the dashed spelling (`--max-seq-length`) so command lines written before
the rename keep working, and `--help` shows the underscore form first.

Bad input (a config field, a hostfile line, a missing user path) ends a command with `<prog>: error: <message>` on
stderr and exit status 2 (USAGE_ERROR): the same line and status argparse gives for a bad flag, so a script or a
batch system sees one kind of "you asked for something impossible". Other statuses keep their meaning (1: a check
found problems; ds_core.loop.EXIT_STOPPED: a run stopped on request). Only the error types a command names are caught:
anything else is a bug and keeps its traceback.

Kept free of torch and deepspeed imports: the launch wrappers use it on a login node.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

USAGE_ERROR = 2  # argparse's status for a bad command line; ours for bad input found after parsing


def flag(name: str) -> tuple[str, ...]:
    """Option strings for one flag: the underscore spelling first (shown by --help; argparse takes the dest from
    it), then the dashed spelling as an alias where it differs."""
    if not name.startswith("--"):
        raise ValueError(f"flag({name!r}): expected a long option starting with --")
    dashed = "--" + name[2:].replace("_", "-")
    return (name,) if dashed == name else (name, dashed)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with allow_abbrev=False: a prefix of a flag is refused, never taken for the flag (a prefix
    silently means another flag once a longer one is added: `--use_hpu_graphs` for `--use_hpu_graphs_for_inference`).
    Both spellings of `flag()` are full option strings, so they need no prefix matching. Subcommand parsers inherit
    the class (add_subparsers uses type(self)); parents must be built with allow_abbrev=False too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def error(prog: str, message: object) -> int:
    """Print `<prog>: error: <message>` to stderr (argparse's form) and return USAGE_ERROR."""
    sys.stdout.flush()  # what the command printed before the error comes first
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return USAGE_ERROR


def run_cli(prog: str, body: Callable[[], int | None], errors: tuple[type[BaseException], ...]) -> int:
    """Run a command's body: its status (None: 0), or USAGE_ERROR with the message of one of `errors`.

    The errors of our packages carry messages written for the user (they name the file, field or line), so the
    message alone is printed; a traceback would bury it."""
    try:
        status = body()
    except errors as e:
        return error(prog, e)
    return 0 if status is None else status
