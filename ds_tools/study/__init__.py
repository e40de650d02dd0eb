"""Studies in one command: a TOML study file names a training command and axes; `ds-study run` runs every cell
through the real launchers (launch.local_ranks), `ds-study report` writes the tables and charts.

    ds-study plan studies/bridgetower_dataloading.toml
    ds-study run studies/bridgetower_dataloading.toml [--out DIR] [--rerun]
    ds-study report runs/studies/bridgetower_dataloading [--from_table CELLS.csv]

The schema is documented in ds_tools/study/spec.py, a cell's plan (what it writes and runs) in ds_tools/study/plan.py,
the measuring rounds and the directory layout in ds_tools/study/runner.py.
"""
from ds_tools.study.spec import Cell, Study, StudyError, load_study

__all__ = ["Cell", "Study", "StudyError", "load_study"]
