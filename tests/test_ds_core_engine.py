"""ds_core.rank.engine_build and ds_core.rank.shm helpers that need no process group."""
import os
import time

import pytest
import torch

from ds_core.checkpoint import describe_mismatch
from ds_core.rank.engine_build import flat_layout, odd_sizes_last
from ds_core.rank.shm import cpu_shm_buffer_name, stale_build_locks


def test_stale_build_locks_finds_old_locks_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old = tmp_path / "py311_cpu" / "fused_adam" / "lock"
    fresh = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    flat = tmp_path / "cpu_adam" / "lock"
    for p in (old, fresh, flat):
        p.parent.mkdir(parents=True)
        p.touch()
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    os.utime(flat, (hour_ago, hour_ago))
    found = dict(stale_build_locks(max_age_s=600))
    assert set(found) == {old, flat}
    assert all(3500 < age < 3700 for age in found.values())
    assert stale_build_locks(max_age_s=7200) == []


def test_cpu_shm_buffer_name_follows_deepspeed_layout(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert cpu_shm_buffer_name(3) == f"deepspeed_allreduce_buffer_{os.getuid()}_10.0.0.1_29500_3"


def _model_with_odd_sizes() -> torch.nn.Module:
    m = torch.nn.Module()
    m.scale = torch.nn.Parameter(torch.ones(1))  # first in model order, as BridgeTower's logit_scale
    m.a = torch.nn.Linear(16, 8)
    m.head = torch.nn.Linear(8, 3)  # weight 24 elements (aligned), bias 3 (not)
    return m


def test_odd_sizes_last_keeps_every_aligned_size_on_an_aligned_offset():
    m = _model_with_odd_sizes()
    groups = [{"params": [m.scale, m.a.weight, m.head.weight], "weight_decay": 0.1},
              {"params": [m.a.bias, m.head.bias], "weight_decay": 0.0}]
    out, moved = odd_sizes_last(m, groups)
    assert [g["weight_decay"] for g in out] == [0.1, 0.0]  # the groups' settings are kept
    assert out[0]["params"] == [m.a.weight, m.head.weight, m.scale] and out[1]["params"] == [m.a.bias, m.head.bias]
    assert moved == ["scale"]  # head.bias is already last: nothing moves there
    for g in out:  # the offsets DeepSpeed's flat buffer gives each view
        offset = 0
        for p in g["params"]:
            assert p.numel() % 8 or offset % 8 == 0, (p.shape, offset)
            offset += p.numel()
    plain, moved_plain = odd_sizes_last(m, list(m.parameters()))
    assert plain == [m.a.weight, m.a.bias, m.head.weight, m.scale, m.head.bias]
    assert moved_plain == ["scale", "head.bias"] and odd_sizes_last(m, plain)[1] == []


def test_a_checkpoint_in_another_flat_order_is_refused_and_old_ones_in_model_order_load():
    def fp(layout=None):
        d = {"param_shapes": {"w": [8]}, "zero_stage": 1, "optimizer_class": "AdamW"}
        return d if layout is None else dict(d, flat_layout=layout)
    moved = flat_layout(["logit_scale"])
    assert describe_mismatch(fp(), fp(flat_layout([]))) == []  # written before the key existed, nothing moved
    assert describe_mismatch(fp(moved), fp(moved)) == []
    diffs = describe_mismatch(fp(), fp(moved))
    assert len(diffs) == 1 and "flat_layout" in diffs[0] and "logit_scale" in diffs[0]


def test_a_checkpoint_of_another_deepspeed_optimizer_wrapper_is_refused_by_name():
    """BF16_Optimizer (bf16 with fp32 gradient accumulation) and DeepSpeedZeroOptimizer write different state files:
    a resume across them is refused with the reason, not left to DeepSpeed's missing-file error, except on a resize
    (through the universal format, which either loads). Checkpoints written before the key existed are not compared
    on it."""
    base = {"param_shapes": {"w": [8]}, "zero_stage": 1, "optimizer_class": "AdamW"}
    zero, bf16 = dict(base, zero_optimizer="DeepSpeedZeroOptimizer"), dict(base, zero_optimizer="BF16_Optimizer")
    assert describe_mismatch(bf16, bf16) == [] and describe_mismatch(base, bf16) == []
    diffs = describe_mismatch(zero, bf16)
    assert len(diffs) == 1 and "grad_accum_dtype" in diffs[0] and "'DeepSpeedZeroOptimizer'" in diffs[0], diffs
    assert describe_mismatch(zero, bf16, universal=True) == []  # a resize loads DeepSpeed's wrapper-free format


@pytest.mark.stack
def test_a_killed_holders_op_build_lock_stops_no_later_load(tmp_path, monkeypatch):
    """ds_core.compat.op_baton: a process killed while it held the JIT build lock of an op leaves the file; torch's
    own baton waits for it forever, the holder-naming one (installed into torch.utils.cpp_extension by every rank)
    sees the holder is gone, clears the lock and goes on. A live holder's lock is waited for."""
    import signal
    import subprocess
    import sys

    import torch.utils.cpp_extension as cpp
    from torch.utils.file_baton import FileBaton

    from conftest import REPO
    from ds_core.compat.changes import State, applied, apply_change
    from ds_core.compat.op_baton import make_baton_class

    lock = tmp_path / "lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom torch.utils.file_baton import FileBaton\n"
        "from ds_core.compat.op_baton import make_baton_class\n"
        f"assert make_baton_class(FileBaton)({str(lock)!r}).try_acquire()\nprint('held', flush=True)\n"
        "time.sleep(600)\n")], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert lock.read_text().split()[1] == str(holder.pid)  # left behind, naming its dead holder

    class StillWaiting(Exception):
        pass

    def sleeps_to_return(baton, limit: int = 3) -> int | None:
        """How many sleeps baton.wait() took before it returned; None: still waiting after `limit` (its loop only
        sleeps while the lock is there, so a wait that sleeps `limit` times on an unchanged lock waits forever)."""
        slept: list[float] = []

        def sleep(seconds: float) -> None:
            slept.append(seconds)
            if len(slept) >= limit:
                raise StillWaiting

        with monkeypatch.context() as m:
            m.setattr(time, "sleep", sleep)  # the time module both batons sleep through
            try:
                baton.wait()
            except StillWaiting:
                return None
        return len(slept)

    assert sleeps_to_return(FileBaton(str(lock), wait_seconds=0.05)) is None  # torch's own: waits forever
    holder_baton = make_baton_class(FileBaton)
    assert not holder_baton(str(lock)).try_acquire()
    assert sleeps_to_return(holder_baton(str(lock), wait_seconds=0.05)) == 0 and not lock.exists()
    mine = holder_baton(str(lock))  # held by this (live) process: a waiter keeps waiting
    assert mine.try_acquire() and sleeps_to_return(holder_baton(str(lock), wait_seconds=0.05)) is None
    mine.release()
    assert apply_change("op_build_lock_holder").state is State.APPLIED
    assert applied(cpp.FileBaton) == "op_build_lock_holder"  # the name torch's JIT build takes
