"""ds_tools.scaling: the published BERT-Large table, hand-written metrics.jsonl fixtures (grouping, baseline, broken
runs), --plot, and (slow) real metrics.jsonl written by ds_core.run.trainer on 1 and 2 ranks."""
import json
import statistics
from pathlib import Path

import pytest

from conftest import REPO, run_deepspeed
from ds_tools import scaling

# BERT-Large on 1, 2, 4, 8 nodes of 8 accelerators
PUBLISHED = "nodes,accelerators,throughput\n1,8,1379.76\n2,16,2705.57\n4,32,5291.58\n8,64,9977.54\n"
SUMMARY = {"type": "summary", "model": "bert_large", "accelerators_per_node": 8, "accelerator": "hpu",
           "micro_batch": 64, "grad_accum": 1, "zero_stage": 1, "precision": "bf16", "seq_len": 128,
           "warmup_steps_excluded": 3, "steps": 50, "tokens_per_s": 0.0, "mfu": 0.4}


def write_run(root: Path, name: str, nodes: int, throughput: float, **over) -> Path:
    """A run directory whose metrics.jsonl has step records and a final summary, as ds_core writes it."""
    d = root / name
    d.mkdir(parents=True)
    world = nodes * over.pop("per_node", 8)
    summary = {**SUMMARY, "world_size": world, "nodes": nodes, "global_batch": world * 64,
               "samples_per_s": throughput, "seqs_per_s_per_accelerator": throughput / world, **over}
    lines = [json.dumps({"type": "step", "step": s, "loss": 5.0, "samples_per_s": throughput}) for s in (1, 2)]
    (d / "metrics.jsonl").write_text("\n".join(lines + [json.dumps(summary)]) + "\n")
    return d


def report(argv, capsys) -> str:
    assert scaling.main(argv) == 0
    return capsys.readouterr().out


def test_published_bert_large_table(tmp_path, capsys):
    csv = tmp_path / "published.csv"
    csv.write_text(PUBLISHED)
    rows = json.loads(report(["--from-table", str(csv), "--format", "json"], capsys))
    assert [r["nodes"] for r in rows] == [1, 2, 4, 8]
    assert [r["accelerators"] for r in rows] == [8, 16, 32, 64]
    assert [round(r["per_accelerator"], 2) for r in rows] == [172.47, 169.10, 165.36, 155.90]
    assert [round(100 * r["efficiency"], 2) for r in rows] == [100.0, 98.04, 95.88, 90.39]
    assert [round(r["speedup"], 2) for r in rows] == [1.0, 1.96, 3.84, 7.23]
    for r in rows:
        assert {"nodes", "accelerators", "throughput", "per_accelerator", "efficiency", "speedup"} <= set(r)
    md = report(["--from-table", str(csv)], capsys)
    # one published figure per scale: one measurement, said to be one, no interval
    assert "| 8 | 64 | 9977.54 | one run | 155.90 | 90.39 | one run | 7.23 | 1 |" in md
    assert "| 1 | 8 | 1379.76 | one run | 172.47 | 100.00 | baseline | 1.00 | 1 |" in md
    out = report(["--from-table", str(csv), "--format", "csv"], capsys).splitlines()
    assert out[0].startswith("group,nodes,accelerators,throughput,throughput_half,per_accelerator,efficiency,"
                             "efficiency_half,speedup,speedup_half,n")
    assert out[2].startswith("1,2,16,2705.57,,169.10,0.9804,,1.96,,1,")


def test_runs_from_metrics_jsonl_and_baseline_nodes(tmp_path, capsys):
    for nodes, thr in ((1, 1379.76), (2, 2705.57), (4, 5291.58)):
        write_run(tmp_path, f"n{nodes}", nodes, thr)
    # a run directory, a metrics.jsonl path and a parent of run directories are all accepted
    rows = json.loads(report([str(tmp_path / "n1"), str(tmp_path / "n2" / "metrics.jsonl"), str(tmp_path / "n4"),
                              "--format", "json"], capsys))
    assert [round(100 * r["efficiency"], 2) for r in rows] == [100.0, 98.04, 95.88]
    assert rows[0]["baseline"] and rows[0]["model"] == "bert_large"
    assert len(json.loads(report([str(tmp_path), "--format", "json"], capsys))) == 3
    rows = json.loads(report([str(tmp_path), "--baseline-nodes", "2", "--format", "json"], capsys))
    by_nodes = {r["nodes"]: r for r in rows}
    assert by_nodes[2]["efficiency"] == 1.0 and by_nodes[2]["speedup"] == 1.0
    assert round(by_nodes[1]["efficiency"], 4) == round(172.47 / (2705.57 / 16), 4)
    # runs repeated at one scale are one row: their mean, its 95 % t interval (t(0.975, 1) = 12.706) and n; the
    # efficiency interval of a larger scale carries the baseline's uncertainty
    write_run(tmp_path, "n1_again", 1, 1300.0)
    rows = {r["nodes"]: r for r in json.loads(report([str(tmp_path), "--format", "json"], capsys))}
    assert rows[1]["n"] == 2 and rows[1]["throughput"] == pytest.approx((1379.76 + 1300.0) / 2, abs=1e-4)
    half = 12.706 * statistics.stdev([1379.76, 1300.0]) / 2 ** 0.5
    assert rows[1]["throughput_half"] == pytest.approx(half, abs=1e-3)
    assert sorted(r.split("/")[-1] for r in rows[1]["runs"]) == ["n1", "n1_again"]
    assert rows[2]["n"] == 1 and rows[2]["efficiency_half"] is None    # one run at 2 nodes: no interval
    md = report([str(tmp_path)], capsys)
    assert f"| 1 | 8 | {(1379.76 + 1300.0) / 2:.2f} | {half:.2f} |" in md and "| 2 |" in md
    assert scaling.main([str(tmp_path), "--baseline-nodes", "3"]) == 2
    err = capsys.readouterr().err
    assert "group bert_large (accelerator " in err and "has runs at 1, 2, 4 node(s) only" in err  # names, no reprs
    assert "{" not in err and "[" not in err


def test_incomparable_runs_are_grouped_with_reasons(tmp_path, capsys):
    write_run(tmp_path, "a1", 1, 1000.0)
    write_run(tmp_path, "a2", 2, 1900.0)
    write_run(tmp_path, "mb", 2, 2500.0, micro_batch=32)           # different micro batch
    write_run(tmp_path, "seq", 2, 600.0, seq_len=512)               # different sequence length
    write_run(tmp_path, "fp32", 1, 300.0, precision="fp32")         # different precision
    write_run(tmp_path, "bt", 1, 90.0, model="bridgetower_large")   # different model
    rows = json.loads(report([str(tmp_path), "--format", "json"], capsys))
    groups = {}
    for r in rows:
        groups.setdefault(r["group_index"], []).append(r)
    assert len(groups) == 5
    assert [r["nodes"] for r in groups[1]] == [1, 2] and groups[1][0]["reason"] == ""
    assert round(groups[1][1]["efficiency"], 4) == 0.95
    reasons = {r["reason"] for g in list(groups.values())[1:] for r in g}
    assert any("micro_batch 32 vs 64" in x for x in reasons)
    assert any("seq_len 512 vs 128" in x for x in reasons)
    assert any("precision 'fp32' vs 'bf16'" in x for x in reasons)
    assert any("model 'bridgetower_large' vs 'bert_large'" in x for x in reasons)
    # each separate group is its own baseline: nothing is averaged across groups
    for g in list(groups.values())[1:]:
        assert len(g) == 1 and g[0]["efficiency"] == 1.0
    md = report([str(tmp_path)], capsys)
    assert md.count("### Group") == 5 and "not comparable with the first group" in md


def test_broken_inputs_name_the_file(tmp_path, capsys):
    d = tmp_path / "crashed"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"type": "step", "step": 1}) + "\n{\"type\": \"sum")
    assert scaling.main([str(d)]) == 2
    err = capsys.readouterr().err
    assert str(d / "metrics.jsonl") in err and "no {\"type\": \"summary\"} record" in err
    bad = tmp_path / "bad.csv"
    bad.write_text("nodes,gpus,throughput\n1,8,10\n")
    assert scaling.main(["--from-table", str(bad)]) == 2
    assert "expected at least ['accelerators', 'nodes', 'throughput']" in capsys.readouterr().err


def test_plot_writes_a_png_that_opens(tmp_path, capsys):
    from PIL import Image

    csv = tmp_path / "published.csv"
    csv.write_text(PUBLISHED)
    png = tmp_path / "scaling.png"
    report(["--from-table", str(csv), "--plot", str(png)], capsys)
    with Image.open(png) as im:
        im.verify()
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 400 and im.size[1] > 200
        untimed_width = im.size[0]
    # published numbers have no phase timing: two panels, no "what grew" bars that would all be "anything else";
    # runs with phase timing get the third panel
    runs = scaling.read_table(csv)
    for r in runs:
        r.phases = {k: 1.0 for k in ("phase_data_s", "phase_forward_s", "phase_backward_s", "phase_comm_s",
                                     "phase_step_s", "phase_wait_s")}
    scaling.plot(scaling.group_runs(runs), tmp_path / "timed.png")
    with Image.open(tmp_path / "timed.png") as im:
        assert im.size[0] > 1.3 * untimed_width


@pytest.mark.slow
def test_real_metrics_from_two_small_ds_core_runs(tmp_path, capsys):
    """tests/tiny_train.py trains through ds_core.run.trainer.Trainer on 1 and then 2 ranks; the reporter reads what the
    loop wrote (no hand-made numbers)."""
    for ranks in (1, 2):
        run_deepspeed([str(REPO / "tests" / "tiny_train.py"), "--run_dir", str(tmp_path / f"r{ranks}"),
                       "--max_steps", "6", "--throughput_warmup_steps", "2", "--progress_bar", "false",
                       "--save_final_checkpoint", "false", "--num_samples", "256"], num_ranks=ranks)
    rows = json.loads(report([str(tmp_path / "r1"), str(tmp_path / "r2"), "--format", "json"], capsys))
    assert [r["accelerators"] for r in rows] == [1, 2]
    assert len({r["group_index"] for r in rows}) == 1 and rows[0]["baseline"]
    s2 = [json.loads(x) for x in (tmp_path / "r2" / "metrics.jsonl").read_text().splitlines()][-1]
    assert s2["type"] == "summary"
    assert rows[1]["throughput"] == pytest.approx(s2["samples_per_s"], rel=1e-4)
    assert rows[1]["per_accelerator"] == pytest.approx(s2["samples_per_s"] / 2, rel=1e-4)
    # the JSON rounds per_accelerator to 4 decimals and efficiency to 6: their rounding is what the two may differ by
    p0, p1 = rows[0]["per_accelerator"], rows[1]["per_accelerator"]
    tol = 5e-7 + (p1 / p0) * (5e-5 / p0 + 5e-5 / p1)
    assert rows[1]["efficiency"] == pytest.approx(p1 / p0, abs=tol, rel=0)
    assert rows[1]["efficiency"] > 0
