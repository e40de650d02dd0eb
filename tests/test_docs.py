"""Every command shown in README.md and docs/*.md parses with today's flags, so the docs cannot drift from the code.

A command is checked when it starts with one of our entry points: `python -m <our module>` or `python <our file>.py`,
our console scripts (pyproject's [project.scripts]), `deepspeed [opts] --module <ours>` / `deepspeed <our file>`,
`torchrun ... -m <ours>`, `mpirun ... python -m ...`, `launch/run.sh`, `sbatch ... launch/slurm_job.sh` and
`make <target>`. Commands of other programs (cat, hf download, rm) are left alone.

How a command is checked: in this process, the entry point's own `main(argv)` runs with the shown arguments until
its argument parsing is over, then stops (argparse's `parse_args` is wrapped to stop right after it returns; for
the training modules, whose settings go through `ds_core.config.parse_args` and each section's `validate()`, the stop
is where the run would first touch the run directory or start distributed work). Nothing trains, nothing is
launched. Launchers are followed: `deepspeed`'s and `torchrun`'s own flags are parsed by their own parsers, then the
module's arguments are checked against the module; `launch.run` / `launch.aws_batch` / `launch.slurm` hand the
arguments after `--` (plus `--preset` / `--deepspeed_config`, as `launch.run.train_args` does) to `--module`, and
`launch.guard` hands its REMAINDER to its module.

Conventions of the docs (docs/development.md says the same):
  * `$VAR` / `${VAR}` and `<NAME>` are placeholders: a name with PORT becomes 29500, one with ADDR or IP
    127.0.0.1, anything else 0; paths in commands need not exist (existence checks of input directories are
    answered "yes" while a training module validates its settings).
  * A literal `...` argument means "more arguments elided": such a command is checked for unknown flags and bad
    values only, not for missing required ones.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import re
import shlex
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.9 / 3.10 (e.g. Gaudi images): the same parser as a package
    import tomli as tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import ds_core.run.setup
from ds_core.cli import split_passthrough

REPO = Path(__file__).resolve().parents[1]
OUR_PACKAGES = ("bert_ref", "bridgetower_ds", "ds_core", "ds_tools", "launch", "bench", "studies")
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
# Messages that mean an argument the entry point does not take or a value it refuses, as opposed to one missing.
UNKNOWN_OR_BAD = ("unrecognized arguments", "unknown command-line argument", "invalid choice", "invalid ",
                  "expected one argument", "ambiguous option", "not allowed with")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass
class Command:
    where: str  # file:line of the command's first line
    text: str
    argv: list[str] = field(default_factory=list)
    partial: bool = False  # a literal `...` stood for elided arguments


def console_scripts() -> dict[str, str]:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: target.split(":")[0] for name, target in scripts.items()}


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


def _placeholder(name: str) -> str:
    upper = name.upper()
    if "PORT" in upper:
        return "29500"
    if "ADDR" in upper or upper.endswith("IP"):
        return "127.0.0.1"
    return "0"


def substitute(text: str) -> str:
    text = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: _placeholder(m.group(1) or m.group(2)), text)
    return re.sub(r"<([A-Za-z_][\w-]*)>", lambda m: _placeholder(m.group(1)), text)


def shell_commands(path: Path, root: Path = REPO) -> list[Command]:
    """Commands of the shell code blocks of a Markdown file: continuation lines joined, comments dropped, placeholders
    substituted, `...` noted; pipelines, redirections and here-documents are left out (not entry points)."""
    out: list[Command] = []
    fence, pending, start = None, "", 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            pending = ""
            continue
        if fence is None or fence not in SHELL_FENCES:
            continue
        if not pending:
            start = n
        body = stripped[2:] if stripped.startswith("$ ") else stripped
        if body.endswith("\\"):
            pending += body[:-1] + " "
            continue
        body = pending + body
        pending = ""
        body = re.sub(r"(^|\s)#.*$", "", body).strip()  # a comment, whole-line or trailing
        if not body or re.search(r"\s(\|\|?|>>?|<<\S*|&&|;)(\s|$)", f" {body} "):
            continue
        argv = shlex.split(substitute(body))
        out.append(Command(f"{path.relative_to(root)}:{start}", body, [a for a in argv if a != "..."], "..." in argv))
    return out


class Parsed(Exception):
    """Raised right after an entry point finished parsing its arguments."""

    def __init__(self, ns=None):
        super().__init__("parsed")
        self.ns = ns


class Refused(Exception):
    """The arguments did not parse: the message is the entry point's."""


def _split_env(argv: list[str]) -> list[str]:
    while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):
        argv = argv[1:]
    if argv[:1] == ["env"]:
        return _split_env(argv[1:])
    return argv


def _is_python(tok: str) -> bool:
    return re.fullmatch(r"(\S*/)?python3?(\.\d+)?", tok) is not None


def _module_of_path(path: str) -> str | None:
    p = Path(path)
    if p.suffix != ".py" or p.parts[:1] == ("..",) or p.is_absolute() or p.parts[0] not in OUR_PACKAGES:
        return None
    return ".".join(p.with_suffix("").parts)


def _ours(module: str) -> bool:
    return module.split(".")[0] in OUR_PACKAGES


def _load(module: str):
    """Import a module by name; a file that is not importable as one (bench/ today) is loaded by path."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        file = REPO / (module.replace(".", "/") + ".py")
        if not file.is_file():
            raise Refused(f"no module or file {module}") from None
        spec = importlib.util.spec_from_file_location(f"_docs_{module.replace('.', '_')}", file)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    if hasattr(mod, "__path__"):  # a package run with `python -m pkg`
        mod = importlib.import_module(module + ".__main__")
    return mod


def _run_parse(module: str, argv: list[str], monkeypatch: pytest.MonkeyPatch):
    """Run `module`'s main(argv) until its arguments are parsed; return the namespace (or None)."""
    mod = _load(module)
    main = getattr(mod, "main", None)
    if main is None:
        raise Refused(f"{module} has no main()")
    orig_parse_args = argparse.ArgumentParser.parse_args

    def stop_after_parse(self, args=None, namespace=None):
        raise Parsed(orig_parse_args(self, args, namespace))

    def stop(*_a, **_k):
        raise Parsed()

    def refuse_exec(*a, **_k):
        raise Refused(f"{module} tried to start a process before its arguments were parsed: {a[:2]}")

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop_after_parse)
        for name in ("execv", "execve", "execvp", "execvpe"):
            m.setattr(os, name, refuse_exec)
        # bench/bert_step.py re-executes itself once to set malloc tunables; that branch is not argument parsing
        m.setenv("GLIBC_TUNABLES", os.environ.get("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"))
        m.setattr(sys, "argv", [module, *argv])
        # an entry point parses in its own module or through ds_core.run.setup.start_run: patch whichever it uses
        for where, parser in [(w, p) for w in ((mod, ds_core.run.setup) if hasattr(mod, "start_run") else (mod,))
                              for p in ("parse_args", "parse_settings")]:
            if hasattr(where, parser) and getattr(getattr(where, parser), "__module__", "").startswith(
                    "ds_core.config"):
                real = getattr(where, parser)

                def parse_then_validate(*a, _real=real, **k):
                    # paths in docs are examples: validate() answers "exists" for them, everything else is checked
                    with monkeypatch.context() as fs:
                        for attr in ("exists", "is_dir", "is_file"):
                            fs.setattr(Path, attr, lambda self: True)
                        return _real(*a, **k)

                m.setattr(where, parser, parse_then_validate)
                for name in ("prepare_run_dir", "init_distributed"):
                    if hasattr(where, name):
                        m.setattr(where, name, stop)
        if hasattr(mod, "check_dataset"):  # opens the dataset from the offline cache: not argument parsing
            m.setattr(mod, "check_dataset", lambda *a, **k: None)
        if hasattr(mod, "resolve_pretrained"):  # resolves hub ids in the local cache: not argument parsing
            m.setattr(mod, "resolve_pretrained", lambda value, *a, **k: value)
        if hasattr(mod, "check_model_dir"):  # the model directory a doc names is an example
            m.setattr(mod, "check_model_dir", lambda *a, **k: None)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                main(argv) if inspect.signature(main).parameters else main()
        except Parsed as p:
            return p.ns
        except SystemExit as e:
            raise Refused(err.getvalue().strip() or f"exit {e.code}") from None
        except Refused:
            raise
        except Exception as e:  # noqa: BLE001 - the entry point's own error is the message to show
            raise Refused(f"{type(e).__name__}: {e}") from None
    raise Refused(f"{module}.main returned without parsing its arguments")


def _parse_with(parser: argparse.ArgumentParser, argv: list[str]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        raise Refused(err.getvalue().strip()) from None


def check_module(module: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse argv with `module`'s entry point, then follow it into the module it launches."""
    if not _ours(module):
        raise Refused(f"{module} is not one of our modules ({', '.join(OUR_PACKAGES)})")
    ns = _run_parse(module, argv, monkeypatch)
    name = module.removesuffix(".__main__")
    if name in ("launch.run", "launch.aws_batch", "launch.slurm"):
        from launch import run

        _, extra = split_passthrough(argv)
        check_module(ns.module, run.train_args(ns, extra), monkeypatch)
    elif name == "launch.guard":
        check_module(ns.module, list(ns.args), monkeypatch)


def check_argv(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> bool:
    """Check one command; False when it is not one of ours (nothing to check)."""
    argv = _split_env(argv)
    if not argv:
        return False
    head, rest = argv[0], argv[1:]
    scripts = console_scripts()
    if head in scripts:
        check_module(scripts[head], rest, monkeypatch)
    elif _is_python(head):
        if rest[:1] == ["-m"] and len(rest) > 1:
            if not _ours(rest[1]):
                return False
            check_module(rest[1], rest[2:], monkeypatch)
        elif rest and _module_of_path(rest[0]):
            check_module(_module_of_path(rest[0]), rest[1:], monkeypatch)
        else:
            return False
    elif head == "deepspeed":
        from deepspeed.launcher.runner import parse_args as ds_parse_args

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ds = ds_parse_args(rest)
        except SystemExit:
            raise Refused("deepspeed: " + err.getvalue().strip()) from None
        module = ds.user_script if ds.module else _module_of_path(ds.user_script)
        if module is None:
            raise Refused(f"deepspeed runs {ds.user_script}, not one of our modules")
        check_module(module, list(ds.user_args), monkeypatch)
    elif head == "torchrun":
        from torch.distributed.run import get_args_parser

        tr = _parse_with(get_args_parser(), rest)
        module = tr.training_script if tr.module else _module_of_path(tr.training_script)
        if module is None:
            raise Refused(f"torchrun runs {tr.training_script}, not one of our modules")
        check_module(module, list(tr.training_script_args), monkeypatch)
    elif head in ("mpirun", "srun", "sbatch"):  # their own options first; our command starts at python / our script
        for i, tok in enumerate(rest):
            if _is_python(tok) or tok.startswith("launch/"):
                return check_argv(rest[i:], monkeypatch)
        return False
    elif head == "launch/run.sh":  # `exec python -m launch.run "$@"`
        check_module("launch.run", rest, monkeypatch)
    elif head == "launch/slurm_job.sh":  # `exec launch/run.sh --launcher srun "$@"`
        check_module("launch.run", ["--launcher", "srun", *rest], monkeypatch)
    elif head == "make":
        targets = [t for t in rest if not t.startswith("-") and "=" not in t]
        missing = [t for t in targets if t not in make_targets()]
        if missing or not targets:
            raise Refused(f"make: no target {missing or targets} in Makefile (targets: {sorted(make_targets())})")
    else:
        return False
    return True


def all_commands() -> list[Command]:
    return [c for f in doc_files() for c in shell_commands(f)]


def verdict(cmd: Command, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """None if the command parses (or is not ours); else the reason, which the test shows with file:line."""
    try:
        check_argv(cmd.argv, monkeypatch)
    except Refused as e:
        msg = str(e)
        if "usage:" in msg and "error:" in msg:  # argparse: the usage block is long, the error line says it
            msg = msg[msg.rindex("\n", 0, msg.index("error:")) + 1:] if "\n" in msg[:msg.index("error:")] else msg
        if cmd.partial and not any(s in msg for s in UNKNOWN_OR_BAD):
            return None  # arguments were elided: a missing one is expected
        return msg
    return None


COMMANDS = all_commands()


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_doc_command_parses(cmd: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    reason = verdict(cmd, monkeypatch)
    assert reason is None, f"{cmd.where}: `{cmd.text}` does not parse:\n{reason}"


def test_docs_show_our_commands() -> None:
    """The docs' commands are found at all (an extractor that finds nothing would pass every check above)."""
    starts = {c.argv[0] for c in COMMANDS if c.argv}
    assert {"make", "deepspeed", "python", "bert-prep", "ds-study", "ds-tune", "ds-scaling-report"} <= starts
    assert len(COMMANDS) >= 40


@pytest.mark.parametrize("text, fragment", [
    ("python -m bert_ref.prep shards --input t --vocab v --output o --max-seq-lenght 128", "unrecognized"),
    ("bert-prep vocab --vocab-size 30522", "required"),  # --output missing
    ("deepspeed --num_gpus 2 --module bert_ref.train --preset debug --input_dir d --learning_rte 1e-3", "learning_rte"),
    ("deepspeed --num_gpus 2 --module bert_ref.train --preset bert_huge --input_dir d", "bert_huge"),
    ("deepspeed --num_gpus 2 --module bert_ref.train --preset debug", "--input_dir is required"),
    ("ds-tune --model bert-large --accelerator gaudi \\\n  --nodes 2 --global_batch_sizes_x 64", "ds-tune: error"),
    ("python -m launch.run --launcher no_ssh -- --preset debug --input_dir d --bogus_flag 1", "bogus_flag"),
    ("python -m launch.guard --mpi bert_ref.train --input_dir d --preset debug --no_such 1", "no_such"),
    ("deepspeed --num_gpuz 2 --module bert_ref.train --preset debug --input_dir d", "--num_gpuz"),
    ("make deploy", "no target"),
    ("python -m launch.hostfile validate hostfile --equal_slotz ...", "unrecognized"),
])
def test_checker_refuses_a_bad_command(text: str, fragment: str, tmp_path: Path, monkeypatch) -> None:
    doc = tmp_path / "page.md"
    doc.write_text(f"# t\n\n```bash\n{text}\n```\n")
    (cmd,) = shell_commands(doc, root=tmp_path)
    reason = verdict(cmd, monkeypatch)
    assert reason is not None and fragment in reason, reason


@pytest.mark.parametrize("text", [
    "python -m bert_ref.prep shards --input t --vocab v --output o --max-seq-length 128",
    "deepspeed --num_gpus 2 --module bert_ref.train --preset debug --input_dir /nowhere --run_dir <RUN_DIR>",
    "python -m launch.run --launcher no_ssh --node_rank $NODE_INDEX --master_addr $MAIN_IP --preset debug -- "
    "--input_dir d",
    "deepspeed --num_gpus 8 --module bert_ref.train ...",
    "make test",
])
def test_checker_accepts_a_good_command(text: str, tmp_path: Path, monkeypatch) -> None:
    doc = tmp_path / "page.md"
    doc.write_text(f"# t\n\n```bash\n{text}\n```\n")
    (cmd,) = shell_commands(doc, root=tmp_path)
    assert verdict(cmd, monkeypatch) is None



def github_anchor(heading: str) -> str:
    """GitHub's id for a Markdown heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            out.add(github_anchor(line.lstrip("#")))
    return out


# Pages another branch writes (docs/checkpoints_resize.md: resuming onto another world size); drop an entry once its
# page is merged, so that the link is checked again.
def test_doc_links_resolve() -> None:
    """Every relative link of README.md and docs/*.md names a file that exists, and a #anchor a heading it has."""
    bad = []
    for doc in doc_files():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(REPO)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{doc.relative_to(REPO)}: {target}: no heading with that anchor in {dest.name}")
    assert not bad, "\n".join(bad)


# Flags whose value a command writes (an output), not a file the docs claim exists.
OUTPUT_FLAGS = {"--out", "--plot", "--write_config", "--output", "--run_dir", "--output_dir", "--out_dir"}
# Flags whose value is a file the command reads.
INPUT_FLAGS = {"--from_table", "--deepspeed_config", "--hostfile"}  # --model, --config: the user's own files
# A path inside this repository, as the docs write it (relative to the repository root).
REPO_PATH = re.compile(r"^(?:studies|ds_configs|tests|docs|tools|launch|bench|bert_ref|bridgetower_ds|ds_core|"
                       r"ds_tools)/[\w./-]+$")


def _named_files(cmd: Command) -> list[str]:
    """Files of this repository a documented command reads: the value of an input flag, or an argument written as a
    path inside the repository, unless an output flag precedes it."""
    out = []
    for i, arg in enumerate(cmd.argv[1:], 1):
        prev = cmd.argv[i - 1]
        if prev in OUTPUT_FLAGS:
            continue
        if REPO_PATH.match(arg) or (prev in INPUT_FLAGS and arg.endswith((".csv", ".json", ".toml"))):
            out.append(arg)
    return out


def test_files_the_docs_name_exist():
    """Every repository file a documented command reads (a study file, a DeepSpeed JSON, a published table) ships;
    a bare DeepSpeed JSON name is found in ds_configs/ as the entry points find it."""
    from ds_core.config import resolve_ds_path

    missing = []
    for cmd in COMMANDS:
        if not check_argv_is_ours(cmd):
            continue
        for name in _named_files(cmd):
            path = REPO / name
            if name.endswith(".json") and not path.exists():
                path = resolve_ds_path(name) if not Path(name).is_absolute() else path
            if not Path(path).exists() and not (REPO / path).exists():
                missing.append(f"{cmd.where}: {name}")
    assert not missing, "documented commands read files that do not ship:\n" + "\n".join(missing)


def check_argv_is_ours(cmd: Command) -> bool:
    argv = _split_env(cmd.argv)
    return bool(argv) and (argv[0] in console_scripts() or _is_python(argv[0]) or argv[0] in
                           ("deepspeed", "torchrun", "mpirun", "srun", "launch/run.sh", "make"))


def shipped_tables() -> list[Path]:
    return sorted([*(REPO / "studies" / "results").glob("*.csv"), *(REPO / "studies" / "published").glob("*.csv")])


@pytest.mark.parametrize("path", shipped_tables(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_results_read_with_the_documented_reader(path: Path):
    """A nodes,accelerators,throughput table reads with `ds-scaling-report --from_table` (ds_tools.scaling), any
    other with `ds-study report --from_table` (ds_tools.study.report), as docs/studies.md says; none is empty."""
    from ds_tools import scaling
    from ds_tools.study import report

    if report._is_scaling_table(path):  # noqa: SLF001 - the reader's own choice of table kind
        runs = scaling.read_table(path)
        assert len(scaling.group_runs(runs)) == 1 and len(runs) >= 2
    else:
        combos = report.read_cells_table(path)
        assert combos and all(c.samples and c.mean > 0 for c in combos)


def test_the_published_scaling_table_is_what_the_report_prints(capsys):
    """docs/studies.md's published BERT-Large table is `ds-scaling-report --from_table` of the shipped file."""
    from ds_tools import scaling

    text = (REPO / "docs" / "studies.md").read_text()
    start = text.index("Published BERT-Large numbers on DL1")
    doc_rows = [line for line in text[start:].split("\n\n", 2)[1].splitlines() if re.match(r"\| \d", line)]
    assert len(doc_rows) == 4
    assert scaling.main(["--from_table", str(REPO / "studies" / "published" / "bert_large_dl1.csv")]) == 0
    printed = capsys.readouterr().out
    for row in doc_rows:
        assert row.rstrip(" |") in printed, row
    assert "What grew" not in printed  # published numbers have no phase timing: no rows of zeros


LAYOUT_PATH = re.compile(r"^[\w-]+(?:/[\w-]+)*(?:\.py|/)$")  # a file or folder named in docs/layout.md


def test_the_layout_page_names_every_folder_and_no_file_that_is_gone():
    """docs/layout.md, the one description of the layout: every tracked top-level folder and every room of ds_core
    has its row, and every file or folder it names is there (in its row's folder, the repository or ds_core)."""
    import subprocess

    text = (REPO / "docs" / "layout.md").read_text()
    rows: dict[str, dict[str, Path]] = {"## The folders": {}, "## The rooms of ds_core": {}}
    section, missing = "", []
    for line in text.splitlines():
        if line.startswith("## "):
            section = line.strip()
            continue
        names = re.findall(r"`([^`]+)`", line)
        base = REPO
        if section in rows and line.startswith("| `"):
            first = re.findall(r"`([^`]+)`", line.split("|")[1])
            base = REPO / first[0] if section == "## The folders" else REPO / "ds_core" / (
                first[0] if first[0].endswith("/") else "")
            rows[section].update((name, base) for name in first)
        for name in filter(LAYOUT_PATH.match, names):
            if not any((b / name).exists() for b in (base, REPO, REPO / "ds_core")):
                missing.append(f"{section or 'top'}: {name}")
    assert not missing, f"docs/layout.md names what is not there: {missing}"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    folders = {f.split("/")[0] + "/" for f in tracked.splitlines() if "/" in f and not f.startswith(".")}
    assert folders <= set(rows["## The folders"]), folders - set(rows["## The folders"])
    room_dirs = {p.parent.name + "/" for p in (REPO / "ds_core").glob("*/__init__.py")}
    assert room_dirs <= set(rows["## The rooms of ds_core"]), room_dirs - set(rows["## The rooms of ds_core"])
