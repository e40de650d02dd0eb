"""One command-line style for every CLI of ours (ds_core.cli): flags spelled with underscores as DeepSpeed's and
transformers' are, the dashed spellings of earlier versions still accepted, and one way to fail on bad input:
`<prog>: error: <message>` on stderr and exit status 2. Parsed in-process; nothing is launched or trained."""
from __future__ import annotations

import argparse
import ast
import importlib
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.9 / 3.10 (e.g. Gaudi images): the same parser as a package
    import tomli as tomllib

import pytest

from conftest import REPO
from ds_core.cli import USAGE_ERROR, flag

# every console script and `python -m` command line of ours that parses with argparse (the training entry points
# parse with HfArgumentParser from dataclass field names: underscores by construction)
CLI_MODULES = ["launch.run", "launch.aws_batch", "launch.slurm", "launch.preflight", "launch.env", "launch.hostfile",
               "launch.guard", "bert_ref.prep.__main__", "ds_tools.scaling", "ds_tools.tuning",
               "ds_tools.study.__main__", "ds_tools.ckpt_cli", "ds_tools.predict", "bench.h5_loader"]


def _parsers(parser: argparse.ArgumentParser):
    """The parser and its subcommands' parsers, recursively (an alias appears once)."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in {id(p): p for p in action.choices.values()}.values():
                yield from _parsers(sub)


def _parse(module: str, argv: list[str]) -> dict:
    return vars(importlib.import_module(module).build_parser().parse_args(argv))


def test_every_console_script_is_covered():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    covered = set(CLI_MODULES) | {case[0] for case in BAD_INPUT}  # a dispatcher is covered by its bad-input case
    for name, target in scripts.items():
        assert target.partition(":")[0] in covered, f"console script {name} ({target}) is not checked here"


def test_flag_spellings():
    assert flag("--max_seq_length") == ("--max_seq_length", "--max-seq-length")
    assert flag("--hosts") == ("--hosts",)
    with pytest.raises(ValueError, match="expected a long option"):
        flag("max_seq_length")


@pytest.mark.parametrize("module", CLI_MODULES)
def test_no_flag_is_only_dashed(module):
    """A dashed flag is only ever the alias of its underscore spelling, which comes first (--help shows it first
    and argparse names the attribute after it)."""
    for parser in _parsers(importlib.import_module(module).build_parser()):
        for action in parser._actions:
            longs = [o for o in action.option_strings if o.startswith("--")]
            for opt in longs:
                if "-" in opt[2:]:
                    under = "--" + opt[2:].replace("-", "_")
                    assert under in longs, f"{module} {parser.prog}: {opt} has no underscore spelling {under}"
                    assert longs.index(under) < longs.index(opt), f"{module}: {under} must come before {opt}"
        help_text = parser.format_help()
        for action in parser._actions:
            if any("-" in o[2:] for o in action.option_strings if o.startswith("--")):
                assert action.option_strings[0] in help_text


# (module, arguments that make a valid command line, renamed flag, its values)
RENAMED = [
    ("launch.hostfile", ["build"], "--aws_batch", []),
    ("launch.hostfile", ["build"], "--mpi_hostfile", ["mpi_hosts"]),
    ("launch.hostfile", ["build", "--hosts", "a,b"], "--equal_slots", []),
    ("launch.hostfile", ["validate", "hostfile"], "--equal_slots", []),
    *[("bert_ref.prep.__main__", ["text", "--input", "raw", "--output", "out"], f, v) for f, v in [
        ("--num_shards", ["3"]), ("--one_doc_per_line", []), ("--text_column", ["body"]), ("--hf_split", ["dev"]),
        ("--min_sentences", ["2"]), ("--no_progress", [])]],
    *[("bert_ref.prep.__main__", ["vocab", "--output", "v.txt"], f, v) for f, v in [
        ("--vocab_file", ["vocab.txt"]), ("--vocab_size", ["100"]), ("--min_frequency", ["3"])]],
    *[("bert_ref.prep.__main__", ["shards", "--input", "t", "--vocab", "v", "--output", "o"], f, v) for f, v in [
        ("--max_seq_length", ["512"]), ("--max_predictions_per_seq", ["80"]), ("--masked_lm_prob", ["0.2"]),
        ("--short_seq_prob", ["0.3"]), ("--dupe_factor", ["2"]), ("--whole_word_mask", []),
        ("--num_test_shards", ["1"]), ("--no_compression", [])]],
    ("bert_ref.prep.__main__", ["check", "dir"], "--no_progress", []),
    ("ds_tools.scaling", ["run0"], "--from_table", ["published.csv"]),
    ("ds_tools.scaling", ["run0"], "--baseline_nodes", ["2"]),
    *[("ds_tools.tuning", ["--model", "bert-large", "--accelerator", "gaudi2", "--global_batch", "64"], f, v)
      for f, v in [("--accelerators_per_node", ["4"]), ("--seq_len", ["512"]),
                   ("--activation_checkpointing", ["on"])]],
    ("ds_tools.tuning", ["--model", "bert-large", "--accelerator", "gaudi2"], "--global_batch", ["64"]),
    ("ds_tools.study.__main__", ["report"], "--from_table", ["cells.csv"]),
    ("ds_tools.study.__main__", ["run", "study.toml"], "--no_report", []),
    *[("bench.h5_loader", [], f, v) for f, v in [
        ("--seq_len", ["512"]), ("--micro_batch", ["8"]), ("--ref_samples", ["10"]), ("--seek_offsets", ["1", "2"]),
        ("--no_compression", [])]],
]


REQUIRED = {"--aws_batch": ("aws_batch", True), "--mpi_hostfile": ("mpi_hostfile", "mpi_hosts"),
            "--global_batch": ("global_batch", 64)}


@pytest.mark.parametrize("module, base, name, values", RENAMED, ids=[f"{m}:{f}" for m, _, f, _ in RENAMED])
def test_renamed_flags_accept_both_spellings(module, base, name, values):
    dashed = "--" + name[2:].replace("_", "-")
    under = _parse(module, [*base, name, *values])
    assert _parse(module, [*base, dashed, *values]) == under
    if name in REQUIRED:  # the command line needs this flag (or one of its group): nothing to compare with
        dest, value = REQUIRED[name]
        assert under[dest] == value
    else:
        assert under != _parse(module, base), f"{name} changed nothing"


@pytest.mark.parametrize("module", CLI_MODULES)
def test_no_parser_takes_abbreviations(module):
    """allow_abbrev=False on every parser and subcommand parser: a prefix that names one flag today silently names
    another (or becomes an error) the day a flag sharing it is added."""
    for parser in _parsers(importlib.import_module(module).build_parser()):
        assert parser.allow_abbrev is False, f"{module}: {parser.prog} accepts abbreviated flags"


@pytest.mark.parametrize("module, argv", [
    ("ds_tools.scaling", ["--baseline", "2"]),                                      # --baseline_nodes
    ("bert_ref.prep.__main__", ["shards", "--input", "t", "--vocab", "v", "--output", "o", "--dupe", "3"]),
    ("launch.run", ["--launch", "srun"]),                                           # --launcher
])
def test_an_abbreviation_is_refused(module, argv, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(module, argv)
    assert e.value.code == USAGE_ERROR and "unrecognized arguments" in capsys.readouterr().err


def test_every_parser_is_built_without_abbreviations():
    """Read from the source: each ArgumentParser / HfArgumentParser built anywhere in the project (entry points,
    benchmarks, studies, test helpers) passes allow_abbrev=False; subcommand parsers of plain argparse parsers too
    (ds_core.cli.ArgumentParser's subcommands inherit it: test_no_parser_takes_abbreviations)."""
    bad = []
    for top in ("ds_core", "ds_tools", "bert_ref", "bridgetower_ds", "launch", "bench", "studies", "tests"):
        for f in sorted((REPO / top).rglob("*.py")):
            tree = ast.parse(f.read_text(encoding="utf-8"))
            cli_parser = any(isinstance(n, ast.ImportFrom) and n.module == "ds_core.cli"
                             and any(a.name == "ArgumentParser" for a in n.names) for n in ast.walk(tree))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                wanted = name in ("ArgumentParser", "HfArgumentParser") or (name == "add_parser" and not cli_parser)
                ok = any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                         for k in node.keywords)
                if wanted and not ok:
                    bad.append(f"{f.relative_to(REPO)}:{node.lineno}: {name}(...) without allow_abbrev=False")
    assert not bad, "; ".join(bad)


def test_renamed_subcommand_keeps_its_old_name(capsys):
    from launch import hostfile

    for cmd in ("expand_nodelist", "expand-nodelist"):
        assert hostfile.main([cmd, "node[1-2]"]) == 0
        assert capsys.readouterr().out.split() == ["node1", "node2"]


# (module, prog in the message, arguments, message); {tmp} is the test's tmp_path, which holds only `hostfile`
BAD_INPUT = [
    ("launch.run", "python -m launch.run", ["--hostfile", "{tmp}/missing"], "{tmp}/missing: cannot read hostfile"),
    ("launch.slurm", "python -m launch.slurm", ["--dry_run"], "SLURM_NODEID is not set"),
    ("launch.aws_batch", "python -m launch.aws_batch", ["--dry_run"], "AWS_BATCH_JOB_NUM_NODES=''"),  # was exit 3
    ("launch.env", "python -m launch.env", ["show", "--profile", "nope"], "unknown profile 'nope'"),
    ("launch.hostfile", "python -m launch.hostfile", ["validate", "{tmp}/hostfile"],
     "{tmp}/hostfile line 2: duplicate host node0"),
    ("bert_ref.prep.__main__", "bert-prep check", ["check", "{tmp}/missing"], "directory not found: {tmp}/missing"),
    ("ds_tools.scaling", "ds-scaling-report", ["{tmp}/missing"], "{tmp}/missing: no such run directory"),
    ("ds_tools.scaling_cli", "ds-scaling-report predict", ["predict", "--measured", "100", "--nodes", "2"],
     "--measured SEQ_PER_S with --measured_nodes"),
    ("ds_tools.tuning", "ds-tune", ["--model", "bert-large", "--accelerator", "gaudi2", "--global_batch", "64",
                                   "--accelerators_per_node", "0"], "--accelerators_per_node and --nodes must"),
    ("ds_tools.study.__main__", "ds-study", ["report", "{tmp}"], "{tmp}: no study.toml"),
    ("ds_tools.ckpt_cli", "ds-ckpt info", ["info", "{tmp}"], "no checkpoints/ directory"),
]


@pytest.mark.parametrize("module, prog, argv, message", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_exits_2_with_the_message_on_stderr(module, prog, argv, message, tmp_path, capsys, monkeypatch):
    for name in ("SLURM_NODEID", "AWS_BATCH_JOB_NUM_NODES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostfile").write_text("node0 slots=2\nnode0 slots=2\n")
    status = importlib.import_module(module).main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert status == USAGE_ERROR == 2, err
    assert err.endswith("\n") and "Traceback" not in err
    line = err.splitlines()[-1]  # the error is the last thing said
    assert line.startswith(f"{prog}: error: ") and message.format(tmp=tmp_path) in line, err


@pytest.mark.parametrize("module", ["bert_ref.train", "bridgetower_ds.train"])
def test_training_modules_help_names_the_module_and_says_what_no_does(module):
    """Usage names the command a user types (`python -m bert_ref.train`, not the file train.py), and each `--no_X`
    says that it turns --X off (HfArgumentParser gives it X's own help and a default of False)."""
    from ds_core.config import section_types, settings_parser

    spec = importlib.import_module(module).SPEC
    parser = settings_parser(list(section_types(spec.settings).values()), spec.description, spec.prog)
    text = parser.format_help()
    assert text.startswith(f"usage: python -m {module} ") and "train.py" not in text.split("\n")[0]
    no_flags = [a for a in parser._actions if a.option_strings and a.option_strings[0].startswith("--no_")]
    assert no_flags
    for action in no_flags:
        positive = "--" + action.option_strings[0][len("--no_"):]
        assert action.help.startswith(f"Turns {positive} off"), action.option_strings
    if module == "bert_ref.train":
        assert "--recipe RECIPE" in text and "habana_1p5b_8x" in text


def test_env_list_gives_each_profile_whole_sentences(capsys):
    from launch import env

    assert env.main(["list"]) == 0
    out = capsys.readouterr().out
    entries = {}
    for line in out.splitlines():
        if line[:1] != " ":
            name, _, text = line.partition(" ")
            entries[name] = text.strip()
        else:
            entries[name] += " " + line.strip()
    assert set(entries) == set(env.profile_names())
    for name, text in entries.items():
        assert text.endswith("."), (name, text)  # not cut mid-sentence
    assert all(len(line) <= 120 for line in out.splitlines())


@pytest.mark.parametrize("argv", [["launch.env", "list"], ["ds_tools.scaling", "--from_table",
                                                           "studies/published/bert_large_dgx_a100.csv"],
                                  ["launch.run", "--help"]])
def test_a_reader_that_leaves_early_ends_the_command_quietly(argv):
    """`... | head`: the reader closes the pipe; the command ends quietly (SIGPIPE's status where a write failed), with
    no traceback."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.stdout.close()  # before the command writes anything
    err = proc.stderr.read()
    assert proc.wait(timeout=120) in (0, 141), err  # 0: what was written fit the pipe before it closed
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_the_module_form_of_ds_scaling_report_takes_predict():
    """`python -m ds_tools.scaling predict ...`, the module form the docs name, is `ds-scaling-report predict`."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "ds_tools.scaling", "predict", "--measured", "100", "--nodes", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == USAGE_ERROR, proc.stderr
    line = proc.stderr.splitlines()[-1]
    assert line.startswith("ds-scaling-report predict: error: ") and "--measured SEQ_PER_S with --measured_nodes" \
        in line, proc.stderr
