"""Compiled vs eager within the rounding of the compute dtype: the criterion of PyTorch's own compile accuracy
check (torch._dynamo.utils.same with an fp64 reference, as its benchmark suite uses it).

Eager and compiled run the same function with the same weights; they differ only in where results are rounded
(inductor fuses element-wise chains and keeps their intermediates in fp32, eager rounds every op's output to the
dtype). So both are roundings of one exact function, evaluated here in float64 with the same weights. The error of
eager against that reference IS the dtype's rounding error on this model and batch; the compiled output may differ
from the reference by at most twice that (torch's multiplier), plus one rounding of the result itself (a unit
roundoff of its magnitude, the least error any result in the dtype carries: it keeps a scalar, whose eager error can
be zero by chance, from getting a zero tolerance). A compiled graph that computes anything else (a dropped mask, a
wrong layout) is off by the size of the function's change, not by rounding, and fails.
"""
from __future__ import annotations

import torch

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}  # half the gap between 1 and the next number


def rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


def rounding_errors(ref: torch.Tensor, eager: torch.Tensor, compiled: torch.Tensor,
                    dtype: torch.dtype) -> tuple[float, float, float]:
    """(compiled's error, eager's error, the tolerance) as RMS differences from the float64 reference."""
    ref = ref.double()
    err_c, err_e = rms(compiled.double() - ref), rms(eager.double() - ref)
    return err_c, err_e, 2 * err_e + UNIT_ROUNDOFF[dtype] * rms(ref)


def assert_within_rounding(name: str, ref: torch.Tensor, eager: torch.Tensor, compiled: torch.Tensor,
                           dtype: torch.dtype) -> None:
    err_c, err_e, tol = rounding_errors(ref, eager, compiled, dtype)
    assert err_c <= tol, (f"{name} ({dtype}): compiled is {err_c:.3g} (RMS) from the float64 reference, eager "
                          f"{err_e:.3g}; allowed 2 x eager + one rounding = {tol:.3g}")
