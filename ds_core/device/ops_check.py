"""DeepSpeed's compiled optimizer ops: a TORCH_CUDA_ARCH_LIST DeepSpeed can parse, and torch's optimizer, with a
named reason, wherever the op cannot be had.

A DeepSpeed JSON with an Adam / AdamW "optimizer" section makes deepspeed.initialize load a compiled op: fused_adam
(DeepSpeed's FusedAdam: a CUDA build with ninja + nvcc, a C++ build on the CPU accelerator) or, with ZeRO's optimizer
offload, cpu_adam. Unless the installed DeepSpeed has it pre-built, the op is built just in time, and that build can
fail in several ways deep inside deepspeed.initialize: no compiler (a runtime-only image, an air-gapped cluster's
minimal container), a compile error, or DeepSpeed 0.19's own parsing of TORCH_CUDA_ARCH_LIST, which reads each entry
as two integers and raises `ValueError: invalid literal for int()` on the arch suffixes that NVIDIA's and PyTorch's
CUDA images set (`9.0a`, `10.0a`, `10.0f`).

prepare_optimizer_ops (ds_core.rank.engine_build.build_engine calls it on every rank, before deepspeed.initialize):
1. on CUDA, rewrites TORCH_CUDA_ARCH_LIST to the same architectures without those suffixes (arch_list_for_deepspeed)
   and says so once;
2. loads the op as DeepSpeed will (`get_accelerator().create_op_builder(...).load()`: the pre-built op or the JIT
   build; DeepSpeed's FusedAdam / DeepSpeedCPUAdam then find it loaded), on every accelerator;
3. if the op failed on any rank, gives every rank DeepSpeed's documented switch `"torch_adam": true` (in the
   optimizer's params), which selects torch.optim.AdamW / Adam (the same update, unfused), with one line naming why.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from ds_core import log

ADAM_TYPES = ("adam", "adamw")
# DeepSpeed's op builder class for each op its Adam optimizers load, and for the CPU accelerator's shared-memory
# collectives that deepspeed.comm loads at init_distributed (deepspeed.ops.op_builder, per accelerator)
BUILDERS = {"fused_adam": "FusedAdamBuilder", "cpu_adam": "CPUAdamBuilder", "shm_comm": "ShareMemCommBuilder"}
# One TORCH_CUDA_ARCH_LIST entry as torch.utils.cpp_extension reads it: major.minor, an optional arch-specific ("a",
# sm_90a) or family-specific ("f", CUDA 12.9+) suffix, an optional +PTX.
_ARCH = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")


def arch_list_for_deepspeed(value: str | None) -> tuple[str | None, str | None]:
    """(a TORCH_CUDA_ARCH_LIST that DeepSpeed 0.19's op builder parses, a note saying what changed, or None).

    `9.0a` -> `9.0`, `10.0f` -> `10.0`, `9.0a+PTX` -> `9.0+PTX`; plain entries, and entries this does not know (named
    arches such as `Hopper`), are kept as written; a duplicate left by the rewrite is dropped.

    What the suffix gave up does not matter to DeepSpeed's optimizer ops: `a` code may use an architecture's own
    instructions (Hopper's wgmma and setmaxnreg, for instance) and `f` a family's, which only hand-written tensor-core
    kernels (CUTLASS, FlashAttention-3) use; fused_adam is an elementwise multi-tensor loop. Plain `sm_90` code runs
    on the same GPUs (and `sm_90a` code on exactly that architecture only). The variable steers the JIT builds of this
    process only; torch's own kernels are compiled already."""
    if not value or not value.strip():
        return value, None
    entries = [e.strip() for e in value.replace(" ", ";").split(";") if e.strip()]
    out: list[str] = []
    for entry in entries:
        m = _ARCH.match(entry)
        plain = f"{m[1]}.{m[2]}{m[4] or ''}" if m else entry
        if plain not in out:
            out.append(plain)
    if out == entries:
        return value, None
    new = ";".join(out)
    return new, (f"TORCH_CUDA_ARCH_LIST {value!r} -> {new!r} for DeepSpeed's op builds: the same architectures "
                 f"without the a/f suffixes, which DeepSpeed 0.19's op builder cannot parse and its elementwise "
                 f"optimizer ops do not use")


def cuda_compiler(env: Mapping[str, str] | None = None) -> str | None:
    """Path of nvcc as torch.utils.cpp_extension would find it (CUDA_HOME / CUDA_PATH, then nvcc on PATH, then
    /usr/local/cuda), or None."""
    env = os.environ if env is None else env
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            nvcc = Path(env[var]) / "bin" / "nvcc"
            return str(nvcc) if nvcc.is_file() else None  # torch takes CUDA_HOME as given: no further search
    found = shutil.which("nvcc", path=env.get("PATH", ""))
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def fused_adam_problem(env: Mapping[str, str] | None = None) -> str | None:
    """Why DeepSpeed's CUDA fused_adam op cannot be built here, from the tools alone (ninja, nvcc), or None
    (pre-built, or both found): a plain reason before a build would fail with a compiler traceback."""
    try:
        from deepspeed.git_version_info import installed_ops

        if installed_ops.get("fused_adam"):
            return None  # built into the installed DeepSpeed wheel (DS_BUILD_FUSED_ADAM=1)
    except ImportError:  # pragma: no cover - an old DeepSpeed without the record: decide from the tools
        pass
    env = os.environ if env is None else env
    if shutil.which("ninja", path=env.get("PATH", "")) is None:
        try:
            import ninja  # noqa: F401 - the pip package puts its binary beside the module
        except ImportError:
            return "ninja is not installed (DeepSpeed builds its ops with it)"
    if cuda_compiler(env) is None:
        where = env.get("CUDA_HOME") or env.get("CUDA_PATH") or "PATH and /usr/local/cuda"
        return f"no CUDA compiler (nvcc) in {where}"
    return None


def needed_op(ds_config: dict) -> str | None:
    """The compiled op deepspeed.initialize will load for this JSON's optimizer section ("fused_adam", "cpu_adam"),
    or None (no section, torch_adam already, or an optimizer this module does not handle)."""
    opt = ds_config.get("optimizer")
    if not isinstance(opt, dict) or str(opt.get("type", "")).lower() not in ADAM_TYPES:
        return None
    if (opt.get("params") or {}).get("torch_adam"):
        return None
    offload = (ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    # DeepSpeedConfig.zero_use_cpu_optimizer: an optimizer offloaded to cpu or nvme steps in DeepSpeedCPUAdam
    return "cpu_adam" if str(offload.get("device", "none")).lower() in ("cpu", "nvme") else "fused_adam"


def _one_line(err: BaseException) -> str:
    """A build error in one line: the head of its first line (torch's "Error building extension 'x'"), plus the first
    compiler diagnostic of the build log (`file:line:col: error: ...`, its directory left out)."""
    lines = [x.strip() for x in str(err).splitlines() if x.strip()] or [""]
    head = lines[0].split(": [", 1)[0]  # torch appends the build log to its first line after ": [1/3] <command>"
    text = f"{type(err).__name__}: {head[:160]}"
    for line in lines:
        m = re.search(r"([^/\s]+:\d+(?::\d+)?: (?:fatal )?error: .*)", line)
        if m:
            return f"{text} ... {m[1][:200]}"
    return text


def load_op(op: str, accel=None) -> str | None:
    """Load `op` the way deepspeed.initialize will (this accelerator's builder, `accel`: DeepSpeed's
    get_accelerator() unless given; pre-built or JIT); None when it loaded, else why not, in one line. Any failure
    counts: a missing compiler, a compile error, DeepSpeed's own parsing of the build settings."""
    if accel is None:
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator()
    builder = accel.create_op_builder(BUILDERS[op])
    if builder is None:
        return f"DeepSpeed has no {op} op for the {accel.device_name()} accelerator"
    try:
        # cached in DeepSpeed's OpBuilder._loaded_ops: deepspeed.initialize does not build again. verbose=False (0.19's
        # default; the fork's is True): torch keeps the build log in the error, _one_line's compiler diagnostic,
        # instead of every rank printing it
        builder.load(verbose=False)
    except Exception as err:  # noqa: BLE001 - every way a build fails means the same here: torch's optimizer
        return _one_line(err)
    return None


def with_torch_optimizer(ds_config: dict, op: str, problem: str) -> tuple[dict, str]:
    """(a copy of the config with `"torch_adam": true` in the optimizer params, the one-line note naming why)."""
    out = copy.deepcopy(ds_config)
    out["optimizer"].setdefault("params", {})["torch_adam"] = True
    kind = out["optimizer"]["type"]
    return out, (f"DeepSpeed's {op} op cannot be had here ({problem}); using torch.optim's {kind} instead "
                 f"(\"torch_adam\": true in the DeepSpeed JSON's optimizer params; the same update, unfused). "
                 f"To get the fused op: a DeepSpeed built with its ops (DS_BUILD_OPS=1), or a working ninja and "
                 f"compiler for JIT builds.")


def op_problem(op: str, accelerator: str, env: Mapping[str, str] | None = None,
               load: Callable[[str], str | None] = load_op) -> str | None:
    """Why `op` cannot be had on this rank, or None: on CUDA the tools check first (a plain reason instead of a
    compiler traceback), then the load itself."""
    if accelerator == "cuda" and op == "fused_adam":
        problem = fused_adam_problem(env)
        if problem:
            return problem
    return load(op)


def agreed_problem(problem: str | None) -> str | None:
    """One rank's problem (with its rank) when any rank has one, on every rank: ranks that step different
    optimizers would not be one data-parallel run. Without a process group, this rank's own.

    Ranks on one node share the JIT build: one compiles while the others wait, and those then fail to import the
    library that was never written (an ImportError that says nothing of why). The build's own error is the one worth
    printing: the lowest rank whose problem is not such an ImportError, else the lowest rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return problem
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    failed = [(r, p) for r, p in enumerate(everyone) if p is not None]
    if not failed:
        return None
    r, p = min(failed, key=lambda rp: (rp[1].startswith("ImportError"), rp[0]))
    return f"rank {r}: {p}"


# What ds_tools.build_ops (the last step of `make setup`) builds before the first run: the CPU accelerator's
# shared-memory collectives (deepspeed.comm loads them at init_distributed, in every CPU run) and FusedAdam (the Adam /
# AdamW of the shipped DeepSpeed JSONs). An accelerator without a builder for one has nothing to build for it.
AHEAD = ("shm_comm", "fused_adam")


def use_deepspeed_arch_list(say: Callable[[str], None], prefix: str) -> None:
    """Rewrite this process's TORCH_CUDA_ARCH_LIST to one DeepSpeed parses (arch_list_for_deepspeed) before a CUDA
    op build, saying so once when it changed."""
    value, note = arch_list_for_deepspeed(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    if note:
        os.environ["TORCH_CUDA_ARCH_LIST"] = value
        say(f"{prefix} {note}" if prefix else note)


def build_ahead(say: Callable[[str], None] = print, accel=None) -> dict[str, str | None]:
    """Load the AHEAD ops of the accelerator DeepSpeed finds (`accel`: its get_accelerator()), building what is not
    built yet into the op cache runs use (TORCH_EXTENSIONS_DIR), as a run would (op_problem), so that a first run
    loads them instead of compiling for minutes inside init_distributed and deepspeed.initialize. {op: None (ready)
    or why not, in one line}; a failure is no error here: a run then takes torch's optimizer
    (prepare_optimizer_ops) and says why."""
    import time

    if accel is None:
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator()
    name = accel.device_name()
    if name == "cuda":
        use_deepspeed_arch_list(say, "[build_ops]")
    out: dict[str, str | None] = {}
    for op in AHEAD:
        if accel.create_op_builder(BUILDERS[op]) is None:
            continue
        t0 = time.monotonic()
        out[op] = problem = op_problem(op, name, load=lambda o: load_op(o, accel))
        if problem is None:
            say(f"[build_ops] {name} {op}: ready ({time.monotonic() - t0:.0f} s)")
        else:
            say(f"[build_ops] {name} {op}: not built ({problem}); runs that need it fall back to torch's "
                f"optimizer and say so")
    return out


def prepare_optimizer_ops(ds_config: dict, accelerator: str, rank: int = 0, say: Callable[[str], None] = log.say, *,
                          env: Mapping[str, str] | None = None, load: Callable[[str], str | None] = load_op) -> dict:
    """The config this rank gives deepspeed.initialize (see the module docstring): with `"torch_adam": true` where the
    op its optimizer needs cannot be had on some rank (op_problem with `env` and `load`, agreed over the ranks),
    otherwise unchanged; never changed in place. On CUDA the process's TORCH_CUDA_ARCH_LIST is rewritten first. Rank
    0 says what changed, one line each, to `say` (ds_core's logger by default; lines without its "[ds_core] ")."""
    if accelerator == "cuda":
        use_deepspeed_arch_list(say if rank == 0 else (lambda _: None), "")
    op = needed_op(ds_config)
    if op is None:
        return ds_config
    problem = agreed_problem(op_problem(op, accelerator, env, load))
    if problem is None:
        return ds_config
    out, note = with_torch_optimizer(ds_config, op, problem)
    if rank == 0:
        say(f"warning: {note}")
    return out
