"""ds-scaling-report predict: the collectives per ZeRO stage, the alpha-beta costs, the one calibrated factor per
fabric against the published BERT-Large tables (NVIDIA DGX A100 80GB phase 1; DL1), and the CLI on a synthetic run
with phase timing."""
import json

import pytest

from ds_tools import fabrics, predict, scaling_cli
from test_scaling_report import write_run

P = 336_232_258      # BERT-Large (ds_configs/models/bert_large.json counted on the meta device by ds_tools.tuning)


def test_collectives_follow_the_zero_stage():
    vol = {s: sum(c.nbytes * c.per_step * (2 if c.kind == "all_reduce" else 1)
                  for c in predict.collectives(s, "bf16", P, grad_accum=4)) for s in (0, 1, 2, 3)}
    g = 2 * P                                   # bf16 gradients / parameters
    assert vol[0] == 2 * g                      # one all-reduce per optimizer step
    assert vol[1] == 3 * g                      # + all-gather of the updated partitions
    assert vol[2] == 4 * 2 * g + g              # all-reduce every micro-step
    assert vol[3] == 4 * (2 * g + g)            # two parameter gathers + a gradient reduce-scatter per micro-step
    assert predict.collectives(0, "fp32", P, 1)[0].nbytes == 4 * P
    with pytest.raises(predict.PredictError, match="--zero_stage 4"):
        predict.collectives(4, "bf16", P, 1)


def test_alpha_beta_costs_use_nccl_bus_bandwidth():
    fab = fabrics.custom(800, 80, latency_us=100)           # 100 GB/s intra, 10 GB/s per node
    s = 1e9
    # 2 nodes x 4: intra 2*3/4*1e9/1e11 + inter 2*1/2*1e9/1e10, latency 2*3*2us + 2*1*100us
    assert fabrics.all_reduce_s(fab, s, 4, 2) == pytest.approx(0.015 + 0.1 + 212e-6)
    assert fabrics.gather_s(fab, s, 4, 2) == pytest.approx(0.0075 + 0.05 + 106e-6)
    assert fabrics.all_reduce_s(fab, s, 1, 1) == 0.0


def test_measured_per_call_cost_is_charged_once_per_collective_call():
    # an emulated link (ds_tools.study.emulated): 2 nodes x 1 rank, 100 Mbit/s, 30 us ring steps, 150 us per call
    fab = fabrics.custom(1e6, 0.1, latency_us=30, call_us=150)
    assert fabrics.all_reduce_s(fab, 0, 1, 2, calls=4) == pytest.approx(4 * (2 * 30 + 150) * 1e-6)  # scalars: latency
    assert fabrics.gather_s(fab, 1.25e6, 1, 2, calls=2) == pytest.approx(0.05 + 2 * (30 + 150) * 1e-6)
    colls = predict.collectives(1, "bf16", 208_130, 1, param_groups=2, small_calls=4)
    assert [(c.kind, c.nbytes, c.calls) for c in colls] == [("all_reduce", 416_260, 1), ("all_gather", 416_260, 2),
                                                            ("all_reduce", 0, 4)]
    base = predict.comm_seconds(predict.collectives(1, "bf16", 208_130, 1), fab, 1, 2)
    more = predict.comm_seconds(colls, fab, 1, 2)
    assert more - base == pytest.approx(4 * 210e-6 + (30 + 150) * 1e-6)   # 4 scalar all-reduces, 1 more gather call
    # the published fabrics carry no per-call cost: their one factor absorbs it (their fits are unchanged)
    assert all(f.call_us == 0.0 for f in fabrics.FABRICS.values())
    with pytest.raises(ValueError, match="--call_us"):
        fabrics.custom(1, 1, 5, call_us=-1)


@pytest.mark.parametrize("name", ["dgx-a100", "dl1"])
def test_published_tables_within_tolerance(name):
    # The shipped factor is the fit (a different fit would change docs/studies.md), and with it every published
    # node count is predicted within 1.5 % of its sequences/s (= 1.5 points of efficiency or less).
    assert predict.calibrate(name, params=P) == fabrics.FABRICS[name].efficiency
    res = predict.published_prediction(name, params=P)
    table = predict.PUBLISHED[name]["table"]
    assert [r["nodes"] for r in res["rows"]] == sorted(table)
    for r in res["rows"]:
        assert r["seq_per_s"] == pytest.approx(table[r["nodes"]], rel=0.015), r
    # the factor is what makes it fit: line rate (1.0) would predict near-perfect scaling, far off the table
    ideal = predict.published_prediction(name, efficiency=1.0, params=P)["rows"][-1]
    assert ideal["seq_per_s"] > 1.02 * table[ideal["nodes"]]


def test_cli_from_a_run_with_phase_timing(tmp_path, capsys):
    # 1 node x 8 at 512 seq/s, 64 x 1 per rank: step 1.0 s of which 0.005 s exposed comm (part of ~0.015 s modelled)
    run = write_run(tmp_path, "n1", 1, 512.0, phase_data_s=0.01, phase_forward_s=0.3, phase_backward_s=0.545,
                    phase_comm_s=0.005, phase_step_s=0.1, phase_wait_s=0.04, zero_stage=1, precision="bf16")
    argv = ["predict", "--from", str(run), "--params", str(P), "--fabric", "dgx-a100", "--nodes", "1", "2", "4",
            "--format", "json"]
    assert scaling_cli.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["nodes"]: r for r in res["rows"]}
    assert rows[1]["seq_per_s"] == pytest.approx(512.0)          # the measured point is reproduced
    comm1 = rows[1]["comm_s"]
    assert 0.5 < res["overlap"] == pytest.approx(1 - 0.005 / comm1)      # from the measured exposed comm
    assert rows[1]["exposed_comm_s"] == pytest.approx(0.005)
    assert rows[2]["exposed_comm_s"] == pytest.approx(0.005 + (1 - res["overlap"]) * (rows[2]["comm_s"] - comm1))
    assert rows[4]["efficiency"] < rows[2]["efficiency"] < 1.0
    assert res["efficiency_factor"] == fabrics.FABRICS["dgx-a100"].efficiency and "DLE" in res["calibrated_on"]
    assert scaling_cli.main(argv[:-1] + ["md"]) == 0
    md = capsys.readouterr().out
    assert "efficiency factor 0.403" in md and "stage_1_and_2.py" in md and "| 4 | 32 | 1 |" in md
    assert scaling_cli.main(argv[:-1] + ["csv"]) == 0
    assert capsys.readouterr().out.startswith("nodes,accelerators,grad_accum,seq_per_s")


def test_cli_errors_name_the_flag(tmp_path, capsys):
    assert scaling_cli.main(["predict", "--measured", "100", "--nodes", "2"]) == 2
    assert "--measured_nodes" in capsys.readouterr().err
    assert scaling_cli.main(["predict", "--measured", "100", "--measured_nodes", "1", "--accelerators_per_node", "8",
                         "--params", "1000", "--zero_stage", "0", "--precision", "fp32", "--micro_batch", "8",
                         "--grad_accum", "1", "--nodes", "2"]) == 2
    assert "--fabric" in capsys.readouterr().err


def test_cli_measured_with_global_batch_reproduces_the_published_fit(capsys):
    argv = ["predict", "--measured", "4553", "--measured_nodes", "1", "--params", str(P), "--precision", "fp16",
            "--zero_stage", "0", "--micro_batch", "64", "--global_batch", "65536", "--accelerators_per_node", "8",
            "--fabric", "dgx-a100", "--nodes", "1", "32", "--format", "json"]
    assert scaling_cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["grad_accum"] for r in rows] == [128, 4]
    assert rows[0]["seq_per_s"] == pytest.approx(4553)
    assert rows[1]["seq_per_s"] == pytest.approx(predict.published_prediction("dgx-a100", params=P)["rows"][-1]
                                                 ["seq_per_s"])


def test_the_shipped_published_tables_are_the_calibration_tables():
    """studies/published/*.csv (what the docs' `ds-scaling-report --from_table` commands read) hold the same figures
    as the tables the fabrics are calibrated on, row by row."""
    from conftest import REPO
    from ds_tools import scaling

    files = {"dl1": "bert_large_dl1.csv", "dgx-a100": "bert_large_dgx_a100.csv"}
    assert set(files) == set(predict.PUBLISHED)
    for fabric, name in files.items():
        runs = scaling.read_table(REPO / "studies" / "published" / name)
        spec = predict.PUBLISHED[fabric]
        assert {r.nodes: r.throughput for r in runs} == spec["table"]
        assert {r.accelerators for r in runs} == {n * spec["per_node"] for n in spec["table"]}
        assert {(r.config["micro_batch"], r.config["precision"]) for r in runs} == {(str(spec["micro"]),
                                                                                    spec["precision"])}


# BERT-1.5B, Habana's ZeRO-1 layout on DL1, from an 8-Gaudi figure
DL1_1P5B = ["predict", "--measured", "160", "--measured_nodes", "1", "--model", "bert-1.5b", "--precision", "bf16",
            "--zero_stage", "1", "--micro_batch", "32", "--global_batch", "12288", "--accelerators_per_node", "8",
            "--fabric", "dl1"]


def test_intervals_from_the_calibration_residuals_cover_the_published_table(capsys):
    """The interval is the calibration's: the published node counts, predicted from their 1-node figure, lie inside
    it; beyond the calibrated nodes and across models the output says so; a fabric fitted to nothing has none."""
    from ds_tools.intervals import t975

    for name in predict.PUBLISHED:
        table = predict.PUBLISHED[name]["table"]
        rows = predict.published_prediction(name, params=P)["rows"]
        resid = [r["seq_per_s"] / table[r["nodes"]] - 1 for r in rows if r["nodes"] != 1]
        n = len(resid)
        half = t975(n - 1) * (sum(x * x for x in resid) / (n - 1)) ** 0.5 * (1 + 1 / n) ** 0.5
        assert predict.calibration(fabrics.FABRICS[name])["rel_half"] == pytest.approx(half)
        argv = ["predict", "--measured", str(table[1]), "--measured_nodes", "1", "--params", str(P), "--precision",
                predict.PUBLISHED[name]["precision"], "--zero_stage", "0", "--micro_batch", "64", "--global_batch",
                "65536", "--accelerators_per_node", "8", "--fabric", name, "--nodes", *map(str, sorted(table)),
                "--format", "json"]
        assert scaling_cli.main(argv) == 0
        res = json.loads(capsys.readouterr().out)
        for r in res["rows"][1:]:
            assert r["seq_per_s_low"] <= table[r["nodes"]] <= r["seq_per_s_high"], (name, r)
            assert not r["extrapolated"]
        assert res["rows"][0]["seq_per_s_low"] is None        # the measured point: its own uncertainty only
        assert not any("Across models" in x or "Extrapolated" in x for x in res["notes"])
    assert scaling_cli.main([*DL1_1P5B, "--nodes", "1", "8", "16"]) == 0
    md = capsys.readouterr().out
    assert "| 16 (extrapolated) |" in md and "beyond the calibrated 1-8 nodes" in md
    assert "Across models: the factor was fitted on bert_large" in md and "bert_1p5b" in md
    eff16 = [ln for ln in md.splitlines() if ln.startswith("| 16 ")][0].split("|")[8]
    low, high = map(float, eff16.split("-"))
    assert low < high                                          # an interval, not one number
    assert scaling_cli.main([*DL1_1P5B[:-2], "--intra_gbps", "800", "--inter_gbps", "400", "--nodes", "2"]) == 0
    assert "No interval" in capsys.readouterr().out
    assert predict.calibration(fabrics.Fabric(**{**fabrics.FABRICS["dl1"].__dict__, "efficiency": 0.1})) is None


def test_inputs_that_contradict_each_other_are_refused(tmp_path, capsys):
    debug = write_run(tmp_path, "debug_n1", 1, 30.0, model="debug", per_node=1, zero_stage=1, precision="bf16")
    assert scaling_cli.main(["predict", "--from", str(debug), "--model", "bert-1.5b", "--fabric", "dl1",
                             "--nodes", "16"]) == 2
    err = capsys.readouterr().err
    assert "--model bert-1.5b" in err and "model debug" in err
    run = write_run(tmp_path, "n1", 1, 512.0, zero_stage=1, precision="bf16")
    assert scaling_cli.main(["predict", "--from", str(run), "--zero_stage", "3", "--fabric", "dl1",
                             "--nodes", "2"]) == 2
    assert "--zero_stage 3 contradicts the measured run's zero_stage 1" in capsys.readouterr().err
    # the same model by its alias is no contradiction
    assert scaling_cli.main(["predict", "--from", str(run), "--model", "bert-large", "--fabric", "dl1",
                             "--nodes", "2"]) == 0
    capsys.readouterr()
    # a bare figure without its accumulation: refused, not taken as accumulation 1
    assert scaling_cli.main([*[a for a in DL1_1P5B if a not in ("--global_batch", "12288")], "--nodes", "16"]) == 2
    assert "--global_batch" in capsys.readouterr().err


def test_exposed_comm_never_exceeds_comm(tmp_path, capsys):
    """A run whose measured exposed communication exceeds what the model gives for it (here: a small parameter count
    named with --params): the excess stays in the step as compute, and exposed <= comm on every row."""
    run = write_run(tmp_path, "n1", 1, 512.0, phase_data_s=0.01, phase_forward_s=0.3, phase_backward_s=0.4,
                    phase_comm_s=0.2, phase_step_s=0.05, phase_wait_s=0.04, zero_stage=1, precision="bf16")
    assert scaling_cli.main(["predict", "--from", str(run), "--params", "1000000", "--fabric", "dgx-a100",
                             "--nodes", "1", "2", "4", "8", "--format", "json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["rows"][0]["seq_per_s"] == pytest.approx(512.0)    # the measured point is still reproduced
    assert all(r["exposed_comm_s"] <= r["comm_s"] for r in res["rows"])
    assert res["overlap"] == 0 and "kept in the step as compute" in res["overlap_source"]


def test_report_help_lists_predict(capsys):
    assert scaling_cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "ds-scaling-report predict" in out and "predict --help" in out
