"""What reaches a remote shell under `--launcher pdsh`, checked before anything starts.

DeepSpeed's pdsh launch (PDSHRunner.get_cmd) hands every node's login shell ONE command string: the exported
variables (the PYTHON*, MLFLOW*, MV2*, UCX* variables of this environment, the accelerator's export_envs() and the
.deepspeed_env entries), `cd` into this working directory, the interpreter, the master address and port, and the
module's arguments. Each of these values is either made safe or refused here, naming it:

- with the change pdsh_remote_quoted on (ds_core.compat.pdsh_quoting: DeepSpeed's launcher process quotes every word
  with shlex.quote), any value reaches the node byte for byte: only what a shell cannot carry in an argument at all
  (a NUL) and a variable name that is not a shell name are refused;
- with it off (switched off, or a DeepSpeed whose get_cmd was not verified), DeepSpeed's own quoting runs, so every
  value must be one no shell acts on: the module's arguments, the working directory and the master address plain
  (letters, digits, `_ @ + = : , . / -`), exported values free of `$`, backquotes, `\\`, `"`, `%` and newlines
  (launch.env.check_entry's rule, which .deepspeed_env entries always follow).

The master address must be a host name or address in any case. One host in the hostfile is no remote launch:
DeepSpeed then starts its local launcher with an argument list, and nothing here applies.

Secret-looking variables (ds_core.redact) that pdsh would export are named in one warning line: pdsh offers no
channel but the command line, which `ps` on every node shows (docs/cluster.md "Security").
"""
from __future__ import annotations

import os
import re
from typing import Iterable, Mapping, Sequence

from launch import env as envmod

CHANGE = "pdsh_remote_quoted"
PLAIN = re.compile(r"[\w@+=:,./-]+", re.ASCII)  # characters no shell acts on, in or out of quotes (no %: pdsh's)
ADDRESS = re.compile(r"[A-Za-z0-9._:-]+")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class RemoteShellError(ValueError):
    """A value that would reach a remote shell unsafely; the message names it."""


def quoting_state() -> str:
    """The change's state as DeepSpeed's launcher process will apply it ("on" or "off: why"): the same switch
    (DS_TOOLKIT_CHANGES) and the same installed DeepSpeed."""
    from ds_core.compat.changes import outcome

    return str(outcome(CHANGE))


def exported_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` DeepSpeed's runner exports to every node (its EXPORT_ENVS prefixes and the
    accelerator's export_envs(), read from the installed DeepSpeed)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher import runner

    prefixes = tuple(runner.EXPORT_ENVS) + tuple(get_accelerator().export_envs())
    return {k: v for k, v in environ.items() if k.startswith(prefixes)}


def _off_why(state: str) -> str:
    return f"the change {CHANGE} that quotes it is {state} (DS_TOOLKIT_CHANGES)"


def check_words(values: Iterable[tuple[str, str]], state: str) -> None:
    """(what, value) pairs that become words of the remote command: module arguments, the module, paths."""
    for what, value in values:
        if "\x00" in value:
            raise RemoteShellError(f"pdsh: {what} {value!r} holds a NUL byte")
        if state != "on" and not PLAIN.fullmatch(value):
            raise RemoteShellError(
                f"pdsh: {what} {value!r} has characters the nodes' shell would act on (DeepSpeed's pdsh launch "
                f"pastes it into one remote command line), and {_off_why(state)}: give the value without them, or "
                f"start with --launcher no_ssh / mpirun / srun, which pass arguments as a list")


def check_exports(exported: Mapping[str, str], state: str) -> None:
    for name, value in exported.items():
        if not NAME.fullmatch(name):
            raise RemoteShellError(f"pdsh: exported variable {name!r} is not a shell variable name; unset it or "
                                   f"start with another --launcher")
        if state != "on":
            try:
                envmod.check_entry(name, value.strip(), f"pdsh export of ${name}")
            except envmod.EnvFileError as e:
                raise RemoteShellError(f"{e}; {_off_why(state)}") from None


def check_launch(words: Sequence[tuple[str, str]], master_addr: str, cwd: str | None,
                 environ: Mapping[str, str], deepspeed_env: Mapping[str, str]) -> list[str]:
    """Everything a pdsh launch puts into the remote command (module docstring); raises RemoteShellError naming the
    first value that would not reach the nodes literally. Returns the secret-looking names it would export."""
    from ds_core.redact import secret_names

    state = quoting_state()
    if master_addr and not ADDRESS.fullmatch(master_addr):
        raise RemoteShellError(f"pdsh: --master_addr {master_addr!r}: expected a host name or address")
    here = os.path.abspath(cwd or ".")
    check_words([*words, ("working directory", here)], state)
    exported = {**exported_environment(environ), **deepspeed_env}
    check_exports(exported, state)
    return secret_names(exported)


__all__ = ["RemoteShellError", "check_launch", "check_words", "check_exports", "exported_environment",
           "quoting_state", "PLAIN", "CHANGE"]
