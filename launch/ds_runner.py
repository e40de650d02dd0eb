"""DeepSpeed's launcher (`deepspeed`), run by this interpreter, with the variables it exports reaching MPI ranks as
they are.

    python -m launch.ds_runner ARGS      (what launch.run and launch.local_ranks start: `deepspeed ARGS`)

DeepSpeed's runner collects what every rank must get (.deepspeed_env, the NCCL_* / HCCL_* / PYTHON* variables) with
MultiNodeRunner.add_export, and its MPI runners hand each to mpirun as `-x KEY=VALUE`, one argument that no shell
reads. DeepSpeed 0.16 (Habana's fork) wraps every value in double quotes, which pdsh's shell strips but mpirun passes
on: each rank would see `DS_ACCELERATOR="cpu"` or `HCCL_SOCKET_IFNAME="eth0"`, quotes included, and DeepSpeed refuses
the first, HCCL finds no interface of the second's name. 0.19 quotes only a value a shell would split or expand.
Where the installed add_export quotes a plain value (ds_core.compat.deepspeed_behaviour.quotes_plain_exports), it
takes 0.19's rule before the runner starts: the changes of stage "launcher" (ds_core.compat.changes:
mpi_exports_as_given, ds_core.compat.mpi_exports; DS_TOOLKIT_CHANGES=off leaves DeepSpeed's own). The module form
also keeps the launcher on this interpreter (launch.local_ranks.deepspeed_launcher).
"""
from __future__ import annotations


def main() -> None:
    from ds_core import log
    from ds_core.compat.changes import apply_stage

    apply_stage("launcher", say=lambda line: log.say(line, stderr=True))
    from deepspeed.launcher.runner import main as runner_main

    runner_main()


if __name__ == "__main__":
    main()
