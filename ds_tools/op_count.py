"""Counting aten operations and host syncs (`.item()`, i.e. aten::_local_scalar_dense) as a region dispatches them:
a TorchDispatchMode sees every top-level aten op once (the ops a composite or fused op runs inside it are not
counted: that is the host's dispatch work the region asks for). Used by bench/host_ops.py and the optimizer's
op-count test; op counts, unlike times, are the same on every machine."""
from __future__ import annotations

import collections
import traceback

from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("aten._local_scalar_dense",)  # .item(), .tolist(), float(t), bool(t), if t: ...


class OpCounter(TorchDispatchMode):
    """ops: Counter of aten op names; syncs: count of host syncs, with the innermost project / library frame of each
    in sync_sites (where it came from) when `where` is set; with `sites` set, every op's frame as well, in op_sites
    (a stack walk per op: for finding where a step's ops come from, not for counting a large region often)."""

    def __init__(self, where: bool = False, sites: bool = False):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.sync_sites: collections.Counter = collections.Counter()
        self.op_sites: collections.Counter = collections.Counter()
        self.where, self.sites = where or sites, sites

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        self.ops[name] += 1
        if self.sites:
            self.op_sites[_site()] += 1
        if name == "_local_scalar_dense" and self.where:
            self.sync_sites[_site()] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> int:
        return self.ops["_local_scalar_dense"]


def _site() -> str:
    """file:line of the innermost frame outside torch/ (the caller that asked for the value)."""
    for fr in reversed(traceback.extract_stack()[:-3]):
        if "/torch/" not in fr.filename and "op_count.py" not in fr.filename:
            parts = fr.filename.split("/")
            return f"{'/'.join(parts[-2:])}:{fr.lineno} {fr.name}"
    return "?"


__all__ = ["OpCounter", "SYNC_OPS"]
