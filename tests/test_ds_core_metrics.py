"""ds_core.outputs.metrics with a controllable clock: warm-up exclusion, per-accelerator figures, summary fields."""
import json

import pytest

from ds_core.device.precision import cpu_peak_tflops
from ds_core.outputs.metrics import REPROBE_MIN_S, Metrics, RunInfo

SUMMARY_FIELDS = ["model", "world_size", "nodes", "accelerators_per_node", "accelerator", "micro_batch", "grad_accum",
                  "zero_stage", "precision", "warmup_steps_excluded", "samples_per_s", "seqs_per_s_per_accelerator",
                  "tokens_per_s", "tflops_per_accelerator", "mfu"]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make(tmp_path, clock, warmup=2, world=4, rank=0, log_every=1, **kw):
    info = RunInfo(model="m", world_size=world, nodes=2, accelerators_per_node=2, accelerator="gaudi2", micro_batch=8,
                   grad_accum=2, zero_stage=1, precision="bf16", flops_per_sample=1e12, seq_len=128,
                   warmup_steps=warmup, log_every=log_every, peak_tflops=10.0)
    return Metrics(tmp_path, info, rank=rank, progress_bar=False, clock=clock, **kw)


def test_warmup_steps_are_excluded_and_rates_are_per_accelerator(tmp_path):
    clock = Clock()
    m = make(tmp_path, clock)
    m.begin()
    # Two slow warm-up steps (compilation), then three steps of 2 s with 64 global samples each.
    for step, dt in [(1, 50.0), (2, 30.0), (3, 2.0), (4, 2.0), (5, 2.0)]:
        clock.t += dt
        m.step(step, samples=64, tokens=64 * 128, loss=1.0, lr=0.1)
    s = m.summary()
    m.close()
    assert s["measured_steps"] == 3 and s["measured_seconds"] == pytest.approx(6.0)
    assert s["samples_per_s"] == pytest.approx(32.0)  # 192 samples / 6 s; warm-up's 80 s ignored
    assert s["seqs_per_s_per_accelerator"] == pytest.approx(8.0)
    assert s["tokens_per_s"] == pytest.approx(32.0 * 128)
    assert s["tflops_per_accelerator"] == pytest.approx(8.0)  # 8 samples/s/acc x 1 TFLOP
    assert s["mfu"] == pytest.approx(0.8)
    assert s["global_batch"] == 8 * 2 * 4
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["type"] == "step"]
    assert [r["warmup"] for r in steps] == [True, True, False, False, False]
    assert steps[0]["samples_per_s"] is None and steps[3]["samples_per_s"] == pytest.approx(32.0)
    assert recs[-1]["type"] == "summary"
    for f in SUMMARY_FIELDS:
        assert recs[-1][f] is not None, f


def test_no_warmup_window_starts_at_begin(tmp_path):
    clock = Clock()
    m = make(tmp_path, clock, warmup=0)
    m.begin()
    clock.t += 4.0
    m.step(1, samples=40)
    s = m.summary()
    m.close()
    assert s["samples_per_s"] == pytest.approx(10.0)


def test_only_rank0_writes(tmp_path):
    m = make(tmp_path, Clock(), rank=1)
    m.begin()
    m.step(1, samples=1)
    m.summary()
    m.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_cpu_peak_probe_measures_something():
    assert cpu_peak_tflops(n=256, seconds=0.05) > 0


def test_a_better_peak_probe_at_the_end_lowers_mfu(tmp_path):
    """A measured peak that read low (busy machine) is re-probed at the end of a run whose timed window lasted
    REPROBE_MIN_S; the better probe wins."""
    clock = Clock()
    m = make(tmp_path, clock, warmup=0, peak_probe=lambda: 20.0)  # first probe said 10 TFLOPs
    m.begin()
    clock.t += REPROBE_MIN_S
    m.step(1, samples=64)
    s = m.summary()
    m.close()
    assert s["peak_tflops_per_accelerator"] == 20.0
    assert s["mfu"] == pytest.approx(s["tflops_per_accelerator"] / 20.0)


def test_a_run_shorter_than_the_probe_is_worth_keeps_the_cached_peak(tmp_path):
    """A timed window under REPROBE_MIN_S does not pay the re-probe (seconds in emulated bf16): the start-up peak
    stays."""
    clock, calls = Clock(), []
    m = make(tmp_path, clock, warmup=0, peak_probe=lambda: calls.append(1) or 20.0)
    m.begin()
    clock.t += REPROBE_MIN_S - 1.0
    m.step(1, samples=64)
    s = m.summary()
    m.close()
    assert calls == [] and s["peak_tflops_per_accelerator"] == 10.0
    assert s["mfu"] == pytest.approx(s["tflops_per_accelerator"] / 10.0)


def read(tmp_path):
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def run_steps(m, clock, n, save_every=0, eval_every=0, save_s=30.0, eval_s=7.0):
    """n optimizer steps of 2 s each; a save of save_s / an eval of eval_s after every save_every / eval_every."""
    m.begin()
    for step in range(1, n + 1):
        clock.t += 2.0
        m.step(step, samples=64, loss=1.0)
        if save_every and step % save_every == 0:
            with m.timed("checkpoint"):
                clock.t += save_s
        if eval_every and step % eval_every == 0:
            with m.timed("eval"):
                clock.t += eval_s
                m.eval(step, {"eval_loss": 0.5})
    m.end_training()
    with m.timed("checkpoint"):  # the final save: after the window
        clock.t += save_s
    return m.summary()


def test_saves_and_evals_are_outside_the_throughput_window(tmp_path):
    c1, c2 = Clock(), Clock()
    plain = run_steps(make(tmp_path / "a", c1, warmup=2), c1, 10)
    busy = run_steps(make(tmp_path / "b", c2, warmup=2), c2, 10, save_every=1, eval_every=1)
    assert plain["measured_seconds"] == pytest.approx(16.0)  # 8 post-warm-up steps x 2 s
    assert busy["measured_seconds"] == pytest.approx(plain["measured_seconds"])
    assert busy["samples_per_s"] == pytest.approx(plain["samples_per_s"]) == pytest.approx(32.0)
    assert busy["checkpoint_s"] == pytest.approx(11 * 30.0) and busy["eval_s"] == pytest.approx(10 * 7.0)
    assert plain["checkpoint_s"] == pytest.approx(30.0) and plain["eval_s"] == 0.0
    recs = read(tmp_path / "b")
    steps = [r for r in recs if r["type"] == "step"]
    # each step record carries the save and eval that ran right after its step, and its rate is unaffected
    assert all(r["checkpoint_s"] == pytest.approx(30.0) and r["eval_s"] == pytest.approx(7.0) for r in steps)
    assert all(r["samples_per_s"] == pytest.approx(32.0) for r in steps if not r["warmup"])
    # records stay in order: step k, then eval k
    kinds = [(r["type"], r["step"]) for r in recs if r["type"] != "summary"]
    assert kinds[:4] == [("step", 1), ("eval", 1), ("step", 2), ("eval", 2)]


def test_last_step_is_logged_when_not_a_multiple_of_log_every(tmp_path):
    clock = Clock()
    m = make(tmp_path, clock, warmup=0, log_every=3)
    m.begin()
    for step in range(1, 8):
        clock.t += 1.0
        m.step(step, samples=10, loss=float(step))
    s = m.summary()
    m.close()
    steps = [r for r in read(tmp_path) if r["type"] == "step"]
    assert [r["step"] for r in steps] == [3, 6, 7]
    assert steps[-1]["loss"] == 7.0 and steps[-1]["samples_per_s"] == pytest.approx(10.0)
    assert s["measured_seconds"] == pytest.approx(7.0)


def test_step_record_has_grad_norm_data_wait_and_console_line(tmp_path, capsys):
    clock = Clock()
    m = make(tmp_path, clock, warmup=0)
    m.begin()
    m.data_wait(1.0)
    clock.t += 4.0  # 1 s of the 4 waited for data
    m.step(1, samples=8, loss=2.0, grad_norm=0.75)
    m.close()
    rec = read(tmp_path)[0]
    assert rec["grad_norm"] == 0.75 and rec["data_wait_frac"] == pytest.approx(0.25)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("[ds_core] step 1 | loss 2 | grad_norm 0.75 |") and "data_wait_frac 0.25" in line
    assert f"samples_per_s {rec['samples_per_s']:.4g}" in line


def test_mfu_above_one_is_never_written(tmp_path):
    """A peak probe that reads low (emulated bf16 on a CPU without native bf16, a busy moment) would give MFU > 1."""
    clock = Clock()
    m = make(tmp_path, clock, warmup=0, peak_probe=lambda: 0.5)  # a 2 s window: no re-probe
    m.peak = m.static["peak_tflops_per_accelerator"] = 0.001  # a start-up probe that read low
    m.begin()
    clock.t += 2.0
    m.step(1, samples=64)
    s = m.summary()
    m.close()
    assert s["tflops_per_accelerator"] > s["peak_tflops_per_accelerator"]
    assert s["mfu"] is None and "above the bf16 peak" in s["mfu_note"]
    step = read(tmp_path)[0]
    assert step["mfu"] is None and "mfu_note" in step
    for r in read(tmp_path):
        assert r.get("mfu") is None or r["mfu"] <= 1


def test_no_known_peak_gives_null_mfu_with_a_note(tmp_path):
    clock = Clock()
    m = make(tmp_path, clock, warmup=0)
    m.peak = None
    m.begin()
    clock.t += 1.0
    m.step(1, samples=8)
    s = m.summary()
    m.close()
    assert s["mfu"] is None and "no bf16 peak known" in s["mfu_note"]


def test_console_prints_each_eval_and_marks_untimed_steps(tmp_path, capsys):
    """One line per held-out evaluation with its numbers; steps outside the throughput window say "not timed"."""
    clock = Clock()
    m = make(tmp_path, clock, warmup=1)
    m.begin()
    for step in (1, 2):
        clock.t += 1.0
        m.step(step, samples=8, loss=2.0)
        m.eval(step, {"mlm_loss": 6.25, "mlm_accuracy": 0.125, "nsp_loss": 0.5, "nsp_accuracy": 0.75, "samples": 64})
    m.close()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[ds_core]")]
    assert len(lines) == 4 and lines[0].startswith("[ds_core] step 1 |") and lines[0].endswith("(not timed)")
    assert lines[2].startswith("[ds_core] step 2 |") and "not timed" not in lines[2] and "warm-up" not in lines[2]
    for ln, step in ((lines[1], 1), (lines[3], 2)):
        assert ln == (f"[ds_core] eval at step {step} | mlm_loss 6.25 | mlm_accuracy 0.125 | nsp_loss 0.5 | "
                      "nsp_accuracy 0.75 | samples 64")
    assert [r["type"] for r in read(tmp_path)].count("eval") == 2  # the file keeps them too
