"""The layering of ../shared/STYLE.md: model packages import ds_core, never each other; ds_core imports neither."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {"ds_core": {"bert_ref", "bridgetower_ds", "launch"}, "bert_ref": {"bridgetower_ds", "launch"},
             "bridgetower_ds": {"bert_ref", "launch"}, "launch": {"bert_ref", "bridgetower_ds"}}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_layering(package):
    bad = []
    for f in sorted((REPO / package).rglob("*.py")):
        hits = imported_packages(f) & FORBIDDEN[package]
        bad += [f"{f.relative_to(REPO)} imports {h}" for h in sorted(hits)]
    assert not bad, "; ".join(bad)
