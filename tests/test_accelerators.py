"""ds_core.device.accelerators is the one table: metrics (MFU peak) and tuning (memory) both read it, old names stay
accepted as aliases, device names map to the right row (never SXM figures for a PCIe or NVL part), and an unknown
name fails listing the known ones."""
import pytest

from ds_core.device import accelerators
from ds_core.outputs.metrics import peak_tflops_for
from ds_tools import tuning


def test_names_and_aliases_resolve_case_insensitively():
    names = [a.name for a in accelerators.ACCELERATORS]
    for required in ("a100-40g", "a100-80g", "h100-sxm", "h100-pcie", "h200", "gaudi", "gaudi2", "gaudi3"):
        assert required in names
    spellings = [n for a in accelerators.ACCELERATORS for n in (a.name, *a.aliases)]
    assert len(spellings) == len(set(spellings)), "an alias names two rows"
    assert accelerators.get("H100") is accelerators.get("h100-sxm")
    assert accelerators.get("a100") is accelerators.get("a100-40g")
    for row in accelerators.ACCELERATORS:
        assert row.memory_gib > 0 and row.interconnect
        assert row.bf16_tflops is None or row.fp32_tflops is None or row.bf16_tflops > row.fp32_tflops


def test_unknown_accelerator_lists_the_known_ones():
    with pytest.raises(accelerators.UnknownAcceleratorError,
                       match=r"'tpu-v5'.*h100-sxm \(h100, dgx-h100\).*gaudi \(gaudi1, hl-205, dl1\).*gaudi2"):
        accelerators.get("tpu-v5")
    with pytest.raises(ValueError):       # a ConfigError: callers that catch ValueError still do
        accelerators.get("")


@pytest.mark.parametrize("device_name,row", [
    ("NVIDIA A100-SXM4-40GB", "a100-40g"), ("NVIDIA A100-PCIE-40GB", "a100-40g"),
    ("NVIDIA A100-SXM4-80GB", "a100-80g"), ("NVIDIA A100 80GB PCIe", "a100-80g"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", None),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", None), ("NVIDIA GeForce RTX 4090", None),
    ("GAUDI", "gaudi"), ("GAUDI2", "gaudi2"), ("GAUDI3", "gaudi3")])
def test_device_names_map_to_their_row_or_to_none(device_name, row):
    assert accelerators.from_device_name(device_name) == row


def test_metrics_and_tuning_read_the_same_rows(monkeypatch):
    monkeypatch.delenv("DS_CORE_PEAK_TFLOPS", raising=False)
    for row in accelerators.ACCELERATORS:
        for name in (row.name, *row.aliases):
            assert peak_tflops_for(name, "bf16") == row.bf16_tflops
            assert peak_tflops_for(name, "fp32") == row.fp32_tflops
            assert tuning.capacity_bytes(name, 8) == row.memory_gib * 2 ** 30
    # the PCIe part is not billed at the SXM peak, and no figure is invented where the vendor publishes none
    assert peak_tflops_for("h100-pcie") < peak_tflops_for("h100")
    assert peak_tflops_for("gaudi2", "fp32") is None and peak_tflops_for("cuda") is None
    monkeypatch.setenv("DS_CORE_PEAK_TFLOPS", "123")
    assert peak_tflops_for("gaudi2") == 123.0


def test_ds_tune_accepts_every_spelling_and_names_the_table_on_a_typo(tmp_path, capsys):
    base = ["--model", "bert-large", "--accelerators-per-node", "8", "--global-batch", "512", "--json",
            "--out", str(tmp_path / "ds.json")]
    for name in ("a100", "a100-80g", "h100", "h200", "gaudi3"):
        assert tuning.main([*base, "--accelerator", name]) == 0
        capsys.readouterr()
    assert tuning.main([*base, "--accelerator", "a100-81g"]) == 2
    err = capsys.readouterr().err
    assert "a100-81g" in err and "a100-80g" in err and "cpu" in err
