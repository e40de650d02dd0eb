"""ds_core.rank.engine helpers that need no process group."""
import os
import time

from ds_core.rank.engine import cpu_shm_buffer_name, stale_build_locks


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
