"""bench.host_ops: a BridgeTower step fed the loader's batch reads no count back with `.item()` (bridgetower_ds keeps
the counts' tensors on the host), and the counts grow by the same amount with every layer (the premise of --layers,
which measures N and 2N layers and extrapolates). Real DeepSpeed engine, bridgetower_ds's tiny preset, one CPU rank;
op counts, not times."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def count(*specs: tuple) -> list[dict]:
    """bench.host_ops.count of each spec, one after the other in one process of its own (a process start costs more
    than a count): it starts a process group (DeepSpeed's engine), whose port and environment (MASTER_PORT, RANK,
    ...) must not stay in the test process for the tests after it."""
    code = f"import json; from bench.host_ops import count; print(json.dumps([count(*a) for a in {specs!r}]))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# every count this module's tests read, made in one process the first time a test asks
SPECS = {(dtype, layers): ("bt_debug", layers, "json", dtype) for dtype, layers in
         (("fp32", 1), ("fp32", 2), ("fp32", 3), ("bf16", 1), ("bf16", 2))}


@pytest.fixture(scope="module")
def counts():
    """counts(dtype, layers): count("bt_debug", layers, "json", dtype)."""
    done: dict[tuple, dict] = {}

    def at(dtype: str, layers: int) -> dict:
        if not done:
            done.update(zip(SPECS, count(*SPECS.values())))
        return done[dtype, layers]

    return at


def assert_no_item_of_ours(r: dict) -> None:
    sites = r["sync_sites"]  # DeepSpeed's and transformers' may remain (Habana's fork reads none in fp32)
    assert not any("bridgetower_ds/" in s for s in sites) and sum(sites.values()) == r["total"]["syncs"], sites
    assert r["prof_total"]["ops"] > r["total"]["ops"]  # the profiler sees nested ops and views too
    assert r["prof_total"]["syncs"] >= r["total"]["syncs"]


def test_bridgetower_step_has_no_item_of_ours(counts):
    """One layer: the syncs of a step are per step, not per layer (the test below), so one shows them all."""
    assert_no_item_of_ours(counts("fp32", 1))


def test_bridgetower_bf16_step_does_not_grow_with_the_number_of_tensors(counts):
    """The shipped BridgeTower JSON in bf16 (what a GPU runs) accumulates gradients in fp32, which makes DeepSpeed
    take BF16_Optimizer: its step works on flat buffers (the norm through ds_core.compat.flat_norm), where
    DeepSpeedZeroOptimizer copies every parameter's gradient and weight one by one (~5 ops per tensor per step, and
    ~13 more in its backward hooks)."""
    runs = {n: counts("bf16", n) for n in (1, 2)}
    assert {r["zero_optimizer"] for r in runs.values()} == {"BF16_Optimizer"}
    # the counter sees a library's read: BF16_Optimizer's check of the gradient norm (0.19: is_invalid_grad_norm;
    # Habana's fork: the assert of a positive norm in its step)
    sites = runs[1]["sync_sites"]
    assert any("is_invalid_grad_norm" in s or "bf16_optimizer.py" in s for s in sites), sites
    assert runs[1]["engine_step"]["ops"] == runs[2]["engine_step"]["ops"], [r["engine_step"] for r in runs.values()]
    assert runs[2]["total"]["ops"] > runs[1]["total"]["ops"]  # the second layer is there: the model's ops grew


@pytest.mark.slow
def test_bridgetower_counts_are_linear_in_layers(counts):
    runs = {n: counts("fp32", n) for n in (1, 2, 3)}
    for key in ("total", "engine_step", "prof_total"):
        ops = [runs[n][key]["ops"] for n in (1, 2, 3)]
        assert ops[1] - ops[0] == ops[2] - ops[1] > 0, (key, ops)
        assert runs[1][key]["syncs"] == runs[3][key]["syncs"], key  # per step, not per layer
    for n in (2, 3):
        assert_no_item_of_ours(runs[n])
