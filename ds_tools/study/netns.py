"""Emulated fabrics: "nodes" as network namespaces joined by a bridge, each link shaped with `tc`.

    with emulated_fabric(2, mbit=100, delay_ms=1.0) as fab:
        fab.wrap(0, cmd)          # ["ip", "netns", "exec", fab.namespaces[0], *cmd]
        fab.addresses             # ["10.215.K.1", "10.215.K.2"]: node i's address on interface `dsnet0`

Layout: one hub namespace holding a bridge; per node a namespace with a veth pair (`dsnet0` in the node, its peer
on the hub's bridge). Each node's `dsnet0` egress gets `tbf rate MBIT` (the link's bandwidth, both directions since
both ends send through their own dsnet0) under `netem delay MS` when the kernel has sch_netem; without it, latency is
not emulated and `latency_emulated` is False (the study prints it). Only addresses inside these namespaces are used,
nothing is routed out, and everything is deleted on exit (deleting a namespace deletes its veth ends).

Needs root (CAP_NET_ADMIN) and iproute2's `ip` and `tc`; `unavailable()` says why not, for a skip with a reason.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

IFACE = "dsnet0"


class FabricError(RuntimeError):
    """A namespace, link or qdisc could not be made; the message names the command and its error."""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=30)


def _must(*args: str) -> None:
    r = _run(*args)
    if r.returncode != 0:
        raise FabricError(f"`{' '.join(args)}` failed: {r.stderr.strip() or r.returncode}")


def unavailable() -> str | None:
    """Why emulated fabrics cannot be built here (None: they can)."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (CAP_NET_ADMIN)"
    return None


@dataclass
class EmulatedFabric:
    tag: str
    namespaces: list[str]
    addresses: list[str]
    mbit: float
    delay_ms: float
    latency_emulated: bool
    hub: str = ""
    made: list[str] = field(default_factory=list)

    def wrap(self, node: int, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[node], *cmd]


def _shape(ns: str, mbit: float, delay_ms: float) -> bool:
    """tbf for bandwidth, under netem for delay where sch_netem exists; True when the delay is emulated."""
    # burst: at least one MTU-sized frame per timer tick, ~1 ms of traffic; limit: ~50 ms of queue (TCP backs off
    # on the drops past it, as on a real congested link)
    burst = max(16_000, int(mbit * 1e6 / 8 / 1000))
    tbf = ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms"]
    if delay_ms > 0:
        r = _run("tc", "-n", ns, "qdisc", "add", "dev", IFACE, "root", "handle", "1:", "netem", "delay",
                 f"{delay_ms}ms")
        if r.returncode == 0:
            _must("tc", "-n", ns, "qdisc", "add", "dev", IFACE, "parent", "1:1", "handle", "10:", *tbf)
            return True
    _must("tc", "-n", ns, "qdisc", "add", "dev", IFACE, "root", *tbf)
    return delay_ms <= 0


def names(nodes: int, key: int) -> tuple[list[str], list[str]]:
    """(namespaces, addresses) that emulated_fabric(nodes, key=key) will make."""
    k = key % 100_000
    return [f"dsf{k}n{i}" for i in range(nodes)], [f"10.215.{k % 250}.{i + 1}" for i in range(nodes)]


@contextmanager
def emulated_fabric(nodes: int, *, mbit: float, delay_ms: float, key: int | None = None) -> Iterator[EmulatedFabric]:
    """`nodes` namespaces on one shaped bridge; removed on exit, also after an error or an interrupt. `key` (default:
    this process id) names them and their subnet, so a caller can know the names and addresses beforehand."""
    why = unavailable()
    if why:
        raise FabricError(f"emulated fabric: {why}")
    if nodes < 1 or not mbit > 0 or delay_ms < 0:
        raise FabricError(f"emulated fabric: nodes={nodes}, mbit={mbit}, delay_ms={delay_ms}: expected nodes >= 1, "
                          "mbit > 0, delay_ms >= 0")
    pid = (os.getpid() if key is None else key) % 100_000
    tag = f"dsf{pid}"
    fab = EmulatedFabric(tag, *names(nodes, pid), mbit, delay_ms, True, hub=f"{tag}h")
    try:
        for ns in [fab.hub, *fab.namespaces]:
            _run("ip", "netns", "del", ns)           # a leftover of an interrupted run of this same pid
            _must("ip", "netns", "add", ns)
            fab.made.append(ns)
            _must("ip", "-n", ns, "link", "set", "lo", "up")
        _must("ip", "-n", fab.hub, "link", "add", "br0", "type", "bridge")
        _must("ip", "-n", fab.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(fab.namespaces):
            a, b = f"{tag}a{i}", f"{tag}b{i}"
            _must("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            _must("ip", "link", "set", a, "netns", ns)
            _must("ip", "link", "set", b, "netns", fab.hub)
            _must("ip", "-n", ns, "link", "set", a, "name", IFACE)
            _must("ip", "-n", ns, "addr", "add", f"{fab.addresses[i]}/24", "dev", IFACE)
            _must("ip", "-n", ns, "link", "set", IFACE, "up")
            _must("ip", "-n", fab.hub, "link", "set", b, "master", "br0")
            _must("ip", "-n", fab.hub, "link", "set", b, "up")
            fab.latency_emulated &= _shape(ns, mbit, delay_ms)
        yield fab
    finally:
        for ns in reversed(fab.made):
            _run("ip", "netns", "del", ns)
