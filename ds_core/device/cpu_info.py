"""py-cpuinfo's description of this CPU, asked once per machine instead of on every op load of every rank: the cache,
and the change cached_cpu_info (ds_core.compat.changes, stage process_start) that puts it in py-cpuinfo's place.

DeepSpeed's JIT op builder asks py-cpuinfo (`cpuinfo.get_cpu_info`) for the architecture and the SIMD width each time
it loads an op, twice per load, and every CPU rank loads DeepSpeed's shared-memory communication op when its process
group starts. py-cpuinfo answers by running a subprocess that probes CPUID: ~1.3 s per call on a 2-core EPYC, so ~2.6
s of each CPU rank's start went to a question whose answer does not change on the machine. `cached` (put in
py-cpuinfo's place by `apply`, on the CPU accelerator) answers it from the per-machine cache (the
folder of ds_core.device.precision.cache_path, file cpu_info.json) under a key made of what the kernel says of the
CPU (model, flags, CPU count), py-cpuinfo's and Python's versions; a miss asks py-cpuinfo once and stores its answer.
DeepSpeed reads `arch`, `flags` and `vendor_id_raw` of it; clock fields (`hz_actual`) are those of the first answer.
"""
from __future__ import annotations

import copy
import hashlib
import os
import platform
from typing import Any, Callable

from ds_core.compat.gates import APPLIED, Outcome, not_needed
from ds_core.compat.marks import replace
from ds_core.device.precision import cache_path, cpu_flags, cpu_model, read_cache, write_cache


def cpu_info_path():
    return cache_path().with_name("cpu_info.json")


def cpu_info_key(version: str) -> str | None:
    """The cache key of this machine's answer; None where the kernel describes no CPU (no /proc/cpuinfo): no cache."""
    flags = cpu_flags()
    if not flags:
        return None
    text = "|".join([cpu_model(), " ".join(sorted(flags)), str(os.cpu_count()), platform.machine(),
                     platform.python_version(), version])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached(ask: Callable[[], dict], version: str) -> Callable[[], dict]:
    """`ask` (py-cpuinfo's get_cpu_info) answered from the per-machine cache, and from memory after the first call."""
    key = cpu_info_key(version)
    memo: dict = {}

    def get_cpu_info() -> dict:
        if "info" not in memo:
            stored = read_cache(cpu_info_path()).get(key) if key else None
            if isinstance(stored, dict) and {"arch", "flags"} <= stored.keys():
                memo["info"] = stored
            else:
                memo["info"] = ask()
                if key:
                    write_cache(cpu_info_path(), key, memo["info"])
        return copy.deepcopy(memo["info"])  # a caller that edits its answer leaves the next one's alone

    return get_cpu_info


def apply(ctx: Any) -> Outcome:
    """Change cached_cpu_info: `cpuinfo.get_cpu_info` (what DeepSpeed's op builders and CPU Adam call) the cached one
    in this process (its gate: py-cpuinfo is installed)."""
    import cpuinfo

    if ctx.device_type != "cpu":
        return not_needed(f"the {ctx.device_type} accelerator's ops do not ask py-cpuinfo at every load")
    replace(cpuinfo, "get_cpu_info", lambda ask: cached(ask, getattr(cpuinfo, "CPUINFO_VERSION_STRING", "?")),
            "cached_cpu_info")
    return APPLIED


__all__ = ["cached", "cpu_info_key", "cpu_info_path", "apply"]
