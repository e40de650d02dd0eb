"""The fingerprint of a function's source: what a change that replaces a DeepSpeed method body is gated on.

A change that swaps in its own body for one of DeepSpeed's is right only for the bodies it was checked against: a
release that edits the method (a fix, a new branch) would keep our old copy silently. So each such change lists the
fingerprints of the bodies it was verified against, per tested release (ds_core.compat.verified), and stays off,
with one line naming the change and the DeepSpeed version, wherever the installed body has another (its gate:
ds_core.compat.gates.Bodies).

The fingerprint is a hash of the function's syntax tree with its docstring, comments, line numbers and formatting
left out, so a reformatted or re-documented method keeps its fingerprint and any change to what it does changes it.
The tree is written out field by field with None and empty lists skipped, which keeps one text for the same code
on every Python the support matrix runs (3.10 to 3.13: 3.12 added FunctionDef.type_params, 3.13 changed ast.dump's
defaults). The same normalisation reads a function from a live object (inspect.getsource) or from a source tree
that is not installed:

    python -m ds_core.compat.fingerprint [DEEPSPEED_SOURCE_ROOT]

prints, for every target of ds_core.compat.verified (VERIFIED and FIXED), the fingerprint of the installed
DeepSpeed's (no argument) or of the unpacked release at DEEPSPEED_SOURCE_ROOT (the folder holding deepspeed/): the
line to record after checking a new release's body by hand.
"""
from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

SKIPPED_FIELDS = ("type_comment", "kind")  # formatting only: `# type:` comments, u"" prefixes


def _text(node: Any) -> str:
    if isinstance(node, ast.AST):
        parts = []
        for name, value in ast.iter_fields(node):
            if name in SKIPPED_FIELDS or value is None or value == []:
                continue
            parts.append(f"{name}={_text(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(_text(v) for v in node) + "]"
    return repr(node)


def _without_docstring(node: ast.AST) -> ast.AST:
    body = getattr(node, "body", None)
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        node.body = body[1:] or [ast.Pass()]
    return node


def of_node(node: ast.AST) -> str:
    """The fingerprint of a function or class definition node: 16 hex digits."""
    return hashlib.sha256(_text(_without_docstring(node)).encode()).hexdigest()[:16]


def of_function(fn: Any) -> str | None:
    """The fingerprint of a live function's (or method's, or class's) source; None where Python has no source for it
    (a compiled or zipped install): then nothing is known and a change gated on it stays off."""
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    return of_node(tree.body[0]) if tree.body else None


def of_source_file(path: str | Path, qualname: str) -> str | None:
    """The fingerprint of `qualname` ("Class.method" or "function") as defined in the Python file `path`.

    Read as of_function reads a live one: the definition's lines (decorators first), dedented, then parsed. Parsing
    the whole file instead gives another tree where a string literal continues over a line break (`"... \\` then
    an indented line): dedenting moves the continued line, and the string's value with it."""
    text = Path(path).read_text()
    node: Any = ast.parse(text)
    for part in qualname.split("."):
        node = next((n for n in getattr(node, "body", []) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                               ast.ClassDef)) and n.name == part), None)
        if node is None:
            return None
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    source = textwrap.dedent("".join(text.splitlines(keepends=True)[first - 1:node.end_lineno]))
    tree = ast.parse(source)
    return of_node(tree.body[0]) if tree.body else None


def split_target(target: str) -> tuple[str, str]:
    """"package.module:Class.method" -> ("package.module", "Class.method")."""
    module, _, qualname = target.partition(":")
    return module, qualname


def resolve(target: str) -> Any:
    """The live object a target names in the installed packages, or None where it is absent."""
    module, qualname = split_target(target)
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return None
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part, None) if isinstance(obj, type) else getattr(obj, part, None)
        if obj is None:
            return None
    return getattr(obj, "__func__", obj)  # staticmethod / classmethod


def installed(target: str) -> str | None:
    """The fingerprint of the installed target's source: DeepSpeed's own, behind any replacement of ours."""
    from ds_core.compat.marks import original

    obj = resolve(target)
    return None if obj is None else of_function(original(obj))


def main(argv: list[str] | None = None) -> int:
    from ds_core.compat.verified import FIXED, VERIFIED

    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else None
    for target in {**VERIFIED, **FIXED}:
        module, qualname = split_target(target)
        if root is None:
            got = installed(target)
        else:
            path = root.joinpath(*module.split(".")).with_suffix(".py")
            got = of_source_file(path, qualname) if path.is_file() else None
        print(f"{target} {got}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["of_node", "of_function", "of_source_file", "installed", "resolve", "split_target"]
