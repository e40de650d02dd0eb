"""Writing h5 shards in the NVIDIA BERT layout, atomically; plus a generator of valid synthetic arrays."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from bert_ref.shards import SCHEMA, VOCAB_ATTR


def tmp_name(path: str | os.PathLike) -> Path:
    """Temporary name next to `path`; the loader and `check` ignore names containing '.tmp'."""
    p = Path(path)
    return p.with_name(f"{p.name}.tmp{os.getpid()}")


def atomic_replace(tmp: Path, final: str | os.PathLike) -> None:
    """fsync then rename, so a crash leaves either no output or a complete one, never a partial file."""
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)


def write_shard(path: str | os.PathLike, arrays: dict[str, np.ndarray], compression: str | None = "gzip",
                vocab_size: int | None = None) -> None:
    """Write the six datasets (cast to the layout's dtypes) to a temporary name, then rename to `path`. vocab_size:
    stored as the file attribute bert_ref.data.VOCAB_ATTR, which the loader checks every id against."""
    import h5py

    tmp = tmp_name(path)
    try:
        with h5py.File(tmp, "w") as f:
            if vocab_size is not None:
                f.attrs[VOCAB_ATTR] = np.int64(vocab_size)
            for name, (dtype, _) in SCHEMA.items():
                a = np.asarray(arrays[name]).astype(dtype, copy=False)
                # chunks of whole rows (~256 KiB): the loader reads sample ranges, and h5py's automatic chunking
                # for compressed data cuts columns too, which makes such reads touch many more, smaller chunks
                row_bytes = max(1, a[:1].nbytes)
                chunks = (max(1, min(len(a), (256 << 10) // row_bytes)), *a.shape[1:]) if a.size else None
                f.create_dataset(name, data=a, dtype=dtype, chunks=chunks if compression else None,
                                 compression=compression if a.size else None)
        atomic_replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def synthetic_arrays(n: int, seq_len: int = 128, max_pred: int = 20, vocab_size: int = 30522,
                     seed: int = 0) -> dict[str, np.ndarray]:
    """Valid random samples in the layout (for tests and benchmarks): [CLS] a [SEP] b [SEP] then padding, up to
    max_pred sorted masked positions among the real tokens, NSP labels 0/1. Vectorized; ~1 s per 200k samples."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(8, seq_len // 4), seq_len + 1, size=n)
    col = np.arange(seq_len)[None, :]
    real = col < lengths[:, None]
    ids = rng.integers(104, vocab_size, size=(n, seq_len), dtype=np.int32)
    a_len = np.maximum(1, (lengths - 3) // 2)
    sep1 = a_len + 1
    ids[:, 0] = 101  # [CLS]
    ids[np.arange(n), sep1] = 102  # [SEP]
    ids[np.arange(n), lengths - 1] = 102
    ids[~real] = 0
    segment = ((col > sep1[:, None]) & real).astype(np.int8)
    # masked positions: a random subset of the non-special real positions, sorted, 0-padded
    score = rng.random((n, seq_len))
    special = (col == 0) | (col == sep1[:, None]) | (col == (lengths - 1)[:, None]) | ~real
    score[special] = 2.0
    npred = np.minimum(max_pred, np.maximum(1, np.round((lengths - 3) * 0.15))).astype(np.int64)
    keep = np.arange(max_pred)[None, :] < npred[:, None]
    chosen = np.argsort(score, axis=1)[:, :max_pred]  # smallest scores = random non-special positions
    chosen = np.where(keep, chosen, seq_len)  # push unused to the end, then sort
    chosen.sort(axis=1)
    pos = np.where(chosen < seq_len, chosen, 0).astype(np.int32)
    mlm_ids = np.where(pos > 0, np.take_along_axis(ids, pos, axis=1), 0).astype(np.int32)
    ids[np.arange(n)[:, None], pos] = np.where(pos > 0, 103, ids[np.arange(n)[:, None], pos])  # [MASK]
    ids[:, 0] = 101
    return {
        "input_ids": ids,
        "input_mask": real.astype(np.int8),
        "segment_ids": segment,
        "masked_lm_positions": pos,
        "masked_lm_ids": mlm_ids,
        "next_sentence_labels": rng.integers(0, 2, size=n, dtype=np.int8),
    }
