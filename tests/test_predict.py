"""ds-scaling-report predict: the collectives per ZeRO stage, the alpha-beta costs with the intra- and inter-node terms
apart, what a published table identifies of them (only the sum, under a kept global batch), the intra-node term from
a run's own communication timing, and the range each row prints (in-sample, a margin, none), on the CLI."""
import json

import pytest

from ds_tools import calibration, fabrics, predict, published, ranges, scaling_cli, validation
from test_scaling_report import write_run

P = 336_232_258      # BERT-Large (ds_configs/models/bert_large.json counted on the meta device by ds_tools.tuning)
DL1 = published.BY_KEY["dl1/bert-large-p1-bf16"]


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


def test_alpha_beta_costs_use_nccl_bus_bandwidth_with_a_factor_per_term():
    fab = fabrics.custom(800, 80, latency_us=100)           # 100 GB/s intra, 10 GB/s per node
    s = 1e9
    # 2 nodes x 4: intra 2*3/4*1e9/1e11 + inter 2*1/2*1e9/1e10, latency 2*3*2us + 2*1*100us
    assert fabrics.all_reduce_s(fab, s, 4, 2) == pytest.approx(0.015 + 0.1 + 212e-6)
    assert fabrics.gather_s(fab, s, 4, 2) == pytest.approx(0.0075 + 0.05 + 106e-6)
    assert fabrics.all_reduce_s(fab, s, 1, 1) == 0.0
    # the two terms' factors apart: halving the intra factor doubles the intra term only
    apart = fab.with_factors(0.5, 1.0, "test")
    assert fabrics.all_reduce_s(apart, s, 4, 2) == pytest.approx(0.030 + 0.1 + 212e-6)
    assert (apart.eta_intra, apart.eta_inter) == (0.5, 1.0)


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
    # the published fabrics carry no per-call cost: their fit absorbs it
    assert all(f.call_us == 0.0 for f in fabrics.FABRICS.values())
    with pytest.raises(ValueError, match="--call_us"):
        fabrics.custom(1, 1, 5, call_us=-1)


def test_every_published_table_states_its_settings_with_sources_or_says_they_are_not():
    """Each setting that decides a table's collectives is stated with its source, or not stated with the values it
    is evaluated at; DL1's runs were ZeRO-1 (their collectives gather the partitions), not ZeRO-0."""
    need = {"pattern", "grad_bytes", "overlap", "schedule", "micro_batch", "buckets", "gradient_path", "stage"}
    for t in published.PUBLISHED:
        assert need <= set(t.settings), t.key
        assert t.source and t.read
        for name, s in t.settings.items():
            assert s.source, (t.key, name)
            assert s.stated or s.plausible, (t.key, name)
        for pattern in t.setting("pattern").values:
            assert pattern in published.COMM_PATTERNS
    assert DL1.setting("stage").value == 1
    assert all(any(kind == "all_gather" for kind, _ in published.COMM_PATTERNS[p])
               for p in DL1.setting("pattern").values)
    # its pattern is not stated (the fork's code is not public): both plausible ones are fitted, and their spread is
    # the calibration's range of w, not one of them picked
    cal = calibration.calibration("dl1")
    assert {p for _k, p, _w in cal.fits} == set(DL1.setting("pattern").values)
    lo, hi = cal.w_range
    assert hi / lo == pytest.approx(1.5, rel=0.02)      # reduce-scatter + gather moves 2 S, all-reduce + gather 3 S


def test_the_shipped_csvs_are_the_published_tables():
    """studies/published/*.csv (what the docs' `ds-scaling-report --from_table` commands read) hold the figures of
    the published tables they name, row by row."""
    from conftest import REPO
    from ds_tools import scaling

    files = {"dl1/bert-large-p1-bf16": "bert_large_dl1.csv", "dgx-a100/bert-large-p1-fp16": "bert_large_dgx_a100.csv"}
    for key, name in files.items():
        t = published.BY_KEY[key]
        runs = scaling.read_table(REPO / "studies" / "published" / name)
        assert {r.nodes: r.throughput for r in runs} == t.table
        assert {r.accelerators for r in runs} == {n * t.per_node for n in t.table}
        micro = t.setting("micro_batch")
        assert {r.config["micro_batch"] for r in runs} == {str(micro.value) if micro.stated else None}


def test_a_kept_global_batch_identifies_only_the_sum_of_the_terms():
    """Every published table keeps its global batch: its predictions do not depend on how w splits between the
    intra- and inter-node terms (but for latency), so the split is not fitted; a per-accelerator batch moves with it
    by points of efficiency, and the range says so. The description names what was fitted and on what."""
    for fabric in ("dl1", "dgx-a100"):
        cal = calibration.calibration(fabric)
        fab = fabrics.FABRICS[fabric]
        phis = calibration.phi_bounds(fab, cal.w, cal.per_node)
        assert phis[0] < phis[1] < phis[2]
        for key in cal.tables:
            t = published.BY_KEY[key]
            v = calibration.variants(t)[0]
            effs = [[r["efficiency"] for r in calibration.table_rows(
                t, calibration.fabric_at(fab, sp.y, sp.x), v)] for sp in
                (calibration.Split(cal.w, cal.per_node, phi) for phi in (phis[0], phis[2]))]
            assert effs[0] == pytest.approx(effs[1], abs=5e-4), key
        text = cal.describe()
        assert "fitted: w = (a-1)/a y + x" in text and "not fitted: how w splits" in text
        assert all(k in text for k in cal.tables)
    # weak scaling of BERT-1.5B on DL1 from a 1-node figure: the split moves the 16-node efficiency by > 20 points
    m = predict.Measured(nodes=1, per_node=8, seq_per_s=250.0, grad_accum=24)
    res = ranges.ranged(m, fabrics.FABRICS["dl1"], params=1_530_376_226, stage=1, precision="bf16", micro=16,
                        nodes=[1, 16], model="bert_1p5b")
    row = res["rows"][1]
    assert row["param_high"] - row["param_low"] > 0.2
    assert row["efficiency_low"] < row["param_low"] <= row["efficiency"] <= row["param_high"] < row["efficiency_high"]


def test_intra_node_term_from_the_measured_runs_own_communication_timing(tmp_path, capsys):
    """A 1-node ZeRO-1 run that timed its exposed communication gives the intra-node term itself: the central
    fabric's intra factor is the one that reproduces that time, and the output says where it came from."""
    fab = fabrics.FABRICS["dl1"]
    colls = predict.collectives(1, "bf16", P, 4)
    want = 0.2                                            # the intra factor the run's timing is made to show
    comm = predict.comm_seconds(colls, fab.with_factors(want, 1.0, ""), 8, 1)
    step = 64 * 4 * 8 / 512.0                             # 512 seq/s, micro 64 x 4 per rank
    other = step - comm
    run = write_run(tmp_path, "n1", 1, 512.0, zero_stage=1, precision="bf16", grad_accum=4, phase_comm_s=comm,
                    phase_data_s=0.0, phase_forward_s=other / 2, phase_backward_s=other / 2, phase_step_s=0.0,
                    phase_wait_s=0.0)
    argv = ["predict", "--from", str(run), "--params", str(P), "--fabric", "dl1", "--nodes", "1", "2", "--format",
            "json"]
    assert scaling_cli.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["intra_efficiency"] == pytest.approx(want, rel=1e-3)
    assert "own communication timing" in res["intra_from"]
    assert res["rows"][0]["seq_per_s"] == pytest.approx(512.0)          # the measured point is reproduced
    assert all(r["exposed_comm_s"] <= r["comm_s"] + 1e-12 for r in res["rows"])


def _dl1_argv(model: str, nodes, extra=()):
    return ["predict", "--measured", "1379.76", "--measured_nodes", "1", "--model", model, "--precision", "bf16",
            "--zero_stage", "1", "--micro_batch", "32", "--global_batch", "65536", "--accelerators_per_node", "8",
            "--fabric", "dl1", "--nodes", *map(str, nodes), *extra, "--format", "json"]


def test_ranges_by_case_in_sample_margin_growing_per_doubling_or_none(capsys):
    """In-sample interval only for the calibration table's own case at its node counts; another model is a margin
    from the out-of-sample errors, growing with each doubling past the calibrated nodes; a fabric no table
    calibrates prints no range and says so."""
    assert scaling_cli.main(_dl1_argv("bert-large", [1, 2, 4, 8, 16])) == 0
    rows = {r["nodes"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows[1]["range_kind"] == "measured"
    for n in (2, 4, 8):
        assert rows[n]["range_kind"].startswith("in-sample")
        assert rows[n]["seq_per_s_low"] <= DL1.table[n] <= rows[n]["seq_per_s_high"]
    assert rows[16]["range_kind"] == "margin" and rows[16]["extrapolated"] and rows[16]["doublings"] == 1
    m = validation.margin("dl1")
    assert rows[16]["range_points"] == pytest.approx(m.at(16, 1)) and m.at(16, 1) > m.at(8, 0)
    assert scaling_cli.main(_dl1_argv("bert-1.5b", [1, 8, 32])) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["nodes"]: r for r in res["rows"]}
    assert rows[8]["range_kind"] == "margin" and not rows[8]["extrapolated"]
    assert rows[32]["range_points"] == pytest.approx(m.at(32, 2))
    assert rows[32]["range_points"] > rows[8]["range_points"]
    assert any(n.startswith("Calibration: fitted") for n in res["notes"])
    assert any("Extrapolated: 32" in n for n in res["notes"])
    custom = [a for a in _dl1_argv("bert-large", [1, 2]) if a not in ("--fabric", "dl1")]
    assert scaling_cli.main([*custom, "--intra_gbps", "800", "--inter_gbps", "400"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert all(r["range_kind"] == "none" and r["seq_per_s_low"] is None for r in res["rows"])
    assert res["notes"][0].startswith("No range: fabric custom is calibrated on no published table")
    assert scaling_cli.main(_dl1_argv("bert-large", [1, 2], ["--efficiency", "0.1"])) == 0
    assert json.loads(capsys.readouterr().out)["rows"][1]["range_kind"] == "none"


def test_cli_markdown_and_csv_say_what_each_range_is(capsys):
    assert scaling_cli.main(_dl1_argv("bert-1.5b", [1, 2, 16])[:-2] + ["--format", "md"]) == 0
    md = capsys.readouterr().out
    assert "| 16 (extrapolated) |" in md and "margin +-" in md and "1 doubling(s) out" in md
    assert "intra factor" in md and "inter factor" in md and "stage_1_and_2.py" in md
    assert "95 %" not in md.split("\n\n")[1]                       # the table: no margin printed as a 95 % interval
    assert scaling_cli.main(_dl1_argv("bert-1.5b", [1, 2])[:-2] + ["--format", "csv"]) == 0
    assert capsys.readouterr().out.startswith("nodes,accelerators,grad_accum,seq_per_s")


def test_cli_errors_name_the_flag(tmp_path, capsys):
    assert scaling_cli.main(["predict", "--measured", "100", "--nodes", "2"]) == 2
    assert "--measured_nodes" in capsys.readouterr().err
    assert scaling_cli.main(["predict", "--measured", "100", "--measured_nodes", "1", "--accelerators_per_node", "8",
                         "--params", "1000", "--zero_stage", "0", "--precision", "fp32", "--micro_batch", "8",
                         "--grad_accum", "1", "--nodes", "2"]) == 2
    assert "--fabric" in capsys.readouterr().err


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
    bare = [a for a in _dl1_argv("bert-1.5b", [16]) if a not in ("--global_batch", "65536")]
    assert scaling_cli.main(bare) == 2
    assert "--global_batch" in capsys.readouterr().err
    # a per-call cost on a calibrated fabric would change what was fitted
    assert scaling_cli.main(_dl1_argv("bert-large", [2], ["--call_us", "50"])) == 2
    assert "--call_us on a calibrated fabric" in capsys.readouterr().err


def test_exposed_comm_never_exceeds_comm(tmp_path, capsys):
    """A run whose measured exposed communication exceeds what the model gives for it (here: a small parameter count
    named with --params, ZeRO-2: its timing does not set the intra-node term): the excess stays in the step as
    compute, and exposed <= comm on every row."""
    run = write_run(tmp_path, "n1", 1, 512.0, phase_data_s=0.01, phase_forward_s=0.3, phase_backward_s=0.4,
                    phase_comm_s=0.2, phase_step_s=0.05, phase_wait_s=0.04, zero_stage=2, precision="bf16")
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


def _dgx_argv(precision: str, seq_len: int, measured: float, micro: int):
    return ["predict", "--measured", str(measured), "--measured_nodes", "1", "--model", "bert-large", "--seq_len",
            str(seq_len), "--precision", precision, "--zero_stage", "0", "--micro_batch", str(micro),
            "--global_batch", "32768", "--accelerators_per_node", "8", "--fabric", "dgx-a100", "--nodes", "1", "2",
            "32", "--format", "json"]


def test_a_run_of_the_kind_of_an_unexplained_table_carries_no_range(capsys):
    """A query like NVIDIA's phase-2 TF32 table (BERT-Large, sequence length 512, fp32 gradients on dgx-a100), whose
    loss is mostly not its collectives', prints no range and says why; phase-2 fp16 (modelled, a calibration table)
    keeps its in-sample interval."""
    assert scaling_cli.main(_dgx_argv("fp32", 512, 854, 16)) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["range_kind"] for r in res["rows"]] == ["measured", "not predictable", "not predictable"]
    assert all(r["efficiency_low"] is None for r in res["rows"])
    note = next(n for n in res["notes"] if n.startswith("No range: a run like dgx-a100/bert-large-p2-tf32"))
    assert "8.2x what dgx-a100/bert-large-p1-tf32" in note and "bins of 64" in note
    assert scaling_cli.main(_dgx_argv("fp16", 512, 1648, 32)) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["range_kind"] for r in res["rows"]][1:] == ["in-sample 95 % interval"] * 2
    assert all(r["efficiency_low"] is not None for r in res["rows"][1:])
    assert not any(n.startswith("No range") for n in res["notes"])
