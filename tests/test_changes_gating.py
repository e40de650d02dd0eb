"""ds_core.compat.changes gates a change that replaces a DeepSpeed method body on that body's fingerprint
(ds_core.compat.fingerprint, recorded per tested release in ds_core.compat.verified): an unverified body keeps
DeepSpeed's own path, with one line naming the change and the DeepSpeed version."""
from __future__ import annotations

import inspect
import textwrap

import pytest

from conftest import deepspeed_release
from ds_core.compat import changes, fingerprint, verified

pytestmark = pytest.mark.stack

# bodies each tested release needs verified: the speed-ups on both, the fixes of 0.16's faults on the fork only
NEEDED = {(0, 19): {"flat_grad_norm_bf16", "flat_grad_norm_zero", "device_clip", "one_op_grad_hook",
                    "pdsh_remote_quoted"},
          (0, 16): {"flat_grad_norm_bf16", "flat_grad_norm_zero", "device_clip", "one_op_grad_hook",
                    "nonfinite_group_norm", "cpu_gradient_buckets", "zero3_gather_waits", "mpi_exports_as_given",
                    "pdsh_remote_quoted"}}


def test_the_installed_bodies_are_the_verified_ones():
    release = deepspeed_release(NEEDED)
    for name in NEEDED[release]:
        change = changes.BY_NAME[name]
        assert change.bodies, name
        for target in change.bodies:
            assert fingerprint.installed(target) in verified.VERIFIED[target], (name, target)
        assert changes.unverified(change) is None, name


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
    for target in verified.VERIFIED:
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
    assert state.startswith(f"off: DeepSpeed {deepspeed_version()}'s deepspeed.runtime.utils.clip_tensors_by_global_"
                            f"norm has fingerprint "), state
    assert len(said) == 1 and said[0].startswith("device_clip off: ") and "DeepSpeed's own path runs" in said[0]
    assert bf16_optimizer.clip_tensors_by_global_norm is before
