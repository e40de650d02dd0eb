"""ds_core.metrics with a controllable clock: warm-up exclusion, per-accelerator figures, summary fields."""
import json

import pytest

from ds_core.metrics import Metrics, cpu_peak_tflops

SUMMARY_FIELDS = ["model", "world_size", "nodes", "accelerators_per_node", "accelerator", "micro_batch", "grad_accum",
                  "zero_stage", "precision", "warmup_steps_excluded", "samples_per_s", "seqs_per_s_per_accelerator",
                  "tokens_per_s", "tflops_per_accelerator", "mfu"]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make(tmp_path, clock, warmup=2, world=4, rank=0, **kw):
    return Metrics(tmp_path, rank=rank, world_size=world, nodes=2, accelerators_per_node=2, accelerator="gaudi2",
                   model_name="m", micro_batch=8, grad_accum=2, zero_stage=1, precision="bf16",
                   flops_per_sample=1e12, seq_len=128, warmup_steps=warmup, peak_tflops=10.0, progress_bar=False,
                   clock=clock, **kw)


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
    """A measured peak that read low (busy machine) is re-probed at the end; the better probe wins."""
    clock = Clock()
    m = make(tmp_path, clock, warmup=0, peak_probe=lambda: 20.0)  # first probe said 10 TFLOPs
    m.begin()
    clock.t += 2.0
    m.step(1, samples=64)
    s = m.summary()
    m.close()
    assert s["peak_tflops_per_accelerator"] == 20.0
    assert s["mfu"] == pytest.approx(s["tflops_per_accelerator"] / 20.0)
