"""Emulated fabrics (ds_tools.study.netns, launcher = "emulated_fabric"): 1 and 2 "nodes" as network namespaces
on a 100 Mbit/s tc-shaped bridge, the BERT debug preset with ZeRO-1 bf16, and the predicted-vs-measured comparison
(ds_tools.study.emulated). Root and iproute2 only (CI runs as root); skipped with the reason elsewhere."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, dist_env
from ds_tools import predict
from ds_tools.study import emulated, netns
from ds_tools.study.runner import fabric_key
from ds_tools.study.spec import StudyError, load_study

MBIT = 100


def _study(tmp_path: Path) -> Path:
    text = (REPO / "studies" / "emulated_fabrics.toml").read_text()
    # the shipped study, smaller: one fabric, fewer steps, one repeat, its data in tmp_path
    text = (text.replace("steps = 30", "steps = 12").replace("repeats = 2", "repeats = 1")
            .replace('fabric = ["slow", "fast"]', 'fabric = ["slow"]').replace("runs/data", str(tmp_path / "data")))
    p = tmp_path / "emulated.toml"
    p.write_text(text)
    return p


def test_study_fabrics_are_checked(tmp_path):
    study = load_study(_study(tmp_path))
    assert study.launcher == "emulated_fabric" and study.fabrics["slow"] == {"mbit": 100.0, "delay_ms": 1.0}
    assert study.fabric_of(study.cells()[0]) == {"name": "slow", "mbit": 100.0, "delay_ms": 1.0}
    bad = tmp_path / "bad.toml"
    for table, axes, msg in (("slow = { mbit = 0 }", 'fabric = ["slow"]', r"\[fabrics\] slow.mbit = 0"),
                             ("slow = { mbit = 10, jitter = 1 }", 'fabric = ["slow"]', "expected { mbit"),
                             ("slow = { mbit = 10 }", 'fabric = ["fast"]', "'fast': not in \\[fabrics\\]"),
                             ("", "nodes = [1, 2]", "needs a \\[fabrics\\] table")):
        bad.write_text(f'[study]\nmodule = "m"\nlauncher = "emulated_fabric"\n[fabrics]\n{table}\n[axes]\n{axes}\n')
        with pytest.raises(StudyError, match=msg):
            load_study(bad)


def test_netns_fabric_is_cleaned_up_and_refuses_bad_links():
    why = netns.unavailable()
    if why:
        pytest.skip(f"emulated fabric: {why}")
    with pytest.raises(netns.FabricError, match="mbit=0"):
        with netns.emulated_fabric(2, mbit=0, delay_ms=1):
            pass
    with netns.emulated_fabric(2, mbit=MBIT, delay_ms=1.0, key=4242) as fab:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(ns in listed for ns in fab.namespaces)
        ok = subprocess.run(fab.wrap(0, ["ip", "-o", "addr", "show", "dev", netns.IFACE]), capture_output=True,
                            text=True).stdout
        assert fab.addresses[0] in ok
        qd = subprocess.run(["tc", "-n", fab.namespaces[1], "qdisc", "show", "dev", netns.IFACE],
                            capture_output=True, text=True).stdout
        assert "tbf" in qd and "100Mbit" in qd
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in fab.namespaces + [fab.hub])


@pytest.mark.slow
def test_emulated_two_nodes_predicted_vs_measured(tmp_path):
    why = netns.unavailable()
    if why:
        pytest.skip(f"emulated fabric: {why}")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ds_tools.study", "run", str(_study(tmp_path)), "--out", str(out)],
                          cwd=REPO, env=dist_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    cell = out / "cells" / "fabric-slow__nodes-2__rep0"
    assert "node_rank=1" in (cell / "log.txt").read_text()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"dsf{fabric_key(out) % 100_000}" not in listed          # the study removed its namespaces

    # the collectives the model prices are the ones DeepSpeed issued: the bf16 gradient all-reduce, once per step
    stats = json.loads((cell / "cell_stats" / "rank0.json").read_text())
    params, comms = stats["params"], stats["comms"]
    grad = predict.collectives(1, "bf16", params, 1)[0]
    assert comms["all_reduce"]["sizes"][str(int(grad.nbytes))] == 12

    rows = emulated.compare(out)
    assert len(rows) == 1 and rows[0]["nodes"] == 2 and rows[0]["comm_from"] == "phase timing"
    r = rows[0]
    # the link was really the shaped one: the gradient bytes over 100 Mbit/s bound the measured time from below
    assert r["measured_comm_s"] > 0.8 * grad.nbytes * 8 / (MBIT * 1e6)
    # the model at the tbf line rate is a lower bound of the measured exposed communication, and on this
    # bandwidth-bound link it explains at least a third of it (docs/studies.md: the rest is gloo's per-call cost and
    # arrival skew on a loaded host, which the model does not have; measured 1.8x on the development machine)
    assert r["predicted_comm_s"] <= r["measured_comm_s"] <= 3 * r["predicted_comm_s"], r
    assert r["efficiency_factor"] == 1.0 and 0 < r["measured_efficiency"] and 0 < r["predicted_efficiency"] < 1
