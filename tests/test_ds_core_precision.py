"""ds_core.device.precision: the auto rule, the DeepSpeed JSON switch, and the per-machine peak cache."""
import json

import pytest

from ds_core.config import TrainConfig, ds_config_for
from ds_core.device import precision as prec
from ds_core.errors import ConfigError


@pytest.fixture(autouse=True)
def no_isa_cap(monkeypatch):
    """These tests state the rule for a CPU's flags; a oneDNN ISA cap in the environment (a CI run measured without
    native bf16) would be another input, set only where a test says so."""
    for name in prec.ISA_CAP_ENVS:
        monkeypatch.delenv(name, raising=False)


def test_auto_is_bf16_on_accelerators_and_native_bf16_cpus():
    assert prec.resolve_precision("auto", "cuda")[0] == "bf16"
    assert prec.resolve_precision("auto", "hpu")[0] == "bf16"
    for flag in ("amx_bf16", "avx512_bf16"):
        dtype, reason = prec.resolve_precision("auto", "cpu", flags={"avx2", flag})
        assert dtype == "bf16" and flag in reason


def test_auto_is_fp32_on_a_cpu_without_native_bf16_and_says_why():
    dtype, reason = prec.resolve_precision("auto", "cpu", flags={"avx2", "fma"}, speed=lambda: (0.0008, 0.054))
    assert dtype == "fp32"
    assert "no native bf16" in reason and "0.0008" in reason and "0.0540" in reason and "68x slower" in reason


def test_auto_is_fp32_where_onednn_is_capped_below_its_bf16_instructions(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 on a CPU with AMX: oneDNN emulates bf16 as an AVX2-only CPU does, so auto is fp32."""
    amx = {"avx2", "avx512_bf16", "amx_bf16"}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    dtype, reason = prec.resolve_precision("auto", "cpu", flags=amx, speed=lambda: (0.0008, 0.054))
    assert dtype == "fp32" and "oneDNN is capped at AVX2" in reason and "68x slower" in reason
    for cap in ("AVX512_CORE_BF16", "avx512_core_amx", "ALL"):  # caps at or above bf16 leave the CPU's own rule
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert prec.resolve_precision("auto", "cpu", flags=amx)[0] == "bf16"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "avx512_core_vnni")  # oneDNN's older name for the same cap
    assert prec.resolve_precision("auto", "cpu", flags=amx, speed=lambda: (1.0, 1.0))[0] == "fp32"
    monkeypatch.delenv("DNNL_MAX_CPU_ISA")
    assert prec.resolve_precision("auto", "cpu", flags=amx)[0] == "bf16"


def test_explicit_precision_wins_and_unknown_is_refused():
    assert prec.resolve_precision("bf16", "cpu", flags=set())[0] == "bf16"
    assert prec.resolve_precision("fp32", "cuda")[0] == "fp32"
    with pytest.raises(ValueError, match="expected one of auto, bf16, fp32"):
        prec.resolve_precision("fp8", "cpu")
    with pytest.raises(ConfigError, match="TrainConfig.precision"):
        TrainConfig(precision="half").validate()


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\n")
    assert prec.cpu_flags(f) == {"fpu", "avx2", "amx_bf16"} and prec.cpu_model(f) == "Test CPU"
    assert prec.cpu_flags(tmp_path / "missing") == set()


@pytest.mark.parametrize("precision,enabled", [("fp32", False), ("bf16", True)])
def test_ds_config_bf16_section_follows_precision(precision, enabled):
    cfg = TrainConfig(deepspeed_config="zero1_bf16.json", precision=precision)
    ds = ds_config_for(cfg, world_size=2, accelerator="cpu")
    assert ds["bf16"]["enabled"] is enabled


def test_auto_on_this_kind_of_cpu_switches_the_json(monkeypatch, capsys):
    monkeypatch.setattr(prec, "cpu_flags", lambda *a: {"avx2"})
    monkeypatch.setattr(prec, "_measured_speed", lambda: (0.001, 0.05))
    monkeypatch.setenv("RANK", "0")
    ds = ds_config_for(TrainConfig(deepspeed_config="zero1_bf16.json"), world_size=1, accelerator="cpu")
    assert ds["bf16"]["enabled"] is False
    assert "precision auto: fp32" in capsys.readouterr().out
    monkeypatch.setattr(prec, "cpu_flags", lambda *a: {"avx512_bf16"})
    assert ds_config_for(TrainConfig(deepspeed_config="zero1_bf16.json"), 1, accelerator="cpu")["bf16"]["enabled"]


def test_fp32_drops_a_bf16_accumulation_dtype_and_fp16_conflicts():
    ds = prec.apply_precision({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}, "fp32")
    assert ds["bf16"]["enabled"] is False and ds["data_types"]["grad_accum_dtype"] == "fp32"
    with pytest.raises(ValueError, match="fp16.enabled is true"):
        prec.apply_precision({"fp16": {"enabled": True}}, "bf16", "x.json")


def test_peak_is_probed_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(prec.CACHE_ENV, str(tmp_path))
    calls = []

    def probe():
        calls.append(1)
        return 1.5

    assert prec.cached_cpu_peak("fp32", probe) == 1.5
    assert prec.cached_cpu_peak("fp32", probe) == 1.5
    assert len(calls) == 1
    data = json.loads((tmp_path / "peak_tflops.json").read_text())
    (key,) = data
    assert "|fp32|threads " in key and "torch " in key  # keyed by CPU model, torch version, dtype, threads
    # a run under oneDNN's ISA cap probes other kernels: its peak is kept apart, never read by uncapped runs
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert prec.peak_cache_key("fp32") == key + "|isa avx2"
    assert prec.cached_cpu_peak("fp32", lambda: 0.5) == 0.5
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert prec.cached_cpu_peak("fp32", probe) == 1.5 and len(calls) == 1
    assert prec.cached_cpu_peak("bf16", lambda: 0.25) == 0.25  # another dtype is another entry
    prec.update_cpu_peak("fp32", 1.0)  # a lower re-probe does not replace the cached best
    assert prec.cached_cpu_peak("fp32", probe) == 1.5
    prec.update_cpu_peak("fp32", 2.0)
    assert prec.cached_cpu_peak("fp32", probe) == 2.0 and len(calls) == 1


def test_corrupt_cache_is_ignored_and_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv(prec.CACHE_ENV, str(tmp_path))
    (tmp_path / "peak_tflops.json").write_text('{"half a file')
    assert prec.cached_cpu_peak("fp32", lambda: 3.0) == 3.0
    assert list(json.loads((tmp_path / "peak_tflops.json").read_text()).values()) == [3.0]
    assert not list(tmp_path.glob(".*tmp*"))  # written through a temporary name, nothing left behind


def test_probe_measures_each_dtype():
    assert prec.cpu_peak_tflops("fp32", n=128, seconds=0.01) > 0
    assert prec.cpu_peak_tflops("bf16", n=64, seconds=0.01) > 0
