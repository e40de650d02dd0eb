"""One batch plan and one batch assembly for every BridgeTower image pipeline.

The host DataLoader path, the CPU/CUDA device decoders (data.py) and the HPU media pipe (hpu_media.py) all take
their batches from a `BatchPlan` and turn decoded rows into the batch dict with one `BatchAssembler`; neither reads
the other's state.

Plan (pure, numpy only; tested without DeepSpeed):
- `epoch_order`: the epoch's GLOBAL sample order (seed + epoch permutation for training, identity for evaluation).
  It does not depend on the world size.
- Training: the order is trimmed so every rank has n // world rows; rank r takes positions r, r + W, r + 2W, ...
  After k micro batches on every rank the ranks together have consumed exactly the first k * B * W positions of the
  global order, so the saved position (`sample_offset`) is a point in that world-size-independent order.
- Resume on another world size W' (or micro batch B'): the epoch's rest is the window [sample_offset, end) of the
  global order, `end` being where the saved plan's epoch ends (`epoch_end`: its trimmed and dropped rows excluded).
  The window is dealt exactly like a whole epoch (`rank_batches(epoch, window)`): trimmed to W' x (len // W') rows,
  rank r' takes positions r', r' + W', ..., a last one-row batch dropped. So the position stays a prefix of the
  global order (window start + k * B' * W'), every rank runs the same number of batches (len(window) // W' / B',
  rounded up), and fewer than 2 x W' rows of the window are dropped: the trim (< W') and the one-row tails (W'), as a
  whole epoch drops them. A later resume in the same epoch windows again; the next epoch is whole.
- Evaluation: the order is cut into micro batches first, and batch c goes to rank c mod W. Batch composition, and so
  the in-batch-negatives loss of every batch, is therefore the same on any number of ranks: eval loss depends on
  the eval micro batch size, never on the world size.
- A batch of one row has no negative: its contrastive loss is exactly 0. Training drops such a last batch (every
  rank has the same share, so all drop it together); evaluation rebalances it with the batch before (every row is
  still ranked for recall and weighs in the loss).

Assembly: `BatchAssembler.assemble` filters the rows that did not decode, applies the padding policy (decided once
by `pad_to_max_length`), moves to the device and, on several ranks during training, keeps the last good batch for
`fill_in` (a batch whose rows are all bad still has to run a step, or the other ranks would wait in a collective).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from . import log
from .images import BadImage

MIN_CONTRASTIVE_ROWS = 2  # one row has no in-batch negative: its ITC loss is exactly 0
MAX_BAD_EXAMPLES = 10


# ---------------------------------------------------------------------------------------------------- plan
def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """The epoch's global sample order; the same for every world size."""
    return np.random.default_rng(seed + epoch).permutation(n) if shuffle else np.arange(n)


def split_batches(rows: np.ndarray, micro_batch: int, *, drop_small: bool) -> list[np.ndarray]:
    """Consecutive micro batches of `rows`. A last batch with fewer than MIN_CONTRASTIVE_ROWS rows is dropped
    (drop_small: training) or, for evaluation, rebalanced with the batch before it: [B-1, 2] rows when B >= 3 (no
    batch exceeds B: the HPU media pipe has a fixed batch size), one batch of 3 when B == 2. With micro_batch 1
    every batch has one row and is kept (only global negatives can train on that)."""
    batches = [rows[i:i + micro_batch] for i in range(0, len(rows), micro_batch)]
    if micro_batch < MIN_CONTRASTIVE_ROWS or not batches or len(batches[-1]) >= MIN_CONTRASTIVE_ROWS:
        return batches
    if drop_small:
        return batches[:-1]
    if len(batches) == 1:
        return batches  # the whole split is one row: nothing to pair it with
    prev, last = batches[-2], batches[-1]
    if micro_batch >= MIN_CONTRASTIVE_ROWS + 1:
        batches[-2:] = [prev[:-1], np.concatenate([prev[-1:], last])]
    else:
        batches[-2:] = [np.concatenate([prev, last])]
    return batches


@dataclass(frozen=True)
class BatchPlan:
    """Which rows each micro batch of one rank holds, per epoch, and the position <-> global-order mapping."""

    rows: int
    rank: int
    world_size: int
    micro_batch: int
    seed: int
    train: bool

    def __post_init__(self):
        if self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {self.micro_batch}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        if self.train and self.rows < self.world_size:
            raise ValueError(f"{self.rows} training rows < world size {self.world_size}")

    def order(self, epoch: int) -> np.ndarray:
        return epoch_order(self.rows, epoch, self.seed, self.train)

    def _global_batches(self, epoch: int) -> list[np.ndarray]:
        """Evaluation: the split's micro batches in global order (rank c mod W runs batch c)."""
        return split_batches(self.order(epoch), self.micro_batch, drop_small=False)

    def _window(self, window: tuple[int, int] | None) -> tuple[int, int]:
        if window is None:
            return 0, self.rows
        if not self.train:
            raise ValueError("evaluation plans are not resumed: no window")
        lo, hi = int(window[0]), int(window[1])
        if not 0 <= lo <= hi <= self.rows:
            raise ValueError(f"window [{lo}, {hi}) outside the {self.rows} rows of the epoch's global order")
        return lo, hi

    def rank_batches(self, epoch: int, window: tuple[int, int] | None = None) -> list[np.ndarray]:
        """This rank's micro batches for the epoch (arrays of dataset rows); `window`: only positions [lo, hi) of
        the epoch's global order (the rest of an epoch resumed on another world size), dealt like a whole epoch."""
        if not self.train:
            return self._global_batches(epoch)[self.rank::self.world_size]
        lo, hi = self._window(window)
        per = (hi - lo) // self.world_size
        mine = self.order(epoch)[lo:lo + per * self.world_size][self.rank::self.world_size]
        return split_batches(mine, self.micro_batch, drop_small=True)

    def sample_offset(self, epoch: int, batches_done: int, window: tuple[int, int] | None = None) -> int:
        """Global position after every rank ran `batches_done` batches: how many leading samples of the epoch's
        global order have been consumed."""
        if not self.train:
            return int(sum(len(b) for b in self._global_batches(epoch)[:batches_done * self.world_size]))
        lo, hi = self._window(window)
        per = (hi - lo) // self.world_size
        return lo + min(batches_done * self.micro_batch, per) * self.world_size

    def epoch_end(self, epoch: int, window: tuple[int, int] | None = None) -> int:
        """Where this plan's epoch ends in the global order: the offset after its last batch (rows after it are the
        trimmed / dropped tail the plan never trains on in this epoch)."""
        return self.sample_offset(epoch, len(self.rank_batches(epoch, window)), window)

    def batches_done(self, epoch: int, sample_offset: int, window: tuple[int, int] | None = None) -> int:
        """Inverse of sample_offset for this plan's world size; a position that is not a batch boundary here is
        refused with the numbers (it would need re-planning the rest of the epoch)."""
        n_batches = len(self.rank_batches(epoch, window))
        for k in range(n_batches + 1):
            if self.sample_offset(epoch, k, window) == sample_offset:
                return k
        raise ValueError(f"data position {sample_offset} (samples of epoch {epoch}'s global order) is not a micro "
                         f"batch boundary for world size {self.world_size} x micro batch {self.micro_batch} "
                         f"over {self.rows} rows" + (f" in window {list(window)}" if window else ""))


def resume_window(states: list[dict], rows: int, seed: int) -> tuple[int, tuple[int, int]]:
    """(epoch, window) left to train on after the saved training states of ALL ranks of a checkpoint (rank order):
    [sample_offset, where the saved plan's epoch ends). Every rank saved the same global position; one that does not
    is refused, naming the field."""
    if not states:
        raise ValueError("no saved data state to resume from")
    first = states[0]
    for key, now in (("rows", rows), ("seed", seed)):
        if first.get(key) != now:
            raise ValueError(f"data position was saved with {key} {first.get(key)}, this run has {now}: the "
                             "epoch's order differs, the position cannot be restored")
    for i, st in enumerate(states):
        if int(st.get("world_size", -1)) != len(states):
            raise ValueError(f"saved data state {i} of {len(states)} has world_size={st.get('world_size')!r}, "
                             f"expected {len(states)} (the states of every rank of one checkpoint, in rank order)")
        for key in ("epoch", "sample_offset", "window", "micro_batch", "rows", "seed"):
            if st.get(key) != first.get(key):
                raise ValueError(f"saved data state {i} of {len(states)} has {key}={st.get(key)!r} but rank 0's "
                                 f"has {first.get(key)!r}: not one checkpoint")
    if "sample_offset" not in first:
        raise ValueError("saved data position has no global sample_offset (saved before it existed): it can only "
                         "be resumed on the world size that saved it")
    saved = BatchPlan(rows, 0, len(states), int(first["micro_batch"]), seed, train=True)
    epoch, window = int(first["epoch"]), first.get("window")
    offset, end = int(first["sample_offset"]), saved.epoch_end(int(first["epoch"]), window)
    start = saved.sample_offset(epoch, 0, window)
    if not start <= offset <= end:
        raise ValueError(f"saved data position {offset} is outside its epoch's plan [{start}, {end}] of {rows} rows")
    return epoch, (offset, end)


# ---------------------------------------------------------------------------------------------------- padding
def pad_to_max_length(requested: bool, device: torch.device | str) -> bool:
    """THE caption padding policy: pad to max_seq_length when asked, and always on HPU (a graph per shape, and the
    media pipe's reader has fixed output shapes); otherwise to the batch's longest caption."""
    return bool(requested) or torch.device(device).type == "hpu"


def tokenize(tokenizer, captions: Sequence[str], max_len: int, pad_to_max: bool) -> dict[str, torch.Tensor]:
    enc = tokenizer(list(captions), truncation=True, max_length=max_len, return_tensors="pt",
                    padding="max_length" if pad_to_max else "longest")
    return {"input_ids": enc["input_ids"].long(), "attention_mask": enc["attention_mask"].long()}


# ---------------------------------------------------------------------------------------------------- bad images
class BadImageLog:
    """Counts distinct bad images (or raises on the first, `--bad_image error`) and keeps the first few for the
    summary. Distinct: an image that is bad in every epoch (or every evaluation) counts once, so the count is that
    of one epoch, whatever the number of epochs (CaptionData.distinct_bad_images takes the union over ranks)."""

    def __init__(self, mode: str, rank: int = 0):
        self.mode, self.rank = mode, rank
        self.seen: set[str] = set()
        self._unnamed = 0  # restored from a checkpoint saved before names were kept
        self.examples: list[str] = []

    @property
    def count(self) -> int:
        return self._unnamed + len(self.seen)

    def restore(self, names: Sequence[str] | None, count: int = 0) -> None:
        """The state saved in a checkpoint: the bad images' names (and the count, for states without names)."""
        self.seen = set(names or ())
        self._unnamed = max(0, int(count or 0) - len(self.seen))

    def record(self, bad: Sequence[tuple[str, str]]) -> None:
        for name, reason in bad:
            if self.mode == "error":
                raise BadImage(name, reason + " (--bad_image error; use --bad_image skip to drop such images)")
            if name in self.seen:
                continue
            self.seen.add(name)
            entry = f"{name}: {reason}"
            if len(self.examples) < MAX_BAD_EXAMPLES and entry not in self.examples:
                self.examples.append(entry)
                log.say(f"rank {self.rank} skipping bad image {entry}", every_rank=True, stderr=True)


# ---------------------------------------------------------------------------------------------------- assembly
class BatchAssembler:
    """Decoded rows -> the batch dict every pipeline yields: the model's inputs on `device` (input_ids [B,T] long,
    attention_mask [B,T] long, pixel_values [B,3,S,S] float32, pixel_mask [B,S,S] long) and its bookkeeping on the
    host (index [B] long: dataset row, -1 for fill-in rows, which metrics ignore; caption_tokens [B] long: each
    row's non-padding tokens). The step counts samples and tokens from the host tensors: read back from an
    accelerator, each count would stop the host until the device caught up, every step.

    `min_rows`: fewer valid rows than this make no batch (training: 2, so a batch shrunk to one row by bad images
    does not train on a loss of exactly 0; evaluation: 1, every valid row is ranked).
    `first_valid()` supplies a fill-in batch before any good batch was seen (several ranks, training).
    """

    def __init__(self, *, size: int, device: torch.device | str, world_size: int, pad_to_max: bool, min_rows: int,
                 fill_in: bool, bad: BadImageLog, first_valid: Callable[[], dict]):
        self.size, self.device = size, torch.device(device)
        self.world_size, self.pad_to_max, self.min_rows = world_size, pad_to_max, min_rows
        self.fill_in_enabled = fill_in and world_size > 1
        self.bad, self.first_valid = bad, first_valid
        self.filler_batches = 0
        self._last_good: dict | None = None

    def assemble(self, pixel_values: torch.Tensor | None, keep: Sequence[int], tokens: dict[str, torch.Tensor],
                 index: torch.Tensor, bad: Sequence[tuple[str, str]] = (), *, remember: bool = True) -> dict | None:
        """pixel_values: [len(keep),3,S,S] float32 (any device) of the decoded rows; keep: their positions among
        the candidate rows that `tokens` ([N,T]) and `index` ([N]) describe; bad: (name, reason) of rows dropped on
        the way. Returns None when fewer than min_rows rows are valid."""
        self.bad.record(bad)
        if pixel_values is None or len(keep) < self.min_rows:
            return None
        n = index.shape[0]
        sel = None if list(keep) == list(range(n)) else torch.as_tensor(list(keep), dtype=torch.long)
        ids, mask, index = (t if sel is None else t[sel] for t in (tokens["input_ids"], tokens["attention_mask"],
                                                                   index))
        if not self.pad_to_max and sel is not None:
            # Rows were dropped: the policy pads to the longest caption of the batch, so cut the columns that only
            # the dropped rows needed.
            width = max(1, int(mask.sum(dim=1).max().item()))
            ids, mask = ids[:, :width], mask[:, :width]
        batch = {"input_ids": ids.to(self.device, non_blocking=True),
                 "attention_mask": mask.to(self.device, non_blocking=True),
                 "index": index.to("cpu", torch.long), "caption_tokens": mask.to("cpu").sum(dim=1),
                 "pixel_values": pixel_values.to(self.device, torch.float32, non_blocking=True),
                 "pixel_mask": torch.ones((len(keep), self.size, self.size), dtype=torch.long, device=self.device)}
        if remember and self.fill_in_enabled:
            self._last_good = batch
        return batch

    def fill_in(self) -> dict | None:
        """Stand-in for a training batch without enough valid rows: None on one rank (skip it); on several ranks
        the last good batch again with index -1 (the loss is that of real, already-seen samples; they count as 0
        samples), so every rank runs the same number of steps."""
        if not self.fill_in_enabled:
            return None
        if self._last_good is None:
            self._last_good = self.first_valid()
        return self._as_filler(self._last_good)

    def stand_in(self) -> dict:
        """A batch that only keeps this rank in step (index -1 everywhere: no metric counts it), e.g. for a rank
        whose evaluation share is empty while the others still run forwards."""
        return self._as_filler(self.first_valid())

    def _as_filler(self, batch: dict) -> dict:
        self.filler_batches += 1
        out = dict(batch)
        out["index"] = torch.full_like(out["index"], -1)
        return out
