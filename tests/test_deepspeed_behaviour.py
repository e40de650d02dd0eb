"""Behaviour that differs between the DeepSpeed releases of the support matrix, read from the installed one
(ds_core.compat.deepspeed_behaviour), stated here per release: which optimizer wrapper a configuration gets (what
ds-tune's memory model and the config checks ask), whether the comms logger's timer is cumulative, and whether
BF16_Optimizer's bf16 gradients stay allocated between steps."""
from __future__ import annotations

import pytest

from conftest import deepspeed_release
from ds_core.compat.deepspeed_behaviour import WrapperRefused, comms_timer_cumulative, optimizer_wrapper
from ds_core.config import settle_grad_accum_dtype
from ds_core.errors import ConfigError

pytestmark = pytest.mark.stack

REFUSED = "refused"
# (stage, precision, grad_accum_dtype) -> wrapper, per DeepSpeed release (major, minor); fused_adam=True
WRAPPERS = {
    (0, 19): {(0, "fp32", None): "basic", (0, "bf16", None): "FP16_Optimizer", (0, "bf16", "fp32"): REFUSED,
              (1, "bf16", "fp32"): "BF16_Optimizer", (1, "bf16", None): "DeepSpeedZeroOptimizer",
              (2, "bf16", "fp32"): "DeepSpeedZeroOptimizer", (3, "bf16", "fp32"): "DeepSpeedZeroOptimizer_Stage3"},
    (0, 16): {(0, "fp32", None): "basic", (0, "bf16", None): REFUSED, (0, "bf16", "fp32"): "BF16_Optimizer",
              (1, "bf16", "fp32"): "BF16_Optimizer", (1, "bf16", None): "DeepSpeedZeroOptimizer",
              (2, "bf16", "fp32"): "DeepSpeedZeroOptimizer", (3, "bf16", "fp32"): "DeepSpeedZeroOptimizer_Stage3"},
}
CUMULATIVE = {(0, 19): True, (0, 16): False}
# whether BF16_Optimizer's bf16 gradients stay allocated between steps (ds-tune's memory model; measured against the
# live tensors by tests/test_bench_zero_memory.py)
BF16_GRADS_HELD = {(0, 19): False, (0, 16): True}


@pytest.fixture(scope="module")
def release() -> tuple[int, int]:
    return deepspeed_release(WRAPPERS, CUMULATIVE, BF16_GRADS_HELD)


def test_the_wrapper_is_the_installed_deepspeeds_decision(release):
    for (stage, precision, acc), want in WRAPPERS[release].items():
        try:
            got = optimizer_wrapper(stage, precision, acc)
        except WrapperRefused:
            got = REFUSED
        assert got == want, (stage, precision, acc)


def test_bf16_zero0_accumulation_follows_the_installed_deepspeed(release):
    """A bf16 ZeRO-0 JSON: the accumulation this DeepSpeed refuses is one ConfigError naming the key; where it needs
    fp32 accumulation (the fork), the JSON gets it with a notice."""
    fp32_path = WRAPPERS[release][(0, "bf16", "fp32")] != REFUSED
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}
    settle_grad_accum_dtype(cfg)
    assert cfg.get("data_types", {}).get("grad_accum_dtype") == ("fp32" if fp32_path else None)
    refused = "bf16" if fp32_path else "fp32"
    with pytest.raises(ConfigError, match=f'data_types.grad_accum_dtype = "{refused}".*refuses it'):
        settle_grad_accum_dtype({**cfg, "data_types": {"grad_accum_dtype": refused}})


def test_the_comms_timer_is_read_as_this_deepspeed_keeps_it(release):
    assert comms_timer_cumulative() is CUMULATIVE[release]


def test_bf16_gradients_between_steps_as_this_deepspeed_keeps_them(release):
    from ds_core.compat.deepspeed_behaviour import bf16_grads_held
    from ds_tools.zero_memory_model import ModelShape, Tower, estimate

    assert bf16_grads_held() is BF16_GRADS_HELD[release]
    shape = ModelShape(name="t", params=10**8, largest_layer_params=10**6, vocab=0, head_seq=0, exact=True,
                       towers=[Tower(name="t", layers=2, hidden=64, heads=2, intermediate=256, seq=16)])
    e = estimate(shape, 1, 1, 2, 1, grad_accum_dtype="fp32")
    held = [k for k in e.parts if k.startswith("states: bf16 gradients")]
    assert e.optimizer == "BF16_Optimizer" and bool(held) is BF16_GRADS_HELD[release], e.parts


def test_zero_gradient_buckets_hold_every_gradient(release):
    """ZeRO-1/2's buffered reduction groups the gradients by dtype (ds_core.compat.zero_buckets): every tensor in
    one bucket, in DeepSpeed 0.19's order; 0.19's own grouping is the same, Habana's fork's drops CPU tensors (the
    fault the change is for: no gradient all-reduced)."""
    import torch

    from ds_core.compat.deepspeed_behaviour import zero_buckets_drop_cpu
    from ds_core.compat.zero_buckets import split_by_dtype

    ts = [torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16), torch.zeros(4), torch.zeros(1, dtype=torch.half)]
    ours = [[id(t) for t in b] for b in split_by_dtype(ts)]
    assert ours == [[id(ts[3])], [id(ts[0]), id(ts[2])], [id(ts[1])]]
    assert zero_buckets_drop_cpu() is (release == (0, 16))
    if release == (0, 19):
        from deepspeed.runtime.zero import stage_1_and_2

        from ds_core.compat.changes import original

        fn = original(stage_1_and_2.split_half_float_double)
        assert [[id(t) for t in b] for b in fn(ts)] == ours
