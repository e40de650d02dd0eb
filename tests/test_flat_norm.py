"""ds_core.compat.flat_norm on the real DeepSpeed ZeRO-1/2 engine, 2 gloo ranks (tests/flat_norm_run.py): its global
gradient norm (over the flat buffer, or one multi-tensor norm where there is none) equals DeepSpeed's per-tensor one on
the same gradients, and its dispatched op count does not grow with the number of tensors. In BF16_Optimizer's run
also ds_core.compat.grad_hook: its per-tensor gradient hook accumulates the same fp32 gradients, bitwise, in fewer
ops."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import deepspeed_release, run_deepspeed

pytestmark = [pytest.mark.slow, pytest.mark.stack]
MODES = {"1": ("BF16_Optimizer", 1), "2": ("DeepSpeedZeroOptimizer", 2), "1-bf16acc": ("DeepSpeedZeroOptimizer", 2)}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Path:
    """Every mode's engine in one 2-rank launch (tests/flat_norm_run.py builds them one after the other)."""
    out = tmp_path_factory.mktemp("flat_norm")
    run_deepspeed(["tests/flat_norm_run.py", str(out), *MODES], timeout=600)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_flat_grad_norm_equals_deepspeeds_per_tensor_norm_in_a_few_ops(measured, mode):
    wrapper, parts = MODES[mode]
    ranks = [json.loads((measured / mode / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["world"] == 2 and r["optimizer"] == wrapper and r["installed"], r
        assert len(r["groups"]) == parts, r  # ZeRO-1/2: per parameter group (decayed; biases and norms)
        for g in r["groups"]:
            if g["float64"] is None:  # ZeRO-1/2: both sum float64 squares (another order), one float32 rounding
                assert g["ours"] == pytest.approx(g["deepspeed"], rel=3e-7, abs=0) and g["ours"] > 0, g
            else:  # BF16_Optimizer norms each tensor in float32; ours accumulates in float64 and rounds once
                assert g["ours"] == pytest.approx(g["float64"], rel=3e-7, abs=0), g
                # float32 accumulation over up to ~1e5 elements per tensor: ~1e-6 relative (measured 1.2e-6)
                assert g["deepspeed"] == pytest.approx(g["float64"], rel=1e-5, abs=0), g
            # a fixed few ops (per chunk of 2**26 elements: one here) against DeepSpeed's several per tensor
            assert g["ours_ops"] <= 32 and g["deepspeed_ops"] >= 2 * g["tensors"], g
        assert max(g["deepspeed_ops"] for g in r["groups"]) > 32
        if wrapper == "BF16_Optimizer":  # ds_core.compat.grad_hook: the same fp32 gradients in 2 ops per tensor, not 5
            h = r["grad_hook"]
            assert h["installed"] and h["bitwise"] and h["nonzero"] and h["tensors"] > 10, h
            assert (h["ours_ops"], h["deepspeed_ops"]) == (2 * h["tensors"], 5 * h["tensors"]), h
    # one global norm: every rank gets the same value (ZeRO-1/2: after the all-reduce of the partitions' sums)
    assert [g["ours"] for g in ranks[0]["groups"]] == [g["ours"] for g in ranks[1]["groups"]]


# Which of the changes inside DeepSpeed (ds_core.compat.changes) are on, per DeepSpeed release of the support matrix
# (stacks/): all on the newest; on Habana's fork (0.16.1) all but the Muon import, a module that release does not have.
# Every change that is on gives DeepSpeed's own result: the norms and hooks above, the clip in test_device_clip.py.
OFF = {(0, 19): set(), (0, 16): {"lazy_muon_import"}}
# fixes of an older release's behaviour, not needed where DeepSpeed has the fix
NOT_NEEDED = {(0, 19): {"nonfinite_group_norm", "universal_load_links", "cpu_gradient_buckets", "zero3_gather_waits",
                        "mpi_exports_as_given"}, (0, 16): set()}
# changes for another optimizer wrapper than the one a run got: "not needed" in that run (decided on the engine)
NOT_USED = {"BF16_Optimizer": {"flat_grad_norm_zero", "nonfinite_group_norm"},
            "DeepSpeedZeroOptimizer": {"flat_grad_norm_bf16", "device_clip", "one_op_grad_hook"}}


def test_which_changes_are_on_for_this_deepspeed(measured):
    release = deepspeed_release(OFF, NOT_NEEDED)
    for mode, (wrapper, _) in MODES.items():
        for rank in (0, 1):
            r = json.loads((measured / mode / f"rank{rank}.json").read_text())
            off = {name for name, state in r["changes"].items() if state.startswith("off")}
            fixed = {name for name, state in r["changes"].items() if state.startswith("not needed")}
            assert off == OFF[release] and fixed == NOT_NEEDED[release] | NOT_USED[wrapper], (mode, r["changes"])
            # on: installed on the engine the run got (the flat norm on either wrapper; the hook and the device clip
            # with BF16_Optimizer)
            assert r["installed"], mode
            if wrapper == "BF16_Optimizer":
                assert r["grad_hook"]["installed"] and r["device_clip"], r
