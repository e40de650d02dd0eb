"""DeepSpeed's compiled ops on a CUDA machine that cannot build them: a named reason and torch's optimizer instead.

A DeepSpeed JSON with an Adam / AdamW "optimizer" section makes DeepSpeed build its fused_adam CUDA op just in time
(ninja + nvcc) at deepspeed.initialize. On a GPU image without a CUDA compiler (a runtime-only image, an air-gapped
cluster's minimal container) that build fails deep inside torch.utils.cpp_extension with a compiler traceback.
DeepSpeed's documented switch `"torch_adam": true` (in the optimizer's params) selects torch.optim.AdamW instead:
the same update, unfused. ds_core.rank.engine.build_engine applies it, saying why, when the op is neither pre-built into
the installed DeepSpeed nor buildable here.
"""
from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Mapping

ADAM_TYPES = ("adam", "adamw")


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
    """Why DeepSpeed's fused_adam op cannot be had on this machine, or None (pre-built, or ninja and nvcc found)."""
    try:
        from deepspeed.git_version_info import installed_ops

        if installed_ops.get("fused_adam"):
            return None  # built into the installed DeepSpeed wheel (DS_BUILD_FUSED_ADAM=1)
    except ImportError:  # pragma: no cover - an old DeepSpeed without the record: decide from the tools
        pass
    env = os.environ if env is None else env
    if shutil.which("ninja", path=env.get("PATH", "")) is None:
        try:
            import ninja  # noqa: F401, PLC0415 - the pip package puts its binary beside the module
        except ImportError:
            return "ninja is not installed (DeepSpeed builds its ops with it)"
    if cuda_compiler(env) is None:
        where = env.get("CUDA_HOME") or env.get("CUDA_PATH") or "PATH and /usr/local/cuda"
        return f"no CUDA compiler (nvcc) in {where}"
    return None


def apply_ops_fallback(ds_config: dict, accelerator: str, problem: str | None = None,
                       env: Mapping[str, str] | None = None) -> tuple[dict, str | None]:
    """(config, note): on CUDA, an Adam/AdamW optimizer section that would need the fused_adam build gets
    `"torch_adam": true` when the op cannot be had (`problem`, else fused_adam_problem()); the note says what and why.
    The config is copied, never changed in place; other accelerators and optimizers pass through untouched."""
    opt = ds_config.get("optimizer")
    if accelerator != "cuda" or not isinstance(opt, dict) or str(opt.get("type", "")).lower() not in ADAM_TYPES:
        return ds_config, None
    if (opt.get("params") or {}).get("torch_adam"):
        return ds_config, None
    problem = problem or fused_adam_problem(env)
    if problem is None:
        return ds_config, None
    out = copy.deepcopy(ds_config)
    out["optimizer"].setdefault("params", {})["torch_adam"] = True
    return out, (f"DeepSpeed's fused_adam op cannot be built here: {problem}. Falling back to torch.optim's "
                 f"{opt['type']} (the DeepSpeed JSON's optimizer params get \"torch_adam\": true; same update, "
                 f"unfused). Install the CUDA toolkit's nvcc and ninja, or a DeepSpeed wheel built with "
                 f"DS_BUILD_FUSED_ADAM=1, to use the fused op.")
