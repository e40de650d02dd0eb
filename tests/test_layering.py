"""The layering that docs/layout.md describes ("Who imports whom"): model packages import ds_core, never each other;
ds_core imports neither. The offline tools (ds_tools) may import ds_core, launch and the model
packages; nothing but tests and bench imports them, so no training process (ds_core, a model package, launch) pulls them
in. bench/ may import any package but no test code, and nothing imports bench to reuse its code (a test needing bench
code means that code belongs in the library or in the test helpers). Tests of bench's own command lines
(tests/test_cli.py, tests/test_docs.py) load its modules by name through importlib to parse their flags; that is testing
bench, not depending on it; so is tests/test_X.py importing bench/X.py, the module it tests: the two exceptions."""
import ast
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_NO_BENCH = {"bench", "tests"}
FORBIDDEN = {"ds_core": {"bert_ref", "bridgetower_ds", "launch", "ds_tools", *_NO_BENCH},
             "bert_ref": {"bridgetower_ds", "launch", "ds_tools", *_NO_BENCH},
             "bridgetower_ds": {"bert_ref", "launch", "ds_tools", *_NO_BENCH},
             "launch": {"bert_ref", "bridgetower_ds", "ds_tools", *_NO_BENCH},
             "ds_tools": _NO_BENCH,
             "studies": _NO_BENCH, "tests": {"bench"}, "bench": {"tests", "conftest"}}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("import_module", "spec_from_file_location", "run_path")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value.split(".")[0].split("/")[0])  # importlib/runpy by name or by path
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("spec_from_file_location", "run_path", "insert", "append")
                and any(w in ast.unparse(node) for w in ("'bench'", '"bench"', "bench/"))):
            names.add("bench")  # a file of bench/ loaded by path, or bench/ put on sys.path
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_layering(package):
    bad = []
    for f in sorted((REPO / package).rglob("*.py")):
        hits = imported_packages(f) & FORBIDDEN[package]
        if package == "tests" and _tests_only_its_bench_module(f):
            hits.discard("bench")  # tests/test_X.py testing bench/X.py itself is testing bench, not reusing it
        bad += [f"{f.relative_to(REPO)} imports {h}" for h in sorted(hits)]
    assert not bad, "; ".join(bad)


def test_bench_is_a_package_without_path_edits():
    """bench runs as `python -m bench.<name>`: no sys.path edits, no private modules imported across files."""
    assert (REPO / "bench" / "__init__.py").is_file()
    bad = [f"{f.relative_to(REPO)}: sys.path edit" for f in sorted((REPO / "bench").glob("*.py"))
           if "sys.path" in f.read_text()]
    bad += [f"{f.relative_to(REPO)} imports {n}" for f in sorted((REPO / "bench").glob("*.py"))
            for n in _bench_modules_imported(f) if n.startswith("_")]
    assert not bad, "; ".join(bad)


def _tests_only_its_bench_module(path: Path) -> bool:
    """tests/test_X.py (or test_bench_X.py) imports bench.X and no other bench module."""
    name = path.stem.removeprefix("test_").removeprefix("bench_")
    return _bench_modules_imported(path) == {name}


def _bench_modules_imported(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "bench":
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bench."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("bench."))
    return out


# Run as the training rank's program: bert_ref.train itself (runpy), then the top-level packages it loaded (a line
# "LOADED [...]"). tests/test_bert_train.py's one-rank eval run starts through it: check_rank_imports then shows that
# the runtime apart from the tools, a rank that trained, evaluated and saved a checkpoint, has imported neither
# ds_tools nor matplotlib (the tools' plotting), and, not compiling, no Inductor (a line "INDUCTOR false").
RANK_PROBE = """
import atexit, json, runpy, sys
# at exit: the rank's __main__ ends through ds_core.rank.process_end.run_main, which runs atexit handlers, then os._exit
atexit.register(lambda: print("LOADED " + json.dumps(sorted({m.split(".")[0] for m in list(sys.modules)})) +
                              "\\nINDUCTOR " + json.dumps("torch._inductor.compile_fx" in sys.modules), flush=True))
runpy.run_module("bert_ref.train", run_name="__main__", alter_sys=True)
"""


def check_rank_imports(output: str) -> None:
    """RANK_PROBE's line in a finished rank's output: it ran after a real run, and loaded no tool."""
    line = next(x for x in output.splitlines() if x.startswith("LOADED "))
    loaded = set(json.loads(line[len("LOADED "):]))
    assert {"bert_ref", "ds_core", "deepspeed"} <= loaded, loaded   # the probe ran after a real training run
    assert not loaded & {"ds_tools", "matplotlib"}, sorted(loaded & {"ds_tools", "matplotlib"})
    # an eager run imports no Inductor (~2 s of every rank's start): DeepSpeed's Muon module, which ZeRO's optimizer
    # check imports, compiles nothing at import (ds_core.compat.lazy_compile)
    assert next(x for x in output.splitlines() if x.startswith("INDUCTOR ")) == "INDUCTOR false"
