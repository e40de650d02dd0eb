"""The fabric a run's ranks will use, as each host reports it and as HCCL will read it (launch.preflight's rows).

Per host (`probe_fabric`, run on that host): the kernel release, libfabric's version (`fi_info --version`) and which
of HCCL's providers (efa, verbs, tcp) find a device there (`fi_info -p NAME`), and the Gaudi cards with the state of
their external NIC ports (`hl-smi -Q bus_id,name`, `hl-smi -n ports` / `hl-smi -n link` per card, as Habana's Intel
Gaudi Health Screen reads them: HabanaAI/Setup_and_Install, utils/intel_gaudi_health_screen/IGNodes.py).

`hccl_scaleout` says which scale-out mode HCCL will pick from those facts and the variables the ranks will see, by
Intel Gaudi docs, HCCL "Scale-out via Host NIC" (https://docs.habana.ai/en/latest/API_Reference_Guides/HCCL_APIs/
Scale_Out_via_Host_NIC.html), "Scale-out Auto-detection":
  P0 Gaudi NICs                     Gaudi scale-out NICs are connected
  P1 host NIC Gaudi Direct (GDR)    the efa provider with libfabric >= 1.16.1, or verbs with libfabric >= 1.20.0
                                    (Gaudi 2 and Gaudi 3 only); Linux kernel >= 5.12. On EFA Habana asks for
                                    RDMAV_FORK_SAFE=1 and FI_EFA_USE_DEVICE_RDMA=1 ("Host NIC Gaudi Direct Setup")
  P2 host NIC through host memory   libfabric with the efa, verbs or tcp provider
  P3 no scale-out
"HCCL auto-detection mechanism is disabled when setting HCCL_OVER_OFI environment variable (force P2)." HCCL's
source (HabanaAI/HCL 1.21.0, hcl/src/interfaces/hcl_idevice.cpp setScaleoutMode) adds: HCCL_OVER_OFI=0 means Gaudi
NICs or no scale-out at all, and HCCL_GAUDI_DIRECT without HCCL_OVER_OFI stops the process. HCCL_OVER_TCP is not read
by that source and not on the page: a setting of older releases.
"""
from __future__ import annotations

import platform
import re
import shutil
import subprocess
from typing import Mapping

from ds_core.device import accelerators

PROVIDERS = ("efa", "verbs", "tcp")  # the libfabric providers HCCL uses (the page's P2 list)
GDR_LIBFABRIC = {"efa": (1, 16, 1), "verbs": (1, 20, 0)}  # P1's libfabric floor per provider
GDR_KERNEL = (5, 12)
P0, P1, P2, P3 = "Gaudi NICs", "host NIC Gaudi Direct", "host NIC through host memory", "no scale-out"
# variables HCCL and libfabric read for the scale-out, reported by every host's probe
FABRIC_VARS = ("HCCL_OVER_OFI", "HCCL_GAUDI_DIRECT", "HCCL_OVER_TCP", "FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA",
               "RDMAV_FORK_SAFE", "MLX5_SCATTER_TO_CQE")
# the mode each Gaudi profile is for (launch/env/*.env)
PROFILE_MODES = {"roce": (P0,), "efa": (P1, P2), "hostnic": (P1, P2)}


def _run(cmd: list[str], timeout: float = 30) -> tuple[int, str] | None:
    """(exit status, stdout + stderr) of a tool, or None where it is not installed."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 1, str(e)
    return p.returncode, p.stdout


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading numbers of a version: "1.18.2amzn1.0" -> (1, 18, 2), "6.8.0-1015-aws" -> (6, 8, 0)."""
    m = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def parse_fi_version(out: str) -> str | None:
    """libfabric's version from `fi_info --version` ("libfabric: 1.18.2amzn1.0")."""
    m = re.search(r"^libfabric:[ \t]*(\S+)", out, re.M)
    return m.group(1) if m else None


def parse_ports(ports_out: str, link_out: str) -> dict[str, str]:
    """{external port: UP / DOWN} of one card from `hl-smi -n ports -i BUS` ("port 8: external") and
    `hl-smi -n link -i BUS` ("port  8:        UP")."""
    external = {m.group(1) for m in re.finditer(r"port\s+(\d+)\s*:\s*external", ports_out)}
    states = {m.group(1): m.group(2).upper() for m in re.finditer(r"port\s+(\d+)\s*:\s*(\w+)", link_out)}
    return {p: states.get(p, "UNKNOWN") for p in sorted(external, key=int)}


def generation_of(card_name: str) -> str | None:
    """HL-205 -> gaudi, HL-225 -> gaudi2, HL-325L -> gaudi3 (ds_core.device.accelerators' aliases)."""
    try:
        return accelerators.get(card_name.strip()).name
    except accelerators.UnknownAcceleratorError:
        return None


def probe_fabric() -> dict:
    """This host's fabric facts (JSON-able): kernel, libfabric version and providers with a device (None without
    fi_info), Gaudi cards with their external ports (None without hl-smi)."""
    out: dict = {"kernel": platform.release(), "libfabric": None, "providers": None, "cards": None}
    ver = _run(["fi_info", "--version"])
    if ver is not None and ver[0] == 0:
        out["libfabric"] = parse_fi_version(ver[1])
        out["providers"] = [p for p in PROVIDERS if (_run(["fi_info", "-p", p]) or (1, ""))[0] == 0]
    listed = _run(["hl-smi", "-Q", "bus_id,name", "-f", "csv,noheader"])
    if listed is not None and listed[0] == 0:
        cards = []
        for line in listed[1].splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) < 2 or not parts[0]:
                continue
            ports, link = (_run(["hl-smi", "-n", what, "-i", parts[0]]) or (1, "") for what in ("ports", "link"))
            cards.append({"bus": parts[0], "name": parts[1], "external": parse_ports(ports[1], link[1])})
        out["cards"] = cards
    return out


# ------------------------------------------------------------------------------------------------ decisions
def gaudi_nics_connected(cards: list[dict] | None) -> bool:
    """Every card has external ports and all of them are UP: HCCL's P0 condition, "Gaudi scale-out NICs are
    connected" (a card with a port down is a broken path for the ranks on it)."""
    return bool(cards) and all(c["external"] and set(c["external"].values()) == {"UP"} for c in cards)


def _providers(fabric: dict, env: Mapping[str, str]) -> list[str]:
    """HCCL's providers that find a device here, narrowed to FI_PROVIDER where it is set (libfabric's own filter)."""
    found = fabric.get("providers") or []
    wanted = env.get("FI_PROVIDER")
    return [p for p in found if not wanted or p in wanted.split(",")]


def gdr_blockers(fabric: dict, env: Mapping[str, str], provider: str) -> list[str]:
    """Why HCCL cannot take host NIC Gaudi Direct (P1) with `provider`: empty where it can."""
    if provider not in GDR_LIBFABRIC:
        return [f"provider {provider} has no Gaudi Direct (efa or verbs only)"]
    why = []
    floor = GDR_LIBFABRIC[provider]
    have = fabric.get("libfabric") or "?"
    if version_tuple(have) < floor:
        why.append(f"libfabric {have} < {'.'.join(map(str, floor))} for {provider}")
    if version_tuple(fabric.get("kernel") or "") < GDR_KERNEL:
        why.append(f"kernel {fabric.get('kernel')} < 5.12")
    gens = {generation_of(c["name"]) for c in fabric.get("cards") or []}
    if provider == "verbs" and not gens <= {"gaudi2", "gaudi3"}:
        why.append("Gaudi Direct over verbs is for Gaudi 2 and Gaudi 3")
    if provider == "efa":
        unset = [v for v in ("FI_EFA_USE_DEVICE_RDMA", "RDMAV_FORK_SAFE") if env.get(v) != "1"]
        if unset:
            why.append(f"{' and '.join(v + '=1' for v in unset)} not set (Habana's Gaudi Direct setup on EFA)")
    return why


def conflicts(env: Mapping[str, str]) -> list[str]:
    """Settings HCCL reads otherwise than they ask for."""
    out = []
    if "HCCL_OVER_TCP" in env:
        out.append("HCCL_OVER_TCP is not read by current HCCL (not on 'Scale-out via Host NIC'): remove it")
    if "HCCL_GAUDI_DIRECT" in env and "HCCL_OVER_OFI" not in env:
        out.append("HCCL_GAUDI_DIRECT without HCCL_OVER_OFI: HCCL stops ('Conflicting scale-out environment "
                   "settings')")
    ofi = env.get("HCCL_OVER_OFI")
    if ofi is not None and env.get("FI_EFA_USE_DEVICE_RDMA") == "1" and env.get("HCCL_GAUDI_DIRECT") != "1":
        out.append(f"HCCL_OVER_OFI={ofi} turns HCCL's auto-detection off ({'host memory' if _true(ofi) else 'no OFI'})"
                   " while FI_EFA_USE_DEVICE_RDMA=1 asks for Gaudi Direct: unset HCCL_OVER_OFI")
    return out


def _true(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def hccl_scaleout(fabric: dict, env: Mapping[str, str]) -> tuple[str, str]:
    """(mode, why) HCCL will take between hosts, from a host's fabric facts and the variables its ranks see."""
    cards, providers = fabric.get("cards"), _providers(fabric, env)
    ofi = env.get("HCCL_OVER_OFI")
    if ofi is not None:
        if not _true(ofi):  # HCL's source: OFI is never tried, Gaudi NICs or nothing
            return (P0, f"HCCL_OVER_OFI={ofi}: Gaudi NICs only") if gaudi_nics_connected(cards) else \
                (P3, f"HCCL_OVER_OFI={ofi} forbids host NICs and the Gaudi NICs are not all up")
        if not providers:
            return P3, f"HCCL_OVER_OFI={ofi} forces libfabric, which has no efa / verbs / tcp device here"
        if _true(env.get("HCCL_GAUDI_DIRECT", "0")) and not gdr_blockers(fabric, env, providers[0]):
            return P1, f"HCCL_OVER_OFI=1 and HCCL_GAUDI_DIRECT=1 (forced) over {providers[0]}"
        return P2, f"HCCL_OVER_OFI={ofi} turns auto-detection off and forces it, over {providers[0]}"
    if gaudi_nics_connected(cards):
        ports = sum(len(c["external"]) for c in cards)
        return P0, f"auto-detection: {ports} external Gaudi NIC ports up on {len(cards)} cards"
    if not providers:
        return P3, "auto-detection: Gaudi NICs not all up and no libfabric efa / verbs / tcp device"
    blockers = {}
    for p in providers:
        blockers[p] = gdr_blockers(fabric, env, p)
        if not blockers[p]:
            return P1, f"auto-detection: {p}, libfabric {fabric.get('libfabric')}, kernel {fabric.get('kernel')}"
    why = "; ".join(f"{p}: {', '.join(b)}" for p, b in blockers.items() if p in GDR_LIBFABRIC) or \
        f"{providers[0]} has no Gaudi Direct"
    return P2, f"auto-detection over {providers[0]} (no Gaudi Direct: {why})"


def port_summary(cards: list[dict]) -> tuple[bool, str]:
    """(all external ports up, a one-line account of them: the ports down where only some are)."""
    down = [f"{c['bus']} port {p}" for c in cards for p, s in c["external"].items() if s != "UP"]
    total = sum(len(c["external"]) for c in cards)
    head = f"{len(cards)} x {'/'.join(sorted({c['name'] for c in cards}))}: {total - len(down)} of {total} external " \
           f"ports UP"
    if down and len(down) < total:
        head += f"; down: {', '.join(down[:6])}" + (" ..." if len(down) > 6 else "")
    return not down and total > 0, head


# ------------------------------------------------------------------------------------------------ expected bandwidth
def expected_gbit(profile: str, generation: str | None) -> tuple[float | None, str]:
    """What the profile's fabric gives one process per host (the all-reduce's set-up): (Gbit/s or None, source)."""
    if profile == "efa":
        return 400.0, ("per host, dl1.24xlarge's 4 x 100 Gbit/s EFA (AWS Compute Blog, 'Amazon EC2 DL1 instances "
                       "Deep Dive')")
    if profile == "roce":
        per_port = {"gaudi2": 100.0, "gaudi3": 200.0}.get(generation or "")
        if per_port is None:
            return None, "Gaudi NICs of an unknown generation"
        return 3 * per_port, (f"per card, {generation}'s 3 external {per_port:g} GbE ports (ds_core.device."
                              f"accelerators: {accelerators.get(generation).interconnect})")
    if profile == "hostnic":
        return None, "the host NICs' line rate, which the site knows: give --expect_gbit"
    return None, "no published figure for this fabric"
