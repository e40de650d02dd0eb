"""Change pdsh_remote_quoted: every word of the command DeepSpeed's pdsh launch hands each node's shell is quoted.

DeepSpeed's PDSHRunner.get_cmd returns `pdsh -S -f N -w HOSTS` followed by the remote command as words, which pdsh
joins with spaces into one string that ssh hands the node's login shell:

    export K=V; ... cd CWD; PYTHON -u -m deepspeed.launcher.launch --world_info=B64 --node_rank=%n
    --master_addr=A --master_port=P [--module ...] SCRIPT ARGS...

An argument holding a space is wrapped in double quotes (PDSHRunner.parse_user_args), an exported value with shell
characters too (MultiNodeRunner.add_export; 0.16 wraps every value): inside double quotes the shell still runs
`$(...)` and backquotes and expands `$VAR`, so `--input_dir '/data/$(touch X)'` ran `touch X` on every node. The
working directory is not quoted at all: `cd /a b;` fails and the ranks start in $HOME, with relative paths. pdsh
itself replaces %h, %u and %n in the command and `%%` by `%` (chaos/pdsh src/common/pipecmd.c, pipecmd_format_arg),
which is how DeepSpeed's `--node_rank=%n` becomes each node's rank.

Here, in DeepSpeed's launcher process (stage "launcher", launch.ds_runner): get_cmd runs as DeepSpeed wrote it, each
word of its remote command is checked to be the one its code puts there, and each is written again with
shlex.quote and `%` doubled, so every value reaches the node byte for byte; `--node_rank=%n` stays for pdsh to fill,
`cd` into the working directory ends the command if it fails (`|| exit 1`), and exported values are quoted from what
add_export was given (kept beside DeepSpeed's own quoted form). Words of another shape stop the launch with one line
rather than run a string of unknown quoting. Where this change is off, launch.run refuses before launch every value
the remote shell would not take literally (launch.remote_shell).
"""
from __future__ import annotations

import os
import re
import shlex
from typing import Any

from ds_core.compat.gates import APPLIED, Outcome
from ds_core.compat.marks import replace

RAW = "ds_core_raw_exports"  # the value each add_export was given, beside DeepSpeed's quoted form
NODE_RANK = "--node_rank=%n"  # DeepSpeed's word for pdsh to fill
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class RemoteCommandShape(RuntimeError):
    """DeepSpeed built the remote command of another shape than the one this change was verified against."""


def quote(word: str) -> str:
    """One word for the remote shell through pdsh: shlex-quoted, `%` doubled (pdsh turns `%%` back into `%`)."""
    return shlex.quote(word.replace("%", "%%"))


def _exports_of(exports: dict) -> str:
    return "".join(f"export {k}={v}; " for k, v in exports.items())  # DeepSpeed's own join, as get_cmd writes it


def quoted_exports(runner: Any) -> str:
    raw = getattr(runner, RAW, {})
    missing = [k for k in runner.exports if k not in raw]
    bad = [k for k in runner.exports if not _NAME.fullmatch(k)]
    if missing or bad:
        raise RemoteCommandShape(f"exported variable(s) {', '.join(missing or bad)}: "
                                 f"{'not given through add_export' if missing else 'not a shell variable name'}")
    return "".join(f"export {k}={quote(raw[k])}; " for k in runner.exports)


def requote(runner: Any, cmd: list[str]) -> list[str]:
    """DeepSpeed's pdsh command with its remote words quoted (module docstring); RemoteCommandShape where a word is
    not where DeepSpeed's code puts it."""
    exports, cwd = _exports_of(runner.exports), os.path.abspath(".")
    try:
        start = cmd.index(exports, 1)
    except ValueError:
        raise RemoteCommandShape("no export words where DeepSpeed writes them") from None
    venv = getattr(runner.args, "venv_script", None)
    head = cmd[:start]
    if venv is not None:
        if head[-1:] != [f"source {venv};"]:
            raise RemoteCommandShape("no `source VENV;` word before the exports")
        head = head[:-1] + [f"source {quote(venv)} || exit 1;"]
    tail = [runner.user_script, *runner.user_arguments]
    body = cmd[start + 1:len(cmd) - len(tail)]
    if cmd[len(cmd) - len(tail):] != tail or not body or body[0] != f"cd {cwd};" or NODE_RANK not in body:
        raise RemoteCommandShape(f"the words after the exports are not `cd {cwd};` ... {NODE_RANK} ... SCRIPT ARGS")
    words = [f"cd {quote(cwd)} || exit 1;"] + [w if w == NODE_RANK else quote(w) for w in body[1:]]
    return head + [quoted_exports(runner), *words, quote(runner.user_script),
                   *(quote(a) for a in runner.args.user_args)]


def apply(ctx: Any) -> Outcome:
    from deepspeed.launcher import multinode_runner

    def make_export(deepspeeds: Any) -> Any:
        def add_export(self: Any, key: str, var: str) -> None:
            # MultiNodeRunner's, looked up at each call (another change of this stage may replace it)
            multinode_runner.MultiNodeRunner.add_export(self, key, var)
            self.__dict__.setdefault(RAW, {})[key.strip()] = var.strip()
        return add_export

    def make_get_cmd(deepspeeds: Any) -> Any:
        def get_cmd(self: Any, environment: Any, active_resources: Any) -> Any:
            cmd, kill_command, env = deepspeeds(self, environment, active_resources)
            try:
                return requote(self, cmd), kill_command, env
            except RemoteCommandShape as e:
                raise SystemExit(f"[ds_core] pdsh_remote_quoted: DeepSpeed's pdsh command has another shape ({e}); "
                                 f"not launching a command whose quoting is unknown. DS_TOOLKIT_CHANGES="
                                 f"off:pdsh_remote_quoted leaves DeepSpeed's own (launch.run then refuses every value "
                                 f"its shell would not take literally)") from None
        return get_cmd

    replace(multinode_runner.PDSHRunner, "add_export", make_export, "pdsh_remote_quoted")
    replace(multinode_runner.PDSHRunner, "get_cmd", make_get_cmd, "pdsh_remote_quoted")
    return APPLIED


__all__ = ["apply", "quote", "requote", "quoted_exports", "RemoteCommandShape", "RAW", "NODE_RANK"]
