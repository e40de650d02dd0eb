"""`ds-scaling-report`: the report of measured runs (ds_tools.scaling), or `ds-scaling-report predict ...` (ds_tools
.predict). ds_tools.scaling.main dispatches both, so that `python -m ds_tools.scaling predict ...` works as the
console script does; this module is the console script's entry."""
from __future__ import annotations

import sys
from typing import Sequence

from ds_tools import scaling


def main(argv: Sequence[str] | None = None) -> int:
    return scaling.main(argv)


if __name__ == "__main__":
    sys.exit(main())
