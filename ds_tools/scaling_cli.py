"""`ds-scaling-report`: the report of measured runs (ds_tools.scaling), or `ds-scaling-report predict ...` (ds_tools
.predict). The dispatch lives here so that predict may use the report's readers without an import circle (a
subparser would clash with the report's list of runs); `python -m ds_tools.scaling` runs this module. For the same
reason `--help` is the report's, with the predict form added to its usage and epilog here."""
from __future__ import annotations

import sys
from typing import Sequence

from ds_tools import predict, scaling

PREDICT_USAGE = "ds-scaling-report predict (--from RUN_DIR | --measured SEQ_PER_S ...) --fabric NAME --nodes N ..."


def _help() -> int:
    p = scaling.build_parser()
    usage = p.format_usage().strip()
    p.usage = usage[len("usage: "):] + "\n       " + PREDICT_USAGE
    p.epilog = ("predict: throughput and scaling efficiency at N nodes, each with its range, from one measured run "
                "(its metrics.jsonl, or --measured) and a fabric profile; `ds-scaling-report predict --help` lists "
                "its flags (ds_tools/predict.py, docs/studies.md).")
    p.print_help()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["predict"]:
        return predict.main(argv[1:])
    if "-h" in argv or "--help" in argv:
        return _help()
    return scaling.main(argv)


if __name__ == "__main__":
    sys.exit(main())
