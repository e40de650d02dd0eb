"""Metrics on CUDA: the accelerator row found from torch.cuda.get_device_name (H100 SXM / PCIe, H200, A100), MFU in
(0, 1] against that row's peak, and no host synchronisation per step from our code: torch's profiler over 20 steps of
`bert_ref.train.main` (one rank, bf16, ZeRO-1) counts cudaStreamSynchronize / cudaDeviceSynchronize and .item()
(aten::_local_scalar_dense) calls whose Python stack passes through ds_core/ or bert_ref/.
Skipped with the reason where torch.cuda.is_available() is false."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, dist_env
from test_gpu_train import STEPS, bert_args, losses, shards, summary  # noqa: F401 - shards is a fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device (torch.cuda.is_available() is False)")]
LOG_EVERY = STEPS  # one logged step: what a per-step sync would be hidden behind otherwise

PROFILE = r"""
import json, sys
import torch
from torch.profiler import ProfilerActivity, profile
from bert_ref.train import main
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
    main(sys.argv[1:])
ours = ("/ds_core/", "/bert_ref/")
counts = {"sync_total": 0, "sync_ours": 0, "item_total": 0, "item_ours": 0, "where": {}}
for e in prof.events():
    kind = ("sync" if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize") else
            "item" if e.name == "aten::_local_scalar_dense" else None)
    if kind is None:
        continue
    counts[kind + "_total"] += 1
    frames = [f for f in (e.stack or []) if any(o in f for o in ours)]
    if frames:
        counts[kind + "_ours"] += 1
        counts["where"][frames[0]] = counts["where"].get(frames[0], 0) + 1
print("PROFILE " + json.dumps(counts))
"""


def test_accelerator_row_from_device_name():
    from ds_core.device.accelerators import from_device_name, get

    name = torch.cuda.get_device_name(0)
    row = from_device_name(name)
    print(f"{name!r} -> {row}")
    if any(k in name for k in ("H100", "H200", "A100")) and "NVL" not in name:
        assert row is not None, f"{name!r} is one of the table's GPUs but no row was found"
        assert get(row).bf16_tflops > 0
    # the same lookup the metrics use: ds_core.outputs.metrics.accelerator_kind
    from ds_core.outputs.metrics import accelerator_kind

    assert accelerator_kind("cuda") == (row or "cuda")


def test_mfu_at_most_one_and_no_host_sync_per_step(shards, tmp_path):  # noqa: F811 - the fixture imported above
    run = tmp_path / "run"
    argv = bert_args(shards, run, 1, "bf16", "--log_every", str(LOG_EVERY))[1:]
    env = dist_env(DS_ACCELERATOR="cuda")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", PROFILE, *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    counts = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("PROFILE "))[8:])
    print(json.dumps(counts, indent=1))
    s = summary(run)
    from ds_core.device.accelerators import from_device_name

    row = from_device_name(torch.cuda.get_device_name(0))
    if row is not None:
        assert s["mfu"] is not None and 0 < s["mfu"] <= 1, s
    assert max(losses(run)) == STEPS
    # fewer than one per step from our code: a per-step .item() or stream sync would give >= STEPS
    assert counts["item_ours"] < STEPS, counts["where"]
    assert counts["sync_ours"] < STEPS, counts["where"]
