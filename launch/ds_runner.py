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
also keeps the launcher on this interpreter (launch.local_ranks.deepspeed_launcher). Under pdsh the same stage
quotes every word of the remote command (pdsh_remote_quoted, ds_core.compat.pdsh_quoting).

The runner logs the command it starts (`cmd = ...`), exported values included: the values of secret-looking
variables (ds_core.redact) of this environment and of the .deepspeed_env files are replaced by <redacted> in every
line DeepSpeed's logger writes here.
"""
from __future__ import annotations

import logging
import os


class RedactSecrets(logging.Filter):
    """Replaces each of `values` in a log record's message by ds_core.redact.REDACTED."""

    def __init__(self, values: list[str]):
        super().__init__()
        self.values = values

    def filter(self, record: logging.LogRecord) -> bool:
        from ds_core.redact import redact_text

        record.msg, record.args = redact_text(record.getMessage(), self.values), ()
        return True


def secret_values() -> list[str]:
    """The values of the secret-looking variables DeepSpeed's runner may log: this environment's and the
    .deepspeed_env files' it reads."""
    from ds_core.redact import is_secret
    from launch.env import EnvFileError, load_deepspeed_env

    try:
        files = load_deepspeed_env()
    except EnvFileError:
        files = {}  # DeepSpeed reads (and fails on) the file itself
    return [v for n, v in {**os.environ, **files}.items() if is_secret(n) and v]


def main() -> None:
    from ds_core import log
    from ds_core.compat.changes import apply_stage

    apply_stage("launcher", say=lambda line: log.say(line, stderr=True))
    from deepspeed.launcher.runner import main as runner_main
    from deepspeed.utils import logger

    logger.addFilter(RedactSecrets(secret_values()))
    runner_main()


if __name__ == "__main__":
    main()
