"""The support matrix (stacks/, tools/stacks.py): pyproject's floors are the versions CI tests, set-up installs with a
stack's pins and keeps an image's torch, DeepSpeed and transformers, and the running environment is the stack it
claims to be."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import REPO

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
    assert set(pins) == {"gaudi", "latest"}
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
    assert not problems, "; ".join(problems)


def test_the_gaudi_stack_is_a_gaudi_image():
    """Gaudi software 1.23's Python packages (Intel Gaudi support matrix): PyTorch 2.9, transformers 4.55.4; Habana's
    DeepSpeed fork 1.21.0 (0.16.1); accelerate 1.10.1 and datasets 3.6.0 as the image has them."""
    pins, image = stacks.read_stack("gaudi")
    assert image == {"torch", "deepspeed", "transformers", "accelerate", "datasets"}
    assert (pins["torch"].split(".")[:2], pins["deepspeed"], pins["transformers"], pins["accelerate"],
            pins["datasets"]) == (["2", "9"], "0.16.1", "4.55.4", "1.10.1", "3.6.0")


@pytest.mark.parametrize("have, stack", [
    ({}, "latest"),  # a fresh machine: set-up installs the newest stack
    ({"deepspeed": "0.16.1+unknown", "transformers": "4.55.4", "torch": "2.9.1"}, "gaudi"),  # a Gaudi image
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


def test_make_setup_installs_with_the_stack_constraints(tmp_path):
    """The README's set-up, dry: the constraints are written first and every pip install of the toolkit takes them."""
    out = subprocess.run(["make", "-n", "-B", "setup", f"VENV={tmp_path / 'v'}", "BUILD_OPS=0"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    first = next(i for i, ln in enumerate(lines) if "tools/stacks.py constraints --stack auto" in ln)
    installs = [i for i, ln in enumerate(lines) if "pip install" in ln and ("-e " in ln or " torch" in ln)]
    assert installs and all(i > first and "-c " in lines[i] for i in installs), out


@pytest.mark.stack
def test_this_environment_is_the_stack_it_claims():
    """What the suite runs on is a stack of the matrix as written: the toolkit's requirements at the pinned versions
    (a stack file that no longer matches what set-up installs fails here, not on a user's fresh install)."""
    out = subprocess.run([sys.executable, str(REPO / "tools" / "stacks.py"), "which"], capture_output=True, text=True,
                         check=True).stdout
    assert "every package as tested" in out, out
