"""How the splits of a BridgeTower run are made from what the dataset has (pure functions over row numbers and
caption tables; bridgetower_ds.data.Splits applies them): missing splits carved as run_bridgetower.py does or by
fractions, --max_*_samples, rows without a caption, and the check that the dataset exists before any rank starts."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ds_core.errors import ConfigError, InputNotFound

if TYPE_CHECKING:
    from .configs import DataArgs
    from .table import CaptionTable


def carve_splits(n: int, need_val: bool, need_test: bool, val_fraction: float, test_fraction: float,
                 seed: int) -> dict[str, np.ndarray]:
    """Deterministic rows of train/validation/test out of n training rows (only the missing ones are carved)."""
    perm = np.random.default_rng(seed).permutation(n)
    n_test = int(round(n * test_fraction)) if need_test else 0
    n_val = int(round(n * val_fraction)) if need_val else 0
    if need_test and n_test == 0 and test_fraction > 0 and n >= 3:  # tiny data: still one row per asked-for split
        n_test = 1
    if need_val and n_val == 0 and val_fraction > 0 and n >= 3:
        n_val = 1
    return {"test": perm[:n_test], "validation": perm[n_test:n_test + n_val], "train": perm[n_test + n_val:]}


def run_bridgetower_splits(n: int, need_val: bool, seed: int) -> dict[str, np.ndarray]:
    """Rows of train / test (/ validation) exactly as run_bridgetower.py carves a dataset without a test split:
    `train_test_split(test_size=0.4, shuffle=True, seed=seed)`, then, without a validation split, the held-out part
    `train_test_split(test_size=0.5, shuffle=False)` -> validation (its first half) and test. datasets itself does
    the arithmetic (ceil/floor of the sizes, numpy's default_rng permutation), on a column of row numbers; the rows
    keep datasets' order (train is in permuted order, so --max_train_samples picks the same rows as the script)."""
    import datasets

    try:
        parts = datasets.Dataset.from_dict({"row": np.arange(n, dtype=np.int64)}).train_test_split(
            test_size=0.4, shuffle=True, seed=seed)
        out = {"train": np.asarray(parts["train"]["row"]), "test": np.asarray(parts["test"]["row"])}
        if need_val:
            buf = parts["test"].train_test_split(test_size=0.5, shuffle=False)
            out["validation"], out["test"] = np.asarray(buf["train"]["row"]), np.asarray(buf["test"]["row"])
    except ValueError as e:  # too few rows for a split: datasets says which sizes
        raise ValueError(f"{n} training rows cannot be split as run_bridgetower.py does (40 % held out, halved): "
                         f"{e}") from None
    return out


def take_rows(table: CaptionTable, rows: Sequence[int], source: str) -> CaptionTable:
    """The rows of `table` in the given order (CaptionTable.subset sorts them)."""
    rows = np.asarray(rows, dtype=np.int64)
    imgs = table.images.select(rows) if hasattr(table.images, "select") else [table.images[int(i)] for i in rows]
    return type(table)(imgs, [table.captions[int(i)] for i in rows], table.base_dir, source)


def drop_bad_captions(table: CaptionTable) -> tuple[CaptionTable, list[str]]:
    """The table without rows whose caption is empty, blank, null or missing (None/[] arrive here as ""), and the
    names of those rows. Skipped rather than refused: one bad row of a large caption set should not stop a run, and
    the count is reported (bad_captions); trained as-is it would be the caption "<s></s>"."""
    bad = [i for i, c in enumerate(table.captions) if not c.strip()]
    if not bad:
        return table, []
    names = [table.name(i) if table.path(i) is None else f"{table.source}[row {i}] ({table.name(i)})" for i in bad]
    skip = set(bad)
    return take_rows(table, [i for i in range(len(table)) if i not in skip], table.source), names


def check_dataset(args: DataArgs) -> None:
    """Before distributed init (and before any rank builds a model): the dataset exists, i.e. a --dataset_name /
    --dataset_config_name is in the offline datasets cache and a --dataset_path exists. Raises naming it."""
    args.validate()
    if args.dataset_name:
        if args.dataset_path:
            raise ConfigError(f"--dataset_name {args.dataset_name} and --dataset_path {args.dataset_path}: give one")
        from .hub import load_cached_dataset

        load_cached_dataset(args.dataset_name, args.dataset_config_name)  # memory-mapped: cheap to open twice
    elif not args.dataset_path:
        raise ConfigError("--dataset_path (or --dataset_name) is required")
    elif not Path(args.dataset_path).expanduser().exists():
        raise InputNotFound(f"--dataset_path {args.dataset_path} does not exist")


def limit_rows(args: DataArgs, split: str, table: CaptionTable) -> CaptionTable:
    """The first --max_{train,eval,predict}_samples rows of a split (transformers' scripts: select(range(N)))."""
    names = {"train": args.train_split, "validation": args.validation_split, "test": args.test_split}
    role = split if split in names else next((r for r, n in names.items() if n == split), split)
    limit = {"train": args.max_train_samples, "validation": args.max_eval_samples,
             "test": args.max_predict_samples}.get(role, 0)
    if not limit or limit >= len(table):
        return table
    return table.subset(np.arange(limit), f"{table.source}[:{limit}]")
