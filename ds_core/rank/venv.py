"""Per-venv paths: caches that must not be shared between checkouts or venvs. Standard library only (the starters
import it without torch)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping


def venv_dir() -> Path | None:
    """This interpreter's venv, by its resolved path (two paths to one venv are one venv); None outside a venv."""
    return Path(sys.prefix).resolve() if sys.prefix != sys.base_prefix else None


def torch_extensions_env(environ: Mapping[str, str]) -> dict[str, str]:
    """{"TORCH_EXTENSIONS_DIR": <this venv>/torch_extensions} unless `environ` sets it or Python runs outside a venv.

    torch keys its JIT build cache (~/.cache/torch_extensions/py311_cpu/<op>) by op name only, so two checkouts or
    venvs (or two paths to one venv) find each other's build of DeepSpeed's CPU shm op, see other sources and rebuild
    it (40-50 s per start) on every alternation. One cache per venv ends that. Set by the starters
    (ds_core.rank.rendezvous.rank_env for launch.local_ranks, launch.run, the Makefile) and by every rank
    (ds_core.rank.dist.init_distributed: other nodes do not get the starter's environment)."""
    venv = venv_dir()
    if environ.get("TORCH_EXTENSIONS_DIR") or venv is None:
        return {}
    return {"TORCH_EXTENSIONS_DIR": str(venv / "torch_extensions")}
