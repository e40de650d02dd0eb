"""Continuing a BERT data epoch on another number of ranks (pure functions; bert_ref.data uses them).

Within an epoch, rank r of W reads a sequence of blocks (data.plan_segments), each visited in its own seeded order
(data.block_permutation), and every rank consumes the same number of samples of its sequence. So the set of samples
consumed so far is a pure function of (W, micro batch, block size, samples consumed per rank), and so is the rest.

A rank's plan is a list of `Piece`s: a block and a range [lo, hi) of positions in the block's visiting order. A
normal epoch uses whole blocks (lo = 0, hi = size); nothing else changes, so a same-world-size resume is today's.

On resume at W' ranks (`history` = the plans this epoch went through, with the samples each rank consumed):
  1. the pool: for every old rank in rank order, the unconsumed part of its sequence up to the epoch's end at the
     old size (the samples the uninterrupted run would still have trained on this epoch), in its reading order. A
     partially read block contributes the rest of its visiting order;
  2. the deal: the pool is cut into W' consecutive equal ranges of n' = (len(pool) // W') // B' * B' samples (B':
     the micro batch); rank r' reads range r'. Every rank yields n' / B' batches (the epoch's step count follows),
     and the last len(pool) - W' * n' samples (< W' * B', i.e. less than one micro batch per rank) are dropped, as a
     normal epoch drops every rank's tail beyond the smallest share. Ranges are consecutive in the pool, so each
     rank still reads whole blocks (or one sub-range of a block's order): no per-sample access across files.
  3. a later resume in the same epoch (another resize, or the same size) appends the dealt plan to the history and
     repeats 1-2 from it. A new epoch starts from a normal plan at the current size.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Piece:
    seg: Any  # a data.Segment (anything with .size)
    lo: int  # positions [lo, hi) of the block's visiting order
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


def whole(segs: Sequence) -> list[Piece]:
    return [Piece(s, 0, s.size) for s in segs]


def starts_of(pieces: Sequence[Piece]) -> list[int]:
    """Sample position in the rank's sequence at which each piece starts."""
    out, s = [], 0
    for p in pieces:
        out.append(s)
        s += p.size
    return out


def slice_pieces(pieces: Sequence[Piece], a: int, b: int) -> list[Piece]:
    """The pieces covering sequence positions [a, b), cut at both ends."""
    starts = starts_of(pieces)
    out = []
    i = max(0, bisect.bisect_right(starts, a) - 1)
    while i < len(pieces) and starts[i] < b:
        p, s = pieces[i], starts[i]
        lo, hi = max(a, s) - s, min(b, s + p.size) - s
        if hi > lo:
            out.append(Piece(p.seg, p.lo + lo, p.lo + hi))
        i += 1
    return out


def unconsumed(plans: Sequence[Sequence[Piece]], done: Sequence[int], end: int) -> list[Piece]:
    """The pool: each rank's pieces from its consumed count to the epoch's end, ranks in order."""
    if len(done) != len(plans):
        raise ValueError(f"{len(done)} consumed counts for {len(plans)} ranks")
    pool: list[Piece] = []
    for pieces, d in zip(plans, done):
        if not 0 <= d <= end:
            raise ValueError(f"consumed samples {d} outside the epoch's [0, {end}] per rank")
        pool.extend(slice_pieces(pieces, d, end))
    return pool


def deal(pool: Sequence[Piece], world_size: int, micro_batch: int) -> tuple[list[list[Piece]], int]:
    """(each rank's pieces, batches per rank): consecutive equal ranges of the pool, tail < world x micro dropped."""
    total = sum(p.size for p in pool)
    batches = total // world_size // micro_batch
    n = batches * micro_batch
    return [slice_pieces(pool, r * n, (r + 1) * n) for r in range(world_size)], batches
