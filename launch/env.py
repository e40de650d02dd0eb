"""Fabric env profiles (launch/env/*.env) and the `.deepspeed_env` file DeepSpeed exports to every node.

    python -m launch.env list
    python -m launch.env show --profile efa
    python -m launch.env write --profile efa --set HCCL_SOCKET_IFNAME=ens32 --forward PT_HPU_
    python -m launch.env check [FILE]

Why the file: with a hostfile, DeepSpeed's runner exports to remote nodes only variables whose names start with
PYTHON, MLFLOW, MV2, UCX plus the accelerator's export_envs(), and the HPU accelerator returns none, so no HCCL_ or
PT_HPU_ variable reaches another node unless it is in `.deepspeed_env`. The runner reads `~/.deepspeed_env` and then
`./.deepspeed_env` (the name can be changed with $DS_ENV_FILE), one NAME=VALUE per line, and for pdsh turns each entry
into `export NAME=VALUE;` in a command line run by the remote shell, wrapping VALUE in double quotes when it has
characters outside [A-Za-z0-9_@%+=:,./-]. Inside double quotes the shell still expands `$`, backquotes and `\\`, so a
value like `$(touch /tmp/pwned)` would run on every node: such values are refused here, as are newlines (they would
end the line) and `%` (pdsh substitutes %h %u %n in the remote command). DeepSpeed also crashes on a blank line and
turns a `# comment` line into `export # ...;`, which comments out the rest of the remote command, so the file we
write has neither.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ds_core.cli import cli_main
from ds_core.files import atomic_write_text
from ds_core.redact import secret_names
from launch import log

PROFILE_DIR = Path(__file__).resolve().parent / "env"
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Characters DeepSpeed's MultiNodeRunner.add_export leaves unquoted.
DS_PLAIN_RE = re.compile(r"^[\w@%+=:,./-]*$")
# Expanded by a shell inside double quotes ($ ` \ "), or substituted by pdsh (%).
SHELL_ACTIVE = set('$`\\"%')


class EnvFileError(ValueError):
    """A bad profile or .deepspeed_env entry; the message names the file and line."""


def check_entry(name: str, value: str, where: str) -> None:
    """Refuse anything that would not reach a remote rank byte for byte, or that a shell would act on."""
    if not NAME_RE.match(name):
        raise EnvFileError(f"{where}: invalid variable name {name!r} (expected [A-Za-z_][A-Za-z0-9_]*)")
    if any(c in value for c in "\n\r\x00"):
        raise EnvFileError(f"{where}: value of {name} contains a newline or NUL; DeepSpeed reads one entry per line")
    if value != value.strip():
        raise EnvFileError(f"{where}: value of {name} has leading or trailing whitespace, which DeepSpeed strips")
    active = sorted(SHELL_ACTIVE & set(value))
    if active:
        raise EnvFileError(
            f"{where}: value of {name} contains {' '.join(active)}: DeepSpeed's pdsh launch pastes it into "
            "`export NAME=\"VALUE\"` for the remote shell, which would expand it (or pdsh would substitute %). "
            "Write the literal value instead")


def plain_warning(name: str, value: str) -> str | None:
    if DS_PLAIN_RE.match(value):
        return None
    return (f"{name}: value has characters DeepSpeed wraps in double quotes; fine for pdsh, but the openmpi/mpich/"
            "slurm backends then pass the quotes literally")


def parse_env_text(text: str, source: str, *, profile: bool = False) -> list[tuple[str, str, str]]:
    """Entries as (name, op, value) in file order; op is '=', or in profiles also '+=' (a path list prepended to
    the shell's value) or '?=' (a site value such as an interface name: the profile's value is a default that
    `launch.env write --set` may replace, and checks then only ask for the variable to be set). A .deepspeed_env
    must be exactly what DeepSpeed can read: no blank lines, no comments."""
    entries: list[tuple[str, str, str]] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.split("\n"), start=1):
        where = f"{source} line {lineno}"
        if raw.endswith("\r"):
            raise EnvFileError(f"{where}: carriage return at the end of the line (DOS line endings)")
        stripped = raw.strip()
        if not stripped:
            if lineno == len(text.split("\n")) and raw == "":  # the newline that ends the last line
                continue
            if profile:
                continue
            raise EnvFileError(f"{where}: blank line (DeepSpeed's runner fails on it)")
        if stripped.startswith("#"):
            if profile:
                continue
            raise EnvFileError(f"{where}: comment line (DeepSpeed would export it and comment out the remote command)")
        if "=" not in raw:
            raise EnvFileError(f"{where}: expected NAME=VALUE, got {raw!r}")
        name, _, value = raw.partition("=")
        op = "="
        if profile and name.endswith("+"):
            name, op = name[:-1], "+="
        elif profile and name.endswith("?"):
            name, op = name[:-1], "?="
        check_entry(name, value, where)
        if name in seen:
            raise EnvFileError(f"{where}: {name} is set twice (first on line {seen[name]})")
        seen[name] = lineno
        entries.append((name, op, value))
    return entries


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.env"))


def profile_path(name: str) -> Path:
    path = PROFILE_DIR / f"{name}.env"
    if not NAME_RE.match(name.replace("-", "_")) or not path.is_file():
        raise EnvFileError(f"unknown profile {name!r}; known: {', '.join(profile_names())}")
    return path


def _prepend(value: str, current: str) -> str:
    parts = [p for p in value.split(":") if p]
    parts += [p for p in current.split(":") if p and p not in parts]
    return ":".join(parts)


def resolve_profile(name: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The profile's variables with `+=` entries prepended to `environ`'s current value (default os.environ)."""
    environ = os.environ if environ is None else environ
    path = profile_path(name)
    out: dict[str, str] = {}
    for var, op, value in parse_env_text(path.read_text(), str(path), profile=True):
        out[var] = _prepend(value, environ.get(var, "")) if op == "+=" else value
        check_entry(var, out[var], f"{path} ({var} after prepending ${var})")
    return out


def profile_entries(name: str) -> list[tuple[str, str, str]]:
    """The profile's raw (name, op, value) entries, after checking that it resolves."""
    resolve_profile(name)
    path = profile_path(name)
    return parse_env_text(path.read_text(), str(path), profile=True)


def compare_with_profile(entries: list[tuple[str, str, str]], seen: Mapping[str, str]) -> tuple[bool, str]:
    """Whether `seen` (what a rank will get) holds the profile: `=` entries equal, `+=` path parts contained, `?=`
    entries present with any value (`launch.env write --set HCCL_SOCKET_IFNAME=ens32` is the documented override)."""
    missing, differ = [], []
    for name, op, value in entries:
        have = seen.get(name)
        if have is None:
            missing.append(name)
        elif op == "+=":
            if not all(p in have.split(":") for p in value.split(":") if p):
                differ.append(name)
        elif op == "?=":
            continue  # a site value (interface name): any value is the user's choice
        elif have != value:
            differ.append(f"{name}={have}")
    if missing or differ:
        return False, "; ".join(filter(None, [f"missing {', '.join(missing)}" if missing else "",
                                              f"differs {', '.join(differ)}" if differ else ""]))
    return True, f"{len(entries)} variables set"


def read_env_file(path: str | os.PathLike) -> dict[str, str]:
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")  # bytes: read_text() would hide a \r before the newline
    except OSError as e:
        raise EnvFileError(f"{p}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise EnvFileError(f"{p}: not UTF-8 text ({e})") from None
    return {name: value for name, _, value in parse_env_text(text, str(p))}


def format_env(entries: Mapping[str, str]) -> str:
    for name, value in entries.items():
        check_entry(name, value, f"entry {name}")
    return "".join(f"{k}={v}\n" for k, v in entries.items())


def write_env_file(path: str | os.PathLike, entries: Mapping[str, str]) -> Path:
    """Written atomically with mode 0600 whatever the umask: the file may hold a forwarded secret."""
    p = Path(path)
    atomic_write_text(p, format_env(entries), secret=True)
    return p


def deepspeed_env_files(cwd: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> list[Path]:
    """The files DeepSpeed's runner reads, in its order (later entries win): ~/NAME then ./NAME, NAME=$DS_ENV_FILE
    or .deepspeed_env. DeepSpeed fixes the name when deepspeed.launcher.runner is imported, from the launcher's env."""
    environ = os.environ if environ is None else environ
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    home = Path(environ.get("HOME") or os.path.expanduser("~"))
    here = Path(cwd) if cwd else Path.cwd()
    return [p for p in (home / name, here / name) if p.is_file()]


def load_deepspeed_env(cwd=None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Merged entries of the files DeepSpeed would read, validated (raises EnvFileError naming file and line)."""
    merged: dict[str, str] = {}
    for path in deepspeed_env_files(cwd, environ):
        merged.update(read_env_file(path))
    return merged


def parse_assignments(items: Iterable[str], where: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq:
            raise EnvFileError(f"{where}: expected NAME=VALUE, got {item!r}")
        check_entry(name, value, f"{where} {name}")
        out[name] = value
    return out


def build_entries(profile: str | None, sets: Sequence[str] = (), forward: Sequence[str] = (),
                  environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Profile values, then variables of `environ` whose names start with a `forward` prefix, then --set values."""
    environ = os.environ if environ is None else environ
    entries = resolve_profile(profile, environ) if profile else {}
    for prefix in forward:
        for name in sorted(environ):
            if name.startswith(prefix):
                check_entry(name, environ[name], f"--forward {prefix}: ${name}")
                entries[name] = environ[name]
    entries.update(parse_assignments(sets, "--set"))
    return entries


def write_merged(out: str | os.PathLike, entries: Mapping[str, str], replace: bool = False) -> tuple[Path, list[str]]:
    """Merge into an existing file (its other entries stay, in order); returns the path and the names changed."""
    p = Path(out)
    merged = {} if replace or not p.exists() else read_env_file(p)
    changed = [k for k, v in entries.items() if merged.get(k) != v]
    merged.update(entries)
    return write_env_file(p, merged), changed


# ------------------------------------------------------------------------ what launch.run hands to the ranks
def rank_env_additions(profile: str, cwd: str | os.PathLike | None = None,
                       environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables the launch wrapper itself hands to the ranks (no_ssh, mpirun: DeepSpeed exports nothing there):
    the profile, then the .deepspeed_env files, which win as they do when DeepSpeed exports them over pdsh."""
    added = resolve_profile(profile, environ) if profile else {}
    added.update(load_deepspeed_env(cwd))
    return added


def require_profile_in_deepspeed_env(profile: str, cwd: str | os.PathLike | None = None) -> None:
    """pdsh/openmpi/mpich: DeepSpeed exports .deepspeed_env itself; make sure the file is readable by it and holds
    the profile, so a node never starts without its fabric settings."""
    present = load_deepspeed_env(cwd)  # validates the file even without a profile
    if not profile:
        return
    ok, detail = compare_with_profile(profile_entries(profile), present)
    if not ok:
        raise EnvFileError(
            f"profile {profile}: .deepspeed_env {detail}. DeepSpeed exports only that file to other nodes: "
            f"run `python -m launch.env write --profile {profile}` here first (add --set NAME=VALUE for a "
            "site value)")


def mpirun_rank_env(profile: str, cwd: str | os.PathLike | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables `mpirun` passes to every rank (-x / -genv): rank_env_additions plus PYTHONPATH, which
    DeepSpeed's runners forward (PYTHON* variables); so do we."""
    out = rank_env_additions(profile, cwd, environ)
    if environ.get("PYTHONPATH"):
        out.setdefault("PYTHONPATH", environ["PYTHONPATH"])
    return out


# ---------------------------------------------------------------------------------------------------- CLI
def default_out() -> Path:
    return Path.cwd() / os.environ.get("DS_ENV_FILE", ".deepspeed_env")


def profile_summary(name: str) -> str:
    """A profile's first sentence: its leading comment lines joined, up to the first full stop that ends a line (the
    comment wraps mid-sentence; the lines after the first sentence say the file's format)."""
    words = []
    for line in profile_path(name).read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("# ").rstrip()
        words.append(text)
        if text.endswith("."):
            break
    return " ".join(words)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.env", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list the profiles in launch/env/", allow_abbrev=False)
    s = sub.add_parser("show", help="print a profile resolved against this shell (NAME=VALUE lines)",
                       allow_abbrev=False)
    s.add_argument("--profile", required=True, help="profile name: " + ", ".join(profile_names()))
    w = sub.add_parser("write", help="merge a profile into .deepspeed_env", allow_abbrev=False)
    w.add_argument("--profile", default=None, help="profile name: " + ", ".join(profile_names()))
    w.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="add or override one variable (repeatable); e.g. --set HCCL_SOCKET_IFNAME=ens32")
    w.add_argument("--forward", action="append", default=[], metavar="PREFIX",
                   help="also copy every variable of this shell whose name starts with PREFIX (repeatable), "
                        "e.g. --forward PT_HPU_ --forward HCCL_")
    w.add_argument("--out", default=None,
                   help="file to write (default ./.deepspeed_env, or ./$DS_ENV_FILE); DeepSpeed reads it from the "
                        "directory you start `deepspeed` in and from $HOME")
    w.add_argument("--replace", action="store_true", help="drop the file's existing entries instead of merging")
    c = sub.add_parser("check", help="validate .deepspeed_env files (default: the ones DeepSpeed would read here)",
                       allow_abbrev=False)
    c.add_argument("files", nargs="*", help="files to check")
    return p


def _main(args: argparse.Namespace) -> int:
    if args.cmd == "list":
        for name in profile_names():
            lines = textwrap.wrap(profile_summary(name), width=108)
            print(f"{name:10s} {lines[0]}")
            for more in lines[1:]:
                print(f"{'':10s} {more}")
    elif args.cmd == "show":
        sys.stdout.write(format_env(resolve_profile(args.profile)))
    elif args.cmd == "write":
        if not (args.profile or args.set or args.forward):
            raise EnvFileError("nothing to write: give --profile, --set or --forward")
        entries = build_entries(args.profile, args.set, args.forward)
        path, changed = write_merged(args.out or default_out(), entries, args.replace)
        for name, value in entries.items():
            msg = plain_warning(name, value)
            if msg:
                log.warn(msg, stderr=True)
        print(f"wrote {path} (mode 600): {len(entries)} entries from "
              f"{'profile ' + args.profile if args.profile else 'arguments'}; changed: {', '.join(changed) or 'none'}")
        secrets = secret_names(entries)
        if secrets:
            log.say(f"forwarded secret-looking variables: {', '.join(secrets)} (values not shown). DeepSpeed's pdsh "
                    f"launch puts every entry on each node's command line, where `ps` shows it: docs/cluster.md "
                    f"\"Security\" says how to keep a secret off it", stderr=True)
    else:
        files = [Path(f) for f in args.files] or deepspeed_env_files()
        if not files:
            print("no .deepspeed_env file here or in $HOME")
        for f in files:
            entries = read_env_file(f)
            readable = Path(f).stat().st_mode & 0o077
            secrets = secret_names(entries)
            note = f"; holds {', '.join(secrets)} and is readable by others: chmod 600 {f}" if secrets and readable \
                else ""
            print(f"{f}: ok, {len(entries)} entries{note}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(argv, build_parser, _main, (EnvFileError,))


if __name__ == "__main__":
    sys.exit(main())
