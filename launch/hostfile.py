"""DeepSpeed hostfiles (`host slots=N`): parse strictly, validate, and build them from a host list, Slurm,
an AWS Batch multi-node parallel job, or an MPI hostfile.

    python -m launch.hostfile build --hosts node1,node2 --slots 8 --out hostfile
    python -m launch.hostfile build --slurm --slots 8 --out hostfile        # SLURM_JOB_NODELIST
    python -m launch.hostfile build --aws_batch --slots 8 --out hostfile    # AWS_BATCH_JOB_* variables
    python -m launch.hostfile build --mpi_hostfile mpi_hosts --out hostfile
    python -m launch.hostfile validate hostfile --equal_slots
    python -m launch.hostfile expand_nodelist 'node[01-03,07],gpu-a[1-2]'

Every problem is reported as `FILE line N: ...` and exits with status 2.
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ds_core.cli import ArgumentParser, cli_main, flag
from ds_core.files import atomic_write_text

# A host name is also used in pdsh's comma-separated -w list, in DeepSpeed's --include syntax (NAME:SLOTS) and as a
# key of the base64 world info, so a colon, comma, '@', whitespace or shell metacharacter in it would be misread.
HOST_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
# DeepSpeed's own parser (runner._parse_hostfile) accepts `^(\S+)\s+slots=(\d+)` and ignores the rest of the line;
# we are stricter: trailing garbage such as `slots=8 max_slots=8` is an MPI-ism DeepSpeed silently drops.
LINE_RE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\S+)$")


class HostfileError(ValueError):
    """A hostfile (or host source) problem; the message starts with `WHERE line N:` where a line is known."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int = 0  # 1-based line in the source file (0: built in memory)



def _add_host(hosts: list, seen: dict, name: str, slots: int, position: int, where: str, first: str) -> None:
    """The checks every host source shares: at least one slot, no host twice (`first` says where it came first)."""
    if slots <= 0:
        raise HostfileError(f"{where}: host {name} has slots={slots} (a host needs at least 1 slot)")
    if name in seen:
        raise HostfileError(f"{where}: duplicate host {name} (first {first} {seen[name]})")
    seen[name] = position
    hosts.append(Host(name, slots, position))

def _where(source: str, line: int) -> str:
    return f"{source} line {line}" if source else f"line {line}"


def check_host_name(name: str, where: str) -> None:
    if not HOST_RE.match(name):
        raise HostfileError(f"{where}: bad host name {name!r} (expected letters, digits, '.', '_', '-'; "
                            "no ':' ',' '@' or spaces)")


def parse_hostfile(text: str, source: str = "") -> list[Host]:
    """Parse DeepSpeed hostfile text. Blank lines and `#` comments are skipped (DeepSpeed skips them too)."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = _where(source, lineno)
        m = LINE_RE.match(line)
        if not m:
            raise HostfileError(f"{where}: expected 'HOST slots=N', got {line!r}")
        name, slots_text = m.group("host"), m.group("slots")
        check_host_name(name, where)
        if not slots_text.isdigit():
            raise HostfileError(f"{where}: slots must be a whole number, got slots={slots_text!r}")
        _add_host(hosts, seen, name, int(slots_text), lineno, where, "on line")
    if not hosts:
        raise HostfileError(f"{source or 'hostfile'}: no hosts (every line is blank or a comment)")
    return hosts


def validate_hosts(hosts: Sequence[Host], source: str = "", *, equal_slots: bool = False, nodes: int = 0,
                   slots: int = 0) -> None:
    """Checks that depend on the run: equal slots (mpich/impi/slurm launchers, one launcher per node), the number
    of nodes the run asks for, the slots each host must offer."""
    if nodes and len(hosts) < nodes:
        raise HostfileError(f"{source or 'hostfile'}: the run needs {nodes} nodes, the hostfile lists {len(hosts)}")
    used = hosts[:nodes] if nodes else hosts
    for h in used:
        if slots and h.slots < slots:
            raise HostfileError(f"{_where(source, h.line)}: host {h.name} has slots={h.slots}, the run needs {slots}")
    if equal_slots and used:
        first = used[0]
        for h in used[1:]:
            if h.slots != first.slots:
                raise HostfileError(
                    f"{_where(source, h.line)}: host {h.name} has slots={h.slots} but {first.name} "
                    f"(line {first.line}) has slots={first.slots}; this launch needs the same slots on every host")


def read_hostfile(path: str | os.PathLike, **checks) -> list[Host]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise HostfileError(f"{p}: cannot read hostfile ({e.strerror})") from None
    hosts = parse_hostfile(text, str(p))
    validate_hosts(hosts, str(p), **checks)
    return hosts


def format_hostfile(hosts: Iterable[Host]) -> str:
    return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)


def write_hostfile(hosts: Sequence[Host], path: str | os.PathLike) -> Path:
    """Validate, then write atomically (a reader never sees half a hostfile)."""
    text = format_hostfile(hosts)
    parse_hostfile(text, str(path))  # re-parse what we are about to write: duplicates, zero slots, bad names
    p = Path(path)
    atomic_write_text(p, text)  # a temporary file made anew, renamed into place
    return p


def hosts_from_names(names: Sequence[str], slots: int, source: str) -> list[Host]:
    """`a,b:4` style items: a bare name gets `slots`; `name:N` sets its own."""
    hosts, seen = [], {}
    for i, item in enumerate(names, start=1):
        where = _where(source, i)
        name, _, n = item.strip().partition(":")
        check_host_name(name, where)
        if n and not n.isdigit():
            raise HostfileError(f"{where}: slots must be a whole number, got {item!r}")
        _add_host(hosts, seen, name, int(n) if n else slots, i, where, "as item")
    if not hosts:
        raise HostfileError(f"{source}: no hosts given")
    return hosts


# ---------------------------------------------------------------------------------------------------- Slurm
# Slurm prints node lists compressed: `node[01-03,07],gpu-a[1-2]`, `rack[1-2]-n[1-2]`. The canonical expander is
# `scontrol show hostnames`, but it only exists where the Slurm client is installed and configured (not inside many
# containers, not on a login-less AWS node, not in CI), so we expand the grammar ourselves. Zero padding follows the
# width of the lower bound (`[08-10]` -> 08 09 10), as Slurm does.
def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostfileError(f"nodelist {text!r}: ']' without '['")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise HostfileError(f"nodelist {text!r}: '[' without ']'")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_range_list(body: str, whole: str) -> list[str]:
    out = []
    for piece in body.split(","):
        piece = piece.strip()
        lo, dash, hi = piece.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise HostfileError(f"nodelist {whole!r}: bad range {piece!r} inside [...]")
        if not dash:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise HostfileError(f"nodelist {whole!r}: range {piece!r} goes backwards")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(a, b + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm compressed node list into host names, in order."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        # alternate literal text and bracket groups; the product of all groups gives the names
        tokens = re.split(r"(\[[^\]]*\])", item)
        choices = [_expand_range_list(t[1:-1], nodelist) if t.startswith("[") else [t] for t in tokens]
        for combo in itertools.product(*choices):
            hosts.append("".join(combo))
    if not hosts:
        raise HostfileError(f"nodelist {nodelist!r}: no hosts")
    return hosts


def hosts_from_slurm(env: Mapping[str, str], slots: int, nodelist: str = "") -> list[Host]:
    nodelist = nodelist or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    if not nodelist:
        raise HostfileError("slurm: SLURM_JOB_NODELIST is not set (run inside an allocation, or pass --nodelist)")
    return hosts_from_names(expand_nodelist(nodelist), slots, f"SLURM_JOB_NODELIST={nodelist}")


# ------------------------------------------------------------------------------------------------ AWS Batch
def aws_batch_info(env: Mapping[str, str]) -> dict:
    """The AWS Batch multi-node parallel job variables, checked. The main node's own address variable is only set on
    child nodes (AWS documents AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS as absent on the main node)."""
    def need_int(name: str) -> int:
        value = env.get(name, "")
        if not value.isdigit():
            raise HostfileError(f"aws batch: {name}={value!r}, expected a whole number "
                                "(is this a multi-node parallel job?)")
        return int(value)

    num_nodes = need_int("AWS_BATCH_JOB_NUM_NODES")
    index = need_int("AWS_BATCH_JOB_NODE_INDEX")
    main_index = int(env.get("AWS_BATCH_JOB_MAIN_NODE_INDEX", "0") or 0)
    if num_nodes < 1 or not 0 <= index < num_nodes:
        raise HostfileError(f"aws batch: node index {index} is outside 0..{num_nodes - 1}")
    main_addr = env.get("AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS", "")
    if index != main_index and not main_addr:
        raise HostfileError("aws batch: AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS is not set on a child node")
    return {"num_nodes": num_nodes, "index": index, "main_index": main_index, "main_addr": main_addr,
            "is_main": index == main_index}


def hosts_from_aws_batch(env: Mapping[str, str], slots: int, addrs: Sequence[str] = ()) -> list[Host]:
    """Hosts in node-index order. With `addrs` (every node's private IP, index order, e.g. collected by
    launch.aws_batch) the file works for ssh launches; without, the names are placeholders `aws-batch-node-I`, which
    is enough for one launcher per node (`--no_ssh --node_rank I`): there host names are only keys that fix the rank
    order, and every node can build the identical file from its own environment."""
    info = aws_batch_info(env)
    n = info["num_nodes"]
    if addrs:
        if len(addrs) != n:
            raise HostfileError(f"aws batch: {len(addrs)} addresses given for AWS_BATCH_JOB_NUM_NODES={n}")
        names = list(addrs)
    else:
        names = [f"aws-batch-node-{i}" for i in range(n)]
    return hosts_from_names(names, slots, "aws batch")


# ---------------------------------------------------------------------------------------------------- MPI
MPI_LINE_RE = re.compile(r"^(?P<host>[^\s:]+)(?::(?P<colon>\S+))?(?P<rest>(\s+\S+)*)$")


def hosts_from_mpi_hostfile(text: str, source: str, slots: int = 0) -> list[Host]:
    """OpenMPI (`host slots=N [max_slots=M]`), MPICH/Hydra (`host:N`) or bare `host` lines (1 slot per line; a host
    repeated on several lines adds up, as both MPIs count it). `slots` (if > 0) overrides every count."""
    counts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = _where(source, lineno)
        m = MPI_LINE_RE.match(line)
        if not m:
            raise HostfileError(f"{where}: not an MPI hostfile line: {line!r}")
        name = m.group("host")
        check_host_name(name, where)
        n = 1
        if m.group("colon") is not None:
            if not m.group("colon").isdigit():
                raise HostfileError(f"{where}: expected HOST:N, got {line!r}")
            n = int(m.group("colon"))
        for field in m.group("rest").split():
            key, _, value = field.partition("=")
            if key in ("slots", "cpu", "cpus"):
                if not value.isdigit():
                    raise HostfileError(f"{where}: {key} must be a whole number, got {field!r}")
                n = int(value)
            elif key not in ("max_slots", "max-slots"):
                raise HostfileError(f"{where}: unknown field {field!r}")
        if n == 0:
            raise HostfileError(f"{where}: host {name} has 0 slots")
        counts[name] = counts.get(name, 0) + n
        first_line.setdefault(name, lineno)
    if not counts:
        raise HostfileError(f"{source}: no hosts")
    return [Host(name, slots or n, first_line[name]) for name, n in counts.items()]


# ---------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m launch.hostfile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="write a DeepSpeed hostfile from one host source")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--hosts", help="comma-separated host names; `name:N` gives one host its own slot count")
    src.add_argument("--slurm", action="store_true",
                     help="hosts from SLURM_JOB_NODELIST (compressed ranges such as node[01-03,07] are expanded)")
    src.add_argument(*flag("--aws_batch"), action="store_true",
                     help="hosts from an AWS Batch multi-node parallel job (AWS_BATCH_JOB_NUM_NODES, "
                          "AWS_BATCH_JOB_NODE_INDEX, AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS)")
    src.add_argument(*flag("--mpi_hostfile"), metavar="FILE",
                     help="convert an OpenMPI (`host slots=N`) or MPICH (`host:N`) hostfile")
    b.add_argument("--slots", type=int, default=None,
                   help="slots (accelerators) per host where the source does not say; default $LAUNCH_SLOTS or 8. "
                        "For --mpi_hostfile a value given here overrides the file's counts")
    b.add_argument("--nodelist", default="", help="with --slurm: use this node list instead of SLURM_JOB_NODELIST")
    b.add_argument("--addrs", default="",
                   help="with --aws_batch: every node's private IP in node-index order (comma-separated); "
                        "without it host names are placeholders fit only for --no_ssh launches")
    b.add_argument(*flag("--equal_slots"), action="store_true", help="fail unless every host has the same slots")
    b.add_argument("--out", default="hostfile", help="file to write (default: ./hostfile); '-' prints it")

    v = sub.add_parser("validate", help="check a DeepSpeed hostfile; exit 2 naming the bad line")
    v.add_argument("file", help="hostfile to check")
    v.add_argument(*flag("--equal_slots"), action="store_true",
                   help="require the same slots on every host (mpich/impi/slurm launchers, --no_ssh per node)")
    v.add_argument("--nodes", type=int, default=0, help="the run uses the first N hosts; fail if fewer (0: all)")
    v.add_argument("--slots", type=int, default=0, help="each used host must offer at least this many slots")

    e = sub.add_parser("expand_nodelist", aliases=["expand-nodelist"],
                       help="print a Slurm compressed node list one host per line")
    e.add_argument("nodelist", help="e.g. 'node[01-03,07],gpu-a[1-2]'")
    return p


def _main(args: argparse.Namespace) -> int:
    if args.cmd == "validate":
        hosts = read_hostfile(args.file, equal_slots=args.equal_slots, nodes=args.nodes, slots=args.slots)
        print(f"{args.file}: ok, {len(hosts)} hosts, {sum(h.slots for h in hosts)} slots")
    elif args.cmd in ("expand_nodelist", "expand-nodelist"):
        print("\n".join(expand_nodelist(args.nodelist)))
    else:
        explicit = args.slots is not None
        if not explicit:
            args.slots = int(os.environ.get("LAUNCH_SLOTS", "8"))
        if args.slots <= 0:
            raise HostfileError(f"--slots must be at least 1, got {args.slots}")
        if args.hosts is not None:
            hosts = hosts_from_names(args.hosts.split(","), args.slots, "--hosts item")
        elif args.slurm:
            hosts = hosts_from_slurm(os.environ, args.slots, args.nodelist)
        elif args.aws_batch:
            addrs = [a for a in args.addrs.split(",") if a]
            hosts = hosts_from_aws_batch(os.environ, args.slots, addrs)
        else:
            src = Path(args.mpi_hostfile)
            try:
                text = src.read_text()
            except OSError as e:
                raise HostfileError(f"{src}: cannot read MPI hostfile ({e.strerror})") from None
            hosts = hosts_from_mpi_hostfile(text, str(src), args.slots if explicit else 0)
        validate_hosts(hosts, "", equal_slots=args.equal_slots)
        if args.out == "-":
            sys.stdout.write(format_hostfile(hosts))
        else:
            write_hostfile(hosts, args.out)
            print(f"wrote {args.out}: {len(hosts)} hosts, {sum(h.slots for h in hosts)} slots")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(argv, build_parser, _main, (HostfileError,))


if __name__ == "__main__":
    sys.exit(main())
