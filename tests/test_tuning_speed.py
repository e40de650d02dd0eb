"""ds-tune answers "which configuration is fastest and fits": memory weighed against the accelerator's capacity in
GiB under a printed headroom rule, step times from the communication model `ds-scaling-report predict` uses (ZeRO-3's
gathers every micro step), a reason on every row not recommended, `--top N` rows, and stdout that is JSON only
where JSON is asked for. The published DL1 BERT-1.5B setting (Habana's run: ZeRO-1, micro batch 32, accumulation 6
on 64 Gaudi, tests/data/habana_bert_1p5b.json) is the case a user plans with."""
import json
import logging
import sys

import pytest

from conftest import REPO
from ds_tools import fabrics, predict, ranges, tuning

pytestmark = pytest.mark.stack  # ds-tune's memory model asks the installed DeepSpeed

GIB = 2 ** 30
DL1 = ["--model", "bert-1.5b", "--accelerator", "dl1", "--accelerators_per_node", "8", "--nodes", "8",
       "--global_batch", "12288"]


def test_dl1_bert_1p5b_gets_the_published_layout_and_every_other_row_a_reason(tmp_path, capsys):
    habana = json.loads((REPO / "tests" / "data" / "habana_bert_1p5b.json").read_text())
    published = habana["files"]["scripts/deepspeed_config_bert_1.5b.json"]
    assert tuning.main([*DL1, "--json", "--out", str(tmp_path / "ds.json")]) == 0
    s = json.loads(capsys.readouterr().out)
    best = s["recommended"]
    assert s["capacity_gib"] == 32.0    # 32 GB of HBM2 per first-generation Gaudi: 32 GiB, not 32 x 10^9 bytes
    assert (best["stage"], best["micro_batch"]) == (published["zero_stage"],
                                                    published["train_micro_batch_size_per_gpu"])
    assert best["grad_accum"] == published["train_batch_size"] // (best["micro_batch"] * 64)
    # the headroom rule is stated, and the recommendation keeps it
    assert "10 % of its own peak" in s["headroom_rule"]
    assert best["headroom_gib"] >= tuning.SAFETY_MARGIN * best["predicted_gib"]
    rows = s["rows"]
    assert [r["recommended"] for r in rows].count(True) == 1 and rows[0]["recommended"]
    assert all(r["reason"] for r in rows[1:])
    # ZeRO-3 is slower here, with the numbers: its gathers every micro step cost more than ZeRO-1's whole step
    zero3 = [r for r in rows if r["stage"] == 3 and not r["checkpointing"] and r["compute_known"]]
    assert zero3 and all(r["step_s"] > best["step_s"] and "slower" in r["reason"] for r in zero3)
    z3_48 = next(r for r in zero3 if r["micro_batch"] == 48)
    assert z3_48["comm_s"] > best["step_s"] and "no overlap" in z3_48["reason"]


def test_step_times_use_predicts_collectives_and_fabric():
    shape = tuning.model_shape("bert-1.5b")
    times = tuning.time_model("dl1", 8, 8, "bf16", None, tuning.DEFAULT_MFU)
    assert times.fabric.name == "dl1"                        # the system the accelerator is, at its fitted terms
    assert times.fabric == ranges.terms(fabrics.FABRICS["dl1"]).central
    opts = {(o.stage, o.micro_batch): o for o in tuning.search(shape, "dl1", 8, 8, 12288, "off", (1, 3),
                                                               times=times)}
    for (stage, micro), o in opts.items():
        want = predict.comm_seconds(predict.collectives(stage, "bf16", shape.params, o.grad_accum),
                                    times.fabric, 8, 8)
        assert o.step.comm_s == pytest.approx(want)
    # ZeRO-1 communicates once per optimizer step; ZeRO-3 gathers and reduce-scatters every micro step
    assert opts[1, 1].step.comm_s == pytest.approx(opts[1, 192].step.comm_s)
    assert opts[3, 32].step.comm_s == pytest.approx(6 * opts[3, 192].step.comm_s)
    # the accelerator with no modelled system gets no step times, and the output says so
    none = tuning.time_model("h200", 8, 2, "bf16", None, 0.4)
    assert none.fabric is None and "not modelled" in none.describe(shape)


def test_top_n_prints_n_rows_and_the_headroom_rule(tmp_path, capsys):
    out = str(tmp_path / "ds.json")
    for n in (1, 3):
        assert tuning.main([*DL1, "--top", str(n), "--out", out]) == 0
        text = capsys.readouterr().out
        table = [ln for ln in text.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
        assert len(table) == n and "**recommended**" in table[0]
        assert "Headroom rule:" in text and "Step time = compute + per-micro-step fixed cost" in text


def test_json_stdout_is_json_only_while_a_library_logs_and_prints(tmp_path, capsys, monkeypatch):
    """A library that logs to stdout (DeepSpeed's logger does: its accelerator warning came first on ds-tune --json's
    stdout) or prints while the tool works leaves stdout to the JSON."""
    noisy = logging.getLogger("noisy_library_for_test")
    handler = logging.StreamHandler(sys.stdout)
    noisy.addHandler(handler)
    shape_of = tuning.model_shape

    def shape_and_noise(*a, **k):
        noisy.warning("Setting accelerator to CPU")
        print("a library's print")
        return shape_of(*a, **k)

    monkeypatch.setattr(tuning, "model_shape", shape_and_noise)
    try:
        assert tuning.main([*DL1, "--json", "--top", "2", "--out", str(tmp_path / "ds.json")]) == 0
        got = capsys.readouterr()
        assert json.loads(got.out)["recommended"]["stage"] == 1
        assert "Setting accelerator to CPU" in got.err and "a library's print" in got.err
        assert tuning.main([*DL1, "--out", "-"]) == 0
        got = capsys.readouterr()
        assert json.loads(got.out)["train_micro_batch_size_per_gpu"] == 32
    finally:
        noisy.removeHandler(handler)
