"""Import hygiene of the whole project: no import circle between our modules, and no private name
(`_x`) imported from another module.

Read from the source with `ast`, not by importing, so an import inside a function, under `if TYPE_CHECKING:` or in a
branch that this machine never takes counts the same as one at the top of a file: each of them can close a circle
when it runs. The edges are the imports written down; the implicit import of a parent package (importing a.b.c runs
a/__init__.py) is not an edge, as in pylint's cyclic-import check, so a package's __init__ may import its own
submodules."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ds_core", "ds_tools", "bert_ref", "bridgetower_ds", "launch", "bench")
SCRIPT_DIRS = ("studies", "tests")  # loose files, checked the same way
TOPS = {*PACKAGES, "conftest"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files() -> dict[str, Path]:
    files = {}
    for top in (*PACKAGES, *SCRIPT_DIRS):
        for f in sorted((REPO / top).rglob("*.py")):
            files[module_name(f)] = f
    return files


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module of `from X import ...` (relative levels resolved against `module`)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(path: Path, module: str, known: set[str]) -> list[tuple[str, str | None, int]]:
    """(imported module, name taken from it or None, line) for every import statement anywhere in the file.
    `from pkg import sub` where pkg.sub is one of our modules is an import of pkg.sub."""
    out = []
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve_from(node, module, is_package)
            for a in node.names:
                sub = f"{src}.{a.name}"
                out.append((sub, None, node.lineno) if sub in known else (src, a.name, node.lineno))
    return out


def import_graph() -> dict[str, set[str]]:
    files = project_files()
    known = set(files)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        for target, _name, _line in imports_of(path, mod, known):
            if target in known and target != mod:
                graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative: no recursion limit)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import circles (each line: modules that import each other, directly or around): " + \
        "; ".join(" <-> ".join(c) for c in found)


def test_no_private_name_imported_from_another_module():
    files = project_files()
    known = set(files)
    bad = []
    for mod, path in files.items():
        for target, name, line in imports_of(path, mod, known):
            if target.split(".")[0] not in TOPS:
                continue  # another project's private name (a test comparing with DeepSpeed's own parser) is theirs
            if name is None:
                name = target.rsplit(".", 1)[-1] if target in known else ""
            if name.startswith("_") and not name.startswith("__") and target != mod:
                bad.append(f"{path.relative_to(REPO)}:{line}: from {target} import {name}")
    assert not bad, "private names taken across modules (give the thing a public name): " + "; ".join(bad)


@pytest.mark.parametrize("source, expected", [
    ({"a": "from b import f", "b": "def f(): from a import g"}, [["a", "b"]]),                 # function-level
    ({"a": "import b.c", "b": "", "b.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n import a"},
     [["a", "b.c"]]),
    ({"p": "from p import q", "p.q": "from . import r", "p.r": ""}, []),                      # parent: no edge
])
def test_cycle_finder_sees_what_it_should(source, expected, tmp_path):
    """The checker itself: a circle closed inside a function or under TYPE_CHECKING is found; a package importing
    its own submodules is not a circle."""
    files = {}
    for mod, text in source.items():
        is_pkg = any(other.startswith(mod + ".") for other in source)
        f = tmp_path / Path(*mod.split(".")) / "__init__.py" if is_pkg else tmp_path / (mod.replace(".", "/") + ".py")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
        files[mod] = f
    graph = {m: {t for t, _n, _l in imports_of(f, m, set(files)) if t in files and t != m} for m, f in files.items()}
    assert cycles(graph) == expected


def test_private_import_is_seen(tmp_path):
    """The checker itself: `from pkg.mod import _name` and `from . import _mod` are reported as what they take."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "_mod.py").write_text("")
    f = tmp_path / "pkg" / "user.py"
    f.write_text("from pkg.other import _name, public\nfrom . import _mod\n")
    known = {"pkg", "pkg._mod", "pkg.user", "pkg.other"}
    assert imports_of(f, "pkg.user", known) == [("pkg.other", "_name", 1), ("pkg.other", "public", 1),
                                                ("pkg._mod", None, 2)]
