"""ds-scaling-report's breakdown of the efficiency lost between the smallest and each larger run, on synthetic
metrics.jsonl files carrying ds_core.outputs.phases' summary fields (phase_*_s)."""
import json

import pytest

from test_scaling_report import report, write_run

# one optimizer step of 64 sequences per accelerator, seconds per phase (sum 1.0 s at 1 node)
BASE = {"phase_data_s": 0.01, "phase_forward_s": 0.30, "phase_backward_s": 0.50, "phase_comm_s": 0.05,
        "phase_step_s": 0.10, "phase_wait_s": 0.04}


def phases(**over):
    return {**BASE, **over}


def test_breakdown_adds_up_and_names_what_grew(tmp_path, capsys):
    # 4 nodes: exposed communication 0.05 -> 0.25 s, slowest-rank wait 0.04 -> 0.10 s, data wait 0.01 -> 0.00 s,
    # compute unchanged: step 1.0 -> 1.25 s, efficiency 80 %
    write_run(tmp_path, "n1", 1, 8 * 64 / 1.0, **phases())
    write_run(tmp_path, "n4", 4, 32 * 64 / 1.25, **phases(phase_comm_s=0.25, phase_wait_s=0.10, phase_data_s=0.0))
    # 2 nodes without phase timing (an older run): the loss cannot be split and is said so
    write_run(tmp_path, "n2", 2, 16 * 64 / 1.1)
    rows = {r["nodes"]: r for r in json.loads(report([str(tmp_path), "--format", "json"], capsys))}
    lost = rows[4]["lost"]
    assert rows[4]["efficiency"] == pytest.approx(0.8)
    assert lost["comm"] == pytest.approx(100 * 0.20 / 1.25, abs=1e-3)      # 16 points
    assert lost["wait"] == pytest.approx(100 * 0.06 / 1.25, abs=1e-3)      # 4.8 points
    assert lost["data"] == pytest.approx(-100 * 0.01 / 1.25, abs=1e-3)     # shrank: -0.8
    assert lost["other"] == pytest.approx(0.0, abs=1e-3)
    assert lost["comm"] + lost["wait"] + lost["data"] + lost["other"] == pytest.approx(100 * (1 - 0.8), abs=1e-3)
    assert lost["timed"] is True
    assert rows[2]["lost"]["timed"] is False
    assert rows[2]["lost"]["other"] == pytest.approx(100 * (1 - 1 / 1.1), abs=1e-3)
    assert rows[1]["lost"]["total"] == pytest.approx(0.0)

    md = report([str(tmp_path)], capsys)
    assert "| communication | slowest rank | data | anything else | total lost | n | phase timing |" in md
    assert "| 4 | 32 | 16.00 | 4.80 | -0.80 | 0.00 | 20.00 | 1 | yes |" in md
    assert "| 2 | 16 | 0.00 | 0.00 | 0.00 | 9.09 | 9.09 | 1 | no: all in anything else |" in md
    out = report([str(tmp_path), "--format", "csv"], capsys).splitlines()
    head = out[0].split(",")
    assert "lost_comm,lost_wait,lost_data,lost_other,lost_total,phase_timing" in out[0]
    row = dict(zip(head, [line for line in out if line.startswith("1,4,32,")][0].split(",")))
    assert [row[k] for k in ("lost_comm", "lost_wait", "lost_data", "lost_other", "lost_total", "phase_timing")] \
        == ["16.0000", "4.8000", "-0.8000", "0.0000", "20.0000", "1"]


def test_breakdown_plot_has_the_stacked_bars(tmp_path, capsys):
    write_run(tmp_path, "n1", 1, 512.0, **phases())
    write_run(tmp_path, "n2", 2, 16 * 64 / 1.2, **phases(phase_comm_s=0.25))
    png = tmp_path / "s.png"
    report([str(tmp_path), "--plot", str(png)], capsys)
    from PIL import Image

    w, h = Image.open(png).size
    assert w > 1.3 * h            # three panels side by side: throughput, efficiency, what grew


@pytest.mark.parametrize("lost", [
    {"comm": 40.46, "wait": 3.93, "data": -1.0, "other": 11.04},    # a part that shrank among parts that grew
    {"comm": 5.0, "wait": -2.0, "data": -1.0, "other": -4.0},       # more shrank than grew: a negative total
])
def test_stacked_parts_end_at_the_total(lost):
    """The breakdown's bar: its parts, stacked, end exactly at the total; with a positive total nothing is drawn below
    zero and the bar's top is the sum of what grew (the parts that shrank hatched inside it), never past it."""
    from ds_tools import scaling_explain as explain

    lost = {**lost, "total": sum(lost.values())}
    segs = explain.stack_segments(lost)
    assert sorted(k for k, _, _ in segs) == sorted(explain.BUCKETS)
    bottom, height = segs[-1][1], segs[-1][2]
    assert bottom + height == pytest.approx(lost["total"])
    for (_, b0, h0), (_, b1, _) in zip(segs, segs[1:]):
        assert b1 == pytest.approx(b0 + h0)          # each part starts where the one before it ended
    lows = [min(b, b + h) for _, b, h in segs]
    grew = sum(v for k, v in lost.items() if k in explain.BUCKETS and v > 0)
    assert max(max(b, b + h) for _, b, h in segs) == pytest.approx(grew)
    if lost["total"] >= 0:
        assert min(lows) >= 0
