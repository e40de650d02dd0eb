"""ds_core.compat.lazy_compile: DeepSpeed's Muon module imported without importing Inductor, its torch.compile
decorations compiled by the real torch.compile, with their arguments, on the first call."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from ds_core.compat.lazy_compile import deferred_compile


def test_deferred_compile_compiles_on_the_first_call_with_the_same_arguments():
    calls = []

    def real(fn, **kwargs):
        calls.append((fn.__name__, kwargs))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    compile_ = deferred_compile(real)

    @compile_
    def plain(x):
        return x + 1

    @compile_(dynamic=False, mode="max-autotune")
    def with_options(x, y=0):
        return x * y

    assert calls == [] and plain.__name__ == "plain"  # decorating compiles nothing
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert with_options(2, y=3) == ("compiled", 6)
    assert calls == [("plain", {}), ("with_options", {"dynamic": False, "mode": "max-autotune"})]  # once each


@pytest.mark.stack
@pytest.mark.each_gaudi
def test_muon_imported_lazily_leaves_inductor_out_and_torch_compile_as_it_was():
    """Where the installed DeepSpeed has the Muon module (0.19): imported, Inductor not. Where it has none (Habana's
    fork, 0.16.1): the change is off, said in one line, and nothing is imported."""
    code = """
import sys, torch
real = torch.compile
from ds_core.compat.changes import BY_NAME, State, apply_change
from ds_core.compat.lazy_compile import MUON_MODULE
lines = []
on = apply_change("lazy_muon_import", device_type="cpu", say=lines.append).state is State.APPLIED
assert on == (BY_NAME["lazy_muon_import"].gate().state is State.APPLIED), (on, lines)
assert (MUON_MODULE in sys.modules) == on, "DeepSpeed's Muon module imported only where the change is on"
assert len(lines) == (0 if on else 1) and all("lazy_muon_import off: this DeepSpeed has no" in ln for ln in lines)
assert torch.compile is real
print("ON", on, "INDUCTOR", "torch._inductor.compile_fx" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "INDUCTOR False" in proc.stdout, proc.stdout[-3000:]
