"""`ds-scaling-report`: the report of measured runs (ds_tools.scaling), or `ds-scaling-report predict ...` (ds_tools
.predict). The dispatch lives here so that predict may use the report's readers without an import circle (a
subparser would clash with the report's list of runs); `python -m ds_tools.scaling` runs this module."""
from __future__ import annotations

import sys
from typing import Sequence

from ds_tools import predict, scaling


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["predict"]:
        return predict.main(argv[1:])
    return scaling.main(argv)


if __name__ == "__main__":
    sys.exit(main())
