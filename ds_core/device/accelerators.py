"""The one accelerator table: dense peak TFLOPs (MFU in ds_core.outputs.metrics), memory (ds_tools.tuning),
interconnect.

Every figure is the vendor's published number for the dense case (NVIDIA's datasheets print Tensor Core rates "with
sparsity": the dense rate is half of that). A figure the vendor does not publish is None, never a borrowed one: MFU
is then null with a note (set DS_CORE_PEAK_TFLOPS), as for any accelerator missing here.

Sources (each row's comment names the one it uses):
  [A100]   NVIDIA A100 Tensor Core GPU datasheet (PCIe/SXM4, 40GB/80GB): BF16 Tensor Core 312 | 624* TFLOPS,
           FP32 19.5 TFLOPS, NVLink 600 GB/s, PCIe Gen4 64 GB/s.
  [H100]   NVIDIA H100 Tensor Core GPU datasheet: SXM BF16 1,979* / FP32 67 / 80 GB HBM3 / NVLink 900 GB/s;
           PCIe BF16 1,513* / FP32 51 / 80 GB HBM2e / NVLink bridge 600 GB/s, PCIe Gen5 128 GB/s
           (* with sparsity). The H100 architecture whitepaper prints the dense SXM5 figure, 989.4, and 756 for PCIe.
  [H200]   NVIDIA H200 Tensor Core GPU datasheet: SXM BF16 1,979* TFLOPS, FP32 67 TFLOPS, 141 GB HBM3e,
           NVLink 900 GB/s (the same GH100 compute as H100 SXM, more memory).
  [Gaudi]  Intel, "Intel Gaudi 3 AI Accelerator: Architected for Gen AI Training and Inference" (Hot Chips 2024,
           product-generation table): peak BF16 compute 60 / 432 / 1835 TFLOPs, HBM 32 / 96 / 128 GB, embedded NIC
           2 / 4.8 / 9.6 Tb/s bidirectional for Gaudi / Gaudi 2 / Gaudi 3; Gaudi 3 spec table: BF16 matrix 1835
           TFLOPs, 24 x 200 GbE RoCE. Habana publishes no FP32 matrix rate for any generation here.

Aliases include the systems ds_tools.fabrics models (dl1: AWS DL1 = 8 first-generation Gaudi; gaudi2-hls; dgx-a100,
the 40 GB part as the bare "a100", so no tool assumes memory the device may not have; dgx-h100), so that ds-tune and
`ds-scaling-report predict` take one set of names.

Memory (`memory_gib`, what ds-tune weighs a configuration against) is the capacity in GiB (2^30 bytes): HBM stacks are
sized in binary units, and the vendors' "GB" on these parts means GiB or a little less, never 10^9 bytes:
  [Gaudi]  "32 GB HBM2" (HL-205: 4 stacks of 8 GiB), "96 GB HBM2e" (HL-225: 6 x 16 GiB), "128 GB HBM2e" (Gaudi 3:
           8 x 16 GiB); hl-smi reports 32768 MiB on an HL-205 and 98304 MiB on an HL-225.
  [NVIDIA] the datasheets' 40 GB / 80 GB (A100), 80 GB (H100) and 141 GB (H200); the capacity the driver reports
           (NVML, nvidia-smi): A100 40960 / 81920 MiB (40 / 80 GiB), H100 81559 MiB (79.65 GiB), H200 143771 MiB
           (140.40 GiB) (Modal, "Why does an NVIDIA H100 80GB card offer 85.52 GB?",
           thundergolfer.com/blog/nvidia-gpu-memory-capacity). The H100 and H200 figures are those the device has,
           below the datasheet number read as GiB: so NVIDIA's "141 GB" is taken as 140.40 GiB (150.75 x 10^9 bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

from ds_core.errors import ConfigError


@dataclass(frozen=True)
class Accelerator:
    name: str
    aliases: tuple[str, ...]
    bf16_tflops: float | None    # dense bf16 matrix peak per device
    fp32_tflops: float | None    # fp32 without TF32 (torch's default for matmuls); None where not published
    memory_gib: float            # capacity, GiB (2^30 bytes): see the module's note on memory
    interconnect: str

    def peak_tflops(self, dtype: str) -> float | None:
        return {"bf16": self.bf16_tflops, "fp32": self.fp32_tflops}.get(dtype)


ACCELERATORS: tuple[Accelerator, ...] = (
    # [A100]: one compute figure for both memory sizes and both form factors. "a100" means the 40 GB part, so a tuner
    # given the bare name never assumes memory the device may not have.
    Accelerator("a100-40g", ("a100", "dgx-a100"), 312.0, 19.5, 40.0,
                "SXM4: NVLink 600 GB/s; PCIe: Gen4 64 GB/s (NVLink bridge 600 GB/s)"),
    Accelerator("a100-80g", (), 312.0, 19.5, 80.0, "SXM4: NVLink 600 GB/s; PCIe: Gen4 64 GB/s"),
    # [H100] dense = datasheet's sparse figure / 2 (whitepaper: 989.4 SXM5, 756 PCIe). Memory: the 81559 MiB NVML
    # reports on the SXM part; the PCIe part (the same 80 GB datasheet figure) is given the same, not checked on one.
    Accelerator("h100-sxm", ("h100", "dgx-h100"), 989.4, 67.0, 79.65, "NVLink 900 GB/s (NVSwitch); PCIe Gen5 128 GB/s"),
    Accelerator("h100-pcie", (), 756.0, 51.0, 79.65, "PCIe Gen5 128 GB/s; NVLink bridge 600 GB/s"),
    # [H200] SXM: same compute as H100 SXM
    Accelerator("h200", ("h200-sxm",), 989.4, 67.0, 140.40, "NVLink 900 GB/s (NVSwitch); PCIe Gen5 128 GB/s"),
    # [Gaudi] HL-205 (AWS DL1): 10 x 100 GbE RoCE v2 on chip
    Accelerator("gaudi", ("gaudi1", "hl-205", "dl1"), 60.0, None, 32.0,
                "10 x 100 GbE RoCE v2 on chip (HLS-1: 7 all-to-all inside the box, 3 out)"),
    # [Gaudi] HL-225: 24 x 100 GbE RoCE v2 on chip
    Accelerator("gaudi2", ("hl-225", "gaudi2-hls"), 432.0, None, 96.0,
                "24 x 100 GbE RoCE v2 on chip (HLS-Gaudi2: 21 all-to-all inside the box, 3 out)"),
    # [Gaudi] HL-325L (OAM): 24 x 200 GbE RoCE v2 on chip
    Accelerator("gaudi3", ("hl-325l",), 1835.0, None, 128.0,
                "24 x 200 GbE RoCE v2 on chip (HLS-Gaudi3: 21 all-to-all inside the box, 3 out)"),
)

_BY_NAME = {n: a for a in ACCELERATORS for n in (a.name, *a.aliases)}


class UnknownAcceleratorError(ConfigError):
    """An accelerator name that is neither a name nor an alias in ACCELERATORS."""


def get(name: str) -> Accelerator:
    """The row for a name or alias (case-insensitive)."""
    try:
        return _BY_NAME[name.strip().lower()]
    except KeyError:
        listed = ", ".join(f"{a.name}" + (f" ({', '.join(a.aliases)})" if a.aliases else "") for a in ACCELERATORS)
        raise UnknownAcceleratorError(f"accelerator {name!r}: not in ds_core.device.accelerators; known (aliases): "
                                      f"{listed}") from None


def from_device_name(device_name: str) -> str | None:
    """Table name for what torch.cuda.get_device_name / habana's get_device_name report, or None when the device
    is not one of the rows (e.g. 'NVIDIA H100 NVL', whose peaks differ from both H100 rows): no figure is guessed."""
    n = device_name.lower()
    if "gaudi" in n:
        return "gaudi3" if "gaudi3" in n else "gaudi2" if "gaudi2" in n else "gaudi"
    if "nvl" in n:
        return None
    if "h200" in n:
        return "h200"
    if "h100" in n:
        # "NVIDIA H100 80GB HBM3" (SXM) / "NVIDIA H100 PCIe"
        return "h100-pcie" if "pcie" in n else "h100-sxm" if ("hbm3" in n or "sxm" in n) else None
    if "a100" in n:
        # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"
        return "a100-80g" if "80gb" in n else "a100-40g"
    return None
