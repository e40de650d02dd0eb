"""ds_core.device.cpu_info: py-cpuinfo asked once per machine, and what DeepSpeed's op builder then reads."""
from __future__ import annotations

import json

import pytest

from ds_core.device import cpu_info, precision as prec

ANSWER = {"arch": "X86_64", "flags": ["avx2", "fma"], "vendor_id_raw": "AuthenticAMD", "hz_actual": [2, 0]}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(prec.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cpu_info, "cpu_flags", lambda: {"avx2", "fma"})
    return tmp_path


def test_asked_once_per_machine_then_read_from_the_cache(cache):
    calls = []

    def ask():
        calls.append(1)
        return dict(ANSWER)

    first = cpu_info.cached(ask, "9.0.0")
    assert first() == ANSWER and first() == ANSWER and len(calls) == 1  # once per process
    second = cpu_info.cached(ask, "9.0.0")  # the next process on the machine
    assert second() == ANSWER and len(calls) == 1
    assert cpu_info.cached(ask, "9.0.1")() == ANSWER and len(calls) == 2  # another py-cpuinfo asks again
    assert len(json.loads((cache / "cpu_info.json").read_text())) == 2
    answer = second()
    answer["flags"].append("x")  # a caller that edits its answer does not edit the next caller's
    assert second()["flags"] == ["avx2", "fma"]


def test_an_entry_without_arch_and_flags_is_asked_again(cache):
    key = cpu_info.cpu_info_key("9.0.0")
    (cache / "cpu_info.json").write_text(json.dumps({key: {"arch": "X86_64"}}))
    assert cpu_info.cached(lambda: dict(ANSWER), "9.0.0")() == ANSWER
    assert json.loads((cache / "cpu_info.json").read_text())[key] == ANSWER


def test_no_cache_where_the_kernel_describes_no_cpu(cache, monkeypatch):
    monkeypatch.setattr(cpu_info, "cpu_flags", lambda: set())
    calls = []
    get = cpu_info.cached(lambda: calls.append(1) or dict(ANSWER), "9.0.0")
    assert get() == ANSWER and get() == ANSWER and len(calls) == 1
    assert not (cache / "cpu_info.json").exists()


def test_deepspeeds_op_builder_reads_the_cached_answer(cache, monkeypatch):
    cpuinfo = pytest.importorskip("cpuinfo")
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder  # the op every CPU rank loads

    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or dict(ANSWER))
    from ds_core.compat.changes import State, applied, apply_change

    assert apply_change("cached_cpu_info", device_type="cpu").state is State.APPLIED
    assert apply_change("cached_cpu_info", device_type="cpu").state is State.APPLIED  # applying twice wraps once
    assert applied(cpuinfo.get_cpu_info) == "cached_cpu_info" and applied(cpuinfo.get_cpu_info.__wrapped__) is None
    builder = ShareMemCommBuilder()  # the CPU accelerator's builder, whichever accelerator this machine has
    assert builder.simd_width() == "-D__AVX256__" and builder.cpu_arch() == "-march=native"
    assert len(calls) == 1
