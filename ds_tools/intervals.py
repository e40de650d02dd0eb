"""Figures with their uncertainty: the mean of repeated measurements with its 95 % confidence interval, and the
interval of a ratio of two such means (a speedup, a scaling efficiency).

A measurement is one run of a study cell: its throughput over the run's measured steps (warm-up excluded). Runs,
not windows within a run, are the unit: on a shared machine what moves a figure is mostly per run (which cores the
ranks landed on, what else was running then), and windows of one run share that, so their scatter understates it.

Method (standard statistics, stated in docs/studies.md):

- mean of n measurements x_i with the Student t interval  mean +- t(0.975, n-1) s / sqrt(n)  (s: sample standard
  deviation). One measurement has no interval and is said to be one (`Estimate.text`).
- ratio r = a / b of two independent means (efficiency = per-accelerator throughput at N nodes / at the baseline):
  first-order propagation (the delta method): relative standard error  sqrt(se_a^2 / a^2 + se_b^2 / b^2); degrees
  of freedom by Welch-Satterthwaite on the two relative variances; interval  r +- t(0.975, df) r rse.

The t quantile comes from the table below rather than scipy, which the toolkit does not otherwise need: the two-sided
95 % critical values of Student's t (any statistics textbook, e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2), linear in
1/df between the listed degrees of freedom (error under 0.002 for df >= 30, exact where listed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import mean, stdev
from typing import Sequence

CONFIDENCE = 0.95
# df -> t(0.975, df); float("inf") -> the normal's 1.960
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980, math.inf: 1.960}


def t975(df: float) -> float:
    """Two-sided 95 % critical value of Student's t with `df` degrees of freedom (df >= 1, not necessarily whole)."""
    if not df >= 1:
        raise ValueError(f"degrees of freedom {df}: expected >= 1")
    keys = sorted(_T975)
    if df in _T975:
        return _T975[df]
    hi = next(k for k in keys if k > df)
    lo = keys[keys.index(hi) - 1]
    # interpolate in 1/df (the quantile is close to linear in it)
    w = (1 / lo - 1 / df) / (1 / lo - (0 if hi == math.inf else 1 / hi))
    return _T975[lo] + w * (_T975[hi] - _T975[lo])


@dataclass(frozen=True)
class Estimate:
    """A mean of `n` measurements and its 95 % interval half-width (None: one measurement, no interval)."""
    value: float
    half: float | None
    n: int
    df: float | None = None
    se: float | None = None

    @property
    def low(self) -> float | None:
        return None if self.half is None else self.value - self.half

    @property
    def high(self) -> float | None:
        return None if self.half is None else self.value + self.half

    @property
    def rel_half(self) -> float | None:
        """Half-width relative to the value: the precision a study asks for."""
        return None if self.half is None or not self.value else self.half / abs(self.value)

    def scaled(self, k: float) -> Estimate:
        return Estimate(self.value * k, None if self.half is None else self.half * abs(k), self.n, self.df,
                        None if self.se is None else self.se * abs(k))

    def overlaps(self, other: Estimate) -> bool:
        """Whether the two intervals share a point (False where either has none)."""
        if self.half is None or other.half is None:
            return False
        return self.low <= other.high and other.low <= self.high

    def text(self, spec: str = ".2f", unit: str = "") -> str:
        """`76.56 +- 3.12 (n=5)`, or `76.56 (n=1, no interval)`: the number of measurements is always said."""
        if self.half is None:
            return f"{self.value:{spec}}{unit} (n={self.n}, no interval)"
        return f"{self.value:{spec}}{unit} ± {self.half:{spec}} (n={self.n})"


def mean_interval(values: Sequence[float]) -> Estimate:
    """The mean of the measurements with its Student t 95 % interval."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("no measurements")
    m = mean(vals)
    if len(vals) == 1:
        return Estimate(m, None, 1)
    se = stdev(vals) / math.sqrt(len(vals))
    df = len(vals) - 1
    return Estimate(m, t975(df) * se, len(vals), df, se)


def ratio_interval(a: Estimate, b: Estimate) -> Estimate:
    """a / b with its 95 % interval by first-order propagation of both relative standard errors (Welch-Satterthwaite
    degrees of freedom); no interval where either side has one measurement. `n` is the smaller of the two."""
    r = a.value / b.value
    n = min(a.n, b.n)
    if a.se is None or b.se is None:
        return Estimate(r, None, n)
    va, vb = (a.se / a.value) ** 2, (b.se / b.value) ** 2
    rse = math.sqrt(va + vb)
    if rse == 0:
        return Estimate(r, 0.0, n, math.inf, 0.0)
    df = (va + vb) ** 2 / (va ** 2 / a.df + vb ** 2 / b.df) if (va or vb) else math.inf
    return Estimate(r, t975(max(1.0, df)) * abs(r) * rse, n, df, abs(r) * rse)
