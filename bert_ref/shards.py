"""The BERT shard layout (NVIDIA recipe) and its checks: listing, opening and validating h5 shards.

Shared by the loader (bert_ref.data, which re-exports these names) and `bert-prep check`; numpy and h5py only, so
`bert-prep` starts fast. The layout itself is described in bert_ref.data's docstring.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_core.errors import InputNotFound

# dataset name -> (dtype, rank); dims: input_* [N, L], masked_lm_* [N, P], next_sentence_labels [N]
SCHEMA: dict[str, tuple[np.dtype, int]] = {
    "input_ids": (np.dtype("int32"), 2),
    "input_mask": (np.dtype("int8"), 2),
    "segment_ids": (np.dtype("int8"), 2),
    "masked_lm_positions": (np.dtype("int32"), 2),
    "masked_lm_ids": (np.dtype("int32"), 2),
    "next_sentence_labels": (np.dtype("int8"), 1),
}
SEQ_DATASETS = ("input_ids", "input_mask", "segment_ids")
PRED_DATASETS = ("masked_lm_positions", "masked_lm_ids")
H5_SUFFIXES = (".hdf5", ".h5")
VOCAB_ATTR = "vocab_size"  # h5 file attribute written by `bert-prep shards`: ids are < this
_TEST_NAME = re.compile(r"(^|[_.-])test([_.-]|$)")


class DataDirError(InputNotFound):
    """The input directory is missing or holds no h5 shard."""


class ShardError(ValueError):
    """A shard is unusable; the message names the file and the dataset."""

    def __init__(self, path: str | os.PathLike, dataset: str | None, problem: str):
        self.path, self.dataset, self.problem = str(path), dataset, problem
        where = f"{self.path}" + (f" [dataset '{dataset}']" if dataset else "")
        super().__init__(f"bad BERT shard {where}: {problem}")



# ----------------------------------------------------------------------------------------------------- files
def list_shards(input_dir: str | os.PathLike, split: str = "training") -> list[str]:
    """Sorted h5 files of `input_dir`. If some names contain `split` ("training" / "test"), only those are taken
    (NVIDIA's loader selects 'training' the same way); otherwise all h5 files. Temporary files (".tmp") never count."""
    d = Path(input_dir)
    if not d.is_dir():
        raise DataDirError(f"BERT data directory not found: {d}")
    files = sorted(str(p) for p in d.iterdir()
                   if p.is_file() and p.suffix in H5_SUFFIXES and ".tmp" not in p.name)
    chosen = [f for f in files if split in Path(f).name] if split else []
    if not chosen and split == "training":  # unnamed training files: never train on the held-out test files
        chosen = [f for f in files if f not in list_test_shards(d, files)]
        if files and not chosen:  # `chosen or files` below would train (and then evaluate) on held-out data
            raise DataDirError(f"BERT data directory {d} holds only held-out test shards "
                               f"({', '.join(Path(f).name for f in files[:3])}{', ...' if len(files) > 3 else ''}): "
                               f"they are never trained on; give the directory of the training shards")
    files = chosen or files
    if not files:
        raise DataDirError(f"no h5 shards (*.hdf5, *.h5) in BERT data directory {d}")
    return files


def list_test_shards(input_dir: str | os.PathLike, files: list[str] | None = None) -> list[str]:
    """The held-out h5 files of `input_dir`: names with a `test` word (`bert_test_*` from `bert-prep shards
    --num_test_shards`, NVIDIA's `*_test_*`); [] when there are none."""
    files = list_shards(input_dir, split="") if files is None else files
    return [f for f in files if _TEST_NAME.search(Path(f).stem)]


@dataclass(frozen=True)
class ShardInfo:
    path: str
    num_samples: int
    seq_len: int
    max_predictions_per_seq: int
    vocab_size: int | None = None  # the file's `vocab_size` attribute (None: not written, e.g. NVIDIA's files)


def inspect_shard(path: str | os.PathLike, check_rows: int = 256, vocab_size: int | None = None) -> ShardInfo:
    """Cheap validation on open: every dataset present with the right dtype and rank, consistent lengths and widths,
    the file's `vocab_size` attribute (if any) not above `vocab_size` (the model's), and the first and last
    `check_rows` rows readable and in range (a truncated or corrupt file fails here, naming the file and dataset).
    Full content checks run on every block the loader reads, and `bert-prep check` reads all."""
    import h5py

    path = str(path)
    try:
        f = h5py.File(path, "r")
    except Exception as e:  # truncated files fail here ("truncated file: eof = ...")
        raise ShardError(path, None, f"cannot open as HDF5 ({type(e).__name__}: {e})") from e
    with f:
        shapes = {}
        for name, (dtype, ndim) in SCHEMA.items():
            if name not in f:
                raise ShardError(path, name, f"missing dataset (file has {sorted(f.keys())})")
            ds = f[name]
            if not isinstance(ds, h5py.Dataset):
                raise ShardError(path, name, "is a group, expected a dataset")
            if ds.dtype != dtype:
                raise ShardError(path, name, f"dtype {ds.dtype}, expected {dtype}")
            if ds.ndim != ndim:
                raise ShardError(path, name, f"shape {ds.shape}, expected {ndim} dimensions")
            shapes[name] = ds.shape
        n = shapes["input_ids"][0]
        for name, shape in shapes.items():
            if shape[0] != n:
                raise ShardError(path, name, f"{shape[0]} samples but input_ids has {n}")
        seq_len = shapes["input_ids"][1]
        for name in SEQ_DATASETS:
            if shapes[name][1] != seq_len:
                raise ShardError(path, name, f"shape {shapes[name]}, expected [{n}, {seq_len}] like input_ids")
        preds = shapes["masked_lm_positions"][1]
        if shapes["masked_lm_ids"][1] != preds:
            raise ShardError(path, "masked_lm_ids",
                             f"shape {shapes['masked_lm_ids']}, expected [{n}, {preds}] like masked_lm_positions")
        if n == 0:
            raise ShardError(path, "input_ids", "file holds 0 samples")
        if seq_len < 2 or preds < 1:
            raise ShardError(path, "input_ids", f"sequence length {seq_len} / predictions {preds} too small")
        attr = f.attrs.get(VOCAB_ATTR)
        if attr is not None:
            if np.ndim(attr) != 0 or not np.issubdtype(np.asarray(attr).dtype, np.integer) or int(attr) < 1:
                raise ShardError(path, None, f"attribute {VOCAB_ATTR}={attr!r}, expected a positive integer")
            attr = int(attr)
            if vocab_size is not None and attr > vocab_size:
                raise ShardError(path, None, f"written with a vocabulary of {attr} tokens (attribute {VOCAB_ATTR}) "
                                             f"but the model's vocab_size is {vocab_size}")
        bound = attr if attr is not None else vocab_size
        k = min(check_rows, n)
        for lo, hi in ((0, k), (n - k, n)):
            check_arrays(path, read_rows(path, f, lo, hi), seq_len, first_row=lo, vocab_size=bound)
    return ShardInfo(path, int(n), int(seq_len), int(preds), attr)


def inspect_shards(files: list[str], vocab_size: int | None = None) -> list[ShardInfo]:
    """inspect_shard for each file, and the files agree on seq_len and max_predictions_per_seq (training and test
    shards are read the same way)."""
    infos = [inspect_shard(p, vocab_size=vocab_size) for p in files]
    first = infos[0]
    for info in infos[1:]:
        for attr, ds in (("seq_len", "input_ids"), ("max_predictions_per_seq", "masked_lm_positions")):
            if getattr(info, attr) != getattr(first, attr):
                raise ShardError(info.path, ds, f"{attr} {getattr(info, attr)} differs from "
                                                f"{getattr(first, attr)} in {first.path}")
    return infos


def read_rows(path: str, f, lo: int, hi: int) -> dict[str, np.ndarray]:
    out = {}
    for name in SCHEMA:
        try:
            out[name] = f[name][lo:hi]
        except Exception as e:
            raise ShardError(path, name, f"cannot read samples {lo}:{hi} ({type(e).__name__}: {e}); "
                             "truncated or corrupt file?") from e
    return out


def check_arrays(path: str, a: dict[str, np.ndarray], seq_len: int, first_row: int = 0,
                 vocab_size: int | None = None) -> None:
    """Content checks on a slice of a shard (rows first_row..): token ids in [0, vocab_size) (only >= 0 when
    vocab_size is None), masks and labels 0/1, positions inside the sequence and not in its padding. Raises
    ShardError naming the file, dataset and first bad row. Fast path: one min/max pass per dataset; the row search
    runs only on a violation."""
    ids_hi, ids_what = ((None, "negative token ids") if vocab_size is None else
                        (vocab_size - 1, f"token ids out of the vocabulary [0, {vocab_size})"))
    # dataset -> (lowest allowed, highest allowed, what)
    bounds = {"masked_lm_positions": (0, seq_len - 1, f"positions out of range [0, {seq_len})"),
              "input_ids": (0, ids_hi, ids_what), "masked_lm_ids": (0, ids_hi, ids_what),
              "input_mask": (0, 1, "values other than 0/1"), "segment_ids": (0, 1, "values other than 0/1"),
              "next_sentence_labels": (0, 1, "values other than 0/1")}
    for name, (lo, hi, what) in bounds.items():
        x = a[name]
        if x.size == 0 or (x.min() >= lo and (hi is None or x.max() <= hi)):
            continue
        bad = (x < lo) | (x > hi) if hi is not None else x < lo
        rows = np.nonzero(bad.reshape(bad.shape[0], -1).any(axis=1))[0]
        raise ShardError(path, name, f"{what} (first at sample {first_row + int(rows[0])}, "
                                     f"{len(rows)} samples in rows {first_row}:{first_row + x.shape[0]})")
    check_masked_positions(path, a, first_row)


def check_masked_positions(path: str, a: dict[str, np.ndarray], first_row: int = 0) -> None:
    """Every masked position (a non-zero masked_lm_positions entry) is a real token (input_mask 1): a position in
    the padding would train the MLM head on a [PAD] input with a real label. `bert-prep check` tests more (order,
    [CLS], ...); this is the one check whose violation trains silently wrong. One gather of [N, P] mask values
    (positions are already range-checked): 35 ms per block of 262,144 samples x 20 positions on a Xeon core (of
    66 ms for all of check_arrays), in the loader's background thread."""
    pos, mask = a["masked_lm_positions"], a["input_mask"]
    if pos.size == 0:
        return
    bad = (pos > 0) & (np.take_along_axis(mask, pos.astype(np.intp, copy=False), axis=1) == 0)
    if bad.any():
        rows = np.nonzero(bad.any(axis=1))[0]
        r = int(rows[0])
        col = int(np.nonzero(bad[r])[0][0])
        raise ShardError(path, "masked_lm_positions",
                         f"masked position {int(pos[r, col])} lies in the padding (input_mask 0) (first at sample "
                         f"{first_row + r}, {len(rows)} samples in rows {first_row}:{first_row + pos.shape[0]})")
