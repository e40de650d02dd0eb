"""ds-tune timed from a measurement: compute per sequence from a measured run (--measured with its layout, or --from
RUN_DIR), the vendor's peak at an MFU stated as assumed with the range the published figures imply otherwise, micro
batch entering the step through per-micro-step fixed costs, rows within the model's error said equal (more headroom
preferred), and both gradient paths listed with the wrapper the installed DeepSpeed builds for each."""
import json

import pytest

from ds_tools import published, tuning, tuning_time, zero_memory_model as zmm
from test_scaling_report import write_run

pytestmark = pytest.mark.stack  # ds-tune's memory model asks the installed DeepSpeed

GIB = 2 ** 30
DL1_LARGE = published.BY_KEY["dl1/bert-large-p1-bf16"]
MEASURED = ["--measured", str(DL1_LARGE.table[1]), "--measured_nodes", "1", "--measured_micro_batch", "32",
            "--measured_global_batch", "65536"]
DEMO = ["--model", "bert-1.5b", "--accelerator", "dl1", "--accelerators_per_node", "8", "--nodes", "8",
        "--global_batch", "24576", *MEASURED, "--measured_model", "bert-large"]


def summary(argv, capsys) -> dict:
    assert tuning.main([*argv, "--json", "--out", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_measured_step_is_reproduced_and_its_compute_carried_to_another_model(capsys):
    """The measured layout's own row takes exactly the measured step (its communication taken out and put back);
    another model's compute is the measured per-sequence time scaled by 6 x parameters x tokens."""
    s = summary(["--model", "bert-large", "--accelerator", "dl1", "--nodes", "1", "--global_batch", "65536",
                 "--stages", "1", "--activation_checkpointing", "off", *MEASURED], capsys)
    row = next(r for r in s["rows"] if r["micro_batch"] == 32 and r["grad_accum_dtype"] == "fp32")
    assert row["step_s"] == pytest.approx(65536 / DL1_LARGE.table[1], rel=1e-9)
    assert "1379.76 seq/s measured on 1 node(s)" in s["step_time"]
    big = summary(DEMO, capsys)
    large, small = tuning.model_shape("bert-large"), tuning.model_shape("bert-1.5b")
    r = big["rows"][0]
    per_seq_large = row["compute_s"] / (32 * 256)
    assert r["compute_s"] == pytest.approx(per_seq_large * small.params / large.params * r["micro_batch"]
                                           * r["grad_accum"], rel=0.02)   # the 1-node comm taken out differs a little
    assert "scaled to bert_1p5b by 6 x parameters x tokens" in big["step_time"] and "assumed" in big["step_time"]


def test_without_a_measurement_the_mfu_is_assumed_with_the_published_range():
    lo, hi, keys = tuning_time.mfu_range()
    p1 = published.BY_KEY["dgx-a100/bert-large-p1-fp16"]
    P = tuning.model_shape("bert-large").params
    assert lo == pytest.approx(6 * P * 128 * p1.table[1] / 8 / 312e12)        # NVIDIA phase 1: the lowest
    assert hi == pytest.approx(6 * P * 128 * DL1_LARGE.table[1] / 8 / 60e12)   # DL1: the highest
    assert keys[0] == p1.key and keys[-1] == DL1_LARGE.key
    tm = tuning.time_model("dl1", 8, 8, "bf16", None, None)
    assert tm.mfu == pytest.approx((lo + hi) / 2)
    text = tm.describe(tuning.model_shape("bert-1.5b"))
    assert "(assumed; --mfu)" in text and f"range {100 * lo:.0f}-{100 * hi:.0f} %" in text


def test_micro_batch_enters_through_per_micro_step_fixed_costs(capsys):
    """With a stated per-micro-step cost two layouts differ by their micro-steps' count times it; without one they
    are equally fast and the one with the most headroom is recommended, not the first in order."""
    s = summary([*DEMO, "--micro_step_ms", "50"], capsys)
    fp32 = {r["micro_batch"]: r for r in s["rows"] if r["stage"] == 1 and r["grad_accum_dtype"] == "fp32"
            and not r["checkpointing"]}
    assert fp32[16]["step_s"] - fp32[32]["step_s"] == pytest.approx((24 - 12) * 0.05)
    assert "slower" in fp32[8]["reason"] and s["recommended"]["micro_batch"] == 32
    s = summary(DEMO, capsys)
    best = s["recommended"]
    equal = [r for r in s["rows"] if r["fits"] and r["keeps_margin"] and r["compute_known"]
             and r["grad_accum_dtype"] == "fp32" and (r["recommended"] or "as fast" in r["reason"])]
    assert len(equal) > 1 and best["headroom_gib"] == max(r["headroom_gib"] for r in equal)
    assert all("with less headroom" in r["reason"] for r in equal if not r["recommended"])


def test_from_a_run_directory_with_phase_timing(tmp_path, capsys):
    """--from RUN_DIR as predict takes it: its model, layout and phase timing; the per-micro-step cost is its data
    wait per micro-step, and the run's 1-node communication timing sets the intra-node term."""
    step = 64 * 4 * 8 / 1000.0                            # 1000 seq/s, micro 64 x 4 per rank: 2.048 s
    run = write_run(tmp_path, "n1", 1, 1000.0, micro_batch=64, grad_accum=4, zero_stage=1, precision="bf16",
                    phase_data_s=0.02 * step, phase_forward_s=0.3 * step, phase_backward_s=0.55 * step,
                    phase_comm_s=0.08 * step, phase_step_s=0.05 * step, phase_wait_s=0.0)
    s = summary(["--model", "bert-large", "--accelerator", "dl1", "--nodes", "2", "--global_batch", "1024",
                 "--stages", "1", "--from", str(run)], capsys)
    assert f"per-micro-step fixed cost {1000 * 0.02 * step / 4:g} ms (measured" in s["step_time"]
    assert "own communication timing" in s["step_time"]
    assert s["rows"][0]["fixed_s"] == pytest.approx(s["rows"][0]["grad_accum"] * 0.02 * step / 4 + 0.05 * step)


def test_both_gradient_paths_with_the_installed_deepspeeds_wrappers(tmp_path, capsys):
    """Each bf16 ZeRO-1 layout is listed with fp32 gradient accumulation and with bf16 gradients, each with the
    wrapper the installed DeepSpeed builds for it, its memory and its step; the JSON is the chosen row's, and the
    output says why."""
    out = tmp_path / "ds.json"
    assert tuning.main([*DEMO, "--json", "--out", str(out)]) == 0
    s = json.loads(capsys.readouterr().out)
    rows = [r for r in s["rows"] if r["stage"] == 1 and not r["checkpointing"]]
    by = {(r["micro_batch"], r["grad_accum_dtype"]): r for r in rows}
    P = tuning.model_shape("bert-1.5b").params
    for (micro, acc), r in by.items():
        assert r["optimizer"] == zmm.deepspeed_optimizer(1, "bf16", acc, True)
        other = by.get((micro, "bf16" if acc == "fp32" else "fp32"))
        if other:     # (a layout that fits on one path only is listed once, with --all both)
            assert r["step_s"] == pytest.approx(other["step_s"])   # the same bytes on the wire
    # the paths the installed DeepSpeed takes (a release that refused bf16 accumulation would list fp32 only)
    assert tuning.grad_paths(1, "bf16") in (["fp32", "bf16"], ["fp32"])
    fp32, bf16 = by[16, "fp32"], by.get((16, "bf16"))
    if bf16 and fp32["optimizer"] == "BF16_Optimizer":         # its fp32 gradient buffer is not partitioned
        assert fp32["predicted_gib"] - bf16["predicted_gib"] > 3.9 * P / GIB
    best = s["recommended"]
    assert best["grad_accum_dtype"] == "fp32"
    assert json.loads(out.read_text())["data_types"] == {"grad_accum_dtype": "fp32"}
    assert all("bf16 gradients" in r["reason"] for r in rows if r["grad_accum_dtype"] == "bf16"
               and r["keeps_margin"] and r["compute_known"])
    assert tuning.main([*DEMO, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Why: " in text and "fp32 gradient accumulation" in text
    assert ("bf16-gradient path" in text) == (bf16 is not None)


def test_measured_flags_name_what_is_missing(capsys):
    assert tuning.main(["--model", "bert-large", "--accelerator", "dl1", "--global_batch", "512", "--measured",
                        "100", "--measured_nodes", "1"]) == 2
    assert "--measured_micro_batch" in capsys.readouterr().err
    assert tuning.main(["--model", "bert-large", "--accelerator", "dl1", "--global_batch", "512", "--measured",
                        "100", "--measured_nodes", "1", "--measured_micro_batch", "8"]) == 2
    assert "--measured_grad_accum and --measured_global_batch" in capsys.readouterr().err
    assert tuning.main(["--model", "bert-large", "--accelerator", "h200", "--global_batch", "512", "--measured",
                        "100", "--measured_nodes", "1", "--measured_micro_batch", "8", "--measured_grad_accum",
                        "1"]) == 2
    assert "has none (give --fabric)" in capsys.readouterr().err


def test_a_run_of_the_kind_no_collectives_model_accounts_for_gets_no_step_range(capsys):
    """ds-tune says what `predict` says for a run like NVIDIA's phase-2 TF32 table (BERT-Large, sequence length 512,
    fp32 gradients on dgx-a100): its communication is not predictable, so its step times carry no range; the same
    run in bf16 (2-byte gradients, modelled) keeps its ranges."""
    argv = ["--model", "bert-large", "--accelerator", "a100", "--nodes", "4", "--global_batch", "2048",
            "--seq_len", "512", "--stages", "1"]
    s = summary([*argv, "--precision", "fp32"], capsys)
    assert "Not predictable, so no step range is printed: a run like dgx-a100/bert-large-p2-tf32" in s["step_time"]
    assert s["rows"] and all(r["step_low_s"] is None and r["step_high_s"] is None for r in s["rows"])
    assert all(r["step_s"] is not None for r in s["rows"])  # the central step still orders the rows
    s = summary([*argv, "--precision", "bf16"], capsys)
    assert "Not predictable" not in s["step_time"]
    assert all(r["step_low_s"] < r["step_s"] < r["step_high_s"] for r in s["rows"])
