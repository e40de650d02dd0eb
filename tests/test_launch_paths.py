"""Paths the starters find or set for the ranks: the MPI library that belongs to mpirun (as distributions ship it) and
one torch JIT extension cache per venv."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from ds_core.rank.venv import torch_extensions_env
from launch import run as runmod
from launch.local_ranks import rank_env


def test_linker_cache_is_read():
    libs = runmod.ldconfig_libraries()
    assert any(Path(p).name == "libc.so.6" for p in libs.get("libc.so.6", [])), sorted(libs)[:20]
    ldd = runmod.ldd_libraries(sys.executable)  # the interpreter links libc (and maybe libpython)
    assert any(name.startswith("libc.so") for name in ldd), ldd


def test_open_mpi_library_found_without_the_dev_package():
    """Debian's openmpi-bin alone (no libopenmpi-dev, what .ci/run installs): `ompi_info --path libdir` names
    .../openmpi/lib, which holds no libmpi.so*; the library is found through the linker instead (it was "" and both
    Open MPI multi-node tests failed with MPI4PY_LIBMPI unset)."""
    ompi_info = shutil.which("ompi_info")
    if not ompi_info:
        pytest.skip("Open MPI not installed (.ci/run installs openmpi-bin)")
    mpirun = Path(ompi_info).resolve().with_name("mpirun")
    lib = runmod.libmpi_of("openmpi", str(mpirun))
    assert Path(lib).name == "libmpi.so.40" and Path(lib).is_file(), lib
    linked = runmod.ldd_libraries(ompi_info).get("libmpi.so.40")
    assert linked and os.path.samefile(linked, lib)  # the one Open MPI's own programs load
    assert runmod.libmpi_of("mpich", str(mpirun)) != lib  # MPICH's soname is another


def test_mpich_library_of_the_venv_mpirun():
    mpirun = Path(sys.executable).with_name("mpirun")
    if not mpirun.exists() or runmod.mpi_flavor_of(str(mpirun)) != "mpich":
        pytest.skip("no MPICH mpirun in this venv (the `mpich` extra)")
    lib = runmod.libmpi_of("mpich", str(mpirun))
    assert Path(lib).name == "libmpi.so.12" and Path(lib).is_file(), lib


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs a venv")
def test_torch_extensions_dir_is_per_venv_unless_set(tmp_path):
    want = str(Path(sys.prefix).resolve() / "torch_extensions")
    base = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    assert rank_env(base)["TORCH_EXTENSIONS_DIR"] == want  # the local starter's ranks
    assert rank_env({**base, "TORCH_EXTENSIONS_DIR": "/mine"})["TORCH_EXTENSIONS_DIR"] == "/mine"
    assert torch_extensions_env({"TORCH_EXTENSIONS_DIR": "/mine"}) == {}
    # launch.run hands it to the launcher it execs (shown by --dry_run)
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    out = subprocess.run([sys.executable, "-m", "launch.run", "--dry_run", "--hostfile", str(tmp_path / "hosts"),
                          "--launcher", "pdsh"], cwd=REPO, env={**base, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["env_added"]["TORCH_EXTENSIONS_DIR"] == want
    # and the Makefile exports <checkout>/.venv/torch_extensions to everything it runs
    if shutil.which("make"):
        made = subprocess.run(["make", "-s", "--no-print-directory", "--eval",
                               "print-ted: ; @echo $$TORCH_EXTENSIONS_DIR", "print-ted"], cwd=REPO, env=base,
                              capture_output=True, text=True, timeout=60)
        assert made.stdout.strip() == str((REPO / ".venv").resolve() / "torch_extensions"), made.stderr
