"""`python -m ds_tools.build_ops` (the last step of `make setup`): DeepSpeed's compiled ops that this toolkit's runs
load on the accelerator DeepSpeed finds, built once into the op cache the runs use (TORCH_EXTENSIONS_DIR, under the
venv), so that the first run does not spend minutes compiling them inside its start. On a CPU: the shared-memory
collectives (~1 min on 2 cores) and FusedAdam (~2 min); on CUDA: FusedAdam (nvcc). An op that cannot be built is
said in one line and is no failure: the runs that need it take torch's optimizer and say why
(ds_core.device.ops_check). `make setup BUILD_OPS=0` leaves the builds to the first run."""
from __future__ import annotations

import sys
from typing import Sequence

from ds_core.cli import ArgumentParser


def main(argv: Sequence[str] | None = None) -> int:
    ArgumentParser(prog="python -m ds_tools.build_ops", description=__doc__, allow_abbrev=False).parse_args(argv)
    from ds_core.compat.changes import apply_change
    from ds_core.device.ops_check import build_ahead

    apply_change("op_build_lock_holder")  # as a rank does: a lock left by a killed build does not stop this one
    build_ahead()
    return 0


if __name__ == "__main__":
    sys.exit(main())
