"""The dependency list is the code's: every third-party package the code imports is declared in pyproject.toml (the
toolkit's packages in `dependencies` or the extra that names it; tests', bench's and tools' in `dependencies` or the
`test` extra), and every declared package is imported somewhere or is listed here with why it is needed anyway. A
package that arrives only through another one's requirements (xxhash through datasets) breaks the toolkit when that
one drops it; a declared package nothing uses (pytorch-optimizer, before) is installed on every machine for
nothing."""
from __future__ import annotations

import ast
import importlib.metadata as md
import sys

import pytest
from packaging.requirements import Requirement

from conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (Gaudi 1.21's images): tomli, a requirement there
    import tomli as tomllib

PRODUCT = ("ds_core", "ds_tools", "bert_ref", "bridgetower_ds", "launch", "ds_configs")
DEVELOPMENT = ("tests", "bench", "tools")
FIRST_PARTY = {*PRODUCT, *DEVELOPMENT, "studies", "conftest",
               *(f.stem for f in (REPO / "tools").glob("*.py"))}  # tests import the set-up helpers by name
# imported modules whose distribution is not installed on every machine (the mapping is read from the installed ones)
KNOWN_MODULES = {"tomli": "tomli", "habana_frameworks": "habana-media-loader", "mpi4py": "mpi4py"}
# imported, deliberately not declared
UNDECLARED = {
    "torch": "not listed on purpose (pyproject.toml): set-up installs the stack's torch only where none is "
             "importable, so an HPU or GPU machine keeps the build it has",
    "habana_frameworks": "Habana's PyTorch bridge comes with every Gaudi image (like its torch); its media loader is "
                         "the `hpu` extra (habana-media-loader)",
    "torchvision": "run_bridgetower.py's reference image transform only (bridgetower_ds.image_processor."
                   "torchvision_transform, optional: it says so when absent); never a training path",
    "setuptools": "the build backend (pyproject.toml's build-system.requires); tests/test_install.py checks the one "
                  "the venv builds with",
    "modeling": "Habana's own BERT modeling.py, from a fetched reference checkout on PYTHONPATH, for the script that "
                "made tests/data/habana_bert (never run by a test)",
    "pip": "the installer itself: set-up asks whether the Python it starts from has one (tools/setup_venv.py)",
    "unit": "DeepSpeed's own tests/unit, from its source checkout (tools/ds_unit_tests.py runs them)",
}
# declared, not imported by name
NOT_IMPORTED = {
    "accelerate": "transformers needs it for TrainingArguments (training_args.bin) and for HfTrainerDeepSpeedConfig, "
                  "which fills Trainer-style DeepSpeed JSONs (ds_core.config.trainer_json); bench's Trainer baseline",
    "mpich": "the `mpich` extra: its mpirun, for machines without an MPI",
    "pytest-timeout": "pytest plugin: pyproject's `timeout` ends every test",
    "ruff": "`make lint`",
}


def canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def declared() -> dict[str, str]:
    """{distribution: where it is declared} ("dependencies" or the extra's name)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    out = {canon(Requirement(r).name): "dependencies" for r in project["dependencies"]}
    for extra, reqs in project["optional-dependencies"].items():
        for r in reqs:
            out.setdefault(canon(Requirement(r).name), extra)
    return out


def imports(package: str) -> set[str]:
    """Top-level names of the third-party modules package's files import (at module level or inside functions)."""
    names = set()
    for f in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [node.module]
            else:
                continue
            names.update(n.split(".")[0] for n in found)
    local = {f.stem for f in (REPO / package).rglob("*.py")}  # tests import their helper modules by name
    return {n for n in names - FIRST_PARTY - local if n not in sys.stdlib_module_names}


def distribution(module: str) -> str:
    dists = md.packages_distributions().get(module) or [KNOWN_MODULES.get(module, "")]
    return canon(dists[0]) if dists[0] else ""


@pytest.mark.parametrize("packages, allowed", [(PRODUCT, ("dependencies", "mpi", "mpich", "hpu")),
                                               (DEVELOPMENT, ("dependencies", "test", "mpi", "mpich"))])
def test_every_third_party_import_is_declared(packages, allowed):
    decl = declared()
    missing = []
    for package in packages:
        for module in sorted(imports(package)):
            if module in UNDECLARED:
                continue
            dist = distribution(module)
            if decl.get(dist) not in allowed:
                missing.append(f"{package} imports {module} ({dist or 'not installed here'}): "
                               + (f"declared in {decl[dist]!r} only" if dist in decl else "not declared"))
    assert not missing, "; ".join(missing)


def test_every_declared_package_is_imported_or_says_why():
    used = {distribution(m) for p in (*PRODUCT, *DEVELOPMENT) for m in imports(p)}
    unused = sorted(d for d in declared() if d not in used and d not in NOT_IMPORTED)
    assert not unused, f"declared in pyproject.toml, imported nowhere and not in NOT_IMPORTED: {unused}"
    stale = sorted(d for d in NOT_IMPORTED if d in used or d not in declared())
    assert not stale, f"NOT_IMPORTED entries that are imported after all, or no longer declared: {stale}"
