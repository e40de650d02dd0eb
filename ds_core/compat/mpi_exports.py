"""Change mpi_exports_as_given: the variables DeepSpeed's launcher exports reach MPI ranks as they are.

DeepSpeed's runner collects what every rank must get (.deepspeed_env, the NCCL_* / HCCL_* / PYTHON* variables) with
MultiNodeRunner.add_export, and its MPI runners hand each to mpirun as `-x KEY=VALUE`, one argument that no shell
reads. DeepSpeed 0.16 (Habana's fork) wraps every value in double quotes, which pdsh's shell strips but mpirun passes
on: each rank would see `DS_ACCELERATOR="cpu"` or `HCCL_SOCKET_IFNAME="eth0"`, quotes included, and DeepSpeed refuses
the first, HCCL finds no interface of the second's name. 0.19 quotes only a value a shell would split or expand.
Where the installed add_export is the fork's (its gate: the body's fingerprint; that it quotes a plain value is
probed by ds_core.compat.deepspeed_behaviour.quotes_plain_exports), it takes 0.19's rule in the launcher process
(stage launcher, launch.ds_runner).
"""
from __future__ import annotations

import re
from typing import Any

from ds_core.compat.gates import APPLIED, Outcome
from ds_core.compat.marks import replace

SHELL_SAFE = re.compile(r"[^\w@%+=:,./-]")  # DeepSpeed 0.19's test for a value that needs quotes


def add_export(self: Any, key: str, var: str) -> None:
    """DeepSpeed 0.19's MultiNodeRunner.add_export: a value is quoted only where a shell would split or expand it."""
    var = var.strip()
    if SHELL_SAFE.search(var):
        var = f'"{var}"'
    self.exports[key.strip()] = var


def apply(ctx: Any) -> Outcome:
    from deepspeed.launcher import multinode_runner

    def make(deepspeeds: Any) -> Any:
        def ours(self: Any, key: str, var: str) -> None:
            add_export(self, key, var)
        return ours

    replace(multinode_runner.MultiNodeRunner, "add_export", make, "mpi_exports_as_given")
    return APPLIED


__all__ = ["add_export", "apply", "SHELL_SAFE"]
