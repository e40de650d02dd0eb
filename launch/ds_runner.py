"""DeepSpeed's launcher (`deepspeed`), run by this interpreter, with the variables it exports reaching MPI ranks as
they are.

    python -m launch.ds_runner ARGS      (what launch.run and launch.local_ranks start: `deepspeed ARGS`)

DeepSpeed's runner collects what every rank must get (.deepspeed_env, the NCCL_* / HCCL_* / PYTHON* variables) with
MultiNodeRunner.add_export, and its MPI runners hand each to mpirun as `-x KEY=VALUE`, one argument that no shell
reads. DeepSpeed 0.16 (Habana's fork) wraps every value in double quotes, which pdsh's shell strips but mpirun passes
on: each rank would see `DS_ACCELERATOR="cpu"` or `HCCL_SOCKET_IFNAME="eth0"`, quotes included, and DeepSpeed refuses
the first, HCCL finds no interface of the second's name. 0.19 quotes only a value a shell would split or expand.
Where the installed add_export quotes a plain value (ds_core.compat.deepspeed_behaviour.quotes_plain_exports), it
takes 0.19's rule before the runner starts (ds_core.compat.changes: mpi_exports_as_given); elsewhere DeepSpeed's
own runs. The module form also keeps the launcher on this interpreter (launch.local_ranks.deepspeed_launcher).
"""
from __future__ import annotations

import re
import sys
from typing import Callable

SHELL_SAFE = re.compile(r"[^\w@%+=:,./-]")  # DeepSpeed 0.19's test for a value that needs quotes


def add_export(self, key: str, var: str) -> None:
    """DeepSpeed 0.19's MultiNodeRunner.add_export: a value is quoted only where a shell would split or expand it."""
    var = var.strip()
    if SHELL_SAFE.search(var):
        var = f'"{var}"'
    self.exports[key.strip()] = var


add_export.ds_core_exports_as_given = True


def use_exports_as_given(say: Callable[[str], None] | None = None) -> bool:
    """MultiNodeRunner.add_export by 0.19's rule where the installed one quotes plain values; True if it is."""
    from deepspeed.launcher import multinode_runner

    from ds_core.compat.changes import BY_NAME, replace_attr

    if BY_NAME["mpi_exports_as_given"].not_needed() is not None:
        return False
    def ours(deepspeeds):
        add_export.deepspeeds = deepspeeds  # DeepSpeed's own, for the probe (deepspeed_behaviour)
        return add_export

    return replace_attr("mpi_exports_as_given", multinode_runner.MultiNodeRunner, "add_export",
                        "ds_core_exports_as_given", ours, say)


def main() -> None:
    use_exports_as_given(lambda line: print(line, file=sys.stderr, flush=True))
    from deepspeed.launcher.runner import main as runner_main

    runner_main()


if __name__ == "__main__":
    main()
