"""The one precision rule: which dtype a run computes in (TrainConfig.precision = auto | bf16 | fp32), and the
measured matmul peak of this CPU in that dtype, cached once per machine.

Why auto is not always bf16: on a CPU without native bf16 (no AMX, no AVX512-BF16: an AVX2-only EPYC, most laptops)
PyTorch emulates bf16 matmuls, measured here ~60x slower than fp32 (0.0008 vs 0.054 TFLOPs at 1024^2), so a "bf16"
run there is both slow and compared against a bf16 peak that is itself emulated. CUDA and HPU always have bf16 units.
Benches (bench/bert_step.py) and entry points call resolve_precision so every figure uses the same rule.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

PRECISIONS = ("auto", "bf16", "fp32")
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of CPUs whose matmuls run bf16 in hardware
# oneDNN's ISA cap (its documented variables, DNNL_ is the older name) and the caps below its first ISA with bf16
# instructions (avx512_core_bf16, in oneDNN's order of ISAs): under one of them oneDNN computes bf16 emulated whatever
# the CPU's flags say, as on a CPU without native bf16.
ISA_CAP_ENVS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ISA_CAPS_WITHOUT_BF16 = ("sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core", "avx512_core_vnni")


def isa_cap() -> str | None:
    """oneDNN's ISA cap set in the environment, lower case, else None."""
    return next((os.environ[e].strip().lower() for e in ISA_CAP_ENVS if os.environ.get(e, "").strip()), None)


def cpu_flags(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> set[str]:
    """The CPU feature flags of the first processor in /proc/cpuinfo (empty where there is none: macOS, Windows)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86 / arm64
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> str:
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def resolve_precision(requested: str, accelerator: str, *, flags: set[str] | None = None,
                      speed: Callable[[], tuple[float, float]] | None = None) -> tuple[str, str]:
    """(dtype, reason): "bf16" or "fp32" for `requested` in PRECISIONS on accelerator "cpu" | "cuda" | "hpu" | ...

    auto is bf16 on CUDA/HPU and on CPUs with native bf16 (NATIVE_BF16_FLAGS) whose oneDNN is not capped below its
    bf16 instructions (isa_cap()), else fp32. `speed` returns measured (bf16, fp32) matmul TFLOPs for
    the reason line of a CPU without native bf16 (default: cached probes of this CPU).
    """
    if requested not in PRECISIONS:
        raise ValueError(f"precision {requested!r}: expected one of {', '.join(PRECISIONS)}")
    if requested != "auto":
        return requested, f"precision {requested} requested"
    if accelerator != "cpu":
        return "bf16", f"auto: bf16 on {accelerator}"
    flags = cpu_flags() if flags is None else flags
    native = sorted(set(NATIVE_BF16_FLAGS) & flags)
    cap = isa_cap()
    if native and cap not in ISA_CAPS_WITHOUT_BF16:
        return "bf16", f"auto: bf16 (this CPU has {', '.join(native)})"
    why = (f"oneDNN is capped at {cap.upper()} ({'/'.join(ISA_CAP_ENVS)}), below its bf16 instructions" if native else
           f"this CPU has no native bf16 ({' or '.join(NATIVE_BF16_FLAGS)} missing from /proc/cpuinfo)")
    bf, fp = (speed or _measured_speed)()
    return "fp32", (f"auto: fp32, {why}: bf16 matmul measured {bf:.4f} TFLOPs vs fp32 {fp:.4f} TFLOPs "
                    f"({fp / bf if bf else float('inf'):.0f}x slower); pass --precision bf16 to train in bf16 anyway")


def _measured_speed() -> tuple[float, float]:
    # 256^2 keeps the emulated bf16 probe to ~0.1 s; the figures only explain the choice, they are not the peak MFU
    # uses (that one is 1024^2, in the run's dtype). Cached like the peak, so each rank and run pays it once.
    return tuple(cached_cpu_peak(f"{d}@n256", probe=lambda d=d: cpu_peak_tflops(d, n=256, seconds=0.1))
                 for d in ("bf16", "fp32"))


def apply_precision(ds_config: dict, dtype: str, source: str = "DeepSpeed config") -> dict:
    """Switch the DeepSpeed JSON's bf16 section to `dtype` (in place; returned). An fp16 JSON is left alone for "auto"
    callers to decide; asking bf16/fp32 of an fp16 config is a conflict the caller reports."""
    if ds_config.get("fp16", {}).get("enabled"):
        raise ValueError(f"{source}: fp16.enabled is true but precision {dtype} was asked: use a bf16/fp32 "
                         f"DeepSpeed config, or set fp16.enabled to false")
    for key in ("bf16", "bfloat16"):  # "bfloat16" is DeepSpeed's older spelling of the same section
        if key in ds_config or key == "bf16":
            section = ds_config.setdefault(key, {})
            section["enabled"] = dtype == "bf16"
    types = ds_config.get("data_types")
    if dtype == "fp32" and isinstance(types, dict) and types.get("grad_accum_dtype") not in (None, "fp32"):
        # An fp32 model accumulates in fp32: DeepSpeed refuses an fp32 model with bf16/fp16 accumulation.
        types["grad_accum_dtype"] = "fp32"
    return ds_config


# ---------------------------------------------------------------------------------------------------------------
# Measured CPU peak, cached once per machine

CACHE_ENV = "DS_CORE_CACHE_DIR"


def cache_path() -> Path:
    """$DS_CORE_CACHE_DIR/peak_tflops.json, else $XDG_CACHE_HOME/ds_core/, else ~/.cache/ds_core/."""
    base = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ds_core"
    return Path(base) / "peak_tflops.json"


def peak_cache_key(dtype: str, threads: int | None = None) -> str:
    """The cache entry of this CPU, torch, dtype and thread count; a oneDNN ISA cap computes on other kernels than the
    CPU's flags say, so a capped run's probe is another machine's and has an entry of its own."""
    import torch

    key = f"{cpu_model()}|torch {torch.__version__}|{dtype}|threads {threads or torch.get_num_threads()}"
    cap = isa_cap()
    return f"{key}|isa {cap}" if cap else key


def read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # missing or corrupt (a killed writer cannot leave one: writes are atomic): re-probe
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, key: str, value: object) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = read_cache(path)
        data[key] = value
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)  # atomic: a concurrent rank or run reads the old or the new file, never half of one
    except OSError:  # a read-only home is no reason to fail a run; the probe is simply repeated next time
        pass


def cached_cpu_peak(dtype: str, probe: Callable[[], float] | None = None) -> float:
    """This CPU's matmul peak in `dtype` from the per-machine cache, probing (and caching) it on a miss."""
    path, key = cache_path(), peak_cache_key(dtype)
    value = read_cache(path).get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    value = (probe or (lambda: cpu_peak_tflops(dtype)))()
    write_cache(path, key, value)
    return value


def update_cpu_peak(dtype: str, value: float) -> None:
    """Keep the better of the cached and a new probe (a probe in a busy moment reads low; the cache keeps the best)."""
    path, key = cache_path(), peak_cache_key(dtype)
    old = read_cache(path).get(key)
    if not isinstance(old, (int, float)) or value > old:
        write_cache(path, key, value)


def cpu_peak_tflops(dtype: str = "bf16", n: int = 1024, seconds: float = 0.5) -> float:
    """Measured matmul peak of this process on the CPU (its current torch thread count) in `dtype`: the best rate of
    square matmuls of side n and n/8, each probed for half of `seconds`.

    Two sizes because torch sends a matmul to different kernels by size (oneDNN for large bf16 ones where the CPU
    flags promise bf16, ATen's own gemm for small ones): where the large path is the slower (a oneDNN ISA cap, an
    emulated bf16), a run of small matmuls would otherwise beat its "peak" and get no MFU at all."""
    import torch

    tdtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype] \
        if isinstance(dtype, str) else dtype
    g = torch.Generator().manual_seed(0)  # private stream: the probe must not shift the run's RNG (exact resume)
    best = 0.0
    for side in dict.fromkeys((n, max(n // 8, 16))):
        a = torch.randn(side, side, generator=g).to(tdtype)
        b = torch.randn(side, side, generator=g).to(tdtype)
        torch.mm(a, b)  # warm-up (allocations, kernels)
        t_end = time.perf_counter() + seconds / 2
        while True:
            t0 = time.perf_counter()
            torch.mm(a, b)
            dt = time.perf_counter() - t0
            best = max(best, 2 * side**3 / dt / 1e12)
            if time.perf_counter() >= t_end:
                break
    return best
