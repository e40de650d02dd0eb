"""The support matrix (stacks/, tools/stacks.py): pyproject's floors are the versions CI tests, set-up installs with a
stack's pins and keeps an image's torch, DeepSpeed and transformers, and the running environment is the stack it
claims to be."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (Gaudi 1.21's images): tomli, a requirement there
    import tomli as tomllib

_spec = importlib.util.spec_from_file_location("stacks_tool", REPO / "tools" / "stacks.py")
stacks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stacks)

# not installed on either lane (Python 3.11, no Gaudi): no tested version to hold a floor to
UNTESTED = {"tomli": "Python < 3.11 only", "habana-media-loader": "HPU only"}


def pyproject_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    return reqs


def test_every_floor_is_the_oldest_tested_version():
    pins = {name: stacks.read_stack(name)[0] for name in stacks.stack_names()}
    assert set(pins) == {"gaudi-1.21", "gaudi-1.23", "latest"}
    problems = []
    for req in pyproject_requirements():
        name = stacks.canon(req.name)
        if name in UNTESTED:
            continue
        tested = [Version(p[name]) for p in pins.values() if name in p]
        if len(tested) != len(pins):
            problems.append(f"{name}: not pinned in every stack")
            continue
        floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
        if floors != [min(tested)]:
            problems.append(f"{req}: floor should be >= {min(tested)} (the oldest tested)")
    # Python's floor too: the oldest a stack file names (its `# python:` line); nothing older has ever run the suite
    pythons = [Version(stacks.stack_meta(name)["python"]) for name in pins if "python" in stacks.stack_meta(name)]
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    if requires != f">={min(pythons)}":
        problems.append(f"requires-python {requires!r}: should be '>={min(pythons)}' (the oldest tested)")
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("stack, torch, transformers, accelerate, python", [
    # Gaudi software 1.23 (Gaudi 2 and 3): PyTorch 2.9; optimum-habana 1.20.0 pins transformers >= 4.55.0, < 4.56.0
    # and accelerate >= 1.7.0, <= 1.10.1 (its setup.py at tag v1.20.0)
    ("gaudi-1.23", "2.9", "4.55.4", "1.10.1", "3.11"),
    # Gaudi software 1.21, the last for first-gen Gaudi (AWS DL1): PyTorch 2.6.0; optimum-habana 1.18.1 pins
    # transformers >= 4.51.0, < 4.52.0 and accelerate >= 1.7.0 (its setup.py at tag v1.18.1); Ubuntu 22.04's Python
    ("gaudi-1.21", "2.6", "4.51.3", "1.7.0", "3.10"),
])
def test_each_gaudi_stack_is_its_release(stack, torch, transformers, accelerate, python):
    """Each Gaudi stack is the Python side of its Intel Gaudi software release, with Habana's DeepSpeed fork 1.21.0
    (0.16.1), and names the release set-up reports (tools/stacks.py GAUDI_TORCH: Intel's support matrix)."""
    pins, image = stacks.read_stack(stack)
    meta = stacks.stack_meta(stack)
    assert {"torch", "deepspeed", "transformers", "accelerate"} <= image
    assert (pins["torch"].split(".")[:2], pins["deepspeed"], pins["transformers"], pins["accelerate"]) == (
        torch.split("."), "0.16.1", transformers, accelerate)
    assert meta == {"gaudi": stack.split("-")[1], "python": python}
    assert stacks.GAUDI_TORCH[meta["gaudi"]] == tuple(int(x) for x in torch.split("."))


@pytest.mark.parametrize("torch, transformers, said", [
    ("2.6.0", "4.51.3", "Intel Gaudi software 1.21: stack gaudi-1.21"),
    ("2.9.1", "4.55.4", "Intel Gaudi software 1.23: stack gaudi-1.23"),
    # 1.22 (PyTorch 2.7, transformers 4.51 through optimum-habana 1.19.0) is no stack of its own: named, and set-up
    # takes the stack of its transformers
    ("2.7.1", "4.51.3", "Intel Gaudi software 1.22 (between the tested stacks gaudi-1.21 and gaudi-1.23, covered by "
                        "both ends): stack gaudi-1.21"),
])
def test_setup_names_the_gaudi_release(torch, transformers, said):
    have = {"torch": torch, "transformers": transformers, "deepspeed": "0.16.1+unknown"}
    assert stacks.describe(stacks.choose("auto", have)[0], have) == said
    # a Gaudi image says which release it is through Habana's PyTorch plugin, whatever its torch
    assert stacks.gaudi_release({**have, "habana-torch-plugin": "1.21.0.555"}) == "1.21"
    assert stacks.gaudi_release({"torch": torch, "deepspeed": "0.19.8"}) is None  # upstream DeepSpeed: no Gaudi image


def test_the_docs_matrix_is_the_stack_files():
    """docs/gaudi.md's table: each package's version per stack, as the stack files pin it (columns in the order of
    the header's stack file names)."""
    text = (REPO / "docs" / "gaudi.md").read_text()
    section = text.split("## The support matrix", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split("|")][1:]
    names = [h.split("stacks/")[1].split(".txt")[0] for h in header]
    assert sorted(names) == stacks.stack_names(), header
    pins = {name: stacks.read_stack(name)[0] for name in names}
    checked = 0
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        name = stacks.canon(cells[0])
        if all(name in pins[s] for s in names):
            assert [c.split()[0] for c in cells[1:]] == [pins[s][name] for s in names], row
            checked += 1
    assert checked >= 7


@pytest.mark.parametrize("have, stack", [
    ({}, "latest"),  # a fresh machine: set-up installs the newest stack
    ({"deepspeed": "0.16.1+unknown", "transformers": "4.55.4", "torch": "2.9.1"}, "gaudi-1.23"),  # a Gaudi image
    ({"deepspeed": "0.16.1+unknown", "transformers": "4.51.3", "torch": "2.6.0"}, "gaudi-1.21"),  # first-gen Gaudi
    ({"deepspeed": "0.16.1+unknown", "transformers": "4.51.3", "torch": "2.7.1"}, "gaudi-1.21"),  # Gaudi 1.22
    ({"transformers": "5.17.0", "torch": "2.11.0+cu130"}, "latest"),  # a CUDA image without DeepSpeed
    ({"deepspeed": "0.19.8", "transformers": "5.24.0"}, "latest"),
])
def test_auto_picks_the_stack_the_installed_packages_match(have, stack):
    assert stacks.choose("auto", have)[0] == stack


def test_constraints_keep_the_image_and_pin_the_rest():
    pins = {"torch": "2.9.1", "deepspeed": "0.16.1", "transformers": "4.55.4", "h5py": "3.16.0", "numpy": "1.26.4"}
    image = {"torch": "2.9.1", "deepspeed": "0.16.1+unknown", "transformers": "4.55.4", "numpy": "1.26.0"}
    lines = stacks.constraint_lines(pins, image)
    # the image's torch / DeepSpeed / transformers pinned as installed (pip cannot replace them); its numpy not pinned
    # (kept where it satisfies the toolkit); what set-up installs pinned to the stack's version
    assert sorted(lines) == sorted(["torch==2.9.1", "deepspeed==0.16.1+unknown", "transformers==4.55.4",
                                    "h5py==3.16.0"])
    assert stacks.kept_too_old({"deepspeed": "0.14.4+hpu"}) and not stacks.kept_too_old(image)
    assert not stacks.kept_too_old({"torch": "2.6.0", "transformers": "4.51.3", "deepspeed": "0.16.1+unknown"})
    assert stacks.kept_too_old({"torch": "2.5.1"}) == ["torch 2.5.1 is older than the oldest tested (2.6.0 in "
                                                       "stacks/gaudi-1.21.txt)"]


@pytest.mark.stack
@pytest.mark.each_gaudi
def test_this_environment_is_the_stack_it_claims():
    """What the suite runs on is a stack of the matrix as written: the toolkit's requirements at the pinned versions
    (a stack file that no longer matches what set-up installs fails here, not on a user's fresh install)."""
    out = subprocess.run([sys.executable, str(REPO / "tools" / "stacks.py"), "which"], capture_output=True, text=True,
                         check=True).stdout
    assert "every package as tested" in out, out
