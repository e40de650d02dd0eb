"""DeepSpeed's Muon module imported without compiling at import time: ~2 s off every rank's start.

deepspeed.initialize with ZeRO checks the client optimizer with is_zero_supported_optimizer, which imports
deepspeed.runtime.zero.muon.muon_optimizer on every call (DeepSpeed moved it there so that `import deepspeed` stays
fast). That module decorates its Newton-Schulz kernels with torch.compile at import, and a first torch.compile call
imports Inductor: ~1.9 s per rank on a 2-core EPYC, paid by every run, though only a Muon optimizer ever calls those
kernels (this toolkit builds NVLAMB, LANS and AdamW). `apply` imports the module once with torch.compile
standing in as deferred_compile: each decorated function is compiled by the real torch.compile, with the same
arguments, on its first call. Nothing else changes; a run that compiles its model (--compile) still imports Inductor
then. Applied by ds_core.compat.changes (stage before_initialize): a DeepSpeed without that module (Habana's fork,
0.16.1) compiles nothing there, and the change is off with one line.
"""
from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable

from ds_core.compat.gates import APPLIED, Outcome

# DeepSpeed's Muon optimizer module, imported by ZeRO's optimizer check in releases that have it (torch imported
# only by apply: ds_core.compat.changes names this module without importing torch)
MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def deferred_compile(real: Callable) -> Callable:
    """A stand-in for torch.compile (`real`) used as a decorator, with or without arguments: the decorated function
    is compiled by `real(fn, **kwargs)` on its first call, not when it is decorated."""

    def compile_(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # @torch.compile(mode=...) form
            return lambda fn: compile_(fn, **kwargs)
        compiled: list = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kw: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **kwargs))
            return compiled[0](*args, **kw)

        return first_call_compiles

    return compile_


def apply(ctx: Any) -> Outcome:
    """Change lazy_muon_import: DeepSpeed's Muon module imported (its gate: this DeepSpeed has one) with its
    torch.compile decorations deferred; a module already imported stays as it is."""
    import torch

    if MUON_MODULE in sys.modules:
        return APPLIED
    real = torch.compile
    torch.compile = deferred_compile(real)
    try:
        importlib.import_module(MUON_MODULE)
    finally:
        torch.compile = real
    return APPLIED


__all__ = ["deferred_compile", "apply", "MUON_MODULE"]
