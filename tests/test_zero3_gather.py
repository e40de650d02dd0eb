"""ZeRO-3's coalesced parameter all-gather on the CPU accelerator (ds_core.compat.zero3_gather): where the installed
DeepSpeed waits for the last parameter's collective only (Habana's fork), each parameter is gathered by a call of
its own; 0.19 waits for every one and keeps its own function. The 2-rank ZeRO-3 runs that read gathered weights
(tests/test_bert_optim_zero.py, tests/test_ds_core_train.py) run through it on the fork."""
from __future__ import annotations

import pytest

from conftest import deepspeed_release

pytestmark = pytest.mark.stack

# DeepSpeed release (stacks/) -> whether its Init._allgather_params_coalesced waits for the last handle only
LAST_ONLY = {(0, 19): False, (0, 16): True}


def release() -> tuple[int, int]:
    return deepspeed_release(LAST_ONLY)


def test_the_wait_is_read_from_the_installed_deepspeed():
    from ds_core.compat.changes import states
    from ds_core.compat.deepspeed_behaviour import zero3_gather_waits_last_only

    assert zero3_gather_waits_last_only() is LAST_ONLY[release()]
    state = states()["zero3_gather_waits"]
    assert state == "on" if LAST_ONLY[release()] else state.startswith("not needed"), state


def test_each_parameter_is_gathered_by_a_call_of_its_own():
    from ds_core.compat.zero3_gather import gather_per_param

    calls = []
    ours = gather_per_param(lambda self, params, hierarchy, quantize: calls.append((self, params, hierarchy, quantize)))
    assert ours("init", ["a", "b", "c"], 0, False) is None  # as DeepSpeed's: a blocking call that returns None
    assert calls == [("init", ["a"], 0, False), ("init", ["b"], 0, False), ("init", ["c"], 0, False)]


def test_installed_on_the_cpu_accelerator_only_and_once(monkeypatch):
    from deepspeed.runtime.zero.partition_parameters import Init

    from ds_core.compat.changes import State, apply_change, original

    def use(device_type: str, say=None) -> bool:
        return apply_change("zero3_gather_waits", device_type=device_type, say=say).state is State.APPLIED

    own = original(Init._allgather_params_coalesced)
    monkeypatch.setattr(Init, "_allgather_params_coalesced", own)
    said: list[str] = []
    assert not use("hpu", said.append) and Init._allgather_params_coalesced is own  # stream order
    installed = use("cpu", said.append)
    assert installed is LAST_ONLY[release()] and said == []
    if installed:
        assert Init._allgather_params_coalesced.__wrapped__ is own
        assert use("cpu") and Init._allgather_params_coalesced.__wrapped__ is own  # not wrapped twice
    else:
        assert Init._allgather_params_coalesced is own
