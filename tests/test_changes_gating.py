"""ds_core.compat.changes decides each change by one gate (ds_core.compat.gates): the fingerprints of the DeepSpeed
bodies it replaces (ds_core.compat.fingerprint, recorded per tested release in ds_core.compat.verified) or the names
it wraps. An unverified body keeps DeepSpeed's own path, with one line naming the change and the DeepSpeed version;
a fix of an older release's fault is applied exactly where the installed DeepSpeed's function has that fault."""
from __future__ import annotations

import inspect
import textwrap

import pytest

from conftest import REPO, deepspeed_release
from ds_core.compat import changes, deepspeed_behaviour as behaviour, fingerprint, gates, verified
from ds_core.compat.gates import State

pytestmark = pytest.mark.stack

_FIXES = ("cpu_gradient_buckets", "zero3_gather_waits", "nonfinite_group_norm", "universal_load_links",
          "mpi_exports_as_given")
# every change's gate on each tested release (stacks/), the switch on: the newest has the fixes of 0.16's faults;
# Habana's fork (0.16.1) gets every change but the Muon import, a module that release does not have
GATES = {(0, 19): {**{c.name: State.APPLIED for c in changes.CHANGES}, **{n: State.NOT_NEEDED for n in _FIXES}},
         (0, 16): {**{c.name: State.APPLIED for c in changes.CHANGES}, "lazy_muon_import": State.REFUSED}}
# each fix's fault, probed on the installed DeepSpeed's own function (ds_core.compat.deepspeed_behaviour)
FAULTS = {"cpu_gradient_buckets": behaviour.zero_buckets_drop_cpu,
          "zero3_gather_waits": behaviour.zero3_gather_waits_last_only,
          "nonfinite_group_norm": behaviour.zero_group_norm_hides_nonfinite,
          "universal_load_links": behaviour.universal_load_repoints_fp32,
          "mpi_exports_as_given": behaviour.quotes_plain_exports}


def test_every_gate_decides_as_recorded_for_this_release():
    release = deepspeed_release(GATES)
    assert {n: changes.BY_NAME[n].gate().state for n in changes.BY_NAME} == GATES[release]


def test_the_installed_bodies_are_the_read_ones():
    """A change applied by its Bodies gate has every body in VERIFIED, one not needed every body in FIXED."""
    release = deepspeed_release(GATES)
    for change in changes.CHANGES:
        if not isinstance(change.gate, gates.Bodies) or GATES[release][change.name] is State.REFUSED:
            continue
        table = verified.VERIFIED if GATES[release][change.name] is State.APPLIED else verified.FIXED
        for target in change.gate.targets:
            assert fingerprint.installed(target) in table[target], (change.name, target)


def test_each_fix_applies_exactly_where_its_fault_is():
    """The fingerprint tables stand for behaviour: a fix's body is in VERIFIED where DeepSpeed's own function has the
    fault it fixes, in FIXED where it has not."""
    fixes = {c.name for c in changes.CHANGES if isinstance(c.gate, gates.Bodies) and c.gate.fixed}
    assert fixes == set(FAULTS)
    for name, fault in FAULTS.items():
        has_fault = fault()
        assert changes.BY_NAME[name].gate().state is (State.APPLIED if has_fault else State.NOT_NEEDED), name


def test_the_fork_on_cpu_only_fixes_are_labelled_as_such():
    """A change that exists only because Habana's fork misbehaves on DeepSpeed's CPU accelerator says so in the list,
    in its module's docstring and in docs/development.md; each is a fix of a fault its gate reads."""
    import importlib

    labelled = [c for c in changes.CHANGES if c.fork_cpu_only]
    assert {c.name for c in labelled} == {"cpu_gradient_buckets", "zero3_gather_waits"}
    docs = (REPO / "docs" / "development.md").read_text()
    section = docs[docs.index("Fork-on-CPU-only fixes"):][:1500]
    for change in labelled:
        assert change.name in FAULTS, change.name
        assert "fork-on-CPU-only fix" in importlib.import_module(change.module).__doc__, change.module
        assert f"`{change.name}`" in section, change.name


def test_the_fingerprint_is_the_code_not_its_layout():
    def f(a, b=1):
        """doc"""
        return a + b  # a comment

    def reformatted(a, b=1):
        return (a +
                b)

    def changed(a, b=1):
        return a - b

    node = fingerprint.of_function
    assert node(f) == fingerprint.of_node(_renamed(reformatted, "f")) != fingerprint.of_node(_renamed(changed, "f"))


def _renamed(fn, name):
    import ast

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    tree.name = name
    return tree


def test_the_same_normalisation_reads_a_source_tree():
    """What `python -m ds_core.compat.fingerprint ROOT` records from an unpacked release is what a run computes from
    the installed one: the installed DeepSpeed's own files, read as files, give the live fingerprints."""
    import deepspeed

    root = __import__("pathlib").Path(deepspeed.__file__).parents[1]
    for target in {**verified.VERIFIED, **verified.FIXED}:
        module, qualname = fingerprint.split_target(target)
        path = root.joinpath(*module.split(".")).with_suffix(".py")
        assert fingerprint.of_source_file(path, qualname) == fingerprint.installed(target), target


def test_an_unverified_body_keeps_deepspeeds_path_with_one_line(monkeypatch):
    from deepspeed.runtime import bf16_optimizer

    from ds_core.compat.deepspeed_behaviour import deepspeed_version

    before = bf16_optimizer.clip_tensors_by_global_norm
    target = "deepspeed.runtime.utils:clip_tensors_by_global_norm"
    monkeypatch.setitem(verified.VERIFIED, target, {"0000000000000000": "another release"})
    engine = type("Engine", (), {"optimizer": object.__new__(bf16_optimizer.BF16_Optimizer)})()
    said: list[str] = []
    state = changes.apply_change("device_clip", engine=engine, device_type="cpu", say=said.append)
    assert state.state is State.REFUSED
    assert str(state).startswith(f"off: DeepSpeed {deepspeed_version()}'s deepspeed.runtime.utils.clip_tensors_by_"
                                 f"global_norm has fingerprint "), state
    assert len(said) == 1 and said[0].startswith("device_clip off: ") and "DeepSpeed's own path runs" in said[0]
    assert bf16_optimizer.clip_tensors_by_global_norm is before
