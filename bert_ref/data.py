"""BERT pretraining data: h5 shards (NVIDIA recipe layout) -> per-rank micro batches, with exact resume.

Each h5 file holds `input_ids` [N,L] int32, `input_mask` [N,L] int8, `segment_ids` [N,L] int8,
`masked_lm_positions` [N,P] int32 (0-padded), `masked_lm_ids` [N,P] int32, `next_sentence_labels` [N] int8.
Files written by NVIDIA's create_pretraining_data.py read unchanged; `bert-prep shards` writes the same layout plus
the h5 attribute `vocab_size` (the vocabulary the ids come from). Token ids (input_ids, masked_lm_ids) are checked
against that attribute, or, in files without it, against the model's vocabulary: the attribute is compared with the
model's vocabulary when a file is opened, and the ids of every block when it is read, before any of its samples is
trained on (`bert-prep check DIR` reads every row up front).

Which files: the training files are those whose names contain `training` (NVIDIA's loader selects them the same
way), else every `*.hdf5` / `*.h5`; names with a `test` word (`bert_test_*`, from `bert-prep shards --num_test_shards`)
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
position and no skipped batch is ever built. The checkpoint's client state also holds a fingerprint of the files
and the seed: a resume under a different seed or set of files is refused with a message naming both values.

Checks (bert_ref.shards): every file is opened and checked for missing datasets, wrong dtype or shape, datasets of
different lengths and a sequence length that differs between files; its first and last 256 rows are read (a truncated
or corrupt file fails here) and range-checked. Every block read later is range-checked completely (positions, masks,
labels, token ids, no masked position in the padding) before any of its samples is trained on. Errors are `ShardError`s
naming the file, the dataset and the first bad sample.

Resume on another world size (`load_state_dicts`, given the saved states of ALL ranks): the samples consumed so far
are a pure function of the old plan and the per-rank counts, so the rest of the epoch is computed from them and dealt
to the new ranks in consecutive ranges of blocks (bert_ref.data_resize: the pool, the deal, the dropped tail of less
than one micro batch per rank, how the epoch's step count follows). Same world size: exactly the resume above.

Sample log: with `DS_CORE_SAMPLE_LOG=<dir>` set, each rank appends {"epoch", "indices"} per yielded micro batch to
`<dir>/rank{r}.jsonl` (ds_core.outputs.sample_log); an index is the sample's position in the concatenation of the sorted
training files (file i's row k is sum(sizes of files before i) + k), the same on any world size.
"""
from __future__ import annotations

import bisect
import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from ds_core.outputs.sample_log import SampleLog

from .data_resize import Piece, deal, starts_of, unconsumed, whole
from .shards import DataDirError, ShardError, check_arrays, inspect_shards, list_shards, read_rows

# torch is imported where batches are built, so `bert-prep` (which shares the layout checks) starts fast
if TYPE_CHECKING:
    import torch

# Label value for every position that is not a masked token. -100 is the default `ignore_index` of
# torch.nn.CrossEntropyLoss and what transformers' BertForPreTraining expects, so labels go straight into the HF model
# or a plain cross entropy without a custom loss. (NVIDIA's recipe used -1 with `ignore_index=-1`; we don't.)
IGNORE_INDEX = -100

DEFAULT_BLOCK_SAMPLES = 1 << 18  # 262144 samples of seq 128 ~ 250 MB in memory; at most two blocks are held


class DataStateError(ValueError):
    """A saved data position does not fit this dataset / world size."""


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


def resized_plan(sizes: dict[str, int], epoch: int, seed: int, history: list[dict], rank: int, world_size: int,
                 micro_batch: int) -> tuple[list[Piece], int]:
    """(pieces, batches) of `rank` of `world_size` for the rest of `epoch` after `history` (pure; see data_resize).

    history: the plans the epoch went through, oldest first, each {"world_size", "micro_batch", "samples": [consumed
    on each rank]}; the first is a normal plan and also holds its "block_samples"."""
    h0 = history[0]
    w, b = int(h0["world_size"]), int(h0["micro_batch"])
    plans = [whole(plan_segments(sizes, r, w, epoch, seed, int(h0["block_samples"]))) for r in range(w)]
    pool = unconsumed(plans, h0["samples"], batches_per_epoch(sizes, w, epoch, seed, b) * b)
    for h in history[1:]:
        plans, nb = deal(pool, int(h["world_size"]), int(h["micro_batch"]))
        pool = unconsumed(plans, h["samples"], nb * int(h["micro_batch"]))
    plans, nb = deal(pool, world_size, micro_batch)
    return plans[rank], nb


# --------------------------------------------------------------------------------------------- batch building
def load_block(seg: Segment, seq_len: int, vocab_size: int | None = None) -> dict[str, np.ndarray]:
    """One h5 slice per dataset for the block's sample range, content-checked (ids < vocab_size when given)."""
    import h5py

    try:
        f = h5py.File(seg.path, "r")
    except Exception as e:
        raise ShardError(seg.path, None, f"cannot open as HDF5 ({type(e).__name__}: {e})") from e
    with f:
        arrays = read_rows(seg.path, f, seg.start, seg.stop)
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
    """Per-rank BERT pretraining batches (implements ds_core.run.data.DataSource).

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
        files_sorted = sorted(self.sizes)
        # global sample index = offset of the file in the sorted concatenation + row (world-size independent)
        self._base = dict(zip(files_sorted, np.cumsum([0] + [self.sizes[f] for f in files_sorted[:-1]]).tolist()))
        self.sample_log = SampleLog(rank)
        self.epoch = 0
        self.samples_done = 0  # samples consumed on this rank in self.epoch (same on every rank)
        # plans self.epoch went through before this one (resumes on another world size); [] for a normal epoch
        self.history: list[dict] = []
        self._plans: dict[int, tuple[list[Piece], list[int], int]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._cache: dict[tuple, Future] = {}
        self._current: tuple | None = None
        self._lock = threading.Lock()
        if len(self) == 0:
            raise DataDirError(f"{self.input_dir}: {self.num_samples} samples in {len(self.files)} files give rank "
                               f"{rank} of {world_size} no full micro batch of {micro_batch}")

    # -- plan
    def _plan(self, epoch: int) -> tuple[list[Piece], list[int], int]:
        """(pieces of blocks, start sample of each piece, batches in the epoch) for this rank."""
        if epoch not in self._plans:
            if self.history and epoch == self.epoch:
                pieces, nb = resized_plan(self.sizes, epoch, self.seed, self.history, self.rank, self.world_size,
                                          self.micro_batch)
            else:
                pieces = whole(plan_segments(self.sizes, self.rank, self.world_size, epoch, self.seed,
                                             self.block_samples))
                nb = batches_per_epoch(self.sizes, self.world_size, epoch, self.seed, self.micro_batch)
            self._plans = {k: v for k, v in self._plans.items() if k >= epoch - 1}
            self._plans[epoch] = (pieces, starts_of(pieces), nb)
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
            except BaseException as e:  # noqa: BLE001 - surfaced by .result() in the consumer, like the threaded path
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
        pieces = self._plan(epoch)[0]
        for p in pieces[block + 1:]:
            if p.seg != pieces[block].seg:  # a dealt plan may read two ranges of one block in a row
                return p.seg, epoch
        nxt = self._plan(epoch + 1)[0]  # first block of the next epoch
        return (nxt[0].seg, epoch + 1) if nxt else None

    # -- DataSource
    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.samples_done = int(epoch), 0
        if self.history:  # a new epoch starts from a normal plan at this world size
            self.history, self._plans = [], {}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch, B = self.epoch, self.micro_batch
        pieces, starts, nb = self._plan(epoch)
        end = nb * B
        while self.samples_done < end and self.epoch == epoch:
            s = self.samples_done
            parts, need, index = [], B, []
            while need:
                b = bisect.bisect_right(starts, s) - 1
                piece = pieces[b]
                arrays, perm = self._get(piece.seg, epoch)
                nxt = self._next_block(epoch, b)
                if nxt is not None:
                    self._prefetch(*nxt)
                off = piece.lo + s - starts[b]
                take = min(need, piece.hi - off)
                rows = perm[off:off + take]
                parts.append(make_batch(arrays, rows))
                if self.sample_log:
                    index.append(self._base[piece.seg.path] + piece.seg.start + rows)
                s, need = s + take, need - take
            self.samples_done = s
            if self.sample_log:
                self.sample_log.write(epoch, np.concatenate(index).tolist())
            yield _concat(parts)

    def position(self) -> dict:
        """Where the next batch starts on this rank: file, block and offset (for logs and the checkpoint)."""
        pieces, starts, nb = self._plan(self.epoch)
        s = self.samples_done
        if s >= nb * self.micro_batch:
            return {"file": None, "range_start": None, "block_start": None, "offset_in_block": None,
                    "offset_in_range": None}
        b = bisect.bisect_right(starts, s) - 1
        segs = [p.seg for p in pieces]
        first = b  # first block of this file's range: the offset in the range counts from there
        while first > 0 and segs[first - 1].path == segs[b].path and segs[first - 1].stop == segs[first].start:
            first -= 1
        return {"file": Path(segs[b].path).name, "range_start": segs[first].start, "block_start": segs[b].start,
                "offset_in_block": pieces[b].lo + s - starts[b], "offset_in_range": s - starts[first]}

    def state_dict(self) -> dict:
        """JSON-able position after the last yielded batch. `samples` (consumed in `epoch`) is what a resume uses and
        is the same on every rank; file order / file / offsets are this rank's view of it, for people and logs.
        `history`: the plans this epoch went through before a resume on another world size ([] normally)."""
        if self.history:
            files = list(dict.fromkeys(Path(p.seg.path).name for p in self._plan(self.epoch)[0]))
        else:
            files = [Path(p).name for p in assign_shards(self.files, self.rank, self.world_size, self.epoch,
                                                         self.seed)]
        return {"version": 2, "epoch": self.epoch, "samples": self.samples_done,
                "batches": self.samples_done // self.micro_batch, "micro_batch": self.micro_batch,
                "world_size": self.world_size, "rank": self.rank, "seed": self.seed,
                "block_samples": self.block_samples, "history": self.history,
                "fingerprint": self.fingerprint, "file_order": files, **self.position()}

    def _check(self, state: dict, keys: tuple[str, ...]) -> None:
        mine = {"fingerprint": self.fingerprint, "world_size": self.world_size, "seed": self.seed}
        for key in keys:
            if state.get(key) != mine[key]:
                raise DataStateError(
                    f"saved data position has {key}={state.get(key)!r} but this run has {mine[key]!r} "
                    f"({self.input_dir}); exact resume needs the same shards, world size and data seed"
                    + (" (another world size: give the states of all ranks to load_state_dicts)"
                       if key == "world_size" else ""))
        epoch, samples = int(state["epoch"]), int(state["samples"])
        if samples < 0 or epoch < 0:
            raise DataStateError(f"saved data position epoch {epoch}, sample {samples} is invalid")

    def load_state_dict(self, state: dict) -> None:
        """Seek to a saved position of this world size. The position is the same on every rank, so any rank's state
        fits any rank."""
        self._check(state, ("fingerprint", "world_size", "seed"))
        epoch, samples = int(state["epoch"]), int(state["samples"])
        history = list(state.get("history") or [])
        block_samples = int(state.get("block_samples", self.block_samples))
        if (history and int(state["micro_batch"]) != self.micro_batch) or \
                (not history and block_samples != self.block_samples):
            # the saved plan is not the one this loader would make (a dealt plan depends on the micro batch, a
            # normal one on the block size): continue from what it consumed, as after a resize. Every rank consumed
            # `samples` (the loop keeps them in step), so this one state describes all of them.
            self._resume_from(epoch, history + [self._entry(state, [samples] * self.world_size, not history)])
            return
        self.epoch, self.history, self._plans = epoch, history, {}
        # positions are in samples, so a changed micro batch still resumes at the same sample (clamped: an epoch
        # that ended under the old micro batch stays ended)
        end = self._plan(epoch)[2] * self.micro_batch
        self.samples_done = min(samples, end)
        self._prefetch_position()

    def load_state_dicts(self, states: list[dict]) -> None:
        """Resume from the saved states of ALL ranks of a checkpoint, in rank order, at this or another world size.

        Same world size (and plan): `load_state_dict(states[self.rank])`, i.e. exactly today's resume. Otherwise the
        samples the saved ranks had not consumed in the epoch are dealt to this run's ranks (bert_ref.data_resize);
        this rank takes its share and the epoch's length follows from it."""
        if not states:
            raise DataStateError(f"{self.input_dir}: no saved data state to resume from")
        for i, st in enumerate(states):
            self._check(st, ("fingerprint", "seed"))
            where = f"saved data state {i} of {len(states)}"
            if int(st.get("world_size", -1)) != len(states):
                raise DataStateError(f"{where} has world_size={st.get('world_size')!r}, expected {len(states)} "
                                     "(the states of every rank of one checkpoint, in rank order)")
            if int(st.get("rank", i)) != i:
                raise DataStateError(f"{where} has rank={st.get('rank')!r}, expected {i} (states in rank order)")
            for key in ("epoch", "history", "micro_batch", "block_samples"):
                if st.get(key) != states[0].get(key):
                    raise DataStateError(f"{where} has {key}={st.get(key)!r} but rank 0's has "
                                         f"{states[0].get(key)!r}: not one checkpoint")
        if len(states) == self.world_size:
            self.load_state_dict(states[self.rank])
            return
        history = list(states[0].get("history") or [])
        self._resume_from(int(states[0]["epoch"]),
                          history + [self._entry(states[0], [int(st["samples"]) for st in states], not history)])

    def _entry(self, state: dict, samples: list[int], first: bool) -> dict:
        out = {"world_size": int(state["world_size"]), "micro_batch": int(state["micro_batch"]), "samples": samples}
        if first:  # the normal plan's blocks
            out["block_samples"] = int(state.get("block_samples", self.block_samples))
        return out

    def _resume_from(self, epoch: int, history: list[dict]) -> None:
        self.epoch, self.history, self._plans, self.samples_done = epoch, history, {}, 0
        try:
            self._plan(epoch)
        except ValueError as e:  # counts outside the saved plan's epoch: not a position of that plan
            raise DataStateError(f"{self.input_dir}: saved data position of epoch {epoch} does not fit its plan "
                                 f"({e}); history {history}") from None
        self._prefetch_position()

    def _prefetch_position(self) -> None:
        pieces, starts, nb = self._plan(self.epoch)
        if self.samples_done < nb * self.micro_batch:  # start reading the block we resume in right away
            self._prefetch(pieces[bisect.bisect_right(starts, self.samples_done) - 1].seg, self.epoch)

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
        except Exception:  # noqa: BLE001 - a finalizer must not raise (at interpreter exit, anything may be torn down)
            pass


def build_data(input_dir: str | os.PathLike, rank: int, world_size: int, micro_batch: int,
               seed: int = 42, **kwargs) -> PretrainingData:
    """The loader for `input_dir`; DataDirError (a FileNotFoundError) if the directory is missing or has no shard."""
    if not input_dir or not Path(input_dir).is_dir():
        raise DataDirError(f"BERT data directory not found: {input_dir!r} (make one with `bert-prep shards`)")
    return PretrainingData(input_dir, rank, world_size, micro_batch, seed=seed, **kwargs)
