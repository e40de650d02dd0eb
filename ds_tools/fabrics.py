"""Fabric profiles and alpha-beta costs of the collectives DeepSpeed issues, for `ds-scaling-report predict`.

Bandwidth is NCCL's *bus bandwidth* (nccl-tests doc/PERFORMANCE.md): for n ranks, a collective of S bytes moves
    all-reduce                    2 (n-1)/n * S   through each rank's link,
    all-gather / reduce-scatter     (n-1)/n * S   (S = the full, gathered buffer),
so time = bytes-moved / bus bandwidth. Across N nodes of a accelerators we use the hierarchical ring (intra-node ring
over the accelerator links, then a ring between nodes in which the a accelerators of a node drive the node's NICs in
parallel, each carrying 1/a of the buffer):

    all-reduce(S)      = 2 (a-1)/a * S / B_intra  +  2 (N-1)/N * S / B_inter        + latency
    all-gather(S), reduce-scatter(S) = half the two bandwidth terms                  + latency
    latency            = steps * alpha: ring steps (a-1) intra, and between nodes min(N-1, ceil(log2 N)) for an
                         all-reduce (NCCL's tree for latency-bound sizes), N-1 for gather/scatter (ring only)
                         + call_us per call: the communication library's own cost of one collective (its software
                         path, scheduling); 0 for the published fabrics (their factor absorbs it), MEASURED for an
                         emulated one (ds_tools.study.linkprobe), never fitted to the run it predicts

B_intra is one accelerator's link bandwidth to its node peers, B_inter one node's aggregate scale-out bandwidth: each
its line rate times a factor of its own (`intra_efficiency`, `inter_efficiency`; both `efficiency` where not set).
The fabrics here carry line rates only (factor 1.0): what a published table identifies of the two factors is fitted
by ds_tools.calibration, which says which terms it fitted and on what; a fabric given on the command line keeps the
factor it is given (uncalibrated: no range, said so in the output).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Fabric:
    name: str
    intra_gbps: float          # per accelerator, one direction, line rate (Gbit/s)
    inter_gbps: float          # per node, aggregate scale-out, one direction, line rate (Gbit/s)
    latency_us: float          # per inter-node ring step
    intra_latency_us: float    # per intra-node ring step
    efficiency: float          # achieved bus bandwidth / line rate, both terms unless set apart below
    calibrated_on: str         # where the factors come from ("" = not calibrated)
    source: str                # where the line rates come from
    call_us: float = 0.0       # per collective call, besides the ring steps' latency (measured; 0 = not modelled)
    accelerators: tuple[str, ...] = ()  # ds_core.device.accelerators rows this system is built from
    intra_efficiency: float | None = None   # the intra-node term's own factor (None: `efficiency`)
    inter_efficiency: float | None = None   # the inter-node term's own factor (None: `efficiency`)

    @property
    def eta_intra(self) -> float:
        return self.efficiency if self.intra_efficiency is None else self.intra_efficiency

    @property
    def eta_inter(self) -> float:
        return self.efficiency if self.inter_efficiency is None else self.inter_efficiency

    @property
    def b_intra(self) -> float:
        """Effective intra-node bus bandwidth, bytes/s."""
        return self.intra_gbps * 1e9 / 8 * self.eta_intra

    @property
    def b_inter(self) -> float:
        return self.inter_gbps * 1e9 / 8 * self.eta_inter

    def with_factors(self, intra: float, inter: float, calibrated_on: str) -> "Fabric":
        return Fabric(**{**self.__dict__, "intra_efficiency": intra, "inter_efficiency": inter,
                         "calibrated_on": calibrated_on})


# Line rates with their sources (factor 1.0: line rate). What the published tables (ds_tools.published) identify of
# each system's two factors is fitted by ds_tools.calibration, never written here.
FABRICS = {
    "dl1": Fabric("dl1", 700, 400, 20.0, 5.0, 1.0, "",
                  "AWS dl1.24xlarge: 8 Gaudi (HL-205), each with 7 of its 10x100 GbE RoCE ports to its 7 peers "
                  "(all-to-all), 4x100 Gb/s EFA per instance (aws.amazon.com/ec2/instance-types/dl1)",
                  accelerators=("gaudi",)),
    "gaudi2-hls": Fabric("gaudi2-hls", 2100, 2400, 10.0, 3.0, 1.0, "",
                         "Intel Gaudi2 HLS-Gaudi2: 24x100 GbE RoCE per card, 21 to its 7 peers (3 each), 3 for "
                         "scale-out (8 cards: 24x100 Gb/s per node) (Gaudi2 white paper / HLS-Gaudi2 spec)",
                         accelerators=("gaudi2",)),
    "dgx-a100": Fabric("dgx-a100", 2400, 1600, 5.0, 2.0, 1.0, "",
                       "DGX A100: NVLink3 600 GB/s per GPU both directions (300 GB/s = 2400 Gb/s one way), "
                       "8x 200 Gb/s HDR InfiniBand compute NICs (DGX A100 user guide)",
                       accelerators=("a100-40g", "a100-80g")),
    "dgx-h100": Fabric("dgx-h100", 3600, 3200, 5.0, 2.0, 1.0, "",
                       "DGX H100: NVLink4 900 GB/s per GPU both directions (450 GB/s = 3600 Gb/s one way), "
                       "8x 400 Gb/s NDR InfiniBand (ConnectX-7) (DGX H100 user guide)",
                       accelerators=("h100-sxm",)),
}


def lookup(name: str) -> Fabric:
    """A fabric by its name, or by the name (or an alias) of an accelerator in ds_core.device.accelerators that one
    fabric is built from: `dl1` and `gaudi` are the same system, as ds-tune's --accelerator takes them."""
    from ds_core.device import accelerators

    if name in FABRICS:
        return FABRICS[name]
    try:
        row = accelerators.get(name).name
    except accelerators.UnknownAcceleratorError:
        row = None
    found = [f for f in FABRICS.values() if row in f.accelerators]
    if len(found) == 1:
        return found[0]
    known = ", ".join(f"{f.name} ({', '.join(f.accelerators)})" for f in FABRICS.values())
    raise ValueError(f"--fabric {name!r}: " + (f"no modelled system is built from {row}" if row else "unknown")
                     + f"; known (with their accelerators): {known}; or give --intra_gbps and --inter_gbps")


def custom(intra_gbps: float, inter_gbps: float, latency_us: float, efficiency: float = 1.0,
           call_us: float = 0.0) -> Fabric:
    for name, v in (("--intra_gbps", intra_gbps), ("--inter_gbps", inter_gbps)):
        if not v > 0:
            raise ValueError(f"{name} {v}: expected a positive bandwidth in Gbit/s")
    if latency_us < 0:
        raise ValueError(f"--latency_us {latency_us}: expected >= 0")
    if call_us < 0:
        raise ValueError(f"--call_us {call_us}: expected >= 0")
    return Fabric("custom", intra_gbps, inter_gbps, latency_us, min(latency_us, 2.0), efficiency, "",
                  "given on the command line", call_us)


def all_reduce_s(fab: Fabric, nbytes: float, per_node: int, nodes: int, calls: int = 1) -> float:
    """Seconds for an all-reduce of nbytes in `calls` buckets (hierarchical ring, NCCL bus-bandwidth terms)."""
    a, n = per_node, nodes
    if a * n <= 1 or nbytes < 0:
        return 0.0
    t = 2 * (a - 1) / a * nbytes / fab.b_intra + 2 * (n - 1) / n * nbytes / fab.b_inter
    steps_inter = min(n - 1, math.ceil(math.log2(n))) if n > 1 else 0
    lat = 2 * (a - 1) * fab.intra_latency_us + 2 * steps_inter * fab.latency_us
    return t + calls * (lat + fab.call_us) * 1e-6


def gather_s(fab: Fabric, nbytes: float, per_node: int, nodes: int, calls: int = 1) -> float:
    """Seconds for an all-gather or a reduce-scatter whose full (gathered) buffer is nbytes."""
    a, n = per_node, nodes
    if a * n <= 1 or nbytes < 0:
        return 0.0
    t = (a - 1) / a * nbytes / fab.b_intra + (n - 1) / n * nbytes / fab.b_inter
    lat = (a - 1) * fab.intra_latency_us + (n - 1) * fab.latency_us
    return t + calls * (lat + fab.call_us) * 1e-6
