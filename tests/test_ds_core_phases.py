"""ds_core.outputs.phases: sampled phase timing. A unit test drives the timer with a fake clock (which steps are
sampled, what each phase gets, the summary without warm-up); a 2-rank run of the real engine with one rank made slow
shows the wait on the other rank, and the phases of a step never add up to more than the step."""
import json

import pytest

import faults
from conftest import REPO, dist_env, run_deepspeed
from ds_core.config import DS_CONFIG_DIR
from ds_core.outputs import phases


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class CpuAccelerator:      # what deepspeed's CPU accelerator says: no events
    Event = None

    @staticmethod
    def device_name():
        return "cpu"


def test_timer_samples_every_k_th_step_and_splits_it():
    clock = FakeClock()
    timer = phases.PhaseTimer(3, clock=clock, accelerator=CpuAccelerator())
    durations = {"data": 0.5, "forward": 1.0, "backward": 2.0, "step": 0.25}
    seen = []
    for step in range(1, 10):
        for micro in range(2):                  # accumulation 2: phases add over the micro-steps
            for name in phases.PHASES:
                if name == "step" and micro == 0:
                    continue                    # (the loop calls engine.step every micro-step; the test need not)
                timer.begin(name)
                clock.t += durations[name] * step
                timer.end(name)
        seen.append(timer.boundary(step))
    assert [s["step"] if s else None for s in seen] == [None, None, 3, 3, 3, 6, 6, 6, 9]
    six = timer.samples[1]
    assert six["data_s"] == pytest.approx(2 * 0.5 * 6) and six["forward_s"] == pytest.approx(2 * 6.0)
    assert six["backward_s"] == pytest.approx(2 * 12.0) and six["step_s"] == pytest.approx(1.5)
    assert six["comm_s"] == 0 and six["wait_s"] == 0 and six["slowest_rank"] == 0   # one rank, no collectives
    fields = phases.record_fields(six)
    assert fields["phase_step"] == 6 and fields["phase_backward_s"] == pytest.approx(24.0)
    summary = phases.summary_fields(timer.samples, first_step=3)     # step 3 is warm-up: 6 and 9 remain
    assert summary["phase_sampled_steps"] == 2
    assert summary["phase_forward_s"] == pytest.approx((12.0 + 18.0) / 2)
    assert sum(summary["phase_frac"].values()) == pytest.approx(1.0)
    assert phases.console_line(summary).startswith("data 14% | forward 28% | backward 55% | comm 0% | step 3%")
    off = phases.PhaseTimer(0, clock=clock, accelerator=CpuAccelerator())
    off.begin("data")
    off.end("data")
    assert off.boundary(10) is None and off.samples == []
    with pytest.raises(ValueError, match="every = -1"):
        phases.PhaseTimer(-1, accelerator=CpuAccelerator())


def test_wait_is_split_per_collective_so_alternating_skew_is_not_communication():
    # two ranks, three collectives of 10 ms own time each: rank 0 arrives 30 ms early at the first, rank 1 30 ms
    # early at the second; their busy totals are equal, so totals alone would call all 80 ms communication
    def row(busy, durs):
        return [0.0, 0.0, busy, 0.0, sum(durs), busy, float(len(durs)), *durs,
                *[0.0] * (phases.MAX_COLLECTIVES - len(durs))]

    rows = [row(0.1, [0.04, 0.01, 0.01]), row(0.1, [0.01, 0.04, 0.01])]
    wait, slowest, wait_max = phases.split_wait(rows, 0)
    assert wait == pytest.approx(0.03) and wait_max == pytest.approx(0.03)          # comm_s = 0.06 - 0.03 = 0.03
    assert phases.split_wait(rows, 1)[0] == pytest.approx(0.03)
    # unequal counts (or more than MAX_COLLECTIVES): the per-rank totals, as before
    rows = [row(0.1, [0.05]), row(0.14, [0.01, 0.0])]
    wait, slowest, _ = phases.split_wait(rows, 0)
    assert slowest == 1 and wait == pytest.approx(0.04)


@pytest.mark.slow
def test_slow_rank_shows_up_as_wait_on_the_other(tmp_path):
    cfg = json.loads((DS_CONFIG_DIR / "zero1_bf16.json").read_text())
    cfg.update(gradient_accumulation_steps=2, bf16={"enabled": False})     # fp32: fast on any CPU
    ds = tmp_path / "zero1.json"
    ds.write_text(json.dumps(cfg))
    run = tmp_path / "run"
    sleep = 0.3
    proc = run_deepspeed([str(REPO / "tests" / "tiny_train.py"), "--run_dir", str(run), "--deepspeed_config",
                          str(ds), "--max_steps", "8", "--phase_timing_every", "2", "--throughput_warmup_steps", "2",
                          "--progress_bar", "false", "--save_final_checkpoint", "false"],
                         env=dist_env(**faults.env(slow_rank=1, slow_s=sleep)))
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in recs if r["type"] == "step"}
    sampled = [r for r in steps.values() if r.get("phase_step") == r["step"]]
    assert [r["step"] for r in sampled] == [2, 4, 6, 8]
    for r in sampled:
        # rank 1 sleeps `sleep` s in each of its 2 forwards; rank 0 (which writes the metrics) waits for it inside
        # the collectives: that time is wait, not communication, and not rank 0's forward
        assert r["phase_slowest_rank"] == 1, r
        assert r["phase_wait_s"] > sleep, r
        assert r["phase_forward_s"] < r["phase_wait_s"] and r["phase_comm_s"] >= 0
        # the phases are disjoint parts of the step: never more than the time between two step records
        parts = sum(r[f"phase_{k}"] for k in phases.FIELDS)
        assert parts <= (r["time"] - steps[r["step"] - 1]["time"]) * 1.02 + 0.005, r
    summary = next(r for r in recs if r["type"] == "summary")
    assert summary["phase_sampled_steps"] == 3                    # 4, 6, 8: step 2 is warm-up
    assert summary["phase_frac"]["wait"] == max(summary["phase_frac"].values())
    assert "[ds_core] step time (3 sampled steps): data " in proc.stdout
