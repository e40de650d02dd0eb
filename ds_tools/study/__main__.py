"""`ds-study` / `python -m ds_tools.study`: plan, run and report studies (see ds_tools/study/__init__.py)."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Sequence

from ds_core.cli import ArgumentParser, cli_main, flag
from ds_tools.scaling import ScalingError
from ds_tools.study import report as report_mod, runner
from ds_tools.study.spec import StudyError, load_study


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="ds-study", description=__doc__, allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("plan", "print the cells and their commands without running them"),
                        ("run", "run every cell not yet complete (resumable)")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("study", help="study file (TOML)")
        s.add_argument("--out", default=None, help="study directory (default runs/studies/<name>)")
        if name == "run":
            s.add_argument("--rerun", action="store_true", help="run complete cells again (earlier runs are moved "
                                                                 "to previous/, not deleted)")
            s.add_argument(*flag("--no_report"), action="store_true", help="do not write the report at the end")
    s = sub.add_parser("report", help="tables (Markdown, CSV, JSON) and PNG charts of a study directory")
    s.add_argument("study_dir", nargs="?", default=None, help="study directory written by `ds-study run`")
    s.add_argument(*flag("--from_table"), action="append", default=[], metavar="CSV",
                   help="already-measured cells (axis columns + samples_per_s, optional accelerators/source), or a "
                        "scaling table (nodes,accelerators,throughput); repeat for several")
    s.add_argument("--out", default=None, help="report directory (default STUDY_DIR/report)")
    return p


def _terminate(signum, frame) -> None:
    # SIGTERM (a batch system, `kill`): unwind like Ctrl-C so the running cell's process groups are killed too
    raise SystemExit(128 + signum)


def _main(args: argparse.Namespace) -> int:
    if args.cmd == "run" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    if args.cmd in ("plan", "run"):
        study = load_study(args.study)
        out = Path(args.out) if args.out else runner.default_out(study)
        if args.cmd == "plan":
            runner.plan(study, out)
            return 0
        counts = runner.run(study, out, rerun=args.rerun)
        if not args.no_report:
            res = report_mod.report(out)
            print(res["md"])
            print(f"[ds-study] report files: {', '.join(map(str, res['files']))}")
        return 0 if counts["failed"] == 0 else 1
    if not args.study_dir and not args.from_table:
        raise StudyError("report: give a study directory and/or --from_table CSV")
    study_dir = Path(args.study_dir) if args.study_dir else None
    if study_dir and not (study_dir / "study.toml").is_file():
        raise StudyError(f"{study_dir}: no study.toml (not a directory written by `ds-study run`)")
    res = report_mod.report(study_dir, args.from_table, Path(args.out) if args.out else None)
    print(res["md"])
    print(f"[ds-study] report files: {', '.join(map(str, res['files']))}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # OSError: a study file, table or directory the user named
    return cli_main(argv, build_parser, _main, (StudyError, ScalingError, OSError))


if __name__ == "__main__":
    sys.exit(main())
