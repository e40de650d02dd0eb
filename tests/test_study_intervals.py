"""Figures with their uncertainty (ds_tools.intervals) and the study's measuring rule (ds_tools.study.runner
.open_combos), without training runs: the t interval's values and coverage, the ratio interval of an efficiency,
when a study measures another round, and that `ds-study plan` prints the master port a cell's commands use."""
from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from ds_tools.intervals import Estimate, mean_interval, ratio_interval, t975
from ds_tools.study import StudyError, load_study, plan, runner
from ds_tools.study.__main__ import main as study_main

NODES_STUDY = """
[study]
module = "bert_ref.train"
steps = 20
warmup_steps = 5
launcher = "simulated_nodes"
repeats = 3
precision = 0.05
max_repeats = 6
budget_s = 600

[axes]
nodes = [1, 2]
"""


def test_t_quantiles_and_the_mean_interval():
    # two-sided 95 % Student t critical values (any table): exact where listed, between them within 0.002
    assert [t975(d) for d in (1, 2, 4, 10, 30)] == [12.706, 4.303, 2.776, 2.228, 2.042]
    assert t975(math.inf) == 1.960 and 2.000 < t975(50) < 2.021 and abs(t975(50) - 2.009) < 0.002
    est = mean_interval([1.0, 2.0, 3.0])           # s = 1, se = 1/sqrt(3), t(2) = 4.303
    assert est.value == 2.0 and est.n == 3 and est.half == pytest.approx(4.303 / math.sqrt(3))
    one = mean_interval([76.56])
    assert one.half is None and one.n == 1 and one.text() == "76.56 (n=1, no interval)"
    assert est.text() == "2.00 ± 2.48 (n=3)"
    with pytest.raises(ValueError):
        mean_interval([])


def test_ratio_interval_propagates_both_sides():
    a, b = mean_interval([90.0, 100.0, 110.0]), mean_interval([180.0, 200.0, 220.0])
    r = ratio_interval(a, b)
    rse = math.sqrt((a.se / a.value) ** 2 + (b.se / b.value) ** 2)
    assert r.value == pytest.approx(0.5) and r.se == pytest.approx(0.5 * rse)
    assert r.df == pytest.approx(4.0)               # equal relative variances, 2 + 2 degrees of freedom
    assert r.half == pytest.approx(t975(4) * 0.5 * rse)
    assert r.se / r.value > max(a.se / a.value, b.se / b.value)    # less certain than either side alone
    assert ratio_interval(a, mean_interval([200.0])).half is None   # one run on either side: none


def test_intervals_cover_the_truth_and_two_runs_agree():
    """The claim a report makes, checked by simulation: a 95 % interval of the mean of 4 runs covers the true
    throughput in 95 % of studies (binomial sd over 4000 studies: 0.34 points, so 93.6-96.4 % is 4 sd), the
    efficiency interval covers the true ratio as often, and two studies' intervals overlap nearly always."""
    rng = np.random.default_rng(7)
    trials, n = 4000, 4
    one = rng.normal(100.0, 8.0, size=(trials, n))
    two = rng.normal(160.0, 12.0, size=(trials, n))   # 2 nodes at 80 % efficiency: 160 / (2 x 100)
    again = rng.normal(100.0, 8.0, size=(trials, n))
    cover = cover_eff = overlap = 0
    for i in range(trials):
        e1, e2, e3 = mean_interval(one[i]), mean_interval(two[i]), mean_interval(again[i])
        cover += e1.low <= 100.0 <= e1.high
        eff = ratio_interval(e2.scaled(0.5), e1)
        cover_eff += eff.low <= 0.8 <= eff.high
        overlap += e1.overlaps(e3)
    assert 0.936 <= cover / trials <= 0.964
    assert 0.93 <= cover_eff / trials <= 0.97       # first-order propagation: close to, not exactly, 95 %
    assert overlap / trials >= 0.99


def test_study_measures_round_by_round_until_precise(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(NODES_STUDY)
    study = load_study(path)
    # cells are numbered in measuring order: round 0 of every combination, then round 1 ...
    assert [(c.values["nodes"], c.repeat, c.index) for c in study.cells()] == \
        [(1, 0, 0), (2, 0, 1), (1, 1, 2), (2, 1, 3), (1, 2, 4), (2, 2, 5)]
    assert len(study.all_cells()) == 12
    tight, loose = [100.0, 101.0, 99.0], [100.0, 130.0, 80.0]
    # the first `repeats` rounds measure every combination, whatever the figures
    assert runner.open_combos(study, {0: tight, 1: tight}, {}, 2, 0.0) == ([0, 1], "")
    # then only combinations whose 95 % interval is wider than +-5 % of the mean
    assert mean_interval(tight).rel_half < 0.05 < mean_interval(loose).rel_half
    assert runner.open_combos(study, {0: tight, 1: loose}, {}, 3, 10.0) == ([1], "")
    todo, why = runner.open_combos(study, {0: tight, 1: tight}, {}, 3, 10.0)
    assert todo == [] and "within +-5 %" in why
    # bounded: by the time budget and by max_repeats; a combination that failed twice is not tried again
    todo, why = runner.open_combos(study, {0: tight, 1: loose}, {}, 3, 601.0)
    assert todo == [] and "time budget 600 s" in why
    assert runner.open_combos(study, {0: loose, 1: loose}, {}, 6, 10.0)[0] == []
    assert runner.open_combos(study, {0: loose, 1: loose}, {1: 2}, 4, 10.0)[0] == [0]
    # without a precision a study runs `repeats` rounds and stops
    path.write_text(NODES_STUDY.replace("precision = 0.05\nmax_repeats = 6\n", "precision = 0\n"))
    study = load_study(path)
    assert study.max_repeats == 3 and runner.open_combos(study, {0: loose, 1: loose}, {}, 3, 0.0)[0] == []


@pytest.mark.parametrize("edit, message", [
    (("repeats = 3", "repeats = 1"), "repeats = 1: expected >= 2 with a precision"),
    (("max_repeats = 6", "max_repeats = 2"), "max_repeats = 2: expected >= repeats (3)"),
    (("precision = 0.05", "precision = 5"), "precision = 5: expected >= 0 and < 1"),
    (("budget_s = 600", "budget_s = 0"), "budget_s = 0: expected > 0"),
])
def test_measuring_keys_are_checked(tmp_path, edit, message):
    path = tmp_path / "s.toml"
    path.write_text(NODES_STUDY.replace(*edit))
    with pytest.raises(StudyError) as e:
        load_study(path)
    assert str(path) in str(e.value) and message in str(e.value), str(e.value)


def test_plan_prints_the_port_its_commands_use(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text(NODES_STUDY)
    study, out = load_study(path), tmp_path / "out"
    assert study_main(["plan", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plans = [plan.build(study, c, out) for c in study.cells()]
    ports = [p.port for p in plans]
    assert len(set(ports)) == len(ports) and all(20000 <= p < 32768 for p in ports)
    for p in plans:
        assert f"master port {p.port}" in printed
        for cmd in p.commands:
            assert cmd[cmd.index("--master_port") + 1] == str(p.port)
            assert " ".join(cmd) in printed                         # the command printed is the one planned
    assert ports == [plan.build(study, c, out).port for c in study.cells()]   # the same plan every time
    assert "further rounds for each combination whose samples/s 95 % interval is wider than +-5 %" in printed
    assert not out.exists()
    path.write_text(NODES_STUDY.replace("[study]", "[study]\nmaster_port = 29600"))
    assert [plan.build(load_study(path), c, out).port for c in study.cells()[:3]] == [29600, 29602, 29604]


def test_estimate_scaled_keeps_relative_precision():
    est = mean_interval([10.0, 12.0, 11.0])
    half = est.scaled(0.5)
    assert half.value == pytest.approx(5.5) and half.rel_half == pytest.approx(est.rel_half)
    assert isinstance(half, Estimate) and half.n == 3
    assert statistics.mean([10.0, 12.0, 11.0]) == est.value
