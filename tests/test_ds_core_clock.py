"""The one clock and the precision rule end to end: 2 CPU ranks, the real DeepSpeed engine (tests/tiny_train.py) with
an injected clock (the fake_clock fault of tests/faults.py: 1.0 per micro-step, 100.0 per save, 50.0 per eval), so
the throughput window is checked exactly and never against wall time."""
import json
import re

import pytest

import faults
from conftest import REPO, dist_env, run_deepspeed
from ds_core.device.precision import resolve_precision

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "tests" / "tiny_train.py")


def records(run_dir, kind):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def tiny(tmp_path, name, *flags, env=None, **injected):
    """A tiny_train run on the fake clock; `injected`: more faults (tests/faults.py), `env`: more variables."""
    run = tmp_path / name
    proc = run_deepspeed([SCRIPT, "--run_dir", str(run), "--deepspeed_config", "zero1_bf16.json", "--max_steps", "7",
                          "--throughput_warmup_steps", "2", "--progress_bar", "false",
                          "--save_final_checkpoint", "false", *flags],
                         env=dist_env(**faults.env(fake_clock=True, **injected),
                                      DS_CORE_CACHE_DIR=str(tmp_path / "cache"), **(env or {})),
                         timeout=400)
    return run, proc.stdout


def test_saves_and_evals_every_step_leave_the_window_alone_and_stats_are_summed(tmp_path):
    busy, out = tiny(tmp_path, "busy", "--num_steps_per_checkpoint", "1", "--eval_every", "1", "--log_every", "3",
                     eval=True, stats=True, env={"DS_CORE_PEAK_TFLOPS": "1e-9"})
    plain, out_plain = tiny(tmp_path, "plain", "--precision", "bf16")
    s, p = records(busy, "summary")[0], records(plain, "summary")[0]
    # 5 post-warm-up steps of one micro-step each: 5.0 on the injected clock, saves and evals outside
    assert p["measured_seconds"] == pytest.approx(5.0) and s["measured_seconds"] == pytest.approx(5.0)
    assert s["samples_per_s"] == pytest.approx(p["samples_per_s"])
    assert s["checkpoint_s"] == pytest.approx(7 * 100.0) and s["eval_s"] == pytest.approx(7 * 50.0)
    assert p["checkpoint_s"] == 0.0 and p["eval_s"] == 0.0
    # the last step is logged although 7 is not a multiple of --log_every 3; sections go into their step's record
    steps = records(busy, "step")
    assert [r["step"] for r in steps] == [3, 6, 7]
    assert [r["checkpoint_s"] for r in steps] == pytest.approx([300.0, 300.0, 100.0])
    assert [r["eval_s"] for r in steps] == pytest.approx([150.0, 150.0, 50.0])
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in steps)
    assert all(0.0 <= r["data_wait_frac"] <= 1.0 for r in steps)
    assert [r["step"] for r in records(busy, "eval")] == list(range(1, 8))
    # rank 0's console line per log step carries the file's numbers
    for r in steps:
        line = next(x for x in out.splitlines() if x.startswith(f"[ds_core] step {r['step']} |"))
        assert f"loss {r['loss']:.4g}" in line and f"grad_norm {r['grad_norm']:.4g}" in line
    # a peak that reads far too low: MFU is not written, the note says why
    assert s["mfu"] is None and "above the" in s["mfu_note"] and all(r["mfu"] is None for r in steps)
    # summary statistics of the data source: per-rank counts summed over both ranks; the shared size is not doubled
    assert s["bad_rows"] == 1 + 2 and s["bad_row_examples"] == ["rank0", "rank1"] and s["data_samples"] == 512
    assert len(s["peak_memory_gb_per_rank"]) == 2 and all(m > 0.1 for m in s["peak_memory_gb_per_rank"])
    # the run computes in the dtype the precision rule chose, and says so
    auto = resolve_precision("auto", "cpu")[0]
    assert s["precision"] == auto and p["precision"] == "bf16"
    dtype_of = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}
    assert f"tiny: parameter dtype {dtype_of[auto]}" in out
    assert "tiny: parameter dtype torch.bfloat16" in out_plain
    assert json.loads((busy / "ds_config.json").read_text())["bf16"]["enabled"] is (auto == "bf16")
    if auto == "fp32":
        why = resolve_precision("auto", "cpu")[1].split(":")[1].split(",")[1].strip()
        assert re.search(rf"precision auto: fp32, {re.escape(why)}.* TFLOPs", out), out
        assert why in s["precision_note"]
        assert p["mfu"] is None or p["mfu"] <= 1
