"""How a rank finds its world: the variables DeepSpeed's launch.py gives each rank, a free local port, and the
environment a started rank needs (rank_env).

Here, not in launch/local_ranks.py (which starts ranks with them), because a training process needs them too (a
single process started by hand makes itself a world of one: ds_core.rank.dist.init_distributed) and so does a model
package's demo (bert_ref.demo), and neither imports the launchers. Kept free of torch and deepspeed imports: the
local starter uses it before any rank exists.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Mapping, Sequence

from ds_core.rank.venv import torch_extensions_env

LOOPBACK = "127.0.0.1"


# Launchers' names for the global rank before torch.distributed exists (deepspeed/torchrun, Open MPI, MPICH/PMIx,
# MVAPICH, Slurm).
RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def env_rank() -> int:
    """This process's global rank as the launcher announced it; 0 for a process started by hand."""
    for var in RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free right now on `host` (the kernel picks it; another process may still take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_variables(rank: int, num_ranks: int, *, master_port: int, master_addr: str = LOOPBACK) -> dict[str, str]:
    """The variables DeepSpeed's launch.py gives rank `rank` of a one-node world of `num_ranks`."""
    return dict(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), WORLD_SIZE=str(num_ranks), CROSS_RANK="0",
                CROSS_SIZE="1", LOCAL_SIZE=str(num_ranks), RANK=str(rank), LOCAL_RANK=str(rank))


def _accelerator_present() -> bool:
    """CUDA (or ROCm) or Habana on this host, asked without importing torch where the answer is already known: a
    CPU-only torch build (torch/version.py with `cuda = None` and `hip = None`) cannot see a GPU, and importing torch
    (~2 s) here would be paid before every rank starts."""
    import importlib.util
    import re

    if importlib.util.find_spec("habana_frameworks") is not None:
        return True
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover - torch is a dependency
        return False
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
        if all(re.search(rf"^{k}\b[^=\n]*= None\s*$", text, re.M) for k in ("cuda", "hip")):
            return False
    except OSError:  # pragma: no cover - an unusual install: ask torch
        pass
    import torch

    return torch.cuda.is_available()


def rank_env(base: Mapping[str, str] | None = None, *, threads: int | None = None,
             pythonpath: Sequence[str | os.PathLike] = (), extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for launched ranks: `base` (default os.environ) plus

    - DS_ACCELERATOR=cpu where neither CUDA nor Habana is present and the caller set none (DeepSpeed's own probe
      would otherwise try CUDA first and fail on a CPU-only host);
    - OMP_NUM_THREADS=threads when given (ranks sharing few cores must not each start one thread per core);
    - `pythonpath` entries in front of PYTHONPATH (a checkout that is not the installed one);
    - TORCH_EXTENSIONS_DIR under this venv unless set (ds_core.rank.venv.torch_extensions_env);
    - `extra` last, so a caller's explicit value always wins.
    """
    env = dict(os.environ if base is None else base)
    env.update(torch_extensions_env({**env, **(extra or {})}))
    if "DS_ACCELERATOR" not in env and not (extra and "DS_ACCELERATOR" in extra) and not _accelerator_present():
        env["DS_ACCELERATOR"] = "cpu"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *filter(None, [env.get("PYTHONPATH", "")])])
    env.update(extra or {})
    return env
