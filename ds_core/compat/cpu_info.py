"""Change cached_cpu_info: py-cpuinfo's get_cpu_info, which DeepSpeed's op builder calls twice per op load (~1.3 s
each on a 2-core EPYC), answered from the per-machine cache of ds_core.device.cpu_info on the CPU accelerator."""
from __future__ import annotations

from typing import Any


def apply(ctx: Any) -> str | None:
    """Make `cpuinfo.get_cpu_info` (what DeepSpeed's op builders and CPU Adam call) the cached one in this process."""
    import cpuinfo

    from ds_core.compat.marks import NotNeeded, replace
    from ds_core.device.cpu_info import cached

    if ctx.device_type != "cpu":
        return NotNeeded(f"the {ctx.device_type} accelerator's ops do not ask py-cpuinfo at every load")
    replace(cpuinfo, "get_cpu_info", lambda ask: cached(ask, getattr(cpuinfo, "CPUINFO_VERSION_STRING", "?")),
            "cached_cpu_info")
    return None


__all__ = ["apply"]
