"""Reports that label what they compare, on study directories written as `ds-study run` writes them (cell.json,
metrics.jsonl summary), without training: scaling groups split by every axis the study varied, each row with its
interval, n and the runs it rests on, unique run names across studies, charts that do not overprint at any number of
cells, and a report.csv that is always written and reads back."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from ds_tools import scaling
from ds_tools.study import load_study, report as report_mod, runner
from ds_tools.study.__main__ import main as study_main

FABRICS = """
[study]
name = "fabrics"
module = "bert_ref.train"
launcher = "emulated_fabric"
repeats = 2

[fabrics]
slow = { mbit = 100, delay_ms = 1.0 }
fast = { mbit = 1000, delay_ms = 0.2 }

[axes]
fabric = ["slow", "fast"]
nodes = [1, 2]
"""
NODES = """
[study]
name = "nodes_only"
module = "bert_ref.train"
launcher = "simulated_nodes"
repeats = 2

[axes]
nodes = [1, 2]
"""
# samples/s per (fabric, nodes), two repeats each; the fast fabric's 1-node cells ran on a quieter machine
FIGURES = {("slow", 1): [100.0, 104.0], ("slow", 2): [120.0, 126.0], ("fast", 1): [150.0, 154.0],
           ("fast", 2): [250.0, 262.0]}


def write_study(root: Path, text: str, figures: dict) -> Path:
    """A study directory with every cell complete: cell.json ok and a metrics.jsonl summary of its samples/s."""
    (root / "study.toml").parent.mkdir(parents=True, exist_ok=True)
    (root / "study.toml").write_text(text)
    study = load_study(root / "study.toml")
    for cell in study.cells():
        d = runner.cell_dir(root, cell)
        d.mkdir(parents=True)
        nodes = cell.values.get("nodes", 1)
        thr = figures[tuple(v for k, v in cell.values.items() if k != "nodes") + (nodes,)][cell.repeat]
        summary = {"type": "summary", "model": "debug_phase1", "accelerator": "cpu", "micro_batch": 4,
                   "seq_len": 128, "precision": "fp32", "zero_stage": 1, "world_size": nodes, "nodes": nodes,
                   "samples_per_s": thr, "steps": 20, "measured_steps": 15, "measured_seconds": 15 * 4 * nodes / thr}
        (d / "metrics.jsonl").write_text(json.dumps(summary) + "\n")
        (d / "cell.json").write_text(json.dumps({"status": "ok", "exit_code": 0, "values": cell.values,
                                                 "repeat": cell.repeat}))
    return root


def test_groups_split_by_every_axis_with_intervals_and_named_runs(tmp_path, capsys):
    out = write_study(tmp_path / "fab", FABRICS, FIGURES)
    assert study_main(["report", str(out)]) == 0
    data = json.loads((out / "report" / "report.json").read_text())
    rows = {(r["fabric"], r["nodes"]): r for r in data["scaling"]}
    assert len({r["group_index"] for r in data["scaling"]}) == 2     # one group per fabric, never mixed
    for fabric in ("slow", "fast"):
        one, two = rows[(fabric, 1)], rows[(fabric, 2)]
        assert one["baseline"] and one["n"] == two["n"] == 2
        m1, m2 = sum(FIGURES[(fabric, 1)]) / 2, sum(FIGURES[(fabric, 2)]) / 2
        assert two["efficiency"] == pytest.approx(m2 / 2 / m1, abs=1e-6)   # against its own fabric's 1 node
        assert two["efficiency_half"] > 0 and one["throughput_half"] > 0
        assert sorted(two["runs"]) == [f"cells/fabric-{fabric}__nodes-2__rep{r}" for r in (0, 1)]
    assert max(r["efficiency"] for r in data["scaling"]) <= 1.0    # no fast 1-node run against a slow baseline
    md = (out / "report" / "report.md").read_text()
    assert "(accelerator cpu, micro batch 4, seq len 128, precision fp32, zero stage 1, fabric fast)" in md
    assert "not comparable with the first group: different fabric 'slow' vs 'fast'" in md or \
        "different fabric 'fast' vs 'slow'" in md
    # the throughput table: every combination with its mean, interval and n
    combos = {(c["fabric"], c["nodes"]): c for c in data["combos"]}
    assert len(combos) == 4 and all(c["n"] == 2 and c["samples_per_s_half"] > 0 for c in combos.values())
    # report.csv reads back as the same cells
    assert study_main(["report", "--from_table", str(out / "report" / "report.csv"), "--out",
                       str(tmp_path / "back")]) == 0
    back = {(c["fabric"], c["nodes"]): c for c in
            json.loads((tmp_path / "back" / "report.json").read_text())["combos"]}
    for k, c in combos.items():
        assert back[k]["samples_per_s"] == pytest.approx(c["samples_per_s"])
        assert back[k]["n"] == 2 and back[k]["samples_per_s_half"] == pytest.approx(c["samples_per_s_half"])


def test_node_only_study_writes_a_report_csv_that_reads_back(tmp_path, capsys):
    out = write_study(tmp_path / "n", NODES, {(1,): [100.0, 98.0], (2,): [150.0, 160.0]})
    assert study_main(["report", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO((out / "report" / "report.csv").read_text())))
    assert [(r["nodes"], r["n"]) for r in rows] == [("1", "2"), ("2", "2")]
    assert (out / "report" / "throughput.png").stat().st_size > 1000
    assert study_main(["report", "--from_table", str(out / "report" / "report.csv"), "--out", str(tmp_path / "b")]) == 0
    back = json.loads((tmp_path / "b" / "report.json").read_text())["combos"]
    assert [(c["nodes"], c["samples_per_s"]) for c in back] == [(1, 99.0), (2, 155.0)]


def test_scaling_report_finds_study_cells_and_names_them_apart(tmp_path, capsys):
    """`ds-scaling-report STUDY_DIR` reads the cells two levels down (failed cells and earlier attempts left out);
    two studies with the same cell names stay apart in the rows."""
    a = write_study(tmp_path / "studies" / "a", NODES, {(1,): [100.0, 98.0], (2,): [150.0, 160.0]})
    write_study(tmp_path / "studies" / "b", NODES, {(1,): [60.0, 62.0], (2,): [90.0, 80.0]})
    (a / "previous" / "nodes-1__rep0.0").mkdir(parents=True)      # an earlier attempt: not a cell
    (a / "previous" / "nodes-1__rep0.0" / "metrics.jsonl").write_text("{\"type\": \"step\"}\n")
    assert scaling.main([str(a), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["nodes"], r["n"]) for r in rows] == [(1, 2), (2, 2)]
    assert scaling.main([str(tmp_path / "studies"), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = [n for r in rows for n in r["runs"]]
    assert len(names) == 8 and len(set(names)) == 8
    assert "a/cells/nodes-1__rep0" in names and "b/cells/nodes-1__rep0" in names
    # the two studies are comparable runs of one group: each scale's row rests on all four runs
    assert [(r["nodes"], r["n"]) for r in rows] == [(1, 4), (2, 4)]


def _overlaps(boxes) -> list:
    return [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes)) if boxes[i].overlaps(boxes[j])]


@pytest.mark.parametrize("shape", [(2, 2), (4, 3, 2)])
def test_throughput_bars_never_overprint(shape):
    """Every combination its own bar at its own x (nodes side by side, not stacked), and no two value labels or
    tick labels overlapping, at 4 and at 24 cells."""
    import itertools

    import matplotlib.pyplot as plt

    names = ["fabric", "workers", "nodes"][-len(shape):]
    combos = [report_mod.Combo("ours", dict(zip(names, vals)), [100.0 + 7 * i, 104.0 + 7 * i], 2)
              for i, vals in enumerate(itertools.product(*(range(n) for n in shape)))]
    fig = report_mod.bars_figure([("this study", combos)], names)
    fig.canvas.draw()
    ax = fig.axes[0]
    xs = [round(p.get_x() + p.get_width() / 2, 6) for p in ax.patches]
    assert len(xs) == len(combos) == len(set(xs))
    r = fig.canvas.get_renderer()
    assert not _overlaps([t.get_window_extent(r) for t in ax.texts])
    assert not _overlaps([t.get_window_extent(r) for t in ax.get_xticklabels()])
    assert all("(n=2)" in t.get_text() for t in ax.texts)
    plt.close(fig)
