"""BERT pretraining data: h5 shards (NVIDIA recipe layout) -> per-rank micro batches, with exact resume.

Each h5 file holds `input_ids` [N,L] int32, `input_mask` [N,L] int8, `segment_ids` [N,L] int8,
`masked_lm_positions` [N,P] int32 (0-padded), `masked_lm_ids` [N,P] int32, `next_sentence_labels` [N] int8.
Files written by NVIDIA's create_pretraining_data.py read unchanged; `bert-prep shards` writes the same layout plus
the h5 attribute `vocab_size` (the vocabulary the ids come from). Token ids (input_ids, masked_lm_ids) are checked
against that attribute, or, in files without it, against the model's vocabulary: the attribute is compared with the
model's vocabulary when a file is opened, and the ids of every block when it is read, before any of its samples is
trained on (`bert-prep check DIR` reads every row up front).

Which files: the training files are those whose names contain `training` (NVIDIA's loader selects them the same
way), else every `*.hdf5` / `*.h5`; names with a `test` word (`bert_test_*`, from `bert-prep shards --num-test-shards`)
are held out, never trained on, and read by `bert_ref/eval.py`. A missing or empty directory raises `DataDirError`.

How an epoch is laid out (all pure functions of the sorted file list, file sizes, world size, epoch and seed, so every
rank computes every rank's plan without talking to the others):
  * `assign_shards`: the files are shuffled with (seed, epoch). The first `n - n % world_size` are dealt round-robin,
    whole, to the ranks (distinct files per rank). The remaining `n % world_size` files are shared: every rank reads
    its own 1/world_size sample range of each. So with more ranks than files every file is split by sample ranges and
    every rank still gets data.
  * each rank's file ranges are cut into blocks of at most `block_samples` samples (default 262,144); a block is read
    with one h5 slice per dataset, held in memory and visited in a seeded random order (NVIDIA's recipe shuffles
    within a file too). The next block, across files and into the next epoch, is read by a background thread (on every
    accelerator type) while the current one is consumed. Batches are gathered with one vectorized take per dataset,
    and MLM labels are built with one scatter: `IGNORE_INDEX = -100` everywhere except the masked positions, because
    -100 is the default `ignore_index` of `torch.nn.CrossEntropyLoss` and what transformers' `BertForPreTraining`
    expects (NVIDIA's recipe used -1 with a custom loss).
  * every rank yields the same number of batches per epoch, `min over ranks (samples_r // micro_batch)`; the tail is
    dropped so no rank waits in a collective for a rank that has run out.

Resume: the position is (epoch, samples consumed on this rank in the epoch). Since all ranks consume the same number
of batches, the position is the same on every rank and maps, through the pure plan, to (file, block, offset). Resuming
reads exactly one block (h5 slicing at the block start) and starts at the offset: the cost does not grow with the
position and no skipped batch is ever built. The checkpoint's client state also holds a fingerprint of the files,
the world size and the seed: a resume under a different world size, seed or set of files is refused with a message
naming both values.

Checks: every file is opened and checked for missing datasets, wrong dtype or shape, datasets of different lengths
and a sequence length that differs between files; its first and last 256 rows are read (a truncated or corrupt file
fails here) and range-checked. Every block read later is range-checked completely (positions, masks, labels, token
ids) before any of its samples is trained on. Errors are `ShardError`s naming the file, the dataset and the first bad
sample.
"""
from __future__ import annotations

import bisect
import hashlib
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

# torch is imported where batches are built, so `bert-prep` (which shares the layout checks) starts fast
if TYPE_CHECKING:
    import torch

# Label value for every position that is not a masked token. -100 is the default `ignore_index` of
# torch.nn.CrossEntropyLoss and what transformers' BertForPreTraining expects, so labels go straight into the HF model
# or a plain cross entropy without a custom loss. (NVIDIA's recipe used -1 with `ignore_index=-1`; we don't.)
IGNORE_INDEX = -100

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
DEFAULT_BLOCK_SAMPLES = 1 << 18  # 262144 samples of seq 128 ~ 250 MB in memory; at most two blocks are held


class DataDirError(FileNotFoundError):
    """The input directory is missing or holds no h5 shard."""


class ShardError(ValueError):
    """A shard is unusable; the message names the file and the dataset."""

    def __init__(self, path: str | os.PathLike, dataset: str | None, problem: str):
        self.path, self.dataset, self.problem = str(path), dataset, problem
        where = f"{self.path}" + (f" [dataset '{dataset}']" if dataset else "")
        super().__init__(f"bad BERT shard {where}: {problem}")


class DataStateError(ValueError):
    """A saved data position does not fit this dataset / world size."""


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
    files = chosen or files
    if not files:
        raise DataDirError(f"no h5 shards (*.hdf5, *.h5) in BERT data directory {d}")
    return files


def list_test_shards(input_dir: str | os.PathLike, files: list[str] | None = None) -> list[str]:
    """The held-out h5 files of `input_dir`: names with a `test` word (`bert_test_*` from `bert-prep shards
    --num-test-shards`, NVIDIA's `*_test_*`); [] when there are none."""
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
            check_arrays(path, _read(path, f, lo, hi), seq_len, first_row=lo, vocab_size=bound)
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

def _read(path: str, f, lo: int, hi: int) -> dict[str, np.ndarray]:
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
    vocab_size is None), masks and labels 0/1, positions inside the sequence. Raises ShardError naming the file,
    dataset and first bad row. Fast path: one min/max pass per dataset; the row search runs only on a violation."""
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


# ---------------------------------------------------------------------------------------------- pure planning
def epoch_file_order(files: list[str], epoch: int, seed: int) -> list[str]:
    """The files sorted, then shuffled with (seed, epoch): the same on every rank."""
    order = sorted(files)
    perm = np.random.default_rng([seed, epoch, 0x5EED]).permutation(len(order))
    return [order[i] for i in perm]


def assign_shards(files: list[str], rank: int, world_size: int, epoch: int, seed: int) -> list[str]:
    """Files `rank` reads in `epoch`, in reading order (pure). Whole files are dealt round-robin (distinct per rank);
    the last `len(files) % world_size` files of the epoch order are shared, each rank reading its own 1/world_size
    sample range of them (see `plan_segments`), so more ranks than files still gives every rank data."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
    order = epoch_file_order(files, epoch, seed)
    n_whole = len(order) - len(order) % world_size
    return order[rank:n_whole:world_size] + order[n_whole:]


@dataclass(frozen=True)
class Segment:
    path: str
    start: int  # sample range [start, stop) of the file
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def plan_segments(sizes: dict[str, int], rank: int, world_size: int, epoch: int, seed: int,
                  block_samples: int = DEFAULT_BLOCK_SAMPLES) -> list[Segment]:
    """Blocks (file, sample range) that `rank` reads in `epoch`, in order: whole files, then its share of the shared
    files; each range cut into equal blocks of at most `block_samples`."""
    files = list(sizes)
    order = epoch_file_order(files, epoch, seed)
    n_whole = len(order) - len(order) % world_size
    shared = set(order[n_whole:])
    out: list[Segment] = []
    for path in assign_shards(files, rank, world_size, epoch, seed):
        n = sizes[path]
        lo, hi = (n * rank // world_size, n * (rank + 1) // world_size) if path in shared else (0, n)
        nblocks = max(1, -(-(hi - lo) // block_samples))
        for b in range(nblocks):
            s, e = lo + (hi - lo) * b // nblocks, lo + (hi - lo) * (b + 1) // nblocks
            if e > s:
                out.append(Segment(path, s, e))
    return out


def batches_per_epoch(sizes: dict[str, int], world_size: int, epoch: int, seed: int, micro_batch: int) -> int:
    """Batches every rank yields in `epoch`: the smallest rank's sample count // micro_batch (tails dropped).
    Vectorized over ranks (the same numbers as summing `plan_segments` for every rank, without building them)."""
    order = epoch_file_order(list(sizes), epoch, seed)
    n = np.array([sizes[p] for p in order], dtype=np.int64)
    n_whole = len(n) - len(n) % world_size
    per_rank = n[:n_whole].reshape(-1, world_size).sum(axis=0) if n_whole else np.zeros(world_size, np.int64)
    r = np.arange(world_size + 1)
    for m in n[n_whole:]:  # shared files: rank r reads [m*r//w, m*(r+1)//w)
        per_rank = per_rank + np.diff(m * r // world_size)
    return int(per_rank.min()) // micro_batch


def block_permutation(seg: Segment, epoch: int, seed: int) -> np.ndarray:
    """Visiting order of a block's samples; depends only on (seed, epoch, file name, block range)."""
    name_key = int.from_bytes(hashlib.sha1(Path(seg.path).name.encode()).digest()[:4], "little")
    return np.random.default_rng([seed, epoch, name_key, seg.start, seg.stop]).permutation(seg.size)


# --------------------------------------------------------------------------------------------- batch building
def load_block(seg: Segment, seq_len: int, vocab_size: int | None = None) -> dict[str, np.ndarray]:
    """One h5 slice per dataset for the block's sample range, content-checked (ids < vocab_size when given)."""
    import h5py

    try:
        f = h5py.File(seg.path, "r")
    except Exception as e:
        raise ShardError(seg.path, None, f"cannot open as HDF5 ({type(e).__name__}: {e})") from e
    with f:
        arrays = _read(seg.path, f, seg.start, seg.stop)
    check_arrays(seg.path, arrays, seq_len, first_row=seg.start, vocab_size=vocab_size)
    return arrays


def make_batch(arrays: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, torch.Tensor]:
    """Gather rows `idx` of a block into a batch of int64 CPU tensors, MLM labels built with one scatter.

    masked_lm_positions is 0-padded: position 0 is [CLS] and is never masked, so a 0 entry is padding (NVIDIA's
    loader reads the same convention). Every pair (row, position) is written at once; padding entries write
    IGNORE_INDEX onto position 0, which holds IGNORE_INDEX anyway."""
    import torch

    ids = np.take(arrays["input_ids"], idx, axis=0)
    pos = np.take(arrays["masked_lm_positions"], idx, axis=0)
    mlm = np.take(arrays["masked_lm_ids"], idx, axis=0)
    labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
    rows = np.arange(len(idx))[:, None]
    labels[rows, pos] = np.where(pos > 0, mlm, IGNORE_INDEX)
    return {
        "input_ids": torch.from_numpy(ids.astype(np.int64)),
        "token_type_ids": torch.from_numpy(np.take(arrays["segment_ids"], idx, axis=0).astype(np.int64)),
        "attention_mask": torch.from_numpy(np.take(arrays["input_mask"], idx, axis=0).astype(np.int64)),
        "labels": torch.from_numpy(labels),
        "next_sentence_label": torch.from_numpy(np.take(arrays["next_sentence_labels"], idx).astype(np.int64)),
    }


def _concat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    import torch

    return parts[0] if len(parts) == 1 else {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def files_fingerprint(sizes: dict[str, int]) -> str:
    """Identifies the dataset (file names and sample counts) so a resume against different data fails loudly."""
    h = hashlib.sha1()
    for path in sorted(sizes):
        h.update(f"{Path(path).name}:{sizes[path]};".encode())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ the source
class PretrainingData:
    """Per-rank BERT pretraining batches (implements ds_core.loop.DataSource).

    Yields dicts of int64 CPU tensors: input_ids, token_type_ids, attention_mask, labels [B, L] and
    next_sentence_label [B]. Every rank yields `len(self)` batches per epoch.

    vocab_size: the model's vocabulary; ids are checked against each file's `vocab_size` attribute when it has one
    (which must not exceed the model's) and against this otherwise (None: only ids >= 0 are checked)."""

    def __init__(self, input_dir: str | os.PathLike, rank: int, world_size: int, micro_batch: int, seed: int = 42,
                 prefetch: bool = True, block_samples: int = DEFAULT_BLOCK_SAMPLES, split: str = "training",
                 vocab_size: int | None = None):
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        self.input_dir, self.rank, self.world_size = str(input_dir), rank, world_size
        self.micro_batch, self.seed, self.prefetch, self.block_samples = micro_batch, seed, prefetch, block_samples
        self.files = list_shards(input_dir, split)
        infos = inspect_shards(self.files, vocab_size)
        first = infos[0]
        self.seq_len: int = first.seq_len
        self.max_predictions_per_seq: int = first.max_predictions_per_seq
        self.sizes = {i.path: i.num_samples for i in infos}
        # the bound every block read checks ids against: the file's own vocabulary, else the model's
        self.id_bounds = {i.path: i.vocab_size if i.vocab_size is not None else vocab_size for i in infos}
        stored = [i.vocab_size for i in infos if i.vocab_size is not None]
        self.vocab_size: int | None = max(stored) if stored else None  # as written with the shards
        self.num_samples = sum(self.sizes.values())
        self.fingerprint = files_fingerprint(self.sizes)
        self.epoch = 0
        self.samples_done = 0  # samples consumed on this rank in self.epoch (same on every rank)
        self._plans: dict[int, tuple[list[Segment], list[int], int]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._cache: dict[tuple, Future] = {}
        self._current: tuple | None = None
        self._lock = threading.Lock()
        if len(self) == 0:
            raise DataDirError(f"{self.input_dir}: {self.num_samples} samples in {len(self.files)} files give rank "
                               f"{rank} of {world_size} no full micro batch of {micro_batch}")

    # -- plan
    def _plan(self, epoch: int) -> tuple[list[Segment], list[int], int]:
        """(blocks, cumulative start sample of each block, batches in the epoch) for this rank."""
        if epoch not in self._plans:
            segs = plan_segments(self.sizes, self.rank, self.world_size, epoch, self.seed, self.block_samples)
            starts = np.cumsum([0] + [s.size for s in segs[:-1]]).tolist()
            nb = batches_per_epoch(self.sizes, self.world_size, epoch, self.seed, self.micro_batch)
            self._plans = {k: v for k, v in self._plans.items() if k >= epoch - 1}
            self._plans[epoch] = (segs, starts, nb)
        return self._plans[epoch]

    def __len__(self) -> int:
        return self._plan(self.epoch)[2]

    # -- block loading with one block of read-ahead
    def _get(self, seg: Segment, epoch: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        key = (seg, epoch)
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                fut = self._submit(seg, epoch)
            if key != self._current:
                # moving to a new block: drop the old one and any stale read-ahead; memory stays at ~2 blocks
                self._cache, self._current = {key: fut}, key
        return fut.result()

    def _submit(self, seg: Segment, epoch: int) -> Future:
        def work():
            return load_block(seg, self.seq_len, self.id_bounds[seg.path]), block_permutation(seg, epoch, self.seed)

        if not self.prefetch:
            fut: Future = Future()
            try:
                fut.set_result(work())
            except BaseException as e:  # surfaced by .result() in the consumer, like the threaded path
                fut.set_exception(e)
            return fut
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bert-h5-prefetch")
        return self._pool.submit(work)

    def _prefetch(self, seg: Segment, epoch: int) -> None:
        if not self.prefetch:
            return
        with self._lock:
            if (seg, epoch) not in self._cache:
                self._cache[(seg, epoch)] = self._submit(seg, epoch)

    def _next_block(self, epoch: int, block: int) -> tuple[Segment, int] | None:
        segs = self._plan(epoch)[0]
        if block + 1 < len(segs):
            return segs[block + 1], epoch
        return self._plan(epoch + 1)[0][0], epoch + 1  # first block of the next epoch

    # -- DataSource
    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.samples_done = int(epoch), 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch, B = self.epoch, self.micro_batch
        segs, starts, nb = self._plan(epoch)
        end = nb * B
        while self.samples_done < end and self.epoch == epoch:
            s = self.samples_done
            parts, need = [], B
            while need:
                b = bisect.bisect_right(starts, s) - 1
                seg = segs[b]
                arrays, perm = self._get(seg, epoch)
                nxt = self._next_block(epoch, b)
                if nxt is not None:
                    self._prefetch(*nxt)
                off = s - starts[b]
                take = min(need, seg.size - off)
                parts.append(make_batch(arrays, perm[off:off + take]))
                s, need = s + take, need - take
            self.samples_done = s
            yield _concat(parts)

    def position(self) -> dict:
        """Where the next batch starts on this rank: file, block and offset (for logs and the checkpoint)."""
        segs, starts, nb = self._plan(self.epoch)
        s = self.samples_done
        if s >= nb * self.micro_batch:
            return {"file": None, "range_start": None, "block_start": None, "offset_in_block": None,
                    "offset_in_range": None}
        b = bisect.bisect_right(starts, s) - 1
        first = b  # first block of this file's range: the offset in the range counts from there
        while first > 0 and segs[first - 1].path == segs[b].path and segs[first - 1].stop == segs[first].start:
            first -= 1
        return {"file": Path(segs[b].path).name, "range_start": segs[first].start, "block_start": segs[b].start,
                "offset_in_block": s - starts[b], "offset_in_range": s - starts[first]}

    def state_dict(self) -> dict:
        """JSON-able position after the last yielded batch. `samples` (consumed in `epoch`) is what a resume uses and
        is the same on every rank; file order / file / offsets are this rank's view of it, for people and logs."""
        files = [Path(p).name for p in assign_shards(self.files, self.rank, self.world_size, self.epoch, self.seed)]
        return {"version": 1, "epoch": self.epoch, "samples": self.samples_done,
                "batches": self.samples_done // self.micro_batch, "micro_batch": self.micro_batch,
                "world_size": self.world_size, "rank": self.rank, "seed": self.seed,
                "fingerprint": self.fingerprint, "file_order": files, **self.position()}

    def load_state_dict(self, state: dict) -> None:
        """Seek to a saved position. The position is the same on every rank, so any rank's state fits any rank."""
        for key, mine in (("fingerprint", self.fingerprint), ("world_size", self.world_size), ("seed", self.seed)):
            if state.get(key) != mine:
                raise DataStateError(
                    f"saved data position has {key}={state.get(key)!r} but this run has {mine!r} "
                    f"({self.input_dir}); exact resume needs the same shards, world size and data seed")
        epoch, samples = int(state["epoch"]), int(state["samples"])
        if samples < 0 or epoch < 0:
            raise DataStateError(f"saved data position epoch {epoch}, sample {samples} is invalid")
        # positions are in samples, so a changed micro batch still resumes at the same sample (clamped: an epoch
        # that ended under the old micro batch stays ended)
        end = self._plan(epoch)[2] * self.micro_batch
        self.epoch, self.samples_done = epoch, min(samples, end)
        if self.samples_done < end:  # start reading the block we resume in right away
            segs, starts, _ = self._plan(epoch)
            self._prefetch(segs[bisect.bisect_right(starts, self.samples_done) - 1], epoch)

    shared_summary_stats = ("data_files", "data_samples")  # the whole set, the same on every rank: not summed

    def summary_stats(self) -> dict:
        return {"data_files": len(self.files), "data_samples": self.num_samples}

    def close(self, wait: bool = False) -> None:
        """Drop the blocks held and stop the prefetch thread (`wait`: until a read in progress has finished)."""
        with self._lock:
            self._cache, self._current = {}, None
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=True)
            self._pool = None

    def __del__(self):  # the prefetch thread must not keep the interpreter alive
        try:
            self.close()
        except Exception:
            pass


def build_data(input_dir: str | os.PathLike, rank: int, world_size: int, micro_batch: int,
               seed: int = 42, **kwargs) -> PretrainingData:
    """The loader for `input_dir`; DataDirError (a FileNotFoundError) if the directory is missing or has no shard."""
    if not input_dir or not Path(input_dir).is_dir():
        raise DataDirError(f"BERT data directory not found: {input_dir!r} (make one with `bert-prep shards`)")
    return PretrainingData(input_dir, rank, world_size, micro_batch, seed=seed, **kwargs)
